"""The vectorised engine (runtime/engines/vectorized.py, flatflower.runtime.engines.inprocess.VectorizedGrid) against its
contract: it trains a round's sampled clients together under ``torch.func.vmap``, running the
same client rule code, so a vectorised run equals an in-process run up to the float rounding
of batched kernels -- for every algorithm, with padded last batches, ragged (Dirichlet)
clients bucketed by step count, stateful clients with and without state, every SGD option,
and a failing client isolated from the rest of its group. Plus its building blocks
(padding weights, grouping, the stacked SGD step), the model check that refuses what it
cannot batch, and the CLI (``simulate``/``sweep --engine vectorized``).

All runs are tiny (digits, MLP, 1 local epoch, 2-3 rounds): each pair of runs takes well
under a second.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

# imported first (see tests/test_bad_input.py: flwr's log handler keeps the stderr of its import)
import flatflower.runtime.engines.inprocess  # noqa: F401
import flatflower.client.app as client_module
import flatflower.runtime.engines.vectorized as vec
from flatflower.client.app import app as client_app
from flatflower.client.batch import ModelBatch, cross_entropy, mean_kl, trainable
from flatflower.client.state import latest
from flatflower.client.train import build_rule
from flatflower.runtime.engines.vectorized import FunctionalBatch, check_batchable, groups, padded
from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.common.config import RunConfig
from flatflower.common.models import MODELS, build_model
from flatflower.strategies.registry import ALGORITHMS
from flatflower.server.run import RunFailed, run_server
from tests.helpers import FIRST_NODE, metrics
from flatflower.tools.cli import main as cli
from flatflower.runtime.engines.inprocess import InProcessGrid, VectorizedGrid, run_inprocess
from flatflower.tools.prepare import UsageError, preflight

# iid digits over 8 clients: 1437 = 5 x 180 + 3 x 179 samples, 6 steps of 32 each; the last
# batch of an epoch has 20 or 19 rows, so a group mixing both sizes pads. Half participate
# per round, so stateful clients meet with and without state from earlier rounds.
BASE = {"dataset": "digits", "model": "mlp", "partition": "iid", "local-epochs": 1,
        "batch-size": 32, "fraction-train": 0.5, "fraction-evaluate": 0.5,
        "num-server-rounds": 3, "tensorboard": False}
CLIENTS = 8
REL = 1e-6  # MLP: measured agreement is ~1e-8 relative (float32 rounding of batched kernels)


# ---------------------------------------------------------------- helpers
def rel_diff(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all tensors of two state dicts (float64)."""
    assert a.keys() == b.keys()
    num = math.sqrt(sum(float((a[k].double() - b[k].double()).norm()) ** 2 for k in a))
    den = math.sqrt(sum(float(b[k].double().norm()) ** 2 for k in a))
    return num / den if den else num


def final(run_dir: Path) -> dict:
    return torch.load(run_dir / "model_final.pt")


def clients_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "clients.jsonl").read_text().splitlines()]


BATCHING_RULE = vec.batching_rule  # the real rule, for the tests of it


@pytest.fixture(autouse=True)
def batching_always_pays(monkeypatch):
    """Every test here batches whatever its model (the rule would train a convolutional
    one client by client on a CPU), in a fresh cache; the tests of the rule replace it."""
    monkeypatch.setattr(vec, "_PAYS", {})
    monkeypatch.setattr(vec, "batching_rule", lambda *args: True)


@pytest.fixture
def spy(monkeypatch):
    """Records every group flatflower.runtime.engines.vectorized trains together (its size, step count and
    partitions) and whether each step's stacked mini-batch was padded (step_batches gave weights)."""
    seen = {"groups": [], "padded": 0, "unpadded": 0}
    train_group, batches = vec.train_group, vec.step_batches
    monkeypatch.setattr(vec, "MIN_GROUP", 1)  # every group batched, however small,
    monkeypatch.setattr(vec, "batching_pays", lambda call: True)  # whatever this CPU measures

    def spying_train_group(calls):
        seen["groups"].append({"size": len(calls), "round": calls[0].server_round,
                               "steps": [c.cfg.num_steps(len(c.data)) for c in calls],
                               "partitions": [c.node.partition_id for c in calls]})
        return train_group(calls)

    def spying_step_batches(*args):
        for x, y, weight in batches(*args):
            seen["padded" if weight is not None else "unpadded"] += 1
            yield x, y, weight

    monkeypatch.setattr(vec, "train_group", spying_train_group)
    monkeypatch.setattr(vec, "step_batches", spying_step_batches)
    return seen


def both_engines(tmp_path, config: dict, clients: int = CLIENTS):
    """The same run in-process and vectorised: (in-process run dir, grid), (vectorised ...)."""
    runs = []
    for vectorized in (False, True):
        name = "vec" if vectorized else "inp"
        runs.append(run_inprocess({**config, "run-dir": str(tmp_path / name)}, clients, vectorized=vectorized))
    return runs


def assert_same_rows(inp: Path, vec_dir: Path) -> None:
    """metrics.jsonl and clients.jsonl agree: the same clients, outcomes and sizes exactly,
    losses and accuracies to float tolerance."""
    a, b = metrics(inp), metrics(vec_dir)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in ("round", "sampled_partitions", "clients_sampled", "clients_replied",
                    "clients_rejected", "clients_failed", "failed_partitions", "bytes_down", "bytes_up"):
            assert x.get(key) == y.get(key), (key, x, y)
        for key in ("test_loss", "train_loss", "federated_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5), (key, x, y)
        for key in ("test_accuracy", "federated_accuracy"):
            if key in x:  # a prediction tie may flip: within one test sample
                assert y[key] == pytest.approx(x[key], abs=1.01 / 360), (key, x, y)
    ca, cb = clients_rows(inp), clients_rows(vec_dir)
    assert [(r["round"], r["partition"], r["status"], r["examples"], r["steps"]) for r in ca] == \
           [(r["round"], r["partition"], r["status"], r["examples"], r["steps"]) for r in cb]
    for x, y in zip(ca, cb):
        for key in ("train_loss", "loss_after"):
            if x[key] is not None:
                assert y[key] == pytest.approx(x[key], rel=1e-5), (key, x, y)


def assert_same_client_state(a: InProcessGrid, b: InProcessGrid, tol: float = REL) -> None:
    """Every node's persistent records (duals, control variates, previous global models...)
    the same in both engines."""
    for node, ctx in a.contexts.items():
        sa = {n: codec.from_record(r) for n, r in ctx.state.array_records.items()}
        sb = {n: codec.from_record(r) for n, r in b.contexts[node].state.array_records.items()}
        assert sa.keys() == sb.keys(), node
        for name in sa:
            scale = max(1e-3, math.sqrt(sum(float(v.double().norm()) ** 2 for v in sa[name].values())))
            diff = math.sqrt(sum(float((sa[name][k].double() - sb[name][k].double()).norm()) ** 2
                                 for k in sa[name]))
            assert diff <= tol * scale, (node, name, diff, scale)
        ma, mb = (c.state.metric_records.get(client_module.META) for c in (ctx, b.contexts[node]))
        assert (ma is None) == (mb is None) and (ma is None or dict(ma) == dict(mb)), node


def assert_equal_runs(runs, tol: float = REL) -> tuple[list[dict], list[dict]]:
    (inp, grid_a), (vec_dir, grid_b) = runs
    init, a, b = torch.load(inp / "model_init.pt"), final(inp), final(vec_dir)
    assert rel_diff(a, init) > 1e-3, "training did not move the model: the comparison is vacuous"
    assert rel_diff(b, a) <= tol, rel_diff(b, a)
    assert_same_rows(inp, vec_dir)
    assert_same_client_state(grid_a, grid_b, tol)
    return metrics(inp), metrics(vec_dir)


# ---------------------------------------------------------------- 1. every algorithm
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_vectorised_run_equals_inprocess_run(tmp_path, spy, algorithm):
    """Final global model, metric rows, client reports and every client's persistent state
    equal the in-process run's, with groups of several clients, padded last batches and (for
    stateful algorithms) clients with and without state in one round."""
    runs = both_engines(tmp_path, {**BASE, **ALGORITHMS[algorithm].example_config()})
    rows, _ = assert_equal_runs(runs)
    assert max(g["size"] for g in spy["groups"]) > 1, spy["groups"]
    assert spy["padded"] > 0 and spy["unpadded"] > 0, spy  # some step padded, most not
    trained = [p for r in rows[1:] for p in r["sampled_partitions"]]
    assert len(set(trained)) < len(trained) < CLIENTS * BASE["num-server-rounds"], \
        "some client must train twice and some round leave clients out"
    # the vectorised run's messages really went through the batched path
    assert sum(g["size"] for g in spy["groups"]) == len(trained)


# ---------------------------------------------------------------- 2. ragged clients
@pytest.mark.parametrize("algorithm", ["fedavg", "fedsam", "scaffold", "fedtoga", "fedlesam-s", "fedswa", "fedmoswa", "fedwmsam"])
@pytest.mark.parametrize("budget", [vec.PADDING_BUDGET, 1.0], ids=["masked", "one-step-count"])
def test_ragged_dirichlet_clients_equal_inprocess(tmp_path, spy, monkeypatch, algorithm, budget):
    """Dirichlet(0.3) over 10 clients: 79 to 247 samples, 3 to 8 steps per epoch. With the
    default padding budget clients of different step counts train in one group (each masked
    after its own last step; SCAFFOLD's K and FedTOGA's gradient register stay per client);
    with budget 1 only clients of one step count do (their last batches padded)."""
    monkeypatch.setattr(vec, "PADDING_BUDGET", budget)
    config = {**BASE, "algorithm": algorithm, "partition": "dirichlet", "dirichlet-alpha": 0.3,
              "fraction-train": 0.6}
    assert_equal_runs(both_engines(tmp_path, config, clients=10))
    mixed = [g for g in spy["groups"] if len(set(g["steps"])) > 1]
    if budget == 1.0:
        assert not mixed and len({tuple(g["steps"]) for g in spy["groups"]}) > 1, spy["groups"]
    else:
        assert mixed, spy["groups"]
    assert max(g["size"] for g in spy["groups"]) > 1 and spy["padded"] > 0, spy


# ---------------------------------------------------------------- 3. optimizer paths
@pytest.mark.parametrize("options", [
    {"momentum": 0.9, "weight-decay": 1e-3, "clip-norm": 1.0},
    {"local-steps": 7, "momentum": 0.9},  # 7 steps of 180-sample clients: an epoch rolls over
    {"clip-norm": 0.05, "lr": 0.3},  # clipping active in every step
], ids=["momentum-wd-clip", "local-steps", "tight-clip"])
@pytest.mark.parametrize("algorithm", ["fedavg", "fedsam", "scaffold", "feddyn", "fedswa"])
def test_optimizer_options_equal_inprocess(tmp_path, spy, algorithm, options):
    assert_equal_runs(both_engines(tmp_path, {**BASE, "algorithm": algorithm, "num-server-rounds": 2,
                                              **options}))
    if "local-steps" in options:
        assert {n for g in spy["groups"] for n in g["steps"]} == {7}


# ---------------------------------------------------------------- 4. the CNN
@pytest.mark.parametrize("algorithm", ["fedavg", "fedsam"])
def test_cnn_equals_inprocess_within_float_tolerance(tmp_path, spy, algorithm):
    """Batched convolutions round differently from per-client ones; where that moves a value
    across a ReLU's 0 or changes the winner of a max-pool tie, the two engines take a
    different branch for that element. So the CNN's engines agree within float tolerance, not
    bit for bit (measured ~1e-8 relative here; the bound leaves room for such a flip)."""
    runs = both_engines(tmp_path, {**BASE, "algorithm": algorithm, "model": "cnn",
                                   "num-server-rounds": 2})
    assert_equal_runs(runs, tol=1e-5)
    assert max(g["size"] for g in spy["groups"]) > 1


# ---------------------------------------------------------------- 5. building blocks
def test_padded_stacks_equal_batches_without_weights():
    xs = [torch.randn(4, 1, 8, 8) for _ in range(3)]
    ys = [torch.randint(0, 10, (4,)) for _ in range(3)]
    x, y, weight = padded(xs, ys)
    assert weight is None
    assert torch.equal(x, torch.stack(xs)) and torch.equal(y, torch.stack(ys))


def test_padded_weighs_real_rows_1_over_b_and_padding_0():
    sizes = [5, 2, 4]
    xs = [torch.randn(n, 1, 8, 8) for n in sizes]
    ys = [torch.randint(0, 10, (n,)) for n in sizes]
    x, y, weight = padded(xs, ys)
    assert x.shape == (3, 5, 1, 8, 8) and y.shape == (3, 5) and weight.shape == (3, 5)
    for i, n in enumerate(sizes):
        assert torch.equal(x[i, :n], xs[i]) and torch.equal(y[i, :n], ys[i])
        assert torch.all(weight[i, :n] == 1.0 / n) and torch.all(weight[i, n:] == 0)
        assert float(weight[i].sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("chunk_bytes", [vec.STEP_BYTES, 1])
@pytest.mark.parametrize("case", ["a client augments", "all normalise alike", "normalisations differ"])
def test_step_batches_are_the_step_by_step_padded_batches_bit_for_bit(monkeypatch, chunk_bytes, case):
    """step_batches (each client's rows gathered once per chunk of steps) gives, step by step,
    exactly what padding each client's own batch gives: ragged sizes (the last batch of an
    epoch), clients past their last step (empty batches), normalised splits; a client whose
    train-transform draws from its own generator in step order (each client's inputs made
    apart), clients whose splits normalise alike (their inputs made at once), and splits with
    different means (apart again); in one chunk and one step a chunk."""
    from flatflower.client.train import batch_indices, round_order
    from flatflower.common.augment import train_augment
    from flatflower.common.datasets import Split

    monkeypatch.setattr(vec, "STEP_BYTES", chunk_bytes)
    torch.manual_seed(3)
    sizes, batch_size = [23, 9, 16, 30], 8  # steps per epoch: 3, 2, 2, 4

    def calls(seed):
        made = []
        for i, n in enumerate(sizes):
            mean = (0.5,) if case == "normalisations differ" and i == 1 else (0.4,)
            data = Split(torch.randint(0, 255, (n, 1, 6, 6), dtype=torch.uint8), torch.randint(0, 10, (n,)),
                         mean=mean, std=(0.3,), scale=255.0)
            augment = train_augment("crop-flip", seed, 1, i) if i == 2 and case == "a client augments" else None
            made.append(SimpleNamespace(data=data, augment=augment,
                                        batch=lambda idx, d=data, a=augment: d.get(idx, augment=a)))
        return made

    def generators(group, seed):
        return [torch.Generator().manual_seed(seed + i) for i in range(len(group))]

    torch.manual_seed(4)
    group = calls(7)
    steps = [2 * math.ceil(n / batch_size) for n in sizes]
    orders = [round_order(len(c.data), batch_size, 2, 0, g) for c, g in zip(group, generators(group, 11))]
    got = list(vec.step_batches(group, orders, steps, torch.device("cpu")))
    torch.manual_seed(4)
    group = calls(7)
    mine = [batch_indices(len(c.data), batch_size, 2, 0, g) for c, g in zip(group, generators(group, 11))]
    empty = torch.zeros(0, dtype=torch.int64)
    assert len(got) == max(steps)
    padded_steps = 0
    for k, (x, y, weight) in enumerate(got):
        xs, ys = zip(*(c.batch(next(d)) if k < n else c.data.get(empty) for c, d, n in zip(group, mine, steps)))
        want = padded(xs, ys)
        assert torch.equal(x, want[0]) and torch.equal(y, want[1])
        assert (weight is None) == (want[2] is None)
        if weight is not None:
            assert torch.equal(weight, want[2])
            padded_steps += 1
    assert padded_steps > 0 and (group[2].augment is not None) == (case == "a client augments")
    assert any(w is not None and bool((w == 0).all(dim=1).any()) for _, _, w in got)  # a client past its end


def test_splits_normalise_alike_by_their_numbers_whatever_holds_them():
    """step_batches makes the inputs of clients together only where their splits normalise
    alike: the same stored dtype, sample shape, device, scale, mean and std, a mean or std
    given as a tuple, a list or an array counting as the numbers it holds."""
    from flatflower.common.datasets import Split

    def split(**kw):
        args = {"x": torch.zeros((3, 1, 2, 2), dtype=torch.uint8), "y": torch.zeros(3, dtype=torch.int64),
                "mean": (0.5,), "std": (0.25,), "scale": 255.0, **kw}
        return Split(**args).normalisation()

    same = split()
    assert split(mean=[0.5]) == same and split(std=np.array([0.25])) == same and split(scale=255) == same
    for other in (split(mean=(0.4,)), split(std=None), split(scale=1.0), split(x=torch.zeros((3, 1, 2, 2))),
                  split(x=torch.zeros((3, 1, 2, 3), dtype=torch.uint8))):
        assert other != same
    assert len({same, split(mean=[0.5])}) == 1  # hashable, whatever held the numbers


def test_weighted_objectives_of_a_padded_batch_equal_the_plain_means():
    torch.manual_seed(0)
    sizes = [7, 3, 5]
    logits = [torch.randn(n, 10) for n in sizes]
    ys = [torch.randint(0, 10, (n,)) for n in sizes]
    x, y, weight = padded(logits, ys)
    # padding rows get random logits: with weight 0 they must not count
    x = torch.where(weight[..., None] > 0, x, torch.randn_like(x) * 100)
    for i, n in enumerate(sizes):
        loss, report = cross_entropy(x[i], y[i], weight[i])
        plain, _ = cross_entropy(logits[i], ys[i])
        torch.testing.assert_close(loss, plain, rtol=1e-6, atol=0)
        torch.testing.assert_close(report, plain, rtol=1e-6, atol=0)
        q = torch.softmax(torch.randn(x.shape[1:]), dim=1)
        torch.testing.assert_close(mean_kl(torch.log_softmax(x[i], 1), q, weight[i]),
                                   mean_kl(torch.log_softmax(logits[i], 1), q[:n]), rtol=1e-6, atol=0)


def test_functional_batch_under_vmap_gives_each_clients_own_gradient_of_its_unpadded_batch():
    """FunctionalBatch.grad (with and without a SAM-style offset) for 3 clients of different
    weights and batch sizes, in one vmap over a padded batch, equals ModelBatch.grad on each
    client's own model and unpadded batch."""
    torch.manual_seed(1)
    template = build_model("mlp", (1, 8, 8), 10, seed=0)
    names = [n for n, p in template.named_parameters() if p.requires_grad]
    sizes = [6, 2, 4]
    models = [build_model("mlp", (1, 8, 8), 10, seed=s) for s in range(3)]
    xs = [torch.randn(n, 1, 8, 8) for n in sizes]
    ys = [torch.randint(0, 10, (n,)) for n in sizes]
    offsets = [[torch.randn_like(p) * 0.01 for p in trainable(m)] for m in models]
    x, y, weight = padded(xs, ys)
    w = [torch.stack(ps) for ps in zip(*[[p.detach() for p in trainable(m)] for m in models])]
    off = [torch.stack(o) for o in zip(*offsets)]

    def grads(w, x, y, weight, off):
        batch = FunctionalBatch(template, names, w, x, y, weight)
        (l0, g0), (l1, g1) = batch.grad(), batch.grad(list(off))
        return l0, g0, l1, g1

    l0, g0, l1, g1 = torch.func.vmap(grads)(w, x, y, weight, off)
    for i, m in enumerate(models):
        batch = ModelBatch(m, xs[i], ys[i])
        for (loss, g), (vl, vg) in ((batch.grad(), (l0, g0)), (batch.grad(offsets[i]), (l1, g1))):
            torch.testing.assert_close(vl[i], loss, rtol=1e-5, atol=1e-7)
            for a, b in zip(vg, g):
                torch.testing.assert_close(a[i], b, rtol=1e-5, atol=1e-7)


def _calls(cfg: RunConfig, algorithm: str, sizes: list[int], states: list[dict] | None = None):
    """Stand-ins for TrainCall with what groups() reads: a rule, data (its length) and cfg."""
    cfg = cfg.replace(algorithm=algorithm)
    model = build_model("logreg", (1, 8, 8), 10, seed=0)
    spec = ALGORITHMS[algorithm]
    named = dict(model.state_dict())
    broadcast = {name: named for name in spec.down}
    out = []
    for n, state in zip(sizes, states or [{}] * len(sizes)):
        rule, _ = build_rule(spec, cfg, model, broadcast, state, 0.1, initial=lambda: named)
        out.append(SimpleNamespace(rule=rule, data=range(n), cfg=cfg))
    return out


def test_groups_cut_clients_by_step_count_within_the_padding_budget():
    cfg = RunConfig.from_mapping({"batch-size": 32, "local-epochs": 2})
    # 2 epochs of ceil(n / 32) steps: 10 -> 2; 33, 50, 60, 64 -> 4; 65, 96 -> 6; 300 -> 20
    calls = _calls(cfg, "fedavg", [64, 65, 33, 10, 60, 96, 50, 300])
    # sorted by steps (2, 4, 4, 4, 4, 6, 6, 20); a client joins while size x its steps <= 2 x
    # the group's real steps: the 20-step client would make 8 x 20 = 160 > 2 x 50
    assert groups(calls) == [[3, 0, 2, 4, 6, 1, 5], [7]]
    assert groups(calls, budget=1.0) == [[3], [0, 2, 4, 6], [1, 5], [7]]  # one step count each
    # a fixed number of local steps: one group whatever the sizes
    fixed = _calls(cfg.replace(local_steps=5), "fedavg", [64, 65, 10])
    assert groups(fixed) == [[0, 1, 2]]


def test_groups_split_clients_by_rule_shape():
    """FedLESAM's clients with a previous global model (a perturbation offset) and without
    (none yet) run different rule code: never in one group."""
    cfg = RunConfig.from_mapping({"batch-size": 32})
    model = build_model("logreg", (1, 8, 8), 10, seed=0)
    previous = {P.PREVIOUS_GLOBAL: {k: v + 0.1 for k, v in model.state_dict().items()}}
    calls = _calls(cfg, "fedlesam", [64, 64, 64, 64], [{}, previous, {}, previous])
    assert sorted(groups(calls)) == [[0, 2], [1, 3]]


# ---------------------------------------------------------------- 6. models it cannot batch
class BNNet(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(input_shape[0], 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * input_shape[1] * input_shape[2], num_classes)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        return self.linear(x)


@pytest.mark.parametrize("model, named", [
    (lambda: BNNet((1, 8, 8), 10), "BatchNorm2d"),
    (lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Dropout(0.5), nn.Linear(32, 10)), "Dropout"),
    (lambda: WithBuffer(), "buffers (count)"),
])
def test_check_batchable_refuses_state_shared_across_a_batch(model, named):
    with pytest.raises(ValueError) as err:
        check_batchable(model(), "net")
    message = str(err.value)
    assert named in message and "'net'" in message
    assert "--engine inprocess" in message and "GroupNorm" in message


@pytest.mark.parametrize("name", list(MODELS))
def test_check_batchable_accepts_every_model_of_the_zoo(name):
    try:
        model = build_model(name, (1, 8, 8), 10, seed=0)  # digits
    except ValueError:  # too small for it (lenet): a CIFAR-shaped input
        model = build_model(name, (3, 32, 32), 10, seed=0)
    check_batchable(model, name)


@pytest.fixture
def bn_model(monkeypatch):
    monkeypatch.setitem(MODELS, "bn-net", BNNet)
    return "bn-net"


def test_preflight_refuses_a_batchnorm_model_for_the_vectorised_engine_only(tmp_path, bn_model):
    cfg = RunConfig.from_mapping({"dataset": "digits", "model": bn_model, "partition": "iid",
                                  "run-dir": str(tmp_path / "r")})
    with pytest.raises(UsageError, match=r"BatchNorm2d.*--engine inprocess.*GroupNorm"):
        preflight(cfg, 4, "vectorized")
    preflight(cfg, 4, "inprocess")
    preflight(cfg, 4, "ray")


def test_cli_refuses_a_batchnorm_model_for_the_vectorised_engine_before_starting(tmp_path, capsys, bn_model):
    code = cli(["simulate", "--engine", "vectorized", "--model", bn_model, "--dataset", "digits",
                "--clients", "2", "--rounds", "1", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and "BatchNorm2d" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- 7. failure isolation
def nan_data_for(monkeypatch, partition: int) -> None:
    """Partition ``partition``'s training inputs become NaN: its loss is NaN at step 1."""
    split = client_module.client_split

    def poisoned(cfg, partition_id, num_partitions, data_dir=""):
        data = split(cfg, partition_id, num_partitions, data_dir)
        if partition_id == partition:
            data = dataclasses.replace(data, x=data.x.float() * float("nan"))
        return data

    monkeypatch.setattr(client_module, "client_split", poisoned)


def run_grid(tmp_path, name: str, kind: type, config: dict, clients: int, faults: dict | None = None):
    """``config`` on a ``kind`` grid; ``faults``: partition -> inject-fault. Returns the run
    directory, the grid, and the RunFailed raised (None when the run completed)."""
    cfg = RunConfig.from_mapping({**config, "num-partitions": clients, "run-dir": str(tmp_path / name)})
    grid = kind(client_app, clients, cfg.to_dict())
    for pid, fault in (faults or {}).items():
        grid.contexts[FIRST_NODE + pid].node_config["inject-fault"] = fault
    try:
        run_server(grid, cfg)
        failed = None
    except RunFailed as err:
        failed = err
    return Path(cfg.run_dir), grid, failed


FAILING = 1  # the failing client's partition


@pytest.mark.parametrize("fault, reason", [
    ("nan-data", "FloatingPointError: local loss became nan at step 1"),  # training itself fails
    ("raise", "RuntimeError: injected fault: raise"),  # opening the call fails
    ("nan", "has NaN or Inf values"),  # a NaN model in the reply: refused by the server
], ids=["nan-data", "raise", "nan"])
def test_a_failing_client_does_not_sink_the_others_of_its_group(tmp_path, monkeypatch, spy, fault, reason):
    """4 iid clients of 12 steps each, all sampled: one group. The failing client's reply is
    an error (or refused), the others train on and are aggregated, and both engines end the
    same: same failures, final model, and client state (the failing client's is never
    committed)."""
    config = {**BASE, "algorithm": "scaffold", "fraction-train": 1.0, "fraction-evaluate": 0.0,
              "num-server-rounds": 2}
    faults = {}
    if fault == "nan-data":
        nan_data_for(monkeypatch, FAILING)
    else:
        faults = {FAILING: fault}
    (inp, grid_a, fail_a), (vec_dir, grid_b, fail_b) = (
        run_grid(tmp_path, name, kind, config, 4, faults)
        for name, kind in (("inp", InProcessGrid), ("vec", VectorizedGrid)))
    assert fail_a is None and fail_b is None, (fail_a, fail_b)
    if fault != "raise":  # trained in one group with the others (round 1; in round 2 a client
        # whose state was never committed has a rule of another shape, so trains apart)
        assert any(g["size"] == 4 and FAILING in g["partitions"] for g in spy["groups"]), spy["groups"]
    else:  # a client that fails to open never reaches a group
        assert all(g["size"] == 3 and FAILING not in g["partitions"] for g in spy["groups"]), spy["groups"]
    for rows in (metrics(inp), metrics(vec_dir)):
        for row in rows[1:]:
            bad = row["failed_partitions"] if fault != "nan" else row["rejected_partitions"]
            assert bad == [FAILING], row
            why = row["failures"] if fault != "nan" else row["rejections"]
            assert reason in why[0]["reason"], why
            assert row["clients_replied"] - row["clients_rejected"] == 3, row
            assert math.isfinite(row["test_loss"]) and math.isfinite(row["train_loss"]), row
    assert rel_diff(final(vec_dir), final(inp)) <= REL
    assert rel_diff(final(vec_dir), torch.load(inp / "model_init.pt")) > 1e-3
    assert_same_rows(inp, vec_dir)
    assert_same_client_state(grid_a, grid_b)
    if fault != "nan":  # the reply failed: nothing of the failing client's round was kept
        assert not latest(grid_b.contexts[FIRST_NODE + FAILING])
        assert P.CLIENT_CONTROL in latest(grid_b.contexts[FIRST_NODE])


def test_a_hung_client_is_lost_alone_at_the_round_deadline(tmp_path):
    config = {**BASE, "algorithm": "fedavg", "fraction-train": 1.0, "fraction-evaluate": 0.0,
              "num-server-rounds": 1}
    crashed, _, failed = run_grid(tmp_path, "crashed", VectorizedGrid, config, 4, {FAILING: "raise"})
    assert failed is None
    # a deadline the honest clients meet on this machine now: 5x their round here, at least 3 s
    timeout = float(max(3, math.ceil(5 * max(r["seconds"] for r in metrics(crashed)[1:]))))
    hung, _, failed = run_grid(tmp_path, "hung", VectorizedGrid, {**config, "round-timeout": timeout},
                               4, {FAILING: "hang"})
    row = metrics(hung)[1]
    assert row["failed_partitions"] == [FAILING] and row["clients_replied"] == 3, row
    assert failed is None
    assert rel_diff(final(hung), final(crashed)) == 0


def test_groups_too_small_to_batch_train_one_by_one_with_the_same_result(tmp_path, monkeypatch):
    """Below MIN_GROUP clients a group trains client by client (TrainCall.train, the
    ClientApp's loop): the run is the in-process run, and the batched groups still batch."""
    alone, batched = [], []
    train, train_group = client_module.TrainCall.train, vec.train_group
    # (the vectorised engine opens its calls without the self-report: reported is None)
    monkeypatch.setattr(client_module.TrainCall, "train",
                        lambda self: alone.append(self.reported is None) or train(self))
    monkeypatch.setattr(vec, "train_group", lambda calls: batched.append(len(calls)) or train_group(calls))
    config = {**BASE, "algorithm": "fedtoga", "partition": "dirichlet", "dirichlet-alpha": 0.3,
              "fraction-train": 0.6}
    monkeypatch.setattr(vec, "PADDING_BUDGET", 1.0)  # one step count per group: some small ones
    assert_equal_runs(both_engines(tmp_path, config, clients=10))
    assert any(alone) and batched and min(batched) >= vec.MIN_GROUP


def test_a_model_whose_batching_does_not_pay_trains_one_by_one(tmp_path, monkeypatch):
    """batching_pays decides once per model, batch size and device whether a batched gradient
    beats as many single ones (on a CPU LeNet's grouped convolutions lose); when not, every
    client trains alone, with the in-process result."""
    measured = []
    monkeypatch.setattr(vec, "_PAYS", {})
    monkeypatch.setattr(vec, "batching_rule", lambda *args: measured.append(1) or False)
    batched = []
    train_group = vec.train_group
    monkeypatch.setattr(vec, "train_group", lambda calls: batched.append(len(calls)) or train_group(calls))
    assert_equal_runs(both_engines(tmp_path, {**BASE, "algorithm": "fedsam", "fraction-train": 1.0}))
    assert measured == [1] and not batched


@pytest.mark.parametrize("batching", ["on", "off"])
def test_the_batching_key_pins_the_choice_without_measuring(tmp_path, monkeypatch, batching):
    """batching = on | off decides without the rule (nor counting the model's FLOPs): on
    batches every group, off trains every client alone; both give the in-process result."""
    monkeypatch.setattr(vec, "_PAYS", {})
    monkeypatch.setattr(vec, "conv_flops", lambda *args: pytest.fail("counted despite batching"))
    batched = []
    train_group = vec.train_group
    monkeypatch.setattr(vec, "train_group", lambda calls: batched.append(len(calls)) or train_group(calls))
    config = {**BASE, "algorithm": "fedsam", "fraction-train": 1.0, "batching": batching}
    assert_equal_runs(both_engines(tmp_path, config))
    assert bool(batched) == (batching == "on") and vec._PAYS == {}


class ZeroRows:
    """A split of 100 zero rows of ``shape`` (what batching_pays reads: its length and rows)."""

    def __init__(self, shape):
        self.shape = shape

    def __len__(self) -> int:
        return 100

    def get(self, rows):
        return torch.zeros(len(rows), *self.shape), torch.zeros(len(rows), dtype=torch.int64)


def rule_call(name: str, batch_size: int, shape=(1, 8, 8)) -> SimpleNamespace:
    """What batching_pays reads of a train call: a zoo model on a CPU and a digits split."""
    cfg = RunConfig.from_mapping({"dataset": "digits", "batch-size": batch_size})
    data = client_module.client_split(cfg, 0, 4)
    if shape != (1, 8, 8):
        data = ZeroRows(shape)
    model = build_model(name, shape, 10, seed=0)
    return SimpleNamespace(layout=client_module.Layout.of(model), model=model, data=data, cfg=cfg)


def test_batching_pays_is_decided_once_per_model_batch_and_device(monkeypatch):
    monkeypatch.setattr(vec, "_PAYS", {})
    runs = []
    monkeypatch.setattr(vec, "batching_rule", lambda *args: runs.append(1) or BATCHING_RULE(*args))
    for name in ("mlp", "mlp", "cnn"):
        vec.batching_pays(rule_call(name, 32))
    assert len(runs) == 2 and len(vec._PAYS) == 2  # the second MLP is the first's decision


def test_conv_flops_are_the_hand_counted_multiply_adds():
    """The digits CNN on one 1x8x8 row: conv 1->16 (3x3, 'same') makes 16 x 64 outputs of 9
    multiply-adds, conv 16->32 on the pooled 4x4 makes 32 x 16 outputs of 16 x 9: 82,944
    multiply-adds, 165,888 FLOPs a row; linear layers count nothing; a batch scales it."""
    cnn = build_model("cnn", (1, 8, 8), 10, seed=0)
    assert vec.conv_flops(cnn, torch.zeros(1, 1, 8, 8)) == 2 * (16 * 64 * 9 + 32 * 16 * 16 * 9) == 165_888
    assert vec.conv_flops(cnn, torch.zeros(32, 1, 8, 8)) == 32 * 165_888
    assert vec.conv_flops(build_model("mlp", (1, 8, 8), 10, seed=0), torch.zeros(32, 1, 8, 8)) == 0


def test_the_batching_rule_is_a_limit_on_convolution_flops():
    """On a CPU: batched up to CONV_FLOPS_LIMIT convolution FLOPs a client step, one by one
    above; on any other device, batched."""
    cpu, cuda, limit = torch.device("cpu"), torch.device("cuda"), vec.CONV_FLOPS_LIMIT
    assert BATCHING_RULE(0.0, cpu) and BATCHING_RULE(limit, cpu) and not BATCHING_RULE(limit + 1, cpu)
    assert BATCHING_RULE(1e12, cuda)


@pytest.fixture
def busy_cpus():
    """A busy loop on every core, in processes this test starts and ends."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    yield
    for proc in procs:
        proc.kill()
        proc.wait()


def test_the_batching_choice_does_not_flip_under_load(monkeypatch, busy_cpus):
    """The choice is a function of the model, the batch shape and the device: fresh
    decisions while every core is busy equal the rule's answer over the hand-counted FLOPs
    (models without convolutions batch; the digits CNN's 165,888 a row batch up to batch 90
    (14.9 M), not at 91; LeNet on 28x28 never)."""
    monkeypatch.setattr(vec, "batching_rule", BATCHING_RULE)
    assert 90 * 165_888 <= vec.CONV_FLOPS_LIMIT < 91 * 165_888
    expected = {("logreg", 128): True, ("mlp", 128): True, ("cnn", 16): True, ("cnn", 90): True,
                ("cnn", 91): False}
    for _ in range(3):
        for (name, batch), batches in expected.items():
            monkeypatch.setattr(vec, "_PAYS", {})
            assert vec.batching_pays(rule_call(name, batch)) is batches, (name, batch)
        monkeypatch.setattr(vec, "_PAYS", {})
        assert vec.batching_pays(rule_call("lenet", 16, shape=(1, 28, 28))) is False


def test_a_client_that_opens_late_trains_alone_with_the_same_result(tmp_path, monkeypatch):
    """A call still opening when the batch is ready (STRAGGLER_WAIT) is trained on its own
    when it opens (TrainCall.run), not waited for: the same model as the in-process engine."""
    from flatflower.client.app import TrainCall

    monkeypatch.setattr(flatflower.runtime.engines.inprocess, "STRAGGLER_WAIT", 0.2)
    opening = TrainCall.open.__func__

    def slow_open(cls, msg, context, self_report=True):
        if context.node_config["partition-id"] == FAILING:
            time.sleep(1.0)
        return opening(cls, msg, context, self_report)

    lone = []
    run = TrainCall.run
    monkeypatch.setattr(TrainCall, "open", classmethod(slow_open))
    monkeypatch.setattr(TrainCall, "run", lambda self: lone.append(self.node.partition_id) or run(self))
    config = {**BASE, "algorithm": "scaffold", "fraction-train": 1.0, "num-server-rounds": 2}
    vec, grid_v, failed = run_grid(tmp_path, "vec", VectorizedGrid, config, 4)
    assert failed is None and lone == [FAILING, FAILING]
    inp, grid_i, failed = run_grid(tmp_path, "inp", InProcessGrid, config, 4)
    assert rel_diff(final(vec), final(inp)) <= REL
    assert_same_rows(inp, vec)
    assert_same_client_state(grid_i, grid_v)


# ---------------------------------------------------------------- 8. the CLI
def test_cli_simulate_vectorized_equals_inprocess(tmp_path, capsys):
    """Through `flatflower simulate`: SCAFFOLD's client state goes through the CLI's on-disk
    client-state mirror in both engines."""
    args = ["--algorithm", "scaffold", "--clients", "6", "--rounds", "2", "--dataset", "digits",
            "--model", "mlp", "--partition", "iid", "--fraction", "0.5", "--set", "local-epochs=1",
            "--no-tensorboard", "--flatness-every", "2"]
    assert cli(["simulate", "--engine", "vectorized", *args, "--run-dir", str(tmp_path / "vec")]) == 0
    out = capsys.readouterr().out
    assert "vectorised in-process simulation" in out and "final test accuracy" in out
    assert cli(["simulate", "--engine", "inprocess", *args, "--run-dir", str(tmp_path / "inp")]) == 0
    rows = metrics(tmp_path / "vec")
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"]
    assert (tmp_path / "vec" / "client-state").is_dir()
    assert json.loads((tmp_path / "vec" / "config.json").read_text())["engine"] == "vectorized"
    assert rel_diff(final(tmp_path / "vec"), final(tmp_path / "inp")) <= REL
    assert_same_rows(tmp_path / "inp", tmp_path / "vec")
    flat = metrics(tmp_path / "inp")
    assert [r.get("flatness_distance") for r in rows] == pytest.approx(
        [r.get("flatness_distance") for r in flat], rel=1e-3)
    assert rows[2]["sharpness"] == pytest.approx(flat[2]["sharpness"], rel=1e-2, abs=1e-6)
    assert rows[2]["hessian_max_eig"] == pytest.approx(flat[2]["hessian_max_eig"], rel=1e-3)


def test_cli_sweep_vectorized(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = cli(["sweep", "--engine", "vectorized", "--algorithms", "fedavg,fedsam", "--seeds", "0",
                "--out", str(out), "--clients", "4", "--rounds", "2", "--dataset", "digits",
                "--model", "mlp", "--partition", "iid", "--set", "local-epochs=1", "--no-tensorboard"])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads((out / "report.json").read_text())
    assert [r["algorithm"] for r in report["runs"]] == ["fedavg", "fedsam"]
    assert "vectorised in-process simulation" in text
    for name in ("fedavg-s0", "fedsam-s0"):
        assert [r["round"] for r in metrics(out / name)] == [0, 1, 2]


def test_an_empty_partition_gets_local_trains_own_error_and_fails_alone():
    """A call with no data never joins a group: it trains alone, so the ClientApp's loop
    raises its own error for it (flatflower.client.train.local_train)."""
    cfg = RunConfig.from_mapping({"batch-size": 32})
    model = build_model("logreg", (1, 8, 8), 10, seed=0)
    from flatflower.client.train import local_train
    from flatflower.common.datasets import Split

    empty = Split(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.int64))
    rule, _ = build_rule(ALGORITHMS[cfg.algorithm], cfg, model, {}, {}, 0.1)
    call = SimpleNamespace(data=empty, cfg=cfg, rule=rule,
                           train=lambda: local_train(model, empty, rule, cfg, 0.1, torch.Generator()))
    [result] = vec.train_together([call])
    assert isinstance(result, ValueError) and "partition is empty" in str(result)


def test_a_resumed_vectorised_run_batches_as_it_did(tmp_path, monkeypatch, capsys):
    """A run records its choices (vectorized.json) and its resume reuses them, never deciding
    again: a run made when the choice was a timing (here: one by one for the MLP, which the
    rule batches) takes the same path on resume."""
    monkeypatch.setattr(vec, "_PAYS", {})
    monkeypatch.setattr(vec, "batching_rule", lambda *args: False)  # as a timing once answered
    args = ["--engine", "vectorized", "--clients", "4", "--dataset", "digits", "--model", "mlp",
            "--set", "local-epochs=1", "--no-tensorboard"]
    run_dir = tmp_path / "run"
    assert cli(["simulate", *args, "--rounds", "1", "--run-dir", str(run_dir)]) == 0
    recorded = json.loads((run_dir / "vectorized.json").read_text())
    assert list(recorded.values()) == [False]
    monkeypatch.setattr(vec, "_PAYS", {})  # as a new process would start
    monkeypatch.setattr(vec, "batching_rule", lambda *args: pytest.fail("decided again on resume"))
    batched = []
    train_group = vec.train_group
    monkeypatch.setattr(vec, "train_group", lambda calls: batched.append(len(calls)) or train_group(calls))
    assert cli(["simulate", "--engine", "vectorized", "--clients", "4", "--rounds", "2",
                "--resume", str(run_dir)]) == 0
    assert not batched and json.loads((run_dir / "vectorized.json").read_text()) == recorded
    capsys.readouterr()
