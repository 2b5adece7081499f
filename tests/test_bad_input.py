"""Bad input, table-driven: every case names the input, the exit code and a distinctive
substring of the message a user must see.

For each CLI case the contract is: exactly one line ``error: ...`` on stderr, exit code 2
(a usage error), never a traceback, and
nothing that was on disk before (a run directory, a checkpoint, a preset file) is changed,
removed or added to. Four groups:

1. run-config values through ``flatflower simulate --engine inprocess``,
2. files: presets, ``--resume`` of damaged run directories, existing/unwritable ``--run-dir``,
3. node config (``NodeSettings.from_node_config`` -> ValueError) and argparse errors (one line
   too, with a pointer to ``--help``, not argparse's usage),
4. checkpoints that load but are wrong in one field: refused in one line, never resumed.

No Flower process is started: only the in-process engine, and (except for the two cases
marked xfail that document a defect) validation fails before any round runs. Cases marked
``xfail(strict=True)`` are real defects: the reason says what happens and what should.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

# imported here, not first inside a test: flwr's log handler keeps the sys.stderr of its import,
# and a test's capture stream is closed after it ("--- Logging error ---" tracebacks later on)
import flatflower.runtime.engines.inprocess  # noqa: F401
from flatflower.client.node import NodeSettings
from flatflower.tools.cli import main

USAGE = 2
SIM = ["simulate", "--engine", "inprocess"]
# a valid, tiny run; each config case appends the one thing it gets wrong (later flags win)
QUICK = [*SIM, "--clients", "3", "--dataset", "synthetic", "--model", "logreg", "--partition", "iid",
         "--rounds", "1", "--set", "local-steps=1", "--run-dir", "{tmp}/run"]


def defect(reason: str, raises: type[BaseException] = AssertionError):
    """A case that fails today because of a bug in the code under test (not in the test)."""
    return pytest.mark.xfail(strict=True, raises=raises, reason=reason)


# ------------------------------------------------------------------------------ helpers
def snapshot(root: Path) -> dict[str, tuple]:
    """Every file (bytes, mtime) and directory under ``root``."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = ("dir",)
        for f in filenames:
            path = os.path.join(dirpath, f)
            st = os.lstat(path)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = (fh.read(), st.st_mtime_ns)
    return out


def assert_untouched(before: dict[str, tuple], after: dict[str, tuple]) -> None:
    removed = sorted(set(before) - set(after))
    added = sorted(set(after) - set(before))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    assert not (removed or added or changed), (
        f"files on disk changed: removed {removed}, added {added}, modified {changed}")


def run_cli(argv: list[str], tmp: Path, capfd) -> tuple[int, str, str]:
    """main(argv with {tmp} filled in) -> (exit code, stdout, stderr); SystemExit is an exit.

    capfd rather than capsys: it also sees what is written to the file descriptors directly."""
    argv = [a.format(tmp=tmp) for a in argv]
    capfd.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capfd.readouterr()
    return code, out, err


def check_cli(argv: list[str], tmp: Path, capfd, caplog, code: int, message: str) -> None:
    before = snapshot(tmp)
    got, out, err = run_cli(argv, tmp, capfd)
    assert "Traceback" not in out + err + caplog.text  # caplog: tracebacks logged by Flower
    assert got == code, f"exit code {got}, expected {code}; stderr: {err!r}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one 'error: ...' line: {err!r}"
    assert message in lines[0], f"{message!r} not in {lines[0]!r}"
    assert_untouched(before, snapshot(tmp))


# ----------------------------------------------------------- 1. run-config values (CLI)
CONFIG_CASES = [
    # names
    pytest.param(["--algorithm", "fedfoo"], "algorithm='fedfoo' is not one of:", id="algorithm-unknown"),
    pytest.param(["--algorithm", "fedsamm"], "(did you mean 'fedsam'?)", id="algorithm-misspelt"),
    pytest.param(["--set", "sam.roh=0.1"], "unknown run-config key(s): sam.roh (did you mean 'sam.rho'?)",
                 id="key-misspelt"),
    pytest.param(["--preset", "digits-quik"], "unknown preset 'digits-quik' (did you mean 'digits-quick'?)",
                 id="preset-misspelt"),
    pytest.param(["--set", "learning-rate=0.1"], "unknown run-config key(s): learning-rate", id="key-unknown"),
    pytest.param(["--set", "=1"], "--set expects key=value, got '=1'", id="key-empty"),
    pytest.param(["--set", "lr"], "--set expects key=value, got 'lr'", id="set-without-equals"),
    pytest.param(["--dataset", "imagenet"], "dataset='imagenet' is not one of:", id="dataset-unknown"),
    pytest.param(["--model", "vgg16"], "model='vgg16' is not one of:", id="model-unknown"),
    pytest.param(["--partition", "random"], "partition='random' is not one of:", id="partition-unknown"),
    pytest.param(["--set", "sampling=random"], "sampling='random' is not one of: bernoulli, fixed",
                 id="sampling-unknown"),
    pytest.param(["--set", "aggregation=median"], "aggregation='median' is not one of: uniform, weighted",
                 id="aggregation-unknown"),
    pytest.param(["--set", "too-few-replies=abort"], "too-few-replies='abort' is not one of: retry, skip",
                 id="too-few-replies-unknown"),
    pytest.param(["--set", "fedtoga.perturbation=X"], "fedtoga.perturbation must be one of: G, N, fusion (got 'X')",
                 id="fedtoga-perturbation-unknown"),
    pytest.param(["--set", "fedtoga.dual-divisor=K"], "fedtoga.dual-divisor must be one of: M, N (got 'K')",
                 id="fedtoga-dual-divisor-unknown"),
    # types
    pytest.param(["--set", "lr=abc"], "lr='abc' is not a valid float", id="lr-not-a-number"),
    pytest.param(["--set", "lr="], "lr='' is not a valid float", id="lr-empty"),
    pytest.param(["--set", "lr=[1, 2]"], "lr=[1, 2] is not a valid float", id="lr-list"),
    pytest.param(["--set", "local-epochs=1.5"], "local-epochs=1.5 is not a valid int", id="local-epochs-fraction"),
    pytest.param(["--set", "batch-size=true"], "batch-size=True is not a valid int", id="batch-size-bool"),
    pytest.param(["--set", "download=maybe"], "download='maybe' is not a valid bool", id="download-not-bool"),
    # ranges
    pytest.param(["--set", "lr=0"], "lr must be a finite number > 0 (got 0.0)", id="lr-zero"),
    pytest.param(["--set", "lr=-0.1"], "lr must be a finite number > 0 (got -0.1)", id="lr-negative"),
    pytest.param(["--set", "lr=nan"], "lr must be a finite number > 0 (got nan)", id="lr-nan"),
    pytest.param(["--set", "lr=inf"], "finite", id="lr-inf"),
    pytest.param(["--set", "lr-decay=0"], "lr-decay must be in (0, 1]", id="lr-decay-zero"),
    pytest.param(["--set", "lr-decay=1.5"], "lr-decay must be in (0, 1]", id="lr-decay-above-1"),
    pytest.param(["--set", "sam.rho=-0.05"], "sam.rho must be a finite number >= 0 (got -0.05)", id="rho-negative"),
    pytest.param(["--set", "fraction-train=0"], "fraction-train must be in (0, 1] (got 0.0)",
                 id="fraction-train-zero"),
    pytest.param(["--fraction", "1.5"], "fraction-train must be in (0, 1] (got 1.5)", id="fraction-flag-above-1"),
    pytest.param(["--set", "fraction-evaluate=-0.1"], "fraction-evaluate must be in [0, 1] (got -0.1)",
                 id="fraction-evaluate-negative"),
    pytest.param(["--set", "fraction-evaluate=1.1"], "fraction-evaluate must be in [0, 1] (got 1.1)",
                 id="fraction-evaluate-above-1"),
    pytest.param(["--set", "dirichlet-alpha=0"], "dirichlet-alpha must be in (0, 1e6]", id="dirichlet-alpha-zero"),
    pytest.param(["--set", "local-epochs=0"], "local-epochs must be >= 1", id="local-epochs-zero"),
    pytest.param(["--set", "batch-size=0"], "batch-size must be >= 1", id="batch-size-zero"),
    pytest.param(["--set", "momentum=1"], "momentum must be in [0, 1)", id="momentum-one"),
    pytest.param(["--set", "momentum=-0.5"], "momentum must be in [0, 1)", id="momentum-negative"),
    pytest.param(["--set", "min-replies=0"], "min-replies must be >= 1", id="min-replies-zero"),
    pytest.param(["--set", "max-retries=-1"], "max-retries must be >= 0", id="max-retries-negative"),
    pytest.param(["--set", "outlier-norm-factor=0.5"], "outlier-norm-factor must be 0 (off) or > 1",
                 id="outlier-norm-factor-half"),
    pytest.param(["--set", "outlier-norm-factor=1"], "outlier-norm-factor must be 0 (off) or > 1",
                 id="outlier-norm-factor-one"),
    pytest.param(["--set", "outlier-norm-factor=-2"], "outlier-norm-factor must be 0 (off) or > 1",
                 id="outlier-norm-factor-negative"),
    pytest.param(["--set", "checkpoint-every=-1"], "checkpoint-every must be >= 0",
                 id="checkpoint-every-negative"),
    pytest.param(["--set", "fedgmt.alpha=1"], "fedgmt.alpha must be in [0, 1)", id="fedgmt-alpha-one"),
    pytest.param(["--set", "fedgmt.beta=0"], "fedgmt.beta must be a finite number > 0 (got 0.0)", id="fedgmt-beta-zero"),
    pytest.param(["--set", "fednsam.lambda=1"], "fednsam.lambda must be in [0, 1)", id="fednsam-lambda-one"),
    pytest.param(["--set", "fednsam.lambda=-0.1"], "fednsam.lambda must be in [0, 1)",
                 id="fednsam-lambda-negative"),
    pytest.param(["--set", "feddyn.alpha=0"], "feddyn.alpha must be a finite number > 0 (got 0.0)", id="feddyn-alpha-zero"),
    pytest.param(["--set", "feddyn.alpha=-1"], "feddyn.alpha must be a finite number > 0 (got -1.0)", id="feddyn-alpha-negative"),
    pytest.param(["--flatness-every", "-1"], "flatness-every must be >= 0", id="flatness-every-negative"),
    pytest.param(["--set", "flatness-rho=0"], "flatness-rho must be a finite number > 0", id="flatness-rho-zero"),
    pytest.param(["--set", "flatness-iters=0"], "flatness-iters must be in [1, 100000]", id="flatness-iters-zero"),
    pytest.param(["--set", "flatness-probes=0"], "flatness-probes must be in [1, 100000]",
                 id="flatness-probes-zero"),
    pytest.param(["--rounds", "0"], "num-server-rounds must be >= 1", id="rounds-zero"),
    pytest.param(["--seed", "-1"], "seed must be in [0, 4294967295]", id="seed-negative"),
    pytest.param(["--set", "lr=0", "--set", "sam.rho=-1"], "lr must be a finite number > 0 (got 0.0); sam.rho must be a finite number >= 0",
                 id="two-errors-both-listed"),
    # clients, partitions, data
    pytest.param(["--clients", "0"], "--clients must be >= 1", id="clients-zero"),
    pytest.param(["--clients", "-3"], "--clients must be >= 1", id="clients-negative"),
    pytest.param(["--clients", "2", "--partition", "pathological", "--set", "classes-per-client=1"],
                 "2 clients x 1 classes each cannot cover all 10 classes", id="pathological-too-few-clients"),
    pytest.param(["--partition", "pathological", "--set", "classes-per-client=11"],
                 "classes_per_client=11 exceeds the 10 classes", id="pathological-too-many-classes"),
    pytest.param(["--clients", "3000"],
                 "the number of clients (num-partitions, --clients) must be between 1 and the number of samples (2000)",
                 id="more-clients-than-samples"),
    pytest.param(["--clients", "150", "--partition", "dirichlet", "--set", "dirichlet-alpha=0.001"],
                 "use a larger alpha or fewer partitions", id="dirichlet-cannot-draw"),
    pytest.param(["--dataset", "cifar10", "--model", "auto", "--set", "download=false",
                  "--set", "data-dir={tmp}/data"],
                 "dataset 'cifar10' is not available", id="cifar10-offline-without-files"),
    pytest.param(["--model", "lenet"], "model 'lenet' does not fit dataset 'synthetic'", id="model-does-not-fit-dataset"),
    pytest.param(["--set", "min-replies=10"], "min-replies=10 exceeds the 3 clients sampled per round", id="min-replies-above-clients"),
    # finite but absurd, and numbers that are not ASCII (issue 13)
    pytest.param(["--set", "round-timeout=0.001"], "round-timeout must be in [1, 10000000] seconds (got 0.001)",
                 id="round-timeout-tiny"),
    pytest.param(["--set", "round-timeout=1e308"], "round-timeout must be in [1, 10000000] seconds",
                 id="round-timeout-overflows"),
    pytest.param(["--set", "node-wait-timeout=1e308"], "node-wait-timeout must be in (0, 10000000] seconds",
                 id="node-wait-timeout-overflows"),
    pytest.param(["--timeout", "1e308"], "--timeout must be in (0, 10000000] seconds", id="timeout-overflows"),
    pytest.param(["--seed", "18446744073709551616"], "seed must be in [0, 4294967295]", id="seed-beyond-2-64"),
    pytest.param(["--seed", "4294967296"], "seed must be in [0, 4294967295]", id="seed-beyond-2-32"),
    pytest.param(["--set", "local-epochs=1000000000000"], "local-epochs=1000000000000 is out of range",
                 id="local-epochs-beyond-int32"),
    pytest.param(["--set", "lr=" + "1" * 5000], "lr must be a finite number > 0 (got inf)", id="lr-5000-digits"),
    pytest.param(["--set", "lr=1" + "0" * 400], "lr=10000", id="lr-beyond-float"),
    pytest.param(["--set", "local-epochs=1" + "0" * 5000], "local-epochs='10000", id="local-epochs-5000-digits"),
    pytest.param(["--run-dir", "~nosuchuser/x"], "~nosuchuser is no user's home directory", id="run-dir-no-such-user"),
    pytest.param(["--set", "client-state-dir=~nosuchuser/x"],
                 "client-state-dir='~nosuchuser/x': ~nosuchuser is no user's home directory",
                 id="client-state-dir-no-such-user"),
    pytest.param(["--preset", "~nosuchuser/p.toml"], "--preset='~nosuchuser/p.toml': ~nosuchuser is no user",
                 id="preset-no-such-user"),
    pytest.param(["--set", "lr=\u0661"], "lr='\u0661' is not a valid float (use ASCII digits)",
                 id="lr-arabic-indic-digit"),
    pytest.param(["--set", "lr=\uff10.\uff15"], "is not a valid float (use ASCII digits)", id="lr-full-width"),
    pytest.param(["--set", "seed=\u0661"], "is not a valid int (use ASCII digits)", id="seed-arabic-indic-digit"),
    # robust aggregation and the federation's size
    pytest.param(["--set", "aggregator=average"], "aggregator='average' is not one of:", id="aggregator-unknown"),
    pytest.param(["--set", "aggregator-trim=0.5"], "aggregator-trim must be in [0, 0.5)", id="aggregator-trim-half"),
    pytest.param(["--set", "aggregator-f=-1"], "aggregator-f (clients assumed Byzantine) must be >= 0",
                 id="aggregator-f-negative"),
    pytest.param(["--set", "aggregator-clip=-1"], "aggregator-clip must be a finite number >= 0",
                 id="aggregator-clip-negative"),
    pytest.param(["--set", "aggregator=krum"], "aggregator krum needs at least 5 clients per round",
                 id="aggregator-krum-too-few-clients"),
    pytest.param(["--set", "num-partitions=5"], "num-partitions=5 disagrees with --clients 3",
                 id="num-partitions-disagrees-with-clients"),
    # a --set value that a named flag overrides (QUICK gives --rounds) is still checked (issue 43)
    pytest.param(["--set", "num-server-rounds=abc"], "num-server-rounds='abc' is not a valid int",
                 id="set-value-overridden-by-flag"),
    pytest.param(["--set", "fraction-train=most", "--fraction", "0.5"], "fraction-train='most' is not a valid float",
                 id="set-fraction-overridden-by-flag"),
]


@pytest.mark.parametrize("args, message", CONFIG_CASES)
def test_bad_run_config(tmp_path, capfd, caplog, args, message):
    (tmp_path / "data").mkdir()  # an empty data directory (the offline cifar10 case)
    check_cli([*QUICK, *args], tmp_path, capfd, caplog, USAGE, message)
    assert not (tmp_path / "run").exists(), "the run directory was created for a run that never started"


# ----------------------------------------------------------------------------- 2. files
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real, resumable run directory: feddyn, 3 clients, 2 rounds (read-only: copy it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    code = main([*SIM, "--algorithm", "feddyn", "--clients", "3", "--rounds", "2", "--dataset",
                 "synthetic", "--model", "logreg", "--partition", "iid", "--set", "local-steps=1",
                 "--run-dir", str(run_dir)])
    assert code == 0 and (run_dir / "checkpoint.pt").is_file()
    return run_dir


def preset(text: str):
    def setup(tmp: Path) -> None:
        (tmp / "p.toml").write_bytes(text.encode() if isinstance(text, str) else text)
    return setup


def edit_config(**changes):
    """Change run-config keys in the run's config.json (not in its checkpoint)."""
    def setup(tmp: Path) -> None:
        path = tmp / "run" / "config.json"
        data = json.loads(path.read_text())
        data["config"].update(changes)
        path.write_text(json.dumps(data, indent=1))
    return setup


def edit_partition(**changes):
    """Change fields of the run's partition.json (``inf`` is written as 1e999)."""
    def setup(tmp: Path) -> None:
        path = tmp / "run" / "partition.json"
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data).replace("Infinity", "1e999"))
    return setup


def write(name: str, content: bytes | str):
    def setup(tmp: Path) -> None:
        path = tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def plant(name: str, replace: bool = False):
    """A symbolic link at ``name`` to the file ``victim`` (which must stay as it is)."""
    def setup(tmp: Path) -> None:
        (tmp / "victim").write_text("precious")
        link = tmp / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if replace:
            shutil.rmtree(link) if link.is_dir() else link.unlink()
        link.symlink_to(tmp / "victim")
    return setup


def remove(name: str):
    return lambda tmp: (tmp / name).unlink()


def truncate_checkpoint(tmp: Path) -> None:
    path = tmp / "run" / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def not_a_flatflower_checkpoint(tmp: Path) -> None:
    torch.save({"weights": torch.zeros(3)}, tmp / "run" / "checkpoint.pt")


class Payload:
    """Unpickling this runs code: it would create the file ``pwned`` (snapshot would see it)."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (self.target,))


def pickle_payload_checkpoint(tmp: Path) -> None:
    """A checkpoint that is real in every field, plus an object whose unpickling runs code."""
    ckpt = torch.load(tmp / "run" / "checkpoint.pt", weights_only=True)
    ckpt["extra"] = Payload(tmp / "pwned")
    torch.save(ckpt, tmp / "run" / "checkpoint.pt")


HELD: list[int] = []


def held_by_another_command(tmp: Path) -> None:
    """Another flatflower command is resuming the run (it holds the directory's lock)."""
    from flatflower.server.rundir import claim

    HELD.append(claim(tmp / "run", "busy"))


GOOD_PRESET = '[preset]\ndescription = "d"\n\n[config]\ndataset = "synthetic"\nmodel = "logreg"\n'
NEW = ["--run-dir", "{tmp}/new"]
RESUME = [*SIM, "--resume", "{tmp}/run"]
FILE_CASES = [
    # presets
    pytest.param(None, [*SIM, "--preset", "{tmp}/missing.toml", *NEW], "preset file {tmp}/missing.toml not found",
                 id="preset-file-missing"),
    pytest.param(None, [*SIM, "--preset", "{tmp}/run", *NEW], "preset {tmp}/run is a directory",
                 id="preset-path-is-a-directory"),
    pytest.param(None, [*SIM, "--preset", "{tmp}", *NEW], "preset {tmp} is a directory",
                 id="preset-path-is-a-directory-without-slash-at-the-end"),
    pytest.param(None, [*SIM, "--preset", "no-such-preset", *NEW],
                 "unknown preset 'no-such-preset'; available presets: digits-quick", id="preset-name-unknown"),
    pytest.param(preset('[preset\ndescription = "d"\n'), [*SIM, "--preset", "{tmp}/p.toml", *NEW],
                 "p.toml: invalid TOML", id="preset-toml-does-not-parse"),
    pytest.param(preset(b"\xff\xfe[preset]\n"), [*SIM, "--preset", "{tmp}/p.toml", *NEW],
                 "p.toml: cannot read preset", id="preset-not-utf8"),
    pytest.param(preset(GOOD_PRESET + "learning-rate = 0.1\n"), [*SIM, "--preset", "{tmp}/p.toml", *NEW],
                 "p.toml: [config]: unknown run-config key(s): learning-rate", id="preset-config-key-unknown"),
    pytest.param(preset(GOOD_PRESET.replace("[preset]\n", "[preset]\nauthor = 'x'\n")),
                 [*SIM, "--preset", "{tmp}/p.toml", *NEW],
                 "p.toml: unknown key(s) in [preset]: author", id="preset-meta-key-unknown"),
    pytest.param(preset(GOOD_PRESET + "[extra]\nx = 1\n"), [*SIM, "--preset", "{tmp}/p.toml", *NEW],
                 "p.toml: unknown table(s) extra", id="preset-table-unknown"),
    pytest.param(preset(GOOD_PRESET + "lr = -1\n"), [*SIM, "--preset", "{tmp}/p.toml", *NEW],
                 "p.toml: [config]: invalid run config: lr must be a finite number > 0", id="preset-config-value-invalid"),
    pytest.param(preset(GOOD_PRESET.replace('"d"', '"d"\nclients = 0')), [*SIM, "--preset", "{tmp}/p.toml", *NEW],
                 "[preset] clients must be a positive integer, got 0", id="preset-clients-zero"),
    pytest.param(preset(GOOD_PRESET.replace('"d"', '""')), [*SIM, "--preset", "{tmp}/p.toml", *NEW],
                 "[preset] needs a description", id="preset-description-empty"),
    pytest.param(preset(GOOD_PRESET + 'run-dir = "a\\u0000b"\n'), [*SIM, "--preset", "{tmp}/p.toml"],
                 "run-dir='a\\x00b' holds control characters", id="preset-value-with-a-nul-byte"),
    pytest.param(preset(GOOD_PRESET.replace('"d"', '"d"\nclients = 1' + "0" * 5000)),
                 [*SIM, "--preset", "{tmp}/p.toml", *NEW], "p.toml: invalid TOML: Exceeds the limit",
                 id="preset-int-of-5000-digits"),
    pytest.param(preset(GOOD_PRESET.replace('"d"', '"d"\nclients = 1' + "0" * 30)),
                 [*SIM, "--preset", "{tmp}/p.toml", *NEW], "is out of range", id="preset-clients-huge"),
    pytest.param(preset(GOOD_PRESET + "x = " + "[" * 100_000 + "]" * 100_000 + "\n"),
                 [*SIM, "--preset", "{tmp}/p.toml", *NEW], "p.toml: invalid TOML", id="preset-nested-deeply"),
    pytest.param(preset(GOOD_PRESET + ".".join(["a"] * 5000) + " = 1\n"),
                 [*SIM, "--preset", "{tmp}/p.toml", *NEW], "p.toml: [config] is nested too deeply",
                 id="preset-keys-nested-deeply"),
    # --resume of a damaged or missing run directory
    pytest.param(None, [*SIM, "--resume", "{tmp}/nowhere"], "run directory {tmp}/nowhere does not exist",
                 id="resume-dir-missing"),
    pytest.param(lambda tmp: (tmp / "empty").mkdir(), [*SIM, "--resume", "{tmp}/empty"],
                 "{tmp}/empty is not a flatflower run directory (no config.json)", id="resume-no-config-json"),
    pytest.param(write("run/config.json", '{"config": {"lr": 0.1'), RESUME, "config.json is corrupt",
                 id="resume-config-json-corrupt"),
    pytest.param(write("run/config.json", '{"config": [1, 2]}'), RESUME,
                 "config.json is corrupt: 'config' is not a table", id="resume-config-json-not-a-table"),
    pytest.param(write("run/config.json", "[]"), RESUME, "config.json is corrupt", id="resume-config-json-a-list"),
    pytest.param(write("run/config.json", b"\xff\xfe{}"), RESUME, "config.json is corrupt: 'utf-8' codec",
                 id="resume-config-json-not-utf8"),
    pytest.param(write("run/config.json", '{"config": ' * 100_000 + "1" + "}" * 100_000), RESUME,
                 "config.json is corrupt: maximum recursion depth", id="resume-config-json-nested-deeply"),
    pytest.param(None, [*SIM, "--resume", "~nosuchuser/run"], "~nosuchuser is no user's home directory",
                 id="resume-no-such-user"),
    pytest.param(edit_partition(num_partitions=float("inf")), [*RESUME, "--rounds", "1"],
                 "num-server-rounds=1 is below the checkpoint's round 2", id="resume-partition-json-1e999"),
    pytest.param(edit_config(lr=-1), RESUME, "config.json", id="resume-config-json-invalid-value"),
    pytest.param(edit_config(**{"no-such-key": 1}), RESUME, "config.json", id="resume-config-json-unknown-key"),
    pytest.param(remove("run/checkpoint.pt"), RESUME, "no checkpoint in {tmp}/run", id="resume-no-checkpoint"),
    pytest.param(write("run/checkpoint.pt", random.Random(0).randbytes(4096)), RESUME,
                 "checkpoint.pt is corrupt or unreadable", id="resume-checkpoint-random-bytes"),
    pytest.param(write("run/checkpoint.pt", b""), RESUME, "checkpoint.pt is corrupt or unreadable",
                 id="resume-checkpoint-empty"),
    pytest.param(truncate_checkpoint, RESUME, "checkpoint.pt is corrupt or unreadable",
                 id="resume-checkpoint-truncated"),
    pytest.param(not_a_flatflower_checkpoint, RESUME, "is not a flatflower checkpoint",
                 id="resume-checkpoint-foreign"),
    pytest.param(edit_config(lr=0.2), RESUME, "cannot resume with a different configuration: lr: 0.1 -> 0.2",
                 id="resume-config-differs-from-checkpoint"),
    pytest.param(edit_config(**{"client-state-dir": "/elsewhere"}), RESUME,
                 "cannot resume with a different configuration: client-state-dir:",
                 id="resume-client-state-dir-changed"),
    pytest.param(pickle_payload_checkpoint, RESUME, "holds objects other than tensors, which are never unpickled",
                 id="resume-checkpoint-with-a-pickle-payload"),
    pytest.param(held_by_another_command, RESUME, "is being resumed or run by another flatflower command",
                 id="resume-while-another-resume-runs"),
    # --resume refuses options that would change the run
    pytest.param(None, [*RESUME, "--set", "lr=0.2"], "--set cannot be combined with it", id="resume-with-set"),
    pytest.param(None, [*RESUME, "--algorithm", "fedavg"], "--algorithm cannot be combined with it",
                 id="resume-with-algorithm"),
    pytest.param(None, [*RESUME, "--preset", "digits-quick"], "--preset cannot be combined with it",
                 id="resume-with-preset"),
    pytest.param(None, [*RESUME, "--run-dir", "{tmp}/other"], "--run-dir cannot be combined with it",
                 id="resume-with-run-dir"),
    pytest.param(None, [*RESUME, "--clients", "5"], "the run in {tmp}/run has 3 clients, not --clients 5",
                 id="resume-different-clients"),
    pytest.param(None, [*RESUME, "--rounds", "1"], "num-server-rounds=1 is below the checkpoint's round 2",
                 id="resume-rounds-below-checkpoint"),
    pytest.param(None, [*RESUME, "--rounds", "0"], "num-server-rounds must be >= 1", id="resume-rounds-zero"),
    # links planted in a run directory (never followed: they would redirect writes elsewhere)
    pytest.param(plant("new/clients.jsonl"), [*QUICK[:-1], "{tmp}/new"],
                 "{tmp}/new/clients.jsonl is a symbolic link; flatflower never follows links",
                 id="run-dir-with-a-planted-link"),
    pytest.param(plant("new/logs/superlink.log"), [*QUICK[:-1], "{tmp}/new"],
                 "{tmp}/new/logs/superlink.log is a symbolic link", id="run-dir-with-a-planted-log-link"),
    pytest.param(plant("run/clients.jsonl", replace=True), [*RESUME, "--rounds", "3"],
                 "{tmp}/run/clients.jsonl is a symbolic link", id="resume-with-a-planted-link"),
    pytest.param(plant("run/client-state", replace=True), [*RESUME, "--rounds", "3"],
                 "{tmp}/run/client-state is a symbolic link", id="resume-with-a-planted-directory-link"),
    # --run-dir
    pytest.param(None, [*QUICK[:-1], "{tmp}/run"], "{tmp}/run already holds a run; choose another --run-dir",
                 id="run-dir-holds-a-run"),
    pytest.param(None, [*QUICK[:-2], "--set", "run-dir={tmp}/run"], "{tmp}/run already holds a run",
                 id="run-dir-via-set-holds-a-run"),
    pytest.param(write("afile", "precious"), [*QUICK[:-1], "{tmp}/afile/run"],
                 "cannot create run directory {tmp}/afile/run", id="run-dir-under-a-regular-file"),
    pytest.param(write("afile", "precious"), [*QUICK[:-1], "{tmp}/afile"],
                 "cannot create run directory {tmp}/afile", id="run-dir-is-a-regular-file"),
]


@pytest.mark.parametrize("setup, argv, message", FILE_CASES)
def test_bad_files(tmp_path, capfd, caplog, finished_run, setup, argv, message):
    shutil.copytree(finished_run, tmp_path / "run")
    if setup:
        setup(tmp_path)
    try:
        check_cli(argv, tmp_path, capfd, caplog, USAGE, message.format(tmp=tmp_path))
    finally:
        while HELD:
            os.close(HELD.pop())


# ------------------------------------------------------- 3. node config, CLI arguments
def node(**config):
    """from_node_config(config) and then torch_device(), as the ClientApp does."""
    config = {k.replace("_", "-"): v for k, v in config.items()}
    return lambda: NodeSettings.from_node_config(config).torch_device()


NODE_CASES = [
    pytest.param(node(num_partitions=3), "node config lacks 'partition-id'", id="partition-id-missing"),
    pytest.param(node(partition_id=0), "node config lacks 'num-partitions'", id="num-partitions-missing"),
    pytest.param(node(partition_id=3, num_partitions=3), "partition-id 3 is out of range [0, 2]",
                 id="partition-id-too-large"),
    pytest.param(node(partition_id=-1, num_partitions=3), "partition-id -1 is out of range [0, 2]",
                 id="partition-id-negative"),
    pytest.param(node(partition_id=1.5, num_partitions=3), "'partition-id' must be a whole number (got 1.5)",
                 id="partition-id-fraction"),
    pytest.param(node(partition_id=True, num_partitions=3), "'partition-id' must be a whole number (got True)",
                 id="partition-id-bool"),
    pytest.param(node(partition_id="one", num_partitions=3), "'partition-id' must be a whole number",
                 id="partition-id-text"),
    pytest.param(node(partition_id=0, num_partitions=0), "num-partitions must be >= 1 (got 0)",
                 id="num-partitions-zero"),
    pytest.param(node(partition_id=0, num_partitions=3, threads=-2), "threads must be >= 1 (got -2)",
                 id="threads-negative"),
    pytest.param(node(partition_id=0, num_partitions=3, threads=0), "threads must be >= 1 (got 0)",
                 id="threads-zero"),
    pytest.param(node(partition_id=0, num_partitions=3, device="gpu"), "device='gpu'", id="device-gpu"),
    pytest.param(node(partition_id=0, num_partitions=3, device="cuda"),
                 "device='cuda' requested but CUDA is not available", id="device-cuda-without-cuda"),
    pytest.param(node(partition_id=0, num_partitions=3, device="cuda:1"),
                 "device='cuda:1' requested but CUDA is not available", id="device-cuda-1-without-cuda"),
    pytest.param(node(partition_id=0, num_partitions=3, device="mps"),
                 "device='mps' requested but MPS (Apple's GPU) is not available", id="device-mps-without-mps"),
    pytest.param(node(partition_id=0, num_partitions=3, inject_fault="boom"),
                 "inject-fault='boom' is not one of: raise, exit, hang, nan, scale:F", id="inject-fault-unknown"),
    pytest.param(node(partition_id=0, num_partitions=3, inject_fault="scale"),
                 "inject-fault='scale' is not one of", id="inject-fault-scale-without-factor"),
    pytest.param(node(partition_id=0, num_partitions=3, inject_fault="raise@0"),
                 "inject-fault='raise@0' is not one of", id="inject-fault-round-zero"),
    pytest.param(node(partition_id=0, num_partitions=3, inject_fault="nan@x"),
                 "inject-fault='nan@x' is not one of", id="inject-fault-round-not-a-number"),
]


@pytest.mark.parametrize("call, message", NODE_CASES)
def test_bad_node_config(monkeypatch, call, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "a machine without CUDA"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)  # nor Apple's GPU
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_node_device_index_beyond_the_gpus_is_refused_at_the_handshake(monkeypatch):
    """cuda:1 on a node with one GPU: one line naming the GPUs there (the handshake's query calls
    torch_device), not a CUDA error in round 1; cuda:0 is that GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=re.escape("device='cuda:1' requested but there is no CUDA device 1 "
                                                   "(1 GPU: cuda:0..0) on this node")):
        node(partition_id=0, num_partitions=3, device="cuda:1")()
    assert node(partition_id=0, num_partitions=3, device="cuda:0")() == torch.device("cuda:0")


@pytest.mark.parametrize("device, message", [
    ("cuda:0", "--device cuda:0: CUDA is not available on this machine"),
    ("cuda", "--device cuda: CUDA is not available on this machine"),
    ("mps", "--device mps: MPS (Apple's GPU) is not available on this machine"),
    ("gpu", "--device 'gpu' is not one of: auto, cpu, cuda, cuda:<i>, mps"),
])
def test_local_device_this_machine_lacks_is_refused_before_anything_starts(tmp_path, capfd, caplog, monkeypatch,
                                                                             device, message):
    """`flatflower local --device cuda:0` without CUDA: one line at once (it failed after 83 s,
    once the SuperNodes had started and the handshake timed out)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    argv = ["local", "--clients", "2", "--rounds", "1", "--dataset", "synthetic", "--model", "logreg",
            "--device", device, "--run-dir", "{tmp}/run"]
    check_cli(argv, tmp_path, capfd, caplog, USAGE, message)


ARGPARSE_CASES = [
    pytest.param(["frobnicate"], "invalid choice: 'frobnicate'", id="subcommand-unknown"),
    pytest.param([], "the following arguments are required: command", id="subcommand-missing"),
    pytest.param(["simulate", "--clients", "abc"], "argument --clients/-n: invalid int value: 'abc'",
                 id="clients-not-a-number"),
    pytest.param(["simulate", "--rounds", "2.5"], "argument --rounds/-r: invalid int value: '2.5'",
                 id="rounds-not-an-int"),
    pytest.param(["simulate", "--rounds", "\u0663"], "argument --rounds/-r: invalid int value:",
                 id="rounds-arabic-indic-digit"),
    pytest.param(["simulate", "--fraction", "\uff10.\uff15"], "argument --fraction: invalid float value:",
                 id="fraction-full-width"),
    pytest.param(["simulate", "--engine", "threads"], "argument --engine: invalid choice: 'threads'",
                 id="engine-unknown"),
    pytest.param(["simulate", "--no-such-flag"], "unrecognized arguments: --no-such-flag", id="flag-unknown"),
    pytest.param(["simulate", "--set"], "argument --set: expected one argument", id="set-without-value"),
    pytest.param(["simulate", "--engine", "vectorised"], "argument --engine: invalid choice: 'vectorised'",
                 id="engine-misspelt"),
    pytest.param(["simulate", "--seed", "abc"], "argument --seed: invalid int value: 'abc'", id="seed-not-a-number"),
    pytest.param(["report", "--last-k", "x", "r"], "argument --last-k: invalid int value: 'x'",
                 id="report-last-k-not-a-number"),
    pytest.param(["report", "--last-k", "0", "r"], "argument --last-k: must be >= 1, not 0", id="report-last-k-zero"),
    pytest.param(["sweep", "--algorithms", "fedavg", "--out", "{tmp}/s", "--last-k", "-1"],
                 "argument --last-k: must be >= 1, not -1", id="sweep-last-k-negative"),
    pytest.param(["bench", "--classes", "x"], "argument --classes: invalid int value: 'x'", id="bench-classes-not-a-number"),
    pytest.param(["flatness", "r", "--hvp", "x"], "argument --hvp: invalid choice: 'x'", id="flatness-hvp-unknown"),
    pytest.param(["sweep", "--algorithms", "fedavg", "--out", "{tmp}/s", "--algorithm", "fedsam"],
                 "unrecognized arguments: --algorithm fedsam", id="sweep-algorithm"),
]


@pytest.mark.parametrize("argv, message", ARGPARSE_CASES)
def test_bad_arguments(tmp_path, capfd, argv, message):
    before = snapshot(tmp_path)
    code, out, err = run_cli(argv, tmp_path, capfd)
    assert "Traceback" not in out + err
    assert code == USAGE
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one 'error: ...' line: {err!r}"
    assert message in lines[0] and "--help)" in lines[0]
    assert_untouched(before, snapshot(tmp_path))


# ------------------------------------------------- 4. loadable but wrong checkpoints (issue 23)
def ckpt_edit(change):
    """Load the run's real checkpoint, apply ``change(ckpt)`` to it, save it back."""
    def setup(tmp: Path) -> None:
        path = tmp / "run" / "checkpoint.pt"
        ckpt = torch.load(path, weights_only=True)
        change(ckpt)
        torch.save(ckpt, path)
    return setup


def at(*keys):
    """``ckpt[k0][k1]...`` (the dict that holds the last key) and that key."""
    def get(ckpt):
        for k in keys[:-1]:
            ckpt = ckpt[k]
        return ckpt, keys[-1]
    return get


def set_(path, value):
    def change(ckpt):
        d, k = path(ckpt)
        d[k] = value(d[k]) if callable(value) else value
    return change


def drop(path):
    def change(ckpt):
        d, k = path(ckpt)
        del d[k]
    return change


W, DUAL = at("strategy", "model", "1.weight"), at("strategy", "records", "dual", "1.weight")
SIZES = at("strategy", "participation", "sizes")
CHECKPOINT_CASES = [
    pytest.param(set_(at("round"), -3), "round", id="round-negative"),
    pytest.param(set_(at("round"), "2"), "round", id="round-a-string"),
    pytest.param(set_(at("round"), 2.0), "round", id="round-a-float"),
    pytest.param(set_(at("round"), True), "round", id="round-a-bool"),
    pytest.param(set_(at("round"), 10**30), "round", id="round-huge"),
    pytest.param(set_(at("strategy", "round"), 1), "round", id="round-differs-from-strategy"),
    pytest.param(set_(at("format"), 99), "is not a flatflower checkpoint", id="format-unknown"),
    pytest.param(drop(at("config")), "config", id="config-missing"),
    pytest.param(set_(at("config"), [1, 2]), "config", id="config-a-list"),
    pytest.param(set_(at("config", "algorithm"), "fedavg"), "algorithm", id="config-another-algorithm"),
    pytest.param(set_(at("strategy", "algorithm"), "fedavg"), "fedavg", id="strategy-another-algorithm"),
    pytest.param(drop(at("strategy", "model")), "model", id="model-missing"),
    pytest.param(set_(at("strategy", "model"), torch.zeros(3)), "model", id="model-a-tensor"),
    pytest.param(set_(W, lambda t: t.double()), "float64", id="model-float64"),
    pytest.param(set_(W, lambda t: t[:5]), "shape", id="model-wrong-shape"),
    pytest.param(set_(W, lambda t: t.tolist()), "1.weight", id="model-value-a-list"),
    pytest.param(drop(at("strategy", "model", "1.bias")), "1.bias", id="model-key-missing"),
    pytest.param(set_(at("strategy", "model", "extra"), torch.zeros(1)), "extra", id="model-key-extra"),
    pytest.param(set_(W, lambda t: t.fill_(float("nan"))), "finite", id="model-nan"),
    pytest.param(drop(at("strategy", "records", "dual")), "dual", id="record-missing"),
    pytest.param(set_(at("strategy", "records", "other"), {}), "other", id="record-extra"),
    pytest.param(set_(DUAL, lambda t: t.double()), "float64", id="record-float64"),
    pytest.param(set_(DUAL, lambda t: t.reshape(-1)), "shape", id="record-wrong-shape"),
    pytest.param(drop(at("strategy", "records", "dual", "1.bias")), "1.bias", id="record-key-missing"),
    pytest.param(set_(at("strategy", "records"), [1]), "records", id="records-a-list"),
    pytest.param(drop(at("strategy", "participation")), "participation", id="participation-missing"),
    pytest.param(set_(at("strategy", "participation", "num_partitions"), "3"), "num_partitions",
                 id="participation-num-partitions-a-string"),
    pytest.param(set_(at("strategy", "participation", "num_partitions"), 4), "num_partitions",
                 id="participation-num-partitions-differs"),
    pytest.param(drop(at("strategy", "participation", "sizes", "2")), "sizes", id="participation-size-missing"),
    pytest.param(set_(at("strategy", "participation", "sizes", "1"), -5), "sizes", id="participation-size-negative"),
    pytest.param(set_(at("strategy", "participation", "sizes", "x"), 5), "sizes", id="participation-size-bad-key"),
    pytest.param(drop(at("strategy", "participation", "accepted")), "accepted", id="participation-accepted-missing"),
    pytest.param(set_(at("strategy", "participation", "accepted"), "x"), "accepted",
                 id="participation-accepted-a-string"),
    pytest.param(set_(at("strategy", "participation", "accepted", "7"), 1), "accepted",
                 id="participation-accepted-unknown-partition"),
    pytest.param(set_(at("strategy", "participation", "accepted", "0"), 0), "accepted",
                 id="participation-accepted-round-zero"),
    pytest.param(drop(at("num_partitions")), "num_partitions", id="num-partitions-missing"),
    pytest.param(drop(at("strategy")), "strategy", id="strategy-missing"),
    pytest.param(set_(at("strategy"), [1]), "strategy", id="strategy-a-list"),
]


@pytest.mark.parametrize("change, message", CHECKPOINT_CASES)
def test_damaged_checkpoint_is_refused(tmp_path, capfd, caplog, finished_run, change, message):
    """Every loadable but wrong checkpoint is refused in one line before anything runs: none
    resumes (to a different model) or ends in a traceback."""
    shutil.copytree(finished_run, tmp_path / "run")
    ckpt_edit(change)(tmp_path)
    check_cli([*RESUME, "--rounds", "3"], tmp_path, capfd, caplog, USAGE, message)


# ------------------------------------------------ 5. links planted while a run goes on (issue 23)
def test_run_directory_files_are_never_opened_through_a_link(tmp_path):
    """Every file flatflower appends to, reads or replaces in a run directory is opened without
    following a link planted at its name (or at its temporary name): the link's target is never
    read or changed; an append or a read is refused in one line, an atomic write replaces the
    link itself."""
    from flatflower.server.progress import PROGRESS_FILE, read_progress, write_progress
    from flatflower.server.rundir import RunDir, RunDirError, RunWriteError, load_tensors, open_file
    from flatflower.tools.progress import Progress

    victim = tmp_path / "victim"
    victim.write_text("precious")
    run = RunDir(tmp_path / "run")
    for name in ("metrics.jsonl", "clients.jsonl"):
        (run.path / name).symlink_to(victim)
        with pytest.raises(RunWriteError, match=f"cannot write {run.path / name}: it is a symbolic link"):
            run.append_rows(name, [{"round": 1}])
    with pytest.raises(RunDirError, match="it is a symbolic link"):
        run.truncate_metrics(0)
    with pytest.raises(OSError, match="it is a symbolic link"):
        Progress(run.path, 3, live=False)()
    for name in ("summary.json", "checkpoint.pt"):
        (run.path / f"{name}.tmp").symlink_to(victim)
    run.write_summary({"status": "ok"})
    run.save("checkpoint.pt", {"x": torch.zeros(1)})
    (run.path / "config.json").symlink_to(victim)
    run.save("config.json", {"x": torch.zeros(1)})
    assert not (run.path / "config.json").is_symlink()
    torch.save({"x": torch.ones(1)}, tmp_path / "elsewhere.pt")
    (run.path / "model_init.pt").symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(RunDirError, match="cannot read initial model .*: it is a symbolic link"):
        load_tensors(run.path / "model_init.pt", "initial model")
    (run.path / f".{PROGRESS_FILE}.{os.getpid()}.tmp").symlink_to(victim)
    write_progress(run.path, {"round": 1})
    (run.path / PROGRESS_FILE).unlink()
    (run.path / PROGRESS_FILE).symlink_to(victim)
    assert read_progress(run.path) is None
    (run.path / "logs").mkdir()
    (run.path / "logs" / "superlink.log").symlink_to(victim)
    with pytest.raises(OSError, match="it is a symbolic link"):
        open_file(run.path / "logs" / "superlink.log", "w")
    assert victim.read_text() == "precious"
