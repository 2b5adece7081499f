"""What a client rule keeps: its declared state, and the check that a rule keeps to it.

A client rule (client/algorithms/base.py ``ClientRule``) keeps values on itself between local
steps and until the round's ``uploads``/``new_state``: the model it received, its duals, control
variates, a step count, its hyperparameters. It declares each one beside its code, in its
``Keeps`` class attribute, with a kind from this module's vocabulary; the declarations of a
rule's classes are merged along its class hierarchy (:func:`declared_state`), as its keys are
declared in its ``Params`` (common/params.py):

    class ScaffoldClient(ClientRule):
        Keeps = keeps(c=MODEL, c_i=MODEL, c_minus_ci=MODEL, steps=SCALAR, _new_control=optional(MODEL))

The kinds, each relative to the model (its trainable parameters, in order):

* ``MODEL``: a list of tensors aligned with the trainable parameters, each of its parameter's
  shape (w^t, a dual, a control variate);
* ``SCALAR``: a 0-d tensor (SCAFFOLD's step count);
* ``RECORDS``: a dict of record name -> such a list, or -> a Python float (a broadcast's
  scalars, FedGF's c): the base's ``broadcast`` and ``state``;
* ``CONSTANT``: a value that holds no tensor (the params, the lr, a flag, the ``initial``
  callable): the same for every client of a round (it may depend on the step, never on a
  client's data);
* ``optional(kind)``: that kind, or ``None`` (not there yet: FedTOGA's gradient register before
  the first step, FedLESAM's offset on a client's first round). ``None`` until ``__init__`` or
  the first local step sets it, then set for good.

Every other kind must be set by ``__init__`` and keep its structure (a list's length, a dict's
keys, a tensor's shape) from step to step. The vectorised engine (runtime/engines/vectorized.py)
stacks exactly the declared tensors of a group's clients and shares its constants, so a rule
that keeps anything else is refused, in one line, when it is loaded: :func:`check_declared_state`
builds it on a small probe model, runs a few local steps, ``uploads`` and ``new_state``, and
compares its attributes with the declaration after each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from flatflower.client.batch import ModelBatch, trainable
from flatflower.common.params import Params, is_required


class RuleStateError(ValueError):
    """A client rule that keeps what its declaration does not say (one line: the class and
    the attributes)."""


@dataclass(frozen=True)
class Kind:
    """The kind of one kept value (see the module's docstring); ``carried``: tensors the
    vectorised engine stacks per client (else a constant, shared by a group)."""

    name: str
    carried: bool
    optional: bool = False

    def __str__(self) -> str:
        return f"optional({self.name})" if self.optional else self.name


MODEL = Kind("model", carried=True)
SCALAR = Kind("scalar", carried=True)
RECORDS = Kind("records", carried=True)
CONSTANT = Kind("constant", carried=False)
KINDS = (MODEL, SCALAR, RECORDS, CONSTANT)


def optional(kind: Kind) -> Kind:
    """``kind``, or None until ``__init__`` or the first local step sets it."""
    if kind not in KINDS:
        raise TypeError(f"optional() takes one of {', '.join(map(str, KINDS))}, not {kind!r}")
    return dataclasses.replace(kind, optional=True)


def keeps(**kinds: Kind) -> Mapping[str, Kind]:
    """A rule class's ``Keeps``: attribute name -> its :class:`Kind` (the values this class
    adds to, or redeclares for, those of its bases)."""
    for name, kind in kinds.items():
        if not isinstance(kind, Kind):
            raise TypeError(f"keeps({name}=...) takes a kind (MODEL, SCALAR, RECORDS, CONSTANT, "
                            f"optional(...)), not {kind!r}")
    return MappingProxyType(dict(kinds))


def declared_state(rule_class: type) -> dict[str, Kind]:
    """Attribute name -> kind: the ``Keeps`` of ``rule_class`` and its bases merged (a class's
    own declaration over its bases'), in the order of the first declaration of each name."""
    merged: dict[str, Kind] = {}
    for klass in reversed(rule_class.__mro__):
        own = klass.__dict__.get("Keeps", {})
        wrong = [f"{name}={kind!r}" for name, kind in own.items() if not isinstance(kind, Kind)]
        if wrong:
            raise RuleStateError(f"{klass.__qualname__}.Keeps declares {', '.join(wrong)}: each value must be a kind "
                                 "(MODEL, SCALAR, RECORDS, CONSTANT, optional(...): flatflower.client.rule_state)")
        merged.update(own)
    return merged


# ---------------------------------------------------------------- one value against its kind
def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def describe(value: Any) -> str:
    """A short account of a value's structure, for a message."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        shapes = [str(list(v.shape)) for v in value if isinstance(v, torch.Tensor)][:4]
        return f"a {type(value).__name__} of {len(value)}" + (f" (shapes {', '.join(shapes)})" if shapes else "")
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))[:6]}"
    return f"a {type(value).__name__}"


def _model_problem(value: Any, shapes: Sequence[torch.Size]) -> str | None:
    if (not isinstance(value, list) or len(value) != len(shapes)
            or not all(isinstance(t, torch.Tensor) and t.shape == s for t, s in zip(value, shapes))):
        return (f"{describe(value)}, not a list of {len(shapes)} tensors shaped like the model's "
                f"trainable parameters ({', '.join(str(list(s)) for s in shapes)})")
    return None


def kind_problem(kind: Kind, value: Any, shapes: Sequence[torch.Size]) -> str | None:
    """What is wrong with ``value`` as a ``kind`` for a model whose trainable parameters have
    ``shapes`` (None: nothing)."""
    if value is None:
        return None if kind.optional or not kind.carried else "None"
    if kind.name == "model":
        return _model_problem(value, shapes)
    if kind.name == "scalar":
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            return f"{describe(value)}, not a 0-d tensor"
        return None
    if kind.name == "records":
        if not isinstance(value, dict):
            return f"{describe(value)}, not a dict of records"
        for key, record in value.items():
            if isinstance(record, float) or (isinstance(record, int) and not isinstance(record, bool)):
                continue
            problem = _model_problem(record, shapes)
            if problem:
                return f"a dict whose record {key!r} is {problem}"
        return None
    if _holds_tensor(value):  # a constant
        return f"{describe(value)} holding tensors, which a constant (shared by a group's clients) cannot"
    return None


def structure(value: Any) -> Any:
    """What must stay fixed from step to step: the nesting, a dict's keys, a list's length,
    each tensor's shape (None stays None)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(structure(v) for v in value))
    if isinstance(value, dict):
        return (type(value), tuple((k, structure(v)) for k, v in value.items()))
    return None if value is None else "value"


_MISSING = object()


def state_problems(rule: Any, declared: Mapping[str, Kind], shapes: Sequence[torch.Size]) -> list[str]:
    """What ``rule`` keeps against ``declared`` (:func:`declared_state` of its class), for a
    model with trainable parameter ``shapes``: its undeclared attributes and its declared ones
    of another kind, as message parts (empty: it keeps to it)."""
    attrs = vars(rule)
    out = []
    undeclared = [name for name in attrs if name not in declared]
    if undeclared:
        out.append(f"keeps {', '.join(undeclared)} undeclared")
    for name, kind in declared.items():
        value = attrs.get(name, _MISSING)
        if value is _MISSING:
            continue
        problem = kind_problem(kind, value, shapes)
        if problem:
            out.append(f"{name} (declared {kind}) is {problem}")
    return out


def refuse(rule_class: type, problems: Sequence[str], when: str) -> RuleStateError:
    """The one-line error for a rule that breaks its declaration."""
    text = "; ".join(problems)
    return RuleStateError(f"client rule {rule_class.__qualname__} breaks its declared state{' ' * bool(when)}{when}: {text} "
                          "(declare what a rule keeps in its Keeps: flatflower.client.rule_state)")


def check_state(rule: Any, shapes: Sequence[torch.Size], when: str = "") -> None:
    """Raise :class:`RuleStateError` if ``rule`` keeps anything its class does not declare, or a
    declared value of another kind (the engine's check on real rules before a group trains)."""
    problems = state_problems(rule, declared_state(type(rule)), shapes)
    if problems:
        raise refuse(type(rule), problems, when)


# ---------------------------------------------------------------- the check at load time
PROBE_SHAPES = ((3, 4), (3,))  # the probe model: nn.Linear(4, 3), two small trainable tensors
PROBE_ROWS = 6
PROBE_VALUES = (0.5, 0.0)  # each broadcast scalar ("values"): a mixing weight or radius, and none


def example_params(params_class: type[Params]) -> Params:
    """``params_class`` with its defaults, and its required keys at their example values."""
    return params_class(**{f.name: f.metadata["example"] for f in dataclasses.fields(params_class)
                           if is_required(f)})


def check_declared_state(rule_class: type, params: Params | None = None, *, down: Sequence[str] = (),
                         values: Sequence[str] = (), state: Sequence[str] = (), steps: int = 3) -> None:
    """Refuse a client rule class that keeps anything its declaration (``Keeps``, merged along
    its classes: :func:`declared_state`) does not say: raise :class:`RuleStateError` (a
    ValueError) with one line naming the class and the attributes; return None when it keeps
    to it.

    The rule is built on a probe model (``nn.Linear(4, 3)``: two small trainable tensors) with
    ``params`` (default: its ``Params``' defaults, required keys at their example values), the
    broadcast records ``down`` (random model-aligned tensors) and scalars ``values`` (0.5, then
    0.0), and this client's state records ``state`` (none, as on a first round, then random
    ones); it takes ``steps`` local SGD steps on small synthetic batches, then ``uploads`` and
    ``new_state``. After each, every attribute must be declared and of its kind, and a declared
    value must keep its structure from step to step (an optional one may be set by the first
    step). An algorithm's registry entry gives the arguments:
    ``check_declared_state(spec.client, down=spec.down, values=spec.values, state=spec.state)``.
    A rule that fails to build or step on the probe is refused too (its error, in one line)."""
    declared = declared_state(rule_class)
    params = example_params(getattr(rule_class, "Params", Params)) if params is None else params
    for with_state in ((False, True) if state else (False,)):
        for value in (PROBE_VALUES if values else (None,)):
            _probe(rule_class, declared, params, down, {n: value for n in values},
                   state if with_state else (), steps)


def _probe(rule_class, declared, params, down, values, state, steps) -> None:
    generator = torch.Generator().manual_seed(0)

    def random_model() -> list[torch.Tensor]:
        return [torch.randn(s, generator=generator) for s in PROBE_SHAPES]

    model = nn.Linear(PROBE_SHAPES[0][1], PROBE_SHAPES[0][0])
    with torch.no_grad():
        for p, t in zip(trainable(model), random_model()):
            p.copy_(t)
    params_now = trainable(model)
    shapes = [p.shape for p in params_now]
    initial = random_model()
    broadcast = {**{n: random_model() for n in down}, **values}
    kept = {n: random_model() for n in state}
    lr = 0.1
    setting = ("(probe: " + (f"stored state {', '.join(sorted(kept))}" if kept else "a first round")
               + "".join(f", {n} = {v}" for n, v in values.items()) + ")")

    def run(what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - any failure of the rule on the probe, in one line
            why = " ".join(str(err).split())[:200]
            raise RuleStateError(f"client rule {rule_class.__qualname__} could not be probed {setting}: {what} "
                                 f"raised {type(err).__name__}: {why} (give check_declared_state the "
                                 "records and values it reads: down=, values=, and its params)") from None

    def check(rule, when: str) -> None:
        problems = state_problems(rule, declared, shapes)
        if problems:
            raise refuse(rule_class, problems, f"{when} {setting}")

    rule = run("__init__", lambda: rule_class(params, [p.detach().clone() for p in params_now], broadcast,
                                               kept, lr, initial=lambda: [t.clone() for t in initial]))
    check(rule, "after __init__")
    missing = [n for n, k in declared.items() if not k.optional and n not in vars(rule)]
    if missing:
        raise refuse(rule_class, [f"{', '.join(missing)} declared but not set by __init__"], setting)
    before = {n: structure(v) for n, v in vars(rule).items()}
    for k in range(1, steps + 1):
        x = torch.randn(PROBE_ROWS, PROBE_SHAPES[0][1], generator=generator)
        y = torch.randint(0, PROBE_SHAPES[0][0], (PROBE_ROWS,), generator=generator)
        w = [p.detach() for p in params_now]
        _, d = run(f"direction (local step {k})", lambda: rule.direction(w, ModelBatch(model, x, y)))
        factor = run("lr_factor", lambda: rule.lr_factor(k - 1, steps))
        with torch.no_grad():
            for p, dp in zip(params_now, d):
                p.sub_(dp.detach() * (lr * factor))
        check(rule, f"after local step {k}")
        now = {n: structure(v) for n, v in vars(rule).items()}
        changed = [n for n, kind in declared.items() if kind.carried and now.get(n) != before.get(n)
                   and not (k == 1 and kind.optional and before.get(n) is None)]
        if changed:
            raise refuse(rule_class, [f"{n} (declared {declared[n]}) changed its structure at local step {k} "
                                      f"(from {_structure_text(before.get(n))} to {describe(vars(rule).get(n))}): "
                                      "the vectorised engine carries one structure from step to step"
                                      for n in changed], setting)
        before = now
    w = [p.detach() for p in params_now]
    run("uploads", lambda: rule.uploads(w))
    check(rule, "after uploads()")
    run("new_state", lambda: rule.new_state(w))
    check(rule, "after new_state()")


def _structure_text(spec: Any) -> str:
    if spec is None:
        return "None"
    if spec == "value":
        return "a value"
    if spec[0] == "tensor":
        return f"a tensor of shape {list(spec[1])}"
    kind, items = spec
    if issubclass(kind, dict):
        return f"a dict with keys {sorted(str(k) for k, _ in items)[:6]}"
    return f"a {kind.__name__} of {len(items)}"
