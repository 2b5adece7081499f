"""Issue 45, item 2: the server's evaluation and flatness measurements run on the device
(``server-device``) and with the CPU threads (``server-threads``) the run config gives them,
and give the same numbers there."""

from __future__ import annotations

import pytest
import torch

import flatflower.server.run as server_run
from flatflower.common.config import ConfigError, RunConfig
from flatflower.runtime.engines.inprocess import run_inprocess
from tests.helpers import metrics
from flatflower.tools.prepare import UsageError, preflight

BASE = {"dataset": "digits", "model": "mlp", "partition": "iid", "local-steps": 2, "batch-size": 16,
        "num-server-rounds": 2, "fraction-evaluate": 0.0, "flatness-every": 2, "flatness-iters": 3, "flatness-probes": 1,
        "tensorboard": False}


def evaluated_run(monkeypatch, tmp_path, **keys) -> tuple[list[dict], list[tuple[int, str]]]:
    """A short run's metric rows, and (threads, model device) at every central evaluation."""
    seen: list[tuple[int, str]] = []
    inner = server_run.evaluate

    def spy(model, data, *args, **kwargs):
        seen.append((torch.get_num_threads(), str(next(model.parameters()).device)))
        assert data.x.device == next(model.parameters()).device  # the test split lives there too
        return inner(model, data, *args, **kwargs)

    name = "-".join(f"{k}{v}" for k, v in keys.items()) or "default"
    config = {**BASE, **{k.replace("_", "-"): v for k, v in keys.items()}, "run-dir": str(tmp_path / name)}
    with monkeypatch.context() as m:
        m.setattr(server_run, "evaluate", spy)
        run_dir, _ = run_inprocess(config, 3)
    return metrics(run_dir), seen


def server_numbers(rows: list[dict]) -> list[tuple]:
    keys = ("test_loss", "test_accuracy", "sharpness", "hessian_max_eig", "hessian_trace")
    return [tuple(r.get(k) for k in keys) for r in rows]


def assert_close(a: list[tuple], b: list[tuple], rel: float) -> None:
    for ra, rb in zip(a, b, strict=True):
        for x, y in zip(ra, rb, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                assert x == pytest.approx(y, rel=rel, abs=1e-9), (ra, rb)


def test_server_threads_are_applied_and_give_the_same_numbers(monkeypatch, tmp_path):
    """Default: one thread (today's server); server-threads = 2: two threads at every
    evaluation, the same test loss/accuracy and flatness numbers (float level)."""
    default, seen_default = evaluated_run(monkeypatch, tmp_path)
    two, seen_two = evaluated_run(monkeypatch, tmp_path, server_threads=2)
    assert {t for t, _ in seen_default} == {1}, seen_default
    assert {d for _, d in seen_default} == {"cpu"}
    assert {t for t, _ in seen_two} == {2}
    assert len(seen_two) == BASE["num-server-rounds"] + 1  # round 0 and every round
    assert [r["test_accuracy"] for r in default] == [r["test_accuracy"] for r in two]
    assert_close(server_numbers(default), server_numbers(two), 1e-5)
    assert any(r.get("hessian_max_eig") is not None for r in two)  # the flatness row was measured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_server_device_cuda_gives_the_cpu_numbers(monkeypatch, tmp_path):
    cpu, _ = evaluated_run(monkeypatch, tmp_path)
    cuda, seen = evaluated_run(monkeypatch, tmp_path, server_device="cuda")
    assert {d for _, d in seen} == {"cuda:0"}
    assert [r["test_accuracy"] for r in cpu] == [r["test_accuracy"] for r in cuda]
    assert_close(server_numbers(cpu), server_numbers(cuda), 1e-4)


@pytest.mark.parametrize("key, value, message", [
    ("server-device", "gpu", r"^invalid run config: server-device must be cpu, cuda, cuda:N or mps \(got 'gpu'\)$"),
    ("server-threads", 0, r"^invalid run config: server-threads must be >= 1 \(got 0\)$")])
def test_bad_server_keys_are_refused_in_one_line(key, value, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping({key: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_server_device_this_machine_lacks_is_refused_before_the_run():
    cfg = RunConfig.from_mapping({**BASE, "server-device": "cuda:0"})
    with pytest.raises(UsageError, match=r"^server-device='cuda:0' requested but .*on this machine$"):
        preflight(cfg, 3)
