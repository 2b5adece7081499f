"""The public Python API (flatflower/, docs/api.md), tested as a user calls it: ``import
flatflower`` in a fresh process, a simulation that returns its history and final model (with a
preset, with the user's model and data as Python objects), one-line refusals of bad input, the
list of algorithms, an algorithm's server half in a user's own ServerApp and its client half in
a user's own ClientApp. Every example of docs/api.md runs here as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

import flatflower
from tests.helpers import fast_config

ROOT = Path(__file__).resolve().parent.parent
DIGITS = {"dataset": "digits", "model": "mlp", "partition": "iid", "local-epochs": 1, "checkpoint-every": 0}


def examples() -> list[str]:
    """The Python code blocks of docs/api.md, in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)


def example(marker: str) -> str:
    found = [code for code in examples() if marker in code]
    assert len(found) == 1, marker
    return found[0]


def run_example(code: str) -> dict:
    namespace: dict = {"__name__": "docs_api_example"}
    exec(compile(code, "docs/api.md", "exec"), namespace)  # noqa: S102 - the documentation's own code
    return namespace


# ----------------------------------------------------------------------------- import, __all__
def test_import_in_a_fresh_process_needs_nothing_else(tmp_path):
    """``import flatflower`` alone: every public name is there and a RunConfig builds (no
    ``import flatflower.strategies.registry`` first)."""
    code = ("import flatflower\n"
            "missing = [n for n in flatflower.__all__ if not hasattr(flatflower, n)]\n"
            "cfg = flatflower.RunConfig.from_mapping({'algorithm': 'fedgmt', 'fedgmt.beta': 5})\n"
            "print(missing, cfg.algorithm, cfg.params.to_dict()['fedgmt.beta'])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "fedgmt", "5.0"]


def test_all_is_what_docs_api_lists():
    """The public names are the ones docs/api.md's table says are public."""
    cells = re.findall(r"^\| (`[^|]+`) \|", (ROOT / "docs" / "api.md").read_text(), re.M)
    documented = {name.split("(")[0] for cell in cells for name in re.findall(r"`([^`]+)`", cell)}
    assert documented == set(flatflower.__all__)


# ----------------------------------------------------------------------------- run_simulation
def test_run_simulation_returns_the_runs_history_and_final_model(tmp_path):
    from flatflower.common.evaluate import evaluate
    from flatflower.common.data import dataset_for
    from flatflower.runtime.engines.inprocess import run_inprocess

    result = flatflower.run_simulation(DIGITS, algorithm="fedsam", clients=2, rounds=2, seed=3,
                                       run_dir=tmp_path / "api")
    assert result.status == "completed" and result.run_dir == (tmp_path / "api").resolve()
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert result.history.rows == rows and result.history.rounds == [0, 1, 2]
    assert result.history.test_accuracy == [r["test_accuracy"] for r in rows]
    assert result.history.test_accuracy[-1] > result.history.test_accuracy[0] + 0.2  # it learned
    assert result.summary == json.loads((result.run_dir / "summary.json").read_text())
    assert result.config.algorithm == "fedsam" and result.config.num_partitions == 2 and result.config.seed == 3
    saved = torch.load(result.run_dir / "model_final.pt", weights_only=True)
    assert saved.keys() == result.final_model.keys()
    assert all(torch.equal(saved[k], result.final_model[k]) for k in saved)
    # the rebuilt model is the final model: its accuracy is the summary's
    _, acc = evaluate(result.model(), dataset_for(result.config).test, 512)
    assert acc == result.summary["final_test_accuracy"] == result.history.test_accuracy[-1]
    # the same run on the engine directly (the real ServerApp and ClientApps): the same model
    path, _ = run_inprocess({**DIGITS, "algorithm": "fedsam", "num-server-rounds": 2, "seed": 3,
                             "run-dir": str(tmp_path / "direct")}, 2)
    direct = torch.load(path / "model_final.pt", weights_only=True)
    assert all(torch.equal(direct[k], saved[k]) for k in saved)


def test_run_simulation_with_a_model_object_starts_from_its_weights(tmp_path):
    torch.manual_seed(7)
    mine = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    start = {k: v.clone() for k, v in mine.state_dict().items()}
    result = flatflower.run_simulation(DIGITS, algorithm="fedavg", clients=2, rounds=2, model=mine,
                                       engine="vectorized", run_dir=tmp_path / "r")
    init = torch.load(result.run_dir / "model_init.pt", weights_only=True)
    assert all(torch.equal(init[k], start[k]) for k in start)  # the run started from its weights
    assert all(torch.equal(mine.state_dict()[k], start[k]) for k in start)  # and left them alone
    assert result.config.model.startswith("python-model-")
    # a RunConfig as the config (its num-partitions 0 means: the clients given)
    again = flatflower.run_simulation(result.config.replace(run_dir=str(tmp_path / "again")), clients=2,
                                      engine="vectorized")
    assert all(torch.equal(again.final_model[k], result.final_model[k]) for k in start)
    assert result.history.test_accuracy[-1] > result.history.test_accuracy[0]
    rebuilt = result.model()
    assert all(torch.equal(rebuilt.state_dict()[k], result.final_model[k]) for k in start)


def test_run_simulation_with_the_docs_examples(tmp_path, monkeypatch):
    """docs/api.md's run_simulation examples, as written (run directories under runs/)."""
    monkeypatch.chdir(tmp_path)
    first = run_example(example('algorithm="fedsam", dataset="digits"'))
    assert first["result"].history.rounds == [0, 1, 2]
    assert first["result"].config.params.to_dict()["sam.rho"] == 0.05
    assert isinstance(first["model"], torch.nn.Module)
    objects = run_example(example("model=lambda input_shape"))["result"]
    assert objects.config.dataset.startswith("python-dataset-")
    # a preset: its values, with the clients and rounds given here
    preset = run_example(example('preset="digits-quick"'))["result"]
    assert (preset.config.algorithm, preset.config.dirichlet_alpha, preset.config.fraction_train) == ("fedsam", 0.1, 0.5)
    assert preset.config.num_partitions == 2 and preset.config.num_server_rounds == 2
    assert preset.history.rounds == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["api-fedsam", "api-objects", "api-preset"]


@pytest.mark.parametrize("kwargs, message", [
    ({"algorithm": "fedsma"}, "algorithm='fedsma' is not one of"),
    ({"lokal_epochs": 1}, "unknown run-config key(s): lokal-epochs"),
    ({"clients": 0}, "clients=0 must be a whole number >= 1"),
    ({"engine": "ray"}, "engine='ray' is not one of: inprocess, vectorized"),
    ({"preset": "no-such-preset"}, "no-such-preset"),
    ({"dataset": "nosuchmodule.data:load"}, "module 'nosuchmodule.data' is not found"),
    ({"model": "lenet"}, "model 'lenet' does not fit dataset 'digits'"),
    ({"model": 3}, "model=int is not a model name"),
    ({"aggregator": "krum", "aggregator_f": 1}, "aggregator krum needs at least"),
    ({"config": {"sam": {"rho": -1}}}, "sam.rho"),
])
def test_bad_input_is_one_line_before_anything_starts(tmp_path, kwargs, message):
    args = {"algorithm": "fedsam", "dataset": "digits", "clients": 2, "rounds": 2, "run_dir": tmp_path / "r", **kwargs}
    with pytest.raises(ValueError) as err:
        flatflower.run_simulation(**args)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "r").exists()  # nothing written


def test_a_directory_holding_a_run_is_refused(tmp_path):
    result = flatflower.run_simulation(DIGITS, algorithm="fedavg", clients=2, rounds=1, run_dir=tmp_path / "r")
    with pytest.raises(flatflower.ConfigError, match="already holds a run"):
        flatflower.run_simulation(DIGITS, algorithm="fedavg", clients=2, rounds=1, run_dir=result.run_dir)


# ----------------------------------------------------------------------------- algorithms
def test_algorithms_lists_all_28_with_their_keys_and_pyprojects_defaults(capsys):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    from flatflower.common.config import flat_keys
    from flatflower.strategies.registry import ALGORITHMS

    declared = flat_keys(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    algs = flatflower.algorithms()
    assert len(algs) == 28 and [a["name"] for a in algs] == list(ALGORITHMS)
    for alg in algs:
        for key in alg["keys"]:
            expected = declared[key["name"]]
            assert key["required"] or key["default"] == expected, (alg["name"], key)
            assert key["read_by"] in ("server", "client", "both") and key["meaning"]
    by_name = {a["name"]: a for a in algs}
    assert [k["name"] for k in by_name["fedsam"]["keys"]] == ["sam.rho"]
    assert by_name["fedgmt"]["down"] == ["ema_model"] and by_name["fedgmt"]["state"] == ["dual"]
    run_example(example("flatflower.algorithms()"))
    assert len(capsys.readouterr().out.splitlines()) == 28


# ----------------------------------------------------------------------------- server half
def test_a_users_own_serverapp_drives_fedgmt_with_flatflowers_clientapp(tmp_path):
    """A ServerApp written here, with Flower's ServerApp and ``strategy.start``, runs FedGMT's
    server half against flatflower's ClientApps on the in-process grid: the global model
    learns (its test accuracy rises well above chance) and the EMA model went down every round."""
    from flatflower.common.data import dataset_for
    from flatflower.common.evaluate import evaluate
    from flatflower.common.models import build_model
    from flatflower.runtime.engines.inprocess import run_inprocess

    seen: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = flatflower.server_strategy("fedgmt", context.run_config)
        seen["initial"] = {k: v.clone() for k, v in strategy.model.items()}
        seen["result"] = strategy.start(grid=grid, initial_arrays=ArrayRecord(strategy.model), num_rounds=3)
        seen["strategy"] = strategy

    cfg = {**DIGITS, "algorithm": "fedgmt", "run-dir": str(tmp_path / "own")}
    run_inprocess(cfg, 2, server_app=app)
    strategy = seen["strategy"]
    final = seen["result"].arrays.to_torch_state_dict()
    assert strategy.round == 3 and sorted(seen["result"].train_metrics_clientapp) == [1, 2, 3]
    assert all(seen["result"].train_metrics_clientapp[r]["clients_replied"] == 2 for r in (1, 2, 3))
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    test = dataset_for(strategy.cfg).test
    model.load_state_dict(seen["initial"])
    _, before = evaluate(model, test, 512)
    model.load_state_dict(final)
    _, after = evaluate(model, test, 512)
    assert before < 0.2 and after > 0.6, (before, after)
    ema = strategy.rule.records["ema_model"]
    assert any(not torch.equal(ema[k], seen["initial"][k]) for k in ema)  # the server's EMA moved


def test_the_docs_serverapp_runs(tmp_path, capsys):
    from flatflower.runtime.engines.inprocess import run_inprocess

    app = run_example(example("flatflower.server_strategy("))["app"]
    run_inprocess({**DIGITS, "algorithm": "fedgmt", "run-dir": str(tmp_path / "docs")}, 2, server_app=app)
    assert "final model: ['1.weight', '1.bias', '3.weight', '3.bias']" in capsys.readouterr().out


def _users_serverapp(seen: dict, **server_keys) -> ServerApp:
    """A user's own ServerApp whose strategy reads the run config with ``server_keys`` over it."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = flatflower.server_strategy("fedavg", context.run_config, **server_keys)
        seen["strategy"] = strategy
        seen["result"] = strategy.start(grid=grid, initial_arrays=ArrayRecord(strategy.model), num_rounds=2)

    return app


def _counting_client_app(calls: list) -> ClientApp:
    """flatflower's ClientApp, each message's type recorded in ``calls``."""
    from flatflower.client import app as client

    app = ClientApp()
    for kind, handler in (("query", client.query), ("train", client.train), ("evaluate", client.evaluate)):
        def handle(msg, context, kind=kind, handler=handler):
            calls.append(kind)
            return handler(msg, context)
        getattr(app, kind)()(handle)
    return app


def test_a_users_serverapp_with_another_run_config_than_the_clients_is_refused_at_the_handshake(tmp_path):
    """Issue 57, item 7: a user's ServerApp whose strategy reads another model and local-epochs
    than flatflower's ClientApps had every round skipped ("reply claims 105 local steps, the round
    asks for 21") and ended as a success. The handshake compares the two halves' settings: one
    line naming the differing keys, and no train message is ever sent."""
    from flatflower.runtime.engines.inprocess import run_inprocess
    from flatflower.strategies.participation import NoNodesError

    seen: dict = {}
    calls: list = []
    cfg = {**DIGITS, "algorithm": "fedavg", "run-dir": str(tmp_path / "own")}
    with pytest.raises(NoNodesError) as err:
        run_inprocess(cfg, 2, server_app=_users_serverapp(seen, model="logreg", local_epochs=3),
                      client_app=_counting_client_app(calls))
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("the clients' run config differs from the server's on model, local-epochs: the "
                           "server's model='logreg', local-epochs=3; the client's model='mlp', local-epochs=1 "), text
    assert text.endswith("(no node passed the partition handshake: 2 refused for it)"), text
    assert calls == ["query", "query"] and seen["strategy"].round == 0


def test_keys_of_the_server_alone_and_of_each_node_may_differ_between_the_halves(tmp_path):
    """What only the server reads (rounds, sampling, timeouts, evaluation, its run directory) and
    what a node may set for itself (data-dir, download) are not compared: the run trains."""
    from flatflower.runtime.engines.inprocess import run_inprocess

    seen: dict = {}
    cfg = {**DIGITS, "algorithm": "fedavg", "run-dir": str(tmp_path / "own")}
    run_inprocess(cfg, 2, server_app=_users_serverapp(
        seen, fraction_train=0.5, round_timeout=300.0, eval_batch_size=64, num_server_rounds=7,
        run_dir=str(tmp_path / "elsewhere"), data_dir=str(tmp_path), download=False))
    assert seen["strategy"].round == 2 and seen["strategy"].rounds_skipped == 0


def test_a_users_serverapp_whose_every_round_is_skipped_fails(tmp_path):
    """Issue 57, item 7: ``strategy.start`` returned the initial model as a result when no round
    had an accepted update; now it raises RunFailed, one line with the last round's reason."""
    from flatflower.runtime.engines.inprocess import run_inprocess
    from flatflower.strategies.strategy import RunFailed

    seen: dict = {}
    cfg = {**DIGITS, "algorithm": "fedavg", "run-dir": str(tmp_path / "own")}
    with pytest.raises(RunFailed) as err:
        run_inprocess(cfg, 2, node_config={"inject-fault": "raise"}, server_app=_users_serverapp(seen))
    text = str(err.value)
    assert "\n" not in text and text.startswith("every round (1-2) was skipped: no round had enough accepted "
                                                "client updates, the global model is the initial one; the last "
                                                "round's failure: client "), text
    assert text.endswith("RuntimeError: injected fault: raise (round 2)"), text
    assert seen["strategy"].rounds_skipped == 2 and "result" not in seen


def test_server_strategy_refuses_another_algorithm_in_its_config():
    with pytest.raises(flatflower.ConfigError, match="disagrees with the config's algorithm='fedsam'"):
        flatflower.server_strategy("fedgmt", {"algorithm": "fedsam"})


# ----------------------------------------------------------------------------- client half
def _direct(cfg_values: dict, model: torch.nn.Module, data, server_round: int, pid: int) -> dict:
    """FedSAM's client half through client/train.py directly: the weights it trains to."""
    from flatflower.client.train import build_rule, local_train, round_generator
    from flatflower.common.config import RunConfig
    from flatflower.strategies.registry import get

    cfg = RunConfig.from_mapping(cfg_values)
    lr = cfg.round_lr(server_round)
    rule, _ = build_rule(get(cfg.algorithm), cfg, model, {}, {}, lr)
    local_train(model, data, rule, cfg, lr, round_generator(cfg.seed, server_round, pid))
    return model.state_dict()


def test_fedsam_in_a_plain_flower_clientapp_trains_as_client_train_does():
    """docs/api.md's ClientApp (a plain Flower app calling ``local_training``): each node's reply
    holds exactly the weights client/train.py trains to from the same model, data and seed; then
    Flower's stock FedAvg drives it for two rounds."""
    from flwr.serverapp.strategy import FedAvg

    from flatflower.common.datasets import Split
    from tests.conftest import set_task_identity
    from flatflower.runtime.engines.inprocess import InProcessGrid

    ns = run_example(example("flatflower.local_training("))
    grid = InProcessGrid(ns["app"], 2, {})
    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)).state_dict()
    set_task_identity()
    msgs = [Message(RecordDict({"arrays": ArrayRecord(start), "config": ConfigRecord({"server-round": 2})}),
                    dst_node_id=node, message_type=MessageType.TRAIN, group_id="2") for node in grid.contexts]
    replies = grid.send_and_receive(msgs)
    assert len(replies) == 2 and not any(r.has_error() for r in replies)
    for pid, reply in enumerate(replies):
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
        model.load_state_dict(start)
        data = Split(ns["x_all"][pid::2], ns["y_all"][pid::2].long())
        expected = _direct({"algorithm": "fedsam", "lr": 0.1, "local-epochs": 1, "sam.rho": 0.05},
                           model, data, 2, pid)
        got = reply.content["arrays"].to_torch_state_dict()
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert not torch.equal(got["1.weight"], start["1.weight"])
        assert reply.content["metrics"]["num-examples"] == len(data)
    # a stock Flower strategy drives it
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    result = strategy.start(grid=InProcessGrid(ns["app"], 2, {}), initial_arrays=ArrayRecord(start), num_rounds=2)
    final = result.arrays.to_torch_state_dict()
    assert all(torch.isfinite(v).all() for v in final.values()) and not torch.equal(final["1.weight"], start["1.weight"])


def test_local_training_equals_flatflowers_own_clientapp():
    """The same round through flatflower's ClientApp (driven by FedSAM's server half) and
    through ``local_training`` on the node's partition: the same weights."""
    from flatflower.common.data import client_split
    from flatflower.common.models import build_model
    from flatflower.runtime.engines.inprocess import InProcessGrid

    cfg = fast_config(algorithm="fedsam", **{"sam.rho": 0.05}, num_partitions=2)
    strategy = flatflower.server_strategy("fedsam", cfg)
    grid = InProcessGrid(flatflower.client_app, 2, strategy.cfg.to_dict())
    msgs = list(strategy.configure_train(1, ArrayRecord(strategy.model), ConfigRecord(), grid))
    replies = grid.send_and_receive(msgs)
    assert len(replies) == 2
    for reply in replies:
        pid = int(reply.content["config"]["partition-id"])  # the reply's bookkeeping (docs/protocol.md)
        model = build_model("logreg", (20,), 10, seed=0)
        model.load_state_dict(strategy.model)
        result = flatflower.local_training("fedsam", model, client_split(strategy.cfg, pid, 2), strategy.cfg,
                                           server_round=1, partition_id=pid)
        got = reply.content["arrays"].to_torch_state_dict()
        assert all(torch.equal(got[k], model.state_dict()[k]) for k in got)
        assert result.num_steps == 2 and result.uploads == {} and result.state == {}


def test_local_training_needs_the_records_of_an_algorithm_that_has_some():
    model = torch.nn.Linear(4, 2)
    data = (torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="fedgmt needs the server.s ema_model in broadcast"):
        flatflower.local_training("fedgmt", model, data)
    with pytest.raises(flatflower.ConfigError, match="does not privatize"):
        flatflower.local_training("fedsam", model, data, {"dp.clip": 1.0, "aggregation": "uniform"})


def test_a_dataset_callable_and_a_model_class(tmp_path):
    """``dataset``: a callable returning the dict form (its num_classes wins over the labels');
    ``model``: an nn.Module class taking (input_shape, num_classes); the same objects keep their
    names in a second run."""
    import numpy as np

    class Net(torch.nn.Module):
        def __init__(self, input_shape, num_classes):
            super().__init__()
            self.fc = torch.nn.Linear(input_shape[0], num_classes)

        def forward(self, x):
            return self.fc(x)

    def data():
        rng = np.random.default_rng(1)
        x = rng.normal(size=(120, 3)).astype("float32")
        y = (x[:, 1] > 0).astype("int64")
        return {"train": (x[:100], y[:100]), "test": (x[100:], y[100:]), "num_classes": 3}

    first = flatflower.run_simulation(algorithm="fedavg", clients=2, rounds=1, model=Net, dataset=data,
                                      partition="iid", run_dir=tmp_path / "a")
    assert first.final_model["fc.weight"].shape == (3, 3)  # three classes, as the dict says
    second = flatflower.run_simulation(algorithm="fedavg", clients=2, rounds=1, model=Net, dataset=data,
                                       partition="iid", run_dir=tmp_path / "b")
    assert (second.config.model, second.config.dataset) == (first.config.model, first.config.dataset)
    assert all(torch.equal(first.final_model[k], second.final_model[k]) for k in first.final_model)
    from flatflower.common.datasets import register_dataset

    with pytest.raises(ValueError, match="already registered to another callable"):
        register_dataset(first.config.dataset, lambda: None)
    with pytest.raises(ValueError, match="not a new dataset name"):
        register_dataset("digits", data)
