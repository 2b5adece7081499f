"""The README and the guides of docs/ say what the code does: every count and table that can
drift is checked against the code (algorithms, presets, the time claims), and every command
of the README runs as written, up to the point where it would start a run: its arguments
parse, its config resolves (the dry run of `flatflower simulate` / `local`), and every file,
folder, preset, algorithm, key and run directory it names exists or was made by an earlier
command. The examples' own commands run for real in tests/test_examples.py; the docs of
deployment and local data have theirs checked in tests/test_docker.py and
tests/test_local_data.py."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex

import pytest

from flatflower.common.references import is_reference
from flatflower.strategies.registry import ALGORITHMS
from tests.helpers import ROOT, markdown_section as section

README = ROOT / "README.md"
DOCS = ROOT / "docs"
# the guides a reader reaches from the README; their `flatflower` lines must parse too
GUIDES = ("configuration", "engines", "presets", "run-directory", "datasets", "flatness", "privacy",
          "sweeps", "reliability", "your-data", "models", "local-data", "deployment", "api", "protocol",
          "own-algorithm", "check-algorithm")
OWN_PARSERS = {"report": "flatflower.tools.report", "landscape": "flatflower.tools.landscape", "bench": "flatflower.tools.bench",
               "sweep": "flatflower.tools.sweep", "flatness": "flatflower.tools.flatness_cmd",
               "tune": "flatflower.tools.tune", "check-algorithm": "flatflower.tools.conformance"}




def shell_blocks(text: str) -> list[list[list[str]]]:
    """Each ```bash block's command lines, continuations joined, comments dropped, as words."""
    return [[words for line in block.replace("\\\n", " ").splitlines() if (words := shlex.split(line, comments=True))]
            for block in re.findall(r"^ *```bash\n(.*?)^ *```$", text, re.M | re.S)]


def shell_lines(text: str) -> list[list[str]]:
    """The command lines of the ```bash blocks, as words."""
    return [words for block in shell_blocks(text) for words in block]


def parse(args: list[str]) -> tuple[str, argparse.Namespace]:
    """(subcommand, namespace) as ``flatflower`` would parse ``args``; a failure is the test's."""
    command = args[0]
    if command in OWN_PARSERS:
        parser = importlib.import_module(OWN_PARSERS[command]).build_parser()
        rest = args[1:]
    else:
        from flatflower.tools.cli import build_parser

        parser, rest = build_parser(), args
    try:
        return command, parser.parse_args(rest)
    except SystemExit as err:
        raise AssertionError(f"`flatflower {shlex.join(args)}` does not parse") from err


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]


# ---------------------------------------------------------------- the front door
def test_readme_is_a_front_door_of_at_most_300_lines_whose_links_exist():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for doc in [README, *(DOCS / f"{g}.md" for g in GUIDES), ROOT / "CONTRIBUTING.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"[a-z]+://", target):
                assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
    for guide in GUIDES:
        assert f"docs/{guide}.md" in text, f"the README does not lead to docs/{guide}.md"


def test_readme_algorithm_table_is_the_registry():
    """Every registered algorithm once, with its gradient passes per step, its extra forward
    passes and whether its clients keep state (the columns the registry knows)."""
    rows = [r for r in table_rows(section(README.read_text(), "## The algorithms")) if r[1] != "`algorithm =`"]
    seen = []
    for paper, names, down, up, keeps, passes in rows:
        for name in re.findall(r"`([a-z0-9-]+)`", names):
            spec = ALGORITHMS[name] if name in ALGORITHMS else pytest.fail(f"README lists unknown {name}")
            seen.append(name)
            assert int(passes.split()[0]) == spec.passes, (name, passes)
            assert ("forward" in passes) == bool(spec.forwards), (name, passes)
            assert keeps.startswith("—") == (not spec.state), (name, keeps)
    assert sorted(seen) == sorted(ALGORITHMS), set(ALGORITHMS) ^ set(seen)


def test_no_doc_states_another_number_of_algorithms():
    for doc in [README, ROOT / "CONTRIBUTING.md", *DOCS.glob("*.md")]:
        for count in re.findall(r"\b[Aa]ll (\d+) algorithms", doc.read_text()):
            assert int(count) == len(ALGORITHMS), f"{doc.name} says all {count} algorithms"


def test_preset_table_is_generated_from_the_presets():
    from flatflower.tools.presets import available, markdown_table

    text = (DOCS / "presets.md").read_text()
    block = text.split("<!-- presets:begin (flatflower.tools.presets.markdown_table) -->\n", 1)[1]
    assert block.split("\n<!-- presets:end -->", 1)[0] == markdown_table(), \
        'regenerate: python -c "from flatflower.tools.presets import markdown_table; print(markdown_table())"'
    assert len(table_rows(markdown_table())) == len(available()) + 1  # + the header


def test_test_times_are_stated_in_one_place():
    """`make test`'s time is measured once and stated once (CONTRIBUTING.md, "Tests"); the
    README, the Makefile and the other docs point there."""
    duration = re.compile(r"`?make test`?(?![-\w])[^.\n]{0,60}?\b\d+(?:[.,]\d+)?(?:-\d+)? ?(?:min|minutes|s)\b")
    places = []
    for doc in [README, ROOT / "CONTRIBUTING.md", ROOT / "Makefile", *DOCS.glob("*.md")]:
        text = doc.read_text()
        for match in duration.finditer(" ".join(text.split())):
            places.append((doc.name, match.group(0)))
    assert places and {name for name, _ in places} == {"CONTRIBUTING.md"}, places
    tests = section((ROOT / "CONTRIBUTING.md").read_text(), "## Tests")
    assert all(m in " ".join(tests.split()) for _, m in places)


# ---------------------------------------------------------------- every command runs as written
def produced_runs(lines: list[list[str]]) -> set[str]:
    """The run directories the commands make: --run-dir of a run, OUT/<algorithm>-s<seed> of a sweep."""
    out = set()
    for words in lines:
        if words[0] != "flatflower" or len(words) < 2:
            continue
        command, args = parse(words[1:])
        if command in ("simulate", "local") and args.run_dir:
            out.add(str(args.run_dir))
        if command == "sweep":
            out |= {f"{args.out}/{a}-s{s}" for a in args.algorithms.split(",") for s in args.seeds.split(",")}
    return out


def test_every_readme_command_parses_resolves_and_names_what_exists(tmp_path, monkeypatch):
    from flatflower.common.config import algorithm_keys, general_fields
    from flatflower.tools.presets import find_preset
    from flatflower.tools.prepare import resolve_config

    blocks = shell_blocks(README.read_text())
    made = produced_runs([words for block in blocks for words in block])
    known_keys = set(general_fields()) | set(algorithm_keys())
    cwd, checked = ROOT, 0
    for words, first in ((w, j == 0) for block in blocks for j, w in enumerate(block)):
        if first:  # each block starts from the checkout's root
            cwd = ROOT
        if words[0] == "cd":
            cwd = (cwd / words[1]).resolve()
            assert cwd.is_dir(), f"README: cd {words[1]}: no such folder"
            continue
        if words[0] == "python" and words[1].endswith(".py"):
            assert (cwd / words[1]).is_file(), f"README: {cwd / words[1]} is missing"
            continue
        if words[0] != "flatflower":
            continue
        command, args = parse(words[1:])
        checked += 1
        for name in (getattr(args, "algorithms", "") or "").split(",") + [getattr(args, "algorithm", None)]:
            assert not name or name in ALGORITHMS or (  # a user's algorithm: its module in the folder
                is_reference(name) and (cwd / f"{name.split(':')[0]}.py").is_file()), f"README: unknown algorithm {name}"
        if getattr(args, "preset", None):
            find_preset(args.preset)  # a PresetError names what is missing
        for assignment in getattr(args, "sets", None) or []:
            assert assignment.split("=", 1)[0] in known_keys, f"README: unknown key in --set {assignment}"
        model = getattr(args, "model", None) or ""
        if ":" in model:
            assert (cwd / f"{model.split(':')[0]}.py").is_file(), f"README: model {model} is not in {cwd}"
        for run in [*getattr(args, "run_dirs", []), *([args.run_dir] if command == "flatness" else [])]:
            assert run in made, f"README: `flatflower {command}` reads {run}, which no command before it makes"
        if command in ("simulate", "local"):  # the dry run: the config resolves, nothing starts
            monkeypatch.chdir(cwd)
            args.run_dir = str(tmp_path / f"run{checked}")
            cfg = resolve_config(args)
            assert cfg.algorithm in ALGORITHMS
        if str(cwd).startswith(str(ROOT / "examples")) and command in ("simulate", "local"):
            example = cwd.relative_to(ROOT / "examples").parts[0]
            theirs = [w for w in shell_lines((ROOT / "examples" / example / "README.md").read_text())]
            assert words in theirs, f"README runs `{shlex.join(words)}`, which examples/{example}/README.md " \
                "(run by tests/test_examples.py) does not"
    assert checked >= 10


@pytest.mark.parametrize("guide", GUIDES)
def test_every_flatflower_line_of_the_guides_parses(guide):
    lines = [w for w in shell_lines((DOCS / f"{guide}.md").read_text()) if w[0] == "flatflower" and len(w) > 1]
    for words in lines:
        command, args = parse(words[1:])
        for name in (getattr(args, "algorithms", "") or "").split(",") + [getattr(args, "algorithm", None)]:
            assert not name or name in ALGORITHMS or is_reference(name), f"{guide}.md: unknown algorithm {name}"


def test_the_flatness_and_landscape_examples_read_runs_their_sweeps_make():
    """The loss-landscape examples name the runs of a sweep shown in the docs (not run names
    that no command makes)."""
    texts = [README.read_text(), *(p.read_text() for p in DOCS.glob("*.md"))]
    made = produced_runs([w for t in texts for w in shell_lines(t) if w[0] == "flatflower" and len(w) > 1])
    text = (DOCS / "flatness.md").read_text()
    for words in shell_lines(text):
        if words[:2] in (["flatflower", "landscape"], ["flatflower", "flatness"]):
            _, args = parse(words[1:])
            for run in getattr(args, "run_dirs", None) or [args.run_dir]:
                if run != "RUN_DIR" and "*" not in run:
                    assert run in made, f"flatness.md reads {run}, which no documented command makes"


def test_the_documented_misspelling_hint_is_the_one_the_config_gives():
    from flatflower.common.config import ConfigError, RunConfig

    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping({"algorithm": "fedsma"})
    hint = re.search(r"\(did you mean '[^']+'\?\)", str(err.value)).group(0)
    text = " ".join((DOCS / "configuration.md").read_text().split())
    assert re.findall(r"algorithm='fedsma' is not one of: \.\.\. (\(did you mean '[^']+'\?\))", text) == [hint]


def test_the_readmes_python_runs_as_written(tmp_path, monkeypatch):
    """The README's ```python blocks (its "From Python" section) run as written, in a fresh
    working directory (their runs land in its runs/)."""
    blocks = [b.split("```", 1)[0] for b in README.read_text().split("```python\n")[1:]]
    assert blocks, "the README shows no Python"
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert namespace["result"].summary["status"] == "completed"
    assert len(namespace["names"]) == len(ALGORITHMS)
