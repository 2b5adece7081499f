"""The Flower strategy that drives an algorithm's rounds around its server rule.

``FlatStrategy`` is a Flower message-based ``FedAvg`` (so ``strategy.start()`` works as in
any Flower app, through the same round code as the ServerApp's ``train_round``, retries
included) that owns one algorithm's :class:`~flatflower.strategies.base.ServerRule` (``self.rule``: the
model, the server state and the algorithm's update, pure tensor code) and adds what the
papers' algorithms need and stock FedAvg lacks:

* participation decided by the server (strategies/participation.py): sampling with a
  deadline, deterministic in (seed, round) over partition ids learned and checked in a
  ``query`` handshake;
* several named ArrayRecords per message (the model plus the algorithm's ``down`` records),
  and the algorithm's scalars (``values``) in the config;
* validation of every reply (strategies/validation.py): decoded arrays, metrics, the
  partition's own size and step count, the message's nonce. A bad reply is rejected and
  logged with its reason; the round goes on with the rest;
* aggregation by the run's ``aggregator`` (mean, or a robust rule) of every per-client
  quantity the algorithm combines, with weights from the server's own partition sizes;
* server state as a checkpointable dict (:meth:`state_dict` / :meth:`load_state_dict`);
* a model's buffers (BatchNorm's statistics; ``buffers``: the names of the state-dict entries
  that are not trainable parameters) kept apart from the rule, which sees the trainable
  parameters only (strategies/buffers.py): replies are validated whole, then split, and
  their buffers checked like the parameters (statistics no data gives, counters beyond the
  local steps, under DP any change are refused; ``outlier-norm-factor`` measures their update);
  the buffers are combined by their own rule (under DP kept fixed); the model sent down and
  checkpointed has both;
* what the last round did, read through :meth:`FlatStrategy.round_record`.

Strategies are built from the registry (strategies/registry.py: ``spec.new_strategy(cfg,
model, buffers=...)``), which says what travels with the model.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.common.config import RunConfig
from flatflower.common.privacy import honest_norm_range, round_noise_multiplier
from flatflower.common.tensors import global_norm
from flatflower.strategies import buffers as bufs
from flatflower.strategies.aggregate import client_weights
from flatflower.strategies.base import ServerRule
from flatflower.strategies.participation import (NoNodesError, Participation, destinations, error_text, exchange,
                                     new_nonce, node_of)
from flatflower.strategies.validation import (REASON_CHARS, ClientUpdate, Expected, RejectedReply, layout_of,
                                   parse_evaluate_reply, parse_train_reply)

log = logging.getLogger("flwr.flatflower.server")

__all__ = ["FlatStrategy", "NoNodesError", "RoundRecord", "RoundStats", "RunFailed"]


class RunFailed(RuntimeError):
    """The run ended without a usable model (every round skipped, or a non-finite model)."""

# federated evaluation's results (aggregate_evaluate): metrics.jsonl's federated_loss / _accuracy
FEDERATED_LOSS, FEDERATED_ACCURACY = "federated-loss", "federated-accuracy"
# and the median over the evaluated nodes, one value each (no size counts): federated_loss_median, ...
FEDERATED_LOSS_MEDIAN, FEDERATED_ACCURACY_MEDIAN = "federated-loss-median", "federated-accuracy-median"


@dataclass
class RoundStats:
    """What one training round did (a metrics.jsonl line is built from it)."""

    clients_sampled: int = 0
    clients_replied: int = 0
    clients_rejected: int = 0
    clients_failed: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    train_loss: float = float("nan")
    sampled_partitions: list[int] = field(default_factory=list)
    failed_partitions: list[int] = field(default_factory=list)
    rejected_partitions: list[int] = field(default_factory=list)
    retries: int = 0
    skipped: int = 0  # 1 when the round left the model unchanged (too few accepted replies)
    # every refused reply of the round: {"stage": train|evaluate|handshake, "partition",
    # "node", "reason"}
    rejections: list[dict] = field(default_factory=list)
    # every failed client of the round: {"partition", "node", "reason"} (its error reply, or
    # no reply before the deadline)
    failures: list[dict] = field(default_factory=list)
    # what the algorithm's server update measured (FedGF's divergence): metrics.jsonl columns
    rule: dict[str, float] = field(default_factory=dict)
    # client-level DP's round (dp.clip > 0; common/privacy.py): dp_sampling_rate (q, each
    # client's chance to be sampled) and dp_noise_multiplier (the noise the round's mean
    # carries, over its sensitivity): metrics.jsonl columns, and the privacy ledger's entry
    privacy: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundRecord:
    """What the last training round leaves for the run directory (clients.jsonl, flatness):
    read through :meth:`FlatStrategy.round_record`."""

    stats: RoundStats
    start: OrderedDict  # the point the clients started from (the global model, or FedACG's look-ahead)
    updates: list[ClientUpdate]  # the accepted updates, by partition
    weights: list[float]  # their aggregation weights p_i (the server's own sizes, ``aggregation``)
    failure_reasons: dict[int, str]  # failed partitions -> why
    examples: dict[int, int]  # each sampled partition -> its size, as the server assigned it
    steps: dict[int, int]  # each sampled partition -> the local steps the server asked of it


def shared_settings(cfg: RunConfig, spec) -> dict:
    """What every handshake query carries for the clients to compare with their own run config
    (the ``settings`` record, common/protocol.py): this run's values of the general keys both
    halves must agree on and of the keys its algorithm's client half reads."""
    client_keys = spec.client.Params.fields()
    return {k: v for k, v in cfg.to_dict().items() if k in P.SHARED_KEYS or k in client_keys}


class FlatStrategy(FlowerFedAvg):
    """The Flower strategy that drives an algorithm's rounds (see module docstring); the
    algorithm itself is ``self.rule``, its :class:`~flatflower.strategies.base.ServerRule`."""

    def __init__(self, cfg: RunConfig, initial_model: OrderedDict, spec,
                 partition_sizes: Callable[[int], Sequence[int]] | None = None,
                 buffers: Iterable[str] = ()):
        super().__init__(
            fraction_train=cfg.fraction_train,
            fraction_evaluate=1.0,  # set below: 0 (our default) makes Flower warn at every start
            min_train_nodes=1,
            min_evaluate_nodes=0,
            min_available_nodes=cfg.min_available_nodes,
        )
        self.fraction_evaluate = cfg.fraction_evaluate
        self.cfg = cfg
        self.spec = spec  # the algorithm's registry entry (strategies/registry.py)
        # the model's buffers (strategies/buffers.py): the rule never sees them
        self.keys = list(initial_model)
        self.buffer_keys = [k for k in self.keys if k in set(buffers)]
        params, kept = bufs.split(initial_model, self.buffer_keys)
        self.buffers: OrderedDict = OrderedDict((k, v.clone()) for k, v in kept.items())
        self.initial_buffers = OrderedDict((k, v.clone()) for k, v in kept.items())  # buffers = local's counters
        self.rule: ServerRule = spec.new_rule(cfg, params if self.buffer_keys else initial_model)
        self.layout = layout_of(initial_model)  # what every reply's model must be: parameters and buffers
        self.round = 0  # last completed training round
        self.rounds_skipped = 0  # training rounds that left the model unchanged (finish_round)
        self.participation = Participation(cfg, partition_sizes, shared_settings(cfg, spec))
        self.stats = RoundStats()
        self.failure_reasons: dict[int, str] = {}  # this round's failed partitions -> why
        self._accepted: tuple[OrderedDict, list[ClientUpdate]] = (self.rule.model, [])  # start point, updates
        self._messages: list[Message] = []  # this round's train messages (ids map error replies)
        self._grid: Grid | None = None  # the grid this round was sent on
        self._content = RecordDict()  # what every train message of this round carries
        self._nonces: dict[int, int] = {}  # partition -> its train message's nonce (its reply echoes it)
        self._eval_messages: list[Message] = []
        self._eval_nonces: dict[int, int] = {}  # the same for this round's evaluate messages

    @property
    def model(self) -> OrderedDict:
        """The global model: the rule's, with the buffers merged in the model's key order."""
        if not self.buffer_keys:
            return self.rule.model
        return bufs.merge(self.rule.model, self.buffers, self.keys)

    def _set_model(self, model: OrderedDict) -> None:
        """Make ``model`` (a whole state dict) the global model: parameters to the rule,
        buffers kept here."""
        if not self.buffer_keys:
            self.rule.model = model
            return
        self.rule.model, buffers = bufs.split(model, self.buffer_keys)
        self.buffers = OrderedDict(buffers)

    def _split_update(self, update: ClientUpdate) -> ClientUpdate:
        """A validated reply as the rule sees it: its model and uploads without the buffers
        (the model's buffers kept in ``update.buffers``). Buffers no honest client of this round
        could send refuse the reply (:func:`flatflower.strategies.buffers.check_reply`): a
        statistic no data gives, a counter beyond the client's local steps, and under DP any
        buffer other than the one the server sent."""
        if not self.buffer_keys:
            return update
        update.model, update.buffers = bufs.split(update.model, self.buffer_keys)
        if self.cfg.buffers == "local":  # its own counter: from the initial model's, at most every round's steps
            most = max((self.cfg.num_steps(n) for n in self.participation.sizes.values()), default=0)
            counted_from, steps = self.initial_buffers, max(self.rule.round, 1) * max(most, update.num_steps)
        else:  # from the global buffers it received, by its own steps
            counted_from, steps = self.buffers, update.num_steps
        bufs.check_reply(update.buffers, self.buffers, counted_from, steps, frozen=self.cfg.dp_clip > 0)
        update.records = {name: bufs.split(r, self.buffer_keys)[0] for name, r in update.records.items()}
        return update

    def round_record(self) -> RoundRecord:
        """The last training round: its statistics, start point, accepted updates and why
        clients failed."""
        start, updates = self._accepted
        part, sampled = self.participation, self.stats.sampled_partitions
        return RoundRecord(self.stats, start, list(updates),
                           client_weights([u.num_examples for u in updates], self.cfg.aggregation),
                           dict(self.failure_reasons), {p: part.num_examples(p) for p in sampled},
                           {p: part.num_steps(p) for p in sampled})

    @property
    def num_partitions(self) -> int | None:
        """N, the number of clients in the federation: ``num-partitions``, or fixed at the first
        handshake (None before it)."""
        return self.participation.num_partitions

    # ------------------------------------------------------------------ checkpointable state
    def state_dict(self) -> dict:
        rule = self.rule.state_dict()
        return {
            "algorithm": self.spec.name,
            "round": self.round,
            "model": bufs.merge(rule["model"], self.buffers, self.keys) if self.buffer_keys else rule["model"],
            "records": rule["records"],
            "participation": self.participation.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`. ValueError naming the first field that differs from
        what this run allocates (algorithm, round, the model's and every record's names, shapes
        and dtypes, finite values; the participation state), and nothing restored then: a
        damaged checkpoint never resumes to a different model."""
        from flatflower.common import schema

        def algorithm(name, where):
            if name != self.spec.name:
                raise ValueError(f"{where}: checkpoint is for {str(name)[:40]}, not {self.spec.name}")

        records = {name: schema.tensors(layout_of(r)) for name, r in self.rule.records.items()}
        schema.table(state, "strategy", algorithm=algorithm, round=schema.whole(0),
                     model=schema.tensors(self.layout), records=schema.fields(**records),
                     participation=schema.anything)
        self.rule.check_records(state["records"])
        params, buffers = bufs.split(state["model"], self.buffer_keys)
        bufs.check(buffers, "strategy.model")
        self.participation.load_state_dict(state["participation"])
        self.round = state["round"]
        if self.buffer_keys:
            self.rule.load_state_dict({**state, "model": params})
            self.buffers = OrderedDict((k, v.clone()) for k, v in buffers.items())
        else:
            self.rule.load_state_dict(state)

    # ------------------------------------------------------------------ refusals
    def _refused(self, stage: str, pid: int, node: int, why: str) -> None:
        """Record and log one refused reply (train rejections also count as rejected clients)."""
        self.stats.rejections.append({"stage": stage, "partition": pid, "node": node, "reason": why})
        if stage == "train":
            self.stats.clients_rejected += 1
            self.stats.rejected_partitions.append(pid)
        log.warning("round %d: %s reply of client %d (node %d) refused: %s", self.round + 1, stage,
                    pid, node, why)

    def _failed(self, server_round: int, pid: int, node: int, why: str) -> None:
        self.failure_reasons[pid] = why
        self.stats.clients_failed += 1
        self.stats.failed_partitions.append(pid)
        self.stats.failures.append({"partition": pid, "node": node, "reason": why})
        log.warning("round %d: client %d (node %d) failed: %s", server_round, pid, node, why)

    def available_partitions(self, grid: Grid) -> dict[int, int]:
        """partition id -> node id of every connected node that passed the handshake."""
        return self.participation.available(grid, self._refused)

    # ------------------------------------------------------------------ Flower hooks: train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send each the model, the round config and the extra records."""
        self.stats = RoundStats()
        self.failure_reasons = {}
        self._grid = grid  # retries go out on it (receive_train)
        self._set_model(codec.from_record(arrays))
        available = self.available_partitions(grid)
        chosen = self.participation.sample(server_round, list(available), self.fraction_train)
        self._nonces = {}
        self.rule.round = server_round
        start = self.rule.start_point()
        values = {**dict(config), P.SERVER_ROUND: server_round}
        if self.cfg.dp_clip > 0:  # M: each client's DP noise is noise-multiplier * clip / sqrt(M)
            values[P.SAMPLED_CLIENTS] = len(chosen)
            self.stats.privacy["dp_sampling_rate"] = self.participation.inclusion_rate(
                len(available), len(chosen), self.fraction_train)
        scalars = self.rule.broadcast_values()
        if sorted(scalars) != sorted(self.spec.values):
            raise RuntimeError(f"{self.spec.name}: the rule sends values {sorted(scalars)}, the registry "
                               f"declares {sorted(self.spec.values)}")
        values.update({name: float(v) for name, v in scalars.items()})
        if self.buffer_keys:  # the start point's parameters with the global buffers
            arrays = codec.to_record(bufs.merge(start, self.buffers, self.keys))
        self._content = RecordDict({P.MODEL: arrays if start is self.rule.model or self.buffer_keys
                                    else codec.to_record(start),
                                    P.CONFIG: ConfigRecord(values)})
        for name, tensors in self.rule.broadcast().items():
            self._content[name] = codec.to_record(tensors)
        msgs = self.train_messages(server_round, {p: available[p] for p in chosen})
        self._messages = msgs
        self.stats.clients_sampled = len(msgs)
        self.stats.sampled_partitions = list(chosen)
        log.info("round %d: sampled partitions %s", server_round, chosen)
        return msgs

    def train_messages(self, server_round: int, nodes: dict[int, int]) -> list[Message]:
        """The round's train message to each partition's node (``nodes``: partition -> node):
        the round's content, with the partition's ``state-round`` (its last round the server
        accepted) in the config, which tells the client what state to start from, and a nonce
        of its own. A reply must echo its message's nonce, which no other node sees: another
        node cannot answer for it (Flower 1.39's SuperLink stores a reply as the node it names,
        whoever sends it), nor work out its message's id, a hash of its content."""
        msgs = []
        for pid, node in nodes.items():
            content = RecordDict(dict(self._content.items()))  # the same arrays, its own config
            self._nonces[pid] = new_nonce()
            content[P.CONFIG] = ConfigRecord({**dict(self._content[P.CONFIG]), P.NONCE: self._nonces[pid],
                                              P.STATE_ROUND: self.participation.state_round(pid)})
            msgs.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN,
                                group_id=str(server_round)))
        self.stats.bytes_down += codec.payload_bytes(self._content) * len(msgs)
        return msgs

    def expected(self, pid: int, nonce: int | None = None) -> Expected:
        """What partition ``pid``'s reply to a message with ``nonce`` (default: its train message
        of this round) must say."""
        nonce = self._nonces.get(pid, 0) if nonce is None else nonce
        part = self.participation
        return Expected(pid, part.num_examples(pid), nonce, part.num_steps(pid), self.layout, self.spec.up)

    def collect(self, server_round: int, replies: Iterable[Message]) -> list[ClientUpdate]:
        """Parse and validate the replies to ``self._messages``; log and count failures
        (error replies, and messages with no reply within ``round-timeout``) and rejections."""
        updates: dict[int, ClientUpdate] = {}
        answered = set()
        sent = destinations(self._messages)
        for reply in replies:
            node = node_of(reply, sent)
            answered.add(reply.metadata.reply_to_message_id)
            pid = self.participation.partition_of.get(node, -1)
            if reply.has_error():
                self._failed(server_round, pid, node, error_text(reply))
                continue
            try:
                self.stats.bytes_up += codec.payload_bytes(reply.content)
                if pid < 0 or pid in updates:
                    raise RejectedReply("a reply from a node that holds no partition, or a second one")
                updates[pid] = self._split_update(parse_train_reply(reply, node, self.expected(pid)))
            except Exception as why:  # noqa: BLE001 - one reply's fault, never the run's end
                self._refused("train", pid, node, str(why))
        for msg in self._messages:
            if msg.metadata.message_id not in answered:
                node = msg.metadata.dst_node_id
                pid = self.participation.partition_of.get(node, -1)
                last = self.participation.state_round(pid)
                self._failed(server_round, pid, node,
                             f"no reply within round-timeout={self.cfg.round_timeout:g}s (client lost); "
                             + (f"its last accepted reply: round {last}" if last else "no accepted reply yet"))
        return [updates[p] for p in sorted(updates)]

    def reject_outliers(self, server_round: int, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """``outlier-norm-factor`` f > 0: reject a client any of whose uploads (the model
        update, each ``up`` record, and for a model with float buffers the buffers' update
        b_i - b, a quantity of its own: BatchNorm's statistics are in the units of the layers'
        inputs, not of the weights) has a norm > f * the round's median norm of that quantity
        (with at least 3 updates; a median itself is never rejected). Norms in float64."""
        factor = self.cfg.outlier_norm_factor
        if factor <= 0 or len(updates) < 3:
            return updates
        names = ["update", *self.spec.up]
        norms = [[float(global_norm(x, torch.float64)) for x in self.rule.uploads(u)] for u in updates]
        if any(v.is_floating_point() for v in self.buffers.values()):
            names.append("buffers")
            for row, u in zip(norms, updates):
                row.append(bufs.update_norm(u.buffers, self.buffers))
        medians = [float(np.median(column)) for column in zip(*norms)]
        kept = []
        for u, row in zip(updates, norms):
            over = [f"{name} norm {norm:.4g} > {factor:g} x round median {median:.4g}"
                    for name, norm, median in zip(names, row, medians) if norm > factor * median]
            if over:
                self._refused("train", u.partition_id, u.node_id, "; ".join(over))
            else:
                kept.append(u)
        return kept

    def reject_impossible_under_dp(self, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """Under DP (``dp.clip`` > 0) refuse a client whose model update no honest clipped, noised
        update could have: its norm outside :func:`honest_norm_range` (a client that did not
        clip, or one that left out its noise; the false refusal of an honest client has
        probability below 2e-26). Norms in float64, with slack for the float32 transport."""
        if self.cfg.dp_clip <= 0 or not updates:
            return updates
        deltas = [self.rule.uploads(u)[0] for u in updates]  # w_i - start point, over the trainable tensors
        dim, tensors = sum(t.numel() for t in deltas[0].values()), len(deltas[0])
        lo, hi = honest_norm_range(self.cfg.dp_clip, self.cfg.dp_noise_multiplier, self.stats.clients_sampled,
                                   dim, tensors, self.cfg.dp_clip_mode)
        slack = 2.0 ** -22 * (float(global_norm(self.rule.start_point(), torch.float64)) + hi)  # float32 rounding, twice
        kept = []
        for u, delta in zip(updates, deltas):
            norm = float(global_norm(delta, torch.float64))
            if not lo - slack <= norm <= hi + slack:
                self._refused("train", u.partition_id, u.node_id,
                              f"update norm {norm:.4g} is outside [{lo:.4g}, {hi:.4g}], the norms an honest "
                              f"update clipped to dp.clip={self.cfg.dp_clip:g} and noised can have "
                              "(docs/privacy.md)")
            else:
                kept.append(u)
        return kept

    # ------------------------------------------------------------------ the round drivers
    def train_round(self, server_round: int, grid: Grid) -> RoundStats:
        """One training round, as the ServerApp runs it: sample and send (``configure_train``),
        then :meth:`receive_train`. Flower's own ``start`` loop takes the same path through
        ``configure_train`` and ``aggregate_train``."""
        msgs = list(self.configure_train(server_round, codec.to_record(self.model), ConfigRecord(), grid))
        self.receive_train(server_round, exchange(grid, msgs, self.cfg.round_timeout))
        return self.stats

    def receive_train(self, server_round: int, replies: Iterable[Message]) -> None:
        """The round from its replies on, for both drivers: collect, retry
        (``too-few-replies = retry``, over the grid the round was sent on), then the
        algorithm's update, or the round is skipped."""
        updates = self.collect(server_round, replies)
        self.finish_round(server_round, self.retry(server_round, self._grid, updates) if self._messages else updates)

    def evaluate_round(self, server_round: int, grid: Grid) -> MetricRecord | None:
        """One federated evaluation round of the global model (``fraction-evaluate`` of the
        clients; None when none is asked or none replied validly)."""
        msgs = list(self.configure_evaluate(server_round, codec.to_record(self.model), ConfigRecord(), grid))
        return self.aggregate_evaluate(server_round, exchange(grid, msgs, self.cfg.round_timeout)) if msgs else None

    def retry(self, server_round: int, grid: Grid, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """Re-send the round's messages to the sampled clients that gave no accepted reply, at
        most ``max-retries`` times, while fewer than ``min-replies`` updates are accepted (only
        with ``too-few-replies = retry``); the accepted updates, in partition order."""
        while (len(updates) < self.cfg.min_replies and self.cfg.too_few_replies == "retry"
               and self.stats.retries < self.cfg.max_retries):
            self.stats.retries += 1
            done = {u.partition_id for u in updates}
            missing = [p for p in self.stats.sampled_partitions if p not in done]
            log.warning("round %d: %d accepted replies < min-replies=%d; retry %d/%d: waiting for "
                        "clients %s", server_round, len(updates), self.cfg.min_replies,
                        self.stats.retries, self.cfg.max_retries, missing)
            available = self.participation.wait_for_partitions(
                grid, missing, self.cfg.round_timeout, self._refused)
            again = [p for p in missing if p in available]
            if not again:
                continue
            self._messages = self.train_messages(server_round, {p: available[p] for p in again})
            replies = exchange(grid, self._messages, self.cfg.round_timeout)
            updates = sorted(updates + self.collect(server_round, replies), key=lambda u: u.partition_id)
        return updates

    def finish_round(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Apply the algorithm's server update to the accepted updates, if there are enough
        (``min-replies``, and what the aggregator needs) and the result is finite; otherwise
        the round is skipped: model and server state stay as they were."""
        self.stats.clients_replied = len(updates) + self.stats.clients_rejected
        updates = self.reject_impossible_under_dp(self.reject_outliers(server_round, updates))
        if self.cfg.dp_clip > 0:
            self.stats.privacy["dp_noise_multiplier"] = round_noise_multiplier(
                self.cfg.dp_noise_multiplier, self.stats.clients_sampled, len(updates))
        self._accepted = (self.rule.start_point(), updates)  # for round_record()
        aggregator = self.rule.aggregator
        needed = max(self.cfg.min_replies, aggregator.required())
        reason = None
        if len(updates) < needed:
            reason = (f"{len(updates)} accepted client updates < {needed} (min-replies="
                      f"{self.cfg.min_replies}, aggregator {aggregator.name} needs "
                      f"{aggregator.required()})")
        else:
            weights = client_weights([u.num_examples for u in updates], self.cfg.aggregation)
            losses = [u.train_loss for u in updates]
            self.stats.train_loss = (float(sum(w * x for w, x in zip(weights, losses)))
                                     if aggregator.name == "mean" else float(np.median(losses)))
            self.rule.num_partitions = self.num_partitions
            if not self.rule.apply(server_round, updates, weights):
                reason = "the server update gave non-finite values"
            else:  # these clients' states after this round are the ones they go on from
                if self.buffer_keys and self.cfg.dp_clip <= 0:  # under DP they stay the initial ones
                    self.buffers = bufs.combine([u.buffers for u in updates], weights, robust=aggregator.name != "mean")
                self.participation.commit(server_round, [u.partition_id for u in updates])
                self.stats.rule = dict(self.rule.metrics)
        if reason:
            self.stats.skipped = 1
            self.rounds_skipped += 1
            log.warning("round %d skipped: %s; the global model and server state are unchanged",
                        server_round, reason)
        self.round = server_round

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, *args, **kwargs):
        """Flower's ``start`` (a user's own ServerApp), which never ends as a success when every
        round was skipped: RunFailed, one line with the last refusal or failure, instead of a
        result holding the initial model (flatflower's own ServerApp says the same:
        server/run.py)."""
        skipped, first = self.rounds_skipped, self.round + 1
        result = super().start(grid, initial_arrays, num_rounds, *args, **kwargs)
        if num_rounds >= 1 and self.rounds_skipped - skipped == num_rounds:
            raise RunFailed(f"every round ({first}-{self.round}) was skipped: no round had enough accepted "
                            f"client updates, the global model is the initial one{self._last_refusal()}")
        return result

    def _last_refusal(self) -> str:
        """``; the last round's refusal: <reason>`` (or failure), for RunFailed's line."""
        for what, items in (("refusal", self.stats.rejections), ("failure", self.stats.failures)):
            if items:  # its first line: an in-process error reply carries its traceback after "'>"
                reason = str(items[-1]["reason"]).split("'> ", 1)[0].removesuffix("'>")[:REASON_CHARS]
                return f"; the last round's {what}: client {items[-1]['partition']}: {reason}"
        return ""

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's hook (for ``strategy.start``): :meth:`receive_train`, then what Flower's
        loop expects back."""
        self.receive_train(server_round, replies)
        metrics = MetricRecord({k: v for k, v in asdict(self.stats).items()
                                if isinstance(v, (int, float)) and v == v})  # drop NaN and lists
        return codec.to_record(self.model), metrics

    # ------------------------------------------------------------------ Flower hooks: evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation on a ``fraction-evaluate`` sample of clients (0 = none)."""
        if self.fraction_evaluate == 0.0:
            return []
        available = self.available_partitions(grid)
        pool = [p for p in available if self.participation.evaluates(p)]  # not a node that holds nothing out
        if not pool:
            self._eval_messages = []
            return []
        chosen = self.participation.sample_evaluate(server_round, pool, self.fraction_evaluate)
        shared = {**dict(config), P.SERVER_ROUND: server_round}
        own_statistics = self.cfg.buffers == "local" and self.buffer_keys  # each evaluates with its own
        self._eval_nonces, self._eval_messages = {}, []
        for p in chosen:  # each with a nonce of its own (train_messages says why)
            self._eval_nonces[p] = new_nonce()
            values = {**shared, P.NONCE: self._eval_nonces[p]}
            if own_statistics:
                values[P.STATE_ROUND] = self.participation.state_round(p)
            self._eval_messages.append(Message(RecordDict({P.MODEL: arrays, P.CONFIG: ConfigRecord(values)}),
                                               dst_node_id=available[p], message_type=MessageType.EVALUATE,
                                               group_id=str(server_round)))
        return self._eval_messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """``federated-loss`` and ``federated-accuracy``: the means of the clients' eval-loss and
        eval-accuracy weighted by the sizes of their evaluated sets (their held-out sets, as
        declared at their first handshake; else their training sets), each at most
        EVALUATE_WEIGHT_CAP times the others' median where the sizes are the nodes' own word
        (Participation.evaluation_weights); ``federated-loss-median`` and
        ``federated-accuracy-median``: the medians over the clients, one value each. A reply
        must claim its size; invalid replies are refused with their reason."""
        rows: dict[int, tuple[float, float]] = {}
        sent = destinations(self._eval_messages)
        for reply in replies:
            node = node_of(reply, sent)
            pid = self.participation.partition_of.get(node, -1)
            if reply.has_error():
                log.warning("round %d: evaluation failed on node %d: %s", server_round, node,
                            error_text(reply))
                continue
            try:
                if pid < 0 or pid in rows:
                    raise RejectedReply("a reply from a node that holds no partition, or a second one")
                part = self.participation
                rows[pid] = parse_evaluate_reply(reply, Expected(pid, part.num_evaluated(pid), self._eval_nonces.get(pid, 0)))
            except Exception as why:  # noqa: BLE001 - one reply's fault, never the run's end
                self._refused("evaluate", pid, node, str(why))
        if not rows:
            return None
        sizes = self.participation.evaluation_weights(rows)
        total = float(sum(sizes.values()))
        means = {key: sum(rows[p][i] * sizes[p] for p in rows) / total
                 for i, key in enumerate((FEDERATED_LOSS, FEDERATED_ACCURACY))}
        medians = {key: float(np.median([rows[p][i] for p in rows]))
                   for i, key in enumerate((FEDERATED_LOSS_MEDIAN, FEDERATED_ACCURACY_MEDIAN))}
        return MetricRecord({**means, **medians})

