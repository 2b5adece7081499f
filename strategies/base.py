"""The strategy base every algorithm's server half builds on.

It is a Flower message-based ``FedAvg`` (so ``strategy.start()`` works as in any Flower app)
that adds what the papers' algorithms need and stock FedAvg lacks:

* sampling with a deadline (never waits forever), deterministic in (seed, round) over
  *partition ids*, learned from a ``query`` handshake with each node, so the same seed
  samples the same clients in-process, in simulation and in a deployment;
* several named ArrayRecords per message (the model plus the algorithm's ``down`` records);
* validation of every reply (records, keys, shapes, dtypes, NaN/Inf, metrics): a bad
  reply is rejected and logged, the round goes on with the rest;
* sample-weighted or uniform aggregation (``aggregation``), in partition-id order;
* server state as a checkpointable dict (:meth:`state_dict` / :meth:`load_state_dict`).

An algorithm subclass sets its records in :meth:`init_records` and implements
:meth:`update` (the server half of its pseudocode).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from common import protocol as P
from common.config import RunConfig
from common.registry import AlgorithmSpec
from common.registry import get as get_spec
from strategies.aggregate import client_weights
from strategies.validation import (ClientUpdate, RejectedReply, layout_of, metric_value,
                                  parse_train_reply)

log = logging.getLogger("flwr.flatflower.server")


class NoNodesError(RuntimeError):
    """No usable SuperNode connected before the deadline."""


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


class FlatStrategy(FlowerFedAvg):
    """Server half shared by all algorithms (see module docstring)."""

    def __init__(self, cfg: RunConfig, initial_model: OrderedDict, spec: AlgorithmSpec | None = None):
        super().__init__(
            fraction_train=cfg.fraction_train,
            fraction_evaluate=1.0,  # set below: 0 (our default) makes Flower warn at every start
            min_train_nodes=1,
            min_evaluate_nodes=0,
            min_available_nodes=cfg.min_available_nodes,
        )
        self.fraction_evaluate = cfg.fraction_evaluate
        self.cfg = cfg
        self.spec = spec or get_spec(cfg.algorithm)
        self.model: OrderedDict = OrderedDict((k, v.clone()) for k, v in initial_model.items())
        self.layout = layout_of(self.model)
        self.round = 0  # last completed training round
        self.records: dict[str, OrderedDict] = {}
        self.init_records()
        self.partition_of: dict[int, int] = {}  # node id -> partition id (handshake)
        self.num_partitions: int | None = None
        self.stats = RoundStats()
        self._messages: list[Message] = []  # this round's train messages (ids map error replies)

    # ------------------------------------------------------------------ algorithm hooks
    def init_records(self) -> None:
        """Allocate the algorithm's server state in ``self.records`` (default: none)."""

    def start_point(self) -> OrderedDict:
        """The model the clients start from and send back (default: the global model;
        FedACG: its look-ahead). Client updates are measured from it."""
        return self.model

    def broadcast(self, server_round: int) -> dict[str, OrderedDict]:
        """Extra records sent with the model: the spec's ``down`` names, from ``records``."""
        return {name: self.records[name] for name in self.spec.down}

    def update(self, server_round: int, updates: list[ClientUpdate], weights: list[float]) -> None:
        """Server half of the algorithm: new ``self.model`` (and records) from accepted updates."""
        raise NotImplementedError

    def federation_size(self) -> int:
        """N, the number of clients in the federation, learned in the partition handshake. The
        duals and control variates are averaged over it (never over the M replies instead)."""
        if self.num_partitions is None:
            raise RuntimeError(
                f"{self.spec.name}: the federation size N is unknown (no partition handshake yet); "
                "its server state is averaged over all N clients, so it cannot update without it")
        return self.num_partitions

    # ------------------------------------------------------------------ checkpointable state
    def state_dict(self) -> dict:
        return {
            "algorithm": self.spec.name,
            "round": self.round,
            "model": OrderedDict((k, v.clone()) for k, v in self.model.items()),
            "records": {n: OrderedDict((k, v.clone()) for k, v in r.items()) for n, r in self.records.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state["algorithm"] != self.spec.name:
            raise ValueError(f"checkpoint is for {state['algorithm']}, not {self.spec.name}")
        if layout_of(state["model"]) != self.layout:
            raise ValueError("checkpoint model does not match this run's model (keys/shapes/dtypes)")
        self.round = int(state["round"])
        self.model = OrderedDict((k, v.clone()) for k, v in state["model"].items())
        self.records = {n: OrderedDict((k, v.clone()) for k, v in r.items()) for n, r in state["records"].items()}

    # ------------------------------------------------------------------ nodes and sampling
    def wait_for_nodes(self, grid: Grid) -> list[int]:
        """Connected node ids. Before the first round: once ``min-available-nodes`` are up, or
        whatever is up at the deadline (``node-wait-timeout``); later rounds go on with the
        nodes that are up (waiting only while none is). NoNodesError if none."""
        deadline = time.monotonic() + self.cfg.node_wait_timeout
        wanted = self.min_available_nodes if not self.partition_of else 1
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= wanted:
                return nodes
            if time.monotonic() >= deadline:
                if nodes:
                    log.warning("only %d of %d required nodes connected after %.0fs; going on",
                                len(nodes), self.min_available_nodes, self.cfg.node_wait_timeout)
                    return nodes
                raise NoNodesError(
                    f"no SuperNode connected within node-wait-timeout={self.cfg.node_wait_timeout}s"
                )
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def handshake(self, grid: Grid, node_ids: list[int]) -> None:
        """Ask nodes not seen before which partition they hold (one ``query`` message each).

        Nodes that are no longer connected are forgotten first, so a restarted SuperNode
        (new node id, same partition) takes its partition back.
        """
        self.partition_of = {n: p for n, p in self.partition_of.items() if n in node_ids}
        new = [n for n in node_ids if n not in self.partition_of]
        if not new:
            return
        msgs = [Message(RecordDict({P.CONFIG: ConfigRecord({"run-algorithm": self.spec.name})}),
                        dst_node_id=n, message_type=MessageType.QUERY) for n in new]
        for reply in grid.send_and_receive(msgs, timeout=self.cfg.node_wait_timeout):
            if reply.has_error():
                log.error("node handshake failed: %s", reply.error.reason)
                continue
            metrics = reply.content.metric_records[P.METRICS]
            node, pid, n = reply.metadata.src_node_id, int(metrics["partition-id"]), int(metrics["num-partitions"])
            if self.num_partitions is None:
                self.num_partitions = n
            if n != self.num_partitions:
                log.error("node %d reports num-partitions=%d, the federation has %d; ignored",
                          node, n, self.num_partitions)
            elif pid in self.partition_of.values():
                log.error("node %d holds partition %d, which another node already holds; ignored",
                          node, pid)
            else:
                self.partition_of[node] = pid
        if not self.partition_of:
            raise NoNodesError("no node answered the partition handshake (see the errors above)")

    def available_partitions(self, grid: Grid) -> dict[int, int]:
        """partition id -> node id of every connected node that passed the handshake."""
        nodes = self.wait_for_nodes(grid)
        self.handshake(grid, nodes)
        return {self.partition_of[n]: n for n in nodes if n in self.partition_of}

    def wait_for_partitions(self, grid: Grid, wanted: list[int], timeout: float) -> dict[int, int]:
        """partition id -> node id, once every ``wanted`` partition has a connected node (e.g. a
        restarted SuperNode) or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            available = self.available_partitions(grid)
            if all(p in available for p in wanted) or time.monotonic() >= deadline:
                return available
            time.sleep(1.0)

    def sample(self, server_round: int, partitions: list[int], fraction: float) -> list[int]:
        """Partition ids for this round: ``fixed`` = fraction * N rounded half up, without replacement,
        ``bernoulli`` = each with probability ``fraction`` (redrawn if empty). Seeded by
        (seed, round) only."""
        rng = np.random.default_rng([self.cfg.seed, server_round])
        partitions = sorted(partitions)
        if self.cfg.sampling == "bernoulli":
            while True:
                chosen = [p for p in partitions if rng.random() < fraction]
                if chosen:
                    return chosen
        total = self.num_partitions or len(partitions)
        size = min(len(partitions), max(1, math.floor(fraction * total + 0.5)))
        return sorted(int(p) for p in rng.choice(partitions, size=size, replace=False))

    # ------------------------------------------------------------------ Flower hooks: train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send each the model, the round config and the extra records."""
        self.stats = RoundStats()
        self.model = P.from_record(arrays)
        available = self.available_partitions(grid)
        chosen = self.sample(server_round, list(available), self.fraction_train)
        config = ConfigRecord({**dict(config), "server-round": server_round})
        start = self.start_point()
        content = RecordDict({P.MODEL: arrays if start is self.model else P.to_record(start),
                              P.CONFIG: config})
        for name, tensors in self.broadcast(server_round).items():
            content[name] = P.to_record(tensors)
        msgs = [Message(content, dst_node_id=available[p], message_type=MessageType.TRAIN,
                        group_id=str(server_round)) for p in chosen]
        self._messages = msgs
        self.stats.clients_sampled = len(msgs)
        self.stats.sampled_partitions = list(chosen)
        self.stats.bytes_down = P.payload_bytes(content) * len(msgs)
        log.info("round %d: sampled partitions %s", server_round, chosen)
        return msgs

    def _node_of(self, reply: Message) -> int:
        """The node a reply belongs to (error replies may come from the SuperLink itself)."""
        for msg in self._messages:
            if msg.metadata.message_id == reply.metadata.reply_to_message_id:
                return msg.metadata.dst_node_id
        return reply.metadata.src_node_id

    def collect(self, server_round: int, replies: Iterable[Message]) -> list[ClientUpdate]:
        """Parse and validate the replies to ``self._messages``; log and count failures
        (error replies, and messages with no reply within ``round-timeout``) and rejections."""
        updates, answered = [], set()
        for reply in replies:
            node = self._node_of(reply)
            answered.add(reply.metadata.reply_to_message_id)
            pid = self.partition_of.get(node, -1)
            if reply.has_error():
                self._failed(server_round, pid, node, f"error {reply.error.code}: {reply.error.reason}")
                continue
            self.stats.bytes_up += P.payload_bytes(reply.content)
            try:
                updates.append(parse_train_reply(reply, node, pid, self.layout, self.spec.up))
            except RejectedReply as why:
                self._rejected(server_round, pid, node, str(why))
        for msg in self._messages:
            if msg.metadata.message_id not in answered:
                node = msg.metadata.dst_node_id
                self._failed(server_round, self.partition_of.get(node, -1), node,
                             f"no reply within round-timeout={self.cfg.round_timeout:g}s (client lost)")
        return sorted(updates, key=lambda u: u.partition_id)

    def _failed(self, server_round: int, pid: int, node: int, why: str) -> None:
        self.stats.clients_failed += 1
        self.stats.failed_partitions.append(pid)
        log.warning("round %d: client %d (node %d) failed: %s", server_round, pid, node, why)

    def _rejected(self, server_round: int, pid: int, node: int, why: str) -> None:
        self.stats.clients_rejected += 1
        self.stats.rejected_partitions.append(pid)
        log.warning("round %d: rejected reply of client %d (node %d): %s", server_round, pid, node, why)

    def reject_outliers(self, server_round: int, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """``outlier-norm-factor`` f > 0: reject updates with ||w_i - w|| > f * median of the
        round's update norms (with at least 3 updates; the median itself is never rejected)."""
        factor = self.cfg.outlier_norm_factor
        if factor <= 0 or len(updates) < 3:
            return updates
        start = self.start_point()
        norms = [math.sqrt(sum(float(((u.model[k] - v).double() ** 2).sum())
                               for k, v in start.items() if v.is_floating_point()))
                 for u in updates]
        limit = factor * float(np.median(norms))
        kept = []
        for u, norm in zip(updates, norms):
            if norm > limit:
                self._rejected(server_round, u.partition_id, u.node_id,
                               f"update norm {norm:.4g} > {factor:g} x round median {limit / factor:.4g}")
            else:
                kept.append(u)
        return kept

    def train_round(self, server_round: int, grid: Grid) -> RoundStats:
        """One training round: sample, send, collect; re-send to the sampled clients that gave
        no accepted reply (``too-few-replies = retry``, at most ``max-retries`` times) while
        fewer than ``min-replies`` updates are accepted; then update the model, or leave it
        unchanged (the round is skipped) if there are still too few."""
        msgs = list(self.configure_train(server_round, P.to_record(self.model), ConfigRecord(), grid))
        updates = self.collect(server_round, grid.send_and_receive(msgs, timeout=self.cfg.round_timeout))
        while (len(updates) < self.cfg.min_replies and self.cfg.too_few_replies == "retry"
               and self.stats.retries < self.cfg.max_retries):
            self.stats.retries += 1
            done = {u.partition_id for u in updates}
            missing = [p for p in self.stats.sampled_partitions if p not in done]
            log.warning("round %d: %d accepted replies < min-replies=%d; retry %d/%d: waiting for "
                        "clients %s", server_round, len(updates), self.cfg.min_replies,
                        self.stats.retries, self.cfg.max_retries, missing)
            available = self.wait_for_partitions(grid, missing, self.cfg.round_timeout)
            again = [p for p in missing if p in available]
            if not again:
                continue
            content = msgs[0].content
            self._messages = [Message(content, dst_node_id=available[p], message_type=MessageType.TRAIN,
                                      group_id=str(server_round)) for p in again]
            self.stats.bytes_down += P.payload_bytes(content) * len(again)
            replies = grid.send_and_receive(self._messages, timeout=self.cfg.round_timeout)
            updates = sorted(updates + self.collect(server_round, replies), key=lambda u: u.partition_id)
        self.stats.clients_replied = len(updates) + self.stats.clients_rejected
        self.finish_round(server_round, updates)
        return self.stats

    def finish_round(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """Apply the algorithm's server update to the accepted updates (if enough)."""
        updates = self.reject_outliers(server_round, updates)
        if len(updates) >= self.cfg.min_replies:
            weights = client_weights([u.num_examples for u in updates], self.cfg.aggregation)
            self.stats.train_loss = float(sum(w * u.train_loss for w, u in zip(weights, updates)))
            self.update(server_round, updates, weights)
        else:
            self.stats.skipped = 1
            log.warning("round %d skipped: %d accepted client updates < min-replies=%d; the global "
                        "model and server state are unchanged", server_round, len(updates),
                        self.cfg.min_replies)
        self.round = server_round

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's hook (for ``strategy.start``): validate, weight, apply the server update."""
        updates = self.collect(server_round, replies)
        self.stats.clients_replied = len(updates) + self.stats.clients_rejected
        self.finish_round(server_round, updates)
        metrics = MetricRecord({k: v for k, v in asdict(self.stats).items()
                                if v == v and v != []})  # drop NaN / empty
        return P.to_record(self.model), metrics

    # ------------------------------------------------------------------ Flower hooks: evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation on a ``fraction-evaluate`` sample of clients (0 = none)."""
        if self.fraction_evaluate == 0.0:
            return []
        available = self.available_partitions(grid)
        chosen = self.sample(server_round + 10**6, list(available), self.fraction_evaluate)
        content = RecordDict({P.MODEL: arrays,
                              P.CONFIG: ConfigRecord({**dict(config), "server-round": server_round})})
        return [Message(content, dst_node_id=available[p], message_type=MessageType.EVALUATE,
                        group_id=str(server_round)) for p in chosen]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Sample-weighted mean of the clients' eval-loss and eval-accuracy (invalid replies skipped)."""
        keys = ("eval-loss", "eval-accuracy")
        rows = []
        for reply in replies:
            if reply.has_error():
                log.warning("round %d: evaluation failed on node %d: %s", server_round,
                            self._node_of(reply), reply.error.reason)
                continue
            metrics = reply.content.metric_records.get(P.METRICS, {})
            try:
                metric_value(metrics, "num-examples", 1)
                for key in keys:
                    metric_value(metrics, key, 0)
            except RejectedReply as why:
                log.warning("round %d: evaluation reply ignored: %s", server_round, why)
                continue
            rows.append(metrics)
        if not rows:
            return None
        total = float(sum(m["num-examples"] for m in rows))
        return MetricRecord({k: float(sum(m[k] * m["num-examples"] for m in rows)) / total for k in keys})
