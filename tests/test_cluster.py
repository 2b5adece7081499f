"""runtime/cluster.py: independent jobs on this machine's cores or on a Ray cluster that already
runs (``sweep --ray-address``, ``simulate --engine ray --ray-address``). The slow test starts a
real two-node Ray cluster on 127.0.0.1 (``ray start --head`` and a second ``ray start
--address``) and stops exactly what it started (its processes carry a mark of their own)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch

from flatflower.runtime.cluster import OUTPUT, ClusterError, Job, pack, probe, run_jobs, unpack
from flatflower.runtime.engines.federation import MARK, _marked, _terminate, free_port
from flatflower.tools.cli import main as cli

RUN = ["--clients", "2", "--rounds", "2", "--dataset", "digits"]


def write_then_return(run_dir: Path, text: str) -> str:
    """A callable job: writes into its run directory, prints, returns a value."""
    run_dir.mkdir(parents=True)
    (run_dir / "note.txt").write_text(text)
    print(f"wrote {text}")
    return text.upper()


def fail(run_dir: Path) -> None:
    raise RuntimeError("this trial failed")


def test_local_jobs_run_side_by_side_and_a_failure_stops_none_of_the_others(tmp_path):
    jobs = [Job("bad", tmp_path / "bad", argv=("-c", "import sys; print('going'); sys.exit(3)")),
            Job("cmd", tmp_path / "cmd", argv=("-c", "import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
                                                     "p.mkdir(); (p / 'x').write_text('1')", str(tmp_path / "cmd"))),
            Job("call", tmp_path / "call", call=write_then_return, args=("hi",)),
            Job("raises", tmp_path / "raises", call=fail)]
    seen = []
    results = {r.job.name: r for r in run_jobs(jobs, parallel=2, on_done=seen.append)}
    assert [r.job.name for r in seen] and len(seen) == 4
    assert (results["bad"].ok, results["bad"].code, results["bad"].error) == (False, 3, "exit 3")
    assert (tmp_path / "bad.log").read_text() == "going\n"
    assert results["cmd"].ok and (tmp_path / "cmd" / "x").read_text() == "1"
    assert results["call"].ok and results["call"].value == "HI" and results["call"].code is None
    assert (tmp_path / "call" / "note.txt").read_text() == "hi"
    assert (tmp_path / "call.log").read_text() == "wrote hi\n"  # a call's output goes to its log too
    assert not results["raises"].ok and "RuntimeError: this trial failed" in results["raises"].error


def test_a_job_is_a_command_or_a_call_with_a_share_that_is_not_negative(tmp_path):
    for bad in (dict(), dict(argv=("-V",), call=fail), dict(argv=("-V",), num_gpus=-1)):
        with pytest.raises(ValueError):
            Job("j", tmp_path, **bad)


def test_an_archive_carries_files_and_folders_and_the_output_apart(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_bytes(b"{}\n")
    (run / "logs" / "run.log").write_bytes(b"log")
    (run / "link").symlink_to("/etc/hostname")  # left out: a run directory holds no links
    back = tmp_path / "back"
    assert unpack(pack(run, {OUTPUT: b"output"}), back) == b"output"
    assert sorted(p.relative_to(back).as_posix() for p in back.rglob("*")) == ["logs", "logs/run.log",
                                                                              "metrics.jsonl"]
    assert (back / "logs" / "run.log").read_bytes() == b"log"
    assert unpack(pack(tmp_path / "none"), tmp_path / "empty") is None
    assert not (tmp_path / "empty").exists()  # a run that wrote nothing leaves no folder


def test_an_archive_cannot_write_outside_its_folder(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError):
        unpack(buffer.getvalue(), tmp_path / "in")
    assert not (tmp_path / "escaped").exists()


def test_joining_a_cluster_gives_ray_no_size_of_this_machine():
    from flatflower.runtime.engines import ray_federation_config

    assert "init-args-num-cpus" in ray_federation_config(2)
    assert ray_federation_config(2, 1, 0.5, joins=True) == {
        "num-supernodes": 2, "client-resources-num-cpus": 1, "client-resources-num-gpus": 0.5}


@pytest.mark.parametrize("command", [
    ["simulate", "--engine", "ray", "--run-dir", "{out}/run", *RUN],
    ["sweep", "--algorithms", "fedavg,fedsam", "--seeds", "0", "--out", "{out}", "--engine", "inprocess", *RUN],
])
def test_an_unreachable_ray_address_is_one_error_line_before_anything_starts(tmp_path, capsys, command):
    port = free_port()  # handed out to no one, bound by no one: refused
    argv = [a.replace("{out}", str(tmp_path / "out")) for a in command]
    started = time.monotonic()
    assert cli([*argv, "--ray-address", f"127.0.0.1:{port}"]) == 2
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --ray-address 127.0.0.1:{port}: nothing answers there (Connection refused); "
                   f"start the cluster's head with 'ray start --head --port {port}' or give its address"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    (["--ray-address", "127.0.0.1:1"], "--ray-address runs Flower's Ray simulation engine on a cluster"),
    (["--engine", "ray", "--ray-address", "ray://10.0.0.1:10001"], "is not HOST:PORT"),
])
def test_simulate_refuses_a_ray_address_without_the_ray_engine_or_a_bad_one(tmp_path, capsys, extra, message):
    assert cli(["simulate", "--run-dir", str(tmp_path / "run"), *RUN, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, message", [
    (["--gpus-per-run", "1"], "--gpus-per-run size each run's Ray task: add --ray-address"),
    (["--engine", "ray", "--ray-address", "127.0.0.1:1"], "use --engine inprocess or vectorized there"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_sweep_refuses_task_sizes_without_a_cluster_and_ray_inside_its_tasks(tmp_path, capsys, extra, message):
    assert cli(["sweep", "--algorithms", "fedavg", "--seeds", "0", "--out", str(tmp_path / "out"), *RUN,
                *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "out").exists()


def test_jobs_auto_is_this_machines_cores():
    from flatflower.tools.parsers import sweep

    args = sweep().parse_args(["--algorithms", "fedavg", "--out", "o", "--jobs", "auto"])
    assert args.jobs == len(os.sched_getaffinity(0))
    assert sweep().parse_args(["--algorithms", "fedavg", "--out", "o"]).jobs is None  # 1, in this process


# ---------------------------------------------------------------- a real cluster


def ray_start(mark: str, temp: Path, *args: str) -> None:
    env = {**os.environ, MARK: mark, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(temp)}
    ray = Path(sys.executable).parent / "ray"  # this environment's
    done = subprocess.run([str(ray), "start", *args, "--num-cpus", "1", "--node-ip-address", "127.0.0.1",
                           "--temp-dir", str(temp), "--disable-usage-stats"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.fixture
def ray_cluster():
    """HOST:PORT of a two-node Ray cluster on 127.0.0.1 (a head and a second node, 1 CPU each),
    stopped afterwards by the mark its processes inherit (never a blanket ``ray stop``)."""
    import shutil

    mark = f"ray-cluster-test-{uuid.uuid4().hex[:12]}"
    temp = Path(tempfile.mkdtemp(prefix="ffray-", dir="/tmp"))  # short: Ray's socket paths
    port = free_port()
    try:
        ray_start(mark, temp, "--head", "--port", str(port), "--include-dashboard", "false")
        ray_start(mark, temp, "--address", f"127.0.0.1:{port}")
        yield f"127.0.0.1:{port}"
    finally:
        # again while any is left: a killed process takes a moment to leave /proc, and Ray's
        # daemons can start a worker while the others stop (seen once under a loaded CI run)
        deadline = time.monotonic() + 60
        while (left := _marked(mark)) and time.monotonic() < deadline:
            _terminate(left, 15.0)
            time.sleep(0.5)
        assert not _marked(mark), "a process of the test's Ray cluster outlived it"
        shutil.rmtree(temp, ignore_errors=True)


def final_models_equal(a: Path, b: Path) -> bool:
    x, y = (torch.load(d / "model_final.pt") for d in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.slow
def test_a_sweep_and_a_ray_simulation_on_a_cluster_give_the_local_runs(tmp_path, capsys, ray_cluster):
    """Two runs of a sweep as Ray tasks on a two-node cluster (1 CPU each: one run a node),
    their run directories written back here complete; the same final models as the sweep run
    here; and ``simulate --engine ray --ray-address`` (its clients the cluster's actors) gives
    the in-process model."""
    assert len(probe(ray_cluster)) == 2
    sweep = ["sweep", "--algorithms", "fedavg,fedsam", "--seeds", "0", "--engine", "inprocess", *RUN]
    assert cli([*sweep, "--out", str(tmp_path / "here")]) == 0
    assert cli([*sweep, "--out", str(tmp_path / "there"), "--ray-address", ray_cluster]) == 0
    out = capsys.readouterr().out
    assert f"sweep: started fedavg-s0 (1/2) on the Ray cluster at {ray_cluster}" in out
    for name in ("fedavg-s0", "fedsam-s0"):
        here, there = tmp_path / "here" / name, tmp_path / "there" / name
        assert sorted(p.name for p in there.iterdir() if not p.name.startswith("events.")) == \
            sorted(p.name for p in here.iterdir() if not p.name.startswith("events."))
        assert (there / "summary.json").is_file() and final_models_equal(here, there), name
        assert "final test accuracy" in (tmp_path / "there" / f"{name}.log").read_text()
        ran_in = json.loads((there / "config.json").read_text())["config"]["run-dir"]
        assert Path(ran_in).name == name and Path(ran_in).parent != tmp_path / "there"  # where it ran
    assert len(json.loads((tmp_path / "there" / "report.json").read_text())["runs"]) == 2

    one = ["simulate", "--algorithm", "fedavg", "--seed", "0", *RUN]
    assert cli([*one, "--engine", "ray", "--ray-address", ray_cluster, "--run-dir", str(tmp_path / "ray")]) == 0
    assert f"on the Ray cluster at {ray_cluster}" in capsys.readouterr().out
    assert final_models_equal(tmp_path / "here" / "fedavg-s0", tmp_path / "ray")


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.slow
def test_a_job_too_large_for_every_node_is_refused_before_anything_starts(tmp_path, ray_cluster):
    job = Job("big", tmp_path / "big", argv=("-V",), num_cpus=2)  # each node has 1 CPU
    with pytest.raises(ClusterError, match="big asks for 2 CPU and 0 GPU, and no node"):
        run_jobs([job], ray_address=ray_cluster)
    assert not (tmp_path / "big.log").exists()


def test_the_cluster_docs_promises_are_the_codes():
    """docs/engines.md's cluster section: its flags exist where it says, its error line is the
    one an unusable address gives, and the defaults it states are the code's."""
    import re

    from flatflower.runtime import cluster
    from flatflower.tools.parsers import sweep
    from tests.test_docs import DOCS

    text = (DOCS / "engines.md").read_text().split("## A Ray cluster that already runs", 1)[1].split("\n## ")[0]
    helps = {flag: action.help for action in sweep()._actions for flag in action.option_strings}
    for flag in ("--ray-address", "--cpus-per-run", "--gpus-per-run", "--jobs"):
        assert flag in text and flag in helps, flag
    words = " ".join(text.split())
    assert "(default 1)" in helps["--cpus-per-run"] and "`--cpus-per-run` CPUs (default 1)" in words
    assert "(default 0)" in helps["--gpus-per-run"] and "`--gpus-per-run` GPUs (default 0)" in words
    assert "within a minute" in text and cluster.PROBE_TIMEOUT == 60.0
    quoted = re.search(r"`(error: --ray-address [^`]*?); \.\.\.`", text.replace("\n  ", " ")).group(1)
    with pytest.raises(ClusterError) as err:
        probe(f"127.0.0.1:{free_port()}")
    assert re.sub(r"127\.0\.0\.1:\d+", "10.0.0.1:6379", f"error: {err.value}").startswith(quoted)
    assert "engines.md#a-ray-cluster-that-already-runs---ray-address" in (DOCS / "sweeps.md").read_text()


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.slow
def test_a_tune_on_a_cluster_spends_each_budget_exactly_and_its_final_runs_are_the_local_ones(
        tmp_path, capsys, ray_cluster):
    """``tune --ray-address --workers 2``: the trials as two Ray tasks (one a node) reaching the
    study through this process's storage proxy; each algorithm ends with exactly --trials
    trials, their directories written back here; the final runs go to the cluster too and give
    the models the same runs make here."""
    import csv

    out = tmp_path / "tune"
    args = ["tune", "--algorithms", "fedavg,fedsam", "--trials", "3", "--seeds", "0", "--out", str(out),
            "--engine", "inprocess", "--last-k", "2", "--pruner", "none", *RUN]
    assert cli([*args, "--workers", "2", "--ray-address", ray_cluster]) == 0
    assert f"6 trial(s) as 2 Ray task(s) on {ray_cluster}" in capsys.readouterr().out
    summary = json.loads((out / "tune.json").read_text())
    for entry in summary["algorithms"]:
        with open(out / entry["algorithm"] / "trials.csv") as f:
            trials = list(csv.DictReader(f))
        assert len(trials) == 3 and {t["state"] for t in trials} == {"complete"}
        for t in trials:  # each trial's run directory came back, under the worker that ran it
            assert t["run_dir"].startswith("ray-") and (out / t["run_dir"] / "metrics.jsonl").is_file()
        assert len({t["run_dir"].split("/")[0] for t in trials}) == 2, "one worker ran them all"
        best = entry["best"]["params"]
        local = tmp_path / f"local-{entry['algorithm']}"
        sets = [a for k, v in best.items() for a in ("--set", f"{k}={v!r}")]
        assert cli(["simulate", "--algorithm", entry["algorithm"], "--seed", "0", "--engine", "inprocess",
                    "--set", "partition-seed=0", *sets, *RUN, "--run-dir", str(local)]) == 0
        assert final_models_equal(out / "final" / f"{entry['algorithm']}-s0", local)
