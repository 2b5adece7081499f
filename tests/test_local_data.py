"""partition = local: every node trains on all of its own data (its own folder), the server
holds none, learns each node's sizes at its handshake (bounded, fixed for the run) and measures
the global model by federated evaluation on the clients' own held-out data.

Three sites with NPZ folders of different sizes and class mixes, in-process (fast); the same
scenario over a real SuperLink and SuperNodes is the loopback test at the end (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

import flatflower.client.app as honest
from flatflower.common import protocol as P
from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.datasets import Split
from flatflower.common.evaluate import evaluate
from flatflower.common.models import build_model
from flatflower.strategies.participation import Participation
from tests.helpers import metrics
from tests.malicious import with_metric
from flatflower.runtime.engines.inprocess import InProcessGrid, run_inprocess

FEATURES, CLASSES = 16, 10
# (train examples, held-out examples, classes present) of each site: different sizes and mixes
SITES = [(120, 30, range(0, 5)), (60, 20, range(3, 10)), (200, 50, range(0, 10))]


def write_site(folder: Path, n_train: int, n_test: int, classes, seed: int, features: int = FEATURES) -> Path:
    """An NPZ folder (train.npz, test.npz: x (N, features) float32, y (N,) int64) of Gaussian
    classes around shared means (the same means at every site, so the federation can learn)."""
    means = np.random.default_rng(1234).normal(size=(CLASSES, features))
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for name, n in (("train", n_train), ("test", n_test)):
        y = rng.choice(np.asarray(list(classes)), size=n)
        x = (means[y][:, :features] + 1.5 * rng.normal(size=(n, features))).astype(np.float32)
        np.savez(folder / f"{name}.npz", x=x, y=y.astype(np.int64))
    return folder


def sites(root: Path) -> list[Path]:
    return [write_site(root / f"site{i}", a, b, c, seed=i) for i, (a, b, c) in enumerate(SITES)]


def local_config(tmp_path: Path, **extra) -> dict:
    return {"dataset": "npz", "partition": "local", "input-shape": str(FEATURES), "num-classes": CLASSES,
            "model": "logreg", "algorithm": "fedavg", "fraction-evaluate": 1.0, "num-server-rounds": 3,
            "local-epochs": 1, "batch-size": 16, "run-dir": str(tmp_path / "run"), **extra}


def node_configs(folders: list[Path]) -> dict[int, dict]:
    return {i: {"data-dir": str(f)} for i, f in enumerate(folders)}


def split_of(folder: Path, name: str) -> Split:
    with np.load(folder / f"{name}.npz") as f:
        return Split(torch.from_numpy(f["x"]), torch.from_numpy(f["y"]))


def rejections(rows: list[dict], stage: str) -> list[dict]:
    return [r for row in rows for r in row.get("rejections", []) if r["stage"] == stage]


# ---------------------------------------------------------------- the three sites, in-process
def test_three_sites_with_their_own_data_and_no_data_on_the_server(tmp_path):
    folders = sites(tmp_path)
    run_dir, _ = run_inprocess(local_config(tmp_path), 3, node_configs=node_configs(folders))
    rows = metrics(run_dir)
    # no evaluation set on the server: no round 0, no test_accuracy; federated evaluation every round
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all("test_accuracy" not in r and "test_loss" not in r for r in rows)
    assert all(0 <= r["federated_accuracy"] <= 1 and r["federated_loss"] > 0 for r in rows)
    assert rows[-1]["federated_loss"] < rows[0]["federated_loss"]  # it learns
    # each site trained on ALL of its data: the server's sizes are the folders' (no slicing)
    partition = json.loads((run_dir / "partition.json").read_text())
    assert partition["scheme"] == "local"
    assert partition["sizes"] == {str(i): a for i, (a, _, _) in enumerate(SITES)}
    assert partition["heldout_sizes"] == {str(i): b for i, (_, b, _) in enumerate(SITES)}
    clients = [json.loads(line) for line in (run_dir / "clients.jsonl").read_text().splitlines()]
    assert {(c["partition"], c["examples"]) for c in clients} == {(i, a) for i, (a, _, _) in enumerate(SITES)}
    # federated_accuracy/_loss = the final model on each site's held-out split, weighted by its size
    model = build_model("logreg", (FEATURES,), CLASSES, seed=0)
    model.load_state_dict(torch.load(run_dir / "model_final.pt", weights_only=True))
    measured = [evaluate(model, split_of(f, "test"), 512) for f in folders]
    sizes = [b for _, b, _ in SITES]
    accuracy = sum(acc * n for (_, acc), n in zip(measured, sizes)) / sum(sizes)
    loss = sum(lo * n for (lo, _), n in zip(measured, sizes)) / sum(sizes)
    assert rows[-1]["federated_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert rows[-1]["federated_loss"] == pytest.approx(loss, rel=1e-5)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and "final_test_accuracy" not in summary
    assert summary["final_federated_accuracy"] == rows[-1]["federated_accuracy"]


def test_a_server_evaluation_set_is_optional(tmp_path):
    """With a data-dir of its own, the server also evaluates on that folder's test split."""
    folders = sites(tmp_path)
    server = write_site(tmp_path / "server", 10, 40, range(10), seed=9)
    run_dir, _ = run_inprocess(local_config(tmp_path, **{"data-dir": str(server), "num-server-rounds": 2}), 3,
                               node_configs=node_configs(folders))
    rows = metrics(run_dir)
    assert [r["round"] for r in rows] == [0, 1, 2]
    model = build_model("logreg", (FEATURES,), CLASSES, seed=0)
    model.load_state_dict(torch.load(run_dir / "model_final.pt", weights_only=True))
    assert rows[-1]["test_accuracy"] == pytest.approx(evaluate(model, split_of(server, "test"), 512)[1])
    assert "federated_accuracy" in rows[-1]
    # the server's folder is for evaluation only: the nodes' sizes are their own folders'
    assert json.loads((run_dir / "partition.json").read_text())["sizes"] == {"0": 120, "1": 60, "2": 200}


def test_a_node_whose_data_does_not_fit_is_refused_at_the_handshake(tmp_path):
    folders = sites(tmp_path)
    folders[1] = write_site(tmp_path / "wide", 50, 10, range(10), seed=5, features=FEATURES + 4)
    run_dir, _ = run_inprocess(local_config(tmp_path, **{"num-server-rounds": 1}), 3,
                               node_configs=node_configs(folders))
    refused = rejections(metrics(run_dir), "handshake")  # asked again before each exchange
    assert refused and all(r["node"] == 1001 for r in refused)
    reason = refused[0]["reason"]
    assert f"data-dir '{folders[1]}': examples of shape 20, the run's input-shape is 16" in reason, reason
    assert metrics(run_dir)[-1]["sampled_partitions"] == [0, 2]


def test_a_declaration_above_max_node_examples_is_refused(tmp_path):
    folders = sites(tmp_path)
    run_dir, _ = run_inprocess(local_config(tmp_path, **{"num-server-rounds": 1, "max-node-examples": 150}), 3,
                               node_configs=node_configs(folders))
    refused = rejections(metrics(run_dir), "handshake")
    assert refused and all(r["reason"] == "declares 200 training examples, more than max-node-examples=150"
                           for r in refused), refused
    assert metrics(run_dir)[-1]["sampled_partitions"] == [0, 1]


@pytest.mark.parametrize("keys, why", [
    ({"input-shape": ""}, "partition=local needs input-shape"),
    ({"num-classes": 0}, "partition=local needs input-shape"),
    ({"input-shape": "1,x,8"}, "input-shape='1,x,8' is not 1 to 4 whole numbers"),
    ({"flatness-every": 2}, "flatness-every > 0 with partition=local needs an evaluation set on the server"),
    ({"max-node-examples": 0}, "max-node-examples must be in"),
])
def test_bad_local_configs_are_one_line(tmp_path, keys, why):
    with pytest.raises(ConfigError, match=why.replace("(", r"\(")):
        RunConfig.from_mapping({**local_config(tmp_path), **keys})


# ---------------------------------------------------------------- an inflating node
INFLATE = 10


def inflating_app(partition: int, stage: str, after: int = 1) -> ClientApp:
    """The real ClientApp, except that ``partition`` declares INFLATE times its size at
    ``stage`` (``query``: from its ``after``+1-th handshake on; ``train``/``evaluate``: in
    rounds > ``after``)."""
    queries: dict[int, int] = {}

    def inflate(handler, this_stage):
        def run(msg: Message, context: Context) -> Message:
            reply = handler(msg, context)
            if int(context.node_config["partition-id"]) != partition or this_stage != stage:
                return reply
            if stage == "query":
                queries[context.node_id] = queries.get(context.node_id, 0) + 1
                late = queries[context.node_id] > after
            else:
                late = int(msg.content[P.CONFIG][P.SERVER_ROUND]) > after
            declared = int(reply.content[P.METRICS][P.NUM_EXAMPLES])
            return with_metric(reply, P.NUM_EXAMPLES, declared * INFLATE) if late else reply
        return run

    app = ClientApp()
    app.train()(inflate(honest.train, "train"))
    app.evaluate()(inflate(honest.evaluate, "evaluate"))
    app.query()(inflate(honest.query, "query"))
    return app


@pytest.mark.parametrize("stage", ["train", "evaluate"])
def test_a_node_that_inflates_its_size_mid_run_is_refused(tmp_path, stage):
    folders = sites(tmp_path)
    run_dir, _ = run_inprocess(local_config(tmp_path), 3, node_configs=node_configs(folders),
                               client_app=inflating_app(1, stage))
    rows = metrics(run_dir)
    refused = rejections(rows, stage)
    assert [r["partition"] for r in refused] == [1, 1]  # rounds 2 and 3, never round 1
    n = SITES[1][0] if stage == "train" else SITES[1][1]
    assert f"reply claims {n * INFLATE} examples, partition 1 has {n}" in refused[0]["reason"]
    if stage == "train":  # its update never entered aggregation; its size never moved
        assert [r["rejected_partitions"] for r in rows] == [[], [1], [1]]
    assert json.loads((run_dir / "partition.json").read_text())["sizes"]["1"] == SITES[1][0]


def test_a_restarted_node_cannot_declare_another_size_even_after_a_resume(tmp_path):
    """The sizes a node declared at its first handshake are fixed: a later handshake (a node
    that reconnects) declaring another is refused, also by a server restored from a checkpoint
    of the participation state."""
    folders = sites(tmp_path)
    cfg = RunConfig.from_mapping({**local_config(tmp_path), "num-partitions": 3})
    grid = InProcessGrid(inflating_app(0, "query"), 3, cfg.to_dict(), node_configs=node_configs(folders))
    refused = []

    def on_refused(stage, pid, node, why):
        refused.append((stage, pid, why))

    part = Participation(cfg)
    nodes = sorted(grid.get_node_ids())
    part.handshake(grid, nodes, on_refused)
    assert part.sizes == {0: 120, 1: 60, 2: 200} and part.heldout == {0: 30, 1: 20, 2: 50} and not refused
    saved = part.state_dict()
    grid.offline.add(nodes[0])  # node 0 leaves ...
    part.handshake(grid, nodes[1:], on_refused)
    grid.offline.discard(nodes[0])  # ... and comes back declaring 10x its size
    part.handshake(grid, nodes, on_refused)
    assert refused == [("handshake", 0, "declares 1200 examples, partition 0 has 120")]
    assert 0 not in part.available(grid, on_refused) and part.sizes[0] == 120
    resumed = Participation(cfg)
    resumed.load_state_dict(saved)  # what a resumed run starts from
    refused.clear()
    resumed.handshake(grid, nodes, on_refused)  # node 0's handshake is its 3rd: inflated
    assert refused == [("handshake", 0, "declares 1200 examples, partition 0 has 120")]
    assert resumed.heldout == {0: 30, 1: 20, 2: 50}


# ---------------------------------------------------------------- the same over real processes
@pytest.mark.slow
@pytest.mark.integration
def test_three_supernodes_each_on_its_own_folder_over_loopback(tmp_path):
    """A SuperLink and three SuperNodes on 127.0.0.1, each SuperNode with its own ``data-dir``
    (node config) holding an NPZ folder of a different size and class mix; the ServerApp has
    no data: partition = local, fraction-evaluate = 1."""
    from tests.helpers import deployed

    folders = sites(tmp_path / "data")
    config = {k: v for k, v in local_config(tmp_path).items() if k != "run-dir"}
    _, run_dir = deployed(tmp_path, "dep", {**config, "num-server-rounds": 2}, 3,
                          node_configs=node_configs(folders))
    rows = metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2]
    assert all("test_accuracy" not in r for r in rows)
    assert all(0 <= r["federated_accuracy"] <= 1 and r["federated_loss"] > 0 for r in rows), rows
    assert all(r["clients_replied"] == 3 and not r["rejections"] for r in rows), rows
    assert json.loads((run_dir / "partition.json").read_text())["sizes"] == {"0": 120, "1": 60, "2": 200}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_federated_accuracy"] == rows[-1]["federated_accuracy"]


def test_a_local_run_with_nothing_to_measure_it_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="measures nothing: set fraction-evaluate > 0"):
        RunConfig.from_mapping({**local_config(tmp_path), "fraction-evaluate": 0.0})


# ---------------------------------------------------------------- the command line
def test_simulate_with_a_folder_per_client(tmp_path, capsys):
    """``flatflower simulate --node-data DIR`` once per client: partition = local, --clients
    from the folders; the in-process and vectorised engines give the same federated numbers."""
    from flatflower.tools.cli import main as cli

    folders = sites(tmp_path)
    args = ["simulate", "--dataset", "npz", "--model", "logreg", "--set", f"input-shape={FEATURES}",
            "--set", f"num-classes={CLASSES}", "--set", "fraction-evaluate=1", "--set", "local-epochs=1",
            "--rounds", "2", *[x for f in folders for x in ("--node-data", str(f))]]
    for engine in ("inprocess", "vectorized"):
        assert cli([*args, "--engine", engine, "--run-dir", str(tmp_path / engine)]) == 0
    assert "final federated accuracy" in capsys.readouterr().out
    a, b = metrics(tmp_path / "inprocess"), metrics(tmp_path / "vectorized")
    assert [r["federated_loss"] for r in a] == pytest.approx([r["federated_loss"] for r in b], rel=1e-5)
    assert json.loads((tmp_path / "inprocess" / "partition.json").read_text())["sizes"] == {
        "0": 120, "1": 60, "2": 200}
    assert cli(["report", str(tmp_path / "inprocess")]) == 0
    assert "accuracy there is federated evaluation's" in capsys.readouterr().out


@pytest.mark.parametrize("change, error", [
    (["--node-data", "{missing}"], "--node-data {missing}: no such directory"),
    (["--node-data", "{wide}"], "--node-data {wide}: data-dir '{wide}': examples of shape 20, the run's input-shape is 16"),
    (["--clients", "2"], "--clients 2 disagrees with the 3 --node-data folders"),
    (["--partition", "iid"], "--node-data gives each client its own data: partition must be local, not 'iid'"),
    (["--engine", "ray"], "--node-data: Ray's simulation gives every virtual node the same node config"),
])
def test_bad_node_folders_are_one_line_before_anything_starts(tmp_path, capsys, change, error):
    from flatflower.tools.cli import main as cli

    folders = sites(tmp_path)
    paths = {"missing": str(tmp_path / "missing"),
             "wide": str(write_site(tmp_path / "wide", 20, 5, range(10), seed=3, features=FEATURES + 4))}
    change = [c.format(**paths) for c in change]
    given = [str(f) for f in folders[:2]] + ([] if change[0] == "--node-data" else [str(folders[2])])
    args = ["simulate", "--dataset", "npz", "--model", "logreg", "--set", f"input-shape={FEATURES}",
            "--set", f"num-classes={CLASSES}", "--set", "fraction-evaluate=1", "--rounds", "1",
            "--run-dir", str(tmp_path / "run"), *[x for f in given for x in ("--node-data", f)], *change]
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and error.format(**paths) in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- federated evaluation on held-out data
def test_federated_evaluation_uses_the_clients_held_out_data_where_they_have_some(tmp_path):
    """synthetic-fedprox: each client holds out 10% of its generated data, and the server's
    test split is the union of those held-out sets. So with every client evaluating, the
    example-weighted federated accuracy and loss ARE the server's test accuracy and loss."""
    run_dir, _ = run_inprocess({"dataset": "synthetic-fedprox", "partition": "natural", "num-server-rounds": 2,
                                "fraction-evaluate": 1.0, "run-dir": str(tmp_path / "run")}, 5)
    for row in metrics(run_dir)[1:]:
        assert row["federated_accuracy"] == pytest.approx(row["test_accuracy"], abs=1e-12)
        assert row["federated_loss"] == pytest.approx(row["test_loss"], rel=1e-5)


# ---------------------------------------------------------------- docs/local-data.md
def test_the_guides_commands_are_valid():
    """Every node config, run config and flatflower command line of docs/local-data.md parses
    (and the run config is a valid partition = local config)."""
    import re
    import shlex

    from flwr.common.config import parse_config_args

    from flatflower.client.node import NodeSettings
    from flatflower.tools.cli import build_parser

    text = (Path(__file__).resolve().parent.parent / "docs" / "local-data.md").read_text()
    seen = set()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["flatflower"]:
                build_parser().parse_args(words[1:])
                seen.add("flatflower")
            for flag, value in zip(words, words[1:]):
                if flag == "--node-config":
                    assert NodeSettings.from_node_config(parse_config_args([value])).data_dir
                    seen.add(flag)
                if flag == "-c":
                    cfg = RunConfig.from_mapping(parse_config_args([value]))
                    assert cfg.local_data() and not cfg.central_evaluation()
                    seen.add(flag)
    assert seen == {"flatflower", "--node-config", "-c"}


def test_federated_evaluation_every_k_rounds_and_the_last(tmp_path):
    folders = sites(tmp_path)
    run_dir, _ = run_inprocess(local_config(tmp_path, **{"num-server-rounds": 5, "evaluate-every": 2}), 3,
                               node_configs=node_configs(folders))
    rows = metrics(run_dir)
    assert [r["round"] for r in rows if "federated_accuracy" in r] == [2, 4, 5]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]


def test_a_resumed_local_run_keeps_the_sizes_and_ends_as_an_unbroken_one(tmp_path):
    """The learned sizes travel in the checkpoint: a run stopped after round 2 and resumed to
    round 3 ends with the model and the rows of a run of 3 rounds."""
    folders = sites(tmp_path)
    full, _ = run_inprocess(local_config(tmp_path, **{"run-dir": str(tmp_path / "full")}), 3,
                            node_configs=node_configs(folders))
    cut, _ = run_inprocess(local_config(tmp_path, **{"run-dir": str(tmp_path / "cut"), "num-server-rounds": 2}),
                           3, node_configs=node_configs(folders))
    saved = torch.load(cut / "checkpoint.pt", weights_only=True)["strategy"]["participation"]
    assert saved["sizes"] == {"0": 120, "1": 60, "2": 200} and saved["heldout"] == {"0": 30, "1": 20, "2": 50}
    run_inprocess(local_config(tmp_path, **{"run-dir": str(cut), "resume": True}), 3,
                  node_configs=node_configs(folders))
    a, b = torch.load(full / "model_final.pt"), torch.load(cut / "model_final.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["federated_loss"] for r in metrics(cut)] == [r["federated_loss"] for r in metrics(full)]


def test_a_held_out_declaration_above_the_bound_is_refused(tmp_path):
    """A node that declares a huge held-out set (to weigh more in federated evaluation) is
    refused at its handshake, like one that declares a huge training set."""
    folders = sites(tmp_path)

    def query(msg: Message, context: Context) -> Message:
        reply = honest.query(msg, context)
        if int(context.node_config["partition-id"]) == 2:
            reply = with_metric(reply, P.NUM_HELDOUT, 10**9)
        return reply

    app = ClientApp()
    app.train()(honest.train)
    app.evaluate()(honest.evaluate)
    app.query()(query)
    run_dir, _ = run_inprocess(local_config(tmp_path, **{"num-server-rounds": 1}), 3,
                               node_configs=node_configs(folders), client_app=app)
    refused = rejections(metrics(run_dir), "handshake")
    assert refused and all(r["reason"] == "declares 1000000000 held-out examples, more than "
                           "max-node-examples=10000000" for r in refused), refused
    assert metrics(run_dir)[-1]["sampled_partitions"] == [0, 1]
