"""The Fashion-MNIST study's published numbers (docs/results/) are what its runs recorded.

docs/results/fashion-mnist-runs/<algorithm>-s<seed>/ keeps each run's config.json,
metrics.jsonl and, once measured, flatness.json (the files `flatflower report` reads). Every
such run must (1) have run the preset's setting for its algorithm, so that its CSV row is the
row of `flatflower simulate --preset fashion-mnist-bench --algorithm A --seed S`, and (2) give,
through `flatflower report`'s own row function, exactly the numbers of its row in
docs/results/fashion-mnist.csv. No training here: the runs take minutes each.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest

from flatflower.tools.presets import load_preset
from flatflower.tools.report import RUN_COLUMNS, load_run, run_row

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
CSV = RESULTS / "fashion-mnist.csv"
RUNS = sorted(p for p in (RESULTS / "fashion-mnist-runs").glob("*-s*") if p.is_dir())
# issue 27's methods, published since the seed papers: their 21 runs joined the study together
NEWER_METHODS = ("fedsol", "fedgloss", "fedswa", "fedmoswa", "fedwmsam", "fedgf", "dp-fedsam")
# the rows the re-runs replaced (first runs on older code, no run directory kept)
FIRST_RUNS = RESULTS / "fashion-mnist-first-runs.csv"
LAST_K, TARGET = 10, 0.8  # the study's report: --last-k 10 --target 0.8 (docs/benchmarks.md)


def _csv_rows() -> dict[tuple[str, int], dict[str, str]]:
    with CSV.open(newline="") as f:
        rows = list(csv.DictReader(f))
    keys = [(r["algorithm"], int(r["seed"])) for r in rows]
    assert len(keys) == len(set(keys)), "one row per (algorithm, seed)"
    return dict(zip(keys, rows))


def test_the_csv_has_the_report_columns_and_fractions():
    with CSV.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == RUN_COLUMNS
        for row in reader:
            for key in ("final_accuracy", "last_k_mean", "best_accuracy"):
                assert 0.0 <= float(row[key]) <= 1.0, (row["run"], key)
            assert row["run"] == f"{row['algorithm']}-s{row['seed']}"


def _differs_from_the_preset(run, ignore=()):
    """The preset's values for the run's algorithm that its config.json does not hold: key -> (preset, run)."""
    expected = {**load_preset("fashion-mnist-bench").values(run.algorithm), "algorithm": run.algorithm}
    return {k: (v, run.config.get(k)) for k, v in expected.items() if k not in ignore and run.config.get(k) != v}


def _ran_the_preset(run_dir):
    run = load_run(run_dir)
    preset = load_preset("fashion-mnist-bench")
    differ = _differs_from_the_preset(run)
    assert not differ, f"{run_dir.name} did not run the preset's setting: {differ}"
    assert run.rounds[-1] == preset.config["num-server-rounds"]
    assert run.config["num-partitions"] == preset.clients
    return run


@pytest.mark.parametrize("run_dir", RUNS, ids=[p.name for p in RUNS])
def test_a_kept_run_ran_the_preset_and_gives_its_csv_row(run_dir):
    run = _ran_the_preset(run_dir)
    published = _csv_rows()[(run.algorithm, int(run.seed))]
    row = run_row(run, LAST_K, TARGET)
    for key in RUN_COLUMNS:
        mine, theirs = row[key], published[key]
        if mine is None or theirs == "":
            assert mine is None and theirs == "", (key, mine, theirs)
        elif isinstance(mine, float):
            assert math.isclose(mine, float(theirs), rel_tol=1e-12, abs_tol=1e-12), (key, mine, theirs)
        else:
            assert str(mine) == theirs, (key, mine, theirs)


def test_every_row_has_its_kept_run_and_every_kept_run_its_row():
    """A run without a row is a number nobody published; a row without its run, one nobody can
    check."""
    kept = set()
    for run_dir in RUNS:
        algorithm, _, seed = run_dir.name.rpartition("-s")
        kept.add((algorithm, int(seed)))
    assert kept == set(_csv_rows())


def test_the_three_seed_table_in_the_docs_is_the_csvs_mean_and_std():
    """docs/benchmarks.md "Three seeds": each method's final and last-10 accuracy (mean ± std
    over the seeds, numpy's ddof 0) and its top eigenvalue are the CSV's, and every method of
    the CSV is in the table with all its seeds."""
    import numpy as np

    doc = (RESULTS.parent / "benchmarks.md").read_text()
    section = doc[doc.index("### Three seeds"):doc.index("### Seed 0 alone")]
    from flatflower.strategies.registry import ALGORITHMS

    table = [cells for cells in (line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| "))
             if cells[0].strip() in ALGORITHMS]
    rows = _csv_rows()
    methods = {a for a, _ in rows}
    assert {cells[0].strip() for cells in table} == methods
    for cells in table:
        name, seeds = cells[0].strip(), [int(s) for s in cells[1].split(",")]
        assert seeds == sorted(s for a, s in rows if a == name)
        for column, key, scale, digits in ((2, "final_accuracy", 100, 2), (3, "last_k_mean", 100, 2),
                                           (7, "hessian_max_eig", 1, 1)):
            values = [float(rows[name, s][key]) * scale for s in seeds]
            mean, std = (float(x) for x in cells[column].split("±"))
            assert mean == round(float(np.mean(values)), digits), (name, key)
            assert std == round(float(np.std(values)), digits), (name, key)


def test_the_newer_methods_have_all_three_seeds_run_on_the_code_of_1d7cb70():
    """Issue 27's seven methods joined the study together: seeds 0, 1 and 2 of each, every run
    on the code of 1d7cb70 (docs/benchmarks.md, "Which code gives which row"), each with its
    final model's train-split flatness."""
    rows = _csv_rows()
    for algorithm in NEWER_METHODS:
        for seed in (0, 1, 2):
            row = rows[algorithm, seed]
            run = load_run(RESULTS / "fashion-mnist-runs" / row["run"])
            assert run.record["versions"]["flatflower-code"].startswith("1d7cb70"), row["run"]
            assert row["flatness_split"] == "train" and row["hessian_max_eig"] != "", row["run"]
    doc = " ".join((RESULTS.parent / "benchmarks.md").read_text().split())
    assert f"study: {len({a for a, _ in rows})} methods x 3 seeds" in doc


def _spearman(x, y) -> float:
    import numpy as np

    rx, ry = (np.argsort(np.argsort(v)) for v in (x, y))
    return float(np.corrcoef(rx, ry)[0, 1])


def test_the_rank_correlations_in_the_docs_are_the_csvs():
    """docs/benchmarks.md, "Three seeds": the Spearman correlations of each method's mean last-10
    accuracy with its mean top eigenvalue, sharpness and flatness distance, over the methods the
    sentence names and over the 11 of the seed papers' study (all of before but MoFedSAM). Left
    out: MoFedSAM and FedGF, which do not train (a model at chance is flat), and DP-FedSAM, whose
    accuracy pays for privacy and whose flatness distance is its clients' noise."""
    import numpy as np

    rows = _csv_rows()
    by: dict[str, list[dict[str, str]]] = {}
    for (algorithm, _), row in rows.items():
        by.setdefault(algorithm, []).append(row)

    def correlations(methods) -> str:
        acc = [np.mean([float(r["last_k_mean"]) for r in by[a]]) for a in methods]
        return ", ".join(f"{_spearman(acc, [np.mean([float(r[k]) for r in by[a]]) for a in methods]):.2f}"
                         for k in ("hessian_max_eig", "sharpness", "flatness_distance"))

    everyone = sorted(set(by) - {"mofedsam", "fedgf", "dp-fedsam"})
    before = sorted(set(by) - {"mofedsam", *NEWER_METHODS})
    assert len(everyone) == 16 and len(before) == 11
    doc = " ".join((RESULTS.parent / "benchmarks.md").read_text().split())
    said = (f"Rank correlation (Spearman) over the 16 methods other than MoFedSAM, FedGF and DP-FedSAM, of the "
            f"last-10 mean with the top eigenvalue, the sharpness and the last-10 flatness distance: "
            f"{correlations(everyone)}; over the 11 methods of the seed papers' study (MoFedSAM aside): "
            f"{correlations(before)}")
    assert said in doc, said


def test_dp_fedsams_epsilon_is_opacus_accounting_of_its_rounds_and_in_the_docs():
    """DP-FedSAM's rows: every round t reports the epsilon of Opacus's RDP analysis of t rounds
    of the sampled Gaussian mechanism (the run's sampling rate, 10 of 100, and noise multiplier;
    RDP composes by addition, so t rounds are t times one) at the run's delta, on the same
    orders; the three seeds spend the same; docs/benchmarks.md states round 100's."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    from flatflower.common.privacy import ORDERS

    spent, one_round = [], {}
    for seed in (0, 1, 2):
        run = load_run(RESULTS / "fashion-mnist-runs" / f"dp-fedsam-s{seed}")
        sigma, delta, rate = (run.config[k] for k in ("dp.noise-multiplier", "dp.delta", "fraction-train"))
        assert run.config["dp.clip"] > 0 and sigma > 0 and 0 < rate < 1
        if (rate, sigma) not in one_round:  # 1,980 orders: seconds a computation
            one_round[rate, sigma] = compute_rdp(q=rate, noise_multiplier=sigma, steps=1, orders=list(ORDERS))
        for t, row in enumerate(run.rows[1:], start=1):
            assert row["round"] == t and row["clients_replied"] == row["clients_sampled"] == 10
            epsilon, _ = get_privacy_spent(orders=list(ORDERS), rdp=t * one_round[rate, sigma], delta=delta)
            assert math.isclose(row["dp_epsilon"], epsilon, rel_tol=1e-9), (seed, t)
        spent.append(run.rows[-1]["dp_epsilon"])
    assert len({round(e, 9) for e in spent}) == 1 and len(one_round) == 1
    doc = " ".join((RESULTS.parent / "benchmarks.md").read_text().split())
    assert f"ε = {spent[0]:.2f} after round 100 (δ = {delta:g};" in doc


def test_fedgfs_threshold_in_the_preset_is_the_calibration_runs_median_divergence():
    """The preset's T_D comes from the kept calibration run (docs/results/fashion-mnist-calibration):
    FedGF with T_D = inf on the study's setting, which is FedSAM (its accuracies are those of the
    FedSAM seed-0 run of the sharpness curves, round for round), and T_D is the median of its divergence D over
    rounds 11-30 to the preset's two digits."""
    calib = load_run(RESULTS / "fashion-mnist-calibration" / "fedgf-inf-s0")
    values = load_preset("fashion-mnist-bench").values("fedgf")
    assert calib.algorithm == "fedgf" and calib.config["fedgf.threshold"] == math.inf
    # the study's setting, 30 rounds
    assert not _differs_from_the_preset(calib, ignore=("fedgf.threshold", "num-server-rounds"))
    rows = calib.rows
    assert all(r["fedgf_mix"] == 0.0 for r in rows[1:])  # T_D = inf: c = 0, FedSAM
    divergences = [r["fedgf_divergence"] for r in rows if 11 <= r["round"] <= 30]
    assert len(divergences) == 20
    assert abs(statistics.median(divergences) - values["fedgf.threshold"]) < 0.01
    fedsam = load_run(RESULTS / "fashion-mnist-curves" / "fedsam-s0")
    assert fedsam.accuracy[:len(rows)] == calib.accuracy


def test_the_replaced_first_runs_are_kept_and_listed_in_the_docs_beside_their_reruns():
    """The 15 rows first run on older code (before c62a3ad) are kept in fashion-mnist-first-runs.csv;
    each was run again (its row in the CSV now, from a kept run on a recorded commit), and
    docs/benchmarks.md lists both final accuracies."""
    with FIRST_RUNS.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == RUN_COLUMNS
        first = list(reader)
    assert len(first) == 15
    rows = _csv_rows()
    doc = " ".join((RESULTS.parent / "benchmarks.md").read_text().split())
    for old in first:
        key = (old["algorithm"], int(old["seed"]))
        new = rows[key]
        run = load_run(RESULTS / "fashion-mnist-runs" / new["run"])
        assert run.record["versions"]["flatflower-code"].startswith("77830e1")
        said = (f"{old['algorithm']} s{old['seed']} {100 * float(old['final_accuracy']):.2f} → "
                f"{100 * float(new['final_accuracy']):.2f}")
        assert said in doc, said


def test_the_sharpness_curve_runs_trained_as_their_study_rows_did():
    """Measuring flatness during a run leaves its training bit for bit as it is: the curve runs
    (--flatness-every 10, on later code) give the seed-0 rows' accuracies round for round."""
    for algorithm in ("fedavg", "fedsam", "fedgmt"):
        curve = load_run(RESULTS / "fashion-mnist-curves" / f"{algorithm}-s0")
        row = load_run(RESULTS / "fashion-mnist-runs" / f"{algorithm}-s0")
        assert curve.config["flatness-every"] == 10 and row.config["flatness-every"] == 0
        assert curve.accuracy == row.accuracy, algorithm


def test_fedgf_at_the_calibrated_threshold_is_at_chance_from_round_two_as_the_docs_say():
    """docs/benchmarks.md: with the preset's T_D, round 1's D (above it) makes c = 1 in round 2,
    D stays far above T_D and the model at chance (the kept 10-round run of the preset's FedGF)."""
    run = load_run(RESULTS / "fashion-mnist-calibration" / "fedgf-s0")
    values = load_preset("fashion-mnist-bench").values("fedgf")
    assert run.algorithm == "fedgf" and not _differs_from_the_preset(run, ignore=("num-server-rounds",))
    rows = run.rows[1:]
    assert len(rows) == 10 and rows[0]["fedgf_divergence"] > values["fedgf.threshold"]
    assert all(r["fedgf_mix"] == 1.0 for r in rows)  # c of the next round
    later = rows[1:]
    assert 7.5 < min(r["fedgf_divergence"] for r in later) and max(r["fedgf_divergence"] for r in later) < 67.5
    assert (round(100 * min(r["test_accuracy"] for r in later), 1),
            round(100 * max(r["test_accuracy"] for r in later), 1)) == (9.9, 18.0)
    doc = " ".join((RESULTS.parent / "benchmarks.md").read_text().split())
    assert "D 8-67 from round 2" in doc and "9.9-18.0% over rounds 2-10" in doc


def _gpu_processes(folder: Path) -> dict[str, list[tuple[str, int]]]:
    """pid -> (time, MiB) for each sample of folder/gpu-processes.txt that saw it hold GPU memory
    (lines "HH:MM:SS pid, MiB MiB": nvidia-smi --query-compute-apps=pid,used_memory, timestamped)."""
    held: dict[str, list[tuple[str, int]]] = {}
    for line in (folder / "gpu-processes.txt").read_text().splitlines():
        time, pid, mib, _ = line.split()
        held.setdefault(pid.rstrip(","), []).append((time, int(mib)))
    return held


def test_the_gpu_table_in_the_docs_is_what_its_runs_recorded():
    """docs/benchmarks.md, "One GPU, measured": each number of the table comes from the files
    kept in docs/results/gpu-h200/ (round-time medians, accuracies, GPU processes, flatness)."""
    gpu = RESULTS / "gpu-h200"
    doc = " ".join((RESULTS.parent / "benchmarks.md").read_text().split())
    section = doc[doc.index("### One GPU, measured"):]

    runs = {p.name: load_run(p) for p in gpu.iterdir() if (p / "metrics.jsonl").is_file()}

    def median_seconds(name: str) -> str:
        return f"{statistics.median(r['seconds'] for r in runs[name].rows[1:]):.1f}"

    def pct(name: str, rnd: int) -> str:
        return f"{100 * runs[name].accuracy[rnd]:.2f}%"

    assert len(runs["vec-fedsam"].rows) - 1 == 66
    assert f"median {median_seconds('inp-fedsam')} s a round (rounds 1-10" in section
    assert f"median {median_seconds('vec-fedsam')} s a round over 66 rounds" in section
    assert f"median {median_seconds('cpu-fedsam')} s a round (3 rounds)" in section
    assert f"{median_seconds('inp5')} s (3.5-5.5) in the second call's 5 rounds" in section
    assert f"no faster ({median_seconds('bf16')} s median" in section
    assert pct("vec-fedsam", 1) == pct("vec-again", 1) and pct("vec-fedsam", 2) != pct("vec-again", 2)
    assert (f"agree in round 1 ({pct('vec-fedsam', 1)}) and differ from round 2 ({pct('vec-fedsam', 2)} "
            f"and {pct('vec-again', 2)})") in section
    assert (f"gave {pct('inp-fedsam', 1)} and {pct('inp5', 1)} in round 1 on two machines, against "
            f"{pct('cpu-fedsam', 1)} on the CPU of the first") in section
    assert pct("cpu-fedsam", 1) in section.split("The study's rows stay CPU rows")[1]
    assert (f"{pct('bf16', 5)} after round 5 against {pct('vec-fedsam', 5)} and {pct('vec-again', 5)}"
            in section)
    assert f"final accuracy {pct('local-cuda', 3)}" in section
    assert len(_gpu_processes(gpu / "local-cuda")) == 4 and "4 worker processes held the GPU" in section
    for name in ("vec-fedsam", "inp-fedsam", "cpu-fedsam", "vec-again", "inp5", "bf16"):
        run = runs[name]
        assert run.record["versions"]["flatflower-code"].startswith("26b4fd8")
        assert (run.algorithm, run.config["seed"]) == ("fedsam", 0)
    flat = json.loads((gpu / "inp5" / "flatness-cuda.json").read_text())
    assert (flat["split"], flat["examples"]) == ("train", 60000)


def test_the_h100_table_in_the_docs_is_what_its_runs_recorded():
    """docs/benchmarks.md, "One GPU, measured again": the newer methods' accuracies and round
    times, DP's epsilon, the deployment's GPU processes, ResNet-18's step costs and the GPU's
    utilisation are those of the files kept in docs/results/gpu-h100/."""
    gpu = RESULTS / "gpu-h100"
    doc = (RESULTS.parent / "benchmarks.md").read_text()
    section = doc[doc.index("### One GPU, measured again"):]
    flat = " ".join(section.split())
    from flatflower.strategies.registry import ALGORITHMS

    table = [cells for cells in (line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| "))
             if cells[0].strip() in ALGORITHMS]
    assert [c[0].strip() for c in table] == ["fedgloss", "fedswa", "fedmoswa", "fedgf", "fedwmsam", "fedsol",
                                             "dp-fedsam"]

    def rounds(run) -> str:
        return f"{100 * run.accuracy[1]:.2f} / {100 * run.accuracy[2]:.2f}"

    for cells in table:
        name = cells[0].strip()
        inp, vec, cpu = (load_run(gpu / d) for d in (f"inp-{name}", f"vec-{name}", f"cpu-vm/inp-{name}"))
        for run, engine in ((inp, "inprocess"), (vec, "vectorized"), (cpu, "inprocess")):
            assert (run.algorithm, run.config["seed"], run.record["engine"]) == (name, 0, engine)
            assert not _differs_from_the_preset(run, ignore=("num-server-rounds",))
            assert run.rounds[-1] == 2
        assert inp.record["versions"]["flatflower-code"].startswith("cc5ee51")
        assert [c.strip() for c in cells[1:4]] == [rounds(inp), rounds(vec), rounds(cpu)]
        assert cells[4].strip() == f"{inp.rows[2]['seconds']:.1f} / {vec.rows[2]['seconds']:.1f}"
    epsilons = {round(load_run(gpu / d).rows[2]["dp_epsilon"], 3)
                for d in ("inp-dp-fedsam", "vec-dp-fedsam", "cpu-vm/inp-dp-fedsam")}
    assert epsilons == {2.674} and "the same `dp_epsilon` everywhere (2.674 after round 2" in flat

    local, local_cpu = load_run(gpu / "local-dp"), load_run(gpu / "cpu-vm" / "local-dp")
    assert (local.algorithm, local.config["dp.clip"], local.config["dp.noise-multiplier"]) == ("dp-fedsam", 0.5, 0.5)
    assert (f"{100 * local.accuracy[3]:.2f}% after round 3, `dp_epsilon` {local.rows[3]['dp_epsilon']:.2f}; the "
            f"same command on this VM's CPU gave {100 * local_cpu.accuracy[3]:.2f}%") in flat
    assert round(local.rows[3]["dp_epsilon"], 6) == round(local_cpu.rows[3]["dp_epsilon"], 6)
    held = _gpu_processes(gpu)
    workers = [pid for pid, h in held.items() if 700 <= max(m for _, m in h) <= 820]  # the SuperNodes
    assert len(workers) == 4 and "4 worker processes held the GPU (710-810 MiB each)" in flat
    assert len(held) == 7 + 7 + 4 + 1  # one process per simulate run, the 4 workers, the bench

    bench = {r["algorithm"]: r for r in json.loads((gpu / "bench-resnet.json").read_text())["compute"]}
    sgd = [r["sgd_seconds_per_step"] * 1e3 for r in bench.values()]
    assert f"a plain SGD step takes {min(sgd):.1f}-{max(sgd):.1f} ms" in flat
    assert (f"FedAvg {bench['fedavg']['seconds_per_step'] * 1e3:.1f} ms, FedSAM "
            f"{bench['fedsam']['seconds_per_step'] * 1e3:.1f} ms") in flat
    assert f"FedSAM {bench['fedsam']['cost_vs_sgd']:.2f}x" in flat

    with (gpu / "nvidia-smi.csv").open() as f:
        samples = [(r[0].split()[1][:8], int(r[1].split()[0])) for r in list(csv.reader(f))[1:] if len(r) > 2]
    runs = sorted(held.values())[:14]  # the 14 simulate runs came first, one process each
    first, last = runs[0][0][0], runs[-1][-1][0]
    peaks = [max(m for _, m in h) / 1024 for h in runs]  # GiB; in-process runs, then vectorised
    assert all(1.75 <= g < 1.85 for g in peaks[:7]) and all(0.85 <= g < 0.95 for g in peaks[7:])
    assert "held 1.8 GiB of GPU memory, each vectorised run's 0.9 GiB" in flat
    busy = [u for t, u in samples if first <= t <= last]
    assert f"at most {max(busy)}%" in flat
