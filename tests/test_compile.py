"""Run-config ``compile = on``: the vectorised engine's batched step under torch.compile
(runtime/engines/vectorized.py ``compiled``). Its models equal the eager step's to float rounding, it
really compiles (dynamo captured graphs), and it compiles a few graphs per run, not one per
round (a graph per round would recompile every round, then fall back to eager)."""

from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import flatflower.runtime.engines.inprocess  # noqa: F401  (flwr's log handler: see test_bad_input.py)
from flatflower.common.config import ConfigError, RunConfig
from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.strategies.registry import ALGORITHMS

CLIENTS = 6  # one batched group (>= MIN_GROUP), ragged: the default Dirichlet partition of digits


def final_model(run_dir) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "model_final.pt", weights_only=False)
    return state.get("state_dict", state)


def both(tmp_path, algorithm: str, rounds: int) -> tuple[dict, dict, dict]:
    """(eager model, compiled model, dynamo's stats of the compiled run)."""
    config = {**ALGORITHMS[algorithm].example_config(), "algorithm": algorithm, "dataset": "digits",
              "num-server-rounds": rounds, "local-epochs": 1, "batch-size": 48, "batching": "on",
              "tensorboard": False, "fraction-evaluate": 0.0}
    models = {}
    for mode in ("off", "on"):
        torch._dynamo.reset()
        counters.clear()
        run_dir, _ = run_inprocess({**config, "compile": mode, "run-dir": str(tmp_path / mode)}, CLIENTS,
                                   vectorized=True)
        models[mode] = final_model(run_dir)
        stats = dict(counters["stats"])
        if mode == "off":
            assert not stats.get("unique_graphs"), stats  # eager: nothing compiled
    torch._dynamo.reset()
    return models["off"], models["on"], stats


def assert_close_models(eager: dict, compiled: dict) -> None:
    assert eager.keys() == compiled.keys()
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-5, atol=1e-6)


def test_a_compiled_fedsam_run_equals_the_eager_one_and_compiles_once_not_per_round(tmp_path):
    eager, compiled, stats = both(tmp_path, "fedsam", rounds=5)
    assert_close_models(eager, compiled)
    assert any(not torch.equal(eager[k], compiled[k]) for k in eager)  # a different kernel really ran
    # full and padded steps, and a dynamic-shape graph: a handful for 5 rounds x 2 steps, not 10
    assert 1 <= stats["unique_graphs"] <= 4, stats
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_the_process_builds_torch_compiles_backend_once_for_every_groups_step(monkeypatch):
    """Each round's groups get new step functions; ``compiled`` wraps them all with one compile
    context (torch.compile's inductor backend, whose construction deep-copies inductor's
    config), built once even when threads ask for it at the same moment. Each compiled
    function still computes its own function."""
    import threading

    from flatflower.runtime.engines import vectorized

    built = []

    class Counted(torch._TorchCompileInductorWrapper):
        def __init__(self, *args):
            built.append(args)
            super().__init__(*args)

    monkeypatch.setattr(vectorized, "_COMPILER", [])
    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", Counted)
    start = threading.Barrier(4)
    wrapped: dict[int, object] = {}

    def wrap(k: int) -> None:
        start.wait(timeout=60)
        wrapped[k] = vectorized.compiled(lambda t, k=k: t * 2 + k)

    threads = [threading.Thread(target=wrap, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch._dynamo.reset()
    assert torch.equal(wrapped[0](torch.ones(3)), torch.full((3,), 2.0))
    assert torch.equal(wrapped[3](torch.ones(3)), torch.full((3,), 5.0))
    assert len(built) == 1 and len(vectorized._COMPILER) == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("missing", ["name", "signature"])
def test_a_torch_whose_private_backend_differs_compiles_with_torch_compile(monkeypatch, missing):
    """The one context is built from torch's private names; a torch without them (renamed, or
    another signature) gets torch.compile itself: slower to wrap, never a failed step."""
    from flatflower.runtime.engines import vectorized

    if missing == "name":
        monkeypatch.delattr(torch, "_TorchCompileInductorWrapper")
    else:
        monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", lambda mode, options: None)
    assert vectorized._compile_context() is torch.compile


def test_compile_takes_off_or_on_only():
    with pytest.raises(ConfigError, match="compile='yes' is not one of: off, on"):
        RunConfig.from_mapping({"compile": "yes"}).validate()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_compiled_equals_eager(tmp_path, algorithm):
    eager, compiled, stats = both(tmp_path, algorithm, rounds=3)
    assert_close_models(eager, compiled)
    assert stats.get("unique_graphs", 0) >= 1, stats
    (tmp_path / "stats.json").write_text(json.dumps(stats))


def test_compile_on_without_a_working_toolchain_is_refused_in_one_line_before_anything_starts(tmp_path):
    """No C++ compiler for inductor (CXX names none; a fresh inductor cache, so nothing is
    reused): the CLI refuses the run in one line naming the option, and no run directory is
    made, instead of every batched group failing at its first step."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "FLWR_HOME": str(tmp_path / "flwr"), "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-m", "flatflower.tools.cli", "simulate", "--engine", "vectorized",
                           "--clients", "4", "--rounds", "1", "--dataset", "digits", "--set", "compile=on",
                           "--run-dir", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.lower().startswith("error:")]
    assert len(errors) == 1 and "compile = on, but torch.compile does not work here on cpu" in errors[0], done.stderr
    assert "use compile = off" in errors[0]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- two halves of a compiled group
def _calls(n: int, compile: str = "on", device: str = "cpu") -> list:
    from types import SimpleNamespace

    first = SimpleNamespace(cfg=SimpleNamespace(compile=compile), layout=SimpleNamespace(device=torch.device(device)))
    return [first] + [SimpleNamespace() for _ in range(n - 1)]


def test_only_a_compiled_cpu_group_of_split_min_clients_or_more_trains_as_two_halves():
    import flatflower.runtime.engines.vectorized as vec

    assert vec.SPLIT_MIN == 32  # docs/configuration.md, compile
    assert vec.splits(_calls(vec.SPLIT_MIN))
    assert not vec.splits(_calls(vec.SPLIT_MIN - 1))
    assert not vec.splits(_calls(vec.SPLIT_MIN, compile="off"))  # eager: Python-bound, nothing to overlap
    assert not vec.splits(_calls(vec.SPLIT_MIN, device="cuda"))  # a GPU wants the whole batch


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the SystemExit half)
def test_train_halves_trains_both_halves_at_once_and_a_failing_half_fails_only_its_clients(monkeypatch):
    """The halves run in two threads at the same time (a barrier both must reach: trained one
    after the other, the first would wait alone and break it), the results come back in the
    order of the calls, and an exception fails the clients of its half only. A half whose
    thread ends with no results (a BaseException) raises for the whole group, never a gap."""
    import threading

    import flatflower.runtime.engines.vectorized as vec

    barrier = threading.Barrier(2, timeout=60)
    seen = []

    def train_group(calls):
        seen.append((tuple(calls), threading.current_thread().name))
        barrier.wait()  # BrokenBarrierError unless the other half is training at the same time
        if 7 in calls:
            raise RuntimeError("a bad half")
        return [f"trained {c}" for c in calls]

    monkeypatch.setattr(vec, "train_group", train_group)
    results = vec.train_halves(list(range(10)))
    assert sorted(c for c, _ in seen) == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)]
    assert len({name for _, name in seen}) == 2
    assert results[:5] == [f"trained {c}" for c in range(5)]
    assert all(isinstance(r, RuntimeError) and str(r) == "a bad half" for r in results[5:])

    def stopped(calls):  # a half whose thread ends on a BaseException (its results never come)
        if 9 in calls:
            raise SystemExit("stop")
        return [f"trained {c}" for c in calls]

    monkeypatch.setattr(vec, "train_group", stopped)
    with pytest.raises(RuntimeError, match="stopped training without results"):
        vec.train_halves(list(range(10)))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedsam", "scaffold", "fedgmt"])
def test_a_compiled_group_trained_as_two_halves_equals_it_trained_whole(tmp_path, monkeypatch, algorithm):
    """SPLIT_MIN ragged clients (Dirichlet digits, padded steps) compiled: the halves' run
    gives the models of the whole group's run to float rounding (vmap keeps clients apart),
    and the halves really ran (train_group got two halves every round)."""
    import flatflower.runtime.engines.vectorized as vec

    sizes = []
    train_group = vec.train_group
    monkeypatch.setattr(vec, "train_group", lambda calls: sizes.append(len(calls)) or train_group(calls))
    config = {**ALGORITHMS[algorithm].example_config(), "algorithm": algorithm, "dataset": "digits",
              "num-server-rounds": 2, "local-epochs": 1, "batch-size": 32, "batching": "on", "compile": "on",
              "tensorboard": False, "fraction-evaluate": 0.0, "fraction-train": 1.0}
    models, clients = {}, vec.SPLIT_MIN
    for split_min in (clients, 10**9):
        monkeypatch.setattr(vec, "SPLIT_MIN", split_min)
        torch._dynamo.reset()
        sizes.clear()
        run_dir, _ = run_inprocess({**config, "run-dir": str(tmp_path / str(split_min))}, clients,
                                   vectorized=True)
        models[split_min] = final_model(run_dir)
        halves = split_min == clients
        assert sizes and (max(sizes) < clients if halves else clients in sizes), sizes
    torch._dynamo.reset()
    assert_close_models(models[10**9], models[clients])
