"""`make test-docker`: the docker-compose federation of docker/, run for real (root, opt-in).

Steps, each printed with the time it took:

1. engine   use a reachable Docker engine, or install Debian's docker.io / docker-compose and
            start `dockerd` (stopped again at the end, by PID);
2. images   Flower's official images when they can be pulled; otherwise local stand-ins
            (docker/Dockerfile.flwr-local on a debootstrapped Debian image, selected by
            docker/compose.local-base.yml), then the flatflower SuperExec image (BuildKit);
            prints what each image weighs;
3. base     docker/compose.yml: SuperLink, ServerApp executor, 2 SuperNodes + their ClientApp
            executors; a FedSAM run on digits; `flwr ls` says completed; the run directory in
            the `runs` volume holds metrics.jsonl and model_final.pt, accuracy above chance,
            and the model equals an in-process run of the same config (in the same image);
            every container stops cleanly (no SIGKILL at the stop timeout), `down -v`;
4. tls      the same with docker/compose.tls.yml (certificates from `flatflower certs`,
            node keys registered with `flwr supernode register`); same final model;
5. restart  TLS stack, FedDyn (per-client state): supernode-0's process is killed after round
            2 (as a crash would: `docker kill` counts as a manual stop, which restart policies
            ignore); `restart: unless-stopped` brings it back, the client restores its state
            from its volume, and the run ends with the model of an uninterrupted run.
6. recreate base stack; a 2-round FedSAM run; the ServerApp executor's container is recreated
            (`up --force-recreate --no-deps`, as a new image would); `resume=true` to 3 rounds
            must be accepted (its record key is in a volume, not the container), hold rounds 0-3
            and end with the model of an uninterrupted 3-round run.

Everything it creates is removed at the end, on success and on failure: the compose project
(`flatflower-e2e`: containers, network, volumes), the work directory, and a dockerd it started.
Images stay (a second run reuses them; `--remove-images` deletes the ones it built).

Networking stays on this machine: the containers share the project's own bridge network, and
the only published ports are the compose files' 127.0.0.1:8000 and 127.0.0.1:9092.

    sudo make test-docker                       # all scenarios
    .venv/bin/python tests/docker_e2e.py --only base --keep-work
    .venv/bin/python tests/docker_e2e.py --only recreate --overlay my.yml   # e.g. a fix undone
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
sys.path.insert(0, str(ROOT))

PROJECT = "flatflower-e2e"
FLWR_VERSION = "1.39.0"
OFFICIAL = {t: f"flwr/{t}:{FLWR_VERSION}" for t in ("superlink", "supernode")}
OFFICIAL["superexec"] = f"flwr/superexec:{FLWR_VERSION}-py3.11-ubuntu24.04"
LOCAL = {t: f"flatflower-local/{t}:{FLWR_VERSION}" for t in ("superlink", "supernode", "superexec")}
DEBIAN_IMAGE = "local/debian:bookworm"
SUPEREXEC_IMAGE = "flatflower-superexec:cpu"
CONTROL = ("127.0.0.1", 8000)  # the compose files publish these on the host's loopback
FLEET = ("127.0.0.1", 9092)
NODES = 2
CHANCE = 0.1  # digits: 10 classes

# The runs. Digits, the MLP, one local epoch: seconds of compute per round, so a round costs
# what Flower's polling costs (~16 s, docs/benchmarks.md).
FEDSAM = {"algorithm": "fedsam", "dataset": "digits", "model": "mlp", "local-epochs": 1,
          "batch-size": 32, "num-server-rounds": 3, "min-available-nodes": NODES, "seed": 0}
# As tests/test_reliability.py's restart test: a lost round message is re-sent once the node is
# back (min-replies = all clients, retry), so the result must equal the uninterrupted run.
FEDDYN = {**FEDSAM, "algorithm": "feddyn", "num-server-rounds": 4, "min-replies": NODES,
          "too-few-replies": "retry", "max-retries": 8, "round-timeout": 30.0}
KILL_AFTER_ROUND = 2
# The recreate scenario: this many rounds, then the ServerApp's container is recreated and the run
# is resumed to FEDSAM's num-server-rounds (an extension: bit for bit the uninterrupted run).
RECREATE_AFTER_ROUND = 2
# Extra compose files (--overlay) for every stack, after its own and before the local stand-ins.
EXTRA_OVERLAYS: list[Path] = []

T0 = time.monotonic()


# ------------------------------------------------------------------------------ output
def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


class Failure(RuntimeError):
    pass


def run(cmd: list[str], *, timeout: float, env: dict | None = None, check: bool = True,
        quiet: bool = False, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    if not quiet:
        say("$ " + " ".join(shlex.quote(str(c)) for c in cmd))
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise Failure(f"timed out after {timeout:.0f}s: {' '.join(map(str, cmd))}") from None
    if check and proc.returncode != 0:
        raise Failure(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n"
                      f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


def wait_until(what: str, probe, timeout: float, every: float = 1.0):
    """Poll ``probe()`` until it returns something truthy; return (value, seconds taken)."""
    start = time.monotonic()
    while True:
        value = probe()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise Failure(f"{what}: not within {timeout:.0f}s")
        time.sleep(every)


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


# ------------------------------------------------------------------------------ engine
class Engine:
    """A Docker engine and a Compose CLI: found, or installed and started here."""

    def __init__(self, work: Path):
        self.work = work
        self.dockerd: subprocess.Popen | None = None
        self.env = dict(os.environ)
        self.docker = "docker"
        self.compose: list[str] = []

    def _docker_ok(self, docker: str) -> bool:
        try:
            return subprocess.run([docker, "info"], capture_output=True, timeout=30,
                                  env=self.env).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _apt_install(self, *packages: str) -> None:
        if not shutil.which("apt-get") or os.geteuid() != 0:
            raise Failure(f"need {', '.join(packages)}: install them (apt-get install {' '.join(packages)})")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if run(["apt-get", "install", "-y", "-q", *packages], timeout=900, env=env, check=False).returncode:
            run(["apt-get", "update", "-q"], timeout=600, env=env)
            run(["apt-get", "install", "-y", "-q", *packages], timeout=900, env=env)

    def start(self) -> None:
        docker = shutil.which("docker") or "/usr/bin/docker"
        if shutil.which(docker) and self._docker_ok(docker):
            say(f"engine: using the running Docker engine ({self._server_version(docker)})")
        else:
            if not shutil.which("dockerd"):
                say("engine: no dockerd; installing Debian's docker.io")
                self._apt_install("docker.io")
            docker = shutil.which("docker") or "/usr/bin/docker"
            log = (self.work / "dockerd.log").open("w")
            self.dockerd = subprocess.Popen([shutil.which("dockerd")], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            say(f"engine: started dockerd (pid {self.dockerd.pid}, log {self.work / 'dockerd.log'})")
            _, took = wait_until("dockerd answering", lambda: self.dockerd.poll() is None
                                 and self._docker_ok(docker) or self._dead(), timeout=120, every=0.5)
            say(f"engine: Docker {self._server_version(docker)} up after {took:.1f}s")
        self.docker = self._buildkit_cli(docker)
        # Compose v1 builds through the `docker` CLI (COMPOSE_DOCKER_CLI_BUILD) so that BuildKit
        # reads docker/Dockerfile.superexec.dockerignore; put the chosen CLI first on PATH.
        self.env = {**os.environ, "COMPOSE_DOCKER_CLI_BUILD": "1", "DOCKER_BUILDKIT": "1",
                    "PATH": os.pathsep.join([str(Path(self.docker).parent), os.environ["PATH"]])}
        if subprocess.run([self.docker, "compose", "version"], capture_output=True,
                          env=self.env).returncode == 0:
            self.compose = [self.docker, "compose"]
        else:
            if not shutil.which("docker-compose"):
                say("engine: no Compose CLI; installing Debian's docker-compose")
                self._apt_install("docker-compose")
            self.compose = [shutil.which("docker-compose")]
        version = run([*self.compose, "version"], timeout=60, env=self.env, quiet=True).stdout
        say(f"engine: CLI {self.docker}, compose: {' '.join(self.compose)} ({version.splitlines()[0]})")

    def _dead(self):
        if self.dockerd is not None and self.dockerd.poll() is not None:
            raise Failure(f"dockerd exited ({self.dockerd.returncode}); see {self.work / 'dockerd.log'}")
        return None

    def _server_version(self, docker: str) -> str:
        return subprocess.run([docker, "version", "-f", "{{.Server.Version}}"], capture_output=True,
                              text=True, env=self.env).stdout.strip()

    def _buildkit_cli(self, found: str) -> str:
        """A docker CLI that builds with BuildKit: one with the buildx plugin, or one older than
        23 (built-in BuildKit with DOCKER_BUILDKIT=1). A newer CLI without buildx falls back to
        the legacy builder, which ignores per-Dockerfile .dockerignore files."""
        for cli in dict.fromkeys([found, shutil.which("docker"), "/usr/bin/docker"]):
            if not cli or not Path(cli).exists():
                continue
            if subprocess.run([cli, "buildx", "version"], capture_output=True).returncode == 0:
                return cli
            client = subprocess.run([cli, "version", "-f", "{{.Client.Version}}"], capture_output=True,
                                    text=True).stdout.strip()
            try:
                if int(client.split(".")[0]) < 23:
                    return cli
            except ValueError:
                continue
        raise Failure("no docker CLI that builds with BuildKit (install docker-buildx, or Debian's docker.io)")

    def d(self, *args, timeout: float = 120, check: bool = True, quiet: bool = False):
        return run([self.docker, *args], timeout=timeout, env=self.env, check=check, quiet=quiet)

    def stop(self) -> None:
        if self.dockerd is None or self.dockerd.poll() is not None:
            return
        say(f"engine: stopping the dockerd started here (pid {self.dockerd.pid})")
        self.dockerd.send_signal(signal.SIGTERM)
        try:
            self.dockerd.wait(60)
        except subprocess.TimeoutExpired:
            self.dockerd.kill()
            self.dockerd.wait(30)


# ------------------------------------------------------------------------------ images
def pip_settings() -> tuple[str, bytes]:
    """The host's pip configuration for a container (pip.conf text, CA bundle): the index
    URLs it reaches over http(s) and the CA bundle it trusts."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True).stdout
    conf: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        conf[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    lines = ["[global]"]
    for key in ("index-url", "extra-index-url"):
        urls = [u for u in conf.get(key, "").split() if u.startswith(("http://", "https://"))]
        if urls:
            lines.append(f"{key} = {' '.join(urls)}")
    bundle = b""
    cert = conf.get("cert") or os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE")
    if cert and Path(cert).is_file():
        bundle = Path(cert).read_bytes()
        lines.append("cert = /etc/pip-ca-certificates.crt")
    lines.append(f"timeout = {conf.get('default-timeout') or conf.get('timeout') or 180}")
    return "\n".join(lines) + "\n", bundle


def host_torch_packages() -> str:
    """The host's torch/torchvision versions (the image gets the same), without local tags."""
    pins = []
    for name in ("torch", "torchvision"):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name).split('+')[0]}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(name)
    return " ".join(pins)


class Images:
    def __init__(self, engine: Engine, work: Path, base: str):
        self.e, self.work, self.base = engine, work, base
        self.built: list[str] = []
        self.overlay: list[Path] = []

    def exists(self, image: str) -> bool:
        return self.e.d("image", "inspect", image, check=False, quiet=True).returncode == 0

    def prepare(self) -> None:
        if self.base in ("auto", "official"):
            if self._pull_official():
                say("images: Flower's official images")
            elif self.base == "official":
                raise Failure("Flower's official images cannot be pulled here")
            else:
                self.base = "local"
        if self.base == "local":
            say("images: Docker Hub out of reach; local stand-ins (docker/compose.local-base.yml)")
            self._local_stand_ins()
            self.overlay = [DOCKER / "compose.local-base.yml"]
        else:
            self.base = "official"
        start = time.monotonic()
        self.e.env["FLATFLOWER_TORCH_PACKAGES"] = host_torch_packages()
        compose(self.e, [DOCKER / "compose.yml", *self.overlay], "build", "superexec-serverapp",
                timeout=3600)
        self.built.append(SUPEREXEC_IMAGE)
        torch = (f"PyTorch {self.e.env['FLATFLOWER_TORCH_PACKAGES']} from PyPI" if self.overlay
                 else "PyTorch from its CPU index")
        say(f"images: {SUPEREXEC_IMAGE} ready in {time.monotonic() - start:.0f}s ({torch})")

    def _pull_official(self) -> bool:
        for image in OFFICIAL.values():
            if self.exists(image):
                continue
            try:
                if self.e.d("pull", image, timeout=300, check=False).returncode != 0:
                    return False
            except Failure:
                return False
        return True

    def _local_stand_ins(self) -> None:
        if not self.exists(DEBIAN_IMAGE):
            if not shutil.which("debootstrap"):
                self.e._apt_install("debootstrap")
            rootfs = self.work / "rootfs"
            start = time.monotonic()
            run(["debootstrap", "--variant=minbase", "bookworm", rootfs], timeout=1800)
            tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run([self.e.docker, "import", "-", DEBIAN_IMAGE], stdin=tar.stdout,
                           check=True, capture_output=True, env=self.e.env, timeout=600)
            tar.wait(60)
            shutil.rmtree(rootfs)
            self.built.append(DEBIAN_IMAGE)
            say(f"images: {DEBIAN_IMAGE} from debootstrap in {time.monotonic() - start:.0f}s")
        context = self.work / "hostconf"
        context.mkdir(exist_ok=True)
        conf, bundle = pip_settings()
        (context / "pip.conf").write_text(conf)
        (context / "ca-certificates.crt").write_bytes(bundle)
        say("images: the host's pip settings for the builds: " + "; ".join(conf.splitlines()[1:]))
        for target, image in LOCAL.items():
            start = time.monotonic()
            self.e.d("build", "-f", DOCKER / "Dockerfile.flwr-local", "--target", target,
                     "--build-arg", f"BASE={DEBIAN_IMAGE}", "-t", image, context, timeout=1800)
            self.built.append(image)
            say(f"images: {image} ready in {time.monotonic() - start:.0f}s")

    def sizes(self) -> dict[str, int]:
        names = ([DEBIAN_IMAGE, *LOCAL.values()] if self.base == "local" else list(OFFICIAL.values()))
        out = {}
        for image in [*names, SUPEREXEC_IMAGE]:
            p = self.e.d("image", "inspect", "-f", "{{.Size}}", image, check=False, quiet=True)
            if p.returncode == 0:
                out[image] = int(p.stdout.strip())
        return out

    def remove(self) -> None:
        for image in reversed(self.built):
            self.e.d("rmi", image, check=False)


# ------------------------------------------------------------------------------ compose
def compose(engine: Engine, files: list[Path], *args, timeout: float = 300, env: dict | None = None,
            check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    cmd = [*engine.compose, "-p", PROJECT]
    for f in files:
        cmd += ["-f", f]
    return run([*cmd, *args], timeout=timeout, env={**engine.env, **(env or {})}, check=check,
               quiet=quiet)


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class Federation:
    """One compose project (PROJECT) with the given files; always taken down with -v."""

    def __init__(self, engine: Engine, images: Images, name: str, files: list[Path], work: Path,
                 env: dict | None = None, certs: Path | None = None):
        self.e, self.name, self.work = engine, name, work
        self.files = [*files, *EXTRA_OVERLAYS, *images.overlay]
        self.env = dict(env or {})
        self.certs = certs
        self.flwr_home = work / "flwr_home"
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        self.connection = f"e2e-{name}"
        entry: dict = {"address": f"{CONTROL[0]}:{CONTROL[1]}"}
        if certs:
            entry["root-certificates"] = str(certs / "ca.crt")
        else:
            entry["insecure"] = True
        import tomli_w
        (self.flwr_home / "config.toml").write_text(tomli_w.dumps({"superlink": {self.connection: entry}}))
        self.flwr_env = {**os.environ, "FLWR_HOME": str(self.flwr_home),
                         "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0"}
        self.up_seconds = 0.0

    def c(self, *args, **kw):
        return compose(self.e, self.files, *args, env=self.env, **kw)

    def flwr(self, *args, timeout: float = 120, quiet: bool = False) -> str:
        flwr = str(Path(sys.executable).parent / "flwr")
        return run([flwr, *args], timeout=timeout, env=self.flwr_env, quiet=quiet).stdout

    # -- start
    def up(self) -> None:
        for host, port in (CONTROL, FLEET):
            if not port_free(host, port):
                raise Failure(f"{host}:{port} is in use: the compose files publish it (stop what holds it)")
        start = time.monotonic()
        self.c("up", "-d", "--no-build", timeout=600)
        _, took = wait_until("SuperLink /health", self._healthy, timeout=180, every=0.5)
        say(f"{self.name}: SuperLink healthy {took:.1f}s after `up` returned")
        if self.certs:  # a SuperNode is refused until its key is registered; it restarts
            for i in range(NODES):
                self.flwr("supernode", "register", self.certs / "nodes" / f"node-{i}.pub",
                          self.connection, "--name", f"node-{i}")
        online, took = wait_until("both SuperNodes online", self._online, timeout=300, every=1.0)
        self.up_seconds = time.monotonic() - start
        say(f"{self.name}: {len(online)} SuperNodes online ({', '.join(online)}); "
            f"the federation took {self.up_seconds:.1f}s to come up")

    def _healthy(self) -> bool:
        scheme = "https" if self.certs else "http"
        context = ssl.create_default_context(cafile=str(self.certs / "ca.crt")) if self.certs else None
        try:
            with urllib.request.urlopen(f"{scheme}://{CONTROL[0]}:{CONTROL[1]}/health", timeout=2,
                                        context=context) as resp:
                return resp.status == 200
        except OSError:
            self._check_running()
            return False

    def _online(self) -> list[str]:
        try:
            nodes = json.loads(self.flwr("supernode", "ls", self.connection, "--format", "json",
                                         quiet=True))["nodes"]
        except (Failure, ValueError, KeyError):
            return []
        online = [n["node-id"] for n in nodes if n["status"] == "online"]
        return online if len(online) >= NODES else []

    def _check_running(self) -> None:
        ps = self.c("ps", quiet=True, check=False).stdout
        for line in ps.splitlines():
            if line.startswith(PROJECT) and "Exit" in line and "-init" not in line:  # the one-shot inits exit
                say(f"{self.name}: note: {line.strip()}")

    # -- runs
    def submit(self, run_config: dict) -> int:
        import tomli_w
        path = self.work / f"{self.name}-run.toml"
        path.write_text(tomli_w.dumps(run_config))
        out = self.flwr("run", ROOT, self.connection, "--format", "json", "-c", path, timeout=300)
        run_id = int(json.loads(out)["run-id"])
        say(f"{self.name}: submitted run {run_id}: {json.dumps(run_config)}")
        return run_id

    def status(self, run_id: int) -> dict:
        out = self.flwr("ls", self.connection, "--run-id", str(run_id), "--format", "json", quiet=True)
        return json.loads(out)["runs"][0]

    def wait(self, run_id: int, rounds: int, on_poll=None) -> dict:
        # Budget: what bringing the federation up took (containers, Python and torch imports:
        # a ClientApp pays them again for every message) per round, on top of Flower's ~16 s
        # polling floor per round, times 3 for a loaded 2-core machine, and never under 5 min.
        timeout = max(300.0, 3 * rounds * (16 + self.up_seconds) + 120)
        say(f"{self.name}: waiting for run {run_id} (at most {timeout:.0f}s)")
        last = None

        def probe():
            nonlocal last
            if on_poll:
                on_poll()
            row = self.status(run_id)
            if row["status"] != last:
                last = row["status"]
                say(f"{self.name}: run {run_id}: {last}")
            return row if str(row["status"]).startswith("finished") else None

        try:
            row, took = wait_until(f"run {run_id} finished", probe, timeout=timeout, every=2.0)
        except Failure:
            self.flwr("stop", str(run_id), self.connection)
            raise
        say(f"{self.name}: run {run_id} {row['status']} after {took:.0f}s (Flower's elapsed: {row.get('elapsed')})")
        (self.work / f"{self.name}-run{run_id}.log").write_text(
            self.flwr("log", str(run_id), self.connection, "--show", timeout=120, quiet=True))
        if row["status"] != "finished:completed":
            raise Failure(f"run {run_id}: {row['status']} ({row.get('status-details')}); "
                          f"log: {self.work / f'{self.name}-run{run_id}.log'}")
        return row

    def container(self, service: str) -> str:
        cid = self.c("ps", "-q", service, quiet=True).stdout.strip()
        if not cid:
            raise Failure(f"no container for {service}")
        return cid

    def fetch(self, path: str, dest: Path) -> Path:
        """Copy ``path`` out of superexec-serverapp (the runs volume)."""
        self.e.d("cp", f"{self.container('superexec-serverapp')}:{path}", dest)
        return dest

    # -- stop
    def down(self) -> dict[str, int]:
        """`stop` (what `down` does first), each container's exit code, then `down -v`."""
        logs = self.c("logs", "--no-color", quiet=True, check=False, timeout=120)
        (self.work / f"{self.name}-compose.log").write_text(logs.stdout + logs.stderr)
        ids = self.c("ps", "-q", quiet=True, check=False).stdout.split()
        start = time.monotonic()
        self.c("stop", timeout=300, check=False)
        stop_s = time.monotonic() - start
        codes = {}
        for cid in ids:
            p = self.e.d("inspect", "-f", "{{.Name}} {{.State.ExitCode}} {{.State.OOMKilled}}", cid,
                         check=False, quiet=True)
            if p.returncode == 0:
                name, code, _ = p.stdout.split()
                codes[name.lstrip("/")] = int(code)
        self.c("down", "-v", "--remove-orphans", timeout=300, check=False)
        say(f"{self.name}: stopped in {stop_s:.1f}s, exit codes {codes}; `down -v` done")
        return codes


# ------------------------------------------------------------------------------ checks
def check_run_dir(run_dir: Path, rounds: int) -> tuple[list[dict], dict]:
    import torch

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    model = torch.load(run_dir / "model_final.pt", weights_only=True)
    assert [r["round"] for r in rows] == list(range(rounds + 1)), [r["round"] for r in rows]
    accuracy = rows[-1]["test_accuracy"]
    assert accuracy > CHANCE + 0.2, f"final test accuracy {accuracy} is not above chance ({CHANCE})"
    say(f"  {run_dir.name}: metrics.jsonl rows {len(rows)}, test accuracy "
        f"{rows[0]['test_accuracy']:.3f} -> {accuracy:.3f} (chance {CHANCE}), "
        f"model_final.pt {len(model)} tensors")
    return rows, model


def same_model(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reference_model(engine: Engine, run_config: dict, work: Path, name: str) -> dict:
    """The same config run in-process (runtime/engines/inprocess.py, 2 clients) in the SuperExec image:
    the model an uninterrupted deployment must end with."""
    import torch

    out = work / f"reference-{name}"
    out.mkdir(mode=0o777)
    out.chmod(0o777)  # the image's user (uid 49999) writes here
    script = (
        "import json, sys\n"
        "from flatflower.client.app import app\n"
        "from flatflower.common.config import RunConfig\n"
        "from flatflower.runtime.engines.inprocess import InProcessGrid\n"
        "from flatflower.server.run import run_server\n"
        "cfg = RunConfig.from_mapping({**json.loads(sys.argv[1]), 'run-dir': '/out/run'})\n"
        f"run_server(InProcessGrid(app, {NODES}, cfg.to_dict()), cfg)\n")
    start = time.monotonic()
    engine.d("run", "--rm", "--network", "none", "-v", f"{out}:/out", "--entrypoint", "python",
             SUPEREXEC_IMAGE, "-c", script, json.dumps(run_config), timeout=900)
    say(f"{name}: in-process reference in {SUPEREXEC_IMAGE} took {time.monotonic() - start:.0f}s")
    return torch.load(out / "run" / "model_final.pt", weights_only=True)


def assert_clean_stop(codes: dict[str, int]) -> None:
    # 137 = SIGKILL: the container ignored SIGTERM until the stop timeout. The one-shot init
    # container exited 0 long before.
    bad = {n: c for n, c in codes.items() if c not in (0, 143)}  # 143: exited on SIGTERM
    assert not bad, f"containers that did not stop cleanly: {bad}"


def sweep(engine: Engine) -> None:
    """Remove whatever of the project is left (an interrupted run): `down -v` with every file
    that defines containers, networks or volumes, then anything still labelled with it."""
    compose(engine, [DOCKER / "compose.yml", DOCKER / "compose.tls.yml"], "down", "-v",
            "--remove-orphans", quiet=True, check=False, env={"FLATFLOWER_CERTS": "/nonexistent"})
    label = f"label=com.docker.compose.project={PROJECT}"
    for kind, extra in (("container", ["-a"]), ("network", []), ("volume", [])):
        ids = engine.d(kind, "ls", "-q", "--filter", label, *extra, quiet=True, check=False).stdout.split()
        if ids:
            engine.d(kind, "rm", *(["-f"] if kind == "container" else []), *ids, check=False)


def assert_nothing_left(engine: Engine) -> None:
    label = f"label=com.docker.compose.project={PROJECT}"
    left = {kind: engine.d(kind, "ls", "-q", "--filter", label, *(["-a"] if kind == "container" else []),
                           quiet=True).stdout.split()
            for kind in ("container", "network", "volume")}
    assert not any(left.values()), f"left behind: {left}"


# ------------------------------------------------------------------------------ scenarios
def scenario_base(engine: Engine, images: Images, work: Path, results: dict) -> None:
    fed = Federation(engine, images, "base", [DOCKER / "compose.yml"], work)
    config = {**FEDSAM, "run-dir": "/app/runs/e2e-base"}
    try:
        fed.up()
        volumes = engine.d("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
                           quiet=True).stdout.split()
        say(f"base: volumes {volumes}")
        row = fed.wait(fed.submit(config), FEDSAM["num-server-rounds"])
        run_dir = fed.fetch("/app/runs/e2e-base", work / "base-run")
    finally:
        codes = fed.down()
    _, model = check_run_dir(run_dir, FEDSAM["num-server-rounds"])
    assert_clean_stop(codes)
    assert_nothing_left(engine)
    reference = reference_model(engine, config, work, "base")
    assert same_model(model, reference), "the deployed FedSAM model differs from the in-process run"
    say("base: final model == in-process run of the same config")
    results["base"] = {"model": model, "elapsed": row.get("elapsed"), "up_s": fed.up_seconds}


def make_certs(work: Path) -> Path:
    certs = work / "certs"
    run([Path(sys.executable).parent / "flatflower", "certs", certs, "--nodes", str(NODES),
         "--host", "superlink"], timeout=120)
    for path in [certs, *certs.rglob("*")]:  # the containers' user reads them; keys stay 0600
        os.chown(path, 49999, 49999)
    return certs


def scenario_tls(engine: Engine, images: Images, work: Path, results: dict) -> None:
    certs = make_certs(work)
    fed = Federation(engine, images, "tls", [DOCKER / "compose.yml", DOCKER / "compose.tls.yml"], work,
                     env={"FLATFLOWER_CERTS": str(certs)}, certs=certs)
    try:
        fed.up()
        row = fed.wait(fed.submit({**FEDSAM, "run-dir": "/app/runs/e2e-tls"}), FEDSAM["num-server-rounds"])
        run_dir = fed.fetch("/app/runs/e2e-tls", work / "tls-run")
        superlink_log = engine.d("logs", fed.container("superlink"), quiet=True)
    finally:
        codes = fed.down()
    _, model = check_run_dir(run_dir, FEDSAM["num-server-rounds"])
    log = superlink_log.stdout + superlink_log.stderr
    assert "Uvicorn running on https://" in log, "the Control API is not on TLS"
    assert "insecure" not in log.lower(), "a component of the TLS stack runs --insecure"
    assert_clean_stop(codes)
    assert_nothing_left(engine)
    if "base" in results:
        assert same_model(model, results["base"]["model"]), "TLS run and plain run differ"
        say("tls: final model == the plain run's")
    else:
        assert same_model(model, reference_model(engine, FEDSAM, work, "tls")), \
            "the deployed FedSAM model differs from the in-process run"
        say("tls: final model == in-process run of the same config")
    results["tls"] = {"elapsed": row.get("elapsed"), "up_s": fed.up_seconds}


def scenario_restart(engine: Engine, images: Images, work: Path, results: dict) -> None:
    certs = work / "certs" if (work / "certs").exists() else make_certs(work)
    fed = Federation(engine, images, "restart", [DOCKER / "compose.yml", DOCKER / "compose.tls.yml"],
                     work, env={"FLATFLOWER_CERTS": str(certs)}, certs=certs)
    config = {**FEDDYN, "run-dir": "/app/runs/e2e-restart"}
    killed: dict = {}

    def on_poll():
        if killed:
            if "back" not in killed:
                state = engine.d("inspect", "-f", "{{.State.Status}} {{.RestartCount}}", killed["id"],
                                 quiet=True).stdout.split()
                if state[0] == "running" and int(state[1]) > killed["restarts"]:
                    killed["back"] = time.monotonic()
                    say(f"restart: supernode-0 restarted by its restart policy "
                        f"{killed['back'] - killed['at']:.1f}s after the kill")
            return
        p = engine.d("exec", fed.container("superexec-serverapp"), "cat", "/app/runs/e2e-restart/metrics.jsonl",
                     check=False, quiet=True)
        if f'"round": {KILL_AFTER_ROUND}' in p.stdout:
            cid = fed.container("supernode-0")
            pid = engine.d("inspect", "-f", "{{.State.Pid}}", cid, quiet=True).stdout.strip()
            say(f"restart: round {KILL_AFTER_ROUND} done; SIGKILL supernode-0's process (host pid {pid})")
            killed["restarts"] = int(engine.d("inspect", "-f", "{{.RestartCount}}", cid, quiet=True).stdout)
            os.kill(int(pid), signal.SIGKILL)
            killed.update(id=cid, at=time.monotonic())

    try:
        fed.up()
        fed.wait(fed.submit(config), FEDDYN["num-server-rounds"], on_poll=on_poll)
        run_dir = fed.fetch("/app/runs/e2e-restart", work / "restart-run")
        executor_log = engine.d("logs", fed.container("superexec-clientapp-0"), quiet=True)
        restarts = engine.d("inspect", "-f", "{{.RestartCount}}", fed.container("supernode-0"),
                            quiet=True).stdout.strip()
        state_files = engine.d("exec", fed.container("superexec-clientapp-0"), "find", "/app/state",
                               "-type", "f", quiet=True).stdout.split()
    finally:
        codes = fed.down()
    assert killed, "the run ended before the kill"
    assert "back" in killed, "supernode-0 did not come back"
    rows, model = check_run_dir(run_dir, FEDDYN["num-server-rounds"])
    # Until the SuperLink marks the killed node offline (missed heartbeats), the restarted
    # SuperNode's key is refused (exit 305) and the policy restarts it again, with back-off.
    say(f"restart: supernode-0 restarted {int(restarts) - killed['restarts']} time(s) after the kill; "
        f"client 0's state volume holds {sorted(Path(f).name for f in state_files)}")
    after = rows[KILL_AFTER_ROUND + 1]
    say(f"restart: round {after['round']}: failed partitions {after['failed_partitions']}, "
        f"{after['retries']} retries, {after['seconds']:.0f}s; skipped rounds: "
        f"{sum(r.get('skipped', 0) for r in rows)}")
    log = executor_log.stdout + executor_log.stderr
    restored = f"client state of round {KILL_AFTER_ROUND} restored from /app/state/partition-0/"
    assert restored in log, "client 0 did not read its state from its volume after the restart"
    assert all(r["skipped"] == 0 for r in rows[1:]), [r.get("skipped") for r in rows]
    assert_clean_stop(codes)
    assert_nothing_left(engine)
    reference = reference_model(engine, config, work, "restart")
    assert same_model(model, reference), "the restarted run's model differs from an uninterrupted run"
    say("restart: final model == uninterrupted (in-process) run")
    results["restart"] = {"restarts": restarts}


def scenario_recreate(engine: Engine, images: Images, work: Path, results: dict) -> None:
    """A run, its ServerApp executor's container recreated, the run resumed and extended: the
    record key that sealed the run directory (its own volume, record-key) must outlive the
    container, or the resume is refused as "sealed by another record key"."""
    fed = Federation(engine, images, "recreate", [DOCKER / "compose.yml"], work)
    rounds = FEDSAM["num-server-rounds"]
    first = {**FEDSAM, "num-server-rounds": RECREATE_AFTER_ROUND, "run-dir": "/app/runs/e2e-recreate"}
    extended = {**first, "num-server-rounds": rounds, "resume": True}
    seal = "/app/runs/e2e-recreate/manifest.json"

    def key_id() -> str:
        manifest = engine.d("exec", fed.container("superexec-serverapp"), "cat", seal, quiet=True).stdout
        return json.loads(manifest)["seal"]["key_id"]

    try:
        fed.up()
        fed.wait(fed.submit(first), RECREATE_AFTER_ROUND)
        sealed_by = key_id()
        old = fed.container("superexec-serverapp")
        start = time.monotonic()
        fed.c("up", "-d", "--no-build", "--no-deps", "--force-recreate", "superexec-serverapp")
        new = fed.container("superexec-serverapp")
        say(f"recreate: superexec-serverapp recreated in {time.monotonic() - start:.1f}s: container "
            f"{old[:12]} -> {new[:12]}; the run directory is sealed by record key {sealed_by}")
        assert new != old, "superexec-serverapp was not recreated"
        run_id = fed.submit(extended)  # refused: "finished:failed (... sealed by another record key ...)"
        row = fed.wait(run_id, rounds - RECREATE_AFTER_ROUND)
        resealed_by = key_id()
        run_dir = fed.fetch("/app/runs/e2e-recreate", work / "recreate-run")
        p = engine.d("logs", new, quiet=True)
        executor_log = p.stdout + p.stderr
    finally:
        codes = fed.down()
    run_log = (work / f"recreate-run{run_id}.log").read_text()
    for name, log in (("ServerApp executor", executor_log), ("run", run_log)):
        assert "another record key" not in log, f"the {name} log mentions another record key"
    assert f"resuming from the checkpoint of round {RECREATE_AFTER_ROUND}" in run_log, \
        f"the second run did not resume from round {RECREATE_AFTER_ROUND}'s checkpoint"
    assert resealed_by == sealed_by, f"the resume sealed with record key {resealed_by}, the run with {sealed_by}"
    notes = json.loads((run_dir / "config.json").read_text()).get("resume_notes")
    assert not notes, f"the resume went on with notes (trusted, not verified?): {notes}"
    _, model = check_run_dir(run_dir, rounds)
    assert_clean_stop(codes)
    assert_nothing_left(engine)
    say(f"recreate: resumed after round {RECREATE_AFTER_ROUND} in the new container, sealed by the "
        f"same record key ({sealed_by}), rounds 0-{rounds} in metrics.jsonl")
    if "base" in results:  # the same training config, 3 rounds uninterrupted
        assert same_model(model, results["base"]["model"]), "the resumed run's model differs from the base run's"
        say("recreate: final model == the base run's (uninterrupted)")
    else:
        reference = reference_model(engine, FEDSAM, work, "recreate")
        assert same_model(model, reference), "the resumed run's model differs from an uninterrupted run"
        say("recreate: final model == uninterrupted (in-process) run")
    results["recreate"] = {"elapsed": row.get("elapsed")}


SCENARIOS = {"base": scenario_base, "tls": scenario_tls, "restart": scenario_restart,
             "recreate": scenario_recreate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=list(SCENARIOS),
                        help="run only these scenarios (repeatable; default: all)")
    parser.add_argument("--base", choices=["auto", "official", "local"], default="auto",
                        help="Flower's images (pulled) or the local stand-ins (default: auto)")
    parser.add_argument("--keep-work", action="store_true", help="keep the work directory (logs, runs)")
    parser.add_argument("--remove-images", action="store_true", help="delete the images built here")
    parser.add_argument("--overlay", action="append", type=Path, default=[], metavar="FILE",
                        help="an extra compose file for every stack (repeatable), e.g. one that undoes "
                             "a fix, to see a scenario fail without it")
    args = parser.parse_args(argv)
    EXTRA_OVERLAYS[:] = [f.resolve() for f in args.overlay]
    if os.geteuid() != 0:
        print("make test-docker needs root (it may install and start a Docker engine)", file=sys.stderr)
        return 2
    for key, value in (("FLWR_DISABLE_UPDATE_CHECK", "1"), ("FLWR_TELEMETRY_ENABLED", "0")):
        os.environ[key] = value
    work = Path(tempfile.mkdtemp(prefix="flatflower-docker-e2e-"))
    work.chmod(0o755)
    engine = Engine(work)
    images = None
    results: dict = {}
    failed = None
    try:
        engine.start()
        sweep(engine)  # a project left by an interrupted earlier run
        images = Images(engine, work, args.base)
        images.prepare()
        sizes = images.sizes()
        for image, size in sizes.items():
            say(f"image {image:40s} {mib(size):>12s}")
        for name in args.only or list(SCENARIOS):
            start = time.monotonic()
            say(f"==== {name}")
            SCENARIOS[name](engine, images, work, results)
            say(f"==== {name}: passed in {time.monotonic() - start:.0f}s")
    except (Failure, AssertionError) as err:
        failed = err
        say(f"FAILED: {type(err).__name__}: {err}")
    finally:
        try:
            if engine.compose:
                sweep(engine)
            if images and args.remove_images:
                images.remove()
        finally:
            engine.stop()
            if args.keep_work or failed:
                say(f"work directory kept: {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
    passed = [n for n in (args.only or list(SCENARIOS)) if n in results]
    print(f"{len(passed)} passed, {int(failed is not None)} failed  "
          f"(make test-docker: {time.monotonic() - T0:.0f}s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
