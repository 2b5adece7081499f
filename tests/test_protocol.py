"""The wire protocol as an outsider speaks it (docs/protocol.md): a stock-style Flower ClientApp
(examples/stock_clientapp, nothing of flatflower's client package) joins a flatflower FedAvg run;
a ClientApp that does not answer the handshake is refused with one line naming what it misses;
flatflower's own ClientApp under Flower's stock FedAvg trains model-only algorithms, keeps its
bookkeeping out of the metrics Flower averages, and names the server records an algorithm
needs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg as StockFedAvg

from flatflower.client.app import app as flatflower_clientapp
from flatflower.common import protocol as P
from flatflower.common.config import RunConfig
from flatflower.strategies.participation import NoNodesError
from tests.helpers import ROOT, fast_config, initial_model, metrics
from flatflower.runtime.engines.inprocess import InProcessGrid, run_inprocess

EXAMPLE = ROOT / "examples" / "stock_clientapp"


def stock_client():
    """examples/stock_clientapp/stock_client.py, imported from its file (as its own app)."""
    spec = importlib.util.spec_from_file_location("stock_client", EXAMPLE / "stock_client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not any(name.split(".")[0] == "client" for name in vars(module)
                   if isinstance(vars(module)[name], type(sys)))  # it speaks the protocol alone
    return module


def stock_run_config(tmp_path: Path, **extra) -> dict:
    """The server's side of the example's README: FedAvg over nodes with data of their own."""
    return {"algorithm": "fedavg", "partition": "local", "dataset": "npz", "model": "logreg",
            "input-shape": "64", "num-classes": 10, "fraction-evaluate": 1.0, "num-server-rounds": 3,
            "local-epochs": 1, "batch-size": 32, "lr": 0.1, "run-dir": str(tmp_path / "run"), **extra}


def test_the_protocol_doc_lists_the_model_only_algorithms():
    """docs/protocol.md names exactly the registry's algorithms that send and keep nothing but
    the model (what a stock ClientApp can run)."""
    import re

    from flatflower.strategies.registry import ALGORITHMS

    intro = (ROOT / "docs" / "protocol.md").read_text().split("\n## ")[0]
    named = {n for n in re.findall(r"`([a-z0-9-]+)`", intro) if n in ALGORITHMS}
    assert named == {n for n, s in ALGORITHMS.items() if not (s.down or s.up or s.values or s.state)}


def test_the_example_imports_nothing_of_flatflower():
    source = (EXAMPLE / "stock_client.py").read_text()
    assert not any(f"{word} " in source for word in ("from client", "import client", "from common",
                                                      "from strategies", "from tools", "from server"))


def test_a_stock_clientapp_joins_a_fedavg_run(tmp_path):
    """Three stock nodes train every round, every reply is accepted (their step counts, sizes and
    nonces check), and the federated accuracy of the global model rises."""
    run_dir, _ = run_inprocess(stock_run_config(tmp_path), 3, client_app=stock_client().app)
    rows = metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert (row["clients_sampled"], row["clients_replied"], row["clients_rejected"],
                row["clients_failed"], row["skipped"]) == (3, 3, 0, 0, 0), row
        assert row["rejections"] == [] and row["failures"] == []
    assert rows[-1]["federated_accuracy"] > rows[0]["federated_accuracy"] > 0.3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    sizes = json.loads((run_dir / "partition.json").read_text())["sizes"]  # as the handshakes declared
    assert sum(sizes.values() if isinstance(sizes, dict) else sizes) == 3 * int(0.8 * 599)  # 1797 digits / 3, 80%


def test_a_clientapp_without_query_is_refused_with_one_line(tmp_path):
    """A quickstart-style ClientApp (train and evaluate only) fails the handshake: the run ends
    before any round with one line per node saying what it misses and where to read."""
    stock = stock_client()
    app = ClientApp()
    app.train()(stock.train)
    app.evaluate()(stock.evaluate)
    with pytest.raises(NoNodesError) as err:
        run_inprocess(stock_run_config(tmp_path), 2, client_app=app)
    text = str(err.value)
    assert "\n" not in text, text
    assert ("node 1000: does not answer flatflower's partition handshake (query): its ClientApp registers "
            "no query function; see docs/protocol.md") in text, text
    assert "No query function registered" not in text


def _stock_round(cfg: RunConfig, num_nodes: int = 2):
    """One round of Flower's stock FedAvg (its own configure_train / aggregate_train) over
    flatflower's ClientApp: (the train replies, the aggregated arrays and metrics)."""
    grid = InProcessGrid(flatflower_clientapp, num_nodes, cfg.to_dict())
    strategy = StockFedAvg(fraction_train=1.0, min_available_nodes=num_nodes)
    start = ArrayRecord(initial_model(cfg))
    messages = list(strategy.configure_train(1, start, ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    arrays, aggregated = strategy.aggregate_train(1, replies)
    return start, replies, arrays, aggregated


def test_flatflower_clientapp_under_a_stock_fedavg_trains_fedsam_without_bookkeeping_metrics():
    cfg = RunConfig.from_mapping(fast_config(algorithm="fedsam", local_steps=2))
    start, replies, arrays, aggregated = _stock_round(cfg)
    assert all(not r.has_error() for r in replies)
    assert aggregated is not None and arrays is not None
    assert {P.NUM_STEPS, P.TRAIN_LOSS} <= set(aggregated)  # (Flower drops its weighting key, num-examples)
    assert not {P.PARTITION_ID, P.NONCE} & set(aggregated), dict(aggregated)
    assert aggregated[P.NUM_STEPS] == 2
    before, after = start.to_torch_state_dict(), arrays.to_torch_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    # the bookkeeping is in each reply's config record, where the server checks it
    assert sorted(r.content[P.CONFIG][P.PARTITION_ID] for r in replies) == [0, 1]


@pytest.mark.parametrize(("algorithm", "needs"), [
    ("fedgmt", "record 'ema_model', config 'state-round'"),
    ("scaffold", "record 'control_variate', config 'state-round'"),
])
def test_an_algorithm_that_needs_server_records_says_so_under_a_stock_strategy(algorithm, needs):
    cfg = RunConfig.from_mapping(fast_config(algorithm=algorithm, local_steps=1))
    _, replies, arrays, _ = _stock_round(cfg)
    assert replies and arrays is None  # no reply to aggregate
    for reply in replies:
        assert reply.has_error()
        said = reply.error.reason.splitlines()[0]
        assert "KeyError" not in said
        assert f"{algorithm} needs {needs} in every train message, which only a flatflower server sends" in said
        assert said.startswith("<class 'ValueError'>")


@pytest.mark.integration
@pytest.mark.slow
def test_a_stock_clientapp_joins_over_loopback(tmp_path):
    """The example's own Flower App (flatflower's ServerApp, the stock ClientApp) submitted with
    `flwr run` to a real SuperLink with two SuperNodes on 127.0.0.1: the run completes, every
    update accepted, with only the keys the example's pyproject lists overridden."""
    from tests.helpers import flower_pids
    from flatflower.runtime.engines.federation import COMPLETED, LocalFederation

    before = flower_pids()
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    with LocalFederation(2, tmp_path / "work", run_dir / "logs", clientapps="stock") as fed:
        run_id = fed.submit(EXAMPLE, {"num-server-rounds": 2, "run-dir": str(run_dir)})
        row = fed.wait(run_id, 500, poll=0.5)
        fed.save_log(run_id, run_dir / "logs" / "run.log")
    assert row["status"] == COMPLETED, (row, (run_dir / "logs" / "run.log").read_text()[-3000:])
    assert flower_pids() - before == set(), "Flower processes left behind"
    rows = metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2]
    assert all((r["clients_replied"], r["clients_rejected"], r["clients_failed"]) == (2, 0, 0) for r in rows), rows
    assert rows[-1]["federated_accuracy"] > 0.3
