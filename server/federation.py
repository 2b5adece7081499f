"""Real Flower processes on 127.0.0.1: a SuperLink, N SuperNodes, and the ``flwr`` CLI.

``LocalFederation`` starts ``flower-superlink`` (gRPC Fleet API on its own port, HTTP
Control/Runtime API on another) and one ``flower-supernode`` per client, each with its
``--node-config "partition-id=i num-partitions=N"``, all bound to loopback on free ports and
with a private ``FLWR_HOME``. With ``simulation=True`` it starts a simulation SuperLink
instead (no SuperNodes; Flower's Ray engine runs the clients). Runs are submitted with
``flwr run`` and judged by ``flwr ls`` (``flwr run --stream`` exits 0 even on failure).
Every process it started, and their children, are stopped by PID on exit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import tomli_w

FINISHED = "finished"
COMPLETED = "finished:completed"


class FederationError(RuntimeError):
    """A Flower process failed to start or a ``flwr`` command failed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_command(name: str) -> str:
    """Path of a Flower console script, preferring the running interpreter's environment."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise FederationError(f"'{name}' not found: is flwr installed in this environment?")
    return found


def _children(pid: int) -> list[int]:
    """All descendants of ``pid`` (Linux /proc; empty elsewhere)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class LocalFederation:
    """A SuperLink and ``num_nodes`` SuperNodes (or a simulation SuperLink) on loopback."""

    def __init__(self, num_nodes: int, work_dir: Path, log_dir: Path, *, simulation: bool = False,
                 node_config: Mapping[str, Any] | None = None):
        self.num_nodes = num_nodes
        self.simulation = simulation
        self.node_config = dict(node_config or {})
        self.work_dir = Path(work_dir).resolve()
        self.log_dir = Path(log_dir).resolve()
        self.flwr_home = self.work_dir / "flwr_home"
        self.http_port = free_port()
        self.fleet_port = free_port()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.env = {**os.environ, "FLWR_HOME": str(self.flwr_home), "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_TELEMETRY_ENABLED": "0", "PYTHONUNBUFFERED": "1",
                    # Flower starts flower-superexec / flwr-clientapp by name: use our environment's
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
        self.connection = "flatflower"

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log_file = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=self.env,
                                cwd=self.work_dir, start_new_session=True)
        log_file.close()
        self.procs.append((name, proc))
        return proc

    def _check_alive(self, only: str | None = None) -> None:
        for name, proc in self.procs:
            if only and name != only:
                continue
            if proc.poll() is not None:
                raise FederationError(
                    f"{name} exited with code {proc.returncode}; last log lines "
                    f"({self.log_dir / (name + '.log')}):\n{_tail(self.log_dir / (name + '.log'))}")

    def start(self, timeout: float = 60.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        cmd = [flower_command("flower-superlink"), "--insecure", "--isolation", "subprocess",
               "--disable-runtime-dependency-installation",
               "--database", str(self.work_dir / "superlink.db"),
               "--host", "127.0.0.1", "--port", str(self.http_port)]
        cmd += ["--simulation"] if self.simulation else [
            "--fleet-api-address", f"127.0.0.1:{self.fleet_port}"]
        self._spawn("superlink", cmd)
        self._wait_health(timeout)
        for i in range(0 if self.simulation else self.num_nodes):
            config = {"partition-id": i, "num-partitions": self.num_nodes, **self.node_config}
            self._spawn(f"supernode-{i}", [
                flower_command("flower-supernode"), "--insecure", "--grpc-rere",
                "--superlink", f"127.0.0.1:{self.fleet_port}", "--port", str(free_port()),
                "--node-config", " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())])
        self._write_connection()

    def _wait_health(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.http_port}/health"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise FederationError(f"SuperLink not healthy after {timeout:.0f}s; see {self.log_dir}")

    def _write_connection(self) -> None:
        config = {"superlink": {self.connection: {
            "address": f"127.0.0.1:{self.http_port}", "insecure": True}}}
        (self.flwr_home / "config.toml").write_text(tomli_w.dumps(config))

    def stop(self, grace: float = 10.0) -> None:
        """Stop every process started here and all their children (SIGTERM, then SIGKILL)."""
        for name, proc in reversed(self.procs):
            family = [proc.pid, *_children(proc.pid)]
            _signal(family, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(_alive(p) for p in family):
                proc.poll()
                time.sleep(0.1)
            _signal([p for p in family if _alive(p)], signal.SIGKILL)
            proc.wait(timeout=grace)
        self.procs.clear()

    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ flwr CLI
    def flwr(self, *args: str, timeout: float = 120.0) -> str:
        cmd = [flower_command("flwr"), *args]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, env=self.env,
                                 cwd=self.work_dir, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise FederationError(f"'flwr {' '.join(args)}' timed out after {timeout:.0f}s") from None
        if out.returncode != 0:
            raise FederationError(f"'flwr {' '.join(args)}' failed ({out.returncode}):\n"
                                  f"{out.stdout[-2000:]}{out.stderr[-2000:]}")
        return out.stdout

    def submit(self, app_dir: Path, run_config: Mapping[str, Any],
               federation_config: Mapping[str, Any] | None = None) -> int:
        """``flwr run`` the app with the given run config; returns the run id."""
        overrides = self.work_dir / "run_config.toml"
        overrides.write_text(tomli_w.dumps(dict(run_config)))
        args = ["run", str(app_dir), self.connection, "--format", "json", "-c", str(overrides)]
        if federation_config:
            args += ["--federation-config",
                     " ".join(f"{k}={json.dumps(v)}" for k, v in federation_config.items())]
        out = self.flwr(*args)
        try:
            return int(json.loads(out)["run-id"])
        except (ValueError, KeyError):
            raise FederationError(f"unexpected 'flwr run' output:\n{out}") from None

    def status(self, run_id: int) -> dict[str, Any]:
        """The run's row of ``flwr ls --run-id`` (status, status-details, elapsed, ...)."""
        out = json.loads(self.flwr("ls", self.connection, "--run-id", str(run_id), "--format", "json"))
        return out["runs"][0]

    def wait(self, run_id: int, timeout: float, poll: float = 2.0,
             on_poll: Callable[[], None] | None = None) -> dict[str, Any]:
        """Poll until the run finishes; stop it and raise after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if on_poll:
                on_poll()
            row = self.status(run_id)
            if str(row.get("status", "")).startswith(FINISHED):
                return row
            if time.monotonic() > deadline:
                self.flwr("stop", str(run_id), self.connection)
                raise FederationError(f"run {run_id} did not finish within {timeout:.0f}s; stopped it")
            self._check_alive(only="superlink")  # a lost SuperNode is the strategy's business
            time.sleep(poll)

    def save_log(self, run_id: int, path: Path) -> None:
        try:
            path.write_text(self.flwr("log", str(run_id), self.connection, "--show", timeout=60))
        except FederationError as err:
            path.write_text(f"could not fetch the run log: {err}\n")
