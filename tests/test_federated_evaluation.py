"""Federated evaluation that one node cannot own (issue 58, item 5; docs/local-data.md, "The
trust model"): under partition = local a node's held-out count is the one it declared at its
handshake (an evaluate reply claiming another is refused), its weight in federated_accuracy
and federated_loss is at most EVALUATE_WEIGHT_CAP times the median count of the other nodes
evaluated with it, the median over the nodes is recorded beside the weighted mean, and an
honest node whose test split is empty trains and is not evaluated.

Each attack runs as the attacker would: the real ServerApp and ClientApps on the in-process
grid, the attacker's ClientApp the real one whose replies it changes (tests/malicious.py)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from flatflower.common.config import RunConfig
from flatflower.common.evaluate import evaluate
from flatflower.common.models import build_model
from flatflower.common.userdata import load
from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.strategies.participation import EVALUATE_WEIGHT_CAP, Participation
from tests.helpers import metrics
from tests.malicious import malicious_app
from tests.test_local_data import (
    CLASSES,
    FEATURES,
    SITES,
    local_config,
    node_configs,
    rejections,
    split_of,
    write_site,
)

# the three sites of tests/test_local_data.py and a fourth, the one that lies when a test says so
FOUR = [*SITES, (80, 25, range(10))]
LIAR, CLAIM = 3, 10_000_000  # the liar's partition; what it claims: max-node-examples' default


def four_sites(root: Path) -> list[Path]:
    return [write_site(root / f"site{i}", a, b, c, seed=i) for i, (a, b, c) in enumerate(FOUR)]


def node_accuracies(run_dir: Path, folders: list[Path]) -> list[tuple[float, float]]:
    """(loss, accuracy) of the run's final model on each folder's test split: what each node's
    last federated evaluation measured."""
    model = build_model("logreg", (FEATURES,), CLASSES, seed=0)
    model.load_state_dict(torch.load(run_dir / "model_final.pt", weights_only=True))
    return [evaluate(model, split_of(f, "test"), 512) for f in folders]


def weighted(values: list[float], weights: list[float]) -> float:
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


def test_a_node_declaring_ten_million_held_out_examples_does_not_own_federated_accuracy(tmp_path):
    """At 922f961 the liar's 10,000,000 declared examples made federated_accuracy 0.99999. Now
    it counts as twice the median of the others' held-out sets; the median over the nodes
    stays among the honest nodes' accuracies. Training is the honest run's, bit for bit."""
    folders = four_sites(tmp_path / "data")
    clean, _ = run_inprocess(local_config(tmp_path, **{"run-dir": str(tmp_path / "clean")}), 4,
                             node_configs=node_configs(folders))
    attack = {LIAR: f"heldout-claim:{CLAIM}+perfect-eval:{CLAIM}"}
    lied, _ = run_inprocess(local_config(tmp_path, **{"run-dir": str(tmp_path / "lied")}), 4,
                            node_configs=node_configs(folders), client_app=malicious_app(attack))
    a, b = torch.load(clean / "model_final.pt"), torch.load(lied / "model_final.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the liar trains honestly: only evaluation differs
    rows, clean_rows = metrics(lied), metrics(clean)
    assert not any(r["rejections"] for r in rows), rows  # its claims are within every bound
    heldout = json.loads((lied / "partition.json").read_text())["heldout_sizes"]
    assert heldout == {"0": 30, "1": 20, "2": 50, str(LIAR): CLAIM}

    measured = node_accuracies(lied, folders)
    honest = [acc for _, acc in measured[:LIAR]]
    sizes = [b for _, b, _ in SITES]
    cap = EVALUATE_WEIGHT_CAP * statistics.median(sizes)  # 60: the others' median is 30
    last = rows[-1]
    assert last["federated_accuracy"] == pytest.approx(weighted([*honest, 1.0], [*sizes, cap]), abs=1e-9)
    assert last["federated_loss"] == pytest.approx(weighted([lo for lo, _ in measured[:LIAR]] + [0.0],
                                                            [*sizes, cap]), rel=1e-5)
    assert all(r["federated_accuracy"] < 0.95 for r in rows), rows  # 0.99999 at 922f961
    # the median over the nodes: one node moves it no further than to a neighbouring honest value
    assert last["federated_accuracy_median"] == pytest.approx(statistics.median([*honest, 1.0]), abs=1e-12)
    assert min(honest) <= last["federated_accuracy_median"] <= max(honest)
    spread = max(honest) - min(honest)
    assert abs(last["federated_accuracy_median"] - clean_rows[-1]["federated_accuracy_median"]) <= spread
    # the honest run: every node within twice the others' median, so its weighted mean is the
    # plain example-weighted one (the rule leaves it as it was)
    clean_measured = node_accuracies(clean, folders)
    all_sizes = [b for _, b, _ in FOUR]
    assert clean_rows[-1]["federated_accuracy"] == pytest.approx(
        weighted([acc for _, acc in clean_measured], all_sizes), abs=1e-9)


def test_a_node_claiming_more_held_out_examples_than_it_declared_is_refused(tmp_path):
    """The evaluate reply must claim the held-out count of the node's handshake: claiming
    10,000,000 (with accuracy 1) after declaring its 25 is refused every round, and the
    federated numbers are the honest nodes' alone."""
    folders = four_sites(tmp_path / "data")
    run_dir, _ = run_inprocess(local_config(tmp_path), 4, node_configs=node_configs(folders),
                               client_app=malicious_app({LIAR: f"perfect-eval:{CLAIM}"}))
    rows = metrics(run_dir)
    refused = rejections(rows, "evaluate")
    assert [r["partition"] for r in refused] == [LIAR] * 3, refused
    assert all(f"reply claims {CLAIM} examples, partition {LIAR} has 25" in r["reason"] for r in refused)
    measured = node_accuracies(run_dir, folders)[:LIAR]
    sizes = [b for _, b, _ in SITES]
    assert rows[-1]["federated_accuracy"] == pytest.approx(weighted([acc for _, acc in measured], sizes), abs=1e-9)
    assert rows[-1]["federated_accuracy_median"] == pytest.approx(statistics.median(acc for _, acc in measured))


def test_an_honest_node_with_an_empty_test_split_trains_and_is_not_evaluated(tmp_path):
    """docs/local-data.md allows a test.npz of 0 rows. At 922f961 such a node was refused at
    its handshake ("test.npz holds no samples") and never trained. Now it joins, trains every
    round, declares no held-out set, and federated evaluation does not ask it (its training data
    is not what federated evaluation measures): the federated numbers are the other two's."""
    folders = [write_site(tmp_path / f"site{i}", a, 0 if i == 1 else b, c, seed=i)
               for i, (a, b, c) in enumerate(SITES)]
    run_dir, _ = run_inprocess(local_config(tmp_path), 3, node_configs=node_configs(folders))
    rows = metrics(run_dir)
    assert not any(r["rejections"] or r["failures"] for r in rows), rows
    assert all(r["sampled_partitions"] == [0, 1, 2] and r["clients_replied"] == 3 for r in rows)
    clients = [json.loads(line) for line in (run_dir / "clients.jsonl").read_text().splitlines()]
    assert sorted((c["round"], c["partition"]) for c in clients if c["partition"] == 1) == [(1, 1), (2, 1), (3, 1)]
    partition = json.loads((run_dir / "partition.json").read_text())
    assert partition["sizes"]["1"] == SITES[1][0] and partition["heldout_sizes"]["1"] == 0
    measured = node_accuracies(run_dir, [folders[0], folders[2]])
    sizes = [SITES[0][1], SITES[2][1]]
    assert rows[-1]["federated_accuracy"] == pytest.approx(weighted([acc for _, acc in measured], sizes), abs=1e-9)
    assert rows[-1]["federated_loss"] == pytest.approx(weighted([lo for lo, _ in measured], sizes), rel=1e-5)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_federated_accuracy"] == rows[-1]["federated_accuracy"]


def test_a_run_whose_nodes_all_hold_nothing_out_completes_without_federated_numbers(tmp_path):
    """Nothing to evaluate on any node and no server evaluation set: every node trains, no round
    has federated columns, and the run completes (no sampling loop over an empty pool)."""
    folders = [write_site(tmp_path / f"site{i}", a, 0, c, seed=i) for i, (a, _, c) in enumerate(SITES)]
    run_dir, _ = run_inprocess(local_config(tmp_path, **{"num-server-rounds": 2, "sampling": "bernoulli",
                                                         "fraction-evaluate": 0.5}), 3,
                               node_configs=node_configs(folders))
    rows = metrics(run_dir)
    assert [r["clients_replied"] for r in rows] and not any("federated_accuracy" in r for r in rows)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def test_the_cap_is_relative_to_the_others_and_only_where_sizes_are_declared(tmp_path):
    """evaluation_weights: under partition = local each count is capped at EVALUATE_WEIGHT_CAP
    times the median of the OTHER evaluated counts (a node cannot raise its own cap); one node
    alone is its own weight; where the server computes the sizes (benchmark partitions) they are
    its own figures, never capped."""
    local = Participation(RunConfig.from_mapping(local_config(tmp_path)))
    local.heldout = {0: 30, 1: 20, 2: 50, 3: CLAIM, 4: 0}
    assert local.evaluation_weights([0, 1, 2, 3]) == {0: 30, 1: 20, 2: 50, 3: 60}
    assert local.evaluation_weights([2, 3]) == {2: 50, 3: 100}
    assert local.evaluation_weights([3]) == {3: CLAIM}
    assert [local.evaluates(p) for p in range(5)] == [True, True, True, True, False]
    bench = Participation(RunConfig.from_mapping({"dataset": "digits", "partition": "iid", "num-partitions": 3}),
                          partition_sizes=lambda n: [10, 10, 10_000])
    bench.fix_size(3)
    assert bench.evaluation_weights([0, 1, 2]) == {0: 10, 1: 10, 2: 10_000}
    assert all(bench.evaluates(p) for p in range(3))


@pytest.mark.parametrize("fmt", ["npz", "csv", "imagefolder"])
def test_an_empty_test_split_loads_and_an_empty_server_evaluation_set_is_one_line(tmp_path, fmt):
    """A node's test split may be empty in every file format (0 rows, a header-only test.csv,
    a test/ folder without class folders); the server's own evaluation set may not."""
    from PIL import Image

    from flatflower.server.setup import server_data

    root = tmp_path / fmt
    if fmt == "npz":
        write_site(root, 6, 0, range(3), seed=0)
    elif fmt == "csv":
        root.mkdir()
        (root / "train.csv").write_text("a,b,label\n1,2,0\n3,4,1\n")
        (root / "test.csv").write_text("a,b,label\n")
    else:
        for c in ("cat", "dog"):
            os.makedirs(root / "train" / c)
            for i in range(2):
                Image.fromarray(np.full((5, 5, 3), 40 * i, np.uint8)).save(root / "train" / c / f"{i}.png")
        (root / "test").mkdir()
    data = load(fmt, str(root))
    assert len(data.train) > 0 and len(data.test) == 0
    assert tuple(data.test.x.shape[1:]) == tuple(data.train.x.shape[1:])
    if fmt == "npz":
        cfg = RunConfig.from_mapping({**local_config(tmp_path), "data-dir": str(root)})
        with pytest.raises(ValueError, match="the test split the server evaluates on holds no samples"):
            server_data(cfg)
