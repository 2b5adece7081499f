"""The seed algorithms (FedCM, FedDyn, FedSpeed, FedGMT, FedGMT-v2, FedNSAM, FedTOGA) end to
end: the communication pattern each paper states, client state across rounds, learning on
digits, and the same model in-process, in Ray simulation and over a real deployment."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import MessageType

from client.app import META
from client.app import app as client_app
from common import protocol as P
from common.config import RunConfig
from common.registry import ALGORITHMS
from tools.cli import main as cli
from tools.inprocess import InProcessGrid, run_inprocess
from server.run import run_server
from tests.conftest import fast_config
from tests.test_integration import check_run_dir, flower_pids, metrics

SEED_ALGORITHMS = ("fedcm", "feddyn", "fedspeed", "fedgmt", "fedgmt-v2", "fednsam", "fedtoga")

# Model-sized records per sampled client per round (down, up), as the papers state them:
# FedGMT Table 1 (1.5x: w and e down), FedGMT-v2 (1x), FedTOGA §1.6 (theta and Delta down,
# theta_i up), FedNSAM (theta and m down; notes §6), FedCM/MoFedSAM (w and Delta down).
PAPER_PATTERN = {
    "fedavg": (1, 1), "fedsam": (1, 1), "mofedsam": (2, 1), "fedcm": (2, 1), "feddyn": (1, 1),
    "fedspeed": (1, 1), "fedgmt": (2, 1), "fedgmt-v2": (1, 1), "fednsam": (2, 1), "fedtoga": (2, 1),
    # the baselines (fedtoga notes §2.3 "extra communication": FedGAMMA 2x, FedSMOO 2x, FedLESAM
    # 1x; SCAFFOLD sends c down and Delta c up; FedLESAM-S is SCAFFOLD's; FedACG sends only its
    # look-ahead model; FedProx, FedAdam and FedYogi are FedAvg on the wire)
    "fedprox": (1, 1), "scaffold": (2, 2), "fedgamma": (2, 2), "fedsmoo": (2, 2), "fedlesam": (1, 1),
    "fedlesam-d": (1, 1), "fedlesam-s": (2, 2), "fedacg": (1, 1), "fedadam": (1, 1), "fedyogi": (1, 1),
}


def test_every_registered_algorithm_has_a_stated_pattern():
    assert set(PAPER_PATTERN) == set(ALGORITHMS)


@pytest.mark.parametrize("algorithm", sorted(PAPER_PATTERN))
def test_bytes_per_round_follow_the_papers_communication_pattern(tmp_path, algorithm):
    run_dir, _ = run_inprocess(fast_config(algorithm=algorithm, fraction_train=0.5,
                                           num_server_rounds=2, run_dir=str(tmp_path / "r")), 4)
    model_bytes = json.loads((run_dir / "summary.json").read_text())["model_bytes"]
    down, up = PAPER_PATTERN[algorithm]
    for row in metrics(run_dir)[1:]:
        assert row["clients_sampled"] == 2 and len(row["sampled_partitions"]) == 2
        assert row["bytes_down"] == row["clients_sampled"] * down * model_bytes
        assert row["bytes_up"] == row["clients_replied"] * up * model_bytes


# ---------------------------------------------------------------- client state across rounds
class SnapshotGrid(InProcessGrid):
    """Records, per train round, every node's state before and after, and the messages."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def _states(self):
        return {n: {name: P.from_record(rec) for name, rec in ctx.state.array_records.items()}
                for n, ctx in self.contexts.items()}

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        before = self._states()
        replies = super().send_and_receive(messages, timeout=timeout)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            sent = {m.metadata.dst_node_id: m.content for m in messages}
            got = {r.metadata.src_node_id: r.content for r in replies}
            self.rounds.append((before, self._states(), sent, got))
        return replies


def run_with_snapshots(tmp_path, **overrides):
    cfg = RunConfig.from_mapping(fast_config(fraction_train=0.5, num_server_rounds=4,
                                             run_dir=str(tmp_path / "run"), **overrides))
    grid = SnapshotGrid(client_app, 4, cfg.to_dict())
    run_server(grid, cfg)
    return cfg, grid


def assert_states_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name])


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
            start, local = P.from_record(sent[node][P.MODEL]), P.from_record(got[node][P.MODEL])
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
            received = P.from_record(sent[node][P.MODEL])
            old = before[node].get(P.CLIENT_EMA, init)
            for k, e in after[node][P.CLIENT_EMA].items():
                torch.testing.assert_close(e, alpha * old[k] + (1 - alpha) * received[k],
                                           rtol=0, atol=1e-7)


def test_fedgmt_server_ema_is_broadcast_and_updated_after_aggregation(tmp_path):
    """FedGMT (Alg. 1 lines 4, 18): e^0 = w^0 goes down in round 1, and each later round
    broadcasts e^t = alpha e^{t-1} + (1 - alpha) w^t, w^t being the model sent with it."""
    cfg, grid = run_with_snapshots(tmp_path, algorithm="fedgmt")
    init = torch.load(tmp_path / "run" / "model_init.pt")
    previous = None
    for _, _, sent, _ in grid.rounds:
        content = next(iter(sent.values()))
        ema, w = P.from_record(content[P.EMA_MODEL]), P.from_record(content[P.MODEL])
        for k in ema:
            expected = init[k] if previous is None else (
                cfg.params.alpha * previous[k] + (1 - cfg.params.alpha) * w[k])
            torch.testing.assert_close(ema[k], expected, rtol=0, atol=1e-7)
        previous = ema
    assert any(not torch.allclose(previous[k], init[k]) for k in init)


# ---------------------------------------------------------------- learning on digits
@pytest.mark.parametrize("algorithm", SEED_ALGORITHMS)
def test_learns_on_digits_with_20_non_iid_clients_at_half_participation(tmp_path, algorithm):
    assert_learns_on_digits(tmp_path, algorithm)


def assert_learns_on_digits(tmp_path, algorithm: str) -> None:
    """The issues' bar, in-process: digits, 20 clients, Dirichlet 0.1, 50% participation."""
    run_dir, _ = run_inprocess({
        "algorithm": algorithm, "dataset": "digits", "partition": "dirichlet", "dirichlet-alpha": 0.1,
        "fraction-train": 0.5, "local-epochs": 2, "num-server-rounds": 30,
        "run-dir": str(tmp_path / "run")}, 20)
    rows = metrics(run_dir)
    assert rows[-1]["test_accuracy"] > 0.6, [round(r["test_accuracy"], 3) for r in rows]


# ---------------------------------------------------------------- same model everywhere
SIM_ARGS = ["--clients", "4", "--rounds", "3", "--fraction", "0.5", "--set", "dataset=digits",
            "--set", "local-epochs=1", "--set", "partition=dirichlet"]


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.parametrize("algorithm", ["fedtoga", "fedgmt-v2", "fedsmoo", "fedlesam-s"])
def test_ray_simulation_gives_the_inprocess_model_for_stateful_clients(tmp_path, algorithm):
    """Client duals (and FedGMT-v2's client EMA, whose w^0 a Ray worker rebuilds from the
    seed; FedSMOO's mu_i, FedLESAM-S's c_i and previous global model) persist in Ray's node
    contexts exactly as in-process; uploads (s~_i, Delta c_i) and broadcasts (s, c) travel
    through Ray's runtime as extra records."""
    before = flower_pids()
    args = ["--algorithm", algorithm, *SIM_ARGS]
    assert cli(["simulate", "--engine", "ray", *args, "--run-dir", str(tmp_path / "ray")]) == 0
    assert cli(["simulate", "--engine", "inprocess", *args, "--run-dir", str(tmp_path / "inp")]) == 0
    assert flower_pids() - before == set(), "simulation left Flower processes behind"
    rows = check_run_dir(tmp_path / "ray", rounds=3, clients=4, num_train=1437)
    seen = [p for r in rows[1:] for p in r["sampled_partitions"]]
    assert len(seen) > len(set(seen)), "no client trained twice: state never carried over"
    a, b = (torch.load(tmp_path / d / "model_final.pt") for d in ("ray", "inp"))
    assert all(torch.equal(a[k], b[k]) for k in a), "same seed, different final model"
    assert [r["test_loss"] for r in rows] == [r["test_loss"] for r in metrics(tmp_path / "inp")]


def deploy_and_match_inprocess(tmp_path, capsys, algorithm: str, rounds: int, epochs: int):
    """``flatflower local`` with 2 SuperNodes on 127.0.0.1: completes, learns, leaves no
    Flower process behind and ends with the in-process run's model. Returns its metric rows
    and the model's size in bytes."""
    before = flower_pids()
    args = ["--algorithm", algorithm, "--clients", "2", "--rounds", str(rounds), "--dataset", "digits",
            "--set", f"local-epochs={epochs}"]
    code = cli(["local", *args, "--run-dir", str(tmp_path / "dep"), "--timeout", "400"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "finished:completed" in out and "final test accuracy" in out
    assert flower_pids() - before == set(), "Flower processes left behind"
    rows = check_run_dir(tmp_path / "dep", rounds=rounds, clients=2, num_train=1437)
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.3
    assert cli(["simulate", "--engine", "inprocess", *args, "--run-dir", str(tmp_path / "inp")]) == 0
    a, b = (torch.load(tmp_path / d / "model_final.pt") for d in ("dep", "inp"))
    assert all(torch.equal(a[k], b[k]) for k in a), "deployment and in-process models differ"
    return rows, json.loads((tmp_path / "dep" / "summary.json").read_text())["model_bytes"]


@pytest.mark.integration
def test_real_deployment_runs_fedtoga_and_matches_inprocess(tmp_path, capsys):
    """FedTOGA over a real SuperLink + 2 SuperNodes (gRPC on 127.0.0.1): client duals live
    in the SuperNodes' contexts, Delta travels as an extra record; the final model is the
    in-process one."""
    rows, model_bytes = deploy_and_match_inprocess(tmp_path, capsys, "fedtoga", rounds=2, epochs=2)
    assert all(r["clients_replied"] == 2 and r["clients_rejected"] == 0 for r in rows[1:])
    logs = tmp_path / "dep" / "logs"
    assert (logs / "superlink.log").is_file() and (logs / "supernode-1.log").is_file()
    assert "round 2" in (logs / "run.log").read_text()
    assert all(r["bytes_down"] == 2 * 2 * model_bytes for r in rows[1:])
