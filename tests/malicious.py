"""A malicious ClientApp, for tests only (never part of the product).

It runs the real ClientApp, then tampers with the reply. Which partitions misbehave, and
how, is given in-process by :func:`malicious_app` and in a deployment by the node-config key
``attack`` that the module-level :data:`app` reads (a Flower App whose ``clientapp`` is
``malicious:app``). An attack spec is one or more attack names joined by ``+``; each name
belongs to one stage (``query`` = the partition handshake, ``train``, ``evaluate``). Names
with a number take it after a colon: ``sign-flip:4.5``, ``scale:50``, ``steal:0``.

``fuzz:SEED`` sends a randomly malformed reply at every stage (its first handshake is a lie,
later ones are honest half of the time, so that it gets to train; see :func:`fuzz`); what it sent is logged in :data:`SENT`
(in-process runs read it back).

Colluding attackers (ALIE, IPM) need the honest clients' updates: :func:`colluding_grid` is an
in-process grid on which they act as an omniscient coalition (the threat model of their papers).
"""

from __future__ import annotations

import copy
import io
import json
import random
import statistics
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from flwr.app import (Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord,
                      RecordDict)
from flwr.clientapp import ClientApp

import flatflower.client.app as honest
from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.strategies.validation import MAX_LOSS

Tamper = Callable[[Message, Message, Context, float], Message]
SENT: list[dict] = []  # every malformed reply of a fuzzing client: {"node", "stage", "round", "kind"}


# ---------------------------------------------------------------------------- building blocks
def npy(value: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=False)
    return buffer.getvalue()


def lying_array(arr: Array, data: bytes) -> Array:
    """An Array whose header still says ``arr``'s dtype and shape, with other data."""
    return Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=arr.stype, data=data)


def with_first_array(reply: Message, make: Callable[[Array], Array]) -> Message:
    """The reply with the first array of its model record replaced by ``make(array)``."""
    record = reply.content.array_records[P.MODEL]
    key = next(iter(record.keys()))
    arrays = {k: (make(v) if k == key else v) for k, v in record.items()}
    reply.content[P.MODEL] = ArrayRecord(arrays)
    return reply


def with_metric(reply: Message, key: str, value) -> Message:
    """The reply with metric ``key`` set to ``value`` (None: removed). A value a MetricRecord
    cannot hold makes the client send its metrics as a ConfigRecord of the same name."""
    metrics = dict(reply.content.metric_records[P.METRICS])
    if value is None:
        metrics.pop(key, None)
    else:
        metrics[key] = value
    del reply.content[P.METRICS]
    try:
        reply.content[P.METRICS] = MetricRecord(metrics)
    except Exception:  # noqa: BLE001 - whatever Flower refuses
        reply.content[P.METRICS] = ConfigRecord(metrics)
    return reply


IDENTITY_KEYS = (P.PARTITION_ID, P.NONCE)  # in every reply's 'config' record, not its metrics


def with_identity(reply: Message, key: str, value) -> Message:
    """The reply with ``key`` of its 'config' record (partition-id, nonce) set to ``value``
    (None: removed)."""
    config = dict(reply.content.config_records.get(P.CONFIG, {}))
    if value is None:
        config.pop(key, None)
    else:
        config[key] = value
    reply.content[P.CONFIG] = ConfigRecord(config)
    return reply


def with_field(reply: Message, key: str, value) -> Message:
    """:func:`with_identity` for partition-id and nonce, :func:`with_metric` for the rest."""
    return (with_identity if key in IDENTITY_KEYS else with_metric)(reply, key, value)


def with_value(reply: Message, value: float) -> Message:
    """The reply with the first entry of its model's first array set to ``value`` (a valid,
    finite float32: a well-formed reply with one huge weight)."""
    def make(a: Array) -> Array:
        data = a.numpy().copy()
        data.flat[0] = value
        return Array(data)
    return with_first_array(reply, make)


EXTRA_RECORDS = {  # a record that is not the protocol's, of each type
    "config": lambda: ConfigRecord({"junk": "x" * 1000}),
    "metrics": lambda: MetricRecord({"junk": [0.0] * 1000}),
    "arrays": lambda: ArrayRecord({"x": Array(np.zeros(3, dtype=np.float32))}),
}


def with_record(reply: Message, name: str, record) -> Message:
    """The reply with ``record`` under ``name`` (added, or in place of the reply's own)."""
    reply.content[name] = record
    return reply


def scaled_update(reply: Message, msg: Message, factor: float) -> Message:
    """Model w + factor (w_i - w): a well-formed reply whose update is scaled (or flipped)."""
    start = codec.from_record(msg.content[P.MODEL])
    local = codec.from_record(reply.content[P.MODEL])
    reply.content[P.MODEL] = codec.to_record({k: start[k] + factor * (v - start[k]) for k, v in local.items()})
    return reply


def with_records(reply: Message, value: float) -> Message:
    """The reply with every array of its uploaded records (all but the model) set to ``value``:
    an honest model with, e.g., SCAFFOLD's Δc = 1e30."""
    for name, record in list(reply.content.array_records.items()):
        if name != P.MODEL:
            reply.content[name] = ArrayRecord({k: Array(np.full(tuple(a.shape), value, dtype=a.dtype))
                                               for k, a in record.items()})
    return reply


def replay(reply: Message, msg: Message, context: Context) -> Message:
    """This node's first train reply again, every round (kept in ``context.state``, so it
    works in a deployment too, where each message runs in a new ClientApp process)."""
    if "replay-model" not in context.state:
        context.state["replay-model"] = reply.content.array_records[P.MODEL]
        context.state["replay-metrics"] = reply.content.metric_records[P.METRICS]
    if "replay-config" not in context.state:
        context.state["replay-config"] = reply.content.config_records[P.CONFIG]
    content = RecordDict({P.MODEL: context.state["replay-model"],
                          P.METRICS: context.state["replay-metrics"],
                          P.CONFIG: context.state["replay-config"]})
    for name, record in reply.content.array_records.items():
        if name != P.MODEL:
            content[name] = record
    return Message(copy.deepcopy(content), reply_to=msg)


# ---------------------------------------------------------------------------- named attacks
ATTACKS: dict[str, tuple[str, Tamper]] = {
    # train: what arrives is not what the header claims
    "data-lie": ("train", lambda r, m, c, x: with_first_array(
        r, lambda a: lying_array(a, npy(np.array([1e30], dtype=np.float32))))),
    "shape-lie": ("train", lambda r, m, c, x: with_first_array(
        r, lambda a: lying_array(a, npy(np.zeros((3, 3), dtype=np.float32))))),
    "complex-nan": ("train", lambda r, m, c, x: with_first_array(
        r, lambda a: lying_array(a, npy(np.full(tuple(a.shape), np.nan + 1j * np.nan))))),
    "not-numpy": ("train", lambda r, m, c, x: with_first_array(
        r, lambda a: lying_array(a, b"\x93NUMPY garbage" + bytes(range(40))))),
    "oversized": ("train", lambda r, m, c, x: with_first_array(
        r, lambda a: lying_array(a, npy(np.zeros(10**6, dtype=np.float32))))),
    # train: metrics that claim weight
    "num-examples-list": ("train", lambda r, m, c, x: with_metric(r, "num-examples", [10, 20])),
    "num-examples-huge": ("train", lambda r, m, c, x: with_metric(r, "num-examples", 1.797e308)),
    "weight-inflation": ("train", lambda r, m, c, x: with_metric(r, "num-examples", 10**9)),
    "steps-inflation": ("train", lambda r, m, c, x: with_metric(r, "num-steps", 10**6)),
    # train: well-formed replies that poison
    "sign-flip": ("train", lambda r, m, c, x: scaled_update(r, m, -x)),
    "scale": ("train", lambda r, m, c, x: scaled_update(r, m, x)),
    "replay": ("train", lambda r, m, c, x: replay(r, m, c)),
    "records": ("train", lambda r, m, c, x: with_records(r, x)),  # e.g. records:1e30
    # the handshake
    "no-metrics": ("query", lambda r, m, c, x: Message(RecordDict(), reply_to=m)),
    "list-partition": ("query", lambda r, m, c, x: with_identity(r, "partition-id", [0, 1])),
    "one-partition": ("query", lambda r, m, c, x: with_identity(
        with_metric(r, "num-partitions", 1), "partition-id", 0)),
    "steal": ("query", lambda r, m, c, x: with_identity(r, "partition-id", int(x))),
    "huge-partition": ("query", lambda r, m, c, x: with_identity(r, "partition-id", 1_000_000)),
    # train: numbers far beyond meaning (x: the value)
    "train-loss": ("train", lambda r, m, c, x: with_metric(r, "train-loss", x)),
    "loss-before": ("train", lambda r, m, c, x: with_metric(r, "loss-before", x)),
    "huge-weight": ("train", lambda r, m, c, x: with_value(r, x)),
    # evaluation
    "accuracy-1000": ("evaluate", lambda r, m, c, x: with_metric(r, "eval-accuracy", 1000.0)),
    # a held-out set of x examples declared at the handshake (the weight of its evaluation)
    "heldout-claim": ("query", lambda r, m, c, x: with_metric(r, P.NUM_HELDOUT, int(x))),
    # accuracy 1 and loss 0 on its held-out set, claiming x examples when x > 1 (else its own count)
    "perfect-eval": ("evaluate", lambda r, m, c, x: with_metric(with_metric(
        r if x <= 1 else with_metric(r, P.NUM_EXAMPLES, int(x)), P.EVAL_ACCURACY, 1.0), P.EVAL_LOSS, 0.0)),
    "eval-loss": ("evaluate", lambda r, m, c, x: with_metric(r, "eval-loss", x)),
    # over the Fleet API, a reply as another node (tests/fleet_forgery.py; x: the update's factor)
    "answer-for": ("train", lambda r, m, c, x: answer_for(r, m, c, x)),
}
# records and metrics beyond the protocol, at every stage: e.g. train-extra-config, query-extra-key
for _stage in ("query", "train", "evaluate"):
    for _kind in EXTRA_RECORDS:
        ATTACKS[f"{_stage}-extra-{_kind}"] = (_stage, lambda r, m, c, x, k=_kind: with_record(
            r, "surprise", EXTRA_RECORDS[k]()))
    ATTACKS[f"{_stage}-extra-key"] = (_stage, lambda r, m, c, x: with_metric(r, "junk", [0.0] * 1000))
ATTACKS["query-long-device"] = ("query", lambda r, m, c, x: with_record(
    r, "node", ConfigRecord({"device": "x" * 1000})))


def answer_for(reply: Message, msg: Message, context: Context, factor: float) -> Message:
    """tests/fleet_forgery.py's attack: B's own update times ``factor``, under the identity of the
    partition its ``forge-target`` names; B's own reply goes out unchanged."""
    try:
        from fleet_forgery import answer_for_another  # beside this module, in a Flower App
    except ImportError:
        from tests.fleet_forgery import answer_for_another
    target = json.loads(Path(str(context.node_config["forge-target"])).read_text())
    forged = scaled_update(Message(copy.deepcopy(reply.content), reply_to=msg), msg, factor)
    forged = with_identity(forged, P.PARTITION_ID, int(target["partition"]))
    return answer_for_another(reply, msg, context, forged.content)


def parse(spec: str) -> dict[str, tuple[Tamper, float]]:
    """stage -> (tamper, its number) for an attack spec such as ``data-lie+accuracy-1000``."""
    out = {}
    for part in filter(None, spec.split("+")):
        name, _, arg = part.partition(":")
        if name == "fuzz":
            for stage in ("query", "train", "evaluate"):
                out[stage] = (fuzz, float(arg or 0))
            continue
        stage, tamper = ATTACKS[name]
        out[stage] = (tamper, float(arg) if arg else 1.0)
    return out


# ---------------------------------------------------------------------------- fuzzing
def _array_mutations(rng: random.Random) -> Callable[[Array], Array]:
    def mutate(a: Array) -> Array:
        kind = rng.choice(["one-element", "other-shape", "complex", "float64", "int", "garbage",
                           "empty", "truncated", "nan", "inf", "stype", "pickle-like", "huge"])
        shape = tuple(a.shape)
        data = {
            "one-element": lambda: npy(np.array([rng.uniform(-1e30, 1e30)], dtype=np.float32)),
            "other-shape": lambda: npy(np.zeros(tuple(s + 1 for s in shape), dtype=np.float32)),
            "complex": lambda: npy(np.zeros(shape, dtype=np.complex64)),
            "float64": lambda: npy(np.zeros(shape, dtype=np.float64)),
            "int": lambda: npy(np.zeros(shape, dtype=np.int32)),
            "garbage": lambda: rng.randbytes(rng.randint(0, 64)),
            "empty": lambda: b"",
            "truncated": lambda: a.data[: len(a.data) // 2],
            "nan": lambda: npy(np.full(shape, np.nan, dtype=np.float32)),
            "inf": lambda: npy(np.full(shape, -np.inf, dtype=np.float32)),
            "stype": lambda: a.data,
            "pickle-like": lambda: b"\x80\x04\x95" + rng.randbytes(30),
            "huge": lambda: npy(np.zeros(int(np.prod(shape)) * 4 + 1000, dtype=np.float32)),
        }[kind]()
        stype = "torch.Tensor" if kind == "stype" else a.stype
        return Array(dtype=a.dtype, shape=shape, stype=stype, data=data)
    return mutate


def fuzz(reply: Message, msg: Message, context: Context, seed: float) -> Message:
    """A randomly malformed version of ``reply`` (every choice is invalid for the server)."""
    stage = msg.metadata.message_type
    rnd = int(msg.content[P.CONFIG].get("server-round", 0)) if P.CONFIG in msg.content.config_records else 0
    rng = random.Random(f"{seed}-{context.node_id}-{stage}-{rnd}-{len(SENT)}")
    lied = any(s["node"] == context.node_id and s["stage"] == "query" for s in SENT)
    if stage == "query" and lied and rng.random() < 0.5:
        return reply  # after a first lie, an honest handshake now and then lets it train
    metric_lies = {
        "query": ["partition-id", "num-partitions", "num-examples", "nonce"],
        "train": ["partition-id", "num-examples", "num-steps", "train-loss", "nonce"],
        "evaluate": ["partition-id", "num-examples", "eval-loss", "eval-accuracy", "nonce"],
    }[stage]
    bad_values = [None, [1, 2], -1, 10**12, float("nan"), float("inf"), -0.5, 1.5, 2**62, 1e300, True]
    choices = ["metric", "no-metrics", "extra-record"]
    if stage == "train":
        choices += ["array", "array", "array", "missing-key", "extra-key", "missing-record"]
    kind = rng.choice(choices)
    if kind == "metric":
        key = rng.choice(metric_lies)
        record = (reply.content.config_records[P.CONFIG] if key in IDENTITY_KEYS
                  else reply.content.metric_records[P.METRICS])
        current = record.get(key)
        value = rng.choice([v for v in bad_values if v != current and not _harmless(key, v)])
        reply = with_field(reply, key, value)
        kind = f"metric {key}={value!r}"
    elif kind == "no-metrics":
        del reply.content[P.METRICS]
    elif kind == "extra-record":
        extra = rng.choice(sorted(EXTRA_RECORDS))
        reply = with_record(reply, "surprise", EXTRA_RECORDS[extra]())
        kind = f"extra {extra} record"
    elif kind == "array":
        reply = with_first_array(reply, _array_mutations(rng))
    elif kind == "missing-key":
        record = reply.content.array_records[P.MODEL]
        reply.content[P.MODEL] = ArrayRecord({k: v for i, (k, v) in enumerate(record.items()) if i})
    elif kind == "extra-key":
        record = dict(reply.content.array_records[P.MODEL])
        record["extra.weight"] = Array(np.zeros(2, dtype=np.float32))
        reply.content[P.MODEL] = ArrayRecord(record)
    elif kind == "missing-record":
        del reply.content[P.MODEL]
    SENT.append({"node": context.node_id, "stage": stage, "round": rnd, "kind": kind})
    return reply


def _harmless(key: str, value) -> bool:
    """Values a valid reply may hold for ``key`` (the fuzzer must only send invalid ones)."""
    if key in ("train-loss", "eval-loss"):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_LOSS
    if key == "eval-accuracy":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    return False


# ---------------------------------------------------------------------------- the ClientApps
def _tampered(handler, stage: str, attacks: Callable[[Context], str]):
    def run(msg: Message, context: Context) -> Message:
        reply = handler(msg, context)
        chosen = parse(attacks(context)).get(stage)
        return chosen[0](reply, msg, context, chosen[1]) if chosen else reply
    return run


def client_app(attacks: Callable[[Context], str]) -> ClientApp:
    """The real ClientApp whose replies ``attacks(context)`` (an attack spec) tampers with."""
    app = ClientApp()
    app.train()(_tampered(honest.train, "train", attacks))
    app.evaluate()(_tampered(honest.evaluate, "evaluate", attacks))
    app.query()(_tampered(honest.query, "query", attacks))
    return app


def malicious_app(attacks: Mapping[int, str]) -> ClientApp:
    """In-process: partition id -> attack spec."""
    return client_app(lambda context: attacks.get(int(context.node_config["partition-id"]), ""))


app = client_app(lambda context: str(context.node_config.get("attack", "")))
"""In a deployment: each SuperNode's ``--node-config "... attack='data-lie'"``."""


# ---------------------------------------------------------------------------- colluding attackers
def alie(honest: torch.Tensor, n: int, f: int, z: float | None) -> torch.Tensor:
    """"A little is enough" (Baruch et al. 2019): mean - z * std of the honest updates, per
    coordinate; z by default the paper's z_max for n clients of which f collude:
    Φ^-1((n - s) / n), s = floor(n / 2 + 1) - f."""
    if z is None:
        s = n // 2 + 1 - f
        z = statistics.NormalDist().inv_cdf((n - s) / n)
    return honest.mean(0) - z * honest.std(0)


def ipm(honest: torch.Tensor, n: int, f: int, epsilon: float | None) -> torch.Tensor:
    """Inner-product manipulation (Xie et al. 2020): -epsilon * the honest updates' mean."""
    return -(0.1 if epsilon is None else epsilon) * honest.mean(0)


COLLUDING = {"alie": alie, "ipm": ipm}


def colluding_grid(client_app: ClientApp, num_nodes: int, run_config, attack: str, attackers,
                   **kwargs):
    """In-process only: an InProcessGrid (runtime/engines/inprocess.py) on which partitions ``attackers``
    collude as an omniscient adversary, the threat model of the ALIE and IPM papers: each train
    round the grid collects every reply, then sets each attacker's model to start + the same
    malicious update, computed from the honest clients' updates of that round (``attack``:
    ``alie[:z]`` or ``ipm[:epsilon]``). The attackers' other uploads (records) stay honest."""
    from flatflower.runtime.engines.inprocess import InProcessGrid  # not in a deployed app (this module is its ClientApp)

    class ColludingGrid(InProcessGrid):
        def push_messages(self, messages):
            messages = list(messages)
            if not any(m.metadata.message_type == MessageType.TRAIN for m in messages):
                return super().push_messages(messages)
            pairs = {}
            for msg in messages:  # one by one: the coalition sees every reply before its own go out
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                pairs[msg.metadata.message_id] = (msg, self._deliver(msg))
            collude(list(pairs.values()), self.contexts, attack, set(attackers))
            self._land({i: reply for i, (_, reply) in pairs.items()})
            return list(pairs)

    return ColludingGrid(client_app, num_nodes, run_config, **kwargs)


def collude(pairs, contexts, attack: str, attackers: set[int]) -> None:
    """Set the attackers' models among one round's (message, reply) ``pairs`` to start + the
    attack's update (replies with an error are left alone)."""
    name, _, arg = attack.partition(":")

    def partition(msg: Message) -> int:
        return int(contexts[msg.metadata.dst_node_id].node_config["partition-id"])

    def flat_update(msg: Message, reply: Message) -> torch.Tensor:
        start, local = codec.from_record(msg.content[P.MODEL]), codec.from_record(reply.content[P.MODEL])
        return torch.cat([(local[k] - start[k]).reshape(-1).double() for k in start])

    good = [(msg, reply) for msg, reply in pairs if not reply.has_error()]
    honest = [flat_update(m, r) for m, r in good if partition(m) not in attackers]
    bad = [(m, r) for m, r in good if partition(m) in attackers]
    if not honest or not bad:
        return
    delta = COLLUDING[name](torch.stack(honest), len(pairs), len(bad), float(arg) if arg else None)
    for msg, reply in bad:
        start, at, model = codec.from_record(msg.content[P.MODEL]), 0, OrderedDict()
        for k, v in start.items():
            model[k] = v + delta[at:at + v.numel()].reshape(v.shape).to(v.dtype)
            at += v.numel()
        reply.content[P.MODEL] = codec.to_record(model)
