"""The ``flatflower`` command: bad input before anything starts, existing and unwritable run
directories, a failed run (tests/test_bad_input.py has the full table of bad input); what the
algorithm specs generate (the docs' key tables, ``flatflower algorithms``), ``--version`` and
the wheel's contents."""

from __future__ import annotations

import re
import os
import subprocess
import sys

import pytest

from flatflower.common.config import RunConfig
from flatflower.strategies.registry import ALGORITHMS
from tests.helpers import ROOT, flower_pids
from flatflower.tools.cli import main as cli


@pytest.mark.parametrize("argv, message", [
    (["--algorithm", "fedbogus"], ", ".join(sorted(ALGORITHMS))),
    (["--set", "lr=-1"], "lr must be a finite number > 0"),
    (["--set", "sam.rho=-0.1"], "sam.rho must be a finite number >= 0"),
    (["--fraction", "0"], "fraction-train must be in (0, 1]"),
    (["--dataset", "imagenet"], "is not one of"),
    (["--set", "nonsense=1"], "unknown run-config key"),
    (["--set", "lr"], "key=value"),
    (["--clients", "0"], "--clients must be >= 1"),
    (["--partition", "pathological", "--clients", "2"], "classes"),
    (["--dataset", "cifar10", "--set", "download=false", "--set", "data-dir=\"{tmp}\""], "cifar10"),
])


def test_cli_rejects_bad_input_before_starting(tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path / "nodata")) for a in argv]
    before = flower_pids()
    code = cli(["local", *argv, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert flower_pids() - before == set()


def test_cli_refuses_to_overwrite_a_run(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"round": 0}\n')
    assert cli(["simulate", "--engine", "inprocess", "--run-dir", str(tmp_path / "r")]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == '{"round": 0}\n'


def test_cli_reports_a_failed_run_with_nonzero_exit(tmp_path, capsys):
    """Pass/fail comes from the `flwr ls` status, not from `flwr run`'s exit code."""
    from flatflower.tools.progress import EXIT_FAILED, Progress, finish

    cfg = RunConfig.from_mapping({"run-dir": str(tmp_path)})
    code = finish(cfg, False, Progress(tmp_path, 3), "ServerApp failed with exception: boom")
    assert code == EXIT_FAILED
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: run failed: ServerApp failed with exception: boom")
    assert str(tmp_path) in err[0]


def test_cli_unwritable_run_dir_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    code = cli(["simulate", "--engine", "inprocess", "--run-dir", str(tmp_path / "file" / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err


# ---------------------------------------------------------------- what the specs generate
def test_docs_key_table_is_flatflower_algorithms_markdown(capsys):
    """docs/algorithms.md's table of every algorithm's records and keys is the command's output."""
    from flatflower.tools.commands import algorithm_table

    text = (ROOT / "docs" / "algorithms.md").read_text()
    block = text.split("<!-- algorithms:begin (flatflower algorithms --markdown) -->\n", 1)[1]
    assert block.split("\n<!-- algorithms:end -->", 1)[0] == algorithm_table(markdown=True), \
        "regenerate: flatflower algorithms --markdown"
    assert cli(["algorithms", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == algorithm_table(markdown=True)


def test_configuration_doc_lists_every_general_key_with_its_default_and_no_algorithm_key():
    """docs/configuration.md's key table: every general key of RunConfig, each with the
    default the code has, and no algorithm key (those are `flatflower algorithms`')."""
    from flatflower.common.config import algorithm_keys, general_fields

    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("## General keys", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    listed = {}
    for keys, defaults in rows:
        names = re.findall(r"`([a-z][a-z0-9.-]*)`", keys)
        values = [re.sub(r"\s*\(.*\)$", "", v.strip()).strip("`") for v in defaults.split(", ")]
        assert len(values) == len(names), (names, defaults)
        listed.update(zip(names, values))
    fields = general_fields()
    assert set(fields) <= set(listed), sorted(set(fields) - set(listed))
    assert not set(listed) & set(algorithm_keys()), "algorithm keys belong to `flatflower algorithms`"
    for key, field in fields.items():
        shown = listed[key]
        code = field.default
        if isinstance(code, bool):
            assert shown == str(code).lower(), (key, shown, code)
        elif isinstance(code, (int, float)):
            assert float(shown) == code, (key, shown, code)
        else:
            assert shown == (code or '""'), (key, shown, code)


def test_algorithms_lists_each_algorithm_with_its_keys_and_meanings(capsys):
    assert cli(["algorithms"]) == 0
    out = capsys.readouterr().out
    for name in ALGORITHMS:
        assert f"\n{name}: " in f"\n{out}", name
    assert "fedtoga.kappa = 1.0    correction kappa of the perturbation by Delta" in out


def test_version_names_flatflower_flower_and_torch(capsys):
    with pytest.raises(SystemExit) as done:
        cli(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"flatflower \S+ \(flwr 1\.39\.0, torch \S+\)\n", out), out


def test_a_wheel_carries_the_presets_and_the_commands(tmp_path):
    """A non-editable install gets everything the commands need: every package, the presets
    (package data) and both console scripts, all under the one top-level package flatflower
    (nothing named common/ or tools/ in site-packages to shadow or be shadowed)."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("flatflower-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    presets = sorted(p.name for p in (ROOT / "tools" / "presets").glob("*.toml"))
    assert presets and all(f"flatflower/tools/presets/{p}" in names for p in presets)
    for package in ("client", "common", "server", "strategies", "runtime", "tools"):
        assert f"flatflower/{package}/__init__.py" in names, package
    assert {n.split("/")[0] for n in names} == {"flatflower", wheel.name.split("-py")[0] + ".dist-info"}
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert b"flatflower = flatflower.tools.cli:entry" in entry_points and b"flatflower-worker = flatflower.runtime.worker:main" in entry_points


@pytest.mark.parametrize("command", ["presets", "algorithms"])
@pytest.mark.slow
def test_output_into_a_closed_pipe_ends_quietly_as_a_shell_reports_sigpipe(command):
    """`flatflower presets | head -1`: the reader goes away; the command ends with 141 (128 +
    SIGPIPE) and says nothing, instead of `error: [Errno 32] Broken pipe` and exit code 2."""
    proc = subprocess.Popen([sys.executable, "-m", "flatflower.tools.cli", command], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command writes a byte
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == b"", err.decode()


def test_the_flower_app_ships_its_code_only_whatever_lies_in_the_checkout(tmp_path):
    """`flwr run .`, `flatflower local` and Ray `simulate` ship the app directory as a FAB:
    a sweep or run directories written into the checkout (as the README's examples do) are
    never packed (they made Flower refuse the run over 10 MB, or shipped them to every node)."""
    import zipfile
    from io import BytesIO

    from flwr.cli.build import build_fab_from_disk

    app = tmp_path / "app"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for name in tracked:
        if (ROOT / name).is_file():
            (app / name).parent.mkdir(parents=True, exist_ok=True)
            (app / name).write_bytes((ROOT / name).read_bytes())
    for junk in ("sweep-digits/fedavg-s0", "runs/fedsam-digits-s0"):
        (app / junk).mkdir(parents=True)
        (app / junk / "metrics.jsonl").write_text('{"round": 0}\n' * 1_000_000)  # 13 MB
        (app / junk / "config.json").write_text("{}")
    shipped = sorted(zipfile.ZipFile(BytesIO(build_fab_from_disk(app))).namelist())
    code = sorted(n for n in tracked if n.startswith("flatflower/")  # the code, once: the root's folders are links
                  and (n.endswith(".py") or n.startswith("flatflower/tools/presets/")))
    assert shipped == sorted([".info/CONTENT", "pyproject.toml", *code])


def test_every_set_example_in_the_help_is_accepted():
    """The help's `--set KEY=VALUE` examples are valid run-config keys and values (it showed
    `--set rho=0.05`, which is refused: the key is sam.rho)."""
    from flatflower.common.config import parse_assignments
    from flatflower.tools.cli import build_parser
    from flatflower.tools.sweep import build_parser as sweep_parser

    parser = build_parser()
    helps = [parser.format_help(), sweep_parser().format_help()]
    helps += [sub.format_help() for action in parser._subparsers._group_actions
              for sub in action.choices.values()]
    examples = {m for text in helps for m in re.findall(r"--set\s+([a-z][\w.-]*=[^\s)]+)", " ".join(text.split()))}
    assert "sam.rho=0.05" in examples
    for example in examples:
        RunConfig.from_mapping(parse_assignments([example]))


def test_the_top_level_help_names_every_simulation_engine(capsys):
    with pytest.raises(SystemExit):
        cli(["--help"])
    simulate = next(line for line in " ".join(capsys.readouterr().out.split()).split("simulate ")[1:]
                    if line.startswith("run on"))
    assert all(engine in simulate for engine in ("Ray", "inprocess", "vectorized"))


def test_run_elapsed_is_formatted():
    from flatflower.runtime.engines import seconds_text

    assert seconds_text("31.795824") == "31.8s" and seconds_text(31.795824) == "31.8s"
    assert seconds_text("?") == "?" and seconds_text("\x1b[2J") == "\\x1b[2J"


def test_a_run_whose_clients_outlive_it_exits_with_its_own_code(tmp_path):
    """In-process, the server stops waiting for a client after round-timeout, but its thread
    computes on: finalising the interpreter under it aborted the process (exit 134, "terminate
    called without an active exception") instead of the run's exit code 1."""
    env = {**os.environ, "FLWR_HOME": str(tmp_path / ".flwr")}
    proc = subprocess.run([sys.executable, "-m", "flatflower.tools.cli", "simulate", "-a", "fedavg", "-n", "2",
                           "-r", "1", "--dataset", "digits", "--set", "round-timeout=1", "--set",
                           "local-epochs=500", "--run-dir", str(tmp_path / "r")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "every round (1-1) was skipped" in proc.stderr and "terminate called" not in proc.stderr
