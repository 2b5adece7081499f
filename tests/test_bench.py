"""``flatflower bench --quick`` (the smoke run of the benchmarks): the report's structure and
the parts of it that are counts, not timings — gradient passes per step, bytes per record,
state bytes, client·steps per round — which must equal what each algorithm needs. Timings are
never asserted."""

from __future__ import annotations

import json

import pytest
import torch

from flatflower.common.config import RunConfig
from flatflower.common.data import partitions_for
from flatflower.common.flatness import HVP_METHODS
from flatflower.strategies.registry import ALGORITHMS
from flatflower.tools.bench import main as bench
from flatflower.tools.bench import print_tables
from flatflower.tools.cli import main as cli
from flatflower.tools.throughput import render as render_throughput


# one worker runs `bench --quick` once for the tests that read its report
pytestmark = pytest.mark.xdist_group("bench")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    assert bench(["--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_report_has_every_section_and_the_machine(report):
    assert {"machine", "settings", "compute", "overhead", "communication", "memory", "throughput",
            "flatness", "trial", "seconds"} <= set(report)
    assert report["machine"]["cpus"] >= 1 and report["machine"]["torch"]
    assert report["settings"]["quick"] is True


def test_compute_counts_the_gradient_passes_each_algorithm_needs(report):
    rows = {r["algorithm"]: r for r in report["compute"]}
    assert set(rows) == set(ALGORITHMS) | {"fedtoga (N)"}
    steps = report["settings"]["steps"]
    for name, spec in ALGORITHMS.items():
        row = rows[name]
        assert row["gradient_passes_per_step"] == spec.passes, name
        assert row["seconds_per_step"] > 0 and row["sgd_seconds_per_step"] > 0
        assert row["cost_vs_sgd"] > 0 and isinstance(row["within_10pct"], bool)
    # FedTOGA-N: one pass per step, plus the fresh gradient of step 0 (fedtoga notes §1.4)
    assert rows["fedtoga (N)"]["gradient_passes_per_step"] == pytest.approx((steps + 1) / steps)


def test_overhead_compares_engines_and_plain_flower(report):
    o = report["overhead"]
    for key in ("pure_training_seconds", "inprocess_round_seconds", "plain_flower_fedavg_round_seconds",
                "ours_vs_plain_flower", "inprocess_vs_pure_training"):
        assert o[key] > 0, key
    assert all("skipped" in o[k] for k in ("ray", "deployment (stock)", "deployment (warm)",
                                           "deployment (warm + fast poll)"))  # --quick starts none


def test_communication_payload_is_model_bytes_times_records(report):
    rows = {r["algorithm"]: r for r in report["communication"]}
    assert set(rows) == set(ALGORITHMS)
    for name, spec in ALGORITHMS.items():
        r = rows[name]
        assert r["bytes_down_per_client"] == r["theoretical_down"] == r["model_bytes"] * (1 + len(spec.down))
        assert r["bytes_up_per_client"] == r["theoretical_up"] == r["model_bytes"] * (1 + len(spec.up))
        assert 1.0 < r["wire_vs_theory_down"] < 1.1 and 1.0 < r["wire_vs_theory_up"] < 1.1


def test_client_state_is_what_the_algorithm_must_keep_and_server_state_does_not_grow(report):
    by_alg: dict[str, list] = {}
    for r in report["memory"]:
        by_alg.setdefault(r["algorithm"], []).append(r)
        assert r["client_state_bytes_max"] == r["expected_client_state_bytes"], r
        assert r["client_state_bytes_total"] == r["clients"] * r["expected_client_state_bytes"], r
    assert set(by_alg) == set(ALGORITHMS)
    for rows in by_alg.values():
        assert len({r["server_state_bytes"] for r in rows}) == 1  # independent of the number of clients


def test_throughput_times_every_model_clients_and_engine_and_counts_the_same_work(report):
    t = report["throughput"]
    assert (t["models"], t["clients"], t["engines"], t["algorithms"]) == (
        ["mlp"], [10, 20], ["inprocess", "vectorized"], ["fedavg"])  # --quick: no Ray
    assert report["settings"]["throughput"]["clients"] == [10, 20]
    assert t["timed_rounds_per_run"] == t["rounds"] - 2 >= 1 and t["repeats"] >= 1
    assert t["cpus"] >= 1 and isinstance(t["loaded"], bool) and "digits" in t["inputs"]["mlp"]
    assert t["load_average_1min_max"] >= max(t["load_average_1min_start"], t["load_average_1min_end"])
    assert [(r["model"], r["clients"], r["engine"]) for r in t["rows"]] == [
        ("mlp", n, e) for n in (10, 20) for e in ("inprocess", "vectorized")]
    for r in t["rows"]:
        assert r["timed_rounds"] == t["repeats"] * t["timed_rounds_per_run"], r
        assert len(r["round_seconds_all"]) == len(r["cpu_seconds_all"]) == r["timed_rounds"]
        for key in ("round_seconds", "cpu_seconds_per_round", "client_steps_per_cpu_second",
                    "client_steps_per_wall_second", "examples_per_cpu_second",
                    "speedup_vs_inprocess_cpu", "speedup_vs_inprocess_wall"):
            assert r[key] > 0, (key, r)
        # client·steps are counts: every client's ceil(examples / batch) steps of 1 epoch, on either engine
        cfg = RunConfig.from_mapping({"dataset": "digits", "partition": "iid", "num-partitions": r["clients"]})
        parts = partitions_for(cfg, r["clients"])
        assert r["client_steps_per_round"] == sum(-(-len(p) // cfg.batch_size) for p in parts), r
        assert r["examples_per_round"] == sum(len(p) for p in parts) == 1437
    assert all(r["speedup_vs_inprocess_cpu"] == 1.0 for r in t["rows"] if r["engine"] == "inprocess")


def test_trial_records_each_engines_fixed_cost_and_per_client_overhead(report):
    """--quick: one fresh-process run of each eager engine; every figure is computed from that
    run's own stamps (the parts of the fixed cost add up to it, the share is the formula's)."""
    t = report["trial"]
    assert (t["model"], t["clients"], t["repeats"], t["trial_rounds"]) == ("mlp", 10, 1, 20)
    assert [(r["variant"], r["engine"]) for r in t["rows"]] == [("inprocess", "inprocess"),
                                                                ("vectorized", "vectorized")]
    for r in t["rows"]:
        [run] = r["runs"]
        assert {k: v for k, v in r.items() if k not in ("variant", "engine", "runs")} == run
        parts = ("interpreter_and_torch", "engine_imports", "setup_to_first_round", "first_round_extra")
        assert r["fixed_seconds"] == pytest.approx(sum(r[k] for k in parts))
        assert r["interpreter_and_torch"] > 0 and r["engine_imports"] > 0 and r["setup_to_first_round"] > 0
        assert r["first_round_seconds"] - r["steady_round_seconds"] == pytest.approx(r["first_round_extra"])
        assert r["share_of_20_round_trial"] == pytest.approx(
            r["fixed_seconds"] / (r["fixed_seconds"] + 20 * r["steady_round_seconds"]))
        assert 0 <= r["overhead_seconds_per_round"] <= r["steady_round_seconds"] * 1.5
        assert r["overhead_seconds_per_client"] > 0
    table = print_tables({"trial": t})
    assert "overhead/client (ms)" in table and "fixed / 20-round trial" in table and "vectorized" in table


def test_throughput_table_says_what_ran_and_warns_on_a_loaded_machine(report):
    t = report["throughput"]
    quiet = render_throughput({**t, "loaded": False})
    assert "client·steps/CPU-s" in quiet and "load average (1 min)" in quiet and "vectorized" in quiet
    assert "Ray: not run" in quiet and "unreliable" not in quiet
    assert "wall-clock figures" in render_throughput({**t, "loaded": True})


def test_throughput_measures_the_plain_loop_on_the_same_work_at_a_chosen_setting(tmp_path, capsys):
    """--throughput-engines ...,loop: the papers' sequential PyTorch loop (tools/loop.py) beside
    the engines, at a partial-participation setting with its own epochs and batch size: the
    same client·steps, and each engine's time as a multiple of the loop's."""
    out = tmp_path / "b.json"
    assert bench(["--quick", "--sections", "throughput", "--throughput-engines", "inprocess,loop",
                  "--throughput-algorithms", "fedavg,fedsam", "--throughput-clients", "6",
                  "--throughput-fraction", "0.5", "--throughput-epochs", "2", "--throughput-batch-size", "50",
                  "--throughput-repeats", "1", "--out", str(out)]) == 0
    t = json.loads(out.read_text())["throughput"]
    assert (t["fraction"], t["local_epochs"], t["batch_size"]) == (0.5, 2, 50)
    rows = {(r["algorithm"], r["engine"]): r for r in t["rows"]}
    assert set(rows) == {(a, e) for a in ("fedavg", "fedsam") for e in ("inprocess", "loop")}
    for algorithm in ("fedavg", "fedsam"):
        engine, loop = rows[algorithm, "inprocess"], rows[algorithm, "loop"]
        assert engine["client_steps_per_round"] == loop["client_steps_per_round"] > 0
        assert engine["examples_per_round"] == loop["examples_per_round"] < 1437  # half the clients
        assert loop["cpu_vs_loop"] == 1.0 and engine["cpu_vs_loop"] > 0 and engine["wall_vs_loop"] > 0
    capsys.readouterr()
    text = " ".join(render_throughput(t).split())
    assert "'x the loop' = an engine's time over the loop's" in text
    assert "0.5 of the N clients a round, 2 local epoch(s) of batch 50" in text
    assert bench(["--quick", "--sections", "throughput", "--throughput-engines", "loop",
                  "--throughput-algorithms", "scaffold", "--out", str(tmp_path / "c.json")]) == 2
    assert "loop runs fedavg, fedsam only, not scaffold" in capsys.readouterr().err


def test_flatness_times_each_hvp_method_a_landscape_and_flatness_every_in_a_run(report):
    f = report["flatness"]
    assert (f["iters"], f["probes"], f["landscape_steps"]) == (3, 2, 5)  # --quick
    assert f["run_hvp"] in HVP_METHODS and f["device"] == "cpu"
    assert [r["model"] for r in f["models"]] == ["mlp", "cnn"]
    for r in f["models"]:
        assert (r["dataset"], r["split"], r["examples"]) == ("digits", "test", 360)
        assert r["parameters"] > 0 and r["round_seconds"] > 0 and r["landscape_seconds"] > 0
        assert r["landscape_points"] == 25
        assert set(r["hvp"]) == set(HVP_METHODS) and r["faster_hvp"] in HVP_METHODS
        for h in r["hvp"].values():
            assert h["flatness_seconds"] > 0 and h["seconds_per_hvp"] > 0
            # power iteration (twice for a negative dominant eigenvalue) and one HVP per probe
            assert f["probes"] + 1 <= h["hvps"] <= 2 * f["iters"] + f["probes"], h
        # flatness-every 2 in a 3-round run: rounds 2 and 3 (the last) were measured
        e = r["every"]
        assert (e["flatness_every"], e["rounds"], e["measurements"]) == (2, 3, 2)
        assert e["overhead"] == pytest.approx(e["flatness_seconds"] / e["round_seconds"]) and e["overhead"] > 0
        assert isinstance(e["within_target"], bool)
    table = print_tables({"flatness": f})
    assert "double-backward (runs)" in table and "5x5 landscape" in table and "flatness-every 2" in table


@pytest.mark.parametrize("args,message", [
    pytest.param(["--device", "cuda:0"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    (["--model", "vgg"], "vgg"),
    (["--steps", "0"], "must be >= 1"),
    (["--sections", "compute,speed"], "--sections: unknown speed"),
    (["--throughput-models", "vgg"], "throughput models: unknown vgg"),
    (["--throughput-engines", "dask"], "throughput engines: unknown dask"),
    (["--throughput-clients", "10,x"], "--throughput-clients"),
    (["--throughput-rounds", "2"], "round 1 is not timed"),
    (["--flatness-models", "cnn,vgg"], "--flatness-models: unknown vgg"),
])
def test_bad_bench_arguments_give_a_clear_error(tmp_path, capsys, args, message):
    out = tmp_path / "b.json"
    assert cli(["bench", "--quick", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err
    assert not out.exists()
