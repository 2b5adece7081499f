"""What every client half provides, in one vocabulary.

A rule sees parameter tensors (lists aligned with the model's trainable parameters) and a
:class:`flatflower.client.batch.Batch`, never a model; it takes its hyperparameters as ``params`` (an
instance of its own ``Params``: the keys this half reads), as a torch optimizer does. Per local step the loop calls
:meth:`ClientRule.direction`; a family (FedDyn's duals, SCAFFOLD's control variates, FedCM's
mixing, FedProx's prox term) writes ``direction`` once around :meth:`ClientRule.gradient`,
which each algorithm of the family sets (plain, SAM, FedLESAM's estimate, FedGMT's KL).
After training, :meth:`uploads` and :meth:`new_state` say what goes to the server and what
the client keeps. Rules are free of ``.item()``, of branches on tensor values and of module
state, so any engine can run them. What a rule keeps on itself is declared in its ``Keeps``
(client/rule_state.py), so an engine carries exactly that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flatflower.client.batch import Batch
from flatflower.client.rule_state import CONSTANT, MODEL, RECORDS, keeps
from flatflower.common.tensors import Tensors, clone
from flatflower.common.params import Params


class ClientRule:
    """Client half of an algorithm.

    ``start`` is w^t, the model received this round (trainable parameters); ``broadcast`` the
    extra records the server sent, ``state`` this client's records from earlier rounds (empty
    before its first), both aligned with the parameters (and in ``broadcast`` the scalars the
    server sent, as Python floats: FedGF's c); ``lr`` this round's local learning
    rate (SCAFFOLD's control variates are in gradient units); ``initial()`` rebuilds the run's
    initial model w^0 (aligned) on demand. ``Params`` declares the run-config keys this half
    reads; ``params`` is an instance of it (common/params.py).

    The state a rule keeps is declared. Every attribute a rule sets on itself, in ``__init__``,
    in a local step or in ``uploads``/``new_state``, is named in the ``Keeps`` of its class or
    of a base (``Keeps = keeps(dual=MODEL)``; the declarations merge along the classes, as
    ``Params`` fields do), with its kind relative to the model (flatflower.client.rule_state):
    ``MODEL`` a list aligned with the trainable parameters, ``SCALAR`` a 0-d tensor,
    ``RECORDS`` a dict of name -> such a list (or a broadcast's Python float), ``CONSTANT`` a
    value without tensors (the same for every client of a round: params, lr, a flag), and
    ``optional(kind)`` for one that is None until ``__init__`` or the first local step sets it.
    The others are set by ``__init__`` and keep their structure (list lengths, dict keys,
    shapes) from step to step. State changes by assignment (``self.mu = add(self.mu, ...)``),
    never in place. The vectorised engine stacks exactly the declared tensors of a group's
    clients (one rule per client under ``torch.func.vmap``) and shares the constants; a rule
    that keeps anything else is refused in one line when it is loaded
    (:func:`flatflower.client.rule_state.check_declared_state`). This class keeps what its
    constructor's arguments give.
    """

    Params: type[Params] = Params  # no hyperparameters of its own
    Keeps = keeps(params=CONSTANT, start=MODEL, broadcast=RECORDS, state=RECORDS, lr=CONSTANT, initial=CONSTANT)

    def __init__(self, params: Params, start: Tensors, broadcast: dict[str, Tensors],
                 state: dict[str, Tensors], lr: float,
                 initial: Callable[[], Tensors] | None = None) -> None:
        self.params = params
        self.start = clone(start)
        self.broadcast = broadcast
        self.state = state
        self.lr = lr
        self.initial = initial

    def gradient(self, w: Tensors, batch: Batch) -> tuple[torch.Tensor, Tensors]:
        """(loss at w, the gradient this algorithm steps with): plain by default."""
        return batch.grad()

    def lr_factor(self, step: int, steps: int) -> float:
        """Local step ``step``'s learning rate (0-based, of this client's ``steps`` this round)
        as a multiple of the round's lr: the loop steps with lr * lr_factor, so weight decay
        and momentum see it as torch.optim.SGD's lr. 1 (a constant lr) by default; FedSWA's
        cyclical schedule. A function of its arguments and ``params`` only (one value per
        client in a batched engine)."""
        return 1.0

    def direction(self, w: Tensors, batch: Batch) -> tuple[torch.Tensor, Tensors]:
        """(loss at w, the local step's direction d): w <- w - lr d (the loop adds weight
        decay, momentum and clipping). Plain: the gradient itself."""
        return self.gradient(w, batch)

    def uploads(self, w: Tensors) -> dict[str, Tensors]:
        """Extra records for the server, besides the local model."""
        return {}

    def new_state(self, w: Tensors) -> dict[str, Tensors]:
        """Records to keep on this client until its next round."""
        return {}
