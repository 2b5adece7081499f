"""Another user of a node's machine cannot act as the node's ClientApp, nor as its SuperNode
(issue 44, item 5; runtime/appauth.py, docs/deployment.md "Who can act as a node").

The attacks run as another uid (``setpriv --reuid 65534``, user ``nobody``), so these tests need
root to switch users; as any other user they are skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flatflower.runtime import appauth
from tests.helpers import ROOT, fast_config, metrics, round_deadline

NOBODY = 65534
ROUNDS = 4
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="runs the attacker as another uid: needs root and setpriv")


def as_nobody(cmd: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]


def nobody_env(home: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home), "FLWR_HOME": str(home / ".flwr")}


def shared_dir() -> Path:
    """A directory the other user can write its findings to (removed by the caller)."""
    path = Path(tempfile.mkdtemp(prefix="flatflower-nobody-"))
    path.chmod(0o777)
    return path


# ---------------------------------------------------------------- the secret file
def test_a_new_secret_is_private_random_and_kept(tmp_path):
    path = tmp_path / "node" / "app.secret"
    assert appauth.create_secret(path) is True
    first = path.read_bytes()
    assert len(first) == 2 * appauth.SECRET_BYTES and int(first, 16) >= 0  # 256 bits, hex
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert appauth.read_secret(path) == first  # the exact bytes Flower's SuperNode reads
    assert appauth.create_secret(path) is False and path.read_bytes() == first  # kept
    other = tmp_path / "other.secret"
    appauth.create_secret(other)
    assert other.read_bytes() != first


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_secret_other_users_could_read_or_write_is_refused_in_one_line(tmp_path, mode):
    path = tmp_path / "app.secret"
    appauth.create_secret(path)
    path.chmod(mode)
    with pytest.raises(appauth.AppAuthError, match=rf"has mode {mode:04o}: other users can read it"):
        appauth.read_secret(path)
    with pytest.raises(appauth.AppAuthError):  # not kept silently either
        appauth.create_secret(path)


def test_a_missing_empty_or_foreign_secret_is_refused(tmp_path):
    with pytest.raises(appauth.AppAuthError, match="cannot read the SuperExec auth secret .*missing"):
        appauth.read_secret(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.touch(mode=0o600)
    with pytest.raises(appauth.AppAuthError, match="is empty"):
        appauth.read_secret(empty)
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        appauth.create_secret(foreign)
        os.chown(foreign, NOBODY, NOBODY)
        with pytest.raises(appauth.AppAuthError, match=f"belongs to uid {NOBODY}, not to this user"):
            appauth.read_secret(foreign)


def test_the_worker_refuses_a_readable_secret_before_starting(tmp_path):
    path = tmp_path / "app.secret"
    made = subprocess.run([sys.executable, "-m", "flatflower.runtime.worker", "--create-secret", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and made.stderr == f"flatflower-worker: wrote a new secret {path}\n"
    path.chmod(0o644)
    out = subprocess.run([sys.executable, "-m", "flatflower.runtime.worker", "--runtime-api-address", "127.0.0.1:1",
                          "--insecure", "--superexec-auth-secret-file", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [f"error: the SuperExec auth secret {path} has mode 0644: other "
                                       "users can read it; chmod 600 it (and make a new secret)"]


# ---------------------------------------------------------------- who serves the Runtime API
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_runtime_api_of_this_user_passes_and_nothing_listening_does_not():
    with socket.socket() as ours:
        ours.bind(("127.0.0.1", 0))
        ours.listen()
        port = ours.getsockname()[1]
        appauth.check_listener(f"127.0.0.1:{port}")
        appauth.check_listener(f"localhost:{port}")
        with pytest.raises(appauth.AppAuthError, match=r"nothing listens on the Runtime API at \[::1\]"):
            appauth.check_listener(f"[::1]:{port}")  # another address: not this socket
    with pytest.raises(appauth.AppAuthError, match="nothing listens"):
        appauth.check_listener(f"127.0.0.1:{port}")
    appauth.check_listener("supernode-0:9094")  # another host: its TLS / network vouch for it


@needs_root
@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0", "::"])
def test_a_runtime_api_port_taken_by_another_user_is_refused(bind):
    """Another user who binds the port first (before the SuperNode starts, or while it
    restarts) is named, and no task is taken from it."""
    port = _free_port()
    squatter = subprocess.Popen(as_nobody([sys.executable, "-c", (
        "import socket, sys, time\n"
        f"s = socket.socket(socket.AF_INET6 if ':' in {bind!r} else socket.AF_INET)\n"
        f"s.bind(({bind!r}, {port})); s.listen(); print('ok', flush=True); time.sleep(60)")]),
        stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "ok"
        assert appauth.listener_uids(*appauth._loopback_target(f"127.0.0.1:{port}")) == {NOBODY}
        with pytest.raises(appauth.AppAuthError, match=(
                rf"the Runtime API at 127\.0\.0\.1:{port} is served by uid {NOBODY}, not by this "
                r"worker's user \(uid 0\): refusing to take tasks from it")):
            appauth.check_listener(f"127.0.0.1:{port}")
    finally:
        squatter.kill()
        squatter.wait(30)


# ---------------------------------------------------------------- the attack of issue 44
def _runtime_port(fed, name: str) -> int:
    args = dict(fed.procs)[name].args
    return int(args[args.index("--port") + 1])


def attack_during_a_run(tmp_path: Path, seconds_budget: float, **fed_kwargs) -> tuple[dict, list, dict]:
    """A 2-node, ROUNDS-round run on loopback; once node 0 has answered the partition handshake (its
    log says it sent the reply), two attackers, as ``nobody``, poll node 0's Runtime API for tasks (one
    unsigned, one signing with a guessed secret) until the run ends. Returns the run's status
    row, its metrics rows and what each attacker got."""
    from flatflower.runtime.engines.federation import LocalFederation

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    config = {**fast_config(num_server_rounds=ROUNDS), "round-timeout": round_deadline(),
              "min-available-nodes": 2, "num-partitions": 2, "run-dir": str(run_dir)}
    share = shared_dir()
    attackers: dict[str, subprocess.Popen] = {}
    try:
        with LocalFederation(2, tmp_path / "work", run_dir / "logs", **fed_kwargs) as fed:
            address = f"127.0.0.1:{_runtime_port(fed, 'supernode-0')}"
            for kind, forged in (("unsigned", []), ("forged", [os.urandom(32).hex()])):
                attackers[kind] = subprocess.Popen(as_nobody(
                    [sys.executable, "-m", "tests.appio_attack", address, str(seconds_budget),
                     str(share / f"{kind}.json"), *forged]), cwd=ROOT, env=nobody_env(share))
            started: list[bool] = []

            def attack():  # the train rounds' tasks, with the global model, are what they want
                log = run_dir / "logs" / "supernode-0.log"
                if not started and "Sending: query message" in log.read_text(errors="replace"):
                    started.append(True)
                    for kind in attackers:
                        (share / f"{kind}.json.go").touch()

            run_id = fed.submit(ROOT, config)
            row = fed.wait(run_id, seconds_budget, poll=0.2, on_poll=attack)
            for kind, proc in attackers.items():  # stopped while the SuperNode still answers
                (share / f"{kind}.json.stop").touch()
                proc.wait(120)
        found = {kind: json.loads((share / f"{kind}.json").read_text()) for kind in attackers}
    finally:
        for proc in attackers.values():
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(share, ignore_errors=True)
    rows = metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return row, rows, found


@needs_root
@pytest.mark.integration
@pytest.mark.slow
def test_another_user_cannot_take_a_nodes_task_and_the_run_is_unharmed(tmp_path):
    """Issue 44: as another uid, a script took all of one node's train tasks, read the global
    model every round and made that node fail every round. Now every request it makes for a
    task (at ten times the worker's rate) is refused (unsigned, or signed with a guessed secret), it gets no task token (so it
    reads nothing), and the run completes with both nodes' updates in every round."""
    assert_every_request_refused(*attack_during_a_run(tmp_path, seconds_budget=4 * round_deadline()))


def assert_every_request_refused(row: dict, rows: list, found: dict) -> None:
    """:func:`attack_during_a_run`'s outcome when the node's runtime API holds: the run completes
    with both nodes in every round, and the attackers, who kept asking, got nothing."""
    from flatflower.runtime.engines.federation import COMPLETED

    assert row["status"] == COMPLETED, row
    assert [r["round"] for r in rows] == list(range(ROUNDS + 1)) and set(found) == {"unsigned", "forged"}
    for r in rows[1:]:
        assert (r["clients_sampled"], r["clients_replied"], r["clients_rejected"]) == (2, 2, 0), r
    for kind, seen in found.items():
        assert seen["tasks"] == seen["models_read"] == seen["failed_pushed"] == 0, (kind, seen)
        assert seen["refused"] == seen["requests"] > 10, (kind, seen)  # it kept asking
        assert all("401 Unauthorized" in err for err in seen["errors"]), (kind, seen)
