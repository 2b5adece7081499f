"""``flatflower sweep``: algorithms x seeds on one partition, one report (in-process engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flatflower.tools.cli import main as cli
from flatflower.tools.sweep import main

FAST = ["--engine", "inprocess", "--clients", "3", "--rounds", "2", "--dataset", "synthetic",
        "--model", "logreg", "--partition", "dirichlet", "--set", "local-steps=2"]


def sweep(out, *extra, algorithms="fedavg,fedsam", seeds="0,1"):
    return cli(["sweep", "--algorithms", algorithms, "--seeds", seeds, "--out", str(out), *FAST, *extra])


def test_sweep_runs_every_pair_on_one_partition_and_reports_per_algorithm(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert sweep(out, "--target", "0.5") == 0
    dirs = [out / f"{a}-s{s}" for a in ("fedavg", "fedsam") for s in (0, 1)]
    parts = {json.dumps(json.loads((d / "partition.json").read_text())["partitions"]) for d in dirs}
    assert len(parts) == 1, "the seeds trained on different partitions"
    inits = [torch.load(out / f"fedavg-s{s}" / "model_init.pt") for s in (0, 1)]
    assert any(not torch.equal(inits[0][k], inits[1][k]) for k in inits[0]), "seeds gave the same init"
    report = json.loads((out / "report.json").read_text())
    assert len(report["runs"]) == 4
    rows = {r["algorithm"]: r for r in report["by_algorithm"]}
    assert set(rows) == {"fedavg", "fedsam"} and all(r["num_seeds"] == 2 for r in rows.values())
    for png in ("report.png", "report-bytes.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Per algorithm" in capsys.readouterr().out


def test_resume_existing_skips_finished_runs(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert sweep(out, algorithms="fedavg", seeds="0") == 0
    before = (out / "fedavg-s0" / "metrics.jsonl").read_text()
    assert sweep(out, "--resume-existing", algorithms="fedavg", seeds="0,1") == 0
    assert "fedavg-s0 already finished, skipped" in capsys.readouterr().out
    assert (out / "fedavg-s0" / "metrics.jsonl").read_text() == before
    assert (out / "fedavg-s1" / "summary.json").is_file()
    # without the flag an existing run directory is refused, and nothing is lost
    assert sweep(out, algorithms="fedavg", seeds="0") == 2
    assert (out / "fedavg-s0" / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_resume_existing_continues_an_interrupted_run_from_its_checkpoint(tmp_path, capsys, jobs="2"):
    """A run stopped after round 2 of 4 (its checkpoint kept, no final model) goes on from round
    3 to the uninterrupted run's model; one interrupted before any checkpoint is moved aside
    (kept) and run afresh; finished runs are untouched."""
    from tests.helpers import metrics

    full = tmp_path / "full"
    assert sweep(full, "--rounds", "4", algorithms="fedavg,fedsam", seeds="0") == 0
    out = tmp_path / "sweep"
    assert sweep(out, "--rounds", "2", algorithms="fedavg,fedsam", seeds="0") == 0
    for name in ("fedavg-s0", "fedsam-s0"):  # as a kill after round 2 leaves them
        (out / name / "summary.json").unlink()
        (out / name / "model_final.pt").unlink()
    (out / "fedsam-s0" / "checkpoint.pt").unlink()  # killed before its first checkpoint
    assert sweep(out, "--rounds", "4", "--resume-existing", "--jobs", jobs, algorithms="fedavg,fedsam",
                 seeds="0") == 0
    text = capsys.readouterr().out
    assert "fedavg-s0 was interrupted: resumed from its checkpoint" in text
    assert "fedsam-s0 was interrupted before its first checkpoint: moved to fedsam-s0.incomplete-1" in text
    assert (out / "fedsam-s0.incomplete-1" / "metrics.jsonl").is_file()  # nothing deleted
    for name in ("fedavg-s0", "fedsam-s0"):
        a, b = (torch.load(d / name / "model_final.pt") for d in (full, out))
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert [r["round"] for r in metrics(out / name)] == [0, 1, 2, 3, 4]
    assert len(json.loads((out / "report.json").read_text())["runs"]) == 2


def test_a_failed_run_does_not_stop_the_others(tmp_path, capsys):
    """fedadam refuses server-lr != 1 (exit 2) after fedavg ran: reported, the rest goes on."""
    out = tmp_path / "sweep"
    assert sweep(out, "--set", "server-lr=0.5", algorithms="fedavg,fedadam,fedsam", seeds="0") == 1
    err = capsys.readouterr().err
    assert "fedadam-s0 failed" in err and "server-lr=0.5 has no effect on fedadam" in err
    assert (out / "fedavg-s0" / "summary.json").is_file() and (out / "fedsam-s0" / "summary.json").is_file()
    assert len(json.loads((out / "report.json").read_text())["runs"]) == 2


def test_bad_input_is_one_error_line_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "sweep"
    for algorithms, seeds, extra, message in [
        ("fedavg,fedfoo", "0", [], "unknown algorithm(s) fedfoo"),
        ("fedavg", "0,x", [], "--seeds expects comma-separated integers"),
        ("fedavg", "1,1", [], "--seeds must be distinct"),
        ("fedavg", "0", ["--set", "lr=-1"], "lr must be a finite number > 0"),
    ]:
        assert sweep(out, *extra, algorithms=algorithms, seeds=seeds) == 2
        assert message in capsys.readouterr().err
        assert not (out / "fedavg-s0" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flag", ["--algorithm", "--seed", "--run-dir", "--resume"])
def test_the_flags_the_sweep_sets_itself_are_not_options(tmp_path, capsys, flag):
    """--algorithm, --seed, --run-dir and --resume mean nothing to a sweep (it sets each run's):
    not in its help, and refused in one line."""
    from flatflower.tools.sweep import build_parser

    assert flag + " " not in build_parser().format_help()
    with pytest.raises(SystemExit) as exit_:
        main(["--algorithms", "fedavg", "--out", str(tmp_path / "s"), flag, "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == [f"error: unrecognized arguments: {flag} x (see flatflower "
                                             "sweep --help)"]
    assert not (tmp_path / "s").exists()


def _partition_seeds(out: Path) -> dict[str, int]:
    return {d.name: json.loads((d / "config.json").read_text())["config"]["partition-seed"]
            for d in sorted(out.iterdir()) if (d / "config.json").is_file()}


@pytest.mark.slow
def test_a_sweep_run_one_seed_at_a_time_stays_on_one_partition(tmp_path, capsys):
    """The study's way: one sweep per seed into one OUT. Seed 1's piece takes the partition of
    the runs already there, not its own first seed; an OUT of mixed partitions is refused."""
    out = tmp_path / "sweep"
    assert sweep(out, algorithms="fedavg", seeds="0") == 0
    assert sweep(out, "--resume-existing", algorithms="fedavg,fedsam", seeds="1") == 0
    assert _partition_seeds(out) == {"fedavg-s0": 0, "fedavg-s1": 0, "fedsam-s1": 0}
    parts = {(out / d / "partition.json").read_text() for d in ("fedavg-s0", "fedavg-s1", "fedsam-s1")}
    assert len({json.dumps(json.loads(t)["partitions"]) for t in parts}) == 1
    assert sweep(out, "--set", "partition-seed=5", algorithms="fedsam", seeds="5") == 0  # given: it wins
    assert _partition_seeds(out)["fedsam-s5"] == 5
    capsys.readouterr()
    assert sweep(out, algorithms="fedavg", seeds="7") == 2
    err = capsys.readouterr().err
    assert "are on different partitions (partition-seed 0: fedavg-s0, fedavg-s1, fedsam-s1; " \
           "partition-seed 5: fedsam-s5)" in err and "--set partition-seed=" in err
    assert not (out / "fedavg-s7").exists()


def test_a_presets_partition_seed_is_the_sweeps(tmp_path):
    """A preset that fixes partition-seed (the study presets) keeps it in a sweep of other
    seeds: each run is then the one `simulate --preset P --seed S` gives."""
    preset = tmp_path / "p.toml"
    preset.write_text('[preset]\ndescription = "d"\nsource = "s"\nclients = 3\n\n[config]\n'
                      'dataset = "synthetic"\nmodel = "logreg"\npartition = "dirichlet"\n'
                      'partition-seed = 4\nlocal-steps = 2\nnum-server-rounds = 2\n')
    out = tmp_path / "sweep"
    assert cli(["sweep", "--algorithms", "fedavg", "--seeds", "1,2", "--out", str(out), "--engine", "inprocess",
                "--preset", str(preset)]) == 0
    assert _partition_seeds(out) == {"fedavg-s1": 4, "fedavg-s2": 4}
    assert cli(["simulate", "--engine", "inprocess", "--preset", str(preset), "--algorithm", "fedavg",
                "--seed", "2", "--run-dir", str(tmp_path / "one")]) == 0
    a, b = (torch.load(d / "model_final.pt") for d in (out / "fedavg-s2", tmp_path / "one"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_partition_seed_decouples_the_partition_from_the_seed(tmp_path):
    from flatflower.common.config import RunConfig
    from flatflower.common.data import partitions_for

    base = {"dataset": "synthetic", "partition": "dirichlet"}
    a, b = (partitions_for(RunConfig.from_mapping({**base, "seed": s, "partition-seed": 7}), 4) for s in (0, 1))
    assert all((x == y).all() for x, y in zip(a, b))
    c, d = (partitions_for(RunConfig.from_mapping({**base, "seed": s}), 4) for s in (0, 1))
    assert any(len(x) != len(y) or (x != y).any() for x, y in zip(c, d))


@pytest.mark.slow
def test_jobs_run_in_parallel_processes_with_their_logs_and_one_report(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert sweep(out, "--jobs", "2", algorithms="fedavg,fedsam", seeds="0") == 0
    text = capsys.readouterr().out
    assert "sweep: started fedavg-s0 (1/2)" in text and "sweep: fedsam-s0 finished" in text
    for name in ("fedavg-s0", "fedsam-s0"):
        assert (out / name / "summary.json").is_file()
        assert "final test accuracy" in (out / f"{name}.log").read_text()  # the run's own output
    parts = {(out / n / "partition.json").read_text() for n in ("fedavg-s0", "fedsam-s0")}
    assert len(parts) == 1
    report = json.loads((out / "report.json").read_text())
    assert [r["algorithm"] for r in report["runs"]] == ["fedavg", "fedsam"]


def test_jobs_with_bad_options_start_nothing(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert sweep(out, "--jobs", "2", "--set", "lr=-1", algorithms="fedavg,fedsam", seeds="0") == 2
    assert "lr must be a finite number > 0" in capsys.readouterr().err
    assert not list(out.glob("*.log")) and not (out / "fedavg-s0").exists()
    assert sweep(out, "--jobs", "0", algorithms="fedavg", seeds="0") == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err


def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    from pathlib import Path

    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


@pytest.mark.parametrize("jobs", ["1", "2"])
@pytest.mark.slow
def test_a_terminated_sweep_stops_its_runs_and_resumes_where_it_stopped(tmp_path, jobs):
    """SIGTERM (as `kill` or a closed session sends) ends the sweep and every run it started
    (--jobs 2: its simulate processes), exit 130; --resume-existing then finishes the sweep."""
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import round_deadline

    out = tmp_path / "sweep"
    argv = [sys.executable, "-m", "flatflower.tools.cli", "sweep", "--algorithms", "fedavg,fedsam", "--seeds", "0",
            "--out", str(out), "--jobs", jobs, *FAST[:-1], "local-steps=400", "--rounds", "6"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 3 * round_deadline()
    while not (out / "fedavg-s0" / "checkpoint.pt").exists():  # a run is under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.2)
    runs = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=round_deadline())
    err = proc.stderr.read()
    assert code == 130, f"exit {code}; its stderr:\n{err[-3000:]}"  # (one SIGABRT seen under load: why?)
    assert "interrupted" in err
    for pid in runs:  # the runs it started are gone too
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert not (out / "fedavg-s0" / "summary.json").exists()
    assert sweep(out, "--resume-existing", "--set", "local-steps=400", "--rounds", "6",
                 algorithms="fedavg,fedsam", seeds="0") == 0
    assert all((out / f"{a}-s0" / "summary.json").is_file() for a in ("fedavg", "fedsam"))
