"""The per-round flatness fields of metrics.jsonl (server/run.py, common/flatness.py):
FedNSAM's eq. (4) flatness distance every round, from the models the clients actually sent;
the global model's sharpness and Hessian numbers every ``flatness-every`` rounds and at the
last; their TensorBoard curves; a resume may change when they are measured."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import MessageType

from flatflower.client.app import app as client_app
from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.data import dataset_for
from flatflower.common.flatness import ROUND_FIELDS, measure, seed_of
from flatflower.common.models import build_model
from flatflower.server.run import run_server
from tests.helpers import fast_config, metrics, run_with_faults
from flatflower.tools.cli import main as cli
from flatflower.runtime.engines.inprocess import InProcessGrid

MEASURED = ("sharpness", "sharpness_rho", "hessian_max_eig", "hessian_trace", "flatness_seconds")


class ModelGrid(InProcessGrid):
    """Keeps every train message's global model and every train reply's model, per round."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[dict] = []  # per round: the model the clients started from
        self.returned: list[list[dict]] = []  # per round: the models they sent back

    def push_messages(self, messages):
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self.sent.append(codec.from_record(messages[0].content[P.MODEL]))
            self.returned.append([])
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        for r in replies:
            if r.metadata.message_type == MessageType.TRAIN and r.has_content():
                self.returned[-1].append(codec.from_record(r.content[P.MODEL]))
        return replies


@pytest.fixture(scope="module")
def fedsam_run(tmp_path_factory):
    """FedSAM, 4 clients at half participation, 3 rounds, flatness measured every 2 rounds
    (so at rounds 2 and 3, the last)."""
    run_dir = tmp_path_factory.mktemp("flat") / "run"
    cfg = RunConfig.from_mapping(fast_config(algorithm="fedsam", fraction_train=0.5, num_server_rounds=3,
                                             flatness_every=2, run_dir=str(run_dir), dataset="digits",
                                             model="cnn", local_steps=5))
    grid = ModelGrid(client_app, 4, cfg.to_dict())
    run_server(grid, cfg)
    return cfg, grid, metrics(run_dir)


def sq_distance(a: dict, b: dict) -> float:
    return sum(float((a[k].double() - b[k].double()).square().sum()) for k in a)


def test_flatness_distance_is_fednsam_eq4_over_the_clients_sent_models(fedsam_run):
    """(1/M) sum_i ||theta_i - theta^{t+1}||^2, theta_i the models the clients sent and
    theta^{t+1} the next round's broadcast (the final model after the last round)."""
    cfg, grid, rows = fedsam_run
    final = torch.load(f"{cfg.run_dir}/model_final.pt")
    after = [*grid.sent[1:], final]
    for rnd, (returned, new) in enumerate(zip(grid.returned, after), start=1):
        assert len(returned) == 2  # half of the 4 clients
        expected = sum(sq_distance(m, new) for m in returned) / len(returned)
        assert rows[rnd]["flatness_distance"] == pytest.approx(expected, rel=1e-9)
    assert "flatness_distance" not in rows[0]


def test_sharpness_and_hessian_every_k_rounds_and_at_the_last(fedsam_run):
    """Rounds 2 and 3 hold the measures, round 1 none; the last round's numbers are
    measure() of the final model on the evaluation split, seeded from (seed, round)."""
    cfg, _, rows = fedsam_run
    assert [r for r in range(1, 4) if "sharpness" in rows[r]] == [2, 3]
    assert all(set(MEASURED) <= set(rows[r]) for r in (2, 3))
    assert rows[2]["sharpness_rho"] == cfg.flatness_rho == 0.05
    assert rows[2]["flatness_seconds"] > 0
    data = dataset_for(cfg)
    model = build_model(cfg.resolved_model(), data.input_shape, data.num_classes)
    model.load_state_dict(torch.load(f"{cfg.run_dir}/model_final.pt"))
    found = measure(model, data.test, batch_size=cfg.eval_batch_size, rho=cfg.flatness_rho,
                    iters=cfg.flatness_iters, probes=cfg.flatness_probes, seed=seed_of(cfg.seed, 3))
    for key in ("sharpness", "hessian_max_eig", "hessian_trace"):
        assert rows[3][key] == pytest.approx(found[key], rel=1e-5), key
    assert rows[3]["hessian_max_eig"] > 0 and rows[3]["sharpness"] > 0


def test_tensorboard_draws_the_flatness_fields_under_flatness(fedsam_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _, rows = fedsam_run
    board = EventAccumulator(cfg.run_dir, size_guidance={"scalars": 0})
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {f"flatness/{k}" for k in ROUND_FIELDS} <= tags
    assert not {f"metrics/{k}" for k in ROUND_FIELDS} & tags
    assert [e.step for e in board.Scalars("flatness/sharpness")] == [2, 3]
    assert [e.value for e in board.Scalars("flatness/flatness_distance")] == pytest.approx(
        [r["flatness_distance"] for r in rows[1:]], rel=1e-6)


def test_report_summarises_flatness_and_draws_its_curves(fedsam_run, tmp_path, capsys):
    cfg, _, rows = fedsam_run
    out = tmp_path / "report.png"
    assert cli(["report", cfg.run_dir, "--out", str(out), "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert "flatness" in printed and "sharpness" in printed
    assert (tmp_path / "report-flatness.png").is_file()
    summary = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert summary["sharpness"] == rows[3]["sharpness"]
    assert summary["hessian_max_eig"] == rows[3]["hessian_max_eig"]
    assert summary["flatness_distance"] == pytest.approx(
        sum(r["flatness_distance"] for r in rows[1:]) / 3)


@pytest.mark.parametrize("threads", [1, 2])
def test_flatness_distance_equals_the_per_client_formula_bit_for_bit(threads, monkeypatch):
    """flatness_distance works a tensor at a time over blocks of clients; its number is the
    per-client formula's, (1/M) sum_i sum_k float(||theta_i[k] - theta[k]||^2) added in that
    order, to the last bit: with one and two threads (a tensor over 32,768 entries is summed
    in two halves by two threads), and with blocks smaller than the clients."""
    import flatflower.common.flatness as flatness
    import flatflower.common.tensors as tensors

    torch.manual_seed(0)
    shapes = {"conv": (6, 1, 5, 5), "fc": (400, 120), "big": (70_000,), "bias": (10,)}
    center = {k: torch.randn(s) for k, s in shapes.items()}
    clients = [{k: v + 0.01 * torch.randn_like(v) for k, v in center.items()} for _ in range(7)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        expected = sum(sq_distance({k: m[k] for k in shapes}, center) for m in clients) / len(clients)
        for block in (tensors.STACKED_ENTRIES, 150_000, 1):  # all clients at once, 2 at once, 1
            monkeypatch.setattr(tensors, "STACKED_ENTRIES", block)
            assert flatness.flatness_distance(clients, center, list(shapes)) == expected
    finally:
        torch.set_num_threads(before)


def test_a_skipped_round_has_no_flatness_distance(tmp_path):
    """Every client fails round 2: no new global model, so no distance to it (null)."""
    rows, _ = run_with_faults(tmp_path, "run", {0: "raise@2-2", 1: "raise@2-2"}, clients=2,
                              num_server_rounds=3)
    assert rows[2]["skipped"] == 1 and rows[2]["flatness_distance"] is None
    assert rows[1]["flatness_distance"] > 0 and rows[3]["flatness_distance"] > 0


def test_flatness_every_is_checked_and_a_resume_may_change_it(tmp_path, capsys):
    with pytest.raises(ConfigError, match="flatness-every must be >= 0"):
        RunConfig.from_mapping({"flatness-every": -1})
    for key in ("flatness-rho", "flatness-iters", "flatness-probes"):
        with pytest.raises(ConfigError, match=key):
            RunConfig.from_mapping({key: 0})
    args = ["--clients", "2", "--dataset", "digits", "--no-tensorboard", "--set", "local-epochs=1"]
    run_dir = tmp_path / "r"
    assert cli(["simulate", "--engine", "inprocess", *args, "--rounds", "1", "--run-dir", str(run_dir)]) == 0
    assert cli(["simulate", "--engine", "inprocess", "--clients", "2", "--rounds", "2",
                "--flatness-every", "1", "--resume", str(run_dir)]) == 0
    rows = metrics(run_dir)
    assert "sharpness" not in rows[1] and rows[2]["sharpness"] is not None
    capsys.readouterr()


def test_runs_csv_holds_one_row_per_run_with_the_final_models_flatness(fedsam_run, tmp_path, capsys):
    """report --runs-csv: a study's row per run; sharpness and the top eigenvalue come from
    the run's flatness.json (`flatflower flatness RUN --split train --json RUN/flatness.json`)."""
    import csv
    import shutil

    cfg, _, rows = fedsam_run
    run = shutil.copytree(cfg.run_dir, tmp_path / "fedsam-s0")
    assert cli(["flatness", str(run), "--split", "train", "--iters", "3", "--probes", "2",
                "--json", str(run / "flatness.json")]) == 0
    assert cli(["report", str(run), "--out", str(tmp_path / "r.png"), "--runs-csv", str(tmp_path / "runs.csv"),
                "--last-k", "2", "--target", "0.3"]) == 0
    capsys.readouterr()
    (row,) = list(csv.DictReader((tmp_path / "runs.csv").open()))
    saved = json.loads((run / "flatness.json").read_text())
    assert (row["algorithm"], row["seed"], row["engine"], row["run"]) == ("fedsam", "0", "inprocess", "fedsam-s0")
    assert float(row["final_accuracy"]) == rows[-1]["test_accuracy"]
    assert int(row["best_round"]) == max(range(4), key=lambda r: rows[r]["test_accuracy"])
    assert int(row["bytes_up"]) == sum(r["bytes_up"] for r in rows[1:])
    assert float(row["flatness_distance"]) == pytest.approx((rows[2]["flatness_distance"] + rows[3]["flatness_distance"]) / 2)
    assert float(row["sharpness"]) == saved["sharpness"] and row["flatness_split"] == "train"
    assert float(row["hessian_max_eig"]) == saved["hessian_max_eig"]
