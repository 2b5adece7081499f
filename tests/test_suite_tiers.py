"""The two tiers of the suite (CONTRIBUTING.md, "Tests"): `make test` runs every test but those marked
``slow``, `make test-slow` runs those alone, and CI (`.ci/run`) runs both, so nothing in
tests/ is left out of CI; a real loopback deployment stays in `make test`."""

from __future__ import annotations

import re
import shlex

from tests.helpers import ROOT


def _recipe(target: str) -> list[str]:
    """The words of the pytest command of a Makefile target."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n\t([^\n]*pytest[^\n]*)$", text, re.M)
    assert match, f"no pytest recipe for make {target}"
    return shlex.split(match.group(1))


def _marker_expression(words: list[str]) -> str | None:
    args = words[words.index("pytest") + 1:]  # after `python -m pytest`
    return args[args.index("-m") + 1] if "-m" in args else None


def test_make_test_and_make_test_slow_split_the_suite_and_ci_runs_both():
    fast, slow, everything = _recipe("test"), _recipe("test-slow"), _recipe("test-all")
    assert _marker_expression(fast) == "not slow"
    assert _marker_expression(slow) == "slow"
    assert _marker_expression(everything) is None
    for words in (fast, slow, everything):  # same selection of files and workers otherwise
        assert words[-1] == "tests" and "-n" in words and "loadgroup" in words
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip().startswith("make ")]
    assert steps == ["make test", "make test-slow"]


def _marks(test) -> set[str]:
    """The names of a test function's ``pytest.mark.*`` decorators (pytest keeps them on it)."""
    return {mark.name for mark in getattr(test, "pytestmark", [])}


def test_make_test_keeps_a_real_loopback_deployment():
    """FedLESAM-S over a real SuperLink and SuperNodes, against its in-process model."""
    from tests.test_engines import test_real_deployment_runs_fedlesam_s_and_matches_inprocess as kept

    assert "integration" in _marks(kept) and "slow" not in _marks(kept)


def test_the_slow_marker_is_registered_and_used(pytestconfig):
    from tests.test_reliability import test_restarted_supernode_keeps_its_identity_and_client_state as slow

    assert any(line.startswith("slow:") for line in pytestconfig.getini("markers"))
    assert "slow" in _marks(slow)
