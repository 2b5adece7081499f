"""Numbers no consumer of client numbers may fail on: TensorBoard (server/tensorboard.py),
clients.jsonl (server/clients.py) and ``flatflower report``. A loss beyond validation's bound is
refused with its reason; a huge weight (finite: validation lets it through) is handled."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest

from flatflower.server.tensorboard import HISTOGRAM_LIMIT, Board, drift
from tests import malicious
from tests.helpers import metrics, run_with_faults
from flatflower.tools import report

# every kind of value a row may hold: huge, beyond float32, beyond TensorBoard's histogram
# buckets, non-finite, subnormal, an int beyond any float, and what is not a number at all
EXTREMES = [1e300, -1e300, 1e21, 3.5e38, -3.5e38, math.inf, -math.inf, math.nan, 5e-324, 0,
            10**400, True, "x", None, [1, 2]]
FINITE = [1e300, -1e300, 1e21, 3.5e38, -3.5e38, 5e-324, 0]


def events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0})
    board.Reload()
    return board


def strict_json(line: str):
    """A line of JSON that holds no NaN or Infinity token (they are not JSON)."""
    return json.loads(line, parse_constant=lambda token: pytest.fail(f"{token} in {line[:200]}"))


# ---------------------------------------------------------------- TensorBoard
def test_the_board_takes_any_value(tmp_path):
    board = Board(tmp_path, True)
    board.add_round({"round": 1, "ok": 0.5, **{f"v{i}": v for i, v in enumerate(EXTREMES)}},
                    [{"update_norm": v, "train_loss": v} for v in EXTREMES])
    board.add_round({"round": 2}, [{"loss_before": 1e300}])  # all beyond the buckets: raised before
    board.close()
    got = events(tmp_path)
    scalars = set(got.Tags()["scalars"])
    assert got.Scalars("metrics/ok")[0].value == 0.5
    assert {"metrics/v2", "metrics/v8", "metrics/v9"} <= scalars  # 1e21, 5e-324 and 0 fit a float32
    assert not {"metrics/v0", "metrics/v3", "metrics/v5", "metrics/v7", "metrics/v10", "metrics/v11"} & scalars
    norms = got.Histograms("clients/update_norm")[0].histogram_value
    assert norms.num == len(FINITE) and -HISTOGRAM_LIMIT <= norms.min <= norms.max <= HISTOGRAM_LIMIT
    (late,) = got.Histograms("clients/loss_before")
    assert late.step == 2 and late.histogram_value.max == HISTOGRAM_LIMIT


def test_a_failing_writer_is_logged_once_and_never_ends_the_run(tmp_path, caplog):
    class Broken:
        def __getattr__(self, name):
            def fail(*args):
                raise OSError("No space left on device")
            return fail

    caplog.set_level(logging.WARNING, logger="flwr.flatflower.server")
    board = Board(tmp_path, True)
    board.writer.close()
    board.writer = Broken()
    for rnd in (1, 2):
        board.add_round({"round": rnd, "test_accuracy": 0.5}, [{"update_norm": 1.0, "cosine_to_mean": 1.0}])
    board.close()
    failures = [r.getMessage() for r in caplog.records if "failed, skipped" in r.getMessage()]
    assert sorted(m.split()[1] for m in failures) == ["add_histogram", "add_scalar", "close", "flush"]
    assert all("No space left on device" in m for m in failures)


def test_drift_and_report_take_hostile_clients_rows(tmp_path, capsys):
    """clients.jsonl rows a server never writes (a hand edit, another tool): drift counts the
    finite numbers only, norms near the float64 limit do not overflow its spread."""
    rows = [{"round": 1, "partition": p, "update_norm": n, "cosine_to_mean": c}
            for p, (n, c) in enumerate([(1e300, 0.5), (1.7e308, -0.2), (1.0, "x"), (True, None), ("y", 1e400)])]
    summary = drift(rows)
    assert summary["cosine_mean"] == pytest.approx(0.15) and summary["cosine_min"] == -0.2
    assert all(math.isfinite(v) for v in summary.values())
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"round": 0, "test_accuracy": 0.1, "test_loss": 2.3},
        {"round": 1, "test_accuracy": 0.5, "test_loss": 1e300, "train_loss": 1e300}]))
    # the file holds what JSON can say (Infinity is not a number flatflower writes: report
    # refuses such a file in one line, tests/test_analysis_damage.py)
    on_disk = [{k: 1.5e308 if v == 1e400 else v for k, v in r.items()} for r in rows]
    (run / "clients.jsonl").write_text("".join(json.dumps(r) + "\n" for r in on_disk))
    assert report.main([str(run), "--out", str(tmp_path / "out" / "r.png")]) == 0
    assert (tmp_path / "out" / "r-drift.png").is_file()
    assert not re.search(r"\b(inf|nan)\b", capsys.readouterr().out)


# ---------------------------------------------------------------- runs
def test_a_loss_only_the_attacker_reports_is_refused_and_the_run_completes(tmp_path):
    """Without client-eval only the attacker reports loss-before: its histogram held 1e300 alone,
    beyond TensorBoard's buckets, and ended the run."""
    rows, _ = run_with_faults(tmp_path, "r", client=malicious.malicious_app({3: "loss-before:1e300"}),
                              clients=4, algorithm="fedavg", client_eval=False)
    for row in rows[1:]:
        (refusal,) = row["rejections"]
        assert refusal["partition"] == 3 and "'loss-before'=1e+300 is out of range" in refusal["reason"]
    assert [e.step for e in events(tmp_path / "r").Scalars("metrics/test_accuracy")] == [0, 1, 2]


def test_a_huge_weight_is_handled_and_the_run_completes(tmp_path):
    """A weight of 1e30 is finite: the mean takes it (a robust rule would not). Its norm is in
    clients.jsonl exactly, clipped in TensorBoard's histogram; next round every client's loss
    is beyond the bound (the model diverged), each refused with its reason."""
    rows, final = run_with_faults(tmp_path, "r", client=malicious.malicious_app({3: "huge-weight:1e30"}),
                                  clients=4, algorithm="fedavg")
    clients = [strict_json(line) for line in (tmp_path / "r" / "clients.jsonl").read_text().splitlines()]
    attacker = next(c for c in clients if c["round"] == 1 and c["partition"] == 3)
    assert attacker["status"] == "accepted" and attacker["update_norm"] == pytest.approx(1e30, rel=1e-3)
    assert rows[1]["rejections"] == []
    assert sorted(r["partition"] for r in rows[2]["rejections"]) == [0, 1, 2, 3]
    assert all("'train-loss'=" in r["reason"] and "out of range [0, 1e+06]" in r["reason"]
               for r in rows[2]["rejections"])
    got = events(tmp_path / "r")
    norms = got.Histograms("clients/update_norm")[0].histogram_value
    assert norms.num == 4 and norms.max == HISTOGRAM_LIMIT
    assert all(math.isfinite(float(v.abs().max())) for v in final.values())
    assert metrics(tmp_path / "r")[-1]["round"] == 2
