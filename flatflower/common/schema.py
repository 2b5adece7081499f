"""Checking the structure of data read back from a file (a checkpoint's tables), so a damaged
file is refused with one line naming the first wrong field, never used half-read.

A check is a function ``check(value, where)`` that raises ValueError naming ``where`` when the
value is wrong; :func:`table` checks a dict's exact keys with one check each, so a new field is
one more keyword argument.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from flatflower.common.config import MAX_INT

Check = Callable[[Any, str], None]


def table(value: Any, where: str, **checks: Check) -> None:
    """``value`` is a dict with exactly the keys of ``checks``, each value passing its check."""
    any_table(value, where)
    missing = [k for k in checks if k not in value]
    extra = [str(k) for k in value if k not in checks]
    if missing or extra:
        raise ValueError(f"{where}: " + "; ".join(
            part for part in (missing and f"missing {', '.join(missing)}",
                              extra and f"unexpected {', '.join(extra[:5])}") if part))
    for key, check in checks.items():
        check(value[key], f"{where}.{key}")


def fields(**checks: Check) -> Check:
    """A check: a table with these fields (:func:`table`)."""
    return lambda value, where: table(value, where, **checks)


def whole(lo: int = 0, hi: int = MAX_INT) -> Check:
    """A check: an int (not a bool) in [lo, hi]."""
    def check(value: Any, where: str) -> None:
        if type(value) is not int or not lo <= value <= hi:
            raise ValueError(f"{where} must be a whole number in [{lo}, {hi}] (got {value!r:.40})")
    return check


def anything(value: Any, where: str) -> None:
    """A check that accepts any value (a field checked elsewhere)."""


def any_table(value: Any, where: str) -> None:
    """A check: a dict, whatever its keys (checked elsewhere)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} is a {type(value).__name__}, not a table")


def tensors(layout: Mapping[str, tuple[tuple[int, ...], str]], finite: bool = True) -> Check:
    """A check: a table of tensors with exactly ``layout``'s names, shapes and dtypes
    (:func:`flatflower.strategies.validation.layout_of`), finite unless ``finite`` is false."""
    def check(value: Any, where: str) -> None:
        table(value, where, **{name: anything for name in layout})
        for name, (shape, dtype) in layout.items():
            t = value[name]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{where}.{name} is a {type(t).__name__}, not a tensor")
            got = (tuple(t.shape), str(t.dtype).removeprefix("torch."))  # numpy's names too
            if got != (shape, dtype):
                raise ValueError(f"{where}.{name} has shape {list(got[0])} and dtype {got[1]}; this "
                                 f"run's model has shape {list(shape)} and dtype {dtype}")
            if finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{where}.{name} holds values that are not finite")
    return check


def printable(text: Any, limit: int = 1000) -> str:
    """``text`` for the terminal, from a file or a client: every character that is not
    printable (escape sequences, newlines, bidi controls) written as its escape, cut to
    ``limit`` characters; a file can neither rewrite the screen nor fake a line."""
    text = str(text)[:limit]
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
