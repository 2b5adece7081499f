"""Presets: the loader (tools/presets.py), the files in tools/presets/ and the CLI's
``--preset`` / ``flatflower presets``. Offline; only the digits preset is run (in-process)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from flatflower.common.config import RunConfig
from flatflower.tools.cli import build_parser, main
from flatflower.tools.prepare import UsageError, apply_preset, resolve_config
from flatflower.tools.presets import PRESET_DIR, PresetError, available, load_preset

PRESETS = available()
# the others reproduce no paper number: a smoke test and the offline benchmarks (source "none ...")
PAPER_PRESETS = [name for name in PRESETS if not load_preset(name).source.startswith("none")]
REQUIRED = (
    "digits-quick", "fedtoga-cifar10-lenet-dir0.1", "fedtoga-cifar10-resnet18-dir0.6",
    "fedgmt-cifar10-cnn-dir0.1", "fedgmt-v2-cifar10-cnn-dir0.1", "fednsam-cifar100-resnet18-dir0.6",
    "fedcm-cifar10-lenet-dir0.1", "feddyn-cifar10-lenet-dir0.1", "fedspeed-cifar10-lenet-dir0.1",
)


def write_preset(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = """
[preset]
description = "test preset"
source = "nowhere, Table 0"
clients = 6

[config]
algorithm = "fedsam"
dataset = "synthetic"
lr = 0.05
sam.rho = 0.3
num-server-rounds = 3
"""


# ------------------------------------------------------------------ the shipped presets
def test_required_presets_exist():
    assert set(REQUIRED) <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_parses_and_validates(name):
    preset = load_preset(name)
    cfg = RunConfig.from_mapping({"num-partitions": preset.clients, **preset.config})
    assert preset.name == name and preset.path == PRESET_DIR / f"{name}.toml"
    assert preset.clients is not None and preset.clients >= 1
    assert preset.config["algorithm"] == cfg.algorithm  # every preset names its algorithm
    assert cfg.fraction_train * preset.clients >= 1


@pytest.mark.parametrize("name", PAPER_PRESETS)
def test_every_paper_preset_cites_a_table(name):
    preset = load_preset(name)
    assert preset.description.strip()
    assert re.search(r"\bTable \d", preset.source), preset.source
    assert re.search(r"\d+\.\d\d", preset.source), "the source quotes the number it reproduces"
    assert preset.config["algorithm"].lower() in name



@pytest.mark.parametrize("name", PRESETS)
def test_the_cifar_presets_train_with_the_papers_crop_and_flip_and_no_other_preset_does(name):
    """Every CIFAR preset augments its local batches as the papers of this family do (pad-4
    random crop + horizontal flip) and no longer lists augmentation as not reproduced; the
    other presets (digits, Fashion-MNIST, the offline benchmarks) keep their data as it is."""
    preset = load_preset(name)
    text = preset.path.read_text()
    not_reproduced = " ".join(line for line in text.splitlines() if line.startswith("# not reproduced:"))
    if preset.config["dataset"] in ("cifar10", "cifar100"):
        assert preset.config["train-transform"] == "crop-flip"
        assert "augmentation" not in not_reproduced
    else:
        assert "train-transform" not in preset.config

def test_load_by_path_equals_load_by_name():
    by_name = load_preset("fedtoga-cifar10-lenet-dir0.1")
    by_path = load_preset(str(PRESET_DIR / "fedtoga-cifar10-lenet-dir0.1.toml"))
    assert by_name == by_path
    assert by_name.clients == 100 and by_name.config["fedtoga.beta"] == 0.9


# ------------------------------------------------------------------ precedence and --clients
def resolved(argv: list[str]) -> tuple[RunConfig, int]:
    args = build_parser().parse_args(["simulate", "--engine", "inprocess", *argv])
    return resolve_config(args), args.clients


def test_precedence_preset_then_set_then_flags(tmp_path):
    path = write_preset(tmp_path, GOOD)
    run_dir = ["--run-dir", str(tmp_path / "run")]
    cfg, _ = resolved(["--preset", str(path), *run_dir])
    assert (cfg.algorithm, cfg.lr, cfg.params.rho, cfg.num_server_rounds) == ("fedsam", 0.05, 0.3, 3)
    cfg, _ = resolved(["--preset", str(path), "--set", "lr=0.2", "--set", "num-server-rounds=5",
                       *run_dir])
    assert (cfg.lr, cfg.params.rho, cfg.num_server_rounds) == (0.2, 0.3, 5)  # --set beats the preset
    cfg, _ = resolved(["--preset", str(path), "--set", "num-server-rounds=5", "--rounds", "7",
                       "--algorithm", "mofedsam", *run_dir])
    assert (cfg.num_server_rounds, cfg.algorithm, cfg.params.rho) == (7, "mofedsam", 0.3)  # flags beat both


STUDY = GOOD + """
[algorithms.fedsam]
sam.rho = 0.01
lr = 0.07

[algorithms.fedtoga]
"sam.rho" = 0.2
fedtoga.beta = 0.8
"""


def test_an_algorithms_table_applies_over_config_for_its_algorithm_only(tmp_path):
    """[config] < [algorithms.<the run's algorithm>] < --set < flags; the run's algorithm is
    the one the flags, --set or [config] name."""
    path = write_preset(tmp_path, STUDY)
    run_dir = ["--run-dir", str(tmp_path / "run")]
    cfg, _ = resolved(["--preset", str(path), *run_dir])  # [config] says fedsam
    assert (cfg.algorithm, cfg.params.rho, cfg.lr) == ("fedsam", 0.01, 0.07)
    cfg, _ = resolved(["--preset", str(path), "--algorithm", "fedtoga", *run_dir])
    assert (cfg.params.rho, cfg.params.beta, cfg.lr) == (0.2, 0.8, 0.05)
    cfg, _ = resolved(["--preset", str(path), "--set", "algorithm=fedtoga", "--set", "sam.rho=0.4", *run_dir])
    assert (cfg.algorithm, cfg.params.rho) == ("fedtoga", 0.4)  # --set beats the table
    cfg, _ = resolved(["--preset", str(path), "--algorithm", "mofedsam", *run_dir])
    assert cfg.params.rho == 0.3  # no table: [config]'s


@pytest.mark.parametrize("table, message", [
    ('[algorithms.fedsamm]\nlr = 0.1', "unknown algorithm 'fedsamm' (did you mean 'fedsam'?)"),
    ('[algorithms.fedsam]\nalgorithm = "fedavg"', "cannot set algorithm"),
    ('[algorithms.fedsam]\nsam.rho = -1', "[algorithms.fedsam]: invalid run config: sam.rho"),
    ('[algorithms]\nfedsam = 3', "algorithms.fedsam must be a table"),
    ('[preset.x]', ""),
])
def test_a_bad_algorithms_table_is_refused(tmp_path, table, message):
    if table == "[preset.x]":  # a bad engine, through the same loader
        path = write_preset(tmp_path, GOOD.replace("clients = 6", 'clients = 6\nengine = "gpu"'))
        message = "engine must be ray, inprocess or vectorized"
    else:
        path = write_preset(tmp_path, GOOD + table)
    with pytest.raises(PresetError) as info:
        load_preset(str(path))
    assert message in str(info.value)


def test_the_presets_engine_is_simulates_default(tmp_path):
    path = write_preset(tmp_path, GOOD.replace("clients = 6", 'clients = 6\nengine = "inprocess"'))
    args = build_parser().parse_args(["simulate", "--preset", str(path), "--run-dir", str(tmp_path / "r")])
    resolve_config(args)
    assert args.engine == "inprocess"
    args = build_parser().parse_args(["simulate", "--preset", str(path), "--engine", "vectorized",
                                      "--run-dir", str(tmp_path / "r")])
    resolve_config(args)
    assert args.engine == "vectorized"  # the flag wins
    args = build_parser().parse_args(["simulate", "--run-dir", str(tmp_path / "r")])
    resolve_config(args)
    assert args.engine == "inprocess"  # no preset: the fastest engine that gives Ray's result


@pytest.mark.parametrize("engine", ["ray", "vectorized", "inprocess"])
def test_a_resumed_run_continues_on_the_engine_it_ran_on(tmp_path, engine):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"engine": engine, "algorithm": "fedavg"}))
    args = build_parser().parse_args(["simulate", "--resume", str(run)])
    apply_preset(args)
    assert args.engine == engine
    args = build_parser().parse_args(["simulate", "--resume", str(run), "--engine", "inprocess"])
    apply_preset(args)
    assert args.engine == "inprocess"  # the flag wins


def test_rays_actor_sizes_choose_ray_and_are_refused_by_the_in_process_engines(tmp_path, monkeypatch):
    monkeypatch.setattr("flatflower.tools.prepare.cuda_gpu_count", lambda: 1)  # as on a machine with one GPU
    run = ["--run-dir", str(tmp_path / "r")]
    args = build_parser().parse_args(["simulate", "--gpus-per-client", "0.25", *run])
    apply_preset(args)
    assert (args.engine, args.gpus_per_client, args.cpus_per_client) == ("ray", 0.25, None)
    for engine in ("inprocess", "vectorized"):
        args = build_parser().parse_args(["simulate", "--engine", engine, "--cpus-per-client", "2", *run])
        with pytest.raises(UsageError, match="--cpus-per-client size Ray's client actors.*add --engine ray"):
            apply_preset(args)
    for flags, message in ((["--cpus-per-client", "0"], "--cpus-per-client must be >= 1"),
                           (["--gpus-per-client", "1.5"], r"--gpus-per-client must be in \[0, 1\]")):
        with pytest.raises(UsageError, match=message):
            apply_preset(build_parser().parse_args(["simulate", "--engine", "ray", *flags, *run]))
    assert main(["sweep", "--algorithms", "fedavg", "--seeds", "0", "--engine", "inprocess",
                 "--gpus-per-client", "0.5", "--out", str(tmp_path / "sweep")]) == 2
    assert not (tmp_path / "sweep").exists()  # refused before any run


def test_ray_actor_sizes_this_machine_cannot_place_are_refused_before_ray_starts(tmp_path, monkeypatch):
    """Ray ends such a run after its start-up with "ActorPool is empty"; the CLI says why first."""
    monkeypatch.setattr("flatflower.tools.prepare.cuda_gpu_count", lambda: 0)
    run = ["--engine", "ray", "--run-dir", str(tmp_path / "r")]
    with pytest.raises(UsageError, match="--gpus-per-client 0.25 gives each client a share of a GPU, and "
                                         "PyTorch sees no CUDA GPU here"):
        apply_preset(build_parser().parse_args(["simulate", "--gpus-per-client", "0.25", *run]))
    apply_preset(build_parser().parse_args(["simulate", "--gpus-per-client", "0", *run]))  # no GPU asked for
    too_many = str((os.cpu_count() or 1) + 1)
    with pytest.raises(UsageError, match=f"--cpus-per-client {too_many} is more than this machine's"):
        apply_preset(build_parser().parse_args(["simulate", "--cpus-per-client", too_many, *run]))
    assert main(["sweep", "--algorithms", "fedavg", "--seeds", "0", "--gpus-per-client", "0.5",
                 "--out", str(tmp_path / "sweep")]) == 2
    assert not (tmp_path / "sweep").exists()


def test_the_ray_engine_without_ray_installed_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    """Without Ray, Flower's simulation ended after its start-up with "Task failed with unknown
    error" (exit code 701 in logs/run.log); the CLI refuses with the install command first."""
    monkeypatch.setattr("flatflower.tools.prepare.ray_installed", lambda: False)
    assert main(["simulate", "--engine", "ray", "--rounds", "1", "--run-dir", str(tmp_path / "r")]) == 2
    assert "pip install 'flwr[simulation]==1.39.0'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    apply_preset(build_parser().parse_args(["simulate", "--engine", "inprocess", "--run-dir", str(tmp_path / "r")]))


@pytest.mark.parametrize("record", ['{"engine": "deployment"}', '{"engine": "threads"}', "[1]", "{"])
def test_a_resumed_runs_engine_that_simulate_cannot_run_falls_back_to_the_default(tmp_path, record):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(record)
    args = build_parser().parse_args(["simulate", "--resume", str(run)])
    apply_preset(args)
    assert args.engine == "inprocess"


def test_the_fashion_mnist_study_preset_gives_each_method_its_papers_values():
    preset = load_preset("fashion-mnist-bench")
    assert preset.engine == "inprocess" and preset.clients == 100
    assert preset.values("fedsam")["sam.rho"] == 0.01 and preset.values("fedtoga")["sam.rho"] == 0.1
    assert preset.values("feddyn")["feddyn.alpha"] == 0.01 and preset.values("fedspeed")["feddyn.alpha"] == 0.1
    cfg = RunConfig.from_mapping({"num-partitions": 100, **preset.values("fedgmt"), "algorithm": "fedgmt"})
    assert (cfg.dataset, cfg.resolved_model(), cfg.dirichlet_alpha, cfg.fraction_train) == (
        "fashion-mnist", "lenet5", 0.1, 0.1)
    assert (cfg.local_epochs, cfg.batch_size, cfg.lr, cfg.clip_norm) == (5, 50, 0.1, 10.0)


NEWER = ("fedsol", "fedgloss", "fedswa", "fedmoswa", "fedwmsam", "fedgf", "dp-fedsam")


@pytest.mark.parametrize("algorithm", NEWER)
def test_the_fashion_mnist_study_preset_runs_the_newer_methods_with_their_authors_values(algorithm):
    """Each newer method has its table (a run of it is the study's setting plus its own values,
    which validate), and FedGF's required T_D is set to a finite number (not left to fail)."""
    preset = load_preset("fashion-mnist-bench")
    values = preset.values(algorithm)
    own = {k for k in values if k not in preset.config}
    assert own, f"{algorithm} has no table in the study preset"
    cfg = RunConfig.from_mapping({"num-partitions": 100, **values, "algorithm": algorithm})
    assert (cfg.dataset, cfg.lr, cfg.local_epochs, cfg.batch_size) == ("fashion-mnist", 0.1, 5, 50)
    expected = {"fedsol": {"fedsol.rho": 1.0, "fedsol.tau": 3.0},
                "fedgloss": {"sam.rho": 0.15, "fedgloss.rho-server": 0.15, "fedgloss.beta": 10.0},
                "fedswa": {"fedswa.lr-ratio": 0.1, "server-lr": 1.0},
                "fedmoswa": {"fedswa.lr-ratio": 0.1, "fedmoswa.gamma": 0.2},
                "fedwmsam": {"sam.rho": 0.01, "fedwmsam.alpha0": 0.1, "fedwmsam.lambda": 0.01},
                "fedgf": {"sam.rho": preset.values("fedsam")["sam.rho"], "fedgf.window": 30},
                "dp-fedsam": {"sam.rho": 0.5, "dp.clip": 0.2, "dp.noise-multiplier": 0.95}}[algorithm]
    assert {k: values[k] for k in expected} == expected
    if algorithm == "fedgf":
        assert math.isfinite(values["fedgf.threshold"]) and values["fedgf.threshold"] > 0


def test_clients_default_from_preset(tmp_path):
    path = write_preset(tmp_path, GOOD)
    run_dir = ["--run-dir", str(tmp_path / "run")]
    assert resolved(["--preset", str(path), *run_dir])[1] == 6
    assert resolved(["--preset", str(path), "--clients", "3", *run_dir])[1] == 3
    assert resolved(run_dir)[1] == 4  # no preset: the old default
    no_clients = write_preset(tmp_path, GOOD.replace("clients = 6\n", ""), "q.toml")
    assert resolved(["--preset", str(no_clients), *run_dir])[1] == 4


@pytest.mark.slow
def test_digits_preset_runs_inprocess(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["simulate", "--engine", "inprocess", "--preset", "digits-quick", "--run-dir", str(run)])
    assert code == 0
    preset = load_preset("digits-quick")
    config = json.loads((run / "config.json").read_text())["config"]
    assert all(config[k] == v for k, v in preset.config.items())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == preset.config["num-server-rounds"] + 1
    assert rows[-1]["clients_sampled"] == 10  # 20 clients from the preset, fraction 0.5
    # it looks like learning (5 rounds ended at 39%), as its description says
    assert rows[-1]["test_accuracy"] >= 0.75 and "ends at 75-86% test accuracy" in preset.description
    assert "preset digits-quick" in capsys.readouterr().out


def test_presets_subcommand_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        preset = load_preset(name)
        assert name in out and preset.description in out and preset.source in out


# ------------------------------------------------------------------ errors: exit 2, one line
@pytest.mark.parametrize("text, message", [
    ("[preset\ndescription = 'x'\n", "invalid TOML"),
    ("[config]\nalgorithm = 'fedsam'\n", "missing [preset] table"),
    ("[preset]\ndescription = 'x'\n", "missing [config] table"),
    (GOOD.replace("clients = 6", "clients = 6\nauthor = 'me'"),
     "unknown key(s) in [preset]: author"),
    (GOOD.replace("clients = 6", "clients = 0"), "clients must be a positive integer"),
    (GOOD.replace("clients = 6", "clients = 2.5"), "clients must be a positive integer"),
    (GOOD.replace("clients = 6", "clients = true"), "clients must be a positive integer"),
    (GOOD.replace('description = "test preset"', ""), "needs a description"),
    ("config = 3\n" + GOOD.replace("[config]", "[other]"), "unknown table(s) other"),
    ("config = 3\n[preset]\ndescription = 'x'\n", "config must be a table"),
    (GOOD + "[extra]\n", "unknown table(s) extra"),
    (GOOD + "nonsense = 1\n", "unknown run-config key(s): nonsense"),
    (GOOD.replace("lr = 0.05", "lr = -1.0"), "lr must be a finite number > 0"),
    (GOOD.replace("lr = 0.05", "lr = 'fast'"), "lr='fast' is not a valid float"),
])
def test_bad_preset_file_is_one_line_exit_2(tmp_path, capsys, text, message):
    path = write_preset(tmp_path, text)
    code = main(["simulate", "--engine", "inprocess", "--preset", str(path),
                 "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert message in err and str(path) in err
    assert not (tmp_path / "r").exists()


def test_toml_error_names_line_and_column(tmp_path):
    path = write_preset(tmp_path, "[preset]\ndescription = \n")
    with pytest.raises(PresetError, match=r"line 2, column"):
        load_preset(path)


@pytest.mark.parametrize("arg, message", [
    ("{tmp}/missing.toml", "preset file {tmp}/missing.toml not found"),
    ("no-such-preset", "unknown preset 'no-such-preset'; available presets: digits-quick, "),
])
def test_missing_preset_is_one_line_exit_2(tmp_path, capsys, arg, message):
    arg, message = (s.replace("{tmp}", str(tmp_path)) for s in (arg, message))
    code = main(["local", "--preset", arg, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert message in err
    if "available" in message:
        assert all(name in err for name in PRESETS)


def test_a_presets_escape_bytes_are_shown_escaped_never_sent_to_the_terminal(tmp_path, capsys):
    """A preset's description is text from a file: ``\\x1b[2J`` (clear screen) or a newline
    faking a line is printed as its escape."""
    path = write_preset(tmp_path, GOOD.replace('"test preset"', '"evil \\u001b[2J\\nerror: fake"'))
    assert main(["simulate", "--engine", "inprocess", "--preset", str(path), "--clients", "0"]) == 2
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\nerror: fake" not in out
    assert "preset p: evil \\x1b[2J\\nerror: fake" in out
