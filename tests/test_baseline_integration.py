"""The baselines (FedProx, SCAFFOLD, FedGAMMA, FedSMOO, FedLESAM, -D, -S, FedACG, FedAdam,
FedYogi) end to end: what each client keeps and uploads across rounds, what the server
broadcasts, learning on digits, and the same model in-process, in Ray simulation and over
a real deployment. (Bytes per round and Ray = in-process: test_seed_integration covers
these algorithms too.)"""

from __future__ import annotations

import pytest
import torch

from common import protocol as P
from common.registry import ALGORITHMS
from tests.test_seed_integration import (assert_learns_on_digits, deploy_and_match_inprocess,
                                         run_with_snapshots)

BASELINES = ("fedprox", "scaffold", "fedgamma", "fedsmoo", "fedlesam", "fedlesam-d", "fedlesam-s",
             "fedacg", "fedadam", "fedyogi")
STATEFUL = sorted(name for name, spec in ALGORITHMS.items() if spec.state)


def assert_states_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name])


def test_stateless_algorithms_keep_nothing(tmp_path):
    _, grid = run_with_snapshots(tmp_path, algorithm="fedacg")
    assert all(not after[node] for _, after, _, _ in grid.rounds for node in after)


@pytest.mark.parametrize("algorithm", STATEFUL)
def test_only_sampled_clients_change_their_state_and_keep_what_the_algorithm_needs(tmp_path, algorithm):
    """Every client that trained holds exactly the records its registry entry declares
    (``state``, what the bench's memory table counts); clients not sampled keep theirs bit
    for bit; and some client trains twice (state carried over)."""
    _, grid = run_with_snapshots(tmp_path, algorithm=algorithm)
    trained_twice = False
    for before, after, sent, _ in grid.rounds:
        for node in grid.contexts:
            if node not in sent:
                assert_states_equal(before[node], after[node])
            else:
                trained_twice |= bool(before[node])
                assert set(after[node]) == set(ALGORITHMS[algorithm].state)
    assert trained_twice


@pytest.mark.parametrize("algorithm", ["scaffold", "fedgamma", "fedlesam-s"])
def test_control_variates_follow_option_ii_and_the_upload_is_their_change(tmp_path, algorithm):
    """SCAFFOLD option II on every client that trained: c_i+ = c_i - c + (x - y_K)/(K lr),
    with c the broadcast control, x the model sent, y_K the model returned and K the steps
    it reports; the upload is c_i+ - c_i."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm=algorithm)
    for rnd, (before, after, sent, got) in enumerate(grid.rounds, start=1):
        for node in sent:
            c = P.from_record(sent[node][P.CONTROL])
            x, y = P.from_record(sent[node][P.MODEL]), P.from_record(got[node][P.MODEL])
            steps = got[node].metric_records[P.METRICS]["num-steps"]
            old = before[node].get(P.CLIENT_CONTROL)
            delta = P.from_record(got[node][P.CONTROL_DELTA])
            for k, new in after[node][P.CLIENT_CONTROL].items():
                ci = old[k] if old is not None else torch.zeros_like(new)
                expected = ci - c[k] + (x[k] - y[k]) / (steps * cfg.round_lr(rnd))
                torch.testing.assert_close(new, expected, rtol=0, atol=1e-5)
                torch.testing.assert_close(delta[k], new - ci, rtol=0, atol=1e-6)


def test_scaffold_server_control_moves_by_m_over_n_of_the_mean_upload(tmp_path):
    """c^{r+1} = c^r + (M/N) sum_i p_i Delta c_i, broadcast next round; c^1 = 0."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm="scaffold")
    sent_c = [P.from_record(next(iter(sent.values()))[P.CONTROL]) for _, _, sent, _ in grid.rounds]
    assert all(float(v.abs().max()) == 0 for v in sent_c[0].values())
    n = len(grid.contexts)
    for r, (_, _, sent, got) in enumerate(grid.rounds[:-1]):
        sizes = {node: got[node].metric_records[P.METRICS]["num-examples"] for node in got}
        total = sum(sizes.values())
        for k, c_next in sent_c[r + 1].items():
            step = sum(sizes[node] / total * P.from_record(got[node][P.CONTROL_DELTA])[k] for node in got)
            torch.testing.assert_close(c_next, sent_c[r][k] + len(got) / n * step, rtol=0, atol=1e-6)


def test_fedsmoo_global_perturbation_is_the_normalised_mean_correction(tmp_path):
    """s^{r+1} = rho S/||S||, S = sum_i p_i s~_i of round r (global norm); s^1 = 0."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm="fedsmoo")
    sent_s = [P.from_record(next(iter(sent.values()))[P.GLOBAL_PERTURBATION]) for _, _, sent, _ in grid.rounds]
    assert all(float(v.abs().max()) == 0 for v in sent_s[0].values())
    for r, (_, _, _, got) in enumerate(grid.rounds[:-1]):
        sizes = {node: got[node].metric_records[P.METRICS]["num-examples"] for node in got}
        total = sum(sizes.values())
        mean = {k: sum(sizes[nd] / total * P.from_record(got[nd][P.PERTURBATION_CORRECTION])[k] for nd in got)
                for k in sent_s[0]}
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in mean.values()))
        for k, s in sent_s[r + 1].items():
            torch.testing.assert_close(s, (cfg.params.rho * mean[k] / norm).float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["fedlesam", "fedlesam-d", "fedlesam-s"])
def test_fedlesam_client_remembers_the_global_model_it_received(tmp_path, algorithm):
    """theta_i^old <- theta^t: after each round it trains, a client holds the model it was sent."""
    _, grid = run_with_snapshots(tmp_path, algorithm=algorithm)
    for _, after, sent, _ in grid.rounds:
        for node in sent:
            received = P.from_record(sent[node][P.MODEL])
            assert all(torch.equal(v, received[k]) for k, v in after[node][P.PREVIOUS_GLOBAL].items())


def test_fedacg_sends_the_look_ahead_model_and_evaluates_the_global_one(tmp_path):
    """Round r sends x^r = theta^r + lambda m^r; with lambda = 0 it is theta^r itself (m^1 = 0
    in any case), and the clients' updates are measured from what they were sent."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm="fedacg")
    sent_models = [P.from_record(next(iter(sent.values()))[P.MODEL]) for _, _, sent, _ in grid.rounds]
    init = torch.load(tmp_path / "run" / "model_init.pt")
    assert all(torch.equal(sent_models[0][k], init[k]) for k in init)
    # theta^{r+1} = theta^r + m^{r+1} and x^{r+1} = theta^{r+1} + lambda m^{r+1} (eta_g = 1):
    # rebuild theta and m from the replies and compare with what was sent
    lam, theta, m = cfg.params.lam, dict(init), {k: torch.zeros_like(v) for k, v in init.items()}
    for r, (_, _, sent, got) in enumerate(grid.rounds[:-1]):
        sizes = {node: got[node].metric_records[P.METRICS]["num-examples"] for node in got}
        total = sum(sizes.values())
        for k in theta:
            delta = sum(sizes[nd] / total * (P.from_record(got[nd][P.MODEL])[k] - sent_models[r][k]) for nd in got)
            m[k] = lam * m[k] + delta
            theta[k] = theta[k] + m[k]
            torch.testing.assert_close(sent_models[r + 1][k], theta[k] + lam * m[k], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- learning on digits
@pytest.mark.parametrize("algorithm", BASELINES)
def test_learns_on_digits_with_20_non_iid_clients_at_half_participation(tmp_path, algorithm):
    assert_learns_on_digits(tmp_path, algorithm)


# ---------------------------------------------------------------- same model everywhere
@pytest.mark.integration
def test_real_deployment_runs_fedlesam_s_and_matches_inprocess(tmp_path, capsys):
    """FedLESAM-S over a real SuperLink + 2 SuperNodes (gRPC on 127.0.0.1): c goes down and
    Delta c_i up as extra records, c_i and theta_i^old live in the SuperNodes; 2 down 2 up
    per client; the final model is the in-process one."""
    rows, model_bytes = deploy_and_match_inprocess(tmp_path, capsys, "fedlesam-s", rounds=3, epochs=1)
    assert all(r["bytes_down"] == r["bytes_up"] == 2 * 2 * model_bytes for r in rows[1:])
