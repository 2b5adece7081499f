"""Reading a run directory's JSON files for the analysis commands (``report``, ``flatness``,
``landscape``, ``sweep``): anything that is not what flatflower writes is one
:class:`RunFileError` line naming the file (and line), never a traceback.

A run directory may be damaged (a full disk, a copy cut short), edited by hand, or handed
over by someone else: binary garbage, text that is not UTF-8, JSON nested a million deep
(Python's parser would raise RecursionError), NaN or Infinity (which flatflower never writes:
it writes null), numbers beyond any float, values of the wrong type, missing keys. The last
line of a JSON-lines file that does not parse is the line a running run is writing: skipped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from flatflower.common.schema import printable

MAX_WHOLE = 2**53  # beyond this an int is no count flatflower wrote (and no float holds it exactly)


class RunFileError(ValueError):
    """A run file is unreadable or not what flatflower writes (one line)."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number flatflower writes (it writes null)")


def _infinity(name: str) -> float:
    if name == "NaN":
        _no_constant(name)
    return math.inf if name == "Infinity" else -math.inf


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is beyond any float")
    return value


def parse(text: str, infinity: bool = False) -> Any:
    """``json.loads`` that refuses NaN, and Infinity and floats beyond any float unless
    ``infinity`` (config.json: a run-config value may be infinite, e.g. ``fedgf.threshold``);
    ValueError, also for JSON nested too deep to parse."""
    try:
        if infinity:
            return json.loads(text, parse_constant=_infinity)
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_text(path: Path) -> str:
    """The file's text (RunFileError: unreadable, or not UTF-8 text), never through a link."""
    from flatflower.server.rundir import open_file

    try:
        with open_file(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise RunFileError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise RunFileError(f"{path} is not UTF-8 text (binary or damaged)") from None


def read_json(path: Path, infinity: bool = False) -> Any:
    try:
        return parse(read_text(path), infinity)
    except RunFileError:
        raise
    except ValueError as err:
        raise RunFileError(f"{path} is not valid JSON ({printable(err, 120)})") from None


def read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """(line number, value) of each non-blank line; a last line without its newline that does
    not parse is being written and skipped; any other line that does not parse is refused."""
    text = read_text(path)
    lines = text.split("\n")
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((number, parse(line)))
        except ValueError as err:
            if number == len(lines):  # no newline after it: being written
                continue
            raise RunFileError(f"{path}, line {number}: not a JSON line flatflower writes "
                               f"({printable(err, 120)})") from None
    return out


def table(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise RunFileError(f"{where}: not a JSON object (a {type(value).__name__})")
    return value


def whole(row: dict, key: str, where: str, default: Any = None) -> Any:
    """``row[key]``: an int in [0, MAX_WHOLE] (``default`` when absent or null)."""
    value = row.get(key)
    if value is None:
        return default
    if type(value) is not int or not 0 <= value <= MAX_WHOLE:
        raise RunFileError(f"{where}: {key} is {printable(repr(value), 60)}, not a whole number in "
                           f"[0, {MAX_WHOLE}]")
    return value


def number(row: dict, key: str, where: str, lo: float = -math.inf, hi: float = math.inf) -> float | None:
    """``row[key]``: a finite number in [lo, hi], or None when absent or null."""
    value = row.get(key)
    if value is None:
        return None
    try:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= float(value) <= hi
    except OverflowError:
        ok = False
    if not ok or not math.isfinite(float(value)):
        raise RunFileError(f"{where}: {key} is {printable(repr(value), 60)}, not a finite number"
                           + (f" in [{lo:g}, {hi:g}]" if math.isfinite(lo) or math.isfinite(hi) else ""))
    return float(value)
