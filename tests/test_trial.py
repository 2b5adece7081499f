"""tools/trial.py's arithmetic on hand-made stamps: the covered time of overlapping training
intervals, and a run's fixed cost, steady round and per-client overhead (the bench's trial
section reads real runs with it: tests/test_bench.py)."""

from __future__ import annotations

import pytest

from flatflower.tools.trial import figures, union_seconds


def test_union_counts_overlapping_intervals_once_and_only_inside_the_window():
    assert union_seconds([], 0.0, 10.0) == 0.0
    assert union_seconds([(1.0, 3.0), (2.0, 4.0), (6.0, 7.0)], 0.0, 10.0) == 4.0  # 1-4 and 6-7
    assert union_seconds([(1.0, 9.0), (2.0, 3.0)], 0.0, 10.0) == 8.0  # one inside another
    assert union_seconds([(-5.0, 2.0), (8.0, 20.0), (11.0, 12.0)], 0.0, 10.0) == 4.0  # clipped, one outside


def test_figures_of_a_hand_made_run():
    """Launched at 0, torch at 2, engine imports at 3, round 1 sent at 4; rounds 1, 2, 3 last
    3, 1 and 1 s (4 clients each); in rounds 2 and 3 the clients train 0.6 and 0.8 s."""
    stamps = {"launched": 0.0, "torch": 2.0, "imports": 3.0}
    rounds = {1: 4.0, 2: 7.0, 3: 8.0, 4: 9.0}
    training = [(4.5, 6.5), (7.0, 7.4), (7.2, 7.6), (8.1, 8.9)]
    out = figures(stamps, rounds, training, {1: 4, 2: 4, 3: 4}, last=3)
    assert out["interpreter_and_torch"] == 2.0 and out["engine_imports"] == 1.0
    assert out["setup_to_first_round"] == 1.0 and out["first_round_extra"] == 2.0  # 3 s against 1 s
    assert out["fixed_seconds"] == 6.0 and out["steady_round_seconds"] == 1.0
    assert out["overhead_seconds_per_round"] == pytest.approx(0.3)  # median of 0.4 and 0.2
    assert out["overhead_seconds_per_client"] == pytest.approx(0.3 / 4)
    assert out["share_of_20_round_trial"] == pytest.approx(6.0 / 26.0)


def test_the_docs_trial_figures_are_the_record():
    """docs/benchmarks.md's trial table and the first compiled round it and engines.md quote
    are docs/results/trial-cpu/bench-trial.json's."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    rows = json.loads((root / "docs/results/trial-cpu/bench-trial.json").read_text())["trial"]["rows"]
    bench_doc = (root / "docs/benchmarks.md").read_text()
    for r in rows:
        assert (f"| {r['variant']} | {r['fixed_seconds']:.2f} | {r['interpreter_and_torch']:.2f} | "
                f"{r['engine_imports']:.2f} | {r['setup_to_first_round']:.2f} | {r['first_round_extra']:.2f} | "
                f"{r['steady_round_seconds']:.3f} | {r['overhead_seconds_per_client'] * 1e3:.2f} | "
                f"{r['share_of_20_round_trial']:.1%} |") in bench_doc
    compiled = next(r for r in rows if r["variant"] == "vectorized, compile = on")
    engines_doc = " ".join((root / "docs/engines.md").read_text().split())
    assert f"{compiled['first_round_extra']:.1f} s beyond a steady one" in " ".join(bench_doc.split())
    assert f"its first round compiles ({compiled['first_round_extra']:.1f} s beyond a steady round" in engines_doc


def test_a_tune_workers_next_trial_is_timed_from_its_own_start_after_a_first_run(tmp_path):
    """``warm``: the same setting runs twice in one process; the stamps are the second run's,
    starting when it is called (no interpreter, torch or import time: a tune worker's next
    trial pays only its setup and its first round's extra)."""
    import time

    from flatflower.tools.throughput import run_config
    from flatflower.tools.trial import VARIANTS, probe

    assert VARIANTS["inprocess, tune worker"] == ("inprocess", {}, True)
    cfg = run_config("fedavg", "mlp", tmp_path / "run", 4)
    out = probe(cfg, 3, vectorized=False, launched=time.time(), warm=True)
    stamps = out["stamps"]
    assert stamps["launched"] == stamps["torch"] == stamps["imports"]
    assert sorted(out["rounds"]) == [1, 2, 3, 4] and min(out["rounds"].values()) > stamps["launched"]
    assert all(start >= stamps["launched"] for start, _ in out["training"])  # the first run's left out
    assert (tmp_path / "run-first" / "summary.json").is_file() and (tmp_path / "run" / "summary.json").is_file()
    f = figures(stamps, out["rounds"], out["training"], out["clients"], last=3)
    assert f["interpreter_and_torch"] == 0 and f["engine_imports"] == 0 and f["setup_to_first_round"] > 0


def test_the_docs_tune_worker_figures_are_their_record():
    """docs/benchmarks.md's second trial table and its sentence on a tune worker's next trial
    are docs/results/trial-cpu/bench-trial-tune.json's."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    rows = {r["variant"]: r for r in
            json.loads((root / "docs/results/trial-cpu/bench-trial-tune.json").read_text())["trial"]["rows"]}
    assert {"inprocess, tune worker", "vectorized, tune worker"} <= set(rows)
    text = (root / "docs/benchmarks.md").read_text()
    for r in rows.values():
        assert (f"| {r['variant']} | {r['fixed_seconds']:.2f} | {r['interpreter_and_torch']:.2f} | "
                f"{r['engine_imports']:.2f} | {r['setup_to_first_round']:.2f} | {r['first_round_extra']:.2f} | "
                f"{r['steady_round_seconds']:.3f} | {r['overhead_seconds_per_client'] * 1e3:.2f} | "
                f"{r['share_of_20_round_trial']:.1%} |") in text
    warm_in, warm_vec = rows["inprocess, tune worker"], rows["vectorized, tune worker"]
    assert max(warm_in["share_of_20_round_trial"], warm_vec["share_of_20_round_trial"]) < 0.10
    assert (f"A tune worker's next 20-round trial pays {warm_in['fixed_seconds']:.2f} s in-process and "
            f"{warm_vec['fixed_seconds']:.2f} s vectorised besides its rounds: "
            f"{warm_in['share_of_20_round_trial']:.1%} and {warm_vec['share_of_20_round_trial']:.1%} of it, under "
            f"the issue's 10%, against {rows['inprocess']['share_of_20_round_trial']:.1%} and "
            f"{rows['vectorized']['share_of_20_round_trial']:.1%} for a run in a fresh process") in " ".join(text.split())
