"""A deployed round without Flower's waits: the warm ClientApp worker (runtime/worker.py), the
opt-in fast poll of the pinned Flower (common/fastpoll.py), and node errors on the operator's
screen. The deployment-equals-in-process tests (test_engines, test_reliability,
test_security) run in the warm mode, the default; test_engines also runs the stock mode and
the fast poll."""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from flwr.app import Error

from flatflower.common import fastpoll
from flatflower.strategies.participation import error_text
from tests.helpers import ROOT, flower_pids, round_deadline
from flatflower.tools.cli import main as cli
from flatflower.runtime.engines.federation import FederationError, LocalFederation, free_port


# ---------------------------------------------------------------- fast poll (no processes)
def test_fast_poll_is_refused_on_any_other_flower_version(monkeypatch, tmp_path):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.40.0")
    with pytest.raises(fastpoll.FastPollError, match=r"flwr 1\.39\.0 .*refused with flwr 1\.40\.0; "
                                                     r"run without --fast-poll"):
        fastpoll.check_version()
    with pytest.raises(FederationError, match="refused with flwr 1.40.0"):
        LocalFederation(1, tmp_path / "w", tmp_path / "logs", fast_poll=True)


def test_the_waits_fast_poll_shortens_are_in_the_pinned_flower():
    """The patch swaps the ``time`` of Flower's SuperNode loop and the backoff defaults of its
    object pulls: the sleeps it maps must be the ones that module makes, or it changes nothing."""
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supernode import start_client_internal

    source = inspect.getsource(start_client_internal)
    for wait in fastpoll.WAITS:
        assert f"time.sleep({wait})" in source, f"flwr's SuperNode no longer sleeps {wait} s"
    for fn in (inflatable_utils.pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        assert set(fastpoll.BACKOFF) <= set(fn.__kwdefaults__), fn.__name__
    patched = subprocess.run(
        [sys.executable, "-c", "from common import fastpoll; fastpoll.patch_supernode()\n"
         "from flwr.supernode import start_client_internal as s\n"
         "from flwr.supercore.inflatable import inflatable_utils as u\n"
         "import time; t0 = time.monotonic(); s.time.sleep(3); print(round(time.monotonic() - t0))\n"
         "print(u.pull_objects.__kwdefaults__['initial_backoff'], s.time.monotonic is time.monotonic)"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert patched.returncode == 0, patched.stderr
    assert patched.stdout.split() == ["0", str(fastpoll.BACKOFF["initial_backoff"]), "True"]


# ---------------------------------------------------------------- node errors
def test_a_clientapp_exception_is_shown_as_type_and_message_bounded_and_clean():
    reply = SimpleNamespace(error=Error(code=2, reason="<class 'ValueError'>:<'partition 1: device="
                                                       "'cuda:0' requested but CUDA is not available'>"))
    assert error_text(reply) == ("error 2: ValueError: partition 1: device='cuda:0' requested but CUDA "
                                 "is not available")
    text = error_text(SimpleNamespace(error=Error(code=2, reason="\x1b[2J" + "x" * 10_000 + "\n\rfake line")))
    assert len(text) < 1_000 and "\x1b" not in text and "\n" not in text and "\r" not in text


@pytest.mark.integration
@pytest.mark.slow
def test_a_node_error_fails_the_run_at_once_on_the_operators_screen(tmp_path, capsys, monkeypatch):
    """`flatflower local --device cuda:0` where the nodes have no GPU: each node's handshake
    raises; the reason, with the partition, is printed and the run fails at once, not after
    node-wait-timeout (an hour here, far beyond the command's own timeout). The command's own
    check of --device (which refuses it at once on this machine, tests/test_bad_input.py) is
    bypassed: it stands for an operator's machine that has the GPU its SuperNodes lack."""
    monkeypatch.setattr("flatflower.tools.commands.check_device", lambda device: None)
    before = flower_pids()
    timeout = int(4 * round_deadline())
    code = cli(["local", "--algorithm", "fedavg", "--clients", "2", "--rounds", "2", "--dataset", "digits",
                "--device", "cuda:0", "--set", "node-wait-timeout=3600", "--timeout", str(timeout),
                "--run-dir", str(tmp_path / "run")])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 1, out
    assert "no node passed the partition handshake" in out, out
    for partition in (0, 1):
        assert (f"ValueError: partition {partition}: device='cuda:0' requested but CUDA is not "
                "available on this node") in out, out
    assert "timed out" not in out
    assert flower_pids() - before == set(), "Flower processes left behind"


# ---------------------------------------------------------------- the worker's process tree
def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def _workers_of(*supervisors: subprocess.Popen) -> dict[int, int]:
    """supervisor pid -> its worker's pid, once each supervisor has started one (or as many as
    started within the deadline)."""
    children: dict[int, int] = {}
    deadline = time.monotonic() + 10 * round_deadline()
    while len(children) < len(supervisors) and time.monotonic() < deadline:
        for proc in supervisors:
            found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            if found:
                children[proc.pid] = int(found[0])
        time.sleep(0.2)
    return children


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.integration
@pytest.mark.slow
def test_the_worker_never_outlives_its_supervisor_or_its_supernode(tmp_path):
    """The supervisor (flatflower-worker) runs the worker as a child; the child ends with the
    supervisor (killed as a whole by nothing else), and both end with the SuperNode pid given."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "flatflower.runtime.worker", "--runtime-api-address", f"127.0.0.1:{free_port()}",
         "--insecure"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = subprocess.Popen(
        [sys.executable, "-m", "flatflower.runtime.worker", "--runtime-api-address", f"127.0.0.1:{free_port()}",
         "--insecure", "--parent-pid", str(stand_in.pid)], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: dict[int, int] = {}
    try:
        children = _workers_of(supervisor, second)
        assert len(children) == 2, "the supervisors started no worker"
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait(30)
        assert _wait_gone(children[supervisor.pid], round_deadline()), "worker outlived its supervisor"
        stand_in.kill()
        stand_in.wait(30)
        assert second.wait(round_deadline()) == 0
        assert _wait_gone(children[second.pid], round_deadline()), "worker outlived its SuperNode"
    finally:
        for proc in (supervisor, second, stand_in):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for child in children.values():
            if not _gone(child):
                os.kill(child, signal.SIGKILL)


@pytest.mark.integration
@pytest.mark.slow
def test_sigterm_stops_the_supervisor_and_its_worker_at_once():
    """`docker stop` sends SIGTERM to the container's PID 1, the supervisor: it passes it on to
    the worker and exits 0, well before Docker's 10 s stop timeout would SIGKILL it (the
    compose e2e run saw exit code 137 before the supervisor handled the signal)."""
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "flatflower.runtime.worker", "--runtime-api-address", f"127.0.0.1:{free_port()}",
         "--insecure"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        worker = _workers_of(supervisor).get(supervisor.pid)
        assert worker, "the supervisor started no worker"
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(round_deadline()) == 0
        assert _wait_gone(worker, round_deadline()), "the worker outlived a stopped supervisor"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait(30)
        if worker and not _gone(worker):
            os.kill(worker, signal.SIGKILL)


# ---------------------------------------------------------------- what the worker says
def _wait_for_line(path, needle: str, seconds: float) -> str:
    """The first line of file ``path`` that holds ``needle``, once it is there ('' at the deadline)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            found = [line for line in path.read_text().splitlines() if needle in line]
            if found:
                return found[0]
        time.sleep(0.2)
    return ""


@pytest.mark.integration
@pytest.mark.slow
def test_the_worker_says_where_it_connected_and_where_it_cannot(tmp_path):
    """flatflower-worker prints one line when it reaches its SuperNode's Runtime API, and its
    retries name the address it cannot reach (Flower's own say "Connection attempt failed")."""
    port = free_port()
    log = tmp_path / "lonely.log"
    with open(log, "w") as out:
        lonely = subprocess.Popen([sys.executable, "-m", "flatflower.runtime.worker", "--runtime-api-address",
                                   f"127.0.0.1:{port}", "--insecure"], cwd=ROOT, stdout=out, stderr=out)
    try:
        line = _wait_for_line(log, "cannot reach", round_deadline())
        assert line == (f"flatflower-worker: cannot reach the SuperNode's Runtime API at 127.0.0.1:{port}; "
                        f"retrying in {line.rsplit(' ', 2)[-2]} s"), log.read_text()
    finally:
        lonely.terminate()
        lonely.wait(30)
    with LocalFederation(1, tmp_path / "work", tmp_path / "logs"):
        line = _wait_for_line(tmp_path / "logs" / "supernode-0-worker.log", "connected", round_deadline())
    assert re.fullmatch(r"flatflower-worker: connected to the SuperNode's Runtime API at 127\.0\.0\.1:\d+",
                        line), line
