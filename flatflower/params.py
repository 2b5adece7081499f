"""The vocabulary of an algorithm's run-config keys, for your own algorithm (docs/own-algorithm.md):
declare each half's keys as a frozen dataclass deriving from :class:`Params`, each field a
:func:`key` with its run-config name (``namespace.key``), default, meaning, check and search range."""

from flatflower.common.params import (FRACTION, NONNEGATIVE, POSITIVE, UNIT, Check, Params, Range, key, one_of,
                                      required_key)

__all__ = ["FRACTION", "NONNEGATIVE", "POSITIVE", "UNIT", "Check", "Params", "Range", "key", "one_of",
           "required_key"]
