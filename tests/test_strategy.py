"""Tests for the server side: reply validation, bad and failing clients, sampling, node
waiting, aggregation arithmetic, checkpointable state, and Flower's own ``start()`` loop."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import flatflower.client.app as real_client
from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.common.config import RunConfig
from flatflower.runtime.engines.inprocess import InProcessGrid, run_inprocess
from flatflower.strategies.aggregate import client_weights, weighted_sum
from flatflower.strategies.strategy import NoNodesError
from flatflower.strategies.mofedsam import MoFedSAM
from flatflower.strategies.registry import ALGORITHMS
from flatflower.strategies.validation import (ClientUpdate, Expected, RejectedReply, layout_of,
                                   parse_train_reply)
from tests.helpers import MODEL, fast_config, make_strategy, metrics


# ----------------------------------------------------------------------------- reply validation
LAYOUT = layout_of(MODEL)


def reply_content(model: dict | None = None, metrics: dict | None = None, drop: tuple = (),
                  config: dict | None = None, **records) -> RecordDict:
    """A valid train reply of partition 1, patched: ``model``/``metrics``/``config`` entries
    replace (None: delete) keys, ``records`` add or replace ArrayRecords, ``drop`` deletes
    records."""
    tensors = OrderedDict((k, v.clone()) for k, v in MODEL.items())
    for key, value in (model or {}).items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    values = {"num-examples": 500, "num-steps": 2, "train-loss": 1.5}
    identity = {"partition-id": 1, "nonce": 7}
    for patch, target in ((metrics, values), (config, identity)):
        for key, value in (patch or {}).items():
            if value is None:
                del target[key]
            else:
                target[key] = value
    content = RecordDict({P.MODEL: codec.to_record(tensors), P.METRICS: MetricRecord(values),
                          P.CONFIG: ConfigRecord(identity)})
    for name, record in records.items():
        content[name] = record
    for name in drop:
        del content[name]
    return content


EXPECTED = Expected(partition_id=1, num_examples=500, nonce=7, num_steps=2, layout=LAYOUT)


def with_value(value: float) -> torch.Tensor:
    t = MODEL["1.weight"].clone()
    t[0, 0] = value
    return t


REJECTED = [
    ("nan", dict(model={"1.weight": with_value(float("nan"))}), "key '1.weight' has NaN or Inf"),
    ("inf", dict(model={"1.bias": torch.full((10,), float("inf"))}), "key '1.bias' has NaN or Inf"),
    ("shape", dict(model={"1.weight": torch.zeros(10, 21)}),
     "key '1.weight' is float32[10, 21], expected float32[10, 20]"),
    ("dtype", dict(model={"1.bias": torch.zeros(10, dtype=torch.float64)}),
     "key '1.bias' is float64[10], expected float32[10]"),
    ("missing-key", dict(model={"1.bias": None}), "missing keys ['1.bias']"),
    ("unexpected-key", dict(model={"2.weight": torch.zeros(3)}), "unexpected keys ['2.weight']"),
    ("extra-record", dict(global_update=codec.to_record(MODEL)),
     "array records ['arrays', 'global_update'] do not match the protocol ['arrays']"),
    ("no-model", dict(drop=(P.MODEL,)), "array records [] do not match the protocol ['arrays']"),
    ("no-metrics", dict(drop=(P.METRICS,)), "reply has no 'metrics' record"),
    ("num-examples-0", dict(metrics={"num-examples": 0}), "reply claims 0 examples, partition 1 has 500"),
    ("num-examples-inflated", dict(metrics={"num-examples": 10**9}),
     "reply claims 1000000000 examples, partition 1 has 500"),
    ("num-examples-float", dict(metrics={"num-examples": 500.0}), "'num-examples'=500.0 is not a whole number"),
    ("num-examples-list", dict(metrics={"num-examples": [500, 1]}), "is not a whole number"),
    ("num-examples-missing", dict(metrics={"num-examples": None}), "metrics lack 'num-examples'"),
    ("num-steps", dict(metrics={"num-steps": 3}), "reply claims 3 local steps, the round asks for 2"),
    ("loss-nan", dict(metrics={"train-loss": float("nan")}), "metric 'train-loss'=nan is out of range"),
    ("loss-negative", dict(metrics={"train-loss": -1.0}), "metric 'train-loss'=-1.0 is out of range"),
    ("partition-mismatch", dict(config={"partition-id": 2}), "reply claims partition 2, node holds 1"),
    ("no-partition", dict(config={"partition-id": None}), "config lacks 'partition-id'"),
    ("partition-text", dict(config={"partition-id": "1"}), "'partition-id'=1 is not a whole number"),
    ("no-nonce", dict(config={"nonce": None}), "config lacks 'nonce'"),
    ("stale-nonce", dict(config={"nonce": 8}), "does not echo this message's nonce"),
    ("nonce-bool", dict(config={"nonce": True}), "'nonce'=True is not a whole number"),
    ("no-config", dict(drop=(P.CONFIG,)), "reply has no 'config' record"),
    ("config-extra-key", dict(config={"num-examples": 10**9}), "config record 'config' has unexpected keys"),
    # bookkeeping is not a metric (a stock strategy would average it): the old place is refused
    ("partition-in-metrics", dict(metrics={"partition-id": 1}), "metrics hold unexpected keys ['partition-id']"),
    ("nonce-in-metrics", dict(metrics={"nonce": 7}), "metrics hold unexpected keys ['nonce']"),
    # what a client reports about itself (clients.jsonl only) is checked like every metric
    ("loss-before-nan", dict(metrics={"loss-before": float("nan")}), "'loss-before'=nan is out of range"),
    ("loss-after-negative", dict(metrics={"loss-after": -0.5}), "'loss-after'=-0.5 is out of range"),
    ("accuracy-above-1", dict(metrics={"heldout-accuracy-after": 1.5}),
     "'heldout-accuracy-after'=1.5 is out of range [0, 1]"),
    ("accuracy-list", dict(metrics={"accuracy-before": [0.5, 0.6]}), "is not a number"),
    ("loss-beyond-meaning", dict(metrics={"train-loss": 1e300}), "'train-loss'=1e+300 is out of range [0, 1e+06]"),
    # nothing beyond the protocol's records and keys; a reason stays short whatever the names
    ("extra-config", dict(surprise=ConfigRecord({"a": "b"})), "unexpected config records ['surprise']"),
    ("extra-metrics", dict(surprise=MetricRecord({"a": 1})), "unexpected metric records ['surprise']"),
    ("long-key", dict(metrics={"k" * 10**5: 1.0}), f"metrics hold unexpected keys ['{'k' * 40}']"),
]


@pytest.mark.parametrize(("case", "patch", "expected"), REJECTED, ids=[c for c, _, _ in REJECTED])
def test_invalid_reply_is_rejected(make_message, case: str, patch: dict, expected: str) -> None:
    msg = make_message(reply_content(**patch))
    with pytest.raises(RejectedReply) as why:
        parse_train_reply(msg, 1001, EXPECTED)
    assert expected in str(why.value)


def test_valid_reply_is_accepted(make_message) -> None:
    update = parse_train_reply(make_message(reply_content()), 1001, EXPECTED)
    assert (update.node_id, update.partition_id, update.num_examples, update.num_steps) == (1001, 1, 500, 2)
    assert update.train_loss == 1.5 and update.records == {} and update.reported == {}
    assert all(torch.equal(update.model[k], MODEL[k]) for k in MODEL)


def test_reported_metrics_are_kept_for_the_record(make_message) -> None:
    reported = {"loss-before": 2.5, "loss-after": 0.25, "accuracy-after": 0.75}
    update = parse_train_reply(make_message(reply_content(metrics=reported)), 1001, EXPECTED)
    assert update.reported == reported and update.num_examples == 500


def test_upload_records_are_validated_too(make_message) -> None:
    content = reply_content(extra=codec.to_record(MODEL))
    expected = dataclasses.replace(EXPECTED, uploads=("extra",))
    update = parse_train_reply(make_message(content), 1001, expected)
    assert update.records["extra"].keys() == MODEL.keys()
    bad = reply_content(extra=codec.to_record({**MODEL, "1.bias": torch.full((10,), float("nan"))}))
    with pytest.raises(RejectedReply, match="record 'extra' key '1.bias' has NaN"):
        parse_train_reply(make_message(bad), 1001, expected)


def test_real_client_reply_is_accepted() -> None:
    cfg = RunConfig.from_mapping(fast_config())
    strategy = make_strategy(cfg)
    grid = InProcessGrid(real_client.app, 2, cfg.to_dict())
    messages = list(strategy.configure_train(1, codec.to_record(strategy.model), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    assert len(replies) == 2
    for reply in replies:
        node = reply.metadata.src_node_id
        pid = int(grid.contexts[node].node_config["partition-id"])
        update = parse_train_reply(reply, node, strategy.expected(pid))
        assert update.partition_id == pid and update.num_examples == 1000
        wrong = 1 - pid  # the same reply, attributed to the other partition
        with pytest.raises(RejectedReply, match="claims partition"):
            parse_train_reply(reply, node, strategy.expected(wrong, strategy._nonces[pid]))
        with pytest.raises(RejectedReply, match="nonce"):  # the same reply in a later round
            parse_train_reply(reply, node, strategy.expected(pid, strategy._nonces[pid] + 1))


def _answered_for(reply: Message, theirs: Message, partition: int) -> Message:
    """Another node's ``reply`` turned into an answer to ``theirs`` (the message of
    ``partition``'s node), as a node that reaches the Fleet API with its own key can push it
    (tests/fleet_forgery.py): the content and nonce are its own, the identity is the victim's."""
    from tests.malicious import with_identity

    return with_identity(Message(copy.deepcopy(reply.content), reply_to=theirs), P.PARTITION_ID, partition)


def test_a_node_cannot_answer_another_nodes_train_or_evaluate_message() -> None:
    """Each message carries a nonce of its own: a reply to node 0's message made by node 1 (its
    own reply, under partition 0's name, before node 0 answers) is refused, and node 0's own
    reply still counts. With one nonce a round, it was taken for node 0's."""
    cfg = RunConfig.from_mapping(fast_config(num_partitions=3, fraction_evaluate=1.0))
    strategy = make_strategy(cfg)
    grid = InProcessGrid(real_client.app, 3, cfg.to_dict())
    for stage in ("train", "evaluate"):
        configure = strategy.configure_train if stage == "train" else strategy.configure_evaluate
        messages = list(configure(1, codec.to_record(strategy.model), ConfigRecord(), grid))
        assert len({int(m.content[P.CONFIG][P.NONCE]) for m in messages}) == len(messages) == 3
        replies = {strategy.participation.partition_of[r.metadata.src_node_id]: r
                   for r in grid.send_and_receive(messages)}
        victim = next(m for m in messages if strategy.participation.partition_of[m.metadata.dst_node_id] == 0)
        forged = _answered_for(replies[1], victim, 0)
        if stage == "train":
            updates = strategy.collect(1, [forged, replies[1], replies[2], replies[0]])
            assert [u.partition_id for u in updates] == [0, 1, 2]
            assert torch.equal(next(iter(updates[0].model.values())),
                               next(iter(codec.from_record(replies[0].content[P.MODEL]).values())))
        else:
            strategy.aggregate_evaluate(1, [forged, replies[1], replies[2], replies[0]])
        (refusal,) = [r for r in strategy.stats.rejections if r["stage"] == stage]
        assert refusal["partition"] == 0 and "nonce" in refusal["reason"], refusal


# ----------------------------------------------------------------------------- bad clients, end to end
def poisoning_client(mode: str, partition: int = 1) -> ClientApp:
    """The real ClientApp, except partition ``partition`` replies NaN (``nan``) or raises."""
    app = ClientApp()

    @app.train()
    def train(msg, context):
        reply = real_client.train(msg, context)
        if int(context.node_config["partition-id"]) == partition:
            if mode == "raise":
                raise RuntimeError("simulated client crash")
            model = codec.from_record(reply.content[P.MODEL])
            next(iter(model.values())).view(-1)[0] = float("nan")
            reply.content[P.MODEL] = codec.to_record(model)
        return reply

    @app.query()
    def query(msg, context):
        return real_client.query(msg, context)

    return app


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory) -> dict[str, Path]:
    """Three 2-round FedSAM runs over 3 clients: honest, one NaN client, one crashing client."""
    root = tmp_path_factory.mktemp("runs")
    runs = {}
    for mode in ("honest", "nan", "raise"):
        app = None if mode == "honest" else poisoning_client(mode)
        runs[mode], _ = run_inprocess(fast_config(run_dir=str(root / mode)), 3, client_app=app)
    return runs


def test_nan_client_is_rejected_every_round(bad_runs) -> None:
    rows = metrics(bad_runs["nan"])[1:]
    assert len(rows) == 2
    for row in rows:
        assert (row["clients_sampled"], row["clients_replied"]) == (3, 3)
        assert (row["clients_rejected"], row["clients_failed"]) == (1, 0)
    final = torch.load(bad_runs["nan"] / "model_final.pt")
    assert all(torch.isfinite(v).all() for v in final.values())
    assert rows[-1]["test_accuracy"] > 0.3  # 10 classes: chance is 0.1
    honest = metrics(bad_runs["honest"])[-1]
    assert honest["clients_rejected"] == 0
    assert abs(rows[-1]["test_accuracy"] - honest["test_accuracy"]) < 0.15


def test_crashing_client_is_counted_as_failed_and_the_run_completes(bad_runs) -> None:
    rows = metrics(bad_runs["raise"])[1:]
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert (row["clients_sampled"], row["clients_replied"]) == (3, 2)
        assert (row["clients_rejected"], row["clients_failed"]) == (0, 1)
    assert (bad_runs["raise"] / "summary.json").exists()


def test_rejected_and_failed_client_are_both_just_excluded(bad_runs) -> None:
    nan_model = torch.load(bad_runs["nan"] / "model_final.pt")
    raise_model = torch.load(bad_runs["raise"] / "model_final.pt")
    honest_model = torch.load(bad_runs["honest"] / "model_final.pt")
    assert nan_model.keys() == raise_model.keys()
    assert all(torch.equal(nan_model[k], raise_model[k]) for k in nan_model)
    assert any(not torch.equal(nan_model[k], honest_model[k]) for k in nan_model)


# ----------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("n", [3, 4, 10])
@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.5, 1.0])
def test_fixed_sampling_size_and_determinism(n: int, fraction: float) -> None:
    strategy = make_strategy(RunConfig.from_mapping(fast_config(fraction_train=fraction)))
    partitions = list(range(n))
    for rnd in range(1, 6):
        chosen = strategy.participation.sample(rnd, partitions, fraction)
        assert len(chosen) == len(set(chosen)) == max(1, round(fraction * n))
        assert set(chosen) <= set(partitions) and chosen == sorted(chosen)
        assert strategy.participation.sample(rnd, partitions[::-1], fraction) == chosen  # order-independent


def test_sampling_depends_on_seed_and_round_only() -> None:
    cfg = RunConfig.from_mapping(fast_config(fraction_train=0.3))
    a, b = make_strategy(cfg), make_strategy(cfg)
    other_seed = make_strategy(cfg.replace(seed=1))
    partitions = list(range(20))
    draws = [a.participation.sample(r, partitions, 0.3) for r in range(1, 11)]
    assert draws == [b.participation.sample(r, partitions, 0.3) for r in range(1, 11)]
    assert len({tuple(d) for d in draws}) > 1  # rounds differ
    assert draws != [other_seed.participation.sample(r, partitions, 0.3) for r in range(1, 11)]


def test_bernoulli_sampling_is_never_empty() -> None:
    cfg = RunConfig.from_mapping(fast_config(sampling="bernoulli", fraction_train=0.05))
    strategy = make_strategy(cfg)
    partitions = [0, 1, 2, 3, 4]
    draws = [strategy.participation.sample(r, partitions, 0.05) for r in range(1, 101)]
    assert all(d and set(d) <= set(partitions) and len(d) == len(set(d)) for d in draws)
    assert draws == [strategy.participation.sample(r, partitions, 0.05) for r in range(1, 101)]
    full = make_strategy(cfg.replace(fraction_train=1.0))
    assert full.participation.sample(7, partitions, 1.0) == partitions


def test_wait_for_nodes_gives_up_when_no_node_connects() -> None:
    cfg = RunConfig.from_mapping(fast_config(node_wait_timeout=0.5))
    grid = InProcessGrid(real_client.app, 3, cfg.to_dict())
    grid.offline = set(grid.contexts)
    strategy = make_strategy(cfg)
    start = time.monotonic()
    with pytest.raises(NoNodesError, match="node-wait-timeout=0.5"):
        strategy.participation.wait_for_nodes(grid)
    assert 0.4 <= time.monotonic() - start < 3.0
    with pytest.raises(NoNodesError):  # configure_train goes through the same wait
        strategy.configure_train(1, codec.to_record(strategy.model), ConfigRecord(), grid)


def test_wait_for_nodes_proceeds_with_fewer_nodes_after_the_deadline() -> None:
    cfg = RunConfig.from_mapping(fast_config(node_wait_timeout=0.5, min_available_nodes=5,
                                             num_partitions=3))
    grid = InProcessGrid(real_client.app, 3, cfg.to_dict())
    offline = max(grid.contexts)
    grid.offline = {offline}
    strategy = make_strategy(cfg)
    start = time.monotonic()
    nodes = strategy.participation.wait_for_nodes(grid)
    assert 0.4 <= time.monotonic() - start < 3.0
    assert nodes == sorted(set(grid.contexts) - {offline})
    messages = list(strategy.configure_train(1, codec.to_record(strategy.model), ConfigRecord(), grid))
    assert {m.metadata.dst_node_id for m in messages} == set(nodes)  # the offline node is skipped


def test_wait_for_nodes_returns_at_once_when_enough_nodes() -> None:
    cfg = RunConfig.from_mapping(fast_config(node_wait_timeout=30.0, min_available_nodes=2))
    grid = InProcessGrid(real_client.app, 2, cfg.to_dict())
    start = time.monotonic()
    assert make_strategy(cfg).participation.wait_for_nodes(grid) == sorted(grid.contexts)
    assert time.monotonic() - start < 0.5


# ----------------------------------------------------------------------------- aggregation
def test_client_weights() -> None:
    assert client_weights([100, 300], "weighted") == pytest.approx([0.25, 0.75])
    assert client_weights([100, 300], "uniform") == pytest.approx([0.5, 0.5])
    assert sum(client_weights([7, 1, 5], "weighted")) == pytest.approx(1.0)
    assert client_weights([3], "weighted") == [1.0]


def test_weighted_sum() -> None:
    a = OrderedDict(w=torch.tensor([1.0, 2.0]), b=torch.tensor(4.0))
    b = OrderedDict(w=torch.tensor([3.0, 6.0]), b=torch.tensor(0.0))
    out = weighted_sum([a, b], [0.25, 0.75])
    assert list(out) == ["w", "b"]
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0])) and torch.allclose(out["b"], torch.tensor(1.0))
    assert torch.equal(a["w"], torch.tensor([1.0, 2.0]))  # inputs untouched


def test_fedavg_update_is_the_weighted_model_average(make_message) -> None:
    cfg = RunConfig.from_mapping(fast_config())
    rule = ALGORITHMS["fedavg"].new_rule(cfg, MODEL)
    locals_ = [OrderedDict((k, v + i + 1) for k, v in MODEL.items()) for i in range(2)]
    updates = [
        parse_train_reply(make_message(RecordDict({
            P.MODEL: codec.to_record(m),
            P.METRICS: MetricRecord({"num-examples": n, "num-steps": 2, "train-loss": 1.0}),
            P.CONFIG: ConfigRecord({"partition-id": i, "nonce": 7}),
        })), 1000 + i, Expected(i, n, 7, 2, LAYOUT))
        for i, (m, n) in enumerate(zip(locals_, [100, 300]))
    ]
    assert rule.apply(1, updates, client_weights([100, 300], "weighted"))
    for k in MODEL:  # w + 0.25 * 1 + 0.75 * 2
        assert torch.allclose(rule.model[k], MODEL[k] + 1.75)


@pytest.mark.parametrize("algorithm", ["feddyn", "fedspeed", "fedsmoo", "fedgmt", "scaffold", "fedlesam-s"])
def test_duals_and_controls_need_the_federation_size(algorithm) -> None:
    """The server dual (FedDyn family) and control variate (SCAFFOLD family) are averaged over
    all N clients; without N (no partition handshake) the update is an error, never a silent
    division by the M replies. With N (fixed by the handshake) the strategy hands it to the
    rule and the round goes through."""
    cfg = RunConfig.from_mapping(fast_config(algorithm=algorithm))
    strategy = make_strategy(cfg)
    uploads = {name: OrderedDict((k, torch.ones_like(v)) for k, v in MODEL.items())
               for name in strategy.spec.up}
    update = ClientUpdate(1000, 0, 100, 2, 1.0, OrderedDict((k, v + 1) for k, v in MODEL.items()), uploads)
    with pytest.raises(RuntimeError, match="the federation size N is unknown"):
        strategy.finish_round(1, [update])
    strategy.participation.num_partitions = 4  # what the handshake fixes
    strategy.finish_round(1, [update])
    assert strategy.rule.federation_size() == 4 and strategy.stats.skipped == 0
    assert any(not torch.equal(strategy.model[k], MODEL[k]) for k in MODEL)


# ----------------------------------------------------------------------------- checkpointable state
def test_mofedsam_state_dict_round_trip(tmp_path: Path) -> None:
    cfg = RunConfig.from_mapping(fast_config(algorithm="mofedsam"))
    strategy = make_strategy(cfg)
    grid = InProcessGrid(real_client.app, 2, cfg.to_dict())
    for rnd in (1, 2):
        arrays, _ = strategy.aggregate_train(rnd, grid.send_and_receive(list(
            strategy.configure_train(rnd, codec.to_record(strategy.model), ConfigRecord(), grid))))
        strategy.rule.model = codec.from_record(arrays)
    state = strategy.state_dict()
    assert state["algorithm"] == "mofedsam" and state["round"] == 2
    assert set(state["records"]) == {P.GLOBAL_UPDATE}
    assert any(v.abs().sum() > 0 for v in state["records"][P.GLOBAL_UPDATE].values())

    torch.save(state, tmp_path / "ckpt.pt")
    fresh = make_strategy(cfg, seed=123)  # another initial model, Delta^0 = 0
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    assert fresh.round == 2
    assert all(torch.equal(fresh.model[k], strategy.model[k]) for k in strategy.model)
    ours, theirs = fresh.rule.records[P.GLOBAL_UPDATE], strategy.rule.records[P.GLOBAL_UPDATE]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert fresh.rule.broadcast().keys() == {P.GLOBAL_UPDATE}

    # the state dict is a copy: in-place changes to the live strategy do not reach it
    saved_bias = state["records"][P.GLOBAL_UPDATE]["1.bias"].clone()
    saved_weight = state["model"]["1.weight"].clone()
    strategy.rule.records[P.GLOBAL_UPDATE]["1.bias"].add_(1.0)
    strategy.model["1.weight"].add_(1.0)
    assert torch.equal(state["records"][P.GLOBAL_UPDATE]["1.bias"], saved_bias)
    assert torch.equal(state["model"]["1.weight"], saved_weight)
    # ... nor do they reach a strategy loaded from it
    assert torch.equal(fresh.rule.records[P.GLOBAL_UPDATE]["1.bias"], saved_bias)


def test_load_state_dict_rejects_another_algorithm() -> None:
    mofedsam = make_strategy(RunConfig.from_mapping(fast_config(algorithm="mofedsam")))
    fedavg = make_strategy(RunConfig.from_mapping(fast_config(algorithm="fedavg")))
    with pytest.raises(ValueError, match="checkpoint is for mofedsam, not fedavg"):
        fedavg.load_state_dict(mofedsam.state_dict())
    with pytest.raises(ValueError, match="checkpoint is for fedavg, not mofedsam"):
        mofedsam.load_state_dict(fedavg.state_dict())
    assert isinstance(mofedsam.rule, MoFedSAM) and fedavg.round == 0


# ----------------------------------------------------------------------------- Flower's start()
def test_strategy_runs_under_flowers_start_loop() -> None:
    cfg = RunConfig.from_mapping(fast_config(algorithm="fedavg"))
    strategy = make_strategy(cfg)
    initial = codec.to_record(strategy.model)
    grid = InProcessGrid(real_client.app, 3, cfg.to_dict())
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=2)
    assert isinstance(result.arrays, ArrayRecord)
    final, start = codec.from_record(result.arrays), codec.from_record(initial)
    assert final.keys() == start.keys()
    assert any(not torch.equal(final[k], start[k]) for k in final)
    assert all(torch.isfinite(v).all() for v in final.values())
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    assert result.train_metrics_clientapp[2]["clients_sampled"] == 3
    assert strategy.round == 2
    for context in grid.contexts.values():
        assert context.state.metric_records[real_client.META]["rounds-trained"] == 2


# ----------------------------------------------------------------------------- regressions found in review
def test_restarted_node_gets_its_partition_back() -> None:
    cfg = RunConfig.from_mapping(fast_config())
    strategy = make_strategy(cfg)
    grid = InProcessGrid(real_client.app, 2, cfg.to_dict())
    strategy.aggregate_train(1, grid.send_and_receive(list(
        strategy.configure_train(1, codec.to_record(strategy.model), ConfigRecord(), grid))))
    grid.contexts[3000] = grid.contexts.pop(1000)  # partition 0 reconnects as node 3000
    messages = list(strategy.configure_train(2, codec.to_record(strategy.model), ConfigRecord(), grid))
    assert {m.metadata.dst_node_id for m in messages} == {3000, 1001}


def test_malformed_evaluate_reply_is_refused_with_its_reason() -> None:
    cfg = RunConfig.from_mapping(fast_config(fraction_evaluate=1.0))
    strategy = make_strategy(cfg)
    grid = InProcessGrid(real_client.app, 2, cfg.to_dict())
    messages = strategy.configure_evaluate(1, codec.to_record(strategy.model), ConfigRecord(), grid)
    replies = grid.send_and_receive(messages)
    expected = dict(strategy.aggregate_evaluate(1, replies))
    assert 0.0 <= expected["federated-accuracy"] <= 1.0
    cases = {"eval-accuracy": (1000.0, "'eval-accuracy'=1000.0 is out of range [0, 1]"),
             "eval-loss": (float("nan"), "'eval-loss'=nan is out of range"),
             "num-examples": (10**6, "reply claims 1000000 examples")}
    for key, (value, reason) in cases.items():
        bad = copy.deepcopy(replies[1])
        bad.content.metric_records[P.METRICS][key] = value
        strategy.stats = type(strategy.stats)()
        assert dict(strategy.aggregate_evaluate(1, [replies[0], bad])) == dict(
            strategy.aggregate_evaluate(1, [replies[0]]))
        (refusal,) = [r for r in strategy.stats.rejections if r["stage"] == "evaluate"]
        assert reason in refusal["reason"] and refusal["partition"] == 1


def test_a_federated_evaluation_draws_its_clients_apart_from_training(tmp_path):
    """Evaluating on a sample of clients (fraction-evaluate) never changes who trains: its draws
    are seeded by (seed, round + EVALUATE_DRAWS), training's by (seed, round)."""
    import torch

    from flatflower.strategies.participation import EVALUATE_DRAWS, Participation

    runs = {}
    for evaluate in (0.0, 0.5):
        cfg = fast_config(run_dir=str(tmp_path / str(evaluate)), fraction_train=0.5,
                          fraction_evaluate=evaluate, num_server_rounds=3)
        runs[evaluate], _ = run_inprocess(cfg, 6)
    trained = {e: [r.get("sampled_partitions") for r in metrics(d)[1:]] for e, d in runs.items()}
    assert trained[0.0] == trained[0.5] and all(len(p) == 3 for p in trained[0.0])
    final = {e: torch.load(d / "model_final.pt", weights_only=True) for e, d in runs.items()}
    assert all(torch.equal(final[0.0][k], final[0.5][k]) for k in final[0.0])
    part = Participation(RunConfig.from_mapping(fast_config(fraction_train=0.5)))
    assert (part.sample_evaluate(2, list(range(6)), 0.5)
            == part.sample(2 + EVALUATE_DRAWS, list(range(6)), 0.5))
