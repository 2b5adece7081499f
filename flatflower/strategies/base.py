"""The server rule every algorithm's server half builds on: pure tensor code.

A :class:`ServerRule` holds the global model and the algorithm's server state (``records``:
duals, control variates, momenta, EMA models) and turns the round's accepted client updates
into the next model. It sees no grid, no message and no Flower object, so it is tested on
plain tensors (``spec.new_rule(cfg, model, num_partitions=N)``). The Flower strategy that
drives the rounds (strategies/strategy.py: sampling, messages, validation, retries,
checkpoints) owns one rule and calls :meth:`ServerRule.apply` on what it accepted; the
client half is its mirror, a ``ClientRule`` (client/algorithms/base.py).

An algorithm subclass declares the run-config keys it reads (``Params``, common/params.py),
allocates its records in :meth:`init_records` and implements :meth:`update` (the server half
of its pseudocode), combining clients with :meth:`aggregate`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from flatflower.common.config import RunConfig
from flatflower.common.params import Params
from flatflower.common.tensors import sub
from flatflower.strategies.aggregate import Aggregator

if TYPE_CHECKING:  # a data class of the validated reply; the rule never parses messages
    from flatflower.strategies.validation import ClientUpdate

__all__ = ["ServerRule", "all_finite"]


def _copy(tensors: Mapping[str, torch.Tensor]) -> OrderedDict:
    return OrderedDict((k, v.clone()) for k, v in tensors.items())


class ServerRule:
    """Server half of an algorithm (see module docstring).

    ``model`` is the global model w^r, ``records`` the server state by record name (those of
    the spec's ``down`` are broadcast with the model), ``num_partitions`` N, the size of the
    federation (the driver sets it once the clients' handshake fixed it; None before).
    """

    Params: type[Params] = Params  # no hyperparameters of its own

    def __init__(self, cfg: RunConfig, initial_model: Mapping[str, torch.Tensor], spec,
                 num_partitions: int | None = None):
        self.cfg = cfg
        self.params = cfg.params.view(self.Params)  # this half's keys (common/params.py)
        self.spec = spec  # the algorithm's registry entry (strategies/registry.py)
        self.model: OrderedDict = _copy(initial_model)
        self.records: dict[str, OrderedDict] = {}
        self.init_records()
        self.aggregator = Aggregator.from_config(cfg)
        self.num_partitions = num_partitions
        self.chosen: list[int] | None = None  # this round's clients under a Krum-family rule (apply)
        self.metrics: dict[str, float] = {}  # what the last applied round measured (metrics.jsonl)
        # the round being played (1-based): the driver sets it before it asks for the start
        # point, the broadcast and the values, and apply() before the update (FedGloSS's warm-up)
        self.round = 1

    # ------------------------------------------------------------------ algorithm hooks
    @classmethod
    def dp_refusal(cls, cfg: RunConfig) -> str | None:
        """Why client-level DP (``dp.clip > 0``) does not cover what this server releases, or
        None. The privacy analysis is of the uniform mean of the accepted updates
        (common/privacy.py): a server that also reads single updates (their norms, their
        angles, each scaled its own way) releases more than that mean."""
        return None

    def init_records(self) -> None:
        """Allocate the algorithm's server state in ``self.records`` (default: none)."""

    def start_point(self) -> OrderedDict:
        """The model the clients start from and send back (default: the global model;
        FedACG: its look-ahead). Client updates are measured from it."""
        return self.model

    def broadcast(self) -> dict[str, OrderedDict]:
        """Extra records sent with the model: the spec's ``down`` names, from ``records``."""
        return {name: self.records[name] for name in self.spec.down}

    def broadcast_values(self) -> dict[str, float]:
        """The scalars sent with the model, by the spec's ``values`` names (default: none;
        FedGF's mixing weight c, FedWMSAM's alpha)."""
        return {}

    def update(self, server_round: int, updates: list[ClientUpdate], weights: list[float]) -> None:
        """Server half of the algorithm: new ``self.model`` (and records) from accepted updates;
        numbers worth a metrics.jsonl column go in ``self.metrics`` (``<algorithm>_<name>``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared mechanics
    def aggregate(self, items: Sequence[OrderedDict], weights: Sequence[float]) -> OrderedDict:
        """The run's estimate of sum_i p_i items[i] (``aggregator``: the mean, or a robust rule;
        a Krum-family rule combines the clients it picked from all their uploads)."""
        return self.aggregator(items, weights, self.chosen)

    def uploads(self, update: ClientUpdate) -> list[OrderedDict]:
        """Every quantity a client uploads that the server combines: its model update
        w_i - (start point), then each of the algorithm's ``up`` records."""
        return [sub(update.model, self.start_point()), *(update.records[n] for n in self.spec.up)]

    def federation_size(self) -> int:
        """N, for the server halves that average over all N clients (duals, control
        variates): never the M replies instead; an error before N is known."""
        if self.num_partitions is None:
            raise RuntimeError(
                f"{self.spec.name}: the federation size N is unknown (no partition handshake yet); "
                "its server state is averaged over all N clients, so it cannot update without it")
        return self.num_partitions

    def apply(self, server_round: int, updates: list[ClientUpdate], weights: list[float]) -> bool:
        """One round of the rule: :meth:`update` on the accepted updates with weights p_i, a
        Krum-family rule's picks made once from every client's uploads; ``metrics`` holds what
        the update measured. False, and model and records as they were (no metrics), when the
        result is not finite."""
        before = self.model, self.records
        self.records = {n: OrderedDict(r) for n, r in self.records.items()}
        self.metrics, self.round = {}, server_round
        # every client's uploads only where a rule picks among them (the mean never looks)
        self.chosen = (self.aggregator.choose([self.uploads(u) for u in updates])
                       if self.aggregator.picks(len(updates)) else None)
        try:
            self.update(server_round, updates, weights)
        finally:
            self.chosen = None
        if all_finite(self.model, *self.records.values()):
            return True
        self.model, self.records, self.metrics = *before, {}
        return False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The rule's state: the model and every record (copies)."""
        return {"model": _copy(self.model), "records": {n: _copy(r) for n, r in self.records.items()}}

    def check_records(self, records: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """ValueError if checkpointed ``records`` (names, shapes and finiteness already
        checked by the caller) hold values this rule never makes (FedGF's window, FedWMSAM's
        alpha); default: anything finite goes."""

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a :meth:`state_dict` (checked by the caller: strategies/strategy.py)."""
        self.model = _copy(state["model"])
        self.records = {n: _copy(r) for n, r in state["records"].items()}


def all_finite(*named: Mapping[str, torch.Tensor]) -> bool:
    """True when every floating-point tensor of every set is finite."""
    return all(bool(torch.isfinite(v).all()) for item in named for v in item.values()
               if v.is_floating_point())
