"""Shared runners and checks of the test suite (one import style: ``from tests.helpers import ...``)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import MessageType

from flatflower.client.app import app as client_app
from flatflower.client.batch import ModelBatch
from flatflower.client.state import latest
from flatflower.common import protocol as P
from flatflower.strategies import registry
from flatflower.common.config import RunConfig
from flatflower.common.data import dataset_for
from flatflower.common.models import build_model
from flatflower.server.run import run_server
from tests.reference import K, LR, Problem
from flatflower.runtime.engines.inprocess import InProcessGrid, run_inprocess


# ---------------------------------------------------------------- quick run configs
FAST = {
    "dataset": "synthetic",  # in memory, no files, no network
    "model": "logreg",
    "partition": "iid",
    "local-steps": 2,
    "batch-size": 64,
    "num-server-rounds": 2,
}


def fast_config(**overrides: Any) -> dict[str, Any]:
    """Run-config keys for a quick run; ``overrides`` use underscores for dashes.

    >>> fast_config(local_steps=3, run_dir="/tmp/x")["local-steps"]
    3
    """
    return {**FAST, **{k.replace("_", "-"): v for k, v in overrides.items()}}


# ---------------------------------------------------------------- run directories and Flower processes
FLOWER_PROCESSES = ("flower-superlink", "flower-supernode", "flower-superexec",
                    "flwr-serverapp", "flwr-clientapp", "flwr-simulation")


RUN_FILES = ("config.json", "partition.json", "metrics.jsonl", "model_init.pt",
             "model_final.pt", "summary.json")


ROUND_FIELDS = ("round", "test_accuracy", "test_loss", "train_loss", "clients_sampled",
                "clients_replied", "clients_rejected", "bytes_down", "bytes_up", "seconds")


def flower_pids() -> set[int]:
    """Flower processes started by this pytest process (they inherit its
    ``FLATFLOWER_TEST_PROCESS``, see conftest)."""
    tag = f"FLATFLOWER_TEST_PROCESS={os.environ['FLATFLOWER_TEST_PROCESS']}".encode()
    pids = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            if any(name in cmd for name in FLOWER_PROCESSES) and \
                    tag in (entry / "environ").read_bytes().split(b"\0"):
                pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_run_dir(run_dir: Path, rounds: int, clients: int, num_train: int) -> list[dict]:
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), f"{name} missing from {run_dir}"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["num-server-rounds"] == rounds and "versions" in config
    parts = json.loads((run_dir / "partition.json").read_text())["partitions"]
    assert len(parts) == clients
    all_idx = np.concatenate([np.array(p) for p in parts.values()])
    assert len(all_idx) == num_train == len(set(all_idx.tolist()))  # disjoint and complete
    rows = metrics(run_dir)
    assert [r["round"] for r in rows] == list(range(rounds + 1))
    for row in rows[1:]:
        assert all(field in row for field in ROUND_FIELDS)
        assert row["bytes_down"] > 0 and row["bytes_up"] > 0
    init, final = (torch.load(run_dir / f) for f in ("model_init.pt", "model_final.pt"))
    assert init.keys() == final.keys()
    return rows


DIGITS = {"dataset": "digits", "model": "mlp", "partition": "dirichlet", "local-epochs": 2}


ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the tiny deterministic problem the algorithm tests run (references: tests/reference.py)
FIRST_NODE = 1000  # InProcessGrid's node id of partition 0


PARTIAL = {"num_clients": 4, "fraction-train": 0.5, "num-server-rounds": 3}


def run(tmp_path, name, num_clients=3, **overrides) -> dict:
    """Run the real ServerApp + ClientApps in-process; ``overrides`` are run-config keys.

    Returns the initial and final global models, the partitions, the run config, the
    training rows of metrics.jsonl (round >= 1, each with ``sampled_partitions``), the run
    directory and the in-process grid (whose node contexts hold the clients' state).
    """
    cfg = {
        "dataset": "synthetic", "model": "logreg", "partition": "iid", "seed": 3,
        "local-steps": K, "batch-size": 100_000, "lr": LR, "num-server-rounds": 2,
        "run-dir": str(tmp_path / name), **overrides,
    }
    run_dir, grid = run_inprocess(cfg, num_clients=num_clients)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    return {
        "init": torch.load(run_dir / "model_init.pt"),
        "final": torch.load(run_dir / "model_final.pt"),
        "parts": json.loads((run_dir / "partition.json").read_text())["partitions"],
        "cfg": {**cfg},
        "rows": [row for row in rows if row["round"] >= 1],
        "run_dir": run_dir,
        "grid": grid,
        "num_clients": num_clients,
    }


def assert_matches(result, expected):
    got = [v.double().numpy() for v in result["final"].values()]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-6)
    # and training moved the model: the check is not vacuous
    init = [v.double().numpy() for v in result["init"].values()]
    assert max(np.abs(g - i).max() for g, i in zip(got, init)) > 1e-2


def matches(result, prob, expected: np.ndarray) -> None:
    """Final global model == reference to 1e-6, and training moved the model."""
    assert_matches(result, prob.unflat(expected))


def client_state(result, partition: int, record: str, prob: Problem) -> np.ndarray:
    """A client's persistent record (flat float64); zeros if it never wrote one."""
    state = latest(result["grid"].contexts[FIRST_NODE + partition])
    if record not in state:
        return prob.zeros()
    return prob.flat(v.double().numpy() for v in state[record].values())


def assert_client_duals(result, prob, expected: dict[int, np.ndarray]) -> None:
    for i in range(prob.N):
        np.testing.assert_allclose(client_state(result, i, P.DUAL, prob), expected[i], rtol=0, atol=1e-6)


def assert_partial(prob) -> None:
    """The sampling really is partial and some client trains twice (so h_i persists)."""
    assert all(len(s) < prob.N for s in prob.rounds)
    trained = [i for s in prob.rounds for i in s]
    assert len(set(trained)) < len(trained)


def finals_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a["final"][k], b["final"][k]) for k in a["final"])


def assert_close_models(a: dict, b: dict, atol=1e-6) -> None:
    for k in a["final"]:
        torch.testing.assert_close(a["final"][k], b["final"][k], rtol=0, atol=atol)


def assert_differ(a: dict, b: dict, min_diff=1e-4) -> None:
    """Guard: the two runs differ by far more than the tolerance of the identities."""
    diff = max(float((a["final"][k] - b["final"][k]).abs().max()) for k in a["final"])
    assert diff > min_diff, diff


def server_dual(seen) -> np.ndarray:
    return Problem.flat(v.double().numpy() for v in seen["rule"].records[P.DUAL].values())


def server_record(seen, name: str) -> np.ndarray:
    return Problem.flat(v.double().numpy() for v in seen["strategy"].rule.records[name].values())


def assert_state(result, prob, record, expected):
    for i in range(prob.N):
        np.testing.assert_allclose(client_state(result, i, record, prob), expected.get(i, prob.zeros()),
                                   rtol=0, atol=1e-6)


def count_gradient_passes(monkeypatch) -> dict:
    """Counts gradient (forward + backward) passes: every one a rule asks of its batch goes
    through ModelBatch._grad. The count is in the returned dict's "n"."""
    calls = {"n": 0}
    original = ModelBatch._grad

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(ModelBatch, "_grad", counting)
    return calls


# ---------------------------------------------------------------- runs with faulty clients, and real deployments
def run_with_faults(tmp_path, name, faults=None, client=None, clients=3, **overrides):
    """An in-process run; ``faults`` maps partition id -> inject-fault value."""
    overrides = {"algorithm": "feddyn", "num_partitions": clients, **overrides}
    cfg = RunConfig.from_mapping(fast_config(run_dir=str(tmp_path / name), **overrides))
    grid = InProcessGrid(client or client_app, clients, cfg.to_dict())
    for pid, fault in (faults or {}).items():
        grid.contexts[1000 + pid].node_config["inject-fault"] = fault
    run_server(grid, cfg)
    rows = metrics(Path(cfg.run_dir))
    final = torch.load(Path(cfg.run_dir) / "model_final.pt")
    return rows, final


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


# Every sampled client must reply, a missing reply is re-sent: Ray's actors can fail under a
# heavy load (ActorUnavailableError), and a skipped round would change the model.
RAY_RETRY = {"min-replies": 2, "too-few-replies": "retry", "max-retries": 8}


def set_flags(config: dict) -> list[str]:
    """``config`` as ``--set key=value`` flags of the CLI."""
    return [flag for key, value in config.items() for flag in ("--set", f"{key}={value}")]

DEPLOYED = {"dataset": "digits", "model": "mlp", "partition": "dirichlet", "local-epochs": 1,
            "local-steps": 0, "batch-size": 32, "num-server-rounds": 3}


def measure_startup() -> float:
    """Wall time of a fresh Python importing torch and flwr, here and now: how loaded the
    machine is, in the unit that Flower processes pay."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch, flwr.serverapp"], check=True)
    return time.monotonic() - t0


@functools.lru_cache(maxsize=None)
def startup_seconds() -> float:
    """:func:`measure_startup`, measured once per test process."""
    return measure_startup()


def round_deadline(fresh: bool = False) -> float:
    """A round-timeout for deployment tests, from the measured start-up (not a fixed 30 s: a
    loaded machine must not turn an honest client's slow reply into a lost one). Its floor is
    the time the SuperLink takes to answer for a dead SuperNode (2 missed 30 s heartbeats),
    so a longer deadline costs the tests with a killed node nothing."""
    return max(60.0, 10 * (measure_startup() if fresh else startup_seconds()))


def deployed(tmp_path, name, config: dict, nodes: int, kill_after: int | None = None,
              kill: str = "", restart: int | None = None, tls: bool = False, node_configs=None,
              app: Path = ROOT):
    """Run ``config`` on a real SuperLink + ``nodes`` SuperNodes (Flower App ``app``); after
    row ``kill_after`` of metrics.jsonl, SIGKILL process ``kill`` (and restart SuperNode
    ``restart``)."""
    from flatflower.runtime.engines.federation import COMPLETED, LocalFederation

    run_dir = tmp_path / name
    (run_dir / "logs").mkdir(parents=True)
    cfg = RunConfig.from_mapping({"round-timeout": round_deadline(fresh=True), **config, "run-dir": str(run_dir),
                                  "min-available-nodes": nodes,
                                  "num-partitions": nodes,
                                  "client-state-dir": str(run_dir / "client-state")})
    done, restarts, stop = [], [], threading.Event()

    def killer():
        """SIGKILL ``kill`` within 0.1 s of the row: the wait loop below can block for seconds
        (`flwr ls` on a loaded machine) while the last rounds run."""
        path = run_dir / "metrics.jsonl"
        while not stop.wait(0.1):
            if path.exists() and f'"round": {kill_after}' in path.read_text():
                fed.kill(kill)
                done.append(time.monotonic())
                return

    def on_poll():
        # Flower refuses a node id that is still online: a SuperNode restarted with the same
        # key gets in once the SuperLink has marked the killed one offline (2 missed 30 s
        # heartbeats), so restart it as a supervisor would until it stays up.
        if done and restart is not None and (not restarts or fed.exited(restarts[-1])):
            if not restarts or time.monotonic() - done[-1] > 5:
                restarts.append(f"supernode-{restart}-restart{len(restarts)}")
                fed.start_node(restart, name=restarts[-1])
                done.append(time.monotonic())

    with LocalFederation(nodes, tmp_path / f"{name}-work", run_dir / "logs", tls=tls,
                         node_configs=node_configs) as fed:
        run_id = fed.submit(app, cfg.to_dict())
        watcher = threading.Thread(target=killer, daemon=True)
        if kill_after:
            watcher.start()
        try:
            row = fed.wait(run_id, 500, poll=0.5, on_poll=on_poll)
        finally:
            stop.set()
            if kill_after:
                watcher.join()
        fed.save_log(run_id, run_dir / "logs" / "run.log")
        # a stop that the run's end beat (the SuperLink can fail a run whose ServerApp was
        # killed before flatflower stops it) is the run's row, not an error
        assert fed.stop_run(run_id)["status"] == row["status"]
    assert row["status"] == COMPLETED, row
    assert done or not kill_after, "the run ended before the kill"
    return cfg, run_dir


# ---------------------------------------------------------------- client state across rounds
class SnapshotGrid(InProcessGrid):
    """Records, per train round, every node's state before and after, and the messages."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def _states(self):
        return {n: latest(ctx) for n, ctx in self.contexts.items()}

    def push_messages(self, messages):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self._round = (self._states(), {m.metadata.dst_node_id: m.content for m in messages}, {})
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        if getattr(self, "_round", None) and replies and replies[0].metadata.message_type == MessageType.TRAIN:
            before, sent, got = self._round
            got.update({r.metadata.src_node_id: r.content if r.has_content() else r.error for r in replies})
            if len(got) == len(sent):  # the round's last reply: its states are final
                self.rounds.append((before, self._states(), sent, got))
                self._round = None
        return replies


def run_with_snapshots(tmp_path, **overrides):
    cfg = RunConfig.from_mapping(fast_config(fraction_train=0.5, num_server_rounds=4,
                                             run_dir=str(tmp_path / "run"), **overrides))
    grid = SnapshotGrid(client_app, 4, cfg.to_dict())
    run_server(grid, cfg)
    return cfg, grid


def assert_states_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name])


# ---------------------------------------------------------------- strategies outside a run
def initial_model(cfg: RunConfig, seed: int | None = None) -> OrderedDict:
    data = dataset_for(cfg)
    model = build_model(cfg.resolved_model(), data.input_shape, data.num_classes,
                        seed=cfg.seed if seed is None else seed)
    return OrderedDict(model.state_dict())


def make_strategy(cfg: RunConfig, seed: int | None = None):
    return registry.get(cfg.algorithm).new_strategy(cfg, initial_model(cfg, seed))


MODEL = initial_model(RunConfig.from_mapping(fast_config()))  # logreg: '1.weight', '1.bias'


TOGA = {"fedtoga.alpha": 0.3, "fedtoga.kappa": 0.7, "fedtoga.beta": 0.4, "sam.rho": 0.2}


def user_module_file(tmp_path, monkeypatch, prefix: str, source: str):
    """For a fixture (``yield from``): the user's own module ``source`` written in ``tmp_path``
    under a name unique to the test (modules are cached per process) and importable from there;
    its name, then the module forgotten."""
    import textwrap

    name = f"{prefix}_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def markdown_section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level (``#``
    lines inside fenced blocks are shell comments, not headings)."""
    import re

    lines = text.splitlines()
    assert heading in lines, f"no heading {heading!r}"
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    fence, end = False, len(lines)
    for i in range(start + 1, len(lines)):
        if lines[i].lstrip().startswith("```"):
            fence = not fence
        elif not fence and re.match(rf"#{{1,{level}}} ", lines[i]):
            end = i
            break
    return "\n".join(lines[start + 1:end])
