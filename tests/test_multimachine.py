"""The documented "server on A, clients on B and C" procedure, run by hand on loopback.

docs/deployment.md, "## Across machines: server on A, clients on B and C": the
``flatflower certs`` command of "Once, on A", and the bash block of "### Without Docker" (plus
its prose: the ``export`` line every machine runs and the ``flatflower-a`` connection). The
commands are read from the markdown when the tests run, so the docs and this test cannot drift.
The only changes made to them are listed in :func:`substitutions` (and each must still match
the docs); the three "machines" are three home directories on this one.

Each command is expanded by bash exactly as a user's shell would (quoting, ``~``, ``$HOME``,
``C=...``) with that machine's ``HOME`` and the environment its ``export`` line leaves, then run
as a plain argument list, with this environment's ``bin`` directory first on ``PATH``.
Everything binds 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomli_w

from flatflower.runtime.certs import planned_files
from flatflower.runtime.engines.federation import COMPLETED, LocalFederation, free_port, is_loopback
from tests.helpers import flower_pids, markdown_section, metrics

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "deployment.md"
SECTION = "## Across machines: server on A, clients on B and C"
WITHOUT_DOCKER = "### Without Docker"
MACHINES = ("A", "B", "C")
NODE_OF = {"B": 0, "C": 1}  # machine -> partition / node key
ROUNDS = 2


# ------------------------------------------------------------------ reading the markdown


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^ *```bash\n(.*?)^ *```$", text, re.M | re.S)


@dataclass(frozen=True)
class Step:
    machine: str  # "A", "B", "C"
    text: str  # one logical shell line (continuations joined), as in the docs

    @property
    def argv(self) -> list[str]:
        """The words, unexpanded (for checks only; the real argv comes from bash)."""
        return shlex.split(self.text, comments=True)

    @property
    def is_assignment(self) -> bool:
        return bool(re.fullmatch(r"[A-Za-z_]\w*=\S*", self.text.split("#")[0].strip()))


def steps(block: str) -> list[Step]:
    """The block's command lines, each with the machine named by the last ``# A``/``# B ...``
    comment above it."""
    out, machine, pending = [], None, ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        if not line:
            continue
        if line.startswith("#"):
            found = re.match(r"#\s*([A-Z])\b", line)
            if found:
                machine = found.group(1)
            continue
        assert machine in MACHINES, f"command before any '# A'/'# B'/'# C' comment: {line!r}"
        out.append(Step(machine, line))
    return out


@dataclass(frozen=True)
class Procedure:
    certs: Step  # "Once, on A"
    export: str  # the line every machine runs first
    steps: list[Step]  # the "Without Docker" block
    connection: str  # the connection's name, as the prose gives it
    address: str  # its address
    ca_name: str  # "<absolute path>/<ca_name>"

    def of(self, machine: str) -> list[Step]:
        return [s for s in self.steps if s.machine == machine]

    def commands(self, program: str, *words: str) -> list[Step]:
        return [s for s in self.steps if not s.is_assignment
                and s.argv[:1 + len(words)] == [program, *words]]


def read_procedure(text: str | None = None) -> Procedure:
    section = markdown_section(text if text is not None else DOCS.read_text(), SECTION)
    once = section.split("\n### ", 1)[0]  # the part before "### With Docker"
    blocks = bash_blocks(once)
    assert len(blocks) == 1, f"{SECTION!r}: expected one bash block before its subsections"
    certs = [s for s in blocks[0].splitlines() if s.startswith("flatflower certs ")]
    assert len(certs) == 1, f"no single 'flatflower certs' line in {blocks[0]!r}"

    by_hand = markdown_section(section, WITHOUT_DOCKER)
    blocks = bash_blocks(by_hand)
    assert len(blocks) == 1, f"{WITHOUT_DOCKER!r}: expected one bash block, found {len(blocks)}"
    export = re.findall(r"`(export FLWR_HOME=[^`]+)`", by_hand)
    assert len(export) == 1, f"{WITHOUT_DOCKER!r}: no single `export FLWR_HOME=...` line"
    prose = " ".join(by_hand.split("```")[-1].split())  # the text after the block, one line
    conn = re.search(r"The connection `([\w.-]+)` in A's `\$FLWR_HOME/config\.toml` is "
                     r"`address = \"([^\"]+)\"` with `root-certificates = \"<absolute path>/"
                     r"([\w.-]+)\"`", prose)
    assert conn, f"{WITHOUT_DOCKER!r}: the sentence describing the connection is gone: {prose!r}"
    return Procedure(Step("A", certs[0]), export[0], steps(blocks[0]), *conn.groups())


# ------------------------------------------------------------------ the only changes made
@dataclass
class Loopback:
    """Where this machine puts what the docs spread over A, B and C."""

    root: Path
    control: int = field(default_factory=free_port)  # SuperLink Control/Runtime API (doc: 8000)
    fleet: int = field(default_factory=free_port)  # SuperLink Fleet API (doc: 9092)
    node_ports: dict[str, int] = field(  # each SuperNode's runtime API (doc: 9094 on B and C)
        default_factory=lambda: {m: free_port() for m in NODE_OF})

    def home(self, machine: str) -> Path:
        return self.root / machine

    @property
    def run_dir(self) -> Path:
        return self.home("A") / "runs" / "exp1"


def substitutions(lb: Loopback) -> dict[str, list[tuple[str, str]]]:
    """Every textual change made to the documented commands, per machine ("certs": the
    ``flatflower certs`` line; "connection": the prose's address). Each must match the docs
    at least once. Besides these, each machine's ``HOME`` is ``lb.home(machine)`` (so
    ``~/...``, ``$HOME/...`` and ``C=$HOME/...`` are directories under tmp_path)."""
    subs: dict[str, list[tuple[str, str]]] = {
        "certs": [("--host a.example.org --host 192.0.2.10", "--host 127.0.0.1")],
        "connection": [("127.0.0.1:8000", f"127.0.0.1:{lb.control}")],
        "A": [
            ("--port 8000", f"--port {lb.control}"),
            ("--fleet-api-address 0.0.0.0:9092", f"--fleet-api-address 127.0.0.1:{lb.fleet}"),
            ("num-server-rounds=20",
             f'num-server-rounds={ROUNDS} dataset="digits" model="mlp" local-epochs=1'),
            ('run-dir="/abs/path/runs/exp1"', f'run-dir="{lb.run_dir}"'),
        ],
    }
    for machine in NODE_OF:
        home = lb.home(machine)
        subs[machine] = [
            ("--superlink a.example.org:9092", f"--superlink 127.0.0.1:{lb.fleet}"),
            ("--port 9094", f"--port {lb.node_ports[machine]}"),
            ("--runtime-api-address 127.0.0.1:9094",
             f"--runtime-api-address 127.0.0.1:{lb.node_ports[machine]}"),
            ('data-dir="/data"', f'data-dir="{home / "data"}"'),
            ('state-dir="/var/lib/flatflower/state"', f'state-dir="{home / "state"}"'),
        ]
    return subs


# What must not be left in any command once substituted: other machines' addresses, any
# wildcard bind, and the docs' placeholder paths.
FORBIDDEN = ("0.0.0.0", "a.example.org", "192.0.2.10", "/abs/path", '"/data"', "/var/lib/")


def localize(proc: Procedure, subs: dict[str, list[tuple[str, str]]]) -> Procedure:
    """``proc`` with ``subs`` applied; fails if one of them no longer matches the docs."""
    def apply(key: str, text: str) -> str:
        for old, new in subs[key]:
            text = text.replace(old, new)
        return text

    groups = {"certs": [proc.certs.text], "connection": [proc.address],
              **{m: [s.text for s in proc.of(m)] for m in MACHINES}}
    for key, texts in groups.items():
        for old, _ in subs.get(key, []):
            assert any(old in t for t in texts), (
                f"docs changed: {old!r} no longer appears in the {key} commands {texts}")
    local = Procedure(Step("A", apply("certs", proc.certs.text)), proc.export,
                      [Step(s.machine, apply(s.machine, s.text)) for s in proc.steps],
                      proc.connection, apply("connection", proc.address), proc.ca_name)
    for text in (local.certs.text, local.address, *(s.text for s in local.steps)):
        bad = [f for f in FORBIDDEN if f in text]
        assert not bad, f"{bad} left in {text!r}"
    return local


# ------------------------------------------------------------------ unit test (no processes)
def test_the_documented_procedure_can_still_be_extracted(tmp_path):
    """A doc edit that breaks extraction (or a substitution target) fails here, loudly."""
    proc = read_procedure()
    assert proc.certs.argv[:5] == ["flatflower", "certs", "~/flatflower-certs", "--nodes", "2"]
    for var in ("FLWR_HOME=$HOME/", "FLWR_DISABLE_UPDATE_CHECK=1", "FLWR_TELEMETRY_ENABLED=0"):
        assert var in proc.export, var
    assert proc.connection == "flatflower-a" and proc.ca_name == "ca.crt"

    superlink = proc.commands("flower-superlink")
    assert len(superlink) == 1 and superlink[0].machine == "A"
    words = superlink[0].argv
    for flag in ("--enable-supernode-auth", "--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile",
                 "--fleet-api-address", "--port", "--database"):
        assert flag in words, flag
    assert "--insecure" not in words
    assert words[words.index("--host") + 1] == "127.0.0.1"  # Control API on loopback

    register = proc.commands("flwr", "supernode", "register")
    assert [s.machine for s in register] == ["A", "A"]
    assert [Path(s.argv[3]).name for s in register] == ["node-0.pub", "node-1.pub"]
    assert all(s.argv[4] == proc.connection for s in register)

    supernodes = proc.commands("flower-supernode")
    assert [s.machine for s in supernodes] == ["B", "C"]
    for step in supernodes:
        words = step.argv
        i = NODE_OF[step.machine]
        assert Path(words[words.index("--auth-supernode-private-key") + 1]).name == f"node-{i}"
        assert "--root-certificates" in words and "--insecure" not in words
        config = words[words.index("--node-config") + 1]
        assert f"partition-id={i} " in config and "num-partitions=2" in config
        assert words[words.index("--isolation") + 1] == "process"  # served by a warm worker

    secrets = proc.commands("flatflower-worker", "--create-secret")
    workers = [s for s in proc.commands("flatflower-worker") if s not in secrets]
    assert [s.machine for s in workers] == ["B", "C"] == [s.machine for s in secrets]
    for worker, node, secret in zip(workers, supernodes, secrets):  # each on its own SuperNode's runtime API
        port = node.argv[node.argv.index("--port") + 1]
        assert worker.argv[worker.argv.index("--runtime-api-address") + 1] == f"127.0.0.1:{port}"
        # the two authenticate each other with the node's own secret, made before either starts
        flag = "--superexec-auth-secret-file"
        assert node.argv[node.argv.index(flag) + 1] == worker.argv[worker.argv.index(flag) + 1] \
            == secret.argv[2]
        assert proc.steps.index(secret) < proc.steps.index(node)

    run = proc.commands("flwr", "run", ".")
    assert len(run) == 1 and run[0].machine == "A" and run[0].argv[3] == proc.connection
    assert "min-available-nodes=2" in run[0].argv[run[0].argv.index("-c") + 1]
    # the order a reader follows: SuperLink, registrations, SuperNodes, then the run
    order = [proc.steps.index(s) for s in (*superlink, *register, *supernodes, *run)]
    assert all(proc.steps.index(w) == proc.steps.index(n) + 1 for w, n in zip(workers, supernodes))
    assert order == sorted(order)

    local = localize(proc, substitutions(Loopback(tmp_path)))  # every substitution matches
    assert len(local.steps) == len(proc.steps)


def test_extraction_fails_loudly_on_a_broken_doc():
    text = DOCS.read_text()
    with pytest.raises(AssertionError, match="no heading"):
        read_procedure(text.replace(SECTION, "## Across machines"))
    with pytest.raises(AssertionError, match="connection is gone"):
        read_procedure(text.replace("The connection `flatflower-a` in A's", "A's connection"))
    proc = read_procedure(text.replace("--fleet-api-address 0.0.0.0:9092",
                                       "--fleet-api-address 0.0.0.0:9093"))
    with pytest.raises(AssertionError, match="no longer appears"):
        localize(proc, substitutions(Loopback(Path("/nonexistent"))))


# ------------------------------------------------------------------ running it
def _bash(script: str, env: dict[str, str]) -> list[str]:
    """What ``printf '%s\\0'`` prints in bash for ``script``: words as a shell expands them."""
    out = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], env=env,
                         capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


class Machines:
    """The three machines' shells: the ``export`` line, then their ``NAME=value`` lines."""

    def __init__(self, proc: Procedure, lb: Loopback, base_env: dict[str, str]):
        base = {k: v for k, v in base_env.items() if k not in ("BASH_ENV", "ENV", "FLWR_HOME")}
        self.env: dict[str, dict[str, str]] = {}
        for m in MACHINES:
            lb.home(m).mkdir(parents=True, exist_ok=True)
            lines = _bash(f"{proc.export}\nenv -0", {**base, "HOME": str(lb.home(m))})
            self.env[m] = dict(line.split("=", 1) for line in lines)
        self.assignments = {m: [s.text for s in proc.of(m) if s.is_assignment] for m in MACHINES}

    def argv(self, step: Step) -> list[str]:
        prefix = "\n".join(self.assignments[step.machine])
        return _bash(f"{prefix}\nprintf '%s\\0' {step.text}", self.env[step.machine])

    def run(self, step: Step, cwd: Path, timeout: float = 120) -> str:
        argv = self.argv(step)
        out = subprocess.run(argv, env=self.env[step.machine], cwd=cwd, capture_output=True,
                             text=True, timeout=timeout)
        assert out.returncode == 0, f"{argv} failed ({out.returncode}):\n{out.stdout}{out.stderr}"
        return out.stdout


def _listening(pids: set[int]) -> dict[int, list[tuple[str, int]]]:
    """pid -> the TCP (host, port) pairs it listens on (Linux /proc)."""
    sockets: dict[str, tuple[str, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A":  # LISTEN
                continue
            hex_ip, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_ip)
            if sys.byteorder == "little":  # /proc/net prints each 32-bit word in host order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw)
            ip = str(getattr(ip, "ipv4_mapped", None) or ip)  # gRPC's ::ffff:127.0.0.1
            sockets[cols[9]] = (ip, int(hex_port, 16))
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        found = [sockets[m.group(1)] for link in links
                 if (m := re.fullmatch(r"socket:\[(\d+)\]", link)) and m.group(1) in sockets]
        if found:
            out[pid] = found
    return out


def _ours(pid: int, marker: str) -> bool:
    """A process started under this test's homes (its FLWR_HOME or command line says so)."""
    try:
        proc = Path(f"/proc/{pid}")
        return marker.encode() in proc.joinpath("environ").read_bytes() + proc.joinpath(
            "cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_documented_server_on_a_clients_on_b_and_c_by_hand(tmp_path):
    t0 = time.monotonic()
    before = flower_pids()
    lb = Loopback(tmp_path)
    proc = localize(read_procedure(), substitutions(lb))
    logs = tmp_path / "logs"
    logs.mkdir()
    # The handle that stops everything (and waits on runs) the way every other deployment test
    # does; the processes themselves come from the docs' commands, not from LocalFederation.
    fed = LocalFederation(2, lb.home("A"), logs, tls=True)
    fed.http_port, fed.fleet_port = lb.control, lb.fleet
    machines = Machines(proc, lb, fed.env)
    for m in MACHINES:  # the docs' export line, and what every Flower process must get
        env = machines.env[m]
        assert env["FLWR_HOME"] == str(lb.home(m) / ".flwr-flatflower")
        assert env["FLWR_DISABLE_UPDATE_CHECK"] == "1" and env["FLWR_TELEMETRY_ENABLED"] == "0"
        assert env["PATH"].split(os.pathsep)[0] == fed.env["PATH"].split(os.pathsep)[0]
    fed.env, fed.connection = machines.env["A"], proc.connection  # `flwr ls/log/stop` run on A
    fed.flwr_home = Path(fed.env["FLWR_HOME"])
    marker = str(tmp_path)
    seen: set[int] = set()
    timeline: list[str] = []

    def spawn(name: str, step: Step):
        argv = machines.argv(step)
        with open(logs / f"{name}.log", "w") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                     env={**machines.env[step.machine], "PYTHONUNBUFFERED": "1"},
                                     cwd=lb.home(step.machine), start_new_session=True)
        fed.procs.append((name, popen))
        return argv

    try:
        # Once, on A: certificates and keys
        print(machines.run(proc.certs, cwd=lb.home("A")))
        ca, registered, run_id = None, {}, None
        # Then every line of the block, in the docs' order
        for step in proc.steps:
            words = step.argv
            if step.is_assignment:
                continue  # part of each later command's shell (Machines.argv)
            if words[0] == "flower-superlink":
                argv = spawn("superlink", step)
                ca = Path(argv[argv.index("--ssl-ca-certfile") + 1])
                assert ca.is_file() and ca.is_relative_to(lb.home("A"))
                fed.certs = planned_files(ca.parent, 2)
                fed._wait_health(30)
                with pytest.raises(OSError):  # TLS only: plain HTTP is not served
                    urllib.request.urlopen(f"http://127.0.0.1:{lb.control}/health", timeout=5)
                # A's connection, as the prose describes it
                fed.flwr_home.mkdir(parents=True, exist_ok=True)
                (fed.flwr_home / "config.toml").write_text(tomli_w.dumps({"superlink": {
                    proc.connection: {"address": proc.address,
                                      "root-certificates": str(ca.parent / proc.ca_name)}}}))
            elif words[0] == "flower-supernode":
                # copy ca.crt and only this node's key (keeping its 0600) to the machine
                home, argv = lb.home(step.machine), machines.argv(step)
                key = Path(argv[argv.index("--auth-supernode-private-key") + 1])
                root = Path(argv[argv.index("--root-certificates") + 1])
                assert key.is_relative_to(home) and root.is_relative_to(home)
                for src, dst in ((ca, root), (ca.parent / "nodes" / key.name, key)):
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dst)
                assert (key.stat().st_mode & 0o777) == 0o600
                (home / "data").mkdir(exist_ok=True)  # the node's data-dir
                spawn(f"supernode-{step.machine}", step)
            elif words[:2] == ["flatflower-worker", "--create-secret"]:  # the node's secret
                machines.run(step, cwd=lb.home(step.machine))
                secret = Path(machines.argv(step)[2])
                assert secret.is_relative_to(lb.home(step.machine))
                assert (secret.stat().st_mode & 0o777) == 0o600
            elif words[0] == "flatflower-worker":  # the node's warm ClientApp worker
                spawn(f"worker-{step.machine}", step)
            elif words[:3] == ["flwr", "supernode", "register"]:
                out = machines.run(step, cwd=lb.home(step.machine))
                found = re.search(r"SuperNode (\d+) registered", out)
                assert found, out
                registered[words[words.index("--name") + 1]] = int(found.group(1))
            elif words[:3] == ["flwr", "run", "."]:  # from the checkout
                run_id = int(json.loads(machines.run(step, cwd=ROOT))["run-id"])
            else:  # anything else the docs say to run (e.g. mkdir)
                machines.run(step, cwd=lb.home(step.machine))
            timeline.append(f"{time.monotonic() - t0:5.1f} s  {step.machine}: "
                            f"{' '.join(words[:3])}")
        assert sorted(registered) == ["node-0", "node-1"] and run_id is not None

        checked: list[dict] = []

        def on_poll():
            fed._check_alive()  # SuperLink and both SuperNodes stay up
            if not checked and all("SuperNode ID" in (logs / f"supernode-{m}.log").read_text()
                                   for m in NODE_OF):
                seen.update(fed.pids())
                checked.append(_listening(seen))

        row = fed.wait(run_id, 150, poll=1.0, on_poll=on_poll)
        timeline.append(f"{time.monotonic() - t0:5.1f} s  A: run {row['status']}")
        seen.update(fed.pids())
        listening = _listening(seen)
        fed.save_log(run_id, logs / "run.log")
    finally:
        seen.update(fed.pids())
        fed.stop()
        print("\n".join(timeline))
    elapsed = time.monotonic() - t0

    # nothing of ours is left; other Flower processes (e.g. a concurrent session's) are ignored
    left = {p for p in flower_pids() - before if p in seen or _ours(p, marker)}
    assert not left, f"Flower processes left behind: {left}"

    assert row["status"] == COMPLETED, (row, (logs / "run.log").read_text()[-3000:])
    # bound loopback only, on the substituted ports
    for snapshot in (*checked, listening):
        addrs = {a for found in snapshot.values() for a in found}
        assert all(is_loopback(ip) for ip, _ in addrs), addrs
        assert {lb.control, lb.fleet, *lb.node_ports.values()} <= {port for _, port in addrs}, (
            addrs, lb)
    superlink_log = (logs / "superlink.log").read_text()
    assert f"127.0.0.1:{lb.fleet}" in superlink_log and "0.0.0.0" not in superlink_log
    assert superlink_log.count("[Fleet.ActivateNode] Activated node_id=") == 2
    # B authenticated with node-0, C with node-1: the ids they were registered with
    for machine, i in NODE_OF.items():
        node_log = (logs / f"supernode-{machine}.log").read_text()
        assert f"SuperNode ID: {registered[f'node-{i}']}" in node_log, machine
    # the run: both clients trained in every round, numbers finite, final model written
    run_dir = lb.run_dir
    assert (run_dir / "model_final.pt").is_file()
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert (config["algorithm"], config["num-server-rounds"], config["min-available-nodes"]) == (
        "fedsam", ROUNDS, 2)
    rows = metrics(run_dir)
    assert [r["round"] for r in rows] == list(range(ROUNDS + 1))
    for r in rows[1:]:
        assert sorted(r["sampled_partitions"]) == [0, 1] and r["clients_replied"] == 2, r
        assert not r["failed_partitions"] and r["clients_rejected"] == 0, r
        assert all(math.isfinite(r[k]) for k in ("test_accuracy", "test_loss", "train_loss")), r
    assert 0 <= rows[-1]["test_accuracy"] <= 1
    print(f"by-hand federation: run {row['elapsed']} s in Flower, test {elapsed:.1f} s wall; "
          f"accuracy {rows[0]['test_accuracy']:.3f} -> {rows[-1]['test_accuracy']:.3f}")
