"""tools/loop.py: the plain sequential loop the throughput bench measures the engines against.
Its worth as a yardstick rests on doing exactly an engine's passes: its global models are the
in-process engine's, to float rounding."""

from __future__ import annotations

import pytest
import torch

from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.tools.loop import measure_loop, run_loop


@pytest.mark.parametrize("algorithm", ["fedavg", "fedsam"])
def test_the_loop_trains_the_engines_global_models(tmp_path, algorithm):
    cfg = {"algorithm": algorithm, "dataset": "digits", "model": "mlp", "partition": "dirichlet",
           "dirichlet-alpha": 0.3, "local-epochs": 2, "batch-size": 50, "fraction-train": 0.5,
           "lr": 0.1, "lr-decay": 0.9, "weight-decay": 1e-3, "clip-norm": 1.0, "momentum": 0.5,
           "num-server-rounds": 3, "seed": 4, "client-eval": False, "tensorboard": False,
           "run-dir": str(tmp_path / "run")}
    rounds = list(run_loop(cfg, 6))
    assert [row["round"] for row, _ in rounds] == [1, 2, 3]
    run_dir, _ = run_inprocess(cfg, 6)
    engine = list(torch.load(run_dir / "model_final.pt").values())
    loop = rounds[-1][1]
    assert len(loop) == len(engine)
    for a, b in zip(loop, engine):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(loop[0], rounds[0][1][0])  # it trained
    assert all(row["client_steps"] > 0 and row["examples"] > 0 for row, _ in rounds)


def test_the_loop_times_the_middle_rounds():
    rows = measure_loop({"algorithm": "fedavg", "dataset": "digits", "model": "logreg",
                         "local-steps": 1, "num-server-rounds": 4}, 4)
    assert [r["round"] for r in rows] == [2, 3]
    assert all(r["cpu_seconds"] > 0 and r["client_steps"] == 4 for r in rows)


def test_the_loop_refuses_an_algorithm_it_does_not_implement():
    with pytest.raises(ValueError, match="runs fedavg, fedsam, not scaffold"):
        list(run_loop({"algorithm": "scaffold", "dataset": "digits", "model": "logreg"}, 2))
