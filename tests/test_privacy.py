"""Client-level differential privacy (common/privacy.py) and DP-FedSAM: clipping bounds every
update, the noise has the calibrated scale, the accountant gives the published values, and
with no clipping and no noise DP-FedSAM is FedSAM."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch

from common.config import ConfigError, RunConfig
from common.privacy import PrivacyLedger, privatize
from tests.helpers import PARTIAL, assert_differ, fast_config, finals_equal, metrics, run
from tools.engines.inprocess import run_inprocess
from tools.report import main as report_main


@pytest.mark.parametrize("sigma,rounds,q,delta,epsilon", [
    (0.95, 200, 0.1, 5e-3, 7.773), (0.95, 300, 0.1, 2e-3, 10.795), (1.0, 100, 0.05, 1e-5, 4.038)])
def test_the_accountant_gives_dp_fedsams_published_values(sigma, rounds, q, delta, epsilon):
    """DP-FedSAM's eps_computer.py (its example, sigma 0.95, 200 rounds, q 0.1, delta 5e-3: 7.773)
    and two more points computed with it (dp-fedsam notes §2.4)."""
    ledger = PrivacyLedger(sigma)
    for _ in range(rounds):
        ledger.add_round(q)
    assert ledger.epsilon(delta) == pytest.approx(epsilon, abs=1e-3)


def test_no_noise_spends_everything_and_no_round_nothing():
    ledger = PrivacyLedger(0.0)
    assert ledger.epsilon(1e-5) == 0.0
    ledger.add_round(0.5)
    assert math.isinf(ledger.epsilon(1e-5))


def _named(*values):
    return OrderedDict((f"t{i}", torch.tensor(v, dtype=torch.float32)) for i, v in enumerate(values))


def test_clipping_by_hand_global_and_per_tensor():
    """Delta = (3, 4) and (12,): global norm 13, clipped to 6.5 by half; per tensor each to
    its own norm (5 -> 5, 12 -> 6.5); a buffer is uploaded as received."""
    received = OrderedDict(**_named([1.0, 1.0], [0.0]), buffer=torch.tensor([7.0]))
    trained = OrderedDict(**_named([4.0, 5.0], [12.0]), buffer=torch.tensor([9.0]))
    out = privatize(trained, received, ["t0", "t1"], clip=6.5, noise_multiplier=0.0, sampled=3)
    assert torch.allclose(out["t0"], torch.tensor([2.5, 3.0])) and torch.allclose(out["t1"], torch.tensor([6.0]))
    assert torch.equal(out["buffer"], received["buffer"])
    out = privatize(trained, received, ["t0", "t1"], clip=6.5, noise_multiplier=0.0, sampled=3, mode="per-tensor")
    assert torch.allclose(out["t0"], torch.tensor([4.0, 5.0])) and torch.allclose(out["t1"], torch.tensor([6.5]))


def test_each_client_adds_noise_of_std_sigma_clip_over_sqrt_m():
    """sigma 2, C 1, M 4: per coordinate std 2 * 1 / 2 = 1, measured over 200,000 draws."""
    zeros = OrderedDict(w=torch.zeros(200_000))
    out = privatize(zeros, zeros, ["w"], clip=1.0, noise_multiplier=2.0, sampled=4,
                    generator=torch.Generator().manual_seed(0))
    assert float(out["w"].std()) == pytest.approx(1.0, rel=0.01)
    assert abs(float(out["w"].mean())) < 0.01


@pytest.mark.parametrize("values,fragment", [
    ({"dp.clip": 1.0}, "needs aggregation = uniform"),
    ({"dp.noise-multiplier": 1.0}, "needs dp.clip > 0"),
    ({"dp.clip": 1.0, "aggregation": "uniform", "aggregator": "median"}, "needs aggregator = mean"),
    ({"dp.clip": 1.0, "aggregation": "uniform", "too-few-replies": "retry"}, "needs too-few-replies = skip"),
    ({"dp.clip": -1.0}, "dp.clip must be"), ({"dp.delta": 1.0}, "dp.delta must be in (0, 1)"),
    ({"dp.clip-mode": "tensor"}, "dp.clip-mode='tensor' is not one of"),
])
def test_bad_dp_settings_are_refused(values, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        RunConfig.from_mapping(values)


DP = {"aggregation": "uniform", **PARTIAL}


def clients(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "clients.jsonl").read_text().splitlines()]


def test_dp_fedsam_without_clipping_or_noise_is_fedsam_and_asam_differs(tmp_path):
    """dp-fedsam notes §4: no clipping (C far above every update) and no noise with the paper's
    SAM is FedSAM bit for bit; the code's ASAM (eta = 0) is another optimizer."""
    keys = {**DP, "sam.rho": 0.3}
    fedsam = run(tmp_path, "fedsam", algorithm="fedsam", **keys)
    assert finals_equal(run(tmp_path, "dp", algorithm="dp-fedsam", **keys, **{
        "dp-fedsam.local": "sam", "dp.clip": 1e6}), fedsam)
    assert_differ(run(tmp_path, "asam", algorithm="dp-fedsam", **keys), fedsam)


def test_clipping_bounds_every_update_the_server_accepts(tmp_path):
    """C = 0.05, far below the updates' norms without DP: every accepted update's norm (the
    server's own measure, clients.jsonl) is at most C, and the round's epsilon is inf (no noise)."""
    plain = run(tmp_path, "plain", algorithm="fedavg", **DP)
    assert max(r["update_norm"] for r in clients(plain["run_dir"])) > 0.5
    clipped = run(tmp_path, "clipped", algorithm="fedavg", **DP, **{"dp.clip": 0.05})
    norms = [r["update_norm"] for r in clients(clipped["run_dir"]) if r["status"] == "accepted"]
    assert norms and max(norms) <= 0.05 * (1 + 1e-5)
    assert all(r["dp_epsilon"] is None for r in metrics(clipped["run_dir"])[1:])  # inf: no noise


def test_with_lr_near_zero_the_global_model_moves_by_the_noise_alone(tmp_path):
    """sigma 2, C 1, all 4 clients each round (M = 4): the uniform mean carries noise of std
    sigma C / M = 0.5 per coordinate, measured on the MLP's ~5,000 weights after one round."""
    config = fast_config(algorithm="fedavg", dataset="digits", model="mlp", **{
        "aggregation": "uniform", "num-server-rounds": 1, "lr": 1e-12, "dp.clip": 1.0,
        "dp.noise-multiplier": 2.0, "run-dir": str(tmp_path / "r")})
    run_dir, _ = run_inprocess(config, 4)
    init, final = (torch.load(run_dir / name) for name in ("model_init.pt", "model_final.pt"))
    moved = torch.cat([(final[k] - init[k]).flatten().double() for k in init])
    assert moved.numel() > 4000
    assert float(moved.std()) == pytest.approx(0.5, rel=0.05)


@pytest.mark.slow
def test_epsilon_is_reported_every_round_and_survives_a_resume(tmp_path):
    """q = M/N = 2/4 each round; the resumed run's epsilon after round 3 is the uninterrupted
    run's, and both are the accountant's."""
    keys = {**DP, "dp.clip": 1.0, "dp.noise-multiplier": 1.1, "dp.delta": 1e-4}
    whole = run(tmp_path, "whole", algorithm="dp-fedsam", **keys)
    ledger, expected = PrivacyLedger(1.1), []
    for _ in range(3):
        ledger.add_round(0.5)
        expected.append(ledger.epsilon(1e-4))
    rows = metrics(whole["run_dir"])[1:]
    np.testing.assert_allclose([r["dp_epsilon"] for r in rows], expected, rtol=1e-12)
    assert expected[0] < expected[1] < expected[2]
    config = {**whole["cfg"], "run-dir": str(tmp_path / "cut"), "num-server-rounds": 2}
    run_dir, _ = run_inprocess(config, PARTIAL["num_clients"])
    run_inprocess({**config, "num-server-rounds": 3, "resume": True}, PARTIAL["num_clients"])
    assert metrics(run_dir)[-1]["dp_epsilon"] == pytest.approx(expected[2], rel=1e-12)
    # `flatflower report` shows the privacy spent by the last round, per run and per algorithm
    report = tmp_path / "report.json"
    assert report_main([str(whole["run_dir"]), str(run_dir), "--out", str(tmp_path / "r.png"),
                        "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert [r["dp_epsilon"] for r in data["runs"]] == pytest.approx([expected[2]] * 2, rel=1e-12)
    assert data["by_algorithm"][0]["dp_epsilon_mean"] == pytest.approx(expected[2], rel=1e-12)


def test_an_algorithm_that_uploads_more_than_the_model_is_refused(tmp_path):
    with pytest.raises(Exception, match="scaffold uploads control_delta besides the model"):
        run(tmp_path, "scaffold", algorithm="scaffold", **DP, **{"dp.clip": 1.0})
