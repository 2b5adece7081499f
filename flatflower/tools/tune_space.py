"""A tune's search space: the keys ``flatflower tune`` searches for one algorithm, and their ranges.

Each tunable key declares its range beside its definition (:class:`flatflower.common.params.Range`
in the ``key(...)`` of an algorithm's half, ``search`` metadata on a general key of
:class:`flatflower.common.config.RunConfig` such as ``lr``), with its paper's searched range
where the paper gives one. An algorithm's space is the general ranges plus those of the keys
its two halves read. A TOML file (``flatflower tune --space FILE``) changes it, per algorithm
(``[fedsam]``) or for all (``[all]``; an algorithm's own table wins)::

    [all]
    lr = { low = 0.01, high = 0.3, log = true }    # a new range
    [fedtoga]
    "fedtoga.kappa" = 1.0                           # fixed: not tuned, this value
    "fedtoga.beta" = false                          # not tuned: its default (or the run's --set)

Every problem (an unknown key, an empty range, a range the key's own check refuses at either
end, a space left with nothing to tune) is a :class:`SpaceError`, one line, before anything runs.
This module imports no PyTorch (the CLI checks a space before it loads an engine).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flatflower.common.config import ConfigError, RunConfig, algorithm_params, did_you_mean, general_fields
from flatflower.common.params import Range

ALL = "all"  # the space file's table for every algorithm


class SpaceError(ValueError):
    """A search space that cannot be searched, said in one line."""


@dataclass(frozen=True)
class Space:
    """What one algorithm's tune searches (``ranges``: key -> range) and what it fixes
    (``fixed``: key -> value, from the space file)."""

    algorithm: str
    ranges: dict[str, Range]
    fixed: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """The space as data (the tune's records): key -> {low, high, log, integer} or its fixed value."""
        return {**{k: {"low": r.low, "high": r.high, "log": r.log, "integer": r.integer}
                   for k, r in self.ranges.items()},
                **{k: {"fixed": v} for k, v in self.fixed.items()}}

    def suggest(self, trial: Any) -> dict[str, Any]:
        """One point of the space, drawn by an Optuna ``trial``, with the fixed keys."""
        drawn = {k: (trial.suggest_int(k, int(r.low), int(r.high), log=r.log) if r.integer else
                     trial.suggest_float(k, r.low, r.high, log=r.log)) for k, r in self.ranges.items()}
        return {**self.fixed, **drawn}


def declared(algorithm: str) -> dict[str, Range]:
    """The ranges declared beside the keys ``algorithm`` reads: the general keys' (``lr``),
    then its params' in declaration order."""
    general = {k: f.metadata["search"] for k, f in general_fields().items() if f.metadata.get("search")}
    own = {k: f.metadata["search"] for k, f in algorithm_params()[algorithm].fields().items()
           if f.metadata.get("search")}
    return {**general, **own}


def read_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """A space file's tables (``[all]``, ``[<algorithm>]``); SpaceError for a file that is
    not there or not TOML, or a table that names no algorithm."""
    import tomllib

    try:
        tables = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise SpaceError(f"search space file {str(path)!r}: {err.strerror or err}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise SpaceError(f"search space file {str(path)!r} is not TOML: {err}") from None
    known = (ALL, *algorithm_params())
    for name, table in tables.items():
        if name not in known:
            raise SpaceError(f"search space file {str(path)!r}: [{name}] is neither [all] nor an algorithm"
                             f"{did_you_mean(name, known)}")
        if not isinstance(table, dict):
            raise SpaceError(f"search space file {str(path)!r}: {name} must be a table ([{name}])")
    return tables


def space_for(algorithm: str, overrides: Mapping[str, Mapping[str, Any]] | None = None,
              base: Mapping[str, Any] | None = None) -> Space:
    """``algorithm``'s space: its declared ranges changed by ``overrides`` (a space file's
    tables), each range checked at both ends against the key's own check (with the run's
    other values ``base``: the ``--set`` keys and flags). SpaceError on any problem."""
    overrides = overrides or {}
    keys = set(general_fields()) | set(algorithm_params()[algorithm].fields())
    ranges, fixed = declared(algorithm), {}
    for table in (overrides.get(ALL, {}), overrides.get(algorithm, {})):
        for k, value in table.items():
            if k not in keys:
                raise SpaceError(f"search space of {algorithm}: {k!r} is not a key {algorithm} reads"
                                 f"{did_you_mean(k, keys)}")
            ranges.pop(k, None)
            fixed.pop(k, None)
            if isinstance(value, dict):
                ranges[k] = _range(algorithm, k, value)
            elif value is not False:
                fixed[k] = value
    for k, r in ranges.items():
        for end in (r.low, r.high):
            _check_value(algorithm, k, end, base, f"its range's end {end!r}")
    for k, v in fixed.items():
        _check_value(algorithm, k, v, base, f"its fixed value {v!r}")
    if not ranges:
        raise SpaceError(f"search space of {algorithm}: nothing left to tune (every key fixed or turned off)")
    return Space(algorithm, ranges, fixed)


def _range(algorithm: str, k: str, table: Mapping[str, Any]) -> Range:
    extra = set(table) - {"low", "high", "log", "integer"}
    if extra or not {"low", "high"} <= set(table):
        raise SpaceError(f"search space of {algorithm}: {k} = {{...}} takes low, high and optionally log, "
                         f"integer (got {', '.join(sorted(table)) or 'nothing'})")
    low, high = table["low"], table["high"]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (low, high)) or \
            not all(isinstance(table.get(b, False), bool) for b in ("log", "integer")):
        raise SpaceError(f"search space of {algorithm}: {k}: low and high must be numbers, log and integer "
                         "true or false")
    r = Range(float(low), float(high), table.get("log", False), table.get("integer", False))
    if problem := r.problem():
        raise SpaceError(f"search space of {algorithm}: {k}: {problem}")
    if r.integer and not (float(low).is_integer() and float(high).is_integer()):
        raise SpaceError(f"search space of {algorithm}: {k}: an integer range needs whole-number ends")
    return r


def _check_value(algorithm: str, k: str, value: Any, base: Mapping[str, Any] | None, what: str) -> None:
    """SpaceError when the run config refuses ``k = value`` for ``algorithm``."""
    examples = algorithm_params()[algorithm].examples()  # a required key (fedgf.threshold) needs a value
    try:
        RunConfig.from_mapping({**examples, **(base or {}), "algorithm": algorithm, k: value})
    except ConfigError as err:
        reason = str(err).removeprefix("invalid run config: ")
        raise SpaceError(f"search space of {algorithm}: {k}: {what} is refused: {reason}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise SpaceError(f"search space of {algorithm}: {k}: {what} is not finite")
