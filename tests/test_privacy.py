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

from flatflower.common.config import ConfigError, RunConfig
from flatflower.server.manifest import TRUST_ENV
from flatflower.server.rundir import RunDirError
from flatflower.server.setup import prepare_run
from flatflower.common.privacy import TAIL_X, PrivacyLedger, honest_norm_range, privatize, round_noise_multiplier
from tests.helpers import PARTIAL, assert_differ, fast_config, finals_equal, metrics, run
from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.tools.report import main as report_main


@pytest.mark.parametrize("sigma,rounds,q,delta,epsilon", [
    (0.95, 200, 0.1, 5e-3, 7.773), (0.95, 300, 0.1, 2e-3, 10.795), (1.0, 100, 0.05, 1e-5, 4.038)])
def test_the_accountant_gives_dp_fedsams_published_values(sigma, rounds, q, delta, epsilon):
    """DP-FedSAM's eps_computer.py (its example, sigma 0.95, 200 rounds, q 0.1, delta 5e-3: 7.773)
    and two more points computed with it (dp-fedsam notes §2.4)."""
    ledger = PrivacyLedger()
    for _ in range(rounds):
        ledger.add_round(q, sigma)
    assert ledger.epsilon(delta) == pytest.approx(epsilon, abs=1e-3)


def test_no_noise_spends_everything_and_no_round_nothing():
    ledger = PrivacyLedger()
    assert ledger.epsilon(1e-5) == 0.0
    ledger.add_round(0.5, 0.0)
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
    ({"dp.clip": 1.0, "aggregation": "uniform", "outlier-norm-factor": 3.0}, "needs outlier-norm-factor = 0"),
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
    ledger, expected = PrivacyLedger(), []
    for _ in range(3):
        ledger.add_round(0.5, 1.1)
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


@pytest.mark.parametrize("algorithm,keys,fragment", [
    ("fedgf", {"fedgf.threshold": 1.0}, "fedgf: its server measures each client's distance"),
    ("fedwmsam", {}, "fedwmsam: its server reads each client's update on its own"),
    ("mofedsam", {"local-steps": 0, "local-epochs": 1}, "mofedsam: its server scales each client's update"),
    ("fedtoga", {"local-steps": 0, "local-epochs": 1}, "fedtoga: its server scales each client's update"),
])
def test_a_server_that_reads_single_updates_is_refused_under_dp(tmp_path, algorithm, keys, fragment):
    """The analysis covers the uniform mean of the accepted updates only: FedGF's divergence
    (each client's distance), FedWMSAM's similarity (each client's angle) and the FedCM family's
    1/tau_i with unequal step counts release more, so they are refused with one clear line."""
    with pytest.raises(ConfigError, match=fragment):
        run(tmp_path, algorithm, algorithm=algorithm, **DP, **keys, **{"dp.clip": 1.0})


def test_the_fedcm_family_with_equal_step_counts_runs_under_dp(tmp_path):
    """With local-steps > 0 every client's 1/tau is the same: the global update is a function of
    the mean, and MoFedSAM runs under DP (its epsilon reported)."""
    rows = run(tmp_path, "mofedsam", algorithm="mofedsam", **DP, **{"dp.clip": 1.0,
                                                                    "dp.noise-multiplier": 1.0})["rows"]
    assert all(r["dp_epsilon"] > 0 for r in rows)


def test_the_sampling_rate_is_each_clients_chance_in_the_pool_sampled_from():
    """q for the accountant: fixed sampling, the sampled share of the partitions sampled from
    (not of N when fewer are connected); bernoulli, the fraction given a non-empty draw."""
    from flatflower.strategies.participation import Participation

    fixed = Participation(RunConfig.from_mapping({"sampling": "fixed"}))
    assert fixed.inclusion_rate(100, 10, 0.1) == 0.1
    assert fixed.inclusion_rate(40, 10, 0.1) == 0.25  # 40 of N = 100 connected
    assert fixed.inclusion_rate(0, 0, 0.1) == 0.0
    bern = Participation(RunConfig.from_mapping({"sampling": "bernoulli"}))
    assert bern.inclusion_rate(100, 7, 0.1) == pytest.approx(0.1 / (1 - 0.9 ** 100), rel=1e-12)
    assert bern.inclusion_rate(2, 1, 0.5) == pytest.approx(0.5 / 0.75, rel=1e-12)  # P(i in S | S non-empty)
    assert bern.inclusion_rate(3, 3, 1.0) == 1.0


def test_a_round_with_fewer_accepted_updates_is_accounted_with_the_noise_its_mean_carries(tmp_path):
    """Each client's noise is calibrated to the M clients sampled (sigma C / sqrt(M)); when only
    M' < M updates are accepted, their mean carries sigma C / sqrt(M M') over sensitivity C / M',
    i.e. noise multiplier sigma sqrt(M'/M): the round's ledger entry, and epsilon grows faster."""
    from tests.helpers import run_with_faults

    keys = {"algorithm": "fedavg", "aggregation": "uniform", "num-server-rounds": 2, "dp.clip": 1.0,
            "dp.noise-multiplier": 1.2}
    whole, _ = run_with_faults(tmp_path, "whole", clients=3, **keys)
    cut, _ = run_with_faults(tmp_path, "cut", faults={1: "raise@2"}, clients=3, **keys)
    assert [r["clients_sampled"] for r in cut[1:]] == [3, 3]
    assert [r["dp_sampling_rate"] for r in cut[1:]] == [1.0, 1.0]
    assert [r["dp_noise_multiplier"] for r in whole[1:]] == [1.2, 1.2]
    assert cut[1]["dp_noise_multiplier"] == 1.2
    assert cut[2]["dp_noise_multiplier"] == pytest.approx(1.2 * math.sqrt(2 / 3), rel=1e-12)
    ledger = PrivacyLedger()
    ledger.add_round(1.0, 1.2)
    ledger.add_round(1.0, 1.2 * math.sqrt(2 / 3))
    assert cut[2]["dp_epsilon"] == pytest.approx(ledger.epsilon(1e-5), rel=1e-12)
    assert cut[2]["dp_epsilon"] > whole[2]["dp_epsilon"]
    assert round_noise_multiplier(1.2, 3, 0) is None  # nothing accepted: nothing released
    spent = ledger.epsilon(1e-5)
    ledger.add_round(1.0, None)
    assert ledger.epsilon(1e-5) == spent


def _ledger(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "privacy.jsonl").read_text().splitlines()]


def test_the_privacy_ledger_outlives_a_resume_and_a_damaged_one_is_refused(tmp_path, monkeypatch):
    """privacy.jsonl is never truncated: a round that ran past the checkpoint (its models were
    released) still counts after the resume redoes it. A resume without the ledger, or with a
    round of the checkpoint missing from it, is refused, and nothing of the run is changed."""
    config = fast_config(algorithm="fedavg", aggregation="uniform", **{
        "num-server-rounds": 2, "dp.clip": 1.0, "dp.noise-multiplier": 1.1, "run-dir": str(tmp_path / "r")})
    run_dir, _ = run_inprocess(config, 3)
    assert [e["round"] for e in _ledger(run_dir)] == [1, 2]
    # as if round 3 had run (and released its model) before the process died, its checkpoint unwritten
    extra = {**_ledger(run_dir)[-1], "round": 3}
    with (run_dir / "privacy.jsonl").open("a") as f:
        f.write(json.dumps(extra) + "\n")
    run_inprocess({**config, "num-server-rounds": 3, "resume": True}, 3)
    ledger = PrivacyLedger()
    for entry in _ledger(run_dir):
        ledger.add_round(entry["dp_sampling_rate"], entry["dp_noise_multiplier"])
    assert [e["round"] for e in _ledger(run_dir)] == [1, 2, 3, 3]
    assert metrics(run_dir)[-1]["dp_epsilon"] == pytest.approx(ledger.epsilon(1e-5), rel=1e-12)

    kept = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "privacy.jsonl").write_text("\n".join(json.dumps(e) for e in _ledger(run_dir)[1:]) + "\n")
    with pytest.raises(Exception, match=r"privacy.jsonl \(its rows up to the checkpoint\) is shorter than"):
        run_inprocess({**config, "num-server-rounds": 4, "resume": True}, 3)  # manifest.json's record first
    (run_dir / "manifest.json").unlink()  # the ledger's own check (a run directory without a manifest)
    monkeypatch.setenv(TRUST_ENV, str(run_dir))  # --trust-run-dir: else refused for the missing manifest
    with pytest.raises(Exception, match=r"lacks rounds \[1\] of the checkpoint's 1-3"):
        run_inprocess({**config, "num-server-rounds": 4, "resume": True}, 3)
    (run_dir / "privacy.jsonl").unlink()
    with pytest.raises(Exception, match=r"privacy.jsonl lacks rounds \[1, 2, 3\]"):
        run_inprocess({**config, "num-server-rounds": 4, "resume": True}, 3)
    assert (run_dir / "metrics.jsonl").read_text() == kept


def test_dp_fedsam_without_dp_says_so(tmp_path, caplog):
    """dp-fedsam with dp.clip = 0 (the general default) runs DP-FedSAM's local optimizer alone, as
    its identity with FedSAM needs, and the run's log says that nothing is private."""
    with caplog.at_level("WARNING"):
        rows = run(tmp_path, "nodp", algorithm="dp-fedsam")["rows"]
    assert "dp-fedsam with dp.clip = 0: no clipping and no noise, so no privacy" in caplog.text
    assert all("dp_epsilon" not in r for r in rows)


@pytest.mark.parametrize("aggregation, dp", [("uniform", False), ("weighted", False), ("uniform", True)])
def test_a_round_with_no_accepted_update_is_skipped_under_every_aggregation(tmp_path, aggregation, dp):
    """Round 1: one client fails and the other's update is NaN (refused), so no update is accepted. The round is skipped (model and server state unchanged), never the
    run's end: under ``uniform`` too (1/M with M = 0 ended it once), and under DP (which needs
    uniform) it spends no privacy: its ledger entry has no noise multiplier and epsilon is that of
    round 2 alone."""
    from tests.helpers import run_with_faults

    keys = {"algorithm": "fedavg", "aggregation": aggregation, "num-server-rounds": 2}
    if dp:
        keys.update({"dp.clip": 1.0, "dp.noise-multiplier": 1.2})
    rows, _ = run_with_faults(tmp_path, "empty", faults={0: "raise@1-1", 1: "nan@1-1"}, clients=2, **keys)
    run_dir = tmp_path / "empty"
    assert [r["skipped"] for r in rows[1:]] == [1, 0]
    assert [r["clients_rejected"] + r["clients_failed"] for r in rows[1:]] == [2, 0]
    assert rows[1]["test_accuracy"] == rows[0]["test_accuracy"]  # the model did not move
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    if dp:
        assert [e["dp_noise_multiplier"] for e in _ledger(run_dir)] == [None, 1.2]
        ledger = PrivacyLedger()
        ledger.add_round(1.0, None)  # round 1 released nothing
        assert rows[1]["dp_epsilon"] == ledger.epsilon(1e-5)
        ledger.add_round(1.0, 1.2)
        assert rows[2]["dp_epsilon"] == pytest.approx(ledger.epsilon(1e-5), rel=1e-12)


# ---------------------------------------------------------------- updates no honest client sends
def _honest_norms(rng, n, dim, tensors, clip, sigma, sampled, mode):
    """Norms of n honest uploads: a clipped update of the largest norm allowed (a random
    direction; per-tensor: each of ``tensors`` equal blocks at norm C) plus N(0, s^2 I)."""
    c = rng.standard_normal((n, dim))
    blocks = np.array_split(np.arange(dim), tensors) if mode == "per-tensor" else [np.arange(dim)]
    for b in blocks:
        c[:, b] *= clip / np.linalg.norm(c[:, b], axis=1, keepdims=True)
    noise = rng.standard_normal((n, dim)) * sigma * clip / math.sqrt(sampled)
    return np.linalg.norm(c + noise, axis=1)


@pytest.mark.parametrize("mode", ["global", "per-tensor"])
@pytest.mark.parametrize("dim, sigma", [(650, 1.2), (5000, 0.3), (50, 0.0)])
def test_honest_updates_stay_in_the_norm_range_and_each_tail_is_below_its_probability(mode, dim, sigma):
    """Laurent-Massart's chi-square tails: at x = 60 (e^-60 = 8.8e-27 per bound) no sampled
    honest update falls outside [lo, hi]; at x = 2 each side's measured rate is below e^-2, so
    the stated probability is an upper bound; and hi is at most 1.6 x the largest honest norm
    seen (conservative, not loose enough to let a scaled update through)."""
    rng = np.random.default_rng(0)
    clip, sampled, tensors = 0.7, 4, 5
    norms = _honest_norms(rng, 20_000, dim, tensors, clip, sigma, sampled, mode)
    lo, hi = honest_norm_range(clip, sigma, sampled, dim, tensors, mode)
    assert lo <= norms.min() and norms.max() <= hi * (1 + 1e-12)
    assert hi <= 1.6 * norms.max() + 1e-12
    lo2, hi2 = honest_norm_range(clip, sigma, sampled, dim, tensors, mode, x=2.0)
    assert (norms > hi2 * (1 + 1e-12)).mean() <= math.exp(-2) and (norms < lo2).mean() <= math.exp(-2)
    # the delta the refusal adds over 800 rounds of 10 clients at epsilon = 10 (docs/privacy.md)
    assert 800 * 10 * 2 * math.exp(-TAIL_X) * (1 + math.exp(10)) < 1e-15


def test_the_lower_bound_catches_an_update_without_noise_only_when_the_noise_dominates():
    lo, _ = honest_norm_range(1.0, 1.0, 4, 650)  # s = 0.5 over 650 coordinates: ||n|| ~ 12.7
    assert lo > 1.0  # an un-noised update (norm <= C) is below it
    assert honest_norm_range(1.0, 0.0, 4, 650)[0] == 0.0  # no noise: nothing to miss
    assert honest_norm_range(1.0, 0.1, 4, 650)[0] == 0.0  # noise norm ~ 1.3 < 2C: no lower bound


def test_under_dp_updates_no_honest_client_sends_are_refused_every_round(tmp_path):
    """Issue 44: under DP the server never checked the clip bound, and a client that did not
    clip (x1e4) was accepted every round. Now a x1e4 and a x1e30 client, and one that leaves out
    its noise (x0: an update of norm 0), are refused in every round with the norm range in
    the reason; the honest client is accepted every round, the run completes with a finite
    model, and each round is accounted with the noise its mean of one update carries."""
    from tests import malicious

    keys = fast_config(algorithm="fedavg", dataset="digits", aggregation="uniform", num_server_rounds=3,
                       **{"dp.clip": 1.0, "dp.noise-multiplier": 1.0, "fraction-train": 1.0,
                          "run-dir": str(tmp_path / "r")})
    attacks = {1: "scale:1e4", 2: "scale:1e30", 3: "scale:0"}
    run_dir, _ = run_inprocess(keys, 4, client_app=malicious.malicious_app(attacks))
    rows = metrics(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    for row in rows[1:]:
        refused = {r["partition"]: r["reason"] for r in row["rejections"] if r["stage"] == "train"}
        assert sorted(refused) == [1, 2, 3], row
        assert all("the norms an honest update clipped to dp.clip=1 and noised can have" in why
                   for why in refused.values())
        assert row["skipped"] == 0 and row["dp_noise_multiplier"] == pytest.approx(1.0 * math.sqrt(1 / 4))
    final = torch.load(run_dir / "model_final.pt")
    assert all(torch.isfinite(t).all() for t in final.values())


def test_honest_dp_runs_refuse_no_update(tmp_path):
    """The range in practice: honest clients under both clip modes, small and large noise,
    are never refused."""
    for mode, sigma in (("global", 1.0), ("per-tensor", 0.3), ("global", 0.0)):
        keys = fast_config(algorithm="fedavg", dataset="digits", aggregation="uniform", num_server_rounds=2,
                           **{"dp.clip": 0.5, "dp.noise-multiplier": sigma, "dp.clip-mode": mode,
                              "fraction-train": 1.0, "run-dir": str(tmp_path / f"{mode}-{sigma}")})
        run_dir, _ = run_inprocess(keys, 4)
        assert all(r["clients_rejected"] == 0 and r["skipped"] == 0 for r in metrics(run_dir)[1:]), (mode, sigma)


@pytest.mark.parametrize("edit, fragment", [
    ({"dp_noise_multiplier": 1000.0}, "noise multiplier 1000.0 at sampling rate"),
    ({"dp_sampling_rate": 0.0}, "at sampling rate 0.0, which no round of this run"),
    ({"dp_noise_multiplier": "x"}, "not a privacy ledger entry"),
    ({"round": 0}, "round 0"),
])
def test_a_ledger_edited_to_lower_epsilon_is_refused_even_without_a_manifest(tmp_path, monkeypatch, edit, fragment):
    """Issue 44: privacy.jsonl's noise edited to 1000 (or the sampling rate to 0) made a resume
    report a smaller epsilon. manifest.json refuses any edit; a run directory without one (an
    older run's) is checked against what this config can have written, and refused in one
    line naming the file; nothing is changed."""
    config = fast_config(algorithm="fedavg", aggregation="uniform", **{
        "num-server-rounds": 2, "dp.clip": 1.0, "dp.noise-multiplier": 1.1, "run-dir": str(tmp_path / "r")})
    run_dir, _ = run_inprocess(config, 3)
    entries = _ledger(run_dir)
    entries[0] = {**entries[0], **edit}
    (run_dir / "privacy.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    with pytest.raises(Exception, match="privacy.jsonl"):  # the manifest's record first
        run_inprocess({**config, "num-server-rounds": 3, "resume": True}, 3)
    (run_dir / "manifest.json").unlink()
    monkeypatch.setenv(TRUST_ENV, str(run_dir))  # --trust-run-dir: else refused for the missing manifest
    kept = {name: (run_dir / name).read_text() for name in ("metrics.jsonl", "summary.json")}
    with pytest.raises(RunDirError, match=r"privacy.jsonl, line 1: .*" + fragment):
        run_inprocess({**config, "num-server-rounds": 3, "resume": True}, 3)
    with pytest.raises(RunDirError, match=r"privacy.jsonl, line 1: .*" + fragment):  # the CLI's preflight
        prepare_run(RunConfig.from_mapping({**config, "num-server-rounds": 3, "resume": True,
                                            "num-partitions": 3}))
    assert {name: (run_dir / name).read_text() for name in kept} == kept  # summary.json included


def test_epsilon_never_decreases_across_rounds_and_resumes(tmp_path):
    """Each round adds its privacy; a resume (which recounts the redone rounds) never lowers it;
    rounds with failed clients raise it faster, never lower it."""
    from tests.helpers import run_with_faults

    keys = {"algorithm": "fedavg", "aggregation": "uniform", "num-server-rounds": 4,
            "dp.clip": 1.0, "dp.noise-multiplier": 1.0, "checkpoint-every": 1}
    rows, _ = run_with_faults(tmp_path, "f", faults={0: "raise@2-3"}, clients=3, **keys)
    eps = [r["dp_epsilon"] for r in rows[1:]]
    assert all(a < b for a, b in zip(eps, eps[1:])), eps
    config = fast_config(**{**keys, "num-server-rounds": 2, "run-dir": str(tmp_path / "r")})
    run_dir, _ = run_inprocess(config, 3)
    run_inprocess({**config, "num-server-rounds": 4, "resume": True}, 3)
    eps = [r["dp_epsilon"] for r in metrics(run_dir)[1:]]
    assert len(eps) >= 4 and all(a <= b for a, b in zip(eps, eps[1:])), eps
