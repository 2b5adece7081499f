"""The Docker deployment (docker/, docs/deployment.md), checked offline.

No Docker engine is needed: the compose files are loaded with PyYAML, the overlays merged
onto the base the way Compose merges them (``command``/``entrypoint`` replaced whole,
``volumes`` merged by target, mappings merged key by key), and every Flower command line is
checked against the installed Flower 1.39 console scripts (their ``--help`` output and their
real argument parsers). Where a ``docker compose`` CLI exists, it must accept every file
combination and merge it exactly as this module does.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from flatflower.client.node import NodeSettings

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
BASE = DOCKER / "compose.yml"
TLS = DOCKER / "compose.tls.yml"
GPU = DOCKER / "compose.gpu.yml"
DOCS = ROOT / "docs" / "deployment.md"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.superexec", "cuda": DOCKER / "Dockerfile.superexec-cuda"}
LOCAL_BASE = DOCKER / "compose.local-base.yml"  # stand-ins where Docker Hub is out of reach
FLWR_LOCAL = DOCKER / "Dockerfile.flwr-local"

COMBOS = {
    "base": (BASE,),
    "tls": (BASE, TLS),
    "gpu": (BASE, GPU),
    "tls+gpu": (BASE, TLS, GPU),
}
# Flower's programs, and flatflower's warm ClientApp worker (runtime/worker.py), which replaces
# flower-superexec as each SuperNode's ClientApp executor
WORKER = "flatflower-worker"
FLOWER_PROGRAMS = ("flower-superlink", "flower-supernode", "flower-superexec", WORKER)
# The ENTRYPOINT of Flower's official images.
IMAGE_ENTRYPOINTS = {
    "flwr/superlink": ["flower-superlink"],
    "flwr/supernode": ["flower-supernode"],
    "flwr/superexec": ["flower-superexec"],
}
# Their argument parsers (private in Flower, so the test that uses them skips if they move).
PARSERS = {
    "flower-superlink": ("flwr.superlink.cli.flower_superlink", "_parse_args_run_superlink"),
    "flower-supernode": ("flwr.supernode.cli.flower_supernode", "_parse_args_run_supernode"),
    "flower-superexec": ("flwr.supercore.cli.flower_superexec", "_parse_args"),
    WORKER: ("flatflower.runtime.worker", "build_parser"),
}
APP_UID = "49999"  # user `app` in every Flower image


# ------------------------------------------------------------------------------ helpers
def flwr_pin() -> str:
    """The Flower version pinned in pyproject.toml (``flwr[simulation]==X``)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.fullmatch(r"flwr(?:\[[^\]]*\])?==([\w.]+)", d))]
    assert len(pins) == 1, f"pyproject.toml must pin flwr exactly once (==X): {deps}"
    return pins[0]


FLWR_VERSION = flwr_pin()
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation: ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(match: re.Match) -> str:
        name, op, default = match.group(1), match.group(2), match.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        if op in (":?", "?"):
            if not env.get(name):
                raise KeyError(f"${{{name}}} is required: {default}")
            return env[name]
        return env.get(name, "")

    return _VAR.sub(sub, value.replace("$$", "\0")).replace("\0", "$")


def load_yaml(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    return data


def volume_target(volume) -> str:
    if isinstance(volume, dict):
        return volume["target"]
    parts = volume.split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def volume_source(volume) -> str | None:
    if isinstance(volume, dict):
        return volume.get("source")
    parts = volume.split(":")
    return parts[0] if len(parts) > 1 else None


def _merge_mapping(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_mapping(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_service(base: dict, over: dict) -> dict:
    """One service of an overlay merged onto the base's, as Compose does."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key not in out or key in ("command", "entrypoint"):
            out[key] = copy.deepcopy(value)  # sequences that Compose replaces whole
        elif key == "volumes":
            by_target = {volume_target(v): v for v in out[key]}
            by_target.update({volume_target(v): copy.deepcopy(v) for v in value})
            out[key] = list(by_target.values())
        elif key == "depends_on" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = out[key] + [v for v in value if v not in out[key]]
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _merge_mapping(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_merged(files: tuple[Path, ...], env: dict[str, str] | None = None) -> dict:
    """The files merged in order, interpolated with ``env`` (defaults where unset)."""
    merged: dict = {"services": {}, "volumes": {}, "networks": {}}
    for path in files:
        data = interpolate(load_yaml(path), env or {})
        for name, service in (data.get("services") or {}).items():
            base = merged["services"].get(name)
            merged["services"][name] = service if base is None else merge_service(base, service)
        merged["volumes"].update(data.get("volumes") or {})
        merged["networks"].update(data.get("networks") or {})
    return merged


@functools.lru_cache(maxsize=None)
def dockerfile_entrypoint(dockerfile: Path) -> list[str]:
    entry = [line for line in dockerfile.read_text().splitlines() if line.startswith("ENTRYPOINT")]
    assert entry, f"{dockerfile} has no ENTRYPOINT"
    return json.loads(entry[-1].split(None, 1)[1])


@functools.lru_cache(maxsize=None)
def stand_in_entrypoints() -> dict[str, list[str]]:
    """flatflower-local/<target> -> the ENTRYPOINT of that target of Dockerfile.flwr-local."""
    out, target = {}, None
    for line in FLWR_LOCAL.read_text().splitlines():
        if line.startswith("FROM "):
            target = line.split()[-1]
        elif line.startswith("ENTRYPOINT"):
            out[f"flatflower-local/{target}"] = json.loads(line.split(None, 1)[1])
    return out


def build_dockerfile(service: dict) -> Path:
    build = service["build"]
    return (DOCKER / build["context"] / build.get("dockerfile", "Dockerfile")).resolve()


def argv(service: dict) -> list[str]:
    """The full command line a service's container runs (entrypoint + command)."""
    entrypoint = service.get("entrypoint")
    if entrypoint is None:
        if "build" in service:
            entrypoint = dockerfile_entrypoint(build_dockerfile(service))
        else:
            repo = service["image"].split(":")[0]
            entrypoint = IMAGE_ENTRYPOINTS.get(repo) or stand_in_entrypoints()[repo]
    command = service.get("command") or []
    entrypoint = shlex.split(entrypoint) if isinstance(entrypoint, str) else entrypoint
    command = shlex.split(command) if isinstance(command, str) else command
    return [str(x) for x in [*entrypoint, *command]]


def options(args: list[str]) -> dict[str, str | None]:
    """``--flag value`` / ``--flag=value`` / ``--flag`` -> {flag: value or None}; no repeats."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"stray argument {arg!r} in {args}"
        if "=" in arg:
            key, value = arg.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = arg, args[i + 1]
            i += 1
        else:
            key, value = arg, None
        assert key not in out, f"{key} given twice in {args}"
        out[key] = value
        i += 1
    return out


def flower_services(config: dict) -> dict[str, tuple[str, dict[str, str | None]]]:
    """service -> (Flower program, its options) for every service that runs Flower."""
    out = {}
    for name, service in config["services"].items():
        args = argv(service)
        if args[0] in FLOWER_PROGRAMS:
            out[name] = (args[0], options(args[1:]))
    return out


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def supernodes(config: dict) -> list[str]:
    names = sorted((n for n in config["services"] if re.fullmatch(r"supernode-\d+", n)),
                   key=lambda n: int(n.split("-")[1]))
    assert names, "no supernode-<i> services"
    return names


def node_config(opts: dict[str, str | None]) -> dict:
    from flwr.common.config import parse_config_args  # what flower-supernode itself uses

    assert opts.get("--node-config"), "SuperNode without --node-config"
    return parse_config_args([opts["--node-config"]])


def named_volume(service: dict, target: str) -> str:
    """The named volume mounted at ``target`` in ``service`` (fails for binds/anonymous)."""
    for volume in service.get("volumes") or []:
        if volume_target(volume) == target:
            source = volume_source(volume)
            assert source and not source.startswith((".", "/", "$", "~")), \
                f"{target} is not a named volume: {volume}"
            return source
    raise AssertionError(f"nothing is mounted at {target}: {service.get('volumes')}")


# --------------------------------------------------------------- the installed Flower CLIs
def _help_env(home: Path) -> dict[str, str]:
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0", "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


@pytest.fixture(scope="module")
def flower_help(tmp_path_factory):
    """``flower_help("flower-supernode")`` / ``flower_help("flwr run")``: the set of options in
    that installed command's ``--help`` (each command run once, in parallel, then cached)."""
    home = tmp_path_factory.mktemp("flwr_home")  # even --help creates $FLWR_HOME
    bindir = Path(sys.executable).parent
    cache: dict[str, frozenset[str]] = {}

    def run(command: str) -> frozenset[str]:
        words = command.split()
        exe = bindir / words[0]
        assert exe.exists(), f"{words[0]} is not installed next to {sys.executable}"
        # flatflower's own worker: this checkout's (the installed script may be another's)
        cmd = [sys.executable, "-m", "flatflower.runtime.worker"] if words[0] == WORKER else [str(exe)]
        proc = subprocess.run([*cmd, *words[1:], "--help"], capture_output=True, text=True,
                              timeout=180, env=_help_env(home), cwd=ROOT)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"`{command} --help` failed:\n{text}"
        return frozenset(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text))

    def get(command: str) -> frozenset[str]:
        if command not in cache:
            cache[command] = run(command)
        return cache[command]

    # the three SuperLink/SuperNode/SuperExec scripts and the flwr commands the docs use
    wanted = [*FLOWER_PROGRAMS, *sorted({c for c, _ in docs_commands() if c.startswith("flwr ")})]
    with ThreadPoolExecutor(max_workers=4) as pool:
        cache.update(zip(wanted, pool.map(run, wanted)))
    return get


def console_scripts() -> set[str]:
    """The console scripts of flwr, and flatflower's (pyproject.toml [project.scripts])."""
    dist = importlib.metadata.distribution("flwr")
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return {ep.name for ep in dist.entry_points if ep.group == "console_scripts"} | set(ours)


# ------------------------------------------------------------------------- the files
def test_installed_flower_is_the_pinned_version():
    assert importlib.metadata.version("flwr") == FLWR_VERSION


@pytest.mark.parametrize("path", [BASE, TLS, GPU, LOCAL_BASE], ids=lambda p: p.name)
def test_compose_files_use_only_known_top_level_keys(path):
    data = load_yaml(path)
    # no top-level `name` and no `create_host_path`: Compose v2 only; Debian's docker-compose
    # 1.29 (what `make test-docker` runs) rejects both. docker/.env names the project instead.
    assert set(data) <= {"services", "volumes", "networks", "secrets", "configs"} | {
        k for k in data if k.startswith("x-")}, set(data)
    assert "create_host_path" not in path.read_text()
    # every image reference pinned, none floating
    text = path.read_text()
    assert ":latest" not in text and "@latest" not in text


def test_project_name_comes_from_the_env_file():
    """Volumes are flatflower_runs, flatflower_data, ... (docs/deployment.md) with Compose v2 and
    v1 alike: both read COMPOSE_PROJECT_NAME from docker/.env, the project directory's."""
    env = dict(line.split("=", 1) for line in (DOCKER / ".env").read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    assert env == {"COMPOSE_PROJECT_NAME": "flatflower"}


def test_services_images_and_builds_exist():
    config = load_merged(COMBOS["base"])
    services = config["services"]
    names = supernodes(config)
    expected = {"superlink", "superexec-serverapp", "superlink-state-init", *names,
                *(f"superexec-clientapp-{n.split('-')[1]}" for n in names),
                *(f"app-secret-init-{n.split('-')[1]}" for n in names)}
    assert set(services) == expected
    for combo, files in COMBOS.items():
        for name, service in load_merged(files)["services"].items():
            image = service.get("image")
            assert image, f"{combo}: {name} has no image"
            repo, _, tag = image.partition(":")
            assert tag and tag != "latest", f"{combo}: {name}: image {image!r} is not pinned"
            if repo.startswith("flwr/"):
                assert repo in IMAGE_ENTRYPOINTS, f"{combo}: {name}: unknown Flower image {repo}"
                assert tag == FLWR_VERSION or tag.startswith(FLWR_VERSION + "-"), \
                    f"{combo}: {name}: {image} is not Flower {FLWR_VERSION}"
                assert "build" not in service, f"{name}: Flower's images are used as they are"
            else:
                assert "build" in service, f"{combo}: {name}: {image} is neither Flower's nor built"
                assert (DOCKER / service["build"]["context"]).resolve() == ROOT
                assert build_dockerfile(service).is_file(), build_dockerfile(service)


@pytest.mark.xdist_group("flower-help")  # one worker builds the module fixture once
@pytest.mark.parametrize("combo", COMBOS)
def test_flower_commands_are_real_scripts_with_real_flags(combo, flower_help):
    config = load_merged(COMBOS[combo])
    scripts = console_scripts()
    seen = set()
    for name, service in config["services"].items():
        args = argv(service)
        if name == "superlink-state-init":
            continue  # the one non-Flower command; test_superlink_state_volume_is_writable
        assert args[0] in FLOWER_PROGRAMS, f"{combo}: {name} runs {args[0]!r}"
        assert args[0] in scripts, f"{args[0]} is not a console script of flwr {FLWR_VERSION} or ours"
        used = {a.split("=", 1)[0] for a in args[1:] if a.startswith("-")}
        unknown = used - flower_help(args[0])
        assert not unknown, f"{combo}: {name}: {args[0]} has no {sorted(unknown)} in 1.39"
        options(args[1:])  # no repeated flags, no stray words
        seen.add(args[0])
    assert seen == set(FLOWER_PROGRAMS)


@pytest.mark.parametrize("combo", COMBOS)
def test_flower_commands_parse_with_the_real_parsers(combo):
    config = load_merged(COMBOS[combo])
    for name, service in config["services"].items():
        args = argv(service)
        if args[0] not in PARSERS:
            continue
        module, function = PARSERS[args[0]]
        try:
            parser = getattr(importlib.import_module(module), function)()
        except (ImportError, AttributeError) as err:
            pytest.skip(f"Flower's parser moved ({err}); the --help check still runs")
        try:
            parser.parse_args(args[1:])
        except SystemExit as err:
            raise AssertionError(f"{combo}: {name}: {args[0]} rejects {args[1:]}") from err


def test_superlink_ports_and_flags():
    config = load_merged(COMBOS["base"])
    program, opts = flower_services(config)["superlink"]
    assert program == "flower-superlink"
    assert opts["--isolation"] == "process", "ServerApps must run in superexec-serverapp"
    assert opts["--host"] == "0.0.0.0" and opts["--port"] == "8000"
    assert host_port(opts["--fleet-api-address"]) == ("0.0.0.0", 9092)
    assert "--disable-runtime-dependency-installation" in opts
    db_dir = str(Path(opts["--database"]).parent)
    assert named_volume(config["services"]["superlink"], db_dir) == "superlink-state"
    published = {}
    for port in config["services"]["superlink"]["ports"]:
        parts = str(port).split(":")
        assert len(parts) == 3, f"{port}: publish with an explicit host address"
        published[int(parts[2])] = parts[0]
    assert published == {8000: "127.0.0.1", 9092: "127.0.0.1"}, \
        "8000 and 9092 are published, on the host's loopback only by default"


def test_superlink_state_volume_is_writable_by_the_flower_user():
    services = load_merged(COMBOS["base"])["services"]
    init = services["superlink-state-init"]
    assert services["superlink"]["depends_on"]["superlink-state-init"]["condition"] == \
        "service_completed_successfully"
    assert str(init["user"]).split(":")[0] in ("0", "root")
    script = " ".join(argv(init))
    assert f"chown {APP_UID}:{APP_UID} /app/state" in script
    assert named_volume(init, "/app/state") == named_volume(services["superlink"], "/app/state")


@pytest.mark.parametrize("combo", COMBOS)
def test_supernodes_partitions_addresses_and_executors(combo):
    config = load_merged(COMBOS[combo])
    services = config["services"]
    flower = flower_services(config)
    _, link = flower["superlink"]
    fleet_port = host_port(link["--fleet-api-address"])[1]
    names = supernodes(config)
    n = len(names)
    partitions = []
    for name in names:
        i = name.split("-")[1]
        program, opts = flower[name]
        assert program == "flower-supernode"
        assert opts["--superlink"] == f"superlink:{fleet_port}", \
            f"{name} must reach the Fleet API (gRPC :{fleet_port}), not {opts['--superlink']}"
        assert opts["--superlink"] != f"superlink:{link['--port']}"
        assert opts["--isolation"] == "process"
        cfg = node_config(opts)
        settings = NodeSettings.from_node_config(cfg)  # the client's own validation
        assert settings.num_partitions == n, f"{name}: num-partitions must be {n}"
        partitions.append(settings.partition_id)
        assert settings.partition_id == int(i), f"{name} must hold partition {i}"

        # its own executor, connected to its runtime API
        executor_name = f"superexec-clientapp-{i}"
        executor = services[executor_name]
        exe_program, exe = flower[executor_name]
        assert exe_program == WORKER, "a warm worker runs the node's ClientApps (runtime/worker.py)"
        runtime_port = int(opts.get("--port") or 9094)
        # A shared network namespace (network_mode: service:supernode-<i>) strands the executor
        # when its SuperNode restarts (tested for real: make test-docker). By name, on a network.
        assert "network_mode" not in executor and "network_mode" not in services[name]
        assert opts["--host"] == "0.0.0.0"
        assert exe["--runtime-api-address"] == f"{name}:{runtime_port}"
        if "tls" in combo:  # the plain-HTTP runtime API on a network of the pair (+ SuperLink)
            private = f"node-{i}"
            assert private in config["networks"]
            assert services[name]["networks"] == [private] == executor["networks"]
            members = {n for n, s in services.items() if private in (s.get("networks") or [])}
            assert members == {name, executor_name, "superlink"}, members
        assert name in executor.get("depends_on", []), f"{executor_name} must start after {name}"

        # data-dir and state-dir are read by the ClientApp: volumes of the executor
        assert named_volume(executor, settings.data_dir) == "data"
        assert named_volume(executor, settings.state_dir) == f"client-state-{i}"
        assert all(volume_target(v).startswith("/app/certs/") or volume_target(v) == "/app/secret"
                   for v in services[name]["volumes"]), \
            f"{name} needs no data or state of its own, only its certificates and its secret"

        # the node's secret: made once, before the SuperNode starts, in a volume of the pair only
        secret = opts["--superexec-auth-secret-file"]
        assert secret == exe["--superexec-auth-secret-file"] == "/app/secret/app.secret"
        assert named_volume(services[name], "/app/secret") == f"app-secret-{i}" == \
            named_volume(executor, "/app/secret")
        init = services[f"app-secret-init-{i}"]
        assert argv(init) == [WORKER, "--create-secret", secret]
        assert named_volume(init, "/app/secret") == f"app-secret-{i}" and init["restart"] == "no"
        assert services[name]["depends_on"][f"app-secret-init-{i}"]["condition"] == \
            "service_completed_successfully"
    assert sorted(partitions) == list(range(n)), "partition ids 0..N-1, each once"


@pytest.mark.parametrize("combo", COMBOS)
def test_serverapp_executor_points_at_the_superlink_runtime_api(combo):
    config = load_merged(COMBOS[combo])
    flower = flower_services(config)
    _, link = flower["superlink"]
    program, exe = flower["superexec-serverapp"]
    assert program == "flower-superexec"
    assert exe["--runtime-api-address"] == f"superlink:{link['--port']}"
    service = config["services"]["superexec-serverapp"]
    assert "superlink" in service["depends_on"]
    assert named_volume(service, "/app/runs") == "runs"
    assert named_volume(service, "/app/data") == "data"
    assert not any(k.startswith("--allow-runtime-dependency") for _, o in flower.values() for k in o)


def test_named_volumes_and_each_clients_state_is_its_own():
    config = load_merged(COMBOS["base"])
    names = supernodes(config)
    state = [f"client-state-{n.split('-')[1]}" for n in names]
    secrets = [f"app-secret-{n.split('-')[1]}" for n in names]
    assert set(config["volumes"]) == {"superlink-state", "runs", "data", "record-key", *state, *secrets}
    users: dict[str, set[str]] = {}
    for name, service in config["services"].items():
        for volume in service.get("volumes") or []:
            source = volume_source(volume)
            if source in config["volumes"]:
                users.setdefault(source, set()).add(name)
    for volume in state:
        assert users[volume] == {f"superexec-clientapp-{volume.rsplit('-', 1)[1]}"}, users[volume]
    for volume in secrets:  # a node's secret: its SuperNode, its worker, the one-shot that made it
        i = volume.rsplit("-", 1)[1]
        assert users[volume] == {f"supernode-{i}", f"superexec-clientapp-{i}", f"app-secret-init-{i}"}
    assert users["runs"] == {"superexec-serverapp"}
    assert users["record-key"] == {"superexec-serverapp"}
    assert users["data"] == {"superexec-serverapp", *(f"superexec-clientapp-{n.split('-')[1]}"
                                                       for n in names)}


@pytest.mark.parametrize("combo", COMBOS)
def test_the_serverapps_record_key_outlives_its_container(combo):
    """The ServerApp seals every run directory's manifest under its record key
    (server/recordkey.py). In the container's own home, a recreated container (a new image, `up
    --force-recreate`) made a new key, and every resume of a run in the `runs` volume was
    refused as "sealed by another record key" until the operator said --trust-run-dir. The key
    is in a volume of its own: outside the run directories, only the ServerApp's, a folder the
    image makes (0700, `app`) so a fresh volume takes over its ownership."""
    from flatflower.server import recordkey

    config = load_merged(COMBOS[combo])
    service = config["services"]["superexec-serverapp"]
    key = service["environment"][recordkey.ENV]
    folder = str(Path(key).parent)
    assert named_volume(service, folder) == "record-key"
    assert not any(key.startswith(volume_target(v) + "/") for v in service["volumes"]
                   if volume_target(v) != folder), "the key lies in another volume (a run directory's?)"
    base = load_merged(COMBOS["base"])["services"]["superexec-serverapp"]["environment"]
    assert service["environment"] == base and set(base) > {recordkey.ENV}  # Flower's settings kept
    for dockerfile in DOCKERFILES.values():
        runs = [r for i, r in dockerfile_instructions(dockerfile) if i == "RUN" and folder in r]
        assert runs and re.search(rf"chmod 700 [^&]*{re.escape(folder)}", runs[0]), dockerfile


def test_insecure_only_in_the_base_file():
    base = flower_services(load_merged(COMBOS["base"]))
    assert all("--insecure" in opts for name, (_, opts) in base.items()
               if not name.startswith("app-secret-init-")), \
        "the base file is the insecure trial setup: every component says so"
    assert "INSECURE" in BASE.read_text()
    assert "--insecure" not in GPU.read_text()
    assert "--insecure" not in DOCKERFILES["cpu"].read_text() + DOCKERFILES["cuda"].read_text()

    for combo in ("tls", "tls+gpu"):
        config = load_merged(COMBOS[combo])
        services = config["services"]
        for name, (program, opts) in flower_services(config).items():
            if "--insecure" not in opts:
                continue
            # the only exception: a ClientApp executor talking to its own SuperNode on the
            # network of the two (and the SuperLink): node-<i>
            match = re.fullmatch(r"superexec-clientapp-(\d+)", name)
            assert match, f"{combo}: {name} still runs with --insecure"
            node = f"supernode-{match.group(1)}"
            assert services[name]["networks"] == [f"node-{match.group(1)}"] == services[node]["networks"]
            assert host_port(opts["--runtime-api-address"])[0] == node


@pytest.mark.parametrize("combo", ["tls", "tls+gpu"])
def test_tls_overlay_uses_the_flatflower_certs_layout(combo, tmp_path):
    from flatflower.runtime.certs import generate_certs

    n = len(supernodes(load_merged(COMBOS["base"])))
    files = generate_certs(tmp_path / "certs", nodes=n, hosts=["superlink"])
    produced = {p.relative_to(files.out_dir).as_posix() for p in files.all_paths()}
    config = load_merged(COMBOS[combo], env={"FLATFLOWER_CERTS": str(files.out_dir)})
    services = config["services"]
    flower = flower_services(config)

    def mounted(service: str, path: str) -> str:
        """``path`` in ``service`` is a read-only bind of a file that `flatflower certs` makes."""
        for volume in services[service].get("volumes") or []:
            if volume_target(volume) == path:
                assert isinstance(volume, dict) and volume.get("read_only"), volume
                # long syntax: a missing file fails `up` instead of becoming a directory
                # (Compose v1 and v2 alike; only short syntax creates missing host paths)
                assert volume["type"] == "bind", volume
                assert not volume.get("bind", {}).get("create_host_path"), volume
                source = Path(volume["source"])
                relative = source.relative_to(files.out_dir).as_posix()
                assert relative in produced and source.is_file(), relative
                return relative
        raise AssertionError(f"{service}: {path} is not mounted")

    _, link = flower["superlink"]
    assert "--enable-supernode-auth" in link
    assert mounted("superlink", link["--ssl-ca-certfile"]) == "ca.crt"
    assert mounted("superlink", link["--ssl-certfile"]) == "server.pem"
    assert mounted("superlink", link["--ssl-keyfile"]) == "server.key"
    _, server_exe = flower["superexec-serverapp"]
    assert mounted("superexec-serverapp", server_exe["--root-certificates"]) == "ca.crt"
    for name in supernodes(config):
        i = name.split("-")[1]
        _, opts = flower[name]
        assert mounted(name, opts["--root-certificates"]) == "ca.crt"
        assert mounted(name, opts["--auth-supernode-private-key"]) == f"nodes/node-{i}", \
            f"{name} must authenticate with its own key"
    # private keys only where they belong; the CA key nowhere
    for name, service in services.items():
        sources = {Path(str(volume_source(v))).name for v in service.get("volumes") or []}
        assert "ca.key" not in sources, name
        if name != "superlink":
            assert "server.key" not in sources, f"{name} must not hold the SuperLink's key"
        keys = {s for s in sources if re.fullmatch(r"node-\d+", s)}
        assert keys <= ({f"node-{name.split('-')[1]}"} if name.startswith("supernode-") else set())
    # the certificate covers the name the SuperNodes and the executor use
    san = files.hosts
    assert "superlink" in san and "127.0.0.1" in san
    health = " ".join(services["superlink"]["healthcheck"]["test"])
    assert "https://" in health and "/app/certs/ca.crt" in health


def test_overlays_keep_every_flag_they_do_not_mean_to_change():
    """Compose replaces `command`/`entrypoint` lists whole, so an overlay that sets one must
    repeat every flag of the base; only the security flags and the addresses may differ."""
    base = flower_services(load_merged(COMBOS["base"]))
    for combo in ("tls", "gpu", "tls+gpu"):
        merged = flower_services(load_merged(COMBOS[combo]))
        assert set(merged) == set(base)
        for name, (program, opts) in base.items():
            assert merged[name][0] == program
            other = merged[name][1]
            for flag, value in opts.items():
                if flag == "--insecure" and "tls" in combo:
                    continue
                assert flag in other, f"{combo}: {name} lost {flag}"
                if flag not in ("--host", "--runtime-api-address", "--node-config"):
                    assert other[flag] == value, f"{combo}: {name}: {flag} {other[flag]!r}"
            if "tls" not in combo:
                assert other == opts or name.startswith("supernode-"), (combo, name)


@pytest.mark.parametrize("combo", ["gpu", "tls+gpu"])
def test_gpu_overlay_reserves_nvidia_gpus_and_sets_cuda_device(combo):
    config = load_merged(COMBOS[combo])
    services = config["services"]
    flower = flower_services(config)
    for name in supernodes(config):
        i = name.split("-")[1]
        assert node_config(flower[name][1])["device"] == "cuda:0"
        executor = services[f"superexec-clientapp-{i}"]
        assert build_dockerfile(executor) == DOCKERFILES["cuda"].resolve()
        assert executor["image"].endswith(":cuda")
        devices = executor["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert devices[0].get("device_ids") or devices[0].get("count")
    assert build_dockerfile(services["superexec-serverapp"]) == DOCKERFILES["cpu"].resolve()
    if combo == "tls+gpu":  # the GPU overlay leaves the TLS connection flags alone
        assert flower["supernode-0"][1].keys() >= {"--root-certificates",
                                                   "--auth-supernode-private-key"}


def test_base_clients_run_on_the_cpu_image():
    config = load_merged(COMBOS["base"])
    for name in supernodes(config):
        assert "device" not in node_config(flower_services(config)[name][1])  # auto
        executor = config["services"][f"superexec-clientapp-{name.split('-')[1]}"]
        assert build_dockerfile(executor) == DOCKERFILES["cpu"].resolve()
        assert "deploy" not in executor


# ---------------------------------------------------------------------------- Dockerfiles
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        current += " " + stripped.rstrip("\\").strip() if current else stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            instruction, _, rest = current.partition(" ")
            out.append((instruction.upper(), rest.strip()))
            current = ""
    return out


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_pins_flower_and_installs_the_app(kind):
    path = DOCKERFILES[kind]
    steps = dockerfile_instructions(path)
    froms = [rest for ins, rest in steps if ins == "FROM"]
    assert len(froms) == 1
    image = froms[0].split()[0]
    if image == "${BASE_IMAGE}":  # compose.local-base.yml can swap in the local stand-in
        image = dict(rest.split("=", 1) for ins, rest in steps if ins == "ARG" and "=" in rest)["BASE_IMAGE"]
    repo, _, tag = image.partition(":")
    assert repo == "flwr/superexec"
    assert tag == FLWR_VERSION or tag.startswith(FLWR_VERSION + "-"), \
        f"{path.name}: FROM {image} is not pinned to Flower {FLWR_VERSION}"
    assert "$" not in image and tag != "latest"

    runs = [rest for ins, rest in steps if ins == "RUN"]
    installs = [r for r in runs if "pip install" in r]
    assert any(re.search(r"pip install(?: -\S+)* \.(?:\s|$)", r) for r in installs), \
        f"{path.name}: no `pip install .` of the app"
    args = dict(rest.split("=", 1) for ins, rest in steps if ins == "ARG" and "=" in rest)
    index = args["TORCH_INDEX_URL"]
    assert index.startswith("https://download.pytorch.org/whl/")
    assert (index.endswith("/cpu") if kind == "cpu" else re.search(r"/cu\d+$", index))
    torch_first = next(i for i, r in enumerate(runs) if "TORCH_INDEX_URL" in r)
    app_install = next(i for i, r in enumerate(runs) if re.search(r"pip install(?: -\S+)* \.", r))
    assert torch_first < app_install, "PyTorch from its index before `pip install .`"
    # the build itself proves the image's Flower is the pinned one
    assert any("m.version('flwr')" in r and f"'{FLWR_VERSION}'" in r for r in runs)
    assert not any("allow-runtime-dependency-installation" in r for _, r in steps)
    env = " ".join(rest for ins, rest in steps if ins == "ENV")
    assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in env
    assert "FLATFLOWER_DATA=/app/data" in env

    # the non-root user of Flower's images, owning what it copies and the mount points
    users = [rest for ins, rest in steps if ins == "USER"]
    assert users and users[-1] == "app"
    copies = [rest for ins, rest in steps if ins == "COPY"]
    assert copies and all(c.startswith("--chown=app:app ") for c in copies), copies
    copied = {word.rstrip("/") for c in copies for word in c.split()[1:-1]}
    needed = {"pyproject.toml", "README.md", "flatflower"}  # the code once: the root's folders are links into it
    assert needed == copied, f"{path.name} copies {copied}, not {needed}"
    assert any("mkdir -p" in r and all(d in r for d in ("/app/runs", "/app/data", "/app/state"))
               for r in runs)
    assert [rest for ins, rest in steps if ins == "ENTRYPOINT"][-1] == '["flower-superexec"]'

    ignore = [line.strip() for line in
              (path.parent / (path.name + ".dockerignore")).read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "the build context is an allow-list"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert needed <= allowed and not {".venv", "docker", "runs", "data"} & allowed


def test_dockerfiles_differ_only_in_pytorch():
    def app_steps(path: Path) -> list[tuple[str, str]]:
        return [(i, r) for i, r in dockerfile_instructions(path)
                if i in ("COPY", "USER", "WORKDIR", "ENTRYPOINT", "FROM")
                or (i == "RUN" and "TORCH_INDEX_URL" not in r)]

    assert app_steps(DOCKERFILES["cpu"]) == app_steps(DOCKERFILES["cuda"])


# ------------------------------------------------------- local stand-ins for Flower's images
def test_local_base_overlay_swaps_only_images_and_build_args():
    """compose.local-base.yml (make test-docker where Docker Hub is out of reach) runs the same
    federation: every Flower image replaced by its Dockerfile.flwr-local stand-in, the SuperExec
    images built FROM the stand-in; commands, users, volumes, networks, ports untouched."""
    stand_ins = {target: image for target, image in local_targets().items()}
    for combo, files in COMBOS.items():
        plain = load_merged(files)["services"]
        local = load_merged((*files, LOCAL_BASE))["services"]
        assert set(local) == set(plain)
        for name, service in local.items():
            before = plain[name]
            assert {k: v for k, v in service.items() if k not in ("image", "build")} == \
                {k: v for k, v in before.items() if k not in ("image", "build")}, (combo, name)
            if "build" in before:
                assert service["image"] == before["image"]
                assert {k: v for k, v in service["build"].items() if k != "args"} == \
                    {k: v for k, v in before["build"].items() if k != "args"}
                assert service["build"]["args"]["BASE_IMAGE"] == stand_ins["superexec"]
                assert service["build"]["args"]["TORCH_INDEX_URL"].startswith("https://")
            else:  # flwr/superlink:1.39.0 -> the superlink stand-in, etc.
                repo = before["image"].split(":")[0].removeprefix("flwr/")
                assert service["image"] == stand_ins[repo], (combo, name)
                assert argv(service) == argv(before), (combo, name)  # same entry point
    assert set(load_yaml(LOCAL_BASE)["services"]) == set(load_merged(COMBOS["base"])["services"])


def local_targets() -> dict[str, str]:
    """Dockerfile.flwr-local's build targets -> the tag compose.local-base.yml gives each."""
    images = {s.get("image") for s in load_yaml(LOCAL_BASE)["services"].values()} - {None}
    images |= {load_yaml(LOCAL_BASE)["x-local-superexec-build"]["args"]["BASE_IMAGE"]}
    out = {}
    for image in images:
        repo, _, tag = image.partition(":")
        assert tag == FLWR_VERSION, f"{image} is not tagged with Flower {FLWR_VERSION}"
        out[repo.rsplit("/", 1)[1]] = image
    return out


def test_flower_stand_in_images_match_the_official_ones():
    """Dockerfile.flwr-local: Flower pinned to pyproject's version, one target per official
    image with its ENTRYPOINT, the user `app` (uid 49999) and /python/venv first on PATH."""
    steps = dockerfile_instructions(FLWR_LOCAL)
    args = dict(rest.split("=", 1) for ins, rest in steps if ins == "ARG" and "=" in rest)
    assert args["FLWR_VERSION"] == FLWR_VERSION
    targets, current = {}, None
    for ins, rest in steps:
        if ins == "FROM":
            current = rest.split()[-1]
        elif ins == "ENTRYPOINT":
            targets[current] = json.loads(rest)
    assert targets == {t: list(IMAGE_ENTRYPOINTS[f"flwr/{t}"]) for t in ("superlink", "supernode", "superexec")}
    assert set(local_targets()) == set(targets)
    runs = " ".join(rest for ins, rest in steps if ins == "RUN")
    assert f"--uid {APP_UID}" in runs and f"--gid {APP_UID}" in runs and "python3 -m venv /python/venv" in runs
    assert 'pip install --no-cache-dir "flwr==${FLWR_VERSION}"' in runs
    assert [rest for ins, rest in steps if ins == "USER"] == ["app"]
    env = " ".join(rest for ins, rest in steps if ins == "ENV")
    assert "PATH=/python/venv/bin:$PATH" in env and "HOME=/app" in env
    assert ("WORKDIR", "/app") in steps


def test_docker_e2e_driver_configs_are_valid_runs():
    """tests/docker_e2e.py (make test-docker, not run by pytest): its run configs are valid and
    its FedDyn restart run can only end with the uninterrupted model (all replies required)."""
    from flatflower import RunConfig  # the public name registers the algorithms
    from tests import docker_e2e as e2e

    keys = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    for config in (e2e.FEDSAM, e2e.FEDDYN):
        assert set(config) <= keys
        RunConfig.from_mapping(config)
    assert e2e.FEDDYN["min-replies"] == e2e.NODES == e2e.FEDSAM["min-available-nodes"]
    assert e2e.FEDDYN["too-few-replies"] == "retry"
    assert 0 < e2e.KILL_AFTER_ROUND < e2e.FEDDYN["num-server-rounds"]
    assert e2e.LOCAL == local_targets()
    base = flower_services(load_merged(COMBOS["base"]))["superlink"][1]
    published = {p.rsplit(":", 1)[1] for p in load_merged(COMBOS["base"])["services"]["superlink"]["ports"]}
    assert {str(e2e.CONTROL[1]), str(e2e.FLEET[1])} == published
    assert base["--port"] == str(e2e.CONTROL[1])


def test_compose_references_the_dockerfiles_and_gitignores_certs():
    built = {str(build_dockerfile(s)) for combo in COMBOS.values()
             for s in load_merged(combo)["services"].values() if "build" in s}
    assert built == {str(p.resolve()) for p in DOCKERFILES.values()}
    assert "certs/" in (DOCKER / ".gitignore").read_text().split()


# ----------------------------------------------------------------------- docker compose
def _docker_compose() -> list[str] | None:
    docker = shutil.which("docker")
    if not docker:
        return None
    try:
        ok = subprocess.run([docker, "compose", "version"], capture_output=True,
                            timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [docker, "compose"] if ok else None


@pytest.mark.parametrize("combo", COMBOS)
def test_docker_compose_config_accepts_and_merges_alike(combo, tmp_path):
    compose = _docker_compose()
    if compose is None:
        pytest.skip("no `docker compose` CLI here; the files are checked by the other tests")
    from flatflower.runtime.certs import generate_certs

    certs = generate_certs(tmp_path / "certs", nodes=2, hosts=["superlink"]).out_dir
    env = {"FLATFLOWER_CERTS": str(certs)}
    cmd = [*compose, "--project-directory", str(DOCKER)]
    for path in COMBOS[combo]:
        cmd += ["-f", str(path)]
    proc = subprocess.run([*cmd, "config", "--format", "json"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert_merged_alike(json.loads(proc.stdout)["services"], COMBOS[combo], env)


def assert_merged_alike(theirs: dict, files: tuple[Path, ...], env: dict[str, str]) -> None:
    """A Compose CLI's merged services have our merge's commands, images, users, volumes,
    networks and build arguments."""
    ours = load_merged(files, env=env)["services"]
    assert set(theirs) == set(ours)
    for name, service in ours.items():
        other = theirs[name]
        for key in ("command", "entrypoint", "image", "network_mode", "user"):
            mine, compose_says = service.get(key), other.get(key)
            if isinstance(mine, list):
                mine, compose_says = [str(x) for x in mine], [str(x) for x in compose_says or []]
            assert compose_says == mine, (files, name, key)
        assert sorted(volume_target(v) for v in other.get("volumes") or []) == \
            sorted(volume_target(v) for v in service.get("volumes") or []), (name, files)
        assert sorted(other.get("networks") or ["default"]) == \
            sorted(service.get("networks") or ["default"]), (name, files)
        if "build" in service:
            assert {k: str(v) for k, v in (other["build"].get("args") or {}).items()} == \
                {k: str(v) for k, v in (service["build"].get("args") or {}).items()}, (name, files)


@pytest.mark.parametrize("combo", [*COMBOS, "base+local", "tls+gpu+local"])
def test_debian_docker_compose_validates_and_merges_alike(combo, tmp_path):
    """Debian's ``docker-compose`` (1.29, installed by .ci/run when apt is available; the one
    ``make test-docker`` runs) takes the files as they are and merges them as we do."""
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("no Debian docker-compose here (apt-get install docker-compose)")
    from flatflower.runtime.certs import generate_certs

    files = COMBOS[combo.removesuffix("+local")] + ((LOCAL_BASE,) if combo.endswith("+local") else ())
    certs = generate_certs(tmp_path / "certs", nodes=2, hosts=["superlink"]).out_dir
    env = {"FLATFLOWER_CERTS": str(certs)}
    cmd = [compose]
    for path in files:
        cmd += ["-f", str(path)]
    proc = subprocess.run([*cmd, "config"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    merged = yaml.safe_load(proc.stdout)
    assert_merged_alike(merged["services"], files, env)
    if "tls" in combo:
        assert set(merged["networks"]) >= {"node-0", "node-1"}


# ------------------------------------------------------------------------------- the docs
def docs_commands() -> list[tuple[str, list[str]]]:
    """(command, arguments) of every flower-*/flwr command line in docs/deployment.md."""
    text = DOCS.read_text()
    out = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                words = words[1:]  # VAR=value prefixes
            if not words:
                continue
            if words[0] in (*FLOWER_PROGRAMS, "flatflower"):
                out.append((words[0], words[1:]))
            elif words[0] == "flwr" and len(words) > 1:
                sub = words[1:3] if words[1] in ("supernode", "federation", "config") else words[1:2]
                out.append((" ".join(["flwr", *sub]), words[1 + len(sub):]))
    return out


@pytest.mark.xdist_group("flower-help")  # one worker builds the module fixture once
def test_docs_commands_use_real_flags(flower_help):
    commands = docs_commands()
    assert {c for c, _ in commands} >= {"flower-superlink", "flower-supernode", "flwr run",
                                        "flwr supernode register"}
    for command, args in commands:
        if command == "flatflower":
            continue  # test_docs_flatflower_commands_parse
        used = {a.split("=", 1)[0] for a in args if a.startswith("-")}
        unknown = used - flower_help(command)
        assert not unknown, f"docs: `{command}` has no {sorted(unknown)} in Flower {FLWR_VERSION}"


def test_docs_run_configs_and_node_configs_are_valid():
    from flwr.common.config import parse_config_args

    keys = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    runs = nodes = 0
    for command, args in docs_commands():
        for flag, value in zip(args, args[1:]):
            if command == "flwr run" and flag in ("-c", "--run-config"):
                unknown = set(parse_config_args([value])) - keys
                assert not unknown, f"docs: run config keys {unknown} do not exist"
                runs += 1
            if command == "flower-supernode" and flag == "--node-config":
                cfg = parse_config_args([value])
                NodeSettings.from_node_config(cfg)
                nodes += 1
    assert runs and nodes


def test_docs_flatflower_commands_parse():
    from flatflower.tools.cli import build_parser

    parser = build_parser()
    lines = [args for command, args in docs_commands() if command == "flatflower"]
    assert any(args[:1] == ["certs"] for args in lines)
    for args in lines:
        if args[:1] == ["report"]:
            continue  # `flatflower report` has its own parser (tools/report.py)
        try:
            parser.parse_args(args)
        except SystemExit as err:
            raise AssertionError(f"docs: `flatflower {' '.join(args)}` does not parse") from err


def test_docs_python_imports_exist():
    for module, name in re.findall(r"from ([\w.]+) import (\w+)", DOCS.read_text()):
        assert hasattr(importlib.import_module(module), name), f"docs: {module}.{name} is gone"


def test_docs_name_existing_files_and_services():
    text = DOCS.read_text()
    for path in set(re.findall(r"\bdocker/[\w.-]+", text)):
        assert (ROOT / path).exists() or path == "docker/certs", f"docs mention missing {path}"
    config = load_merged(COMBOS["base"])
    n = len(supernodes(config))
    for name in set(re.findall(r"\b(superexec-serverapp|superexec-clientapp-\d+|supernode-\d+)\b", text)):
        index = re.search(r"-(\d+)$", name)
        if index and int(index.group(1)) >= n:
            continue  # "More clients" shows how to add them
        assert name in config["services"], f"docs mention service {name}, which compose.yml lacks"
