"""The engines agree and learn: every algorithm learns on digits in-process; the same seed
gives the same final model in-process, in Flower's Ray simulation and over a real SuperLink
and SuperNodes on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import tempfile

import pytest
import torch

from flatflower.tools.cli import main as cli
from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.common.config import RunConfig
from tests.helpers import DIGITS, RAY_RETRY, ROOT, check_run_dir, flower_pids, metrics


# ---------------------------------------------------------------- every algorithm learns
SEED_ALGORITHMS = ("fedcm", "feddyn", "fedspeed", "fedgmt", "fedgmt-v2", "fednsam", "fedtoga")


BASELINES = ("fedprox", "scaffold", "fedgamma", "fedsmoo", "fedlesam", "fedlesam-d", "fedlesam-s",
             "fedacg", "fedadam", "fedyogi")


NEWER = ("fedsol", "fedgloss", "fedswa", "fedmoswa", "fedgf", "fedwmsam", "dp-fedsam")  # published since the seed papers
# FedGF's T_D has no default: near the typical divergence D of FedSAM in this setting (0.5-0.8
# over the 30 rounds, fedgf_divergence of a run with T_D = inf), so c takes fractions of 1
LEARN_KEYS = {"fedgf": {"fedgf.threshold": 0.8}}


@pytest.mark.parametrize("algorithm", SEED_ALGORITHMS + BASELINES + NEWER)
def test_learns_on_digits_with_20_non_iid_clients_at_half_participation(tmp_path, algorithm):
    assert_learns_on_digits(tmp_path, algorithm)


def assert_learns_on_digits(tmp_path, algorithm: str) -> None:
    """The issues' bar, in-process: digits, 20 clients, Dirichlet 0.1, 50% participation."""
    run_dir, _ = run_inprocess({
        "algorithm": algorithm, **LEARN_KEYS.get(algorithm, {}),
        "dataset": "digits", "partition": "dirichlet", "dirichlet-alpha": 0.1,
        "fraction-train": 0.5, "local-epochs": 2, "num-server-rounds": 30,
        "run-dir": str(tmp_path / "run")}, 20)
    rows = metrics(run_dir)
    assert rows[-1]["test_accuracy"] > 0.6, [round(r["test_accuracy"], 3) for r in rows]


def test_inprocess_real_apps_learn_and_fill_run_dir(tmp_path):
    run_dir, grid = run_inprocess({**DIGITS, "num-server-rounds": 3, "run-dir": str(tmp_path / "r"),
                                   "algorithm": "mofedsam", "fraction-evaluate": 1.0}, num_clients=3)
    rows = check_run_dir(run_dir, rounds=3, clients=3, num_train=1437)
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.3
    assert 0 < rows[-1]["federated_accuracy"] <= 1  # federated evaluation ran on the clients
    # MoFedSAM sends the model and its global update: 2 model-sized records down, 1 up
    assert rows[1]["bytes_down"] == pytest.approx(2 * rows[1]["bytes_up"], rel=0.01)


# ---------------------------------------------------------------- the same model in-process, in Ray and over a real deployment
SIM = {"num-server-rounds": 3, "fraction-train": 0.5, "dataset": "digits", "local-epochs": 1,
       "partition": "dirichlet", "num-partitions": 4, "flatness-every": 3, **RAY_RETRY}
FLATNESS = ("flatness_distance", "sharpness", "hessian_max_eig", "hessian_trace")


def same_flatness(a: list[dict], b: list[dict]) -> None:
    """Both runs' metric rows carry the same flatness numbers: the distance every round, the
    Hessian measures at the last round (flatness-every = the number of rounds)."""
    assert all(r["flatness_distance"] > 0 for r in a[1:]) and a[-1]["hessian_max_eig"] > 0
    assert "sharpness" not in a[1]
    assert [[r.get(k) for k in FLATNESS] for r in a] == [[r.get(k) for k in FLATNESS] for r in b]


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.slow
def test_ray_simulation_gives_the_inprocess_model_for_stateful_clients(tmp_path):
    """Client state (FedTOGA's and FedSMOO's duals, FedSMOO's mu_i; FedLESAM-S's c_i and
    previous global model) persists in Ray's node contexts exactly as in-process; uploads
    (s~_i, Delta c_i) and broadcasts (FedTOGA's Delta, FedSMOO's s, FedLESAM-S's c, FedWMSAM's
    m and c) travel through Ray's runtime as extra records, FedWMSAM's alpha as a config
    scalar, its c_k as client state. One Ray simulation federation (the one
    `flatflower simulate` starts) runs the three algorithms one after the other. FedGMT-v2's
    client EMA (whose w^0 a Ray worker rebuilds from the seed) and its broadcast EMA go
    through Ray in tests/test_reliability.py's stop-and-resume test, via the CLI."""
    from flatflower.runtime.engines import ray_federation_config
    from flatflower.runtime.engines.federation import COMPLETED, LocalFederation

    before = flower_pids()
    algorithms = ("fedtoga", "fedsmoo", "fedlesam-s", "fedwmsam")
    fed = LocalFederation(0, tmp_path / "work", tmp_path / "logs", simulation=True)
    # Ray's socket paths must stay under 108 bytes: a short directory, not tmp_path
    fed.env["RAY_TMPDIR"] = ray_tmp = tempfile.mkdtemp(prefix="ray-")
    try:
        with fed:
            for algorithm in algorithms:
                cfg = RunConfig.from_mapping({**SIM, "algorithm": algorithm, "run-dir": str(tmp_path / algorithm)})
                run_id = fed.submit(ROOT, cfg.to_dict(), ray_federation_config(4))
                row = fed.wait(run_id, 600, poll=0.5)
                if row["status"] != COMPLETED:
                    fed.save_log(run_id, tmp_path / f"{algorithm}.log")
                    superlink = (tmp_path / "logs" / "superlink.log").read_text(errors="replace")
                    pytest.fail(f"{algorithm}: run failed: {row}; its log:\n"
                                f"{(tmp_path / f'{algorithm}.log').read_text()[-3000:]}\n"
                                f"the SuperLink's log (the simulation's output):\n{superlink[-5000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert flower_pids() - before == set(), "simulation left Flower processes behind"
    for algorithm in algorithms:
        ray = tmp_path / algorithm
        rows = check_run_dir(ray, rounds=3, clients=4, num_train=1437)
        assert json.loads((ray / "config.json").read_text())["engine"] == "ray"
        seen = [p for r in rows[1:] for p in r["sampled_partitions"]]
        assert len(seen) > len(set(seen)), "no client trained twice: state never carried over"
        inp, _ = run_inprocess({**SIM, "algorithm": algorithm, "run-dir": str(tmp_path / f"{algorithm}-inp")}, 4)
        a, b = (torch.load(d / "model_final.pt") for d in (ray, inp))
        assert all(torch.equal(a[k], b[k]) for k in a), f"{algorithm}: same seed, different final model"
        assert [r["test_loss"] for r in rows] == [r["test_loss"] for r in metrics(inp)]
        same_flatness(rows, metrics(inp))


def test_inprocess_clients_parse_array_headers_one_at_a_time():
    """The in-process clients decode arrays in parallel threads; numpy parses each header with
    ast.parse, which CPython < 3.13 cannot run in two threads at once (python/cpython#106905:
    SystemError "AST constructor recursion depth mismatch", seen here under load)."""
    import ast
    import sys

    from flatflower.client.app import app as client_app
    from flatflower.runtime.engines.inprocess import InProcessGrid

    InProcessGrid(client_app, 2, {})
    assert sys.version_info >= (3, 13) or getattr(ast.parse, "one_at_a_time", False)
    assert ast.literal_eval("{'descr': '<f4', 'shape': (3, 4)}") == {"descr": "<f4", "shape": (3, 4)}


def test_exchange_takes_each_in_process_reply_as_it_lands_without_sleeping(monkeypatch):
    """On the in-process grids the strategies' exchange waits for the replies themselves
    (wait_for_replies): no poll pause (at least 10 ms a pull otherwise) is added to a round."""
    import threading

    from flwr.app import Message, MessageType, RecordDict
    from flwr.clientapp import ClientApp

    from flatflower.strategies import participation
    from flatflower.runtime.engines.inprocess import InProcessGrid

    answered = threading.Event()
    echo = ClientApp()

    @echo.query()
    def query(msg, context):
        if context.node_config["partition-id"] == 1:
            answered.wait(5)  # replies in turn: the exchange must wait once at least
        answered.set()
        return Message(RecordDict(), reply_to=msg)

    def no_sleep(seconds):
        raise AssertionError(f"exchange slept {seconds} s on an in-process grid")

    monkeypatch.setattr(participation, "pause_between_pulls", no_sleep)
    grid = InProcessGrid(echo, 2, {})
    messages = [grid.create_message(RecordDict(), MessageType.QUERY, node, "1") for node in grid.contexts]
    replies = participation.exchange(grid, messages, timeout=30)
    assert [r.metadata.src_node_id for r in replies] == list(grid.contexts)


def deploy_and_match_inprocess(tmp_path, capsys, algorithm: str, rounds: int, epochs: int,
                               flags: tuple[str, ...] = ()):
    """``flatflower local [flags]`` with 2 SuperNodes on 127.0.0.1: completes, learns, leaves
    no Flower process behind and ends with the in-process run's model. Returns its metric rows
    and the model's size in bytes."""
    before = flower_pids()
    args = ["--algorithm", algorithm, "--clients", "2", "--rounds", str(rounds), "--dataset", "digits",
            "--set", f"local-epochs={epochs}", "--flatness-every", str(rounds)]
    code = cli(["local", *flags, *args, "--run-dir", str(tmp_path / "dep"), "--timeout", "400"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "finished:completed" in out and "final test accuracy" in out
    assert flower_pids() - before == set(), "Flower processes left behind"
    rows = check_run_dir(tmp_path / "dep", rounds=rounds, clients=2, num_train=1437)
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.3
    assert cli(["simulate", "--engine", "inprocess", *args, "--run-dir", str(tmp_path / "inp")]) == 0
    a, b = (torch.load(tmp_path / d / "model_final.pt") for d in ("dep", "inp"))
    assert all(torch.equal(a[k], b[k]) for k in a), "deployment and in-process models differ"
    same_flatness(rows, metrics(tmp_path / "inp"))
    assert [json.loads((tmp_path / d / "config.json").read_text())["engine"] for d in ("dep", "inp")] == [
        "deployment", "inprocess"]  # config.json says which engine carried the run
    return rows, json.loads((tmp_path / "dep" / "summary.json").read_text())["model_bytes"]


@pytest.mark.integration
@pytest.mark.slow
def test_real_deployment_runs_fedtoga_and_matches_inprocess(tmp_path, capsys):
    """FedTOGA over a real SuperLink + 2 SuperNodes (gRPC on 127.0.0.1), with Flower's own
    ClientApp process per message (``--clientapps stock``): client duals live in the
    SuperNodes' contexts, Delta travels as an extra record; the final model is the in-process
    one."""
    rows, model_bytes = deploy_and_match_inprocess(tmp_path, capsys, "fedtoga", rounds=2, epochs=2,
                                                   flags=("--clientapps", "stock"))
    assert all(r["clients_replied"] == 2 and r["clients_rejected"] == 0 for r in rows[1:])
    logs = tmp_path / "dep" / "logs"
    assert (logs / "superlink.log").is_file() and (logs / "supernode-1.log").is_file()
    assert "round 2" in (logs / "run.log").read_text()
    assert all(r["bytes_down"] == 2 * 2 * model_bytes for r in rows[1:])


@pytest.mark.integration
def test_real_deployment_runs_fedlesam_s_and_matches_inprocess(tmp_path, capsys):
    """FedLESAM-S over a real SuperLink + 2 SuperNodes (gRPC on 127.0.0.1), warm workers and
    ``--fast-poll``: c goes down and Delta c_i up as extra records, c_i and theta_i^old live in
    the SuperNodes; 2 down 2 up per client; the final model is the in-process one."""
    rows, model_bytes = deploy_and_match_inprocess(tmp_path, capsys, "fedlesam-s", rounds=3, epochs=1,
                                                   flags=("--fast-poll",))
    assert all(r["bytes_down"] == r["bytes_up"] == 2 * 2 * model_bytes for r in rows[1:])
