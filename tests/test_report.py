"""Tests for flatflower.tools.report: loading run directories, summaries, grouping, plot and CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flatflower.tools.report import (
    ReportError,
    group_by_algorithm,
    load_run,
    main,
    plot_accuracy,
    render_table,
    summarize,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(
    root: Path,
    name: str,
    accuracies: list[float],
    algorithm: str | None = "fedsam",
    seed: int = 0,
    with_round0: bool = True,
    truncated_tail: str | None = None,
) -> Path:
    """A fake run dir; ``accuracies[0]`` is round 0 when ``with_round0``, else round 1."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    config = {"config": {"seed": seed, "dataset": "digits"}, "version": "0.1.0", "seed": seed}
    if algorithm is not None:
        config["config"]["algorithm"] = algorithm
    (run_dir / "config.json").write_text(json.dumps(config))
    first = 0 if with_round0 else 1
    lines = []
    for i, acc in enumerate(accuracies):
        rnd = first + i
        row = {"round": rnd, "test_accuracy": acc, "test_loss": 1.0 - acc}
        if rnd >= 1:
            row.update(bytes_down=100, bytes_up=10 * rnd, clients_sampled=4, clients_replied=4)
        lines.append(json.dumps(row))
    text = "\n".join(lines) + "\n"
    if truncated_tail is not None:
        text += truncated_tail
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


# Round 0..6
ACC = [0.10, 0.30, 0.50, 0.60, 0.70, 0.80, 0.90]


def test_load_run_reads_curves_label_and_bytes(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, "r", ACC, seed=3))
    assert run.label == "fedsam seed3"
    assert run.algorithm == "fedsam"
    assert run.seed == 3
    assert run.rounds == [0, 1, 2, 3, 4, 5, 6]
    assert run.accuracy == ACC
    assert run.loss == pytest.approx([1.0 - a for a in ACC])
    # rounds 1..6: 100 down + 10*r up each; round 0 carries no bytes
    assert run.bytes_total == 6 * 100 + 10 * (1 + 2 + 3 + 4 + 5 + 6)


def test_label_falls_back_to_directory_name(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, "my-run", ACC, algorithm=None))
    assert run.label == "my-run"


def test_summarize_last_k_excludes_round0(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, "r", ACC))
    summary = summarize(run, last_k=3, target=0.65)
    tail = [0.70, 0.80, 0.90]
    assert summary["rounds"] == 6
    assert summary["final_accuracy"] == pytest.approx(0.90)
    assert summary["best_accuracy"] == pytest.approx(0.90)
    assert summary["last_k_mean"] == pytest.approx(0.80)
    assert summary["last_k_std"] == pytest.approx(np.sqrt(sum((a - 0.8) ** 2 for a in tail) / 3))
    assert summary["rounds_to_target"] == 4
    assert summary["bytes_total"] == run.bytes_total

    # k larger than the run: only rounds 1..6 count, never round 0
    whole = summarize(run, last_k=50)
    assert whole["last_k_mean"] == pytest.approx(np.mean(ACC[1:]))
    assert whole["last_k_std"] == pytest.approx(np.std(ACC[1:]))


def test_rounds_to_target_never_reached_and_round0(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, "r", ACC))
    assert summarize(run, target=0.95)["rounds_to_target"] is None
    assert summarize(run, target=None)["rounds_to_target"] is None
    assert summarize(run, target=0.10)["rounds_to_target"] == 0  # initial model already there
    assert summarize(run, target=0.90)["rounds_to_target"] == 6


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "r", ACC, truncated_tail='{"round": 7, "test_accur')
    run = load_run(run_dir)
    assert run.rounds[-1] == 6
    assert summarize(run)["final_accuracy"] == pytest.approx(0.90)


def test_missing_directory_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ReportError, match="nope"):
        load_run(missing)


def test_missing_metrics_or_no_rounds_is_an_error(tmp_path: Path) -> None:
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ReportError, match="metrics.jsonl"):
        load_run(empty_dir)
    (empty_dir / "metrics.jsonl").write_text('{"round": 1, "test_acc')
    with pytest.raises(ReportError, match="no rounds"):
        load_run(empty_dir)


def test_group_by_algorithm_over_seeds(tmp_path: Path) -> None:
    runs = [
        load_run(write_run(tmp_path, "a0", [0.1, 0.5, 0.7], seed=0)),
        load_run(write_run(tmp_path, "a1", [0.1, 0.6, 0.9], seed=1)),
        load_run(write_run(tmp_path, "b0", [0.1, 0.4, 0.5], algorithm="fedavg")),
    ]
    summaries = [summarize(run, last_k=2, target=0.65) for run in runs]
    rows = {row["algorithm"]: row for row in group_by_algorithm(summaries)}
    assert set(rows) == {"fedsam", "fedavg"}

    fedsam = rows["fedsam"]
    assert fedsam["num_seeds"] == 2
    assert fedsam["final_accuracy_mean"] == pytest.approx(0.8)
    assert fedsam["final_accuracy_std"] == pytest.approx(0.1)  # population std of 0.7, 0.9
    assert fedsam["last_k_mean"] == pytest.approx(np.mean([0.6, 0.75]))
    assert fedsam["rounds_to_target_mean"] == pytest.approx(2.0)  # both reach 0.65 at round 2

    fedavg = rows["fedavg"]
    assert fedavg["num_seeds"] == 1
    assert fedavg["final_accuracy_std"] == pytest.approx(0.0)
    assert fedavg["rounds_to_target_mean"] is None


def test_rounds_to_target_mean_ignores_seeds_that_missed(tmp_path: Path) -> None:
    runs = [
        load_run(write_run(tmp_path, "a0", [0.1, 0.5, 0.7], seed=0)),
        load_run(write_run(tmp_path, "a1", [0.1, 0.2, 0.3], seed=1)),
    ]
    (row,) = group_by_algorithm([summarize(run, target=0.65) for run in runs])
    assert row["rounds_to_target_mean"] == pytest.approx(2.0)


def test_render_table_formats_percentages_and_missing(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, "r", ACC))
    text = render_table([summarize(run, last_k=3, target=0.99)], title="Runs")
    assert "Runs" in text
    assert "fedsam seed0" in text
    assert "90.00%" in text  # final accuracy
    assert "80.00% ± 8.16%" in text  # last-3 mean ± std
    assert "last k mean ± std" in text
    row = next(line for line in text.splitlines() if "fedsam seed0" in line)
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert cells[7] == "-"  # rounds_to_target is None


def test_plot_accuracy_writes_png(tmp_path: Path) -> None:
    runs = [load_run(write_run(tmp_path, f"r{s}", ACC, seed=s)) for s in range(2)]
    out = plot_accuracy(runs, tmp_path / "plots" / "acc.png")
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_main_writes_png_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [
        write_run(tmp_path, "a0", [0.1, 0.5, 0.7], seed=0),
        write_run(tmp_path, "a1", [0.1, 0.6, 0.9], seed=1),
    ]
    png, js = tmp_path / "out.png", tmp_path / "out.json"
    argv = [*map(str, dirs), "--last-k", "2", "--target", "0.65", "--out", str(png), "--json", str(js)]
    assert main(argv) == 0

    data = png.read_bytes()
    assert len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC)
    payload = json.loads(js.read_text())
    assert [run["label"] for run in payload["runs"]] == ["fedsam seed0", "fedsam seed1"]
    assert payload["runs"][1]["final_accuracy"] == pytest.approx(0.9)
    assert payload["by_algorithm"][0]["num_seeds"] == 2

    stdout = capsys.readouterr().out
    assert "fedsam seed1" in stdout
    assert "Per algorithm" in stdout  # shown because fedsam has two seeds


def test_main_default_png_beside_the_runs_never_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One run: its plots go into its directory; several: into the directory holding them all.
    Nothing is written to the current directory (a checkout's own files were overwritten)."""
    runs = tmp_path / "runs"
    a, b = write_run(runs, "a", ACC), write_run(runs, "b", ACC)
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main([str(a)]) == 0
    assert (a / "report.png").read_bytes().startswith(PNG_MAGIC)
    assert (a / "report-bytes.png").is_file()
    assert main([str(a), str(b)]) == 0
    assert (runs / "report.png").read_bytes().startswith(PNG_MAGIC)
    assert list(cwd.iterdir()) == []


def test_main_out_under_a_regular_file_is_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run_dir = write_run(tmp_path, "r", ACC)
    (tmp_path / "afile").write_text("precious")
    assert main([str(run_dir), "--out", str(tmp_path / "afile" / "r.png")]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert err == [f"error: cannot write the report: {tmp_path / 'afile'}: File exists"]
    assert (tmp_path / "afile").read_text() == "precious"


def test_main_missing_directory_returns_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "does-not-exist"
    assert main([str(missing), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert str(missing) in err
    assert "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------- settings, units, CSV, drift
def _with_config(run_dir: Path, **config) -> Path:
    data = json.loads((run_dir / "config.json").read_text())
    data["config"].update({k.replace("_", "-"): v for k, v in config.items()})
    (run_dir / "config.json").write_text(json.dumps(data))
    return run_dir


SAME = dict(num_partitions=20, num_server_rounds=6, partition="dirichlet", dirichlet_alpha=0.1,
            partition_seed=0)


def test_runs_of_different_settings_are_flagged_or_refused(tmp_path: Path, capsys) -> None:
    a = _with_config(write_run(tmp_path, "a", ACC), **SAME)
    b = _with_config(write_run(tmp_path, "b", ACC, seed=1), **SAME)
    c = _with_config(write_run(tmp_path, "c", ACC), **{**SAME, "num_partitions": 3, "dirichlet_alpha": 0.5})
    out = str(tmp_path / "p.png")
    assert main([str(a), str(b), "--out", out]) == 0
    assert "warning" not in capsys.readouterr().err  # two seeds of one setting
    assert main([str(a), str(c), "--out", out]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: the runs have different settings")
    assert "clients: 20 (a); 3 (c)" in err and "partition: dirichlet(0.1)" in err
    assert "dirichlet(0.5)" in err and "rounds" not in err and "dataset" not in err
    assert main([str(a), str(c), "--strict", "--out", out]) == 2
    assert capsys.readouterr().err.startswith("error: the runs have different settings")


def _with_code(run_dir: Path, code: str) -> Path:
    data = json.loads((run_dir / "config.json").read_text())
    data["versions"] = {"flatflower": "0.1.0", "flatflower-code": code}
    (run_dir / "config.json").write_text(json.dumps(data))
    return run_dir


def test_runs_of_different_or_modified_code_are_flagged(tmp_path: Path, capsys) -> None:
    """A sweep's runs import the checkout's code as they start: an edit mid-sweep (or a
    modified checkout) makes results no commit reproduces, and the report says so."""
    a = _with_code(_with_config(write_run(tmp_path, "a", ACC), **SAME), "1" * 40)
    b = _with_code(_with_config(write_run(tmp_path, "b", ACC, seed=1), **SAME), "1" * 40)
    c = _with_code(_with_config(write_run(tmp_path, "c", ACC, seed=2), **SAME), "2" * 40)
    d = _with_code(_with_config(write_run(tmp_path, "d", ACC, seed=3), **SAME), "1" * 40 + "+modified")
    old = _with_config(write_run(tmp_path, "old", ACC, seed=4), **SAME)  # recorded no code
    out = str(tmp_path / "p.png")
    assert main([str(a), str(b), str(old), "--out", out]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main([str(a), str(b), str(c), "--out", out]) == 0
    assert f"different or locally modified flatflower code (git commit): {'1' * 40} (a, b); {'2' * 40} (c)" in (
        " ".join(capsys.readouterr().err.split()))
    assert main([str(d), "--out", out]) == 0
    assert "+modified (d)" in capsys.readouterr().err


def test_a_run_records_the_git_commit_of_the_code_it_ran(tmp_path: Path) -> None:
    import subprocess

    from flatflower.server.rundir import code_version, versions

    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout: nothing to record")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert code_version().removesuffix("+modified") == head
    assert versions()["flatflower-code"] == code_version()


def test_a_study_of_twelve_methods_draws_twelve_distinct_lines_and_no_empty_flatness_panel(tmp_path: Path) -> None:
    """Matplotlib's default cycle has 10 colours: the 11th line would share the 1st's (in the
    Fashion-MNIST study FedAvg and MoFedSAM did). And a measure no run took (sharpness per round
    with flatness-every 0) gets no empty panel."""
    import struct

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from flatflower.tools.report import _plot, plot_flatness

    curves = [(f"m{i}", [0, 1], [i, i + 1], None) for i in range(12)]
    fig, ax = plt.subplots()
    _plot(ax, curves)
    looks = {(matplotlib.colors.to_hex(line.get_color()), line.get_linestyle()) for line in ax.get_lines()}
    plt.close(fig)
    assert len(looks) == 12
    runs = []
    for i in range(2):
        run_dir = write_run(tmp_path, f"r{i}", ACC, seed=i)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        for row in rows[1:]:
            row["flatness_distance"] = 0.1 * row["round"]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(load_run(run_dir))

    def width(png: Path) -> int:
        return struct.unpack(">I", png.read_bytes()[16:20])[0]

    one = plot_flatness(runs, tmp_path / "one.png")
    rows = [json.loads(line) for line in (tmp_path / "r0" / "metrics.jsonl").read_text().splitlines()]
    rows[-1].update(sharpness=0.01, hessian_max_eig=3.0)
    (tmp_path / "r0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    three = plot_flatness([load_run(tmp_path / "r0"), runs[1]], tmp_path / "three.png")
    assert width(three) > 2.5 * width(one)  # three panels, then one


def test_many_curves_get_their_legend_beside_the_axes_and_a_diverging_panel_a_log_axis() -> None:
    """With 19 methods the legend inside the axes hid the curves, and FedGF's flatness distance
    (up to about 4,000 against below 3 for every other method) flattened the others to one line:
    more than 10 curves put the legend right of the axes, and a per-round panel whose values are
    all positive and span more than two decades is logarithmic. A few curves keep the legend
    inside; a narrow range, or a value at or below zero (a cosine, which a log axis would hide),
    keeps a linear axis."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from flatflower.tools.report import _legend, _log_if_wide, _plot

    def draw(n: int, top: float, low: float = 0.4):
        fig, ax = plt.subplots()
        curves = [(f"m{i}", [0, 1, 2], [1.0, 0.5, top if i == 0 else low], None) for i in range(n)]
        _plot(ax, curves)
        _log_if_wide(ax, curves)
        _legend(ax, n)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend, axes = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        plt.close(fig)
        return legend.x0 >= axes.x1, ax.get_yscale(), len(ax.get_legend().get_texts())

    assert draw(19, 4000.0) == (True, "log", 19)
    assert draw(11, 3.0) == (True, "linear", 11)
    assert draw(3, 3.0) == (False, "linear", 3)
    assert draw(3, 39.0) == (False, "linear", 3)  # 39 / 0.4 is not above 100
    assert draw(3, 41.0)[1] == "log"
    assert draw(3, 4000.0, low=-0.2)[1] == "linear"
    assert draw(3, 4000.0, low=0.0)[1] == "linear"


def test_bytes_are_printed_in_human_units(tmp_path: Path) -> None:
    from flatflower.tools.report import human_bytes

    assert [human_bytes(n) for n in (999, 3_898_000, 23_400_000_000)] == ["999 B", "3.90 MB", "23.40 GB"]
    text = render_table([{"algorithm": "fedsam", "bytes_total": 3_898_000.0}], "t")
    assert "3.90 MB" in text and "3898000" not in text


def test_csv_has_every_round_of_every_run(tmp_path: Path) -> None:
    import csv

    dirs = [write_run(tmp_path, f"r{s}", ACC[:3], seed=s) for s in range(2)]
    out = tmp_path / "rounds.csv"
    assert main([*map(str, dirs), "--out", str(tmp_path / "p.png"), "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 6 and rows[0]["run"] == str(dirs[0]) and rows[0]["algorithm"] == "fedsam"
    assert [r["round"] for r in rows] == ["0", "1", "2"] * 2 and rows[4]["seed"] == "1"
    assert float(rows[2]["test_accuracy"]) == pytest.approx(ACC[2]) and rows[2]["bytes_up"] == "20"


def _write_clients(run_dir: Path, cosines: dict[int, list[float]]) -> None:
    lines = [json.dumps({"round": r, "partition": i, "status": "accepted", "cosine_to_mean": c,
                         "update_norm": 1.0 + i}) for r, cs in cosines.items() for i, c in enumerate(cs)]
    (run_dir / "clients.jsonl").write_text("\n".join(lines) + "\n")


def test_client_drift_table_and_plot(tmp_path: Path, capsys) -> None:
    from flatflower.tools.report import drift_by_algorithm

    a = write_run(tmp_path, "a", ACC[:3], algorithm="fedavg")
    b = write_run(tmp_path, "b", ACC[:3], algorithm="fedtoga")
    _write_clients(a, {1: [0.2, 0.4], 2: [0.4, 0.6]})
    _write_clients(b, {1: [0.9, 0.7], 2: [1.0, 0.8]})
    rows = drift_by_algorithm([load_run(a), load_run(b)])
    assert [r["algorithm"] for r in rows] == ["fedavg", "fedtoga"]
    assert rows[0]["cosine_mean"] == pytest.approx(0.4) and rows[0]["cosine_min"] == pytest.approx(0.3)
    assert rows[1]["cosine_mean"] == pytest.approx(0.85)
    assert rows[0]["norm_spread"] == pytest.approx(np.std([1, 2]) / 1.5)
    png = tmp_path / "p.png"
    assert main([str(a), str(b), "--out", str(png)]) == 0
    assert "Client drift per algorithm" in capsys.readouterr().out
    assert (tmp_path / "p-drift.png").read_bytes().startswith(PNG_MAGIC)


def test_seed_curves_carry_their_std(tmp_path: Path) -> None:
    from flatflower.tools.report import _curves

    runs = [load_run(write_run(tmp_path, f"r{s}", acc, seed=s))
            for s, acc in enumerate(([0.1, 0.5, 0.7], [0.1, 0.7, 0.9]))]
    ((label, x, mean, std),) = _curves(runs, lambda run: run.rounds)
    assert "mean ± std of 2" in label and x == [0, 1, 2]
    assert mean == pytest.approx([0.1, 0.6, 0.8]) and std == pytest.approx([0.0, 0.1, 0.1])


# ---------------------------------------------------------------- statistics over seeds (tools/stats.py)
def _seeds(root: Path, algorithm: str, finals: list[float], partition_seed: int | None = 0) -> list[Path]:
    """One run per seed whose last accuracy is ``finals[seed]`` (--last-k 1: the last-k mean)."""
    dirs = [write_run(root, f"{algorithm}-s{s}", [0.1, 0.3, acc], algorithm=algorithm, seed=s)
            for s, acc in enumerate(finals)]
    if partition_seed is not None:
        for d in dirs:
            _with_config(d, **{**SAME, "num_server_rounds": 2, "partition_seed": partition_seed})
    return dirs


def _t_p(d: list[float]) -> tuple[float, float]:
    """The paired t statistic of differences ``d`` (3 of them) and its two-sided p from the t
    CDF with 2 degrees of freedom, 1/2 + t / (2 sqrt(2 + t^2)): p = 1 - |t| / sqrt(2 + t^2)."""
    mean = sum(d) / 3
    s = (sum((x - mean) ** 2 for x in d) / 2) ** 0.5
    t = mean / (s / 3 ** 0.5)
    return t, 1 - abs(t) / (2 + t * t) ** 0.5


def test_per_algorithm_intervals_and_the_comparison_with_the_best(tmp_path: Path, capsys) -> None:
    """a: 0.6, 0.7, 0.9 (the best); b: 0.5 every seed; c: 0.3, 0.35, 0.4, all on one partition.
    a's interval: t(0.975, 2) * sqrt(0.07/3) / sqrt(3); b against a: differences 0.1, 0.2, 0.4
    (t = sqrt 7); c against a: 0.3, 0.35, 0.5; Holm over the two. The table, report.json, the
    per-algorithm CSV and report-ci.png carry the same numbers."""
    import csv

    runs = [*_seeds(tmp_path, "a", [0.6, 0.7, 0.9]), *_seeds(tmp_path, "b", [0.5, 0.5, 0.5]),
            *_seeds(tmp_path, "c", [0.3, 0.35, 0.4])]
    js, table_csv, png = tmp_path / "r.json", tmp_path / "alg.csv", tmp_path / "p.png"
    assert main([*map(str, runs), "--last-k", "1", "--out", str(png), "--json", str(js),
                 "--algorithms-csv", str(table_csv)]) == 0
    out = capsys.readouterr().out
    payload = json.loads(js.read_text())
    rows = {row["algorithm"]: row for row in payload["by_algorithm"]}
    half = 4.302652729749462 * 0.07 ** 0.5 / 3
    assert rows["a"]["last_k_ci95"] == pytest.approx(half) and rows["a"]["final_accuracy_ci95"] == pytest.approx(half)
    assert rows["b"]["last_k_ci95"] == pytest.approx(0.0)
    assert "73.33% ± 37.95%" in out and "last k mean ± 95% CI" in out
    comparison = payload["comparison"]
    assert (comparison["best"], comparison["test"], comparison["metric"]) == ("a", "paired t", "last_k_mean")
    (t_b, p_b), (t_c, p_c) = _t_p([0.1, 0.2, 0.4]), _t_p([0.3, 0.35, 0.5])
    b, c = comparison["rows"]
    assert (b["algorithm"], b["n"], b["test"]) == ("b", 3, "paired t")
    assert (b["statistic"], b["p"], c["statistic"], c["p"]) == pytest.approx((t_b, p_b, t_c, p_c), rel=1e-9)
    low, high = sorted([p_b, p_c])  # Holm: the smaller times 2, the larger times 1, never below it
    assert (c["p_holm"], b["p_holm"]) == pytest.approx((2 * low, max(2 * low, high)))
    assert (b["verdict"], c["verdict"]) == ("≈ best", "worse")
    assert "vs the best (a)" in " ".join(out.split()) and "≈ best" in out and "worse" in out
    with table_csv.open(newline="") as f:
        written = {row["algorithm"]: row for row in csv.DictReader(f)}
    assert written["a"]["verdict"] == "best" and written["a"]["p_holm"] == ""
    assert float(written["c"]["p_holm"]) == pytest.approx(c["p_holm"]) and written["c"]["verdict"] == "worse"
    assert float(written["a"]["last_k_ci95"]) == pytest.approx(half) and written["b"]["test"] == "paired t"
    assert (tmp_path / "p-ci.png").read_bytes().startswith(PNG_MAGIC)
    # a gap below --min-gap (e.g. the spread of one run between two machines) is never "worse"
    assert main([*map(str, runs), "--last-k", "1", "--out", str(png), "--json", str(js), "--min-gap", "0.5"]) == 0
    assert [r["verdict"] for r in json.loads(js.read_text())["comparison"]["rows"]] == ["≈ best", "≈ best"]


def test_one_seed_each_gets_no_interval_and_no_verdict(tmp_path: Path, capsys) -> None:
    runs = [*_seeds(tmp_path, "a", [0.9]), *_seeds(tmp_path, "b", [0.5])]
    js = tmp_path / "r.json"
    assert main([*map(str, runs), "--by-algorithm", "--out", str(tmp_path / "p.png"), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    payload = json.loads(js.read_text())
    assert [r["last_k_ci95"] for r in payload["by_algorithm"]] == [None, None] and "(n=1)" in out
    (row,) = payload["comparison"]["rows"]
    assert row["verdict"] == "not testable" and row["p"] is None and row["test"] is None
    assert "no test" in row["note"] and "worse" not in out


def test_runs_on_different_partitions_are_compared_unpaired_and_labelled(tmp_path: Path) -> None:
    """a's runs on partition seed 0, b's on 1: no pair; Welch's test over their runs, named."""
    from scipy import stats

    runs = [*_seeds(tmp_path, "a", [0.6, 0.7, 0.9], 0), *_seeds(tmp_path, "b", [0.5, 0.52, 0.49], 1)]
    js = tmp_path / "r.json"
    assert main([*map(str, runs), "--last-k", "1", "--out", str(tmp_path / "p.png"), "--json", str(js)]) == 0
    (row,) = json.loads(js.read_text())["comparison"]["rows"]
    ref = stats.ttest_ind([0.6, 0.7, 0.9], [0.5, 0.52, 0.49], equal_var=False)
    assert row["test"] == "Welch t (unpaired)" and "compared unpaired" in row["note"]
    assert (row["statistic"], row["p"]) == pytest.approx((ref.statistic, ref.pvalue))


def test_a_bad_min_gap_is_one_error_line(tmp_path: Path, capsys) -> None:
    run_dir = write_run(tmp_path, "r", ACC)
    with pytest.raises(SystemExit) as exit_:
        main([str(run_dir), "--min-gap", "1.5"])
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and "--min-gap" in err[0] and "[0, 1)" in err[0]
    assert not (run_dir / "report.png").exists()


def test_runs_pair_only_on_the_same_partition_json(tmp_path: Path) -> None:
    """The same setting and seeds, but b's runs kept another partition.json (another
    partition): no pair, Welch; the same partition.json: paired."""
    def report_of(b_partition: dict) -> dict:
        root = tmp_path / json.dumps(b_partition["partitions"]["0"])
        runs = [*_seeds(root, "a", [0.6, 0.7, 0.9]), *_seeds(root, "b", [0.5, 0.52, 0.49])]
        for run in runs:
            mine = b_partition if run.name.startswith("b") else {"partitions": {"0": [1, 2]}}
            (run / "partition.json").write_text(json.dumps(mine))
        js = root / "r.json"
        assert main([*map(str, runs), "--last-k", "1", "--out", str(root / "p.png"), "--json", str(js)]) == 0
        return json.loads(js.read_text())["comparison"]["rows"][0]

    assert report_of({"partitions": {"0": [1, 2]}})["test"] == "paired t"
    assert report_of({"partitions": {"0": [2, 1]}})["test"] == "Welch t (unpaired)"


def test_sweeps_md_states_the_tests_as_the_code_makes_them() -> None:
    """docs/sweeps.md's statistics section: the default test, Welch's label, alpha, Wilcoxon's
    smallest p and the number of pairs from which it is given."""
    from flatflower.tools import stats
    from tests.helpers import ROOT, markdown_section

    text = " ".join(markdown_section((ROOT / "docs" / "sweeps.md").read_text(),
                                     "### Statistics over seeds: intervals and the comparison with the best").split())
    assert f"the **{stats.DEFAULT_TEST}-test**" in text and f"labelled `{stats.WELCH}`" in text
    assert f"at least {stats.ALPHA}" in text and "its smallest two-sided p being 2 / 2^n" in text
    n = stats.WILCOXON_MIN_PAIRS
    assert f"the Wilcoxon p is given beside it from {n} pairs on" in text
    assert 2 / 2 ** n < stats.ALPHA <= 2 / 2 ** (n - 1) and 2 / 2 ** 3 > stats.ALPHA  # never below 0.05 at 3 seeds
    near = stats.paired([0.9, 0.8, 0.7, 0.6, 0.5, 0.4][: n - 1], [0.85, 0.78, 0.71, 0.55, 0.46, 0.4][: n - 1], "x")
    assert near.wilcoxon_p is None
    given = stats.paired([0.9, 0.8, 0.7, 0.6, 0.5, 0.45], [0.85, 0.78, 0.69, 0.55, 0.46, 0.4], "x")
    assert given.wilcoxon_p == pytest.approx(2 / 2 ** n)  # every gap positive: the exact test's smallest p
