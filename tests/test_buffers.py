"""Buffers (BatchNorm's running statistics and counter), for every algorithm.

The server rules see trainable parameters only (strategies/buffers.py): FedDyn's and FedGMT's
corrections once drove ``running_var`` negative, and the int64 ``num_batches_tracked`` was
averaged as a float. Float buffers are the weighted mean of the accepted clients', integer ones
their maximum; ``buffers = local`` keeps each client's own (FedBN-style). A SAM step's first
gradient pass alone moves the running statistics (client/batch.py). The vectorised engine
refuses such a model itself; a run whose final test loss is not finite fails loudly.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import pytest
import torch
from torch import nn

import flatflower.runtime.engines.inprocess  # noqa: F401 (flwr's log handler: see tests/test_bad_input.py)
from flatflower.client.batch import ModelBatch
from flatflower.common.config import RunConfig
from flatflower.common.models import buffer_names, build_model
from flatflower.server.run import RunFailed
from flatflower.strategies import buffers as bufs
from flatflower.strategies.registry import ALGORITHMS
from flatflower.strategies.validation import ClientUpdate
from tests.bn_models import small_bn_cnn
from flatflower.runtime.engines.inprocess import run_inprocess

BN = "tests.bn_models:small_bn_cnn"
RESNET = "tests.bn_models:resnet18_bn"
TINY = {"dataset": "digits", "num-server-rounds": 2, "local-steps": 2, "batch-size": 16}


def algorithm_config(name: str) -> dict:
    """The algorithm's example config (fedgf's threshold), DP-FedSAM with its clipping and noise."""
    cfg = ALGORITHMS[name].example_config()
    if name == "dp-fedsam":
        cfg.update({"dp.clip": 0.2, "dp.noise-multiplier": 0.5, "aggregation": "uniform"})
    return cfg


def check_final(run_dir, rounds: int, steps: int, moved: bool = True) -> dict:
    """The run completed, its final test loss is finite, every running variance is >= 0, every
    counter an int64 of at most rounds x steps (one update per local step; 0 when the buffers
    never ``moved``: under DP they go back as received); the final model."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and math.isfinite(summary["final_test_loss"])
    model = torch.load(run_dir / "model_final.pt", weights_only=True)
    variances = [v for k, v in model.items() if k.endswith("running_var")]
    counters = [v for k, v in model.items() if k.endswith("num_batches_tracked")]
    assert variances and counters
    assert all(bool((v >= 0).all()) and bool(torch.isfinite(v).all()) for v in variances)
    assert all(c.dtype == torch.int64 and (0 < int(c) <= rounds * steps if moved else int(c) == 0)
               for c in counters)
    return model


# ------------------------------------------------------------------ every algorithm, both policies
@pytest.mark.parametrize("buffers", ["global", "local"])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_trains_a_batchnorm_model(tmp_path, algorithm, buffers):
    cfg = {**algorithm_config(algorithm), **TINY, "model": BN, "buffers": buffers, "run-dir": str(tmp_path / "r")}
    run_dir, _ = run_inprocess(cfg, 2)
    check_final(run_dir, 2, 2, moved=algorithm != "dp-fedsam")  # DP: buffers go back as received


@pytest.mark.parametrize("algorithm", ["feddyn", "fedgmt"])
def test_torchvisions_resnet18_with_batchnorm_trains(tmp_path, algorithm):
    """The two algorithms whose server corrections once drove running_var negative."""
    cfg = {**algorithm_config(algorithm), **TINY, "num-server-rounds": 2, "local-steps": 1, "batch-size": 8, "client-eval": False,
           "model": RESNET, "run-dir": str(tmp_path / "r")}
    run_dir, _ = run_inprocess(cfg, 2)
    check_final(run_dir, 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_torchvisions_resnet18_trains_with_every_algorithm(tmp_path, algorithm):
    cfg = {**algorithm_config(algorithm), **TINY, "num-server-rounds": 2, "local-steps": 1, "batch-size": 8, "client-eval": False,
           "model": RESNET, "run-dir": str(tmp_path / "r")}
    run_dir, _ = run_inprocess(cfg, 2)
    check_final(run_dir, 2, 1, moved=algorithm != "dp-fedsam")


# ------------------------------------------------------------------ the server's split
def _update(pid: int, model: OrderedDict, records: dict | None = None, steps: int = 10) -> ClientUpdate:
    """Partition ``pid``'s reply holding ``model`` after ``steps`` local steps (a counter may grow by that many)."""
    return ClientUpdate(node_id=pid, partition_id=pid, num_examples=10 * (pid + 1), num_steps=steps,
                        train_loss=1.0, model=model, records=records or {})


def _strategy(name: str, model: nn.Module, **cfg):
    spec = ALGORITHMS[name]
    config = RunConfig.from_mapping({**algorithm_config(name), "num-partitions": 2, **cfg})
    return spec.new_strategy(config, model.state_dict(), buffers=buffer_names(model))


@pytest.mark.parametrize("algorithm", ["feddyn", "fedgmt", "scaffold", "fedacg", "fedadam"])
def test_the_rule_sees_parameters_only_and_buffers_are_combined_apart(algorithm):
    torch.manual_seed(0)
    model = small_bn_cnn((1, 8, 8), 10)
    strategy = _strategy(algorithm, model)
    names = buffer_names(model)
    assert names == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert not set(names) & set(strategy.rule.model)  # the rule never holds a buffer
    assert all(not set(names) & set(r) for r in strategy.rule.records.values())
    assert list(strategy.model) == list(model.state_dict())  # the model's own key order
    # two clients: buffers of their own; uploads (control deltas) zero-filled for buffers, as
    # client/layout.py full_record makes them
    updates = []
    for pid in range(2):
        w = OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
        w["1.running_mean"] = torch.full((4,), float(pid + 1))
        w["1.running_var"] = torch.full((4,), 2.0 * (pid + 1))
        w["1.num_batches_tracked"] = torch.tensor(5 + pid)
        for k, v in w.items():
            if k not in names:
                w[k] = v + 0.01 * (pid + 1)
        records = {r: OrderedDict((k, torch.zeros_like(v)) for k, v in w.items()) for r in ALGORITHMS[algorithm].up}
        updates.append(strategy._split_update(_update(pid, w, records)))
    assert all(set(u.model) == set(strategy.rule.model) for u in updates)
    strategy.rule.num_partitions = 2
    strategy.participation.sizes = {0: 10, 1: 20}  # as the handshake would have learnt them
    strategy.finish_round(1, updates)
    assert strategy.stats.skipped == 0
    p = [1 / 3, 2 / 3]  # weighted by the sizes 10, 20
    final = strategy.model
    assert torch.allclose(final["1.running_mean"], torch.full((4,), p[0] * 1 + p[1] * 2))
    assert torch.allclose(final["1.running_var"], torch.full((4,), p[0] * 2 + p[1] * 4))
    assert final["1.num_batches_tracked"].dtype == torch.int64 and int(final["1.num_batches_tracked"]) == 6
    # the checkpoint holds them, and a fresh strategy restores them exactly
    state = strategy.state_dict()
    again = _strategy(algorithm, model)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.model.values(), final.values()))
    assert list(again.model) == list(final)


def test_feddyns_correction_never_reaches_a_variance():
    """FedDyn's server model is mean(w_i) - h/alpha: over a running variance that subtraction
    made it negative. With the split, the variance is the clients' mean, whatever the dual."""
    model = small_bn_cnn((1, 8, 8), 10)
    strategy = _strategy("feddyn", model, **{"feddyn.alpha": 0.001})
    strategy.rule.num_partitions = 2
    for rnd in (1, 2, 3):
        updates = []
        for pid in range(2):
            w = OrderedDict((k, v.clone()) for k, v in strategy.model.items())
            w["0.weight"] = w["0.weight"] + 1.0  # a large step: a large dual
            w["1.running_var"] = torch.full((4,), 0.01)
            updates.append(strategy._split_update(_update(pid, w)))
        strategy.finish_round(rnd, updates)
        assert torch.allclose(strategy.model["1.running_var"], torch.full((4,), 0.01))
    assert float(strategy.rule.records["dual"]["0.weight"].abs().max()) > 0  # the dual did move


def test_a_negative_variance_is_refused_with_its_reason():
    model = small_bn_cnn((1, 8, 8), 10)
    strategy = _strategy("fedavg", model)
    w = OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
    w["1.running_var"][2] = -0.5
    with pytest.raises(ValueError, match=r"key '1.running_var' is a variance with negative entries"):
        strategy._split_update(_update(0, w))
    state = strategy.state_dict()
    state["model"]["1.running_var"][0] = -1.0
    with pytest.raises(ValueError, match="negative"):
        _strategy("fedavg", model).load_state_dict(state)


def _reply(model: nn.Module, **entries) -> OrderedDict:
    """``model``'s state dict with ``entries`` (``running_mean=...``: layer 1's) in place."""
    w = OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
    for name, value in entries.items():
        w[f"1.{name}"] = torch.as_tensor(value, dtype=w[f"1.{name}"].dtype).expand_as(w[f"1.{name}"]).clone()
    return w


@pytest.mark.parametrize("entries, reason", [
    ({"running_mean": 1e30}, r"key '1.running_mean' holds 1e\+30, a magnitude above 1e\+18: a statistic no data gives"),
    ({"running_mean": -2e18}, r"key '1.running_mean' holds 2e\+18, a magnitude above 1e\+18"),
    ({"running_var": 3e38}, r"key '1.running_var' holds 3e\+38, a variance above 1e\+36"),
    ({"running_var": -1e-3}, r"key '1.running_var' is a variance with negative entries"),
    ({"num_batches_tracked": 11}, r"key '1.num_batches_tracked' is a counter of 11, outside \[0, 10\]"),
    ({"num_batches_tracked": -1}, r"key '1.num_batches_tracked' is a counter of -1, outside \[0, 10\]"),
], ids=["mean-1e30", "mean-minus-2e18", "var-3e38", "var-negative", "counter-past-its-steps", "counter-negative"])
def test_statistics_no_honest_client_sends_are_refused(entries, reason):
    """buffers = global, a client of 10 local steps that received the initial statistics."""
    model = small_bn_cnn((1, 8, 8), 10)
    with pytest.raises(ValueError, match=reason):
        _strategy("fedavg", model)._split_update(_update(0, _reply(model, **entries)))


def test_the_bounds_leave_every_statistic_data_can_give():
    """Right at the bounds, and the server's own value beyond them (a frozen parameter, or
    statistics the server holds), pass; so does a counter grown by exactly its steps."""
    model = small_bn_cnn((1, 8, 8), 10)
    strategy = _strategy("fedavg", model)
    strategy._split_update(_update(0, _reply(model, running_mean=-1e18, running_var=1e36, num_batches_tracked=10)))
    strategy.buffers["1.running_mean"] = torch.full((4,), 1e30)  # as if the server had sent it
    strategy._split_update(_update(0, _reply(model, running_mean=1e30)))
    with pytest.raises(ValueError, match="holds 3e"):  # but no other value beyond the bound
        strategy._split_update(_update(0, _reply(model, running_mean=3e30)))


def test_a_counter_grows_from_what_the_client_starts_from():
    """buffers = global: from the counter the server sent, by the client's own steps; buffers =
    local: each client goes on from its own counter, so from the initial model's, by at most
    the largest partition's steps in every round so far."""
    model = small_bn_cnn((1, 8, 8), 10)
    strategy = _strategy("fedavg", model)
    strategy.buffers["1.num_batches_tracked"] = torch.tensor(30)
    strategy._split_update(_update(0, _reply(model, num_batches_tracked=33), steps=3))
    for count in (29, 34):
        with pytest.raises(ValueError, match=rf"a counter of {count}, outside \[30, 33\]"):
            strategy._split_update(_update(0, _reply(model, num_batches_tracked=count), steps=3))
    local = _strategy("fedavg", model, buffers="local", **{"local-steps": 4})
    local.participation.sizes = {0: 10, 1: 20}
    local.rule.round = 3  # at most 3 rounds of 4 steps since the initial 0, whatever the global counter
    local.buffers["1.num_batches_tracked"] = torch.tensor(2)
    local._split_update(_update(0, _reply(model, num_batches_tracked=12), steps=4))
    with pytest.raises(ValueError, match=r"a counter of 13, outside \[0, 12\]"):
        local._split_update(_update(0, _reply(model, num_batches_tracked=13), steps=4))


def test_under_dp_every_buffer_must_be_the_one_the_server_sent():
    """DP: an honest client sends its buffers back as received (common/privacy.py), so the
    smallest change is refused; and a round keeps the global buffers as they were, whatever the
    accepted updates hold (sigma = 0 here, so that unchanged weights have an honest norm)."""
    model = small_bn_cnn((1, 8, 8), 10)
    strategy = _strategy("dp-fedsam", model, **{"num-partitions": 3, "dp.noise-multiplier": 0.0})
    sent = OrderedDict((k, v.clone()) for k, v in strategy.buffers.items())
    moved = _reply(model)
    moved["1.running_mean"][0] = torch.nextafter(moved["1.running_mean"][0], torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"key '1.running_mean' differs from the buffer the server sent: under DP"):
        strategy._split_update(_update(0, moved))
    with pytest.raises(ValueError, match=r"key '1.num_batches_tracked' differs"):
        strategy._split_update(_update(0, _reply(model, num_batches_tracked=1)))
    updates = [strategy._split_update(_update(pid, _reply(model))) for pid in range(3)]
    updates[0].buffers["1.running_mean"] = updates[0].buffers["1.running_mean"] + 1.0  # past the check
    strategy.rule.num_partitions = 3
    strategy.participation.sizes = {0: 10, 1: 20, 2: 30}
    strategy.stats.clients_sampled = 3
    strategy.finish_round(1, updates)
    assert strategy.stats.skipped == 0 and strategy.stats.rejections == []
    assert all(torch.equal(strategy.buffers[k], v) for k, v in sent.items())


def test_the_buffers_update_norm_is_its_own_quantity():
    """||b_i - b|| over the float buffers only, in float64 (1e30's square overflows float32)."""
    sent = OrderedDict(m=torch.zeros(2), v=torch.ones(2), n=torch.tensor(3))
    mine = OrderedDict(m=torch.tensor([3.0, 4.0]), v=torch.ones(2), n=torch.tensor(9))
    assert bufs.update_norm(mine, sent) == 5.0
    assert bufs.update_norm(OrderedDict(m=torch.full((2,), 1e30), v=torch.ones(2), n=torch.tensor(3)), sent) \
        == pytest.approx(2 ** 0.5 * 1e30, rel=1e-6)


def test_a_model_without_buffers_takes_none_of_these_paths():
    model = build_model("cnn", (1, 8, 8), 10, seed=0)
    strategy = _strategy("feddyn", model)
    assert buffer_names(model) == [] and strategy.model is strategy.rule.model
    update = _update(0, OrderedDict(model.state_dict()))
    assert strategy._split_update(update) is update and update.buffers == OrderedDict()


def test_integer_buffers_keep_their_dtype_and_take_the_maximum():
    items = [OrderedDict(n=torch.tensor(3), m=torch.tensor([1.0, 2.0])),
             OrderedDict(n=torch.tensor(7), m=torch.tensor([3.0, 4.0]))]
    out = bufs.combine(items, [0.25, 0.75])
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 7
    assert out["m"].dtype == torch.float32 and torch.equal(out["m"], torch.tensor([2.5, 3.5]))


def test_under_a_robust_aggregator_one_client_cannot_move_the_buffers():
    """aggregator = median: the parameters' estimate is robust, and so are the buffers (the
    coordinate-wise median of the clients', a value one of them sent): a client sending a running
    mean of 1e17 and a counter of 10 (the most each check allows: STAT_LIMIT, its 10 local
    steps) moves neither."""
    torch.manual_seed(0)
    model = small_bn_cnn((1, 8, 8), 10)
    strategy = _strategy("fedavg", model, aggregator="median", **{"num-partitions": 3})
    updates = []
    for pid, (mean, count) in enumerate([(1.0, 5), (2.0, 6), (1e17, 10)]):
        w = OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
        w["1.running_mean"] = torch.full((4,), mean)
        w["1.num_batches_tracked"] = torch.tensor(count)
        updates.append(strategy._split_update(_update(pid, w)))
    strategy.rule.num_partitions = 3
    strategy.participation.sizes = {0: 10, 1: 20, 2: 30}
    strategy.finish_round(1, updates)
    final = strategy.model
    assert torch.equal(final["1.running_mean"], torch.full((4,), 2.0))
    assert final["1.num_batches_tracked"].dtype == torch.int64 and int(final["1.num_batches_tracked"]) == 6
    # the plain mean would have taken them: the rule that keeps the papers' weighted mean
    mean = bufs.combine([u.buffers for u in updates], [1 / 6, 2 / 6, 3 / 6])
    assert float(mean["1.running_mean"][0]) > 1e16 and int(mean["1.num_batches_tracked"]) == 10


# ------------------------------------------------------------------ SAM's passes and the statistics
def test_only_the_first_pass_of_a_sam_step_moves_the_running_statistics():
    """FedSAM: each step takes a gradient at w and one at w + e; num_batches_tracked advances by
    exactly 1 per step, and running_mean is one momentum update with the batch's mean at w."""
    from flatflower.client.train import local_train, round_generator
    from flatflower.client.train import build_rule
    from flatflower.common.data import client_split

    cfg = RunConfig.from_mapping({"algorithm": "fedsam", "dataset": "digits", "local-steps": 3, "batch-size": 16})
    model = build_model(BN, (1, 8, 8), 10, seed=0)
    data = client_split(cfg, 0, 2)
    rule, _ = build_rule(ALGORITHMS["fedsam"], cfg, model, {}, {}, cfg.lr)
    local_train(model, data, rule, cfg, cfg.lr, round_generator(0, 1, 0))
    assert int(model[1].num_batches_tracked) == 3

    # one step by hand: the running mean after it is (1 - m) * 0 + m * mean of the conv output at w
    model = build_model(BN, (1, 8, 8), 10, seed=0)
    x, y = data.get(torch.arange(16))
    with torch.no_grad():
        conv = model[0](x)
    expected_mean = 0.1 * conv.mean(dim=(0, 2, 3))
    expected_var = 0.9 * 1.0 + 0.1 * conv.var(dim=(0, 2, 3), unbiased=True)
    batch = ModelBatch(model, x, y)
    rule, _ = build_rule(ALGORITHMS["fedsam"], cfg, model, {}, {}, cfg.lr)
    rule.direction([p.detach() for p in batch.params], batch)
    assert int(model[1].num_batches_tracked) == 1
    assert torch.allclose(model[1].running_mean, expected_mean, atol=1e-6)
    assert torch.allclose(model[1].running_var, expected_var, atol=1e-6)


def test_later_passes_and_outputs_restore_every_buffer_bit_for_bit():
    model = small_bn_cnn((1, 8, 8), 10)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    batch = ModelBatch(model, x, y)
    batch.grad()
    after_first = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("1.")}
    batch.grad([0.1 * torch.ones_like(p) for p in batch.params])
    batch.outputs([p.detach() + 1.0 for p in batch.params])
    batch.grad()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in after_first.items())


# ------------------------------------------------------------------ buffers = local
def test_local_buffers_stay_on_each_client(tmp_path):
    """Each client stores its own statistics in its state (never seen by the rule) and starts
    its next round from them: its self-report before round 2 differs from the global policy's,
    while the server's averaged buffers (its central evaluation) agree."""
    from flatflower.client.state import latest
    from flatflower.common import protocol as P

    rows, finals = {}, {}
    for policy in ("global", "local"):
        run_dir, grid = run_inprocess({"algorithm": "fedavg", **TINY, "model": BN, "buffers": policy,
                                       "run-dir": str(tmp_path / policy)}, 2)
        finals[policy] = torch.load(run_dir / "model_final.pt", weights_only=True)
        rows[policy] = [json.loads(line) for line in (run_dir / "clients.jsonl").read_text().splitlines()]
        states = [latest(c) for c in grid.contexts.values()]
        if policy == "local":
            own = [s[P.LOCAL_BUFFERS] for s in states]
            assert list(own[0]) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
            assert not torch.equal(own[0]["1.running_mean"], own[1]["1.running_mean"])  # each its own
        else:
            assert all(P.LOCAL_BUFFERS not in s for s in states)
    before = {p: [r["loss_before"] for r in rows[p] if r["round"] == 2] for p in rows}
    assert before["global"] != before["local"]
    for k in finals["global"]:  # the average of own statistics is the global one (up to rounding)
        assert torch.allclose(finals["global"][k].double(), finals["local"][k].double(), atol=1e-5)


# ------------------------------------------------------------------ the vectorised engine, NaN
def test_the_vectorised_engine_refuses_a_batchnorm_model_itself(tmp_path):
    with pytest.raises(ValueError, match=r"vectorised engine cannot batch clients of model .*BatchNorm2d"):
        run_inprocess({"algorithm": "fedavg", **TINY, "model": BN, "run-dir": str(tmp_path / "r")}, 2,
                      vectorized=True)
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # before any round


class NaNWhenEvaluated(nn.Module):
    """Trains normally; once trained, in eval mode (the server's central evaluation) its logits
    are NaN. Finite at its initial weights: the check before a run (server/setup.py) passes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 10)
        self.initial = self.lin.bias.detach().clone()  # not in the state dict

    def forward(self, x):
        out = self.lin(x.flatten(1))
        trained = not torch.equal(self.lin.bias.detach(), self.initial)
        return out * float("nan") if trained and not self.training else out


def test_a_non_finite_final_test_loss_fails_the_run_and_keeps_what_was_computed(tmp_path):
    from flatflower.common.models import register_model

    register_model("nan-when-evaluated", lambda: NaNWhenEvaluated())
    with pytest.raises(RunFailed, match="test_loss is not finite"):
        run_inprocess({"algorithm": "fedavg", **TINY, "model": "nan-when-evaluated", "client-eval": False,
                       "run-dir": str(tmp_path / "r")}, 2)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and "not finite" in summary["error"]
    assert (tmp_path / "r" / "model_final.pt").exists()
    rows = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3 and json.loads(rows[-1])["test_loss"] is None
    assert json.loads(rows[0])["test_loss"] is not None  # round 0: the initial weights


def test_a_resumed_batchnorm_run_ends_where_an_uninterrupted_one_does(tmp_path):
    """Checkpoints hold the buffers (and, with buffers = local, each client's own ones are in its
    state mirror): 2 rounds, then a resume to 3, give the 3-round run's model bit for bit."""
    base = {"algorithm": "scaffold", **TINY, "model": BN, "buffers": "local", "client-state-dir": "state"}
    straight, _ = run_inprocess({**base, "num-server-rounds": 3, "run-dir": str(tmp_path / "a")}, 2)
    run_inprocess({**base, "num-server-rounds": 2, "run-dir": str(tmp_path / "b")}, 2)
    resumed, _ = run_inprocess({**base, "num-server-rounds": 3, "run-dir": str(tmp_path / "b"), "resume": True}, 2)
    a, b = (torch.load(d / "model_final.pt", weights_only=True) for d in (straight, resumed))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert int(a["1.num_batches_tracked"]) == 6


def test_federated_evaluation_uses_each_clients_own_statistics(tmp_path):
    """fraction-evaluate = 1: with buffers = local each client evaluates the global weights with
    its own running statistics, so its loss differs from the global policy's."""
    losses = {}
    for policy in ("global", "local"):
        run_dir, _ = run_inprocess({"algorithm": "fedavg", **TINY, "model": BN, "buffers": policy,
                                    "fraction-evaluate": 1.0, "run-dir": str(tmp_path / policy)}, 2)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[policy] = [r["federated_loss"] for r in rows[1:]]
        assert all(math.isfinite(x) for x in losses[policy])
    assert losses["global"] != losses["local"]


def test_a_missing_model_module_fails_the_serverapp_in_one_line(tmp_path):
    from flatflower.common.references import BadReference

    with pytest.raises(BadReference, match="module 'nowhere_at_all_q' is not found"):
        run_inprocess({"algorithm": "fedavg", **TINY, "model": "nowhere_at_all_q:net",
                       "run-dir": str(tmp_path / "r")}, 2)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and "\n" not in summary["error"]
    assert summary["error"].startswith("model='nowhere_at_all_q:net': module 'nowhere_at_all_q' is not found")
