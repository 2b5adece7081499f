"""``flatflower tune``: equal budgets, a validation objective that never reads the test split,
search ranges declared beside the keys, resumable, bad input in one line (in-process engine)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from flatflower.common.config import RunConfig
from flatflower.common.data import carve_validation, client_split, dataset_for, partitions_for
from flatflower.common.params import Range
from flatflower.strategies.registry import ALGORITHMS
from flatflower.tools.cli import main as cli
from flatflower.tools.tune_space import SpaceError, declared, read_file, space_for

FAST = ["--engine", "inprocess", "--clients", "3", "--rounds", "3", "--dataset", "digits",
        "--model", "logreg", "--set", "local-steps=2", "--last-k", "2"]


def tune(out, *extra, algorithms="fedavg,fedsam", trials="3", seeds="0,1"):
    return cli(["tune", "--algorithms", algorithms, "--trials", trials, "--seeds", seeds, "--out", str(out),
                *FAST, *extra])


# ---------------------------------------------------------------- the validation split
def test_validation_split_is_a_seeded_per_class_share_of_the_training_split_and_nothing_else():
    data = dataset_for(RunConfig.from_mapping({"dataset": "digits"}))
    carved = carve_validation(data, 0.25, seed=3)
    labels = data.train.y.numpy()
    for c in np.unique(labels):  # round(0.25 * n_c) of each class, as the docstring says
        assert int(np.sum(carved.test.y.numpy() == c)) == int(round(0.25 * np.sum(labels == c)))
    assert len(carved.train) + len(carved.test) == len(data.train)
    # every validation row and every kept row is a row of the training split, none in both
    rows = {tuple(x.tolist()) for x in data.train.x.reshape(len(data.train), -1)}
    val = [tuple(x.tolist()) for x in carved.test.x.reshape(len(carved.test), -1)]
    kept = [tuple(x.tolist()) for x in carved.train.x.reshape(len(carved.train), -1)]
    assert set(val) <= rows and set(kept) <= rows
    test_rows = {tuple(x.tolist()) for x in data.test.x.reshape(len(data.test), -1)}
    assert not (set(val) & test_rows - rows), "a validation row came from the test split"
    again = carve_validation(data, 0.25, seed=3)
    assert np.array_equal(again.test.y.numpy(), carved.test.y.numpy())
    other = carve_validation(data, 0.25, seed=4)
    assert not np.array_equal(other.test.x.numpy(), carved.test.x.numpy())


def test_a_run_with_a_validation_split_partitions_and_evaluates_only_training_rows():
    cfg = RunConfig.from_mapping({"dataset": "digits", "validation-fraction": 0.2, "partition-seed": 5})
    plain = dataset_for(RunConfig.from_mapping({"dataset": "digits"}))
    data = dataset_for(cfg)
    assert len(data.train) + len(data.test) == len(plain.train)
    parts = partitions_for(cfg, 4)
    assert sum(len(p) for p in parts) == len(data.train)  # no client holds a validation row
    val = {tuple(x.tolist()) for x in data.test.x.reshape(len(data.test), -1)}
    for pid in range(4):
        split = client_split(cfg, pid, 4)
        assert not {tuple(x.tolist()) for x in split.x.reshape(len(split), -1)} & val


def test_validation_fraction_is_checked_and_off_by_default():
    assert RunConfig().validation_fraction == 0.0
    plain = RunConfig.from_mapping({"dataset": "digits"})
    assert dataset_for(plain).test is dataset_for(plain).test  # the test split itself, untouched
    for bad in (1.0, -0.1, math.nan):
        with pytest.raises(ValueError, match="validation-fraction must be in"):
            RunConfig.from_mapping({"validation-fraction": bad})
    with pytest.raises(ValueError, match="leaves no validation example"):
        dataset_for(RunConfig.from_mapping({"dataset": "digits", "validation-fraction": 0.0001}))


# ---------------------------------------------------------------- the search space
def test_every_declared_range_is_valid_and_accepted_by_its_key_at_both_ends():
    for algorithm in ALGORITHMS:
        space = space_for(algorithm)  # checks both ends of every range against the key's own check
        assert space.ranges["lr"] == Range(0.001, 0.3, log=True)
        for r in space.ranges.values():
            assert r.problem() is None
    assert set(declared("fedsam")) == {"lr", "sam.rho"}
    assert set(declared("fedgmt")) == {"lr", "fedgmt.beta", "fedgmt.gamma", "fedgmt.alpha"}
    assert declared("fedavg") == {"lr": Range(0.001, 0.3, log=True)}


def test_a_space_file_changes_fixes_or_turns_off_keys(tmp_path):
    path = tmp_path / "space.toml"
    path.write_text('[all]\nlr = { low = 0.01, high = 0.2, log = true }\n'
                    '[fedtoga]\n"fedtoga.kappa" = 1.5\n"fedtoga.beta" = false\n'
                    '"fedtoga.alpha" = { low = 0.05, high = 0.5 }\n')
    space = space_for("fedtoga", read_file(path))
    assert space.ranges["lr"] == Range(0.01, 0.2, log=True)
    assert space.ranges["fedtoga.alpha"] == Range(0.05, 0.5)
    assert "fedtoga.beta" not in space.ranges and "fedtoga.beta" not in space.fixed
    assert space.fixed == {"fedtoga.kappa": 1.5}
    assert space_for("fedavg", read_file(path)).ranges == {"lr": Range(0.01, 0.2, log=True)}


@pytest.mark.parametrize("text, message", [
    ('[fedsam]\n"sam.roh" = { low = 0.01, high = 0.1 }\n', "'sam.roh' is not a key fedsam reads"),
    ('[fedsam]\n"fedtoga.kappa" = { low = 0.0, high = 1.0 }\n', "'fedtoga.kappa' is not a key fedsam reads"),
    ('[fedsam]\n"sam.rho" = { low = 0.1, high = 0.1 }\n', "empty or non-finite range"),
    ('[fedsam]\n"sam.rho" = { low = 0.0, high = 0.1, log = true }\n', "log-scale range must stay above 0"),
    ('[fedsam]\n"sam.rho" = { low = -1.0, high = 0.1 }\n', "range's end -1.0 is refused"),
    ('[fedsam]\nlr = { low = 0.1 }\n', "takes low, high"),
    ('[fedsam]\nlr = 0.1\n"sam.rho" = false\n', "nothing left to tune"),
    ('[fedsamm]\nlr = 0.1\n', "neither [all] nor an algorithm"),
    ('[fedsam\n', "is not TOML"),
])
def test_a_bad_space_is_one_line_naming_the_problem(tmp_path, text, message):
    path = tmp_path / "space.toml"
    path.write_text(text)
    with pytest.raises(SpaceError) as err:
        space_for("fedsam", read_file(path))
    assert message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- the command
def test_tune_gives_every_algorithm_the_same_budget_then_tests_the_best_on_every_seed(tmp_path):
    out = tmp_path / "tune"
    assert tune(out) == 0
    summary = json.loads((out / "tune.json").read_text())
    assert summary["objective"].startswith("validation accuracy, mean of the last 2 rounds")
    budgets = [e["budget"] for e in summary["algorithms"]]
    assert budgets[0] == budgets[1] and budgets[0]["client_rounds_allotted"] == 3 * 3 * 3
    for entry in summary["algorithms"]:
        algorithm = entry["algorithm"]
        with open(out / algorithm / "trials.csv") as f:
            trials = list(csv.DictReader(f))
        assert len(trials) == 3
        assert entry["budget"]["client_rounds_spent"] == sum(int(t["rounds_run"]) for t in trials) * 3
        best = max((t for t in trials if t["state"] == "complete"), key=lambda t: float(t["value"]))
        assert entry["best"]["value"] == float(best["value"])
        for t in trials:  # the objective is the mean of the last 2 rounds' validation accuracy
            run = out / t["run_dir"]
            config = json.loads((run / "config.json").read_text())["config"]
            assert config["validation-fraction"] == 0.1 and config["num-server-rounds"] == 3
            assert config["checkpoint-every"] == 0 and not config["tensorboard"]
            assert not (run / "checkpoint.pt").exists()
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            assert float(t["value"]) == pytest.approx(np.mean([r["test_accuracy"] for r in rows[-2:]]))
            assert config["lr"] == pytest.approx(float(t["lr"]))
            assert float(t["round_seconds"]) == pytest.approx(sum(r.get("seconds", 0) for r in rows), abs=1e-3)
            assert 0 < float(t["round_seconds"]) < float(t["seconds"])
        for seed in (0, 1):  # the best point, on the test split, for every seed
            run = out / "final" / f"{algorithm}-s{seed}"
            config = json.loads((run / "config.json").read_text())["config"]
            assert config["validation-fraction"] == 0.0 and config["seed"] == seed
            assert config["checkpoint-every"] == 1 and (run / "checkpoint.pt").is_file()
            for k, v in entry["best"]["params"].items():
                assert config[k] == pytest.approx(v)
    report = json.loads((out / "report.json").read_text())
    assert len(report["runs"]) == 4
    final = (out / "final" / "fedsam-s1" / "metrics.jsonl").read_text()
    assert tune(out) == 0  # run again: nothing new, the final runs skipped, not redone
    assert (out / "final" / "fedsam-s1" / "metrics.jsonl").read_text() == final
    assert not list((out / "final").glob("*.incomplete-*"))


def test_a_second_tune_in_the_same_out_is_refused_and_an_rdb_storage_serves_the_study(tmp_path, capsys):
    import optuna

    from flatflower.server.rundir import claim

    out = tmp_path / "tune"
    out.mkdir()
    lock = claim(out / ".tune.lock", "held")
    try:
        assert tune(out, "--no-final", algorithms="fedavg", trials="1") == 2
        assert "another tune is running in" in capsys.readouterr().err
    finally:
        import os

        os.close(lock)
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    assert tune(out, "--no-final", "--storage", url, algorithms="fedavg", trials="2") == 0
    assert len(optuna.load_study(study_name="fedavg", storage=url).get_trials()) == 2
    assert not (out / "optuna.journal").exists()


def test_final_rounds_and_a_final_run_made_with_other_values_is_refused_not_reported(tmp_path, capsys):
    out = tmp_path / "tune"
    assert tune(out, "--final-rounds", "4", algorithms="fedavg", trials="2", seeds="0") == 0
    config = json.loads((out / "final" / "fedavg-s0" / "config.json").read_text())["config"]
    assert config["num-server-rounds"] == 4
    trial = json.loads((out / "fedavg" / "trials" / "t0000" / "config.json").read_text())["config"]
    assert trial["num-server-rounds"] == 3
    capsys.readouterr()
    assert tune(out, "--final-rounds", "5", algorithms="fedavg", trials="2", seeds="0") == 2
    err = capsys.readouterr().err
    assert "ran other values of num-server-rounds" in err and err.count("\n") == 1


def test_an_interrupted_final_run_goes_on_from_its_checkpoint_to_the_uninterrupted_model(tmp_path, capsys):
    import torch

    full, cut = tmp_path / "full", tmp_path / "cut"
    assert tune(full, "--final-rounds", "4", algorithms="fedavg", trials="2", seeds="0") == 0
    assert tune(cut, "--final-rounds", "2", algorithms="fedavg", trials="2", seeds="0") == 0
    run = cut / "final" / "fedavg-s0"
    (run / "summary.json").unlink()  # as a kill after round 2 leaves it: its checkpoint kept
    (run / "model_final.pt").unlink()
    capsys.readouterr()
    assert tune(cut, "--final-rounds", "4", algorithms="fedavg", trials="2", seeds="0") == 0
    assert f"tune: {run} was interrupted: resumed from its checkpoint" in capsys.readouterr().out
    a, b = (torch.load(d / "final" / "fedavg-s0" / "model_final.pt") for d in (full, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rounds = [json.loads(line)["round"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3, 4]


def test_a_tune_run_again_goes_on_where_it_stopped_and_more_trials_extend_it(tmp_path, capsys):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    out = tmp_path / "tune"
    assert tune(out, "--no-final", algorithms="fedavg", trials="2") == 0
    storage = JournalStorage(JournalFileBackend(str(out / "optuna.journal")))
    study = optuna.load_study(study_name="fedavg", storage=storage)
    cut = study.ask({"lr": optuna.distributions.FloatDistribution(0.001, 0.3, log=True)})  # a killed trial
    assert tune(out, "--no-final", algorithms="fedavg", trials="3") == 0
    assert "1 trial(s) cut short by an interruption will run again" in capsys.readouterr().out
    trials = optuna.load_study(study_name="fedavg", storage=storage).get_trials()
    done = [t for t in trials if not t.user_attrs.get("flatflower.interrupted")]
    assert len(done) == 3 and all(t.state == optuna.trial.TrialState.COMPLETE for t in done)
    assert done[-1].params == cut.params, "the cut trial did not run again with its parameters"
    with open(out / "fedavg" / "trials.csv") as f:
        assert len(list(csv.DictReader(f))) == 3
    assert tune(out, "--no-final", algorithms="fedavg", trials="3") == 0  # nothing left: no new trial
    assert len(optuna.load_study(study_name="fedavg", storage=storage).get_trials()) == len(trials)


def test_a_tune_with_other_settings_in_the_same_out_is_refused(tmp_path, capsys):
    out = tmp_path / "tune"
    assert tune(out, "--no-final", algorithms="fedavg", trials="1") == 0
    capsys.readouterr()
    assert tune(out, "--no-final", "--set", "lr-decay=0.9", algorithms="fedavg", trials="1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "other settings (sets)" in err


def test_a_pruned_trial_stops_early_and_counts_the_rounds_it_ran(tmp_path):
    import argparse

    from flatflower.tools.tune_trial import run_trial, trial_args
    from flatflower.tools.parsers import tune as parser

    class Trial:  # what run_trial asks of an Optuna trial: its reports, and whether to stop
        def __init__(self):
            self.reports = []

        def report(self, value, step):
            self.reports.append((step, value))

        def should_prune(self):
            return len(self.reports) >= 2

    args = parser().parse_args(["--algorithms", "fedavg", "--trials", "1", "--out", str(tmp_path),
                                "--engine", "inprocess", "--clients", "2", "--rounds", "200",
                                "--dataset", "digits", "--model", "mlp", "--set", "local-epochs=2"])
    args.first_seed = 0
    one = trial_args(args, "fedavg", {"lr": 0.05}, tmp_path / "t0")
    trial = Trial()
    outcome, rows = run_trial(one, trial)
    assert outcome == "pruned" and 2 <= len(rows) < 200
    assert trial.reports == rows  # every round written was reported, in order
    assert isinstance(args, argparse.Namespace)


def test_a_trial_interrupted_after_the_pruners_word_runs_again_not_counted_failed(tmp_path):
    """Ctrl-C in the round that ends a pruned trial: the trial is interrupted (run again at the
    next resume), as any interrupted trial. It was recorded as failed ("failed:130") and spent
    a trial of the budget (issue 56's MoFedSAM piece)."""
    from flatflower.tools.parsers import tune as parser
    from flatflower.tools.tune_trial import run_trial, trial_args

    class Trial:  # the pruner says stop after round 1; the user presses Ctrl-C in the next round
        def __init__(self):
            self.reports, self.pruned = [], False

        def report(self, value, step):
            if self.pruned:
                raise KeyboardInterrupt
            self.reports.append((step, value))

        def should_prune(self):
            self.pruned = len(self.reports) >= 2
            return self.pruned

    args = parser().parse_args(["--algorithms", "fedavg", "--trials", "1", "--out", str(tmp_path),
                                "--engine", "inprocess", "--clients", "2", "--rounds", "200",
                                "--dataset", "digits", "--model", "mlp"])
    args.first_seed = 0
    with pytest.raises(KeyboardInterrupt):
        run_trial(trial_args(args, "fedavg", {"lr": 0.05}, tmp_path / "t0"), Trial())


@pytest.mark.parametrize("extra, message", [
    (["--validation-fraction", "1"], "--validation-fraction must be in (0, 1)"),
    (["--engine", "ray"], "--engine inprocess or vectorized"),
    (["--last-k", "9"], "--last-k 9 is more than the trials' 3 rounds"),
    (["--set", "validation-fraction=0.2"], "tune sets this key itself"),
    (["--set", "lr=-1"], "lr"),
])
def test_bad_input_is_one_line_before_anything_starts(tmp_path, capsys, extra, message):
    out = tmp_path / "tune"
    assert tune(out, *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("error:")
    assert not out.exists()


def test_budget_of_zero_and_unknown_algorithms_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:  # argparse's own one line
        tune(tmp_path / "a", trials="0")
    assert stopped.value.code == 2 and "--trials: must be >= 1, not 0" in capsys.readouterr().err
    assert tune(tmp_path / "b", algorithms="fedsam,fedsamm") == 2
    assert "did you mean 'fedsam'" in capsys.readouterr().err
    space = tmp_path / "space.toml"
    space.write_text('[fedsam]\n"sam.rho" = { low = 0.5, high = 0.1 }\n')
    assert tune(tmp_path / "c", "--space", str(space)) == 2
    assert "empty or non-finite range" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------- docs/tuning.md
def test_the_tuning_guides_space_file_and_quoted_ranges_are_what_the_code_does(tmp_path):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "tuning.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "space.toml").write_text(toml)
    space = space_for("fedtoga", read_file(tmp_path / "space.toml"))
    assert space.ranges["lr"] == Range(0.01, 0.3, log=True) and space.fixed == {"fedtoga.kappa": 1.0}
    assert "fedtoga.beta" not in space.ranges
    gmt = declared("fedgmt")  # "FedGMT's Table 7 (beta in 1-1000, gamma 0.5-2, alpha 0.5-0.998"
    assert (gmt["fedgmt.beta"], gmt["fedgmt.gamma"], gmt["fedgmt.alpha"]) == (
        Range(1.0, 1000.0, log=True), Range(0.5, 2.0, log=True), Range(0.5, 0.998))
    assert declared("mofedsam")["mofedsam.beta"] == Range(0.01, 1.0, log=True)
    assert declared("fedtoga")["fedtoga.beta"] == Range(0.0, 1.0)
    assert "search=Range(0.001, 0.5, log=True)" in text and declared("fedsam")["sam.rho"] == Range(0.001, 0.5, log=True)


@pytest.mark.slow
def test_workers_share_the_study_and_never_overshoot_the_budget(tmp_path):
    """Two workers (this process and one more) draw trials from one journal file: each
    algorithm ends with exactly --trials trials, every one complete, run by both workers."""
    out = tmp_path / "tune"
    assert tune(out, "--no-final", "--workers", "2", "--pruner", "none", "--rounds", "6", "--set", "local-steps=300",
                trials="5") == 0
    for algorithm in ("fedavg", "fedsam"):
        with open(out / algorithm / "trials.csv") as f:
            trials = list(csv.DictReader(f))
        assert len(trials) == 5 and {t["state"] for t in trials} == {"complete"}
        assert len({t["run_dir"] for t in trials}) == 5
    log = (out / "worker-1.log").read_text()
    assert "tune: fedavg trial" in log or "tune: fedsam trial" in log, "the second worker ran no trial"


def test_report_calls_a_trials_accuracy_validation_accuracy(tmp_path):
    from flatflower.tools.report import accuracy_name, load_run

    out = tmp_path / "tune"
    assert tune(out, "--no-final", algorithms="fedavg", trials="1") == 0
    trial = load_run(out / "fedavg" / "trials" / "t0000")
    assert accuracy_name([trial]) == "validation accuracy"
    cli(["simulate", "--algorithm", "fedavg", "--run-dir", str(tmp_path / "plain"), *FAST[:-2]])
    plain = load_run(tmp_path / "plain")
    assert accuracy_name([plain]) == "test accuracy"
    assert accuracy_name([trial, plain]).startswith("accuracy (validation in runs with")


def test_the_samplers_random_start_is_half_the_budget_between_2_and_10():
    from flatflower.tools.tune_study import startup_trials

    assert [startup_trials(n) for n in (1, 3, 4, 8, 19, 20, 40)] == [2, 2, 2, 4, 9, 10, 10]


def test_an_unreachable_ray_address_and_sizes_without_one_are_one_line_before_anything_runs(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "tune"
    assert tune(out, "--ray-address", f"127.0.0.1:{port}") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ray-address") and "nothing answers there" in err and err.count("\n") == 1
    assert tune(out, "--cpus-per-trial", "2") == 2
    assert "add --ray-address" in capsys.readouterr().err
    assert not out.exists()


def test_each_worker_draws_with_its_own_sampler_seed_and_the_shares_add_up():
    import argparse

    from flatflower.tools.tune_cluster import shares
    from flatflower.tools.tune_study import sampler_seed

    seeds = {sampler_seed(argparse.Namespace(tune_seed=3, worker_index=i)) for i in range(4)}
    assert len(seeds) == 4 and sampler_seed(argparse.Namespace(tune_seed=3)) == 3
    for left, workers in ((7, 3), (2, 4), (0, 2), (8, 2)):
        split = shares(left, workers)
        assert sum(split) == left and max(split) - min(split) <= 1 and len(split) == workers


def test_without_an_engine_the_trials_run_vectorised_where_it_applies(tmp_path):
    out = tmp_path / "tune"
    fast = [a for a in FAST if a not in ("--engine", "inprocess")]
    base = ["tune", "--trials", "1", "--seeds", "0", "--no-final", *fast]
    assert cli([*base, "--algorithms", "fedavg", "--out", str(out / "mlp")]) == 0
    assert json.loads((out / "mlp" / "fedavg" / "trials" / "t0000" / "config.json").read_text())["engine"] == "vectorized"
    bn = ["--model", "tests.bn_models:small_bn_cnn"]  # BatchNorm: the vectorised engine refuses it
    assert cli([*base, *bn, "--algorithms", "fedavg", "--out", str(out / "bn")]) == 0
    assert json.loads((out / "bn" / "fedavg" / "trials" / "t0000" / "config.json").read_text())["engine"] == "inprocess"


def test_a_trial_whose_run_fails_is_a_failed_trial_in_the_budget_and_no_final_runs_without_a_best(tmp_path, capsys):
    import logging

    space = tmp_path / "space.toml"
    space.write_text("[all]\nlr = { low = 1e8, high = 1e9, log = true }\n")  # every update refused: every round skipped
    out = tmp_path / "tune"
    shown = []

    class Console(logging.Handler):  # one more of Flower's log handlers, as its console's
        def emit(self, record):
            shown.append(record)

    console = Console(logging.DEBUG)
    logging.getLogger("flwr").addHandler(console)
    try:
        assert tune(out, "--space", str(space), algorithms="fedavg", trials="2", seeds="0") == 1
    finally:
        logging.getLogger("flwr").removeHandler(console)
    err = capsys.readouterr().err
    assert "fedavg has no complete trial: no final run" in err
    # the trials' refused updates and skipped rounds are in their metrics.jsonl, not on the console
    assert not [r for r in shown if r.levelno == logging.WARNING]
    with open(out / "fedavg" / "trials.csv") as f:
        trials = list(csv.DictReader(f))
    assert [t["state"] for t in trials] == ["fail", "fail"] and all(t["error"] == "failed:1" for t in trials)
    best = json.loads((out / "fedavg" / "best.json").read_text())
    assert best["best"] is None and best["budget"]["trials_by_state"] == {"complete": 0, "pruned": 0, "fail": 2}
    assert not (out / "final").exists()


def test_flatflower_algorithms_shows_each_tunable_keys_range_and_json_holds_it(capsys):
    assert cli(["algorithms"]) == 0
    text = capsys.readouterr().out
    assert "sam.rho = 0.1    SAM radius: the perturbation's global L2 norm [read by the client; tuned over " \
           "0.001-0.5, log]" in text
    assert "fedtoga.beta = 0.9    correction beta of the step by Delta [read by the client; tuned over 0-1]" in text
    assert cli(["algorithms", "--json"]) == 0
    data = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    keys = {k["name"]: k for k in data["fedgmt"]["keys"]}
    assert keys["fedgmt.beta"]["search"] == {"low": 1.0, "high": 1000.0, "log": True, "integer": False}
    assert keys["fedgmt.tau"]["search"] is None  # not tuned: its paper fixes it


def test_a_failed_cluster_worker_leaves_its_share_to_the_next_run_and_no_final_run(tmp_path, capsys, monkeypatch):
    """The driver's side of a worker that failed on the cluster (its Ray task's result, as
    runtime/cluster.py reports it): the tune says so, writes its records, runs no final run and
    exits 1; run again (here without the cluster), it spends exactly what was left."""
    from flatflower.runtime import cluster
    from flatflower.tools import prepare

    monkeypatch.setattr(prepare, "check_cluster", lambda *a, **k: None)  # no cluster to probe here
    monkeypatch.setattr(cluster, "run_jobs", lambda jobs, **k: [cluster.Result(j, False, error="node lost") for j in jobs])
    out = tmp_path / "tune"
    assert tune(out, "--workers", "2", "--ray-address", "127.0.0.1:6379", algorithms="fedavg", trials="3",
                seeds="0") == 1
    err = capsys.readouterr().err
    assert err.count("a cluster worker failed:") == 2 and "node lost" in err and "finish the budget" in err
    assert not (out / "final").exists()
    best = json.loads((out / "fedavg" / "best.json").read_text())
    assert best["budget"]["trials_by_state"] == {"complete": 0, "pruned": 0, "fail": 0}
    monkeypatch.undo()
    assert tune(out, "--workers", "1", algorithms="fedavg", trials="3", seeds="0") == 0
    with open(out / "fedavg" / "trials.csv") as f:
        assert len(list(csv.DictReader(f))) == 3
