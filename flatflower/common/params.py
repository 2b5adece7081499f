"""An algorithm's hyperparameters, owned by the half that reads them (torch.optim's rule).

Each half of an algorithm declares the run-config keys it reads as a small frozen dataclass,
its ``Params`` class attribute, in its own file: the client half in client/algorithms/x.py,
the server half in strategies/x.py. A key both halves read is declared by the client half and
the server's ``Params`` extends that class. Fields are run-config keys in the algorithm's
namespace (``fedtoga.alpha``; Flower flattens a ``[tool.flwr.app.config.fedtoga]`` table into
such dotted keys), each declared with :func:`key`: its run-config name, default, meaning and
check. Families share fields by inheritance: :class:`flatflower.client.sam.SAMParams` gives every
SAM-family algorithm ``sam.rho``. The registry (strategies/registry.py) joins an algorithm's
two classes into one (:func:`combine`) for parsing and checking the run config; each half then
receives only its own view of it (:meth:`Params.view`). Derived values (FedTOGA's coefficient)
are methods; checks that involve other keys override :meth:`Params.problems`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_type_hints


@dataclass(frozen=True)
class Check:
    """A predicate on a value and how a message says it: ``must be <text>``."""

    ok: Callable[[Any], bool]
    text: str


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


POSITIVE = Check(lambda x: _finite(x) and x > 0, "a finite number > 0")
NONNEGATIVE = Check(lambda x: _finite(x) and x >= 0, "a finite number >= 0")
FRACTION = Check(lambda x: _finite(x) and 0 <= x < 1, "in [0, 1)")
UNIT = Check(lambda x: _finite(x) and 0 <= x <= 1, "in [0, 1]")


def one_of(*choices: str) -> Check:
    return Check(lambda x: x in choices, "one of: " + ", ".join(sorted(choices)))


@dataclass(frozen=True)
class Range:
    """A tunable key's search range for ``flatflower tune`` (tools/tune_space.py): ``low`` to
    ``high``, sampled on a log scale when ``log`` (for a step size or a radius, whose useful
    values span decades), whole numbers when ``integer``. Declared beside the key it tunes,
    with the range its paper searched where the paper gives one."""

    low: float
    high: float
    log: bool = False
    integer: bool = False

    def problem(self) -> str | None:
        """What is wrong with the range itself (None: nothing)."""
        if not (_finite(self.low) and _finite(self.high)) or self.low >= self.high:
            return f"an empty or non-finite range [{self.low!r}, {self.high!r}] (low must be < high)"
        if self.log and self.low <= 0:
            return f"a log-scale range must stay above 0 (low = {self.low!r})"
        return None


def key(name: str, default: Any, meaning: str, check: Check | None = None, search: Range | None = None) -> Any:
    """A params field: run-config key ``name`` (``namespace.key``) with its default, what it
    means (``flatflower algorithms`` and the docs show it), its check and, for a key worth
    tuning, its search range (:class:`Range`)."""
    return dataclasses.field(default=default, metadata={"key": name, "meaning": meaning, "check": check,
                                                        "search": search})


UNSET = float("nan")  # the value of a required key the run did not set
PLACEHOLDER = ""  # a required key's value in pyproject.toml: Flower's run config must hold every key
# (it refuses overrides of keys it lacks) and cannot hold NaN (Flower compares a Context's run
# config before and after a ClientApp call, and NaN != NaN reads as a modification)


def required_key(name: str, meaning: str, check: Check, example: float, search: Range | None = None) -> Any:
    """A float params field with no default: a run of the algorithm must set it (FedGF's T_D,
    whose authors' value is unknown). Unset it is :data:`UNSET`, and the run config (Flower's,
    pyproject.toml) holds :data:`PLACEHOLDER` for it, so every other algorithm's run config stays
    valid. ``example``: a value that runs every path of the algorithm, for what runs every
    algorithm (``flatflower bench``, the tests); not a recommendation."""
    return dataclasses.field(default=UNSET, metadata={"key": name, "meaning": meaning, "check": check,
                                                      "required": True, "example": example, "search": search})


def is_required(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("required"))


def is_unset(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def parse_value(name: str, field: dataclasses.Field, raw: Any, type_name: str,
                coerce: Callable[[str, Any, str], Any]) -> Any:
    """A run-config value as the field's type (``coerce``); a required key's placeholder
    (:data:`PLACEHOLDER`) is :data:`UNSET`."""
    if is_required(field) and raw == PLACEHOLDER:
        return UNSET
    return coerce(name, raw, type_name)


@dataclass(frozen=True)
class Params:
    """Base of every algorithm's params (an algorithm with no hyperparameter uses it as is)."""

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field]:
        """Run-config key -> field, in declaration order."""
        return {f.metadata["key"]: f for f in dataclasses.fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {k: f.default for k, f in cls.fields().items()}

    @classmethod
    def examples(cls) -> dict[str, Any]:
        """Each required key -> its example value (:func:`required_key`)."""
        return {k: f.metadata["example"] for k, f in cls.fields().items() if is_required(f)}

    @classmethod
    def parse(cls, values: Mapping[str, Any], coerce: Callable[[str, Any, str], Any]) -> Params:
        """Params from run-config ``values`` (missing keys keep their defaults); values are
        converted to the field types with ``coerce(key, value, type name)``."""
        hints = get_type_hints(cls)
        kwargs = {f.name: parse_value(k, f, values[k], hints[f.name].__name__, coerce)
                  for k, f in cls.fields().items() if k in values}
        return cls(**kwargs)

    def problems(self, cfg: Any) -> list[str]:
        """What is wrong with these values (``cfg``: the general run config, for checks that
        involve its keys). Subclasses extend it for checks that span fields."""
        out = [p for k, f in self.fields().items() if (p := field_problem(k, f, getattr(self, f.name)))]
        return out + [f"{k} is required and has no default: {f.metadata['meaning']}"
                      for k, f in self.fields().items() if is_required(f) and is_unset(getattr(self, f.name))]

    def to_dict(self) -> dict[str, Any]:
        """Run-config key -> value."""
        return {k: getattr(self, f.name) for k, f in self.fields().items()}

    def view(self, cls: type[Params]) -> Params:
        """These values as an instance of ``cls``, one of the classes this one combines: what
        one half of the algorithm receives (reading a key it does not declare fails)."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})


@functools.lru_cache(maxsize=None)
def combine(name: str, *classes: type[Params]) -> type[Params]:
    """One params class with the keys of all ``classes`` (an algorithm's server and client
    halves): the most derived one when it already holds the others, else a new subclass of
    all. Two classes that name one field differently, or one key by two fields, are refused."""
    classes = tuple(dict.fromkeys(classes))
    for cls in classes:
        if all(issubclass(cls, other) for other in classes):
            return cls
    by_name: dict[str, str] = {}
    by_key: dict[str, str] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            k = f.metadata["key"]
            if by_name.setdefault(f.name, k) != k or by_key.setdefault(k, f.name) != f.name:
                raise TypeError(f"{name}: field {f.name!r} ({k}) clashes between "
                                + ", ".join(c.__name__ for c in classes))
    made = dataclasses.make_dataclass(name, [], bases=classes, frozen=True)
    made.__reduce__ = lambda self: (_combined, ((name, *classes), self.to_dict()))  # picklable by its parts
    return made


def _combined(parts: tuple, values: dict[str, Any]) -> Params:
    """Unpickle an instance of a class made by :func:`combine`."""
    cls = combine(*parts)
    return cls(**{f.name: values[k] for k, f in cls.fields().items()})


def field_problem(name: str, field: dataclasses.Field, value: Any) -> str | None:
    """The message if ``value`` fails the field's check (None if it passes; a required key left
    unset passes here: :meth:`Params.problems` asks for it when its algorithm runs)."""
    check = field.metadata["check"]
    if is_required(field) and is_unset(value):
        return None
    if check is not None and not check.ok(value):
        return f"{name} must be {check.text} (got {value!r})"
    return None
