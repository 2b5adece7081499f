"""The vectorised engine: many clients' local training in batched passes.

A round's clients train in groups: their trainable parameters are stacked along a leading
client dimension, and each step runs the **same client rule** (client/algorithms) once under
``torch.func.vmap``. So every per-client quantity (SAM's gradient norm, FedNSAM's offset,
FedGMT's teacher logits, a dual, a control variate) is per client, and gradients come from
``torch.func.grad`` of a functional call of one template model (:class:`FunctionalBatch`).
The state a rule declares (its ``Keeps``, flatflower.client.rule_state: start model, duals,
previous SAM gradient, SCAFFOLD's step count...) is stacked alongside (:class:`StackedRule`)
and carried from step to step; its declared constants (hyperparameters, flags) are shared by
the group. Nothing else of a rule is carried: one that keeps more is refused.

Ragged clients are exact. A step whose clients draw mini-batches of different sizes (the last
batch of an epoch) pads them; real rows weigh 1/b and padding 0 in the objective's means
(flatflower.client.batch.batch_mean). A client with fewer steps than its group's longest is masked after
its last step: its weights, momentum and rule tensors keep their values. :func:`groups` cuts
clients (sorted by step count) so that padded work stays within PADDING_BUDGET of the real
work; a group smaller than MIN_GROUP, or on a CPU of a model whose convolutions batch
slower than they run alone (:func:`batching_pays`: a rule over the model's convolution
FLOPs), trains client by client with the ClientApp's own loop. The SGD step (clipping,
weight decay, momentum, the step's lr) is the one client/train.py takes (client/sgd.py), on
the stacked tensors, client by client.

Every client's data, shuffling RNG, rule and reply are those of its own ``train`` call
(flatflower.client.app.TrainCall), so a vectorised run equals an in-process one up to the float rounding
of batched kernels. A group's mini-batches are gathered a chunk of steps at a time
(:func:`step_batches`); run-config ``compile = on`` runs the batched step under torch.compile
(:func:`compiled`), and on a CPU a compiled group of SPLIT_MIN clients or more trains as two
halves in two threads (:func:`train_halves`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.app import report_of
from flatflower.client.batch import Objective, cross_entropy
from flatflower.client.rule_state import RuleStateError, check_state, declared_state
from flatflower.client.sgd import masked, sgd_step
from flatflower.client.train import LocalResult, autocast, host_losses, round_loss, round_order
from flatflower.common.tensors import Tensors, add

log = logging.getLogger("flwr.flatflower.client")
UNBATCHABLE = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)


def check_batchable(model: nn.Module, name: str) -> None:
    """A clear error for a model whose forward pass is not a pure function of its weights
    (BatchNorm's running statistics in train mode, dropout's random masks, other buffers)."""
    bad = sorted({type(m).__name__ for m in model.modules() if isinstance(m, UNBATCHABLE)})
    buffers = [n for n, _ in model.named_buffers()]
    if bad or buffers:
        what = ", ".join(bad) if bad else f"buffers ({', '.join(buffers)})"
        raise ValueError(f"the vectorised engine cannot batch clients of model {name!r}: it has "
                         f"{what}, state that one forward pass shares across the clients of a "
                         "batch; use --engine inprocess (or ray), or a model with GroupNorm "
                         "instead of BatchNorm (e.g. resnet18-gn)")


class FunctionalBatch:
    """:class:`flatflower.client.batch.Batch` for one client inside vmap: gradients by
    ``torch.func.grad`` of the template model called with this client's weights."""

    def __init__(self, model: nn.Module, names: Sequence[str], w: Tensors, x: torch.Tensor,
                 y: torch.Tensor, weight: torch.Tensor | None):
        self.model, self.names, self.w = model, list(names), list(w)
        self.x, self.y, self.weight = x, y, weight

    def _forward(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        return functional_call(self.model, dict(zip(self.names, weights)), (self.x,))

    def grad(self, offset=None, objective: Objective = cross_entropy):
        at = self.w if offset is None else add(self.w, offset)  # = ModelBatch's p += offset

        def differentiated(weights):
            value, report = objective(self._forward(weights), self.y, self.weight)
            return value, report.detach()

        g, report = torch.func.grad(differentiated, has_aux=True)(at)
        return report, list(g)

    def outputs(self, weights):
        with torch.no_grad():
            return self._forward(weights)


# ---------------------------------------------------------------- a rule's declared state, stacked
TENSOR, OTHER = "T", "O"  # the leaves of a declared value: stacked per client / shared


def _flatten(value, tensors: list, others: list):
    """The structure of ``value`` (nested dicts, lists, tuples) as a hashable spec; its
    tensors and other leaves appended to ``tensors`` and ``others``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return TENSOR
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_flatten(v, tensors, others) for v in value))
    if isinstance(value, dict):
        return (type(value), tuple((k, _flatten(v, tensors, others)) for k, v in value.items()))
    others.append(value)
    return OTHER


def _unflatten(spec, tensors, others):
    if spec is TENSOR:
        return next(tensors)
    if spec is OTHER:
        return next(others)
    kind, items = spec
    if issubclass(kind, dict):
        return kind((k, _unflatten(v, tensors, others)) for k, v in items)
    return kind(_unflatten(v, tensors, others) for v in items)


ABSENT = object()  # a declared optional value not set yet


class StackedRule:
    """The rules of a group of clients as one, over their declared state
    (flatflower.client.rule_state): per carried value (a model-aligned list, a 0-d tensor,
    records, optional ones), its structure and shared leaves (``spec``, ``others``, from the
    first rule) and its tensors stacked along the clients; the constants (params, lr, flags)
    from the first rule, shared. A rule that keeps anything else is refused before its group
    trains (flatflower.client.rule_state.RuleStateError, one line)."""

    def __init__(self, rules: Sequence[ClientRule], shapes: Sequence[torch.Size]):
        self.kind = type(rules[0])
        self.declared = declared_state(self.kind)
        check_state(rules[0], shapes, "in the vectorised engine")  # the others: no other names
        for r in rules[1:]:  # (their structures and shapes are the first's: groups() keys on them)
            if vars(r).keys() - self.declared.keys():
                check_state(r, shapes, "in the vectorised engine")
        self.carried = [n for n, k in self.declared.items() if k.carried]
        self.constants = {n: v for n, v in vars(rules[0]).items() if not self.declared[n].carried}
        self.attrs: dict[str, tuple[object, list, list[torch.Tensor]]] = {}
        for name in self.carried:
            if name in vars(rules[0]):
                per_client = [split_attr(vars(r)[name]) for r in rules]
                spec, others, _ = per_client[0]
                self.attrs[name] = (spec, others, [torch.stack(ts) for ts in zip(*(t for _, _, t in per_client))])

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Carried value -> its stacked tensors (what the group's step maps over)."""
        return {name: tensors for name, (_, _, tensors) in self.attrs.items()}

    def rule(self, tensors: dict[str, Sequence[torch.Tensor]]) -> ClientRule:
        """A rule with these tensors (one client's, inside vmap; or client i's slices) and the
        group's constants: its declared state, set without ``__init__``."""
        rule = object.__new__(self.kind)
        values = vars(rule)
        values.update(self.constants)
        for name, (spec, others, _) in self.attrs.items():
            values[name] = _unflatten(spec, iter(tensors[name]), iter(others))
        return rule

    def client(self, i: int) -> ClientRule:
        return self.rule({name: [t[i] for t in tensors] for name, tensors in self.tensors().items()})

    def changes(self, rule: ClientRule, built: dict) -> tuple[dict, dict]:
        """The declared values ``rule`` set since it was built (``built``: its values then):
        (carried name -> tensors, carried name -> (spec, others)), and its constants, which
        one run of the step sets for the whole group, taken at once."""
        values = vars(rule)
        undeclared = [n for n in values if n not in self.declared]
        if undeclared:
            raise RuleStateError(f"client rule {self.kind.__qualname__} set {', '.join(undeclared)} during a local "
                                 "step without declaring it (declare what a rule keeps in its Keeps: "
                                 "flatflower.client.rule_state)")
        gone = sorted(set(built) - set(values))
        if gone:
            raise RuntimeError(f"{self.kind.__name__} deleted {gone} during a step; the vectorised engine "
                               "cannot carry that")
        for name in self.constants:
            self.constants[name] = values[name]
        changed = {n: split_attr(values[n]) for n in self.carried
                   if n in values and values[n] is not built.get(n, ABSENT)}
        return ({n: t for n, (_, _, t) in changed.items()},
                {n: (spec, others) for n, (spec, others, _) in changed.items()})

    def update(self, tensors: dict, layouts: dict, active: torch.Tensor | None, step: int) -> None:
        """Take a step's changed values; a client past its last step (not ``active``) keeps
        its values, which needs the value's structure unchanged (the declaration's promise:
        flatflower.client.rule_state.check_declared_state holds a rule to it)."""
        for name, new in tensors.items():
            spec, others = layouts[name]
            old = self.attrs.get(name)
            if active is not None:
                if old is None or old[0] != spec:
                    raise RuntimeError(f"{self.kind.__name__}.{name} changed its structure at step "
                                       f"{step}, after some clients' last step, against its declared "
                                       f"{self.declared[name]}; the vectorised engine cannot mask that")
                new = [masked(active, n, o) for n, o in zip(new, old[2])]
            self.attrs[name] = (spec, others, list(new))


def split_attr(value) -> tuple[object, list, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    others: list = []
    spec = _flatten(value, tensors, others)
    return spec, others, tensors


def group_key(rule: ClientRule) -> tuple:
    """What clients that train in one group share: their rule's class and, per declared value,
    its structure, its constants (callables aside: ``initial``) and its tensors' shapes and
    dtypes. FedLESAM's clients with a previous global model (an offset) and without differ."""
    values = vars(rule)
    parts = []
    for name in declared_state(type(rule)):
        if name not in values:
            parts.append((name, None))
            continue
        spec, others, tensors = split_attr(values[name])
        shared = tuple(repr(o) for o in others if not callable(o))
        parts.append((name, spec, shared, tuple((tuple(t.shape), t.dtype) for t in tensors)))
    return (type(rule), tuple(parts))


# ---------------------------------------------------------------- self-reports
@torch.no_grad()
def evaluate_stacked(model: nn.Module, names: Sequence[str], params: Tensors, splits: Sequence,
                     batch_size: int) -> list[tuple[float, float]]:
    """flatflower.common.evaluate.evaluate for each client: (mean cross-entropy, accuracy) of its weights
    (``params``, stacked) on its split, in batched forward passes over padded rows."""
    def forward(weights, x):
        return functional_call(model, dict(zip(names, weights)), (x,))

    model.eval()
    sizes = torch.tensor([len(s) for s in splits])
    loss = torch.zeros(len(splits), dtype=torch.float64)
    correct = torch.zeros(len(splits), dtype=torch.int64)
    for start in range(0, int(sizes.max()) if len(splits) else 0, batch_size):
        xs, ys = zip(*(s.get(slice(start, start + batch_size)) for s in splits))
        x, y, _ = padded(xs, ys)
        x, y = x.to(params[0].device), y.to(params[0].device)
        logits = vmap(forward)(params, x)
        real = (torch.arange(y.shape[1]) < (sizes - start).clamp(min=0).unsqueeze(1)).to(y.device)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").view(y.shape)
        loss += torch.where(real, ce, 0.0).sum(dim=1).double().cpu()
        correct += ((logits.argmax(dim=2) == y) & real).sum(dim=1).cpu()
    n = sizes.clamp(min=1).double()
    return list(zip((loss / n).tolist(), (correct.double() / n).tolist()))


def self_reports(calls: Sequence, params: Tensors, when: str) -> list[dict[str, float]]:
    """flatflower.client.app's ``client-eval`` self-reports of a group, batched (flatflower.client.app.report_of)."""
    first = calls[0]
    if not first.cfg.client_eval:
        return [{} for _ in calls]
    model, names, size = first.model, first.layout.names, first.cfg.eval_batch_size
    train = evaluate_stacked(model, names, params, [c.data for c in calls], size)
    held: list[float | None] = [None] * len(calls)
    with_held = [i for i, c in enumerate(calls) if c.held_out is not None and len(c.held_out)]
    if with_held:
        accuracy = evaluate_stacked(model, names, [p[with_held] for p in params],
                                    [calls[i].held_out for i in with_held], size)
        for i, (_, acc) in zip(with_held, accuracy):
            held[i] = acc
    return [report_of(when, t, h) for t, h in zip(train, held)]


# ---------------------------------------------------------------- groups and their training
PADDING_BUDGET = 2.0  # a group's work (clients x its longest client's steps) <= this x its real steps
# smaller groups train one by one with flatflower.client.train.local_train (the same rule code): a
# vmapped gradient costs about 1 ms more than one client's on this CPU, so batching 1 to 3
# small clients loses (MLP, batch 32: 1 client 0.98 vs 0.24 ms, 10 clients 1.4 vs 2.4 ms)
MIN_GROUP = 4


def groups(calls: Sequence, budget: float | None = None) -> list[list[int]]:
    """Indices of ``calls`` that train together. A group has one rule shape (e.g. FedLESAM
    clients with and without a previous global model train apart) and tensor shapes; within
    one, clients sorted by step count are cut into groups whose padded work (size x the most
    steps) stays within ``budget`` x their real steps: a client with fewer steps than its
    group's longest is masked (left unchanged) after its last step. ``budget``: default
    PADDING_BUDGET."""
    budget = PADDING_BUDGET if budget is None else budget
    kinds: dict[tuple, list[int]] = {}
    for i, call in enumerate(calls):
        kinds.setdefault(group_key(call.rule), []).append(i)
    out = []
    for members in kinds.values():
        steps = {i: calls[i].cfg.num_steps(len(calls[i].data)) for i in members}
        group: list[int] = []
        real = 0  # the group's real steps
        for i in sorted(members, key=steps.__getitem__):
            if group and (len(group) + 1) * steps[i] > budget * (real + steps[i]):
                out.append(group)
                group, real = [], 0
            group.append(i)
            real += steps[i]
        out.append(group)
    return out


def padded(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]):
    """Stacked mini-batches, and per-row weights when their sizes differ (None when not): 1/b
    on a batch's b real rows, 0 on padding (and on all rows of an empty batch)."""
    sizes = [len(y) for y in ys]
    b = max(sizes)
    if min(sizes) == b:
        return torch.stack(list(xs)), torch.stack(list(ys)), None
    x = xs[0].new_zeros((len(xs), b, *xs[0].shape[1:]))
    y = ys[0].new_zeros((len(ys), b))
    weight = torch.zeros((len(xs), b), device=x.device)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        if len(yi):
            x[i, : len(yi)], y[i, : len(yi)], weight[i, : len(yi)] = xi, yi, 1.0 / len(yi)
    return x, y, weight


def _moved(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (one dtype, on the host) on ``device``, in one copy."""
    if not tensors:
        return []
    flat = torch.cat([t.flatten() for t in tensors]).to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(torch.split(flat, [t.numel() for t in tensors]), tensors)]


STEP_BYTES = 64 << 20  # the most input bytes step_batches gathers at once (a chunk of steps)


def step_batches(calls: Sequence, orders: Sequence[tuple[torch.Tensor, list[int]]], steps: Sequence[int],
                 device: torch.device):
    """Each local step's stacked mini-batches of a group, as :func:`padded` stacks them
    (x, y, weight; a client past its last step has an empty batch), gathered a chunk of steps
    at a time. ``orders``: each client's :func:`flatflower.client.train.round_order` (its
    round's batch indices in order, and their sizes). A client's rows of a chunk are one slice
    of its order; without a train-transform, the rows of all clients whose splits normalise
    alike become inputs in one element-wise map (``Split.inputs``), else each client's do (per
    batch, in step order, where a train-transform draws from the call's generator). They
    reach ``device`` in one copy, and one indexing per step cuts them into padded batches.
    Split.get acts row by row, so the batches equal the ones built step by step, bit for bit."""
    sizes = np.zeros((max(steps), len(calls)), dtype=np.int64)  # step x client (host bookkeeping)
    for i, (_, own) in enumerate(orders):
        sizes[: len(own), i] = own
    # (step + 1) x client: a client's rows before each step (row 0: none; the last: all of them)
    before = np.concatenate([np.zeros((1, len(calls)), dtype=np.int64), np.cumsum(sizes, axis=0)])
    row_bytes = 4 * max(1, calls[0].data.x[0].numel())  # float32 inputs
    chunk = max(1, STEP_BYTES // max(1, int(sizes.sum(axis=1).max()) * row_bytes))
    together = (all(c.augment is None for c in calls)
                and len({c.data.normalisation() for c in calls}) == 1)
    for k0 in range(0, len(sizes), chunk):
        k1 = min(k0 + chunk, len(sizes))
        rows = [order[int(a):int(b)] for (order, _), a, b in zip(orders, before[k0], before[k1])]
        if together:
            xs = [calls[0].data.inputs(torch.cat([c.data.x[r] for c, r in zip(calls, rows)]))]
            ys = [torch.cat([c.data.y[r] for c, r in zip(calls, rows)]).long()]
        else:
            xs, ys = [], []
            for c, r, (_, own) in zip(calls, rows, orders):
                if c.augment is None:
                    x, y = c.data.get(r)
                else:  # per batch, in step order: the transform's draws as the client's own loop makes them
                    parts = [c.batch(j) for j in r.split(own[k0:k1])] or [c.data.get(r)]
                    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                xs.append(x)
                ys.append(y)
        xs.append(xs[0].new_zeros((1, *xs[0].shape[1:])))  # the padding row
        ys.append(ys[0].new_zeros(1))
        x_all = torch.cat(xs).to(device, non_blocking=True)
        y_all = torch.cat(ys).to(device, non_blocking=True)
        part = sizes[k0:k1]
        offsets = np.cumsum(part.sum(axis=0)) - part.sum(axis=0)  # each client's first row
        starts = offsets + np.cumsum(part, axis=0) - part  # step x client: its batch's first row
        index, weight = [], []  # per step, built on the host and moved to the device at once
        for s, first in zip(part, starts):
            j = np.arange(s.max())
            real = j < s[:, None]
            index.append(torch.from_numpy(np.where(real, first[:, None] + j, len(x_all) - 1)))
            # 1 / b on a batch's b real rows (the float64 quotient, as padded's), 0 on padding
            weight.append(None if real.all() else
                          torch.from_numpy(np.where(real, 1.0 / np.maximum(s, 1)[:, None], 0.0)).float())
        plain = [w is None for w in weight]
        weights = iter(_moved([w for w in weight if w is not None], device))
        for i, unweighted in zip(_moved(index, device), plain):
            yield x_all[i], y_all[i], None if unweighted else next(weights)


def train_group(calls: Sequence) -> list[LocalResult | Exception]:
    """Train the models of ``calls`` (one group: see :func:`groups`) in place, together.

    A client whose loss stops being finite gets the in-process engine's FloatingPointError;
    the vmap keeps clients apart, so the others train on."""
    first = calls[0]
    cfg, lr, model = first.cfg, first.lr, first.model
    names = first.layout.names
    with torch.no_grad():  # the stacks, not the clients' parameters, are what the steps change
        params = [torch.stack(ps) for ps in zip(*[c.layout.params for c in calls])]
    rules = StackedRule([c.rule for c in calls], [p.shape for p in first.layout.params])
    orders = [round_order(len(c.data), cfg.batch_size, cfg.local_epochs, cfg.local_steps, c.generator())
              for c in calls]
    steps = [cfg.num_steps(len(c.data)) for c in calls]
    device = params[0].device
    layouts: dict = {}

    def step(tensors, w, x, y, weight):
        """One client's local step. vmap runs it once for the group, so the rule's new shared
        attributes (``layouts``) are set once; only the attributes the step set are returned."""
        nonlocal layouts
        rule = rules.rule(tensors)
        built = dict(vars(rule))
        loss, d = rule.direction(list(w), FunctionalBatch(model, names, w, x, y, weight))
        changed, layouts = rules.changes(rule, built)
        return loss, list(d), changed

    def step_lr(k: int) -> float | torch.Tensor:
        """Step k's lr: the round's times the rule's factor, per client when they differ."""
        factors = [first.rule.lr_factor(k, n) if k < n else 1.0 for n in steps]
        if all(f == 1.0 for f in factors):
            return lr
        return torch.tensor([lr * f for f in factors], dtype=params[0].dtype, device=params[0].device)

    steppers: dict[bool, object] = {}

    def stepper(weighted: bool):
        """The group's batched step (vmap of ``step``; padded steps take per-row weights);
        run-config ``compile = on``: under ``torch.compile`` (:func:`compiled`)."""
        if weighted not in steppers:
            batched = vmap(step, in_dims=(0, 0, 0, 0, 0 if weighted else None))
            steppers[weighted] = compiled(batched) if cfg.compile == "on" else batched
        return steppers[weighted]

    before = self_reports(calls, params, "before")
    model.train()
    failed: dict[int, Exception] = {}
    losses: list[torch.Tensor] = []  # each step's losses (one per client), left on the device
    buffers = None
    for k, (x, y, weight) in enumerate(step_batches(calls, orders, steps, device)):
        live = [k < n for n in steps]
        active = None if all(live) else torch.tensor(live, device=device)
        with autocast(cfg, device):
            loss, direction, changed = stepper(weight is not None)(rules.tensors(), params, x, y, weight)
        rules.update(changed, layouts, active, k + 1)
        losses.append(loss.detach())
        buffers = sgd_step(params, [d.detach() for d in direction], buffers, lr=step_lr(k), momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm, clients=True, active=active)
    after = self_reports(calls, params, "after")
    table = np.ascontiguousarray(host_losses(losses).T)  # client x step: the group's one host sync
    mean_losses: dict[int, float] = {}
    for i, n in enumerate(steps):
        try:
            mean_losses[i] = round_loss(table[i, :n])
        except FloatingPointError as error:
            failed[i] = error
    # each client's trained weights, rule and self-reports back into its own call
    with torch.no_grad():  # one copy op for all: client i's tensors from row i of each stack
        torch._foreach_copy_([p for c in calls for p in c.layout.params],
                             [row for rows in zip(*[s.unbind(0) for s in params]) for row in rows])
    results: list[LocalResult | Exception] = []
    for i, call in enumerate(calls):
        call.rule = rules.client(i)
        call.reported, call.after = before[i], after[i]
        results.append(failed.get(i) or LocalResult(len(call.data), steps[i], mean_losses[i]))
    return results


SPLIT_MIN = 32  # a compiled group on a CPU of at least this many clients trains as two halves


def splits(calls: Sequence) -> bool:
    """Whether a group trains as two halves at once (:func:`train_halves`): its step compiled
    (run-config ``compile = on``), on a CPU, at least SPLIT_MIN clients."""
    first = calls[0]
    return len(calls) >= SPLIT_MIN and first.cfg.compile == "on" and first.layout.device.type == "cpu"


def train_halves(calls: Sequence) -> list[LocalResult | Exception]:
    """:func:`train_group` of each half of ``calls``, the second half in a thread of its own.
    A compiled step's batched matrix products release Python's lock while its fused kernels
    and its Python hold it, so one half's products run while the other half's Python does:
    two cores busy where one group keeps one busy (docs/benchmarks.md, "Where a round's time
    goes"). vmap keeps clients apart, so each client trains as in one group (to the float
    rounding of the compiled step, which may differ by batch size). A half that raises fails
    as its clients would."""
    half = len(calls) // 2
    second: list = []
    worker = threading.Thread(target=lambda: second.extend(_outcome(train_group, calls[half:])), daemon=True,
                              name="flatflower-half-group")
    worker.start()
    first = _outcome(train_group, calls[:half])
    worker.join()
    if len(second) != len(calls) - half:  # its thread ended on a BaseException: never a silent gap
        raise RuntimeError("the second half of a group stopped training without results")
    return first + second


def _outcome(train, calls: Sequence) -> list:
    """``train(calls)``, or its exception once per call: a group fails as each of its clients
    would."""
    try:
        return train(calls)
    except Exception as err:  # noqa: BLE001 - one group's fault, never the round's
        return [err] * len(calls)


def compiled(batched):
    """``batched`` (a group's vmapped step) under ``torch.compile``: the rule's Python, the
    functional forward and backward passes of both SAM gradients and the per-client
    arithmetic become one graph per kind of step (a full batch or a padded one, with its rule's
    attributes present or not yet: a first round has no state; its sizes static, then symbolic
    once they change), so the step's many small kernels become few fused ones (on a CPU, C++
    from inductor; on a GPU, Triton). The first step of each kind compiles (seconds to tens of
    seconds); results equal the eager step's to float rounding (about 1e-7 relative), not bit
    for bit. torch's limit of graphs per compiled function is raised to RECOMPILE_LIMIT for the
    process (from 8); beyond it the step runs eagerly, with torch's warning. Every step is
    wrapped by the process's one compile context (``_COMPILER``)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    with _COMPILER_LOCK:
        if not _COMPILER:
            _COMPILER.append(_compile_context())
    return _COMPILER[0](batched)


# torch.compile(fn) is torch._dynamo.optimize(its inductor backend)(fn), and building that backend
# deep-copies inductor's config: about 1 ms per call, twice a round here (a group's step is a new
# function each round). The process builds it once; the graphs compiled are the same.
_COMPILER: list = []
_COMPILER_LOCK = threading.Lock()


def _compile_context():
    """torch.compile's default context (inductor, default mode), built once; torch.compile
    itself where a torch lacks the private names this builds it from."""
    try:
        return torch._dynamo.optimize(backend=torch._TorchCompileInductorWrapper("default", None, None))
    except (AttributeError, TypeError):
        return torch.compile


def check_compilable(cfg) -> None:
    """``compile = on``: a clear error (one line) before any round when torch.compile cannot
    work on this machine (no C++ compiler for the CPU's inductor, no Triton for a GPU), instead
    of every batched group failing at its first step. Compiles a one-line function (a few
    seconds the first time in a process) the way the steps are compiled (:func:`compiled`)."""
    if cfg.compile != "on":
        return
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        try:
            compiled(_probe)(torch.ones(2, device=device))
        except Exception as err:  # noqa: BLE001 - any failure of the toolchain
            why = (str(err).strip().splitlines() or [""])[0][:200]
            raise ValueError(f"compile = on, but torch.compile does not work here on {device} "
                             f"({type(err).__name__}: {why}); use compile = off") from None


def _probe(t: torch.Tensor) -> torch.Tensor:
    return t * 2 + 1


# graphs a process may compile for the vectorised step (torch's default, 8, is used up by a rule
# whose attributes appear over the first rounds: kinds x full or padded x static or dynamic sizes)
RECOMPILE_LIMIT = 32


_PAYS: dict[str, bool] = {}  # batching_key -> whether batching pays (this process; a resumed run's)


def batching_key(call) -> str:
    """What :func:`batching_pays` decides for: the model's parameter shapes, the batch shape
    and the device, as text (JSON: a run directory records it)."""
    x, _ = call.data.get(torch.arange(min(len(call.data), call.cfg.batch_size)))
    return json.dumps([[list(p.shape) for p in call.layout.params], list(x.shape), str(call.layout.device)])


def batching_pays(call) -> bool:
    """Whether this call's model trains batched: decided by a rule over the model and the
    batch shape (:func:`batching_rule`), never by a timing, so two fresh runs of one command
    take the same path whatever the machine's load; always on a GPU. A run records its
    choices (runtime/engines/inprocess.py: ``vectorized.json``) and its resume reuses them
    (:func:`adopt_batching`; a run made when the choice was a timing keeps what it measured).
    The run-config key ``batching`` (``on`` | ``off``) pins the choice instead, on every device."""
    if call.cfg.batching != "auto":
        return call.cfg.batching == "on"
    device = call.layout.device
    if device.type != "cpu":
        return True
    key = batching_key(call)
    if key not in _PAYS:
        x, _ = call.data.get(torch.arange(min(len(call.data), call.cfg.batch_size)))
        flops = conv_flops(call.model, x)
        _PAYS[key] = batching_rule(flops, device)
        log.info("vectorised engine: %s for this model on %s (%.3g convolution FLOPs a client step)",
                 "batches clients" if _PAYS[key] else "trains clients one by one", device, flops)
    return _PAYS[key]


def batching_choices() -> dict[str, bool]:
    """The choices :func:`batching_pays` made (or adopted) in this process."""
    return dict(_PAYS)


def adopt_batching(choices: dict[str, bool]) -> None:
    """Take choices a run recorded: its resume batches exactly as it did."""
    _PAYS.update({str(k): bool(v) for k, v in choices.items() if isinstance(v, bool)})


# On a CPU, convolutions batched under vmap become grouped convolutions, which lose to each
# client's own once a step's convolutions are more than small; the matrix products of linear
# layers batch into faster ones. Measured (docs/results/batching_rule.py, records in
# docs/results/batching-cpu/; docs/benchmarks.md "Batching on a CPU"): a batched gradient of
# 16 clients took 0.15-1.0x the CPU time of 16 single ones for every model without
# convolutions and every convolutional step up to 1.3e7 FLOPs; from 1.6e7 up, 0.64-3.0x,
# losing in most (grouped convolutions), never better than 0.64x.
CONV_FLOPS_LIMIT = 1.5e7  # convolution FLOPs (2 x multiply-adds) of one client's forward step


def batching_rule(flops: float, device: torch.device) -> bool:
    """Whether a group of clients trains batched, from its model's convolution FLOPs per
    client step (:func:`conv_flops`) and the device: a pure function (no timing), always yes
    off the CPU, on a CPU yes up to CONV_FLOPS_LIMIT."""
    return device.type != "cpu" or flops <= CONV_FLOPS_LIMIT


def conv_flops(model: nn.Module, x: torch.Tensor) -> float:
    """The convolution FLOPs of one forward pass of ``model`` over the batch ``x`` (torch's
    FLOP counter: every convolution, a module's or a functional one), counted on one row
    (no gradients; a model with buffers or dropout never reaches here: check_batchable) and
    scaled by the batch's rows."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x[:1])
    return float(counter.get_flop_counts().get("Global", {}).get(torch.ops.aten.convolution, 0)) * len(x)


def train_together(calls: Sequence) -> list[LocalResult | Exception]:
    """Train every call's model in place, group by group (:func:`groups`; a group of fewer
    than MIN_GROUP clients, or of a model for which batching does not pay on this device
    (:func:`batching_pays`), one by one; a compiled one on a CPU of SPLIT_MIN or more, as two
    halves at once: :func:`splits`); the results in the order of ``calls`` (an exception for
    a client whose training failed)."""
    results: list[LocalResult | Exception | None] = [None] * len(calls)
    # a client with no data goes one by one too, to local_train's own error
    nonempty = [i for i, call in enumerate(calls) if len(call.data)]
    alone = [i for i, call in enumerate(calls) if not len(call.data)]
    for members in groups([calls[i] for i in nonempty]):
        members = [nonempty[m] for m in members]
        group = [calls[i] for i in members]
        if len(group) < MIN_GROUP or not batching_pays(group[0]):
            alone += members
            continue
        outcome = _outcome(train_halves if splits(group) else train_group, group)
        for i, result in zip(members, outcome):
            results[i] = result
    for i in alone:
        try:
            results[i] = calls[i].train()
        except Exception as err:
            results[i] = err
    return results
