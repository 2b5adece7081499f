"""Participation: which nodes take part, which partition each holds, and who trains a round.

The server decides identity and weight (docs/reliability.md, "The principle"); a node's word counts
only where the server checks it:

* N, the number of partitions, is the run config's ``num-partitions``, or (0) the number of
  nodes connected when the first round starts: never what a node reports;
* each node is asked once which partition it holds (a ``query`` handshake). A claim is
  accepted only if it is a whole number in [0, N), the node is configured for the same N, and
  no other connected node holds that partition (the first valid claim keeps it);
* the size of each partition is the server's own (it computes the same partition as the
  nodes); where it cannot know a size, the size a node declares at its handshake is fixed for
  the rest of the run. Aggregation weights and the expected number of local steps follow.

Trust model of the sizes the server cannot compute (``partition = local``: each node trains on
its own data; docs/local-data.md). The server cannot verify a node's data. It takes the
training-set size (and held-out size, the weight of the node's federated evaluation) a node
declares at the FIRST handshake of its partition, refuses a declaration < 1 or above
``max-node-examples``, and fixes it for the run (the checkpoint keeps it, so a resume holds
the node to it): a later handshake (a restarted node) or any train/evaluate reply that
declares another size is refused. So a node can lie once, within the bound, and never inflate
its weight mid-run; and since the local steps asked of a node follow from its declared size
(``local-epochs`` passes), a node that declares more examples must also run (and is checked
to report) more steps. ``aggregation = uniform`` removes sizes from the aggregation weights
entirely, for federations that trust no node's declaration. A declared held-out size costs a
node no work, so in federated evaluation it counts at most ``EVALUATE_WEIGHT_CAP`` times the
median size of the other nodes evaluated with it (:meth:`Participation.evaluation_weights`),
and a node that holds nothing out trains and is not evaluated (:meth:`Participation.evaluates`).

Sampling is deterministic in (seed, round) over partition ids, so the same seed samples the
same clients in-process, in simulation and in a deployment.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from flatflower.common import protocol as P
from flatflower.common import schema
from flatflower.common.config import RunConfig
from flatflower.strategies.validation import REASON_CHARS, RejectedReply, parse_handshake_reply

log = logging.getLogger("flwr.flatflower.server")

# (stage, partition id or -1, node id, reason): how a refused reply is reported
OnRefused = Callable[[str, int, int, str], None]

EVALUATE_DRAWS = 10**6  # evaluation rounds' sampling streams: (seed, round + this), apart from training's
# partition = local: a node's weight in federated evaluation is at most this many times the median
# held-out size of the other nodes evaluated in the same round (docs/local-data.md, "The trust model")
EVALUATE_WEIGHT_CAP = 2


class NoNodesError(RuntimeError):
    """No usable SuperNode connected, or none passed the handshake, before the deadline."""


POLL_FIRST, POLL_MAX = 0.01, 0.2  # seconds between pulls of replies: at least, at most
POLL_SHARE = 0.05  # and otherwise this share of the time waited so far
pause_between_pulls = time.sleep
# seconds a message outlives the wait for its reply (the last pull after the deadline); the
# message's TTL, which the SuperLink and the warm worker (runtime/deadline.py) enforce
TTL_MARGIN = 5.0


def expire_after(messages: Iterable[Message], timeout: float) -> None:
    """Give each message a TTL that ends ``TTL_MARGIN`` s after ``timeout`` s from now: when the
    server stops waiting for its reply. Flower's default is 12 hours, and a message nobody waits
    for any more (its round is over, its run failed or was stopped) was still handed to its node
    later, which ran it, and answered the next run's messages only after that (issue 44). With
    the TTL, the SuperLink never delivers such a message, refuses a reply to it, and the warm
    worker drops the task at once (or abandons it when the deadline passes while it runs)."""
    for msg in messages:
        msg.metadata.ttl = max(0.0, time.time() - msg.metadata.created_at) + timeout + TTL_MARGIN


def exchange(grid: Grid, messages: Iterable[Message], timeout: float, expire: bool = True) -> list[Message]:
    """Send ``messages`` and return the replies that arrive within ``timeout`` seconds: Flower's
    ``Grid.send_and_receive`` through its public ``push_messages``/``pull_messages`` (whose
    own wait is 3 s between pulls). The pause between pulls is 5% of the time waited so far,
    between 10 ms and 0.2 s, so the poll adds at most about 5% to a round of any length. A grid
    that can say when a reply lands (``wait_for_replies(ids, timeout)``: the in-process grids)
    is waited on instead, with no pause at all.
    ``expire``: the messages expire when the wait ends (:func:`expire_after`); the handshake's
    queries do not (a slow node's late answer is taken at a later round).
    Replies come in the order of the messages they answer, whatever order they arrived in."""
    wait = getattr(grid, "wait_for_replies", None)
    messages = list(messages)
    if expire:
        expire_after(messages, timeout)
    order = list(grid.push_messages(list(messages)))
    pending = set(order)
    start = time.monotonic()
    deadline = start + timeout
    replies: list[Message] = []
    while pending:
        last = time.monotonic() >= deadline  # the pull that starts at the deadline is the last
        with objects_by(deadline):
            got = [_unfinished(m, timeout) for m in grid.pull_messages(pending)]
        replies += got
        pending -= {m.metadata.reply_to_message_id for m in got}
        now = time.monotonic()
        if not pending or last:
            break
        if now >= deadline:  # one more pull, for the replies that arrived while this one ran
            continue
        if wait is not None:
            wait(pending, deadline - now)
            continue
        pause = min(POLL_MAX, max(POLL_FIRST, POLL_SHARE * (now - start)))
        pause_between_pulls(min(pause, deadline - now))
    rank = {message_id: i for i, message_id in enumerate(order)}
    return sorted(replies, key=lambda m: rank.get(m.metadata.reply_to_message_id, len(rank)))


UNFINISHED = ("its reply was still arriving when the server stopped waiting (round-timeout or "
              "node-wait-timeout): a slow or broken link")


@contextlib.contextmanager
def objects_by(deadline: float):
    """Flower's reply pulls (``pull_objects`` in the ServerApp: flwr 1.39's grid inflates each
    reply the SuperLink holds, which it holds as soon as the reply's header arrived) give up at
    ``deadline`` (``time.monotonic()``; at least one try each), retrying at most every second.

    Flower's own limits are 500 tries backing off to 10 s, two hours in all: a reply still
    uploading over a 256 kbit/s link held its round past round-timeout until it arrived, and
    one whose node was cut off mid-upload held it for minutes. Such a reply is an error reply
    (Flower's ``MESSAGE_UNAVAILABLE``: :func:`_unfinished`). The grid inflates the replies of
    one pull one after another, each with its own time limit; the deadline is the same for
    all, so the replies behind one still uploading are taken as soon as it gives up (one try:
    a reply whose content is in is taken) and a pull of many such replies still ends at the
    deadline. :func:`exchange` pulls once more after the deadline for the replies that arrived
    while a pull waited. A Flower whose pull has no such limits: unbounded."""
    try:
        from flwr.superlink.grid import http_grid
        from flwr.supercore.inflatable import inflatable_utils
    except ImportError:
        yield
        return
    flower_pull = inflatable_utils.pull_objects
    defaults = getattr(flower_pull, "__kwdefaults__", None) or {}
    if "max_time" not in defaults or "backoff_cap" not in defaults:
        yield
        return
    cap = min(defaults["backoff_cap"], 1.0)

    def bounded(*args, **kwargs):
        kwargs.update(max_time=max(0.0, deadline - time.monotonic()),
                      backoff_cap=min(kwargs.get("backoff_cap", cap), cap))
        return flower_pull(*args, **kwargs)

    modules = [m for m in (inflatable_utils, http_grid) if getattr(m, "pull_objects", None) is flower_pull]
    for module in modules:
        module.pull_objects = bounded
    try:
        yield
    finally:
        for module in modules:
            module.pull_objects = flower_pull


def _unfinished(reply: Message, timeout: float) -> Message:
    """A reply whose content did not arrive in time (Flower's grid makes it an error reply saying
    that "the object-push session expired"), said as it is."""
    from flwr.app import Error
    from flwr.common.constant import ErrorCode

    if reply.has_error() and reply.error.code == ErrorCode.MESSAGE_UNAVAILABLE:
        reply.error = Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason=f"{UNFINISHED} ({timeout:g}s)")
    return reply


def new_nonce() -> int:
    """A fresh random number a reply must echo (replies to earlier messages do not)."""
    return secrets.randbits(62)


def destinations(sent: Iterable[Message]) -> dict[str, int]:
    """Message id -> destination node, for :func:`node_of`."""
    return {msg.metadata.message_id: msg.metadata.dst_node_id for msg in sent}


def node_of(reply: Message, sent: Mapping[str, int]) -> int:
    """The node a reply belongs to: the destination of the message it answers (``sent``:
    :func:`destinations` of the messages; error replies may come from the SuperLink itself),
    else its source."""
    node = sent.get(reply.metadata.reply_to_message_id)
    return reply.metadata.src_node_id if node is None else node


def _asked(sent: Iterable[Message]) -> dict[str, tuple[int, int]]:
    """Message id -> (destination node, nonce) of handshake queries (once pushed: the grid
    gives each message its id)."""
    return {m.metadata.message_id: (m.metadata.dst_node_id, int(m.content[P.CONFIG][P.NONCE]))
            for m in sent}


def error_text(reply: Message, limit: int = REASON_CHARS) -> str:
    """An error reply's code and reason, bounded (``limit`` characters of the reason) and
    without control characters (it is shown to the operator)."""
    reason = re.sub(r"[\x00-\x1f\x7f]+", " ", str(reply.error.reason)).strip()
    # Flower writes a ClientApp exception as "<class 'ValueError'>:<'message'>"
    raised = re.match(r"<class '(?:[\w.]+\.)?(\w+)'>:<'", reason)
    if raised:
        reason = f"{raised.group(1)}: " + reason[raised.end():].removesuffix("'>")
    return f"error {reply.error.code}: {reason[:limit]}"


SETTINGS_CHARS = 1000  # how much of a node's "run config differs" line is kept (it names every key)

# What Flower's ClientApp raises on a query message when no query function is registered (a
# Message-API ClientApp without @app.query; a legacy client_fn ClientApp)
NO_QUERY = ("No query function registered", "Invalid message type: query")


def handshake_error(reply: Message) -> str:
    """Why a node's handshake failed, from its error reply: for a ClientApp that has no query
    function (a stock Flower ClientApp), what it misses and where the protocol is written; for
    one whose run config differs from the query's ``settings``, its line naming the keys."""
    text = error_text(reply)
    if any(sign in text for sign in NO_QUERY):
        return ("does not answer flatflower's partition handshake (query): its ClientApp registers no "
                "query function; see docs/protocol.md")
    raw = str(reply.error.reason)  # Flower's Ray engine wraps it in its traceback: found, not assumed first
    differ = raw.find(P.SETTINGS_DIFFER)
    if differ >= 0:  # the node compared the query's settings with its run config: its own line
        line = (raw[differ:].splitlines() or [""])[0].removesuffix("'>")
        return re.sub(r"[\x00-\x1f\x7f]+", " ", line)[:SETTINGS_CHARS].strip()
    return text


def medians_of_others(values: Sequence[float]) -> list[float]:
    """For each of ``values`` (at least 2), the median of all the others: one sort, O(n log n)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranked = [values[i] for i in order]
    low, high = (len(values) - 2) // 2, (len(values) - 1) // 2  # the middle of n - 1 values
    out = [0.0] * len(values)
    for rank, i in enumerate(order):  # the others, in order: ranked without position ``rank``
        out[i] = (ranked[low + (low >= rank)] + ranked[high + (high >= rank)]) / 2
    return out


class Participation:
    def __init__(self, cfg: RunConfig, partition_sizes: Callable[[int], Sequence[int]] | None = None,
                 settings: Mapping[str, Any] | None = None):
        """``partition_sizes(N)``: the number of training examples of each of N partitions, as
        the server computes them (None: taken from the handshakes). ``settings``: the run-config
        values every handshake query carries for the clients to compare with their own
        (``settings`` record, common/protocol.py; None: none sent)."""
        self.cfg = cfg
        self.settings = dict(settings or {})
        self.num_partitions: int | None = cfg.num_partitions or None
        self.sizes: dict[int, int] = {}  # partition id -> number of training examples
        # partition id -> its held-out examples, declared at its first handshake (0: it holds
        # none out, and federated evaluation measures its training data)
        self.heldout: dict[int, int] = {}
        self.partition_sizes = partition_sizes
        self.partition_of: dict[int, int] = {}  # node id -> partition id
        # partition id -> the last round whose reply entered a server update (absent: none);
        # each train message carries it as ``state-round`` (client/state.py)
        self.accepted: dict[int, int] = {}
        # handshake queries no longer waited for: message id -> (node id, nonce)
        self.unanswered: dict[str, tuple[int, int]] = {}
        self.silent: set[int] = set()  # nodes that once gave no answer within node-wait-timeout

    # ------------------------------------------------------------------ checkpointable state
    def state_dict(self) -> dict:
        state = {"num_partitions": self.num_partitions,
                 "sizes": {str(p): n for p, n in sorted(self.sizes.items())},
                 "accepted": {str(p): r for p, r in sorted(self.accepted.items())}}
        if any(self.heldout.values()):  # only once a node declared one (older checkpoints have none)
            state["heldout"] = {str(p): n for p, n in sorted(self.heldout.items())}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`; ValueError naming the first field that is wrong (or
        that disagrees with this run's N and partition sizes), and nothing restored then."""
        schema.any_table(state, "participation")
        state = {"heldout": {}, **state}
        schema.table(state, "participation", num_partitions=schema.whole(1), sizes=schema.anything,
                     accepted=schema.anything, heldout=schema.anything)
        n, sizes, heldout = state["num_partitions"], state["sizes"], state["heldout"]
        known = [str(p) for p in range(n) if isinstance(sizes, dict) and str(p) in sizes]
        schema.table(sizes, "participation.sizes", **dict.fromkeys(known, schema.whole(0)))
        schema.table(heldout, "participation.heldout",
                     **dict.fromkeys([str(p) for p in range(n) if str(p) in heldout], schema.whole(0)))
        sizes = {int(p): size for p, size in sizes.items()}  # the partitions known so far
        if self.num_partitions is not None and n != self.num_partitions:
            raise ValueError(f"participation.num_partitions is {n}, this run's is {self.num_partitions}")
        if self.partition_sizes is not None and sizes != dict(enumerate(map(int, self.partition_sizes(n)))):
            raise ValueError("participation.sizes differ from this run's partition sizes")
        accepted = state["accepted"]  # the clients' last accepted rounds, of known partitions
        schema.any_table(accepted, "participation.accepted")
        schema.table(accepted, "participation.accepted",
                     **dict.fromkeys([k for k in accepted if k in known], schema.whole(1)))
        self.num_partitions, self.sizes = n, sizes
        self.heldout = {int(p): m for p, m in heldout.items()}
        self.accepted = {int(p): r for p, r in accepted.items()}

    def state_round(self, partition_id: int) -> int:
        """The last round of ``partition_id`` the server accepted (0 = none): the client's
        state must be its state after that round."""
        return self.accepted.get(partition_id, 0)

    def commit(self, server_round: int, partition_ids: Iterable[int]) -> None:
        """The replies of ``partition_ids`` entered the server update of ``server_round``."""
        self.accepted.update({p: server_round for p in partition_ids})

    # ------------------------------------------------------------------ the federation
    def fix_size(self, connected: int) -> int:
        """N (and the partition sizes when the server can compute them), fixed at round 1."""
        if self.num_partitions is None:
            self.num_partitions = connected
            log.info("num-partitions=0: the federation has the %d nodes connected now", connected)
        if self.partition_sizes is not None and not self.sizes:
            self.sizes = {p: int(n) for p, n in enumerate(self.partition_sizes(self.num_partitions))}
        return self.num_partitions

    def num_examples(self, partition_id: int) -> int:
        return self.sizes[partition_id]

    def num_evaluated(self, partition_id: int) -> int:
        """The examples a federated evaluation of this partition measures (its evaluate reply
        must claim them; its weight): its held-out set, else its training set."""
        return self.heldout.get(partition_id) or self.sizes[partition_id]

    def evaluates(self, partition_id: int) -> bool:
        """Whether federated evaluation asks this partition: with partition = local only if it
        declared a held-out set (its training data is not what federated evaluation measures:
        a node that holds nothing out trains and is not evaluated); otherwise always."""
        return not self.cfg.local_data() or self.heldout.get(partition_id, 0) > 0

    def evaluation_weights(self, partition_ids: Iterable[int]) -> dict[int, int]:
        """Each evaluated partition's weight in the federated mean: :meth:`num_evaluated`, and
        with partition = local (a size only the node's word, which costs it no work) at most
        EVALUATE_WEIGHT_CAP times the median of the other partitions' sizes (rounded down), so
        that no node owns the mean."""
        sizes = {p: self.num_evaluated(p) for p in partition_ids}
        if not self.cfg.local_data() or len(sizes) < 2:
            return sizes
        others = medians_of_others(list(sizes.values()))
        return {p: min(n, int(EVALUATE_WEIGHT_CAP * m)) for (p, n), m in zip(sizes.items(), others)}

    def num_steps(self, partition_id: int) -> int:
        """The local steps a client of this partition takes in a round (tau_i)."""
        return self.cfg.num_steps(self.sizes[partition_id])

    # ------------------------------------------------------------------ nodes
    def wait_for_nodes(self, grid: Grid) -> list[int]:
        """Connected node ids. Before the first round: once ``min-available-nodes`` are up, or
        whatever is up at the deadline (``node-wait-timeout``); later rounds go on with the
        nodes that are up (waiting only while none is). NoNodesError if none."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.node_wait_timeout
        wanted = cfg.min_available_nodes if not self.partition_of else 1
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= wanted:
                return nodes
            if time.monotonic() >= deadline:
                if nodes:
                    log.warning("only %d of %d required nodes connected after %.0fs; going on",
                                len(nodes), cfg.min_available_nodes, cfg.node_wait_timeout)
                    return nodes
                raise NoNodesError(f"no SuperNode connected within node-wait-timeout={cfg.node_wait_timeout}s")
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def handshake(self, grid: Grid, node_ids: list[int], on_refused: OnRefused) -> None:
        """Ask the nodes not seen before which partition they hold (one ``query`` each) and
        accept the valid claims. Nodes no longer connected are forgotten first, so a restarted
        SuperNode (new node id, same partition) takes its partition back.

        A node that does not answer within ``node-wait-timeout`` is reported (a handshake
        refusal) and never waited for again: its query stays out, and an answer that comes
        later is taken at a later call, without a wait (a slow node joins late)."""
        connected = set(node_ids)  # (a set: thousands of nodes, every round)
        self.partition_of = {n: p for n, p in self.partition_of.items() if n in connected}
        self.unanswered = {m: q for m, q in self.unanswered.items() if q[0] in connected}
        holders = {p: n for n, p in self.partition_of.items()}  # partition id -> node id
        refusals = []

        def refuse(node: int, pid: int, why: str) -> None:
            refusals.append((node, why))
            on_refused("handshake", pid, node, why)

        if self.unanswered:  # answers that came after their wait
            late = dict(self.unanswered)
            for reply in grid.pull_messages(list(late)):
                self.unanswered.pop(reply.metadata.reply_to_message_id, None)
                self._claim(reply, late, refuse, holders)
        asked = {node for node, _ in self.unanswered.values()}
        new = [n for n in node_ids if n not in self.partition_of and n not in asked]
        if new:
            self.fix_size(len(node_ids))
            again = [n for n in new if n in self.silent]  # given up on once: asked, not waited for
            if again:
                msgs = self._queries(again)
                grid.push_messages(msgs)
                self.unanswered.update(_asked(msgs))
            first = [n for n in new if n not in self.silent]
            if first:
                msgs = self._queries(first)
                replies = exchange(grid, msgs, self.cfg.node_wait_timeout, expire=False)
                queries = _asked(msgs)
                for reply in replies:
                    self._claim(reply, queries, refuse, holders)
                    queries.pop(reply.metadata.reply_to_message_id, None)
                for message_id, (node, nonce) in queries.items():
                    self.unanswered[message_id] = (node, nonce)
                    self.silent.add(node)
                    refuse(node, -1, f"no answer to the partition handshake within node-wait-timeout="
                                     f"{self.cfg.node_wait_timeout:g}s, although the SuperLink sees it "
                                     "connected: its ClientApp (worker) is not running, still busy with "
                                     "earlier messages, or its link is too slow to fetch the app; not "
                                     "waited for again (it joins if it answers later)")
        if not self.partition_of:
            reasons = {why for _, why in refusals}
            if len(reasons) == 1 and next(iter(reasons)).startswith(P.SETTINGS_DIFFER):
                # not the nodes' fault but the run's (its two halves read different run configs): said once
                raise NoNodesError(f"{reasons.pop()} (no node passed the partition handshake: "
                                   f"{len(refusals)} refused for it)")
            listed = [f"node {node}: {why}" for node, why in refusals]
            more = f"; and {len(listed) - 4} more (the run log names each)" if len(listed) > 4 else ""
            raise NoNodesError("no node passed the partition handshake: "
                               + ("; ".join(listed[:4]) or "no node answered") + more)

    def _queries(self, node_ids: list[int]) -> list[Message]:
        """One handshake ``query`` for each node, each with a fresh nonce of its own (another
        node cannot answer for it: Strategy.train_messages)."""
        settings = {P.SETTINGS: ConfigRecord(self.settings)} if self.settings else {}
        return [Message(RecordDict({P.CONFIG: ConfigRecord({P.NONCE: new_nonce()}), **settings}),
                        dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids]

    def _claim(self, reply: Message, asked: Mapping[str, tuple[int, int]],
               refuse: Callable[[int, int, str], None], holders: dict[int, int]) -> None:
        """Accept or refuse the claim of a reply to one of the ``asked`` queries (see
        :func:`_asked`); a reply to none of them, or from a node already placed, is ignored.
        ``holders``: partition id -> node id of :attr:`partition_of`, kept in step with it."""
        node, nonce = asked.get(reply.metadata.reply_to_message_id, (None, 0))
        if node is None or node in self.partition_of:
            return  # not ours to answer, or a second reply
        if reply.has_error():
            refuse(node, -1, handshake_error(reply))
            return
        try:
            claim = parse_handshake_reply(reply, nonce, self.num_partitions, self.cfg.max_node_examples)
        except RejectedReply as why:
            refuse(node, -1, str(why))
            return
        pid, declared, heldout = claim.partition_id, claim.num_examples, claim.num_heldout or 0
        holder = holders.get(pid)
        if holder is not None:
            refuse(node, pid, f"claims partition {pid}, which node {holder} holds")
        elif self.sizes.setdefault(pid, declared) != declared:
            refuse(node, pid, f"declares {declared} examples, partition {pid} has {self.sizes[pid]}")
        elif self.heldout.setdefault(pid, heldout) != heldout:
            refuse(node, pid, f"declares {heldout} held-out examples, partition {pid} has "
                              f"{self.heldout[pid]} (fixed at its first handshake)")
        else:
            self.partition_of[node], holders[pid] = pid, node
            if not self.evaluates(pid):
                log.info("partition %d (node %d) holds no held-out data: it trains, and federated "
                         "evaluation does not ask it", pid, node)

    def available(self, grid: Grid, on_refused: OnRefused) -> dict[int, int]:
        """partition id -> node id of every connected node that passed the handshake."""
        nodes = self.wait_for_nodes(grid)
        self.handshake(grid, nodes, on_refused)
        return {self.partition_of[n]: n for n in nodes if n in self.partition_of}

    def wait_for_partitions(self, grid: Grid, wanted: list[int], timeout: float,
                            on_refused: OnRefused) -> dict[int, int]:
        """partition id -> node id, once every ``wanted`` partition has a connected node (e.g. a
        restarted SuperNode) or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            available = self.available(grid, on_refused)
            if all(p in available for p in wanted) or time.monotonic() >= deadline:
                return available
            time.sleep(1.0)

    # ------------------------------------------------------------------ sampling
    def sample_evaluate(self, server_round: int, partitions: list[int], fraction: float) -> list[int]:
        """:meth:`sample` for a federated evaluation: its own draws, seeded by (seed, round +
        EVALUATE_DRAWS), so that evaluating never shifts which clients train."""
        return self.sample(server_round + EVALUATE_DRAWS, partitions, fraction)

    def sample(self, server_round: int, partitions: list[int], fraction: float) -> list[int]:
        """Partition ids for this round: ``fixed`` = fraction * N rounded half up, without
        replacement, ``bernoulli`` = each with probability ``fraction`` (redrawn if empty).
        Seeded by (seed, round) only."""
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

    def inclusion_rate(self, pool: int, chosen: int, fraction: float) -> float:
        """The probability that :meth:`sample` picks a given one of the ``pool`` partitions it
        sampled from (what a privacy accountant needs as q): ``fixed``, the ``chosen`` of the
        pool; ``bernoulli``, ``fraction`` given that the draw is not empty (it is redrawn)."""
        if pool <= 0:
            return 0.0
        if self.cfg.sampling == "bernoulli":
            return min(1.0, fraction / -math.expm1(pool * math.log1p(-fraction))) if fraction < 1 else 1.0
        return min(1.0, chosen / pool)
