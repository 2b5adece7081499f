"""The ClientApp: ``train``, ``evaluate`` and ``query`` (partition handshake).

Per-client persistent state (client/state.py) lives in ``context.state`` or a state mirror on
disk. It is staged only as the last step of a successful ``train`` call (Flower's deployment
runtime keeps partial writes of a call that later raises; the simulation runtime drops them),
and a call starts from the state of the client's last round the server accepted.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.faults import Fault
from flatflower.client.layout import Layout
from flatflower.client.node import NodeSettings
from flatflower.client.state import ContextState, StateMirror, check_state
from flatflower.client.train import LocalResult, build_rule, local_train, round_generator, rule_outputs
from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.common.augment import Augment, train_augment
from flatflower.client import allowed_code
from flatflower.common.config import RunConfig
from flatflower.common.data import client_split, client_test_split, model_shape
from flatflower.common.datasets import Split
from flatflower.common.evaluate import evaluate as evaluate_model
from flatflower.common.models import ModelPool, build_model, check_importable
from flatflower.common.privacy import privatize
from flatflower.strategies import registry  # the algorithms (both halves); also registers their keys

log = logging.getLogger("flwr.flatflower.client")
META = "client-meta"  # MetricRecord in context.state: rounds trained, last round

app = ClientApp()


def keeps_buffers(cfg: RunConfig, model: torch.nn.Module) -> bool:
    """``buffers = local`` and a model with buffers: the client keeps its own (FedBN-style).
    Its buffers are a record of its client state (``local_buffers``) that the client rule never
    sees: loaded over the received ones before training (the first round: the received ones),
    stored after it, and used by its self-reports and its federated evaluation. It still
    uploads them; the server averages them for its own, central evaluation model."""
    return cfg.buffers == "local" and bool(Layout.of(model).buffers)


def _setup(context: Context) -> tuple[RunConfig, NodeSettings, torch.device]:
    allowed_code.check(context.run_config, context.node_config)  # before the run config imports any code
    cfg = RunConfig.parsed(context.run_config)
    node = NodeSettings.from_node_config(context.node_config)
    device = node.torch_device()
    if device.type == "cpu":
        torch.set_num_threads(node.threads)
    return cfg, node, device


MODEL_POOL = ModelPool()  # the models of this process's train and evaluate calls, kept for reuse


def _model(cfg: RunConfig, node: NodeSettings, arrays: ArrayRecord, device: torch.device):
    """(pool key, a model holding ``arrays``): give it back to MODEL_POOL when done."""
    input_shape, num_classes = model_shape(cfg, node.data_dir)
    key, model = MODEL_POOL.take(cfg.resolved_model(), input_shape, num_classes, device)
    try:
        Layout.of(model).load(codec.from_record(arrays))
    except BaseException:
        MODEL_POOL.give(key, model)
        raise
    return key, model


def _initial_weights(cfg: RunConfig, node: NodeSettings):
    """w^0, the run's initial global model (the server builds it from the same seed)."""
    input_shape, num_classes = model_shape(cfg, node.data_dir)
    return build_model(cfg.resolved_model(), input_shape, num_classes, seed=cfg.seed).state_dict()


def _store(cfg: RunConfig, node: NodeSettings, context: Context) -> ContextState | StateMirror:
    """Where this client's state lives: on disk under node-config ``state-dir``, else under the
    run config's ``client-state-dir`` (a relative one is inside the run directory), else in
    ``context.state``."""
    root = node.state_dir or cfg.client_state_path()
    return StateMirror(root, node.partition_id, cfg.checkpoint_every) if root else ContextState(context)


def _config(msg: Message) -> ConfigRecord | dict:
    """The message's ``config`` record, or {} when it has none (read by name: Flower's typed
    views build a new dict per access)."""
    config = msg.content.get(P.CONFIG)
    return config if isinstance(config, ConfigRecord) else {}


def _nonce(msg: Message) -> int:
    """The message's nonce, echoed in the reply (the server refuses replies without it)."""
    return int(_config(msg).get(P.NONCE, 0))


def _identity(msg: Message, node: NodeSettings) -> ConfigRecord:
    """Every reply's ``config`` record: the partition this node holds and the nonce of the
    message it answers. Bookkeeping, not measurements: in the MetricRecord a stock Flower
    strategy would average them (docs/protocol.md)."""
    return ConfigRecord({P.PARTITION_ID: node.partition_id, P.NONCE: _nonce(msg)})


def _state_round(msg: Message, server_round: int) -> int:
    """The client's last round the server accepted (``state-round``), before this one."""
    config = msg.content[P.CONFIG]
    if P.STATE_ROUND not in config:
        raise ValueError("the train message lacks 'state-round' (the server's last accepted round "
                         "of this client), which an algorithm with client state needs")
    accepted = config[P.STATE_ROUND]
    if isinstance(accepted, bool) or not isinstance(accepted, int) or not 0 <= accepted < server_round:
        raise ValueError(f"state-round={accepted!r} is not a round before {server_round}")
    return accepted


def _down_value(msg: Message, name: str) -> float:
    """A scalar the server sends in the train config (the algorithm's ``values``): a finite number."""
    config = msg.content[P.CONFIG]
    value = config[name] if name in config else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the train message's {name}={value!r} is not a finite number")
    return float(value)


def _sampled_clients(msg: Message) -> int:
    """M, the clients the server sampled this round (``sampled-clients``): the DP noise's scale."""
    config = msg.content[P.CONFIG]
    sampled = config[P.SAMPLED_CLIENTS] if P.SAMPLED_CLIENTS in config else None
    if isinstance(sampled, bool) or not isinstance(sampled, int) or sampled < 1:
        raise ValueError(f"dp.clip > 0, but the train message's {P.SAMPLED_CLIENTS}={sampled!r} is not a "
                         "number of clients >= 1: the noise cannot be calibrated")
    return sampled


def _check_server_sends(spec, cfg: RunConfig, msg: Message, local: bool) -> None:
    """ValueError (one line) naming what the run's algorithm needs in a train message beyond
    the model and ``server-round`` (its ``down`` records, its ``values``, ``state-round`` when
    the client keeps state, ``sampled-clients`` under DP): what only a flatflower server sends,
    so a stock Flower strategy (flwr.serverapp.strategy.FedAvg) driving this ClientApp learns
    which algorithm it cannot drive, instead of a KeyError."""
    config = _config(msg)
    missing = [f"record '{name}'" for name in spec.down if not isinstance(msg.content.get(name), ArrayRecord)]
    missing += [f"config '{name}'" for name in spec.values if name not in config]
    if (spec.state or local) and P.STATE_ROUND not in config:
        missing.append(f"config '{P.STATE_ROUND}'")
    if cfg.dp_clip > 0 and P.SAMPLED_CLIENTS not in config:
        missing.append(f"config '{P.SAMPLED_CLIENTS}'")
    if missing:
        raise ValueError(f"{spec.name} needs {', '.join(missing)} in every train message, which only a "
                         "flatflower server sends (flatflower.server.app:app): a stock Flower strategy can drive a "
                         "model-only algorithm (fedavg, fedsam, fedprox, ...) only; see docs/protocol.md")


@dataclass
class TrainCall:
    """One ``train`` message, opened: the data, model and client rule its local training
    needs (:meth:`open`), and the reply built from the training's outcome (:meth:`reply`).
    Every engine shares it: the ClientApp trains one call with ``local_train``; the vectorised
    engine (runtime/engines/vectorized.py) trains many calls' models at once, then replies to each."""

    msg: Message
    context: Context
    cfg: RunConfig
    node: NodeSettings
    server_round: int
    fault: Fault | None
    data: Split
    held_out: Split | None
    model: torch.nn.Module
    rule: ClientRule
    layout: Layout
    lr: float
    state: dict
    store: ContextState | StateMirror
    accepted: int  # the client's last round the server accepted: ``state`` is its state after it
    reported: dict | None  # the self-report before training (None: not made yet)
    pool_key: tuple
    after: dict | None = None  # the self-report after training, when the engine made it
    augment: Augment | None = None  # train-transform, with this call's own generator (common/augment.py)

    @classmethod
    def open(cls, msg: Message, context: Context, self_report: bool = True) -> TrainCall:
        """``self_report=False``: the engine makes the self-reports (``reported`` and ``after``)."""
        cfg, node, device = _setup(context)
        spec = registry.get(cfg.algorithm)
        server_round = int(msg.content[P.CONFIG][P.SERVER_ROUND])
        fault = Fault.parse(node.inject_fault)
        if fault:
            fault.before_training(server_round)
        data = client_split(cfg, node.partition_id, node.num_partitions, node.data_dir)
        if device.type == "cuda":
            data = data.to(device)  # the whole partition on the GPU (flatflower.common.datasets.Split.to)
        key, model = _model(cfg, node, msg.content[P.MODEL], device)
        try:
            _check_server_sends(spec, cfg, msg, keeps_buffers(cfg, model))
            broadcast = {name: codec.from_record(msg.content[name]) for name in spec.down}
            broadcast.update({name: _down_value(msg, name) for name in spec.values})
            store = _store(cfg, node, context)
            local = keeps_buffers(cfg, model)  # buffers = local: the state round is needed too
            accepted = _state_round(msg, server_round) if spec.state or local else 0
            state = store.load(accepted)
            if isinstance(store, StateMirror) and state:  # a file: damaged or edited, never trained with
                check_state(state, Layout.of(model), str(store.path(accepted)))
            own = state.pop(P.LOCAL_BUFFERS, None)  # never seen by the client rule
            if own is not None and local:  # this client's own statistics over the received ones
                Layout.of(model).load_buffers(own)
            lr = cfg.round_lr(server_round)
            rule, layout = build_rule(spec, cfg, model, broadcast, state, lr, lambda: _initial_weights(cfg, node))
            held_out = client_test_split(cfg, node.partition_id, node.num_partitions, node.data_dir)
            reported = _self_report(cfg, model, data, held_out, "before") if self_report else None
        except BaseException:
            MODEL_POOL.give(key, model)
            raise
        return cls(msg, context, cfg, node, server_round, fault, data, held_out, model, rule,
                   layout, lr, state, store, accepted, reported, key,
                   augment=train_augment(cfg.train_transform, cfg.seed, server_round, node.partition_id))

    def close(self) -> None:
        """Give the model back to the pool (the call is done with it)."""
        MODEL_POOL.give(self.pool_key, self.model)

    def train(self) -> LocalResult:
        """Train this call's model alone (flatflower.client.train.local_train), after its self-report."""
        if self.reported is None:  # opened without its self-report
            self.reported = _self_report(self.cfg, self.model, self.data, self.held_out, "before")
        return local_train(self.model, self.data, self.rule, self.cfg, self.lr, self.generator(), self.batch)

    def run(self) -> Message:
        """Train alone and reply: the ClientApp's path."""
        try:
            return self.reply(self.train())
        finally:
            self.close()

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One local training batch, the rows ``idx`` of this client's data, augmented by the
        run's train-transform (its draws from this call's own generator, in step order): the
        one place every engine builds a training batch."""
        return self.data.get(idx, augment=self.augment)

    def generator(self) -> torch.Generator:
        """This call's shuffling RNG (flatflower.client.train.round_generator)."""
        return round_generator(self.cfg.seed, self.server_round, self.node.partition_id)

    def reply(self, result: LocalResult) -> Message:
        """The reply to the train message, after ``self.model`` was trained; stages the
        client's new state (last: only a successful call changes it)."""
        cfg, node, model, server_round = self.cfg, self.node, self.model, self.server_round
        after = self.after if self.after is not None else _self_report(cfg, model, self.data,
                                                                        self.held_out, "after")
        reported = {**(self.reported or {}), **after}
        uploads, new_state = rule_outputs(self.rule, self.layout, model)
        weights = self.layout.weights()
        if cfg.dp_clip > 0:  # client-level DP: clip and noise the round's update (common/privacy.py)
            weights = privatize(weights, codec.from_record(self.msg.content[P.MODEL]), self.layout.names,
                                cfg.dp_clip, cfg.dp_noise_multiplier, _sampled_clients(self.msg), cfg.dp_clip_mode)
        if self.fault:
            weights = self.fault.corrupt(server_round, codec.from_record(self.msg.content[P.MODEL]), weights)
        content = RecordDict(
            {
                P.MODEL: codec.to_record(weights),
                P.METRICS: MetricRecord(
                    {
                        P.NUM_EXAMPLES: result.num_examples,
                        P.NUM_STEPS: result.num_steps,
                        P.TRAIN_LOSS: result.mean_loss,
                        **reported,
                    }
                ),
                P.CONFIG: _identity(self.msg, node),
            }
        )
        for name, tensors in uploads.items():
            content[name] = codec.to_record(tensors)
        if keeps_buffers(cfg, model):  # the statistics it trained to: its next round starts from them
            new_state[P.LOCAL_BUFFERS] = self.layout.own_buffers()
        if new_state:
            self.store.stage(server_round, self.accepted, {**self.state, **new_state})
        context = self.context
        meta = context.state.get(META)  # by name: the typed view builds a new dict
        meta = meta if isinstance(meta, MetricRecord) else MetricRecord({"rounds-trained": 0})
        context.state[META] = MetricRecord(
            {"rounds-trained": int(meta["rounds-trained"]) + 1, "last-round": server_round}
        )
        log.info("partition %d round %d: %d steps, loss %.4f", node.partition_id, server_round,
                 result.num_steps, result.mean_loss)
        return Message(content, reply_to=self.msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training with the run's algorithm."""
    call = TrainCall.open(msg, context)
    reply = call.run()
    if call.fault:
        time.sleep(call.fault.late_by(call.server_round))  # a straggler, for tests
    return reply


def _self_report(cfg: RunConfig, model, data, held_out, when: str) -> dict[str, float]:
    """``client-eval``: loss and accuracy of ``model`` on this client's training data (one
    forward pass, no gradients) and accuracy on its own held-out data where it has some; the
    server checks them and writes them to clients.jsonl, never aggregates them."""
    if not cfg.client_eval:
        return {}
    held = (evaluate_model(model, held_out, cfg.eval_batch_size)[1]
            if held_out is not None and len(held_out) else None)
    return report_of(when, evaluate_model(model, data, cfg.eval_batch_size), held)


def report_of(when: str, train: tuple[float, float], heldout_accuracy: float | None) -> dict[str, float]:
    """The self-report's metrics: (loss, accuracy) on the training data, held-out accuracy."""
    out = {P.self_report_key("loss", when): train[0], P.self_report_key("accuracy", when): train[1]}
    if heldout_accuracy is not None:
        out[P.self_report_key("heldout-accuracy", when)] = heldout_accuracy
    return {k: v for k, v in out.items() if math.isfinite(v)}  # an overflowed loss is not reported


def evaluation_split(cfg: RunConfig, node: NodeSettings) -> Split:
    """What federated evaluation measures the global model on: this client's own held-out
    data where it has some (partition = local: its test split), else its training split."""
    held_out = client_test_split(cfg, node.partition_id, node.num_partitions, node.data_dir)
    return held_out if held_out is not None and len(held_out) else client_split(cfg, node.partition_id, node.num_partitions,
                                                              node.data_dir)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on this client's held-out data (its training
    data when it has none): :func:`evaluation_split`."""
    cfg, node, device = _setup(context)
    data = evaluation_split(cfg, node)
    key, model = _model(cfg, node, msg.content[P.MODEL], device)
    try:
        if keeps_buffers(cfg, model) and P.STATE_ROUND in msg.content[P.CONFIG]:  # its own statistics
            own = _store(cfg, node, context).load(_state_round(msg, int(msg.content[P.CONFIG][P.SERVER_ROUND]) + 1))
            if P.LOCAL_BUFFERS in own:
                Layout.of(model).load_buffers(own[P.LOCAL_BUFFERS])
        loss, acc = evaluate_model(model, data, cfg.eval_batch_size)
    finally:
        MODEL_POOL.give(key, model)
    metrics = MetricRecord({P.NUM_EXAMPLES: len(data), P.EVAL_LOSS: loss, P.EVAL_ACCURACY: acc})
    return Message(RecordDict({P.METRICS: metrics, P.CONFIG: _identity(msg, node)}), reply_to=msg)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_settings(cfg: RunConfig, msg: Message) -> None:
    """ValueError (one line, naming every differing key with both values) when the handshake
    query's ``settings`` (the server's values of the keys both halves must agree on,
    common/protocol.py) differ from this client's run config: a server built from another run
    config than the ClientApps read (a ServerApp of one's own) would otherwise refuse every
    reply, round after round. Keys this client's run config lacks (another algorithm's; the
    ``algorithm`` key tells) are not compared; a query without settings is not checked."""
    settings = msg.content.get(P.SETTINGS)
    if not isinstance(settings, ConfigRecord):
        return
    own = cfg.to_dict()
    differ = [k for k in own if k in settings and settings[k] != own[k]]
    if differ:
        raise ValueError(
            f"{P.SETTINGS_DIFFER} {', '.join(differ)}: the server's "
            f"{', '.join(f'{k}={_shown(settings[k])}' for k in differ)}; the client's "
            f"{', '.join(f'{k}={_shown(own[k])}' for k in differ)} (both halves must read one run config: a "
            "ServerApp of your own builds its strategy from context.run_config, "
            "flatflower.server_strategy(algorithm, context.run_config))")


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Handshake: which partition this node holds, its training set's size and, where it has
    held-out data, that set's size (federated evaluation's weight); that the server's settings
    are this node's run config (:func:`check_settings`), that its data loads (and, with
    partition = local, fits the run's model: a one-line refusal naming its folder), and that
    the run's own model code imports here (a node without it is refused, the reason naming the
    module)."""
    cfg, node, device = _setup(context)
    check_settings(cfg, msg)
    check_importable(cfg.resolved_model())
    fault = Fault.parse(node.inject_fault)
    if fault:
        fault.before_query()
    data = client_split(cfg, node.partition_id, node.num_partitions, node.data_dir)
    held_out = client_test_split(cfg, node.partition_id, node.num_partitions, node.data_dir)
    metrics = MetricRecord({P.NUM_PARTITIONS: node.num_partitions, P.NUM_EXAMPLES: len(data),
                            **({P.NUM_HELDOUT: len(held_out)} if held_out is not None and len(held_out) else {})})
    return Message(RecordDict({P.METRICS: metrics, P.CONFIG: _identity(msg, node),
                               P.NODE: ConfigRecord({P.DEVICE: str(device)})}), reply_to=msg)
