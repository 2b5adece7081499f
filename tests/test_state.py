"""What each algorithm sends and keeps, in real runs: the records and bytes per round its
paper states, the client state across rounds (only sampled clients change theirs), and the
server state it broadcasts."""

from __future__ import annotations

import json

import pytest
import torch

from flatflower.client.app import META
from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.strategies.registry import ALGORITHMS
from tests.helpers import assert_states_equal, fast_config, metrics, run_with_snapshots
from tests.reference import PAPER_PATTERN
from flatflower.runtime.engines.inprocess import run_inprocess

# ---------------------------------------------------------------- what crosses the wire


def test_every_registered_algorithm_has_a_stated_pattern():
    assert set(PAPER_PATTERN) == set(ALGORITHMS)


@pytest.mark.parametrize("algorithm", sorted(PAPER_PATTERN))
def test_bytes_per_round_follow_the_papers_communication_pattern(tmp_path, algorithm):
    run_dir, _ = run_inprocess(fast_config(**ALGORITHMS[algorithm].example_config(), fraction_train=0.5,
                                           num_server_rounds=2, run_dir=str(tmp_path / "r")), 4)
    model_bytes = json.loads((run_dir / "summary.json").read_text())["model_bytes"]
    down, up = PAPER_PATTERN[algorithm]
    for row in metrics(run_dir)[1:]:
        assert row["clients_sampled"] == 2 and len(row["sampled_partitions"]) == 2
        assert row["bytes_down"] == row["clients_sampled"] * down * model_bytes
        assert row["bytes_up"] == row["clients_replied"] * up * model_bytes


# ---------------------------------------------------------------- what each client keeps
STATEFUL = sorted(name for name, spec in ALGORITHMS.items() if spec.state)


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


@pytest.mark.parametrize("algorithm", ["feddyn", "fedspeed", "fedtoga", "fedgmt", "fedgmt-v2"])
def test_client_dual_survives_rounds_and_only_sampled_clients_change_it(tmp_path, algorithm):
    """h_i <- h_i - a (theta_K - theta^t) on the clients that trained (FedDyn; FedGMT's
    u_m with a = 1/beta), nothing else: clients not sampled keep their state bit for bit."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm=algorithm)
    a = {"fedgmt": lambda p: 1 / p.beta, "fedgmt-v2": lambda p: 1 / p.beta,
         "fedtoga": lambda p: p.coefficient()}.get(algorithm, lambda p: p.alpha)(cfg.params)
    trained_twice = False
    for before, after, sent, got in grid.rounds:
        assert 0 < len(sent) < len(grid.contexts)
        for node in grid.contexts:
            if node not in sent:
                assert_states_equal(before[node], after[node])
                continue
            start, local = codec.from_record(sent[node][P.MODEL]), codec.from_record(got[node][P.MODEL])
            old = before[node].get(P.DUAL)
            trained_twice |= old is not None
            for k, h in after[node][P.DUAL].items():
                expected = (old[k] if old is not None else 0) - a * (local[k] - start[k])
                torch.testing.assert_close(h, expected, rtol=0, atol=1e-6)
    assert trained_twice, "no client trained twice: the test would not see state carried over"
    meta = {n: ctx.state.metric_records[META] for n, ctx in grid.contexts.items()
            if META in ctx.state.metric_records}
    counts = {}
    for _, _, sent, _ in grid.rounds:
        for node in sent:
            counts[node] = counts.get(node, 0) + 1
    assert {n: int(m["rounds-trained"]) for n, m in meta.items()} == counts


def test_fedgmt_v2_client_ema_folds_in_each_received_global_model(tmp_path):
    """FedGMT-v2 (Alg. 1 line 7): e_m <- alpha e_m + (1 - alpha) w^t on each round m trains,
    starting from w^0 (fedgmt-v2-init = "initial")."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm="fedgmt-v2")
    init = torch.load(tmp_path / "run" / "model_init.pt")
    alpha = cfg.params.client_alpha
    for before, after, sent, _ in grid.rounds:
        for node in sent:
            received = codec.from_record(sent[node][P.MODEL])
            old = before[node].get(P.CLIENT_EMA, init)
            for k, e in after[node][P.CLIENT_EMA].items():
                torch.testing.assert_close(e, alpha * old[k] + (1 - alpha) * received[k],
                                           rtol=0, atol=1e-7)


@pytest.mark.parametrize("algorithm", ["scaffold", "fedgamma", "fedlesam-s"])
def test_control_variates_follow_option_ii_and_the_upload_is_their_change(tmp_path, algorithm):
    """SCAFFOLD option II on every client that trained: c_i+ = c_i - c + (x - y_K)/(K lr),
    with c the broadcast control, x the model sent, y_K the model returned and K the steps
    it reports; the upload is c_i+ - c_i."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm=algorithm)
    for rnd, (before, after, sent, got) in enumerate(grid.rounds, start=1):
        for node in sent:
            c = codec.from_record(sent[node][P.CONTROL])
            x, y = codec.from_record(sent[node][P.MODEL]), codec.from_record(got[node][P.MODEL])
            steps = got[node].metric_records[P.METRICS]["num-steps"]
            old = before[node].get(P.CLIENT_CONTROL)
            delta = codec.from_record(got[node][P.CONTROL_DELTA])
            for k, new in after[node][P.CLIENT_CONTROL].items():
                ci = old[k] if old is not None else torch.zeros_like(new)
                expected = ci - c[k] + (x[k] - y[k]) / (steps * cfg.round_lr(rnd))
                torch.testing.assert_close(new, expected, rtol=0, atol=1e-5)
                torch.testing.assert_close(delta[k], new - ci, rtol=0, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["fedlesam", "fedlesam-d", "fedlesam-s"])
def test_fedlesam_client_remembers_the_global_model_it_received(tmp_path, algorithm):
    """theta_i^old <- theta^t: after each round it trains, a client holds the model it was sent."""
    _, grid = run_with_snapshots(tmp_path, algorithm=algorithm)
    for _, after, sent, _ in grid.rounds:
        for node in sent:
            received = codec.from_record(sent[node][P.MODEL])
            assert all(torch.equal(v, received[k]) for k, v in after[node][P.PREVIOUS_GLOBAL].items())


# ---------------------------------------------------------------- what the server keeps and broadcasts
def test_fedgmt_server_ema_is_broadcast_and_updated_after_aggregation(tmp_path):
    """FedGMT (Alg. 1 lines 4, 18): e^0 = w^0 goes down in round 1, and each later round
    broadcasts e^t = alpha e^{t-1} + (1 - alpha) w^t, w^t being the model sent with it."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm="fedgmt")
    init = torch.load(tmp_path / "run" / "model_init.pt")
    previous = None
    for _, _, sent, _ in grid.rounds:
        content = next(iter(sent.values()))
        ema, w = codec.from_record(content[P.EMA_MODEL]), codec.from_record(content[P.MODEL])
        for k in ema:
            expected = init[k] if previous is None else (
                cfg.params.alpha * previous[k] + (1 - cfg.params.alpha) * w[k])
            torch.testing.assert_close(ema[k], expected, rtol=0, atol=1e-7)
        previous = ema
    assert any(not torch.allclose(previous[k], init[k]) for k in init)


def test_scaffold_server_control_moves_by_m_over_n_of_the_mean_upload(tmp_path):
    """c^{r+1} = c^r + (M/N) sum_i p_i Delta c_i, broadcast next round; c^1 = 0."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm="scaffold")
    sent_c = [codec.from_record(next(iter(sent.values()))[P.CONTROL]) for _, _, sent, _ in grid.rounds]
    assert all(float(v.abs().max()) == 0 for v in sent_c[0].values())
    n = len(grid.contexts)
    for r, (_, _, sent, got) in enumerate(grid.rounds[:-1]):
        sizes = {node: got[node].metric_records[P.METRICS]["num-examples"] for node in got}
        total = sum(sizes.values())
        for k, c_next in sent_c[r + 1].items():
            step = sum(sizes[node] / total * codec.from_record(got[node][P.CONTROL_DELTA])[k] for node in got)
            torch.testing.assert_close(c_next, sent_c[r][k] + len(got) / n * step, rtol=0, atol=1e-6)


def test_fedsmoo_global_perturbation_is_the_normalised_mean_correction(tmp_path):
    """s^{r+1} = rho S/||S||, S = sum_i p_i s~_i of round r (global norm); s^1 = 0."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm="fedsmoo")
    sent_s = [codec.from_record(next(iter(sent.values()))[P.GLOBAL_PERTURBATION]) for _, _, sent, _ in grid.rounds]
    assert all(float(v.abs().max()) == 0 for v in sent_s[0].values())
    for r, (_, _, _, got) in enumerate(grid.rounds[:-1]):
        sizes = {node: got[node].metric_records[P.METRICS]["num-examples"] for node in got}
        total = sum(sizes.values())
        mean = {k: sum(sizes[nd] / total * codec.from_record(got[nd][P.PERTURBATION_CORRECTION])[k] for nd in got)
                for k in sent_s[0]}
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in mean.values()))
        for k, s in sent_s[r + 1].items():
            torch.testing.assert_close(s, (cfg.params.rho * mean[k] / norm).float(), rtol=0, atol=1e-6)


def test_fedacg_sends_the_look_ahead_model_and_evaluates_the_global_one(tmp_path):
    """Round r sends x^r = theta^r + lambda m^r; with lambda = 0 it is theta^r itself (m^1 = 0
    in any case), and the clients' updates are measured from what they were sent."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm="fedacg")
    sent_models = [codec.from_record(next(iter(sent.values()))[P.MODEL]) for _, _, sent, _ in grid.rounds]
    init = torch.load(tmp_path / "run" / "model_init.pt")
    assert all(torch.equal(sent_models[0][k], init[k]) for k in init)
    # theta^{r+1} = theta^r + m^{r+1} and x^{r+1} = theta^{r+1} + lambda m^{r+1} (eta_g = 1):
    # rebuild theta and m from the replies and compare with what was sent
    lam, theta, m = cfg.params.lam, dict(init), {k: torch.zeros_like(v) for k, v in init.items()}
    for r, (_, _, sent, got) in enumerate(grid.rounds[:-1]):
        sizes = {node: got[node].metric_records[P.METRICS]["num-examples"] for node in got}
        total = sum(sizes.values())
        for k in theta:
            delta = sum(sizes[nd] / total * (codec.from_record(got[nd][P.MODEL])[k] - sent_models[r][k]) for nd in got)
            m[k] = lam * m[k] + delta
            theta[k] = theta[k] + m[k]
            torch.testing.assert_close(sent_models[r + 1][k], theta[k] + lam * m[k], rtol=0, atol=1e-6)
