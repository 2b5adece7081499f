"""``flatflower --help``, every subcommand's ``--help`` and every argument error answer before
PyTorch is imported (issue 43: they took 6-37 s, each mistyped flag as long as a run's start).

One child process (a fresh interpreter: this one has torch loaded long ago) calls
``flatflower.tools.cli.main`` on each command line in turn and records its exit code, its stderr and
whether torch, NumPy, Flower, matplotlib or Ray were imported by then. No timing is asserted: what the answer
costs is what it imports (`python -X importtime -c "import flatflower.tools.cli"`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numpy", "flwr", "matplotlib", "ray")

SUBCOMMANDS = ("local", "simulate", "report", "landscape", "bench", "sweep", "flatness", "presets", "data",
               "algorithms", "certs", "check-algorithm")
# (command line, exit code): --help and --version exit 0, argument errors 2
CASES = [(["--help"], 0), (["--version"], 0), *(([name, "--help"], 0) for name in SUBCOMMANDS),
         (["frobnicate"], 2), ([], 2), (["simulate", "--no-such-flag"], 2), (["local", "--rounds", "two"], 2),
         (["simulate", "--engine", "threads"], 2), (["certs", "out"], 2), (["report"], 2),
         (["report", "r", "--last-k", "0"], 2), (["landscape", "r", "--dims", "3"], 2),
         (["bench", "--classes", "x"], 2), (["sweep", "--algorithms", "fedavg"], 2),
         (["flatness", "r", "--hvp", "x"], 2), (["algorithms", "--json", "--markdown"], 2),
         (["check-algorithm"], 2), (["check-algorithm", "fedavg", "--engines", "threads"], 2),
         (["check-algorithm", "fedavg", "--rounds", "1"], 2)]

CHILD = f"""
import contextlib, io, json, sys
from flatflower.tools.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append([code, [m for m in {HEAVY!r} if m in sys.modules], err.getvalue()])
print(json.dumps(results))
"""


def answers(argvs: list[list[str]]) -> list[tuple[int, list[str], str]]:
    """(exit code, the heavy modules imported so far, stderr) of ``flatflower ARGV`` for each
    ARGV in turn, in one new interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argvs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(r) for r in json.loads(done.stdout.splitlines()[-1])]


def test_help_and_argument_errors_import_no_torch():
    failures = []
    for (argv, expected), (code, heavy, err) in zip(CASES, answers([argv for argv, _ in CASES])):
        if code != expected or heavy:
            failures.append(f"flatflower {' '.join(argv)}: exit {code} (expected {expected}), imported {heavy}")
        if expected == 2:  # an argument error: one line, pointing to --help
            lines = [line for line in err.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: ") and "--help" in lines[0], (argv, err)
    assert not failures, "\n".join(failures)


def test_a_command_still_loads_what_it_runs():
    """The other side: once its arguments parse, a command imports what it needs (here the
    algorithm table, from the registry), so the test above is not passing by running nothing."""
    (code, heavy, _), = answers([["algorithms"]])
    assert code == 0 and "torch" in heavy
