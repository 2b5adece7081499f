"""Tests for the client side: batching, RNG, node settings and the ClientApp handlers.

The ClientApp is exercised through ``flatflower.runtime.engines.inprocess.InProcessGrid`` (real Flower
messages and contexts, one process, no ports).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from flatflower.client.app import META
from flatflower.client.app import app as client_app
from flatflower.client.node import NodeSettings
from flatflower.client.train import batch_indices, round_generator
from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.strategies import registry
from flatflower.common.config import RunConfig
from flatflower.common.data import dataset_for, partitions_for
from flatflower.common.models import build_model
from flatflower.runtime.engines.inprocess import InProcessGrid, run_inprocess
from tests.helpers import fast_config


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- batch_indices
@pytest.mark.parametrize("steps", [1, 3, 4, 10, 25])
def test_local_steps_gives_exactly_k_batches(steps: int) -> None:
    n, b = 100, 32  # ceil(100/32) = 4 batches per epoch
    batches = list(batch_indices(n, b, local_epochs=7, local_steps=steps, generator=generator()))
    assert len(batches) == steps
    assert all(1 <= len(x) <= b for x in batches)


@pytest.mark.parametrize(("n", "b", "epochs"), [(100, 32, 1), (100, 32, 3), (64, 64, 2), (5, 32, 4)])
def test_local_epochs_gives_full_passes(n: int, b: int, epochs: int) -> None:
    batches = list(batch_indices(n, b, local_epochs=epochs, local_steps=0, generator=generator()))
    per_epoch = math.ceil(n / b)
    assert len(batches) == epochs * per_epoch
    assert sum(len(x) for x in batches) == epochs * n


def _epochs(batches: list[torch.Tensor], per_epoch: int) -> list[torch.Tensor]:
    return [torch.cat(batches[i: i + per_epoch]) for i in range(0, len(batches), per_epoch)]


def test_each_epoch_is_a_permutation() -> None:
    n, b = 100, 32
    batches = list(batch_indices(n, b, local_epochs=3, local_steps=0, generator=generator()))
    epochs = _epochs(batches, math.ceil(n / b))
    assert len(epochs) == 3
    for order in epochs:
        assert torch.equal(torch.sort(order).values, torch.arange(n))
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled every epoch


def test_local_steps_roll_over_epochs_as_permutations() -> None:
    n, b = 100, 32
    batches = list(batch_indices(n, b, local_epochs=1, local_steps=10, generator=generator()))
    full, rest = _epochs(batches[:8], 4), torch.cat(batches[8:])
    for order in full:  # steps 1-8: two complete passes
        assert torch.equal(torch.sort(order).values, torch.arange(n))
    assert len(rest) == 2 * b and len(set(rest.tolist())) == 2 * b  # start of a third pass


def test_batch_indices_deterministic_for_the_same_seed() -> None:
    def draw(seed: int) -> list[list[int]]:
        return [x.tolist() for x in batch_indices(50, 8, 2, 0, generator(seed))]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


@pytest.mark.parametrize(("n", "b", "epochs", "steps"),
                         [(100, 32, 3, 0), (100, 32, 1, 10), (64, 64, 2, 0), (5, 32, 4, 0), (18, 32, 5, 0),
                          (100, 32, 1, 4), (100, 32, 1, 5), (7, 3, 1, 1)])
def test_batches_are_drawn_a_pass_at_a_time_as_the_loop_always_drew_them(n, b, epochs, steps) -> None:
    """round_order (all the round's batches at once, which batch_indices hands out one at a
    time) draws what the loop drew lazily: a randperm of the n rows when a pass begins, its
    consecutive slices as the batches; the same indices from the same generator, bit for bit,
    and the generator left where the loop left it (one draw per pass begun, none more)."""
    from flatflower.client.train import round_order

    def lazily(g):
        batches, total = [], steps or epochs * math.ceil(n / b)
        while len(batches) < total:
            order = torch.randperm(n, generator=g)
            batches += [order[i:i + b] for i in range(0, n, b)][:total - len(batches)]
        return batches

    want_gen, got_gen = generator(5), generator(5)
    want = lazily(want_gen)
    order, sizes = round_order(n, b, epochs, steps, got_gen)
    assert sizes == [len(x) for x in want]
    assert torch.equal(order, torch.cat(want))
    assert [x.tolist() for x in batch_indices(n, b, epochs, steps, generator(5))] == [x.tolist() for x in want]
    assert torch.equal(torch.randperm(n, generator=got_gen), torch.randperm(n, generator=want_gen))


def test_round_generator_depends_on_seed_round_and_partition() -> None:
    def first_draw(seed: int, rnd: int, pid: int) -> list[int]:
        return torch.randperm(100, generator=round_generator(seed, rnd, pid)).tolist()

    base = first_draw(0, 1, 0)
    assert first_draw(0, 1, 0) == base
    assert first_draw(0, 2, 0) != base  # another round
    assert first_draw(0, 1, 1) != base  # another partition
    assert first_draw(1, 1, 0) != base  # another seed
    seeds = {round_generator(0, r, p).initial_seed() for r in range(1, 6) for p in range(5)}
    assert len(seeds) == 25


# ----------------------------------------------------------------------------- NodeSettings
def test_node_settings_parse_and_defaults() -> None:
    node = NodeSettings.from_node_config({"partition-id": "2", "num-partitions": 4})
    assert (node.partition_id, node.num_partitions, node.device, node.threads) == (2, 4, "auto", 1)


@pytest.mark.parametrize("missing", ["partition-id", "num-partitions"])
def test_node_settings_missing_key_mentions_node_config(missing: str) -> None:
    config = {"partition-id": 0, "num-partitions": 2}
    del config[missing]
    with pytest.raises(ValueError, match=f"lacks '{missing}'.*--node-config"):
        NodeSettings.from_node_config(config)


@pytest.mark.parametrize("pid", [-1, 3, 10])
def test_node_settings_partition_out_of_range(pid: int) -> None:
    with pytest.raises(ValueError, match=rf"partition-id {pid} is out of range \[0, 2\]"):
        NodeSettings.from_node_config({"partition-id": pid, "num-partitions": 3})


def test_node_settings_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="threads must be >= 1"):
        NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 1, "threads": 0})
    with pytest.raises(ValueError, match="num-partitions must be >= 1"):
        NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 0})
    with pytest.raises(ValueError, match="must be a whole number"):
        NodeSettings.from_node_config({"partition-id": "first", "num-partitions": 2})


def test_device_cpu_is_honoured() -> None:
    node = NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 1, "device": "cpu"})
    assert node.torch_device() == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error() -> None:
    for device in ("cuda", "cuda:0"):
        node = NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 1, "device": device})
        with pytest.raises(ValueError, match=f"device='{device}' requested but CUDA is not available"):
            node.torch_device()
    for auto in ({}, {"device": "auto"}):  # the default, and said explicitly
        node = NodeSettings.from_node_config({"partition-id": 0, "num-partitions": 1, **auto})
        assert node.torch_device() == torch.device("cpu")


# ----------------------------------------------------------------------------- ClientApp
def make_strategy(cfg: RunConfig):
    """The run's strategy, from the registry, with the seeded initial model."""
    data = dataset_for(cfg)
    model = build_model(cfg.resolved_model(), data.input_shape, data.num_classes, seed=cfg.seed)
    return registry.get(cfg.algorithm).new_strategy(cfg, model.state_dict())


def state_view(context) -> dict:
    """A comparable snapshot of ``context.state``."""
    state = context.state
    return {
        "metrics": {k: dict(v) for k, v in state.metric_records.items()},
        "configs": {k: dict(v) for k, v in state.config_records.items()},
        "arrays": {k: {n: a.numpy().tolist() for n, a in v.items()}
                   for k, v in state.array_records.items()},
    }


def train_message(strategy, node_id: int, server_round: int = 1) -> Message:
    content = RecordDict({P.MODEL: codec.to_record(strategy.model),
                          P.CONFIG: ConfigRecord({"server-round": server_round})})
    for name, tensors in strategy.rule.broadcast().items():
        content[name] = codec.to_record(tensors)
    return Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN,
                   group_id=str(server_round))


def test_client_meta_counts_rounds_in_a_full_run(tmp_path: Path) -> None:
    _, grid = run_inprocess(fast_config(num_server_rounds=3, run_dir=str(tmp_path / "run")), 3)
    for context in grid.contexts.values():
        meta = context.state.metric_records[META]
        assert (meta["rounds-trained"], meta["last-round"]) == (3, 3)


def test_unsampled_nodes_keep_their_state() -> None:
    cfg = RunConfig.from_mapping(fast_config(fraction_train=0.5, num_server_rounds=3))
    strategy = make_strategy(cfg)
    grid = InProcessGrid(client_app, 4, cfg.to_dict())
    node_of = {int(c.node_config["partition-id"]): n for n, c in grid.contexts.items()}
    trained = {n: 0 for n in grid.contexts}
    for rnd in range(1, cfg.num_server_rounds + 1):
        before = {n: state_view(c) for n, c in grid.contexts.items()}
        messages = list(strategy.configure_train(rnd, codec.to_record(strategy.model), ConfigRecord(), grid))
        sampled = {m.metadata.dst_node_id for m in messages}
        assert sampled == {node_of[p] for p in strategy.participation.sample(rnd, [0, 1, 2, 3], 0.5)}
        assert len(sampled) == 2
        strategy.aggregate_train(rnd, grid.send_and_receive(messages))
        assert strategy.stats.clients_replied == 2 and strategy.stats.clients_failed == 0
        for node, context in grid.contexts.items():
            if node in sampled:
                trained[node] += 1
                meta = context.state.metric_records[META]
                assert (meta["rounds-trained"], meta["last-round"]) == (trained[node], rnd)
            else:
                assert state_view(context) == before[node], f"round {rnd}: node {node} changed"
    assert sum(trained.values()) == 6


def test_failed_call_is_an_error_reply_and_keeps_state() -> None:
    cfg = RunConfig.from_mapping(fast_config())
    strategy = make_strategy(cfg)
    grid = InProcessGrid(client_app, 2, cfg.to_dict())
    node = min(grid.contexts)
    (ok,) = grid.send_and_receive([train_message(strategy, node, 1)])
    assert not ok.has_error()
    before = state_view(grid.contexts[node])
    assert before["metrics"][META]["rounds-trained"] == 1

    # 1) the node's own settings are wrong: partition-id out of range
    grid.contexts[node].node_config["partition-id"] = 7
    (reply,) = grid.send_and_receive([train_message(strategy, node, 2)])
    assert reply.has_error() and reply.error.code == 2
    assert "partition-id 7 is out of range" in reply.error.reason
    assert state_view(grid.contexts[node]) == before

    # 2) local training raises: a non-finite global model makes the loss NaN
    grid.contexts[node].node_config["partition-id"] = 0
    strategy.rule.model = {k: torch.full_like(v, float("nan")) for k, v in strategy.model.items()}
    (reply,) = grid.send_and_receive([train_message(strategy, node, 2)])
    assert reply.has_error()
    assert "FloatingPointError" in reply.error.reason and "local loss became nan" in reply.error.reason
    assert state_view(grid.contexts[node]) == before


def test_train_reply_follows_the_protocol() -> None:
    cfg = RunConfig.from_mapping(fast_config(algorithm="mofedsam", local_steps=3))
    strategy = make_strategy(cfg)
    grid = InProcessGrid(client_app, 2, cfg.to_dict())
    node = max(grid.contexts)
    (reply,) = grid.send_and_receive([train_message(strategy, node)])
    assert not reply.has_error()
    assert set(reply.content.array_records) == {P.MODEL}
    metrics = reply.content.metric_records[P.METRICS]
    assert (reply.content[P.CONFIG]["partition-id"], metrics["num-examples"], metrics["num-steps"]) == (1, 1000, 3)
    assert not {"partition-id", "nonce"} & set(metrics)  # bookkeeping is no metric
    assert metrics["train-loss"] > 0
    model = codec.from_record(reply.content[P.MODEL])
    assert model.keys() == strategy.model.keys()
    assert any(not torch.equal(model[k], strategy.model[k]) for k in model)  # it trained


def test_query_reports_partition_and_size() -> None:
    cfg = RunConfig.from_mapping(fast_config(partition="dirichlet"))
    grid = InProcessGrid(client_app, 3, cfg.to_dict(), node_config={"device": "cpu"})
    messages = [Message(RecordDict({P.CONFIG: ConfigRecord({"run-algorithm": cfg.algorithm})}),
                        dst_node_id=n, message_type=MessageType.QUERY) for n in sorted(grid.contexts)]
    replies = grid.send_and_receive(messages)
    sizes = [len(p) for p in partitions_for(cfg, 3)]
    assert len(replies) == 3
    for i, reply in enumerate(replies):
        assert not reply.has_error()
        metrics = reply.content.metric_records[P.METRICS]
        assert (reply.content[P.CONFIG]["partition-id"], metrics["num-partitions"], metrics["num-examples"]) \
            == (i, 3, sizes[i])
        assert reply.content.config_records["node"]["device"] == "cpu"
    assert sum(sizes) == 2000 and len(set(sizes)) > 1  # dirichlet: unequal sizes, all data
    assert all(state_view(c)["metrics"] == {} for c in grid.contexts.values())  # query keeps state


def test_query_compares_the_servers_settings_with_its_own_run_config() -> None:
    """The handshake query carries the server's values of the keys both halves must agree on
    (protocol.SETTINGS): equal values are answered as before; a difference is an error reply
    in one line naming every differing key with both values (issue 57, item 7); the server
    keeps that line whole, even wrapped in the traceback Flower's Ray engine puts around it."""
    from types import SimpleNamespace

    from flwr.app import Error

    from flatflower.strategies.participation import handshake_error
    from flatflower.strategies.strategy import shared_settings

    cfg = RunConfig.from_mapping(fast_config(algorithm="fedsam"))
    grid = InProcessGrid(client_app, 2, cfg.to_dict())
    node = min(grid.contexts)

    def query(settings: dict) -> Message:
        content = RecordDict({P.CONFIG: ConfigRecord({P.NONCE: 7}), P.SETTINGS: ConfigRecord(settings)})
        (reply,) = grid.send_and_receive([Message(content, dst_node_id=node, message_type=MessageType.QUERY)])
        return reply

    settings = shared_settings(cfg, registry.get("fedsam"))
    assert {"model", "local-epochs", "sam.rho"} <= set(settings)
    assert not {"data-dir", "download", "run-dir", "num-server-rounds", "fraction-train"} & set(settings)
    assert not query(settings).has_error()
    assert not query({**settings, "fedgmt.beta": 3.0}).has_error()  # a key this client's run config lacks
    reply = query({**settings, "model": "mlp", "local-epochs": 9, "sam.rho": 0.5})
    assert reply.has_error()
    why = handshake_error(reply)
    assert why.startswith("the clients' run config differs from the server's on model, local-epochs, sam.rho: "
                          "the server's model='mlp', local-epochs=9, sam.rho=0.5; the client's model='logreg', "
                          f"local-epochs={cfg.local_epochs}, sam.rho={cfg.params.rho}"), why
    assert "\n" not in why and why.endswith("flatflower.server_strategy(algorithm, context.run_config))")
    ray = SimpleNamespace(error=Error(code=0, reason=(
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run() (pid=1)\n"
        "  File \"ray_actor.py\", line 65, in run\nflwr.clientapp.client_app.ClientAppException: \n"
        f"Exception ClientAppException occurred. Message: {why}\n\nThe above exception was the direct "
        "cause of the following exception:\n" + "x" * 2000 + "'>")))
    assert handshake_error(ray) == why


def test_query_on_misconfigured_node_is_an_error_reply() -> None:
    cfg = RunConfig.from_mapping(fast_config())
    grid = InProcessGrid(client_app, 2, cfg.to_dict())
    node = min(grid.contexts)
    del grid.contexts[node].node_config["partition-id"]
    (reply,) = grid.send_and_receive(
        [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY)])
    assert reply.has_error() and "--node-config" in reply.error.reason
    (other,) = grid.send_and_receive(  # the other node is unaffected
        [Message(RecordDict(), dst_node_id=max(grid.contexts), message_type=MessageType.QUERY)])
    assert not other.has_error()


def test_the_self_report_names_are_one_vocabulary_on_both_sides():
    """What a client can report (flatflower.client.app.report_of) is what the server accepts in a train
    reply and writes to clients.jsonl: all spelled once, in flatflower.common.protocol."""
    from flatflower.client.app import report_of
    from flatflower.server.clients import REPORTED_FIELDS
    from flatflower.strategies.validation import REPORTED, TRAIN_METRICS

    made = {**report_of("before", (0.5, 0.25), 0.75), **report_of("after", (0.4, 0.5), 0.8)}
    assert set(made) == set(P.SELF_REPORTS) == set(REPORTED) == set(REPORTED_FIELDS)
    assert set(P.SELF_REPORTS) <= TRAIN_METRICS
    assert report_of("after", (float("inf"), 0.5), None) == {"accuracy-after": 0.5}
    with pytest.raises(ValueError, match="no self-report 'loss-during'"):
        P.self_report_key("loss", "during")


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), "0.5", True])
def test_a_scalar_the_algorithm_needs_is_checked_before_training(value) -> None:
    """FedGF's c travels in the train config (the registry's ``values``): missing, non-finite
    or not a number is an error reply naming it, and the client's state is untouched."""
    cfg = RunConfig.from_mapping(fast_config(algorithm="fedgf", **{"fedgf.threshold": 1.0}))
    strategy = make_strategy(cfg)
    grid = InProcessGrid(client_app, 2, cfg.to_dict())
    node = min(grid.contexts)
    msg = train_message(strategy, node)
    if value is not None:
        msg.content[P.CONFIG][P.MIX_WEIGHT] = value
    before = state_view(grid.contexts[node])
    (reply,) = grid.send_and_receive([msg])
    said = f"{P.MIX_WEIGHT}=" if value is not None else f"fedgf needs config '{P.MIX_WEIGHT}'"
    assert reply.has_error() and said in reply.error.reason
    assert state_view(grid.contexts[node]) == before
    msg = train_message(strategy, node)
    msg.content[P.CONFIG][P.MIX_WEIGHT] = 0.5
    (reply,) = grid.send_and_receive([msg])
    assert not reply.has_error()
