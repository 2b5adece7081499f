"""Robust aggregation (``aggregator``): each rule on hand-computed numbers, its bound against
one Byzantine client, and its composition with every algorithm's server state."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from flatflower.common.config import AGGREGATORS, ConfigError, RunConfig
from flatflower.common.protocol import CONTROL, CONTROL_DELTA
from flatflower.strategies.registry import ALGORITHMS
from flatflower.strategies.registry import get as get_spec
from flatflower.tools.cli import main as cli
from flatflower.common.tensors import global_norm
from flatflower.strategies.aggregate import Aggregator, weighted_sum
from flatflower.strategies.validation import ClientUpdate
from tests.helpers import MODEL, fast_config, run_with_faults

ROBUST = ("median", "trimmed-mean", "krum", "multi-krum", "bulyan")


def vec(*values) -> OrderedDict:
    return OrderedDict(w=torch.tensor(values, dtype=torch.float32))


def agg(name: str, items, weights=None, **kw) -> torch.Tensor:
    weights = weights or [1.0 / len(items)] * len(items)
    return Aggregator(name, **kw)(items, weights)["w"]


# ---------------------------------------------------------------- each rule by hand
def test_each_rule_on_hand_computed_numbers():
    items = [vec(1.0, 10.0), vec(2.0, 20.0), vec(3.0, 30.0), vec(5.0, 50.0), vec(100.0, -1000.0)]
    assert torch.equal(agg("mean", items), weighted_sum(items, [0.2] * 5)["w"])
    assert agg("median", items).tolist() == [3.0, 20.0]
    # trim 0.2 of 5 = 1 value cut at each end of each coordinate: mean of the middle three
    assert agg("trimmed-mean", items, trim=0.2).tolist() == pytest.approx([10 / 3, 20.0])
    # Krum (f=1, n=5): a point's score is the sum of squared distances to its n-f-2 = 2
    # nearest neighbours: (2, 20) has 101 + 101, (1, 10) and (3, 30) 101 + 404, (5, 50) 404 + 909
    assert agg("krum", items, f=1).tolist() == [2.0, 20.0]
    # multi-krum keeps the n-f = 4 best scores (the outlier's is worst) and averages them
    assert agg("multi-krum", items, f=1).tolist() == pytest.approx([2.75, 27.5])
    # norm-clip at 60: (100, -1000) has norm ~1005 and is scaled to norm 60; the others are kept
    outlier = torch.tensor([100.0, -1000.0])
    outlier = outlier * (60.0 / float(outlier.norm()))
    expected = torch.stack([i["w"] for i in items[:4]] + [outlier]).mean(0)
    assert agg("norm-clip", items, clip=60.0).tolist() == pytest.approx(expected.tolist())


def test_centered_clip_on_hand_computed_numbers():
    """From the median 2, τ = the median distance to it, 2 (distances 2, 1, 0, 2, 98): each
    step adds the mean of the clipped differences: (-2 - 1 + 0 + 2 + 2) / 5 = 0.2, then
    (-2 - 1.2 - 0.2 + 1.8 + 2) / 5 = 0.08, then (-2 - 1.28 - 0.28 + 1.72 + 2) / 5 = 0.032."""
    items = [vec(0.0), vec(1.0), vec(2.0), vec(4.0), vec(100.0)]
    assert agg("centered-clip", items, iterations=1).tolist() == pytest.approx([2.2])
    assert agg("centered-clip", items).tolist() == pytest.approx([2.312])  # 3 iterations
    # a fixed τ = 1: differences -2, -1, 0, 2, 98 clip to -1, -1, 0, 1, 1: the median stays
    assert agg("centered-clip", items, clip=1.0, iterations=1).tolist() == pytest.approx([2.0])
    # the clip is on the whole vector's norm: (3, 4) - (0, 0) has norm 5, clipped to 1: (0.6, 0.8)
    pair = [vec(0.0, 0.0), vec(0.0, 0.0), vec(3.0, 4.0)]
    assert agg("centered-clip", pair, clip=1.0, iterations=1).tolist() == pytest.approx([0.2, 0.8 / 3])
    # sample weights count as in the mean: (0.5, 0.25, 0.25) -> 0.25 * (0.6, 0.8)
    assert agg("centered-clip", pair, [0.5, 0.25, 0.25], clip=1.0, iterations=1).tolist() == \
        pytest.approx([0.15, 0.2])


def test_rules_are_computed_in_float64_so_1e30_values_cannot_overflow():
    """Squares of float32 values near 1e30 overflow float32: Krum's distances and the clipping
    norms are float64, so a 1e30 client is scored and clipped, never turned into inf/NaN."""
    items = [vec(1.0, 2.0), vec(1.5, 2.5), vec(2.0, 3.0), vec(2.5, 3.5), vec(1e30, 1e30)]
    for name in ("krum", "multi-krum", "norm-clip", "centered-clip"):
        out = agg(name, items)
        assert bool(torch.isfinite(out).all()) and float(out.abs().max()) < 10, name


def test_bulyan_needs_4f_plus_3_and_then_ignores_the_outlier():
    honest = [vec(float(i), float(-i)) for i in range(6)]
    items = honest + [vec(1e6, 1e6)]
    out = agg("bulyan", items, f=1)
    low, high = torch.stack([h["w"] for h in honest]).min(0).values, torch.stack([h["w"] for h in honest]).max(0).values
    assert bool(((out >= low) & (out <= high)).all())
    with pytest.raises(ValueError, match="needs at least 7 updates"):
        agg("bulyan", items[:6], f=1)
    assert Aggregator("bulyan", f=2).required() == 11 and Aggregator("krum", f=2).required() == 7


@pytest.mark.parametrize("name", ROBUST)
def test_one_byzantine_client_cannot_drag_a_robust_rule_outside_the_honest_range(name):
    """7 clients, one sends a huge update: each coordinate of the result stays within the
    honest clients' range (the mean would be dragged to ~1e8)."""
    gen = torch.Generator().manual_seed(0)
    honest = [OrderedDict(w=torch.randn(50, generator=gen)) for _ in range(6)]
    items = honest + [OrderedDict(w=torch.full((50,), 1e9))]
    out = agg(name, items, trim=0.2)
    stacked = torch.stack([h["w"] for h in honest])
    assert bool(((out >= stacked.min(0).values - 1e-6) & (out <= stacked.max(0).values + 1e-6)).all())
    assert float(agg("mean", items).abs().min()) > 1e7


def test_norm_clip_bounds_every_clients_influence():
    gen = torch.Generator().manual_seed(1)
    honest = [OrderedDict(w=torch.randn(20, generator=gen)) for _ in range(6)]
    items = honest + [OrderedDict(w=torch.full((20,), 1e9))]
    median_norm = float(np.median([float(global_norm(i, torch.float64)) for i in items]))
    out = Aggregator("norm-clip")(items, [1 / 7] * 7)  # bound: the round's median norm
    assert float(global_norm(out, torch.float64)) <= median_norm + 1e-5


# ---------------------------------------------------------------- composition with every algorithm
def rule_for(algorithm: str, aggregator: str):
    """The algorithm's server rule (pure tensor code, no Flower) over N = 10 clients."""
    cfg = RunConfig.from_mapping(fast_config(aggregator=aggregator, **get_spec(algorithm).example_config()))
    return get_spec(algorithm).new_rule(cfg, MODEL, num_partitions=10)


def updates(rule, outlier: bool) -> list[ClientUpdate]:
    """7 clients with the same update (model and uploads), the last one huge if ``outlier``."""
    out = []
    for i in range(7):
        shift = 1e6 if outlier and i == 6 else 0.1
        model = OrderedDict((k, v + shift) for k, v in rule.start_point().items())
        uploads = {name: OrderedDict((k, torch.full_like(v, shift)) for k, v in MODEL.items())
                   for name in rule.spec.up}
        out.append(ClientUpdate(1000 + i, i, 100, 2, 1.0, model, uploads))
    return out


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_robust_rules_compose_with_every_algorithms_server_state(algorithm):
    """Under each robust rule, 6 identical honest clients and one huge one leave the model and
    every piece of server state (duals, control variates, momentum, EMA, global update,
    global perturbation, moments) exactly where 7 honest clients under the mean put them."""
    reference = rule_for(algorithm, "mean")
    reference.update(1, updates(reference, outlier=False), [1 / 7] * 7)
    for name in ROBUST:
        rule = rule_for(algorithm, name)
        rule.update(1, updates(rule, outlier=True), [1 / 7] * 7)
        for key in ("model", *reference.records):
            ours = rule.model if key == "model" else rule.records[key]
            theirs = reference.model if key == "model" else reference.records[key]
            for k in theirs:
                assert torch.allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6), (name, key, k)


def test_every_aggregator_is_one_the_config_accepts():
    assert set(AGGREGATORS) == {"mean", *ROBUST, "norm-clip", "centered-clip"}


@pytest.mark.parametrize("value", [0, 101, 2.5])
def test_aggregator_iterations_is_validated(value):
    with pytest.raises(ConfigError, match="aggregator-iterations"):
        RunConfig.from_mapping(fast_config(aggregator="centered-clip", aggregator_iterations=value))


@pytest.mark.parametrize("name", ("krum", "multi-krum", "bulyan"))
def test_the_krum_family_picks_the_same_clients_for_the_model_and_every_record(name):
    """SCAFFOLD, 7 clients: six honest ones spread around the attacker, whose model update is
    the most central of all and whose Δc is 1e30. Picked by the model alone, the attacker
    would be kept (and its Δc left to a separate pick); scored on all its uploads together it
    is dropped from every quantity: model and c are those of the honest clients' picks."""
    rule = rule_for("scaffold", name)
    start = rule.start_point()
    out = []
    for i, shift in enumerate([-0.31, -0.17, -0.05, 0.08, 0.22, 0.4, 0.0]):
        model = OrderedDict((k, v + shift) for k, v in start.items())
        dc = OrderedDict((k, torch.full_like(v, 1e30 if i == 6 else shift)) for k, v in start.items())
        out.append(ClientUpdate(1000 + i, i, 100, 2, 1.0, model, {CONTROL_DELTA: dc}))
    assert rule.apply(1, out, [1 / 7] * 7)
    assert 6 not in rule.aggregator.choose([rule.uploads(u) for u in out])
    step = OrderedDict((k, rule.model[k] - start[k]) for k in start)
    control = rule.records[CONTROL]
    assert bool(torch.isfinite(control["1.weight"]).all())
    assert float(max(v.abs().max() for v in control.values())) <= 0.4
    # the model step and the control step come from the same clients: Δc_i = model shift_i here
    for k in start:
        assert torch.allclose(control[k] * 10 / 7, step[k], atol=1e-6), (name, k)


@pytest.mark.parametrize("name, picks", [("mean", False), ("median", False), ("norm-clip", False),
                                         ("krum", True), ("bulyan", True)])
def test_the_uploads_are_built_for_a_rule_that_picks_clients_only(name, picks, monkeypatch):
    """A round under a Krum-family rule scores every client's uploads (its model update and
    records) to pick the clients; the other rules combine every client, and a round under
    them never builds that list (a subtraction per client and tensor, for nothing)."""
    rule = rule_for("scaffold", name)
    built = []
    original = type(rule).uploads
    monkeypatch.setattr(type(rule), "uploads", lambda self, u: built.append(u) or original(self, u))
    out = updates(rule, outlier=False)
    assert rule.apply(1, out, [1 / 7] * 7)
    assert built == (out if picks else [])
    assert rule.aggregator.picks(len(out)) is picks
    assert not rule.aggregator.picks(rule.aggregator.required() - 1)


# ---------------------------------------------------------------- in a run
def test_a_round_with_fewer_updates_than_the_rule_needs_is_skipped(tmp_path, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="flwr.flatflower.server")
    rows, _ = run_with_faults(tmp_path, "krum", {3: "raise@2"}, clients=5, aggregator="krum")
    assert [r["skipped"] for r in rows[1:]] == [0, 1]
    assert "aggregator krum needs 5" in caplog.text


@pytest.fixture(scope="module")
def sign_flip_runs(tmp_path_factory):
    """6 rounds of FedSAM over 5 clients, one of which flips and scales its update by 4.5
    every round, under each rule; and the same without the attacker's lie."""
    from tests.malicious import malicious_app

    tmp = tmp_path_factory.mktemp("flip")
    out = {}
    for name in ("mean", "median", "trimmed-mean", "krum", "multi-krum", "norm-clip"):
        for tag, app in (("attacked", malicious_app({4: "sign-flip:4.5"})), ("clean", None)):
            rows, _ = run_with_faults(tmp, f"{name}-{tag}", client=app, clients=5, algorithm="fedsam",
                          aggregator=name, num_server_rounds=6)
            out[name, tag] = rows[-1]["test_accuracy"]
    return out


@pytest.mark.xdist_group("sign-flip")  # one worker builds the module fixture once
@pytest.mark.parametrize("name", ("median", "trimmed-mean", "krum", "multi-krum"))
def test_a_sign_flipping_client_barely_moves_a_robust_rule(sign_flip_runs, name):
    assert sign_flip_runs["mean", "attacked"] < 0.2  # the mean follows the attacker to chance
    assert sign_flip_runs[name, "attacked"] >= sign_flip_runs[name, "clean"] - 0.03


@pytest.mark.xdist_group("sign-flip")  # one worker builds the module fixture once
def test_norm_clipping_bounds_a_sign_flipping_client(sign_flip_runs):
    """Clipping to the median norm keeps the attacker's pull to that of an honest client: the
    run learns, more slowly than without it."""
    assert sign_flip_runs["norm-clip", "attacked"] > sign_flip_runs["mean", "attacked"] + 0.5


def test_cli_refuses_a_rule_the_federation_is_too_small_for(tmp_path, capsys):
    code = cli(["simulate", "--engine", "inprocess", "--clients", "4", "--set", "aggregator=bulyan",
                "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "aggregator bulyan needs at least 7 clients per round (aggregator-f=1)" in err[0]
    assert not (tmp_path / "r").exists()
