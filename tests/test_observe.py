"""Watching a run: clients.jsonl (per-client metrics), TensorBoard event files, progress.json
inside a round and the CLI's progress display. In-process runs only; file contents, no timings."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from flwr.app import MessageType

from flatflower.server import progress as progress_module
from flatflower.server.progress import RoundProgress, read_progress, write_progress
from tests.helpers import fast_config, metrics, run_with_faults
from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.tools.progress import Progress, round_line

CLIENT_FIELDS = {"round", "partition", "status", "reason", "node", "examples", "steps", "weight",
                 "train_loss", "update_norm", "cosine_to_mean", "loss_before", "loss_after",
                 "accuracy_before", "accuracy_after", "heldout_accuracy_before",
                 "heldout_accuracy_after"}


def clients(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "clients.jsonl").read_text().splitlines()]


def flat(state: dict) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for v in state.values()])


# ---------------------------------------------------------------- clients.jsonl
def test_clients_jsonl_holds_the_servers_numbers(tmp_path):
    """Every field on every line; norms and cosines are the server's own: for FedAvg (server
    lr 1) the model moves by the weighted mean update m, so sum_i p_i |d_i| cos(d_i, m) = |m|."""
    run_dir, _ = run_inprocess(fast_config(algorithm="fedavg", num_server_rounds=1, local_steps=3,
                                           run_dir=str(tmp_path / "r")), 3)
    rows = clients(run_dir)
    sizes = {int(k): len(v) for k, v in json.loads((run_dir / "partition.json").read_text())["partitions"].items()}
    assert [r["partition"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert set(row) == CLIENT_FIELDS
        assert row["status"] == "accepted" and row["reason"] is None and row["round"] == 1
        assert row["examples"] == sizes[row["partition"]] and row["steps"] == 3
        assert -1 <= row["cosine_to_mean"] <= 1 and row["update_norm"] > 0
        assert 0 <= row["accuracy_before"] <= 1 and 0 <= row["accuracy_after"] <= 1
        assert row["loss_after"] < row["loss_before"]  # three steps of SGD on its own data
        assert row["heldout_accuracy_before"] is None  # synthetic has no per-client held-out data
    moved = flat(torch.load(run_dir / "model_final.pt")) - flat(torch.load(run_dir / "model_init.pt"))
    projected = sum(r["weight"] * r["update_norm"] * r["cosine_to_mean"] for r in rows)
    assert math.isclose(projected, float(moved.norm()), rel_tol=1e-5)
    assert math.isclose(sum(r["weight"] for r in rows), 1.0)


@pytest.mark.parametrize("size", [1.0, 1e200])
def test_client_rows_norms_and_cosines_are_each_updates_own(size):
    """update_norm = ||w_i - w|| and cosine_to_mean = cos(w_i - w, sum_j p_j (w_j - w)), each
    update's own, over its floating entries (an int buffer is left out); float64 updates
    near its limit (entries of 1e200: squares overflow) still give finite norms and cosines."""
    from collections import OrderedDict

    from flatflower.server.clients import client_rows
    from flatflower.strategies.strategy import RoundRecord, RoundStats
    from flatflower.strategies.validation import ClientUpdate

    start = OrderedDict(w=torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64) * size,
                        b=torch.tensor([0.5, -0.5], dtype=torch.float64) * size, n=torch.tensor(7))
    moves = {4: [1.0, 0.0, 0.0, 0.0, 2.0, 0.0], 2: [0.0, 3.0, 0.0, 4.0, 0.0, 0.0], 9: [-1.0, -1.0, 1.0, 1.0, 0.0, 1.0]}
    updates = []
    for pid, move in moves.items():
        delta = torch.tensor(move, dtype=torch.float64) * size
        model = OrderedDict(w=start["w"] + delta[:4].view(2, 2), b=start["b"] + delta[4:], n=torch.tensor(99))
        updates.append(ClientUpdate(node_id=100 + pid, partition_id=pid, num_examples=10, num_steps=1,
                                    train_loss=0.5, model=model))
    weights = [0.5, 0.25, 0.25]
    record = RoundRecord(RoundStats(sampled_partitions=list(moves)), start, updates, weights, {},
                         {p: 10 for p in moves}, {p: 1 for p in moves})
    rows = {r["partition"]: r for r in client_rows(record, 3)}
    mean = [sum(w * m[k] for w, m in zip(weights, moves.values())) for k in range(6)]
    for (pid, move), weight in zip(moves.items(), weights):
        norm = math.sqrt(sum(v * v for v in move))
        cosine = sum(a * b for a, b in zip(move, mean)) / (norm * math.sqrt(sum(v * v for v in mean)))
        row = rows[pid]
        assert row["status"] == "accepted" and row["node"] == 100 + pid and row["weight"] == weight
        assert row["update_norm"] == pytest.approx(size * norm, rel=1e-12)
        assert row["cosine_to_mean"] == pytest.approx(cosine, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("stacked", [1 << 22, 1000, 1])
def test_client_rows_deltas_equal_each_model_flattened_on_its_own(stacked, monkeypatch):
    """The round's update matrix is built a tensor at a time over blocks of clients: row i is
    client i's floating entries, flattened in the model's order and cast to float64, minus
    the start's, bit for bit (float16, float32 and float64 tensors; an int buffer left out;
    all clients in one block, a few, one at a time)."""
    from collections import OrderedDict

    import flatflower.common.tensors as tensors
    from flatflower.server.clients import _deltas

    monkeypatch.setattr(tensors, "STACKED_ENTRIES", stacked)

    torch.manual_seed(0)
    start = OrderedDict(w=torch.randn(40, 30), n=torch.tensor(3), h=torch.randn(7).half(),
                        d=torch.randn(5, 2, dtype=torch.float64))
    models = [OrderedDict((k, v + 1 if k == "n" else (v + 0.01 * torch.randn_like(v.float())).to(v.dtype))
                          for k, v in start.items()) for _ in range(5)]

    def flat(tensors):
        return torch.cat([t.reshape(-1).double() for t in tensors.values() if t.is_floating_point()])

    assert torch.equal(_deltas(start, models), torch.stack([flat(m) - flat(start) for m in models]))


def test_clients_jsonl_says_who_was_refused_and_who_failed(tmp_path):
    run_with_faults(tmp_path, "faults", faults={1: "nan", 2: "raise"}, clients=3, num_server_rounds=1)
    rows = {r["partition"]: r for r in clients(tmp_path / "faults")}
    assert rows[0]["status"] == "accepted" and rows[0]["cosine_to_mean"] == pytest.approx(1.0)
    assert rows[1]["status"] == "rejected" and "NaN" in rows[1]["reason"]
    assert rows[2]["status"] == "failed" and "injected fault: raise" in rows[2]["reason"]
    for pid in (1, 2):
        assert rows[pid]["update_norm"] is None and rows[pid]["loss_before"] is None
        assert rows[pid]["examples"] > 0  # the server's own figure, whatever the client did


def test_held_out_accuracy_where_clients_have_their_own_test_data(tmp_path):
    run_dir, _ = run_inprocess(fast_config(dataset="synthetic-fedprox", partition="natural",
                                           num_server_rounds=1, run_dir=str(tmp_path / "r")), 3)
    for row in clients(run_dir):
        assert 0 <= row["heldout_accuracy_before"] <= 1 and 0 <= row["heldout_accuracy_after"] <= 1


def test_client_eval_off_reports_nothing_about_itself(tmp_path):
    run_dir, _ = run_inprocess(fast_config(num_server_rounds=1, client_eval=False,
                                           run_dir=str(tmp_path / "r")), 2)
    for row in clients(run_dir):
        assert row["loss_before"] is None and row["accuracy_after"] is None
        assert row["update_norm"] > 0  # the server's own numbers stay


# ---------------------------------------------------------------- TensorBoard
def test_tensorboard_event_files_hold_every_metric_and_the_clients(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = run_inprocess(fast_config(run_dir=str(tmp_path / "r")), 3)
    board = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0})
    board.Reload()
    tags = board.Tags()
    rows = metrics(run_dir)
    numeric = {k for row in rows[1:] for k, v in row.items()
               if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    from flatflower.common.flatness import ROUND_FIELDS

    assert {f"{'flatness' if k in ROUND_FIELDS else 'metrics'}/{k}" for k in numeric} <= set(tags["scalars"])
    accuracy = board.Scalars("metrics/test_accuracy")
    assert [e.step for e in accuracy] == [0, 1, 2]
    assert [e.value for e in accuracy] == pytest.approx([r["test_accuracy"] for r in rows])
    assert {"clients/update_norm", "clients/cosine_to_mean", "clients/loss_before"} <= set(tags["histograms"])
    norms = board.Histograms("clients/update_norm")
    assert [h.step for h in norms] == [1, 2] and norms[0].histogram_value.num == 3
    assert {"drift/cosine_mean", "drift/norm_spread"} <= set(tags["scalars"])


def test_tensorboard_off_writes_no_event_files(tmp_path):
    run_dir, _ = run_inprocess(fast_config(tensorboard=False, run_dir=str(tmp_path / "r")), 2)
    assert not list(run_dir.glob("events.out.tfevents.*"))


# ---------------------------------------------------------------- progress inside a round
def _message(kind: str, group: str = "", reply_to: str = ""):
    return SimpleNamespace(metadata=SimpleNamespace(message_type=kind, group_id=group,
                                                    reply_to_message_id=reply_to))


class FakeGrid:
    def __init__(self):
        self.replies = []

    def push_messages(self, messages):
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        out, self.replies = self.replies, []
        return out


def test_round_progress_counts_the_train_replies_as_the_grid_pulls_them(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_module, "REWRITE", 0.0)  # every pull writes
    grid = FakeGrid()
    RoundProgress(grid, tmp_path, rounds=5)
    grid.push_messages([_message(MessageType.EVALUATE)])  # federated evaluation is not watched
    assert read_progress(tmp_path) is None
    grid.push_messages([_message(MessageType.TRAIN, "3") for _ in range(4)])
    assert read_progress(tmp_path)["round"] == 3 and read_progress(tmp_path)["replied"] == 0
    grid.replies = [_message("", reply_to="m0"), _message("", reply_to="m2"), _message("", reply_to="x")]
    assert len(grid.pull_messages(["m0", "m1", "m2", "m3"])) == 3
    state = read_progress(tmp_path)
    assert (state["round"], state["rounds"], state["sampled"], state["replied"]) == (3, 5, 4, 2)


def test_progress_is_rewritten_for_replies_at_most_every_rewrite_seconds_but_always_for_the_last(
        tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress_module, "clock", lambda: clock[0])
    grid = FakeGrid()
    RoundProgress(grid, tmp_path, rounds=5)
    grid.push_messages([_message(MessageType.TRAIN, "1") for _ in range(3)])  # a new stage: written
    for reply, replied in (("m0", 0), ("m1", 0)):  # within REWRITE of the last write: not written
        clock[0] += progress_module.REWRITE / 4
        grid.replies = [_message("", reply_to=reply)]
        grid.pull_messages(["m0", "m1", "m2"])
        assert read_progress(tmp_path)["replied"] == replied
    grid.replies = [_message("", reply_to="m2")]  # the last reply is always written
    grid.pull_messages(["m2"])
    assert read_progress(tmp_path)["replied"] == 3
    grid.push_messages([_message(MessageType.TRAIN, "2") for _ in range(3)])
    clock[0] += progress_module.REWRITE  # REWRITE after the last write: written
    grid.replies = [_message("", reply_to="m0")]
    grid.pull_messages(["m0", "m1", "m2"])
    assert (read_progress(tmp_path)["round"], read_progress(tmp_path)["replied"]) == (2, 1)


def test_a_run_leaves_its_last_rounds_progress(tmp_path):
    run_dir, _ = run_inprocess(fast_config(num_server_rounds=2, run_dir=str(tmp_path / "r")), 3)
    state = read_progress(run_dir)
    assert (state["round"], state["rounds"], state["sampled"], state["replied"]) == (2, 2, 3, 3)


ROW = {"round": 1, "test_accuracy": 0.5, "test_loss": 1.25, "clients_replied": 4,
       "clients_rejected": 1, "clients_sampled": 5, "seconds": 2.0}


def _write_rows(run_dir: Path, rows: list[dict]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plain_progress_lines_with_eta_and_the_round_in_progress(tmp_path):
    import time

    _write_rows(tmp_path, [{"round": 0, "test_accuracy": 0.1, "test_loss": 2.3}, ROW])
    write_progress(tmp_path, {"round": 2, "rounds": 4, "stage": "train", "sampled": 5,
                              "replied": 3, "started": time.time() - 30})
    out = io.StringIO()
    Progress(tmp_path, 4, live=False, out=out, every=10)()
    lines = out.getvalue().splitlines()
    assert lines[0] == "round   0/4  test accuracy  10.00%  loss 2.3000"
    assert lines[1] == "round   1/4  test accuracy  50.00%  loss 1.2500  clients 3/5  2.0s  ETA 6s"
    assert lines[2].startswith("round   2/4  in progress: 3/5 clients replied  30s")
    assert round_line({**ROW, "round": 4}, 4, 1.0).endswith("2.0s")  # no ETA after the last round


def test_a_short_round_prints_no_in_progress_line(tmp_path):
    import time

    _write_rows(tmp_path, [{"round": 0, "test_accuracy": 0.1, "test_loss": 2.3}])
    write_progress(tmp_path, {"round": 1, "rounds": 4, "stage": "train", "sampled": 5,
                              "replied": 1, "started": time.time()})
    out = io.StringIO()
    Progress(tmp_path, 4, live=False, out=out, every=10)()
    assert "in progress" not in out.getvalue()


def test_live_display_shows_rounds_and_clients(tmp_path):
    import time

    _write_rows(tmp_path, [{"round": 0, "test_accuracy": 0.1, "test_loss": 2.3}, ROW])
    write_progress(tmp_path, {"round": 2, "rounds": 4, "stage": "train", "sampled": 5,
                              "replied": 3, "started": time.time()})
    out = io.StringIO()
    progress = Progress(tmp_path, 4, live=True, out=out)
    progress()
    progress.close()
    text = out.getvalue()
    assert "rounds" in text and "1/4" in text and "test accuracy 50.00%" in text and "ETA 6s" in text
    assert "round 2" in text and "3/5" in text and "clients replied" in text


def test_tensorboard_flag_sets_the_run_config(tmp_path):
    from flatflower.tools.cli import build_parser
    from flatflower.tools.prepare import resolve_config

    def cfg(*flags):
        args = build_parser().parse_args(["simulate", *flags, "--run-dir", str(tmp_path / "r")])
        return resolve_config(args)

    assert cfg().tensorboard is True
    assert cfg("--no-tensorboard").tensorboard is False
    assert cfg("--set", "tensorboard=false", "--tensorboard").tensorboard is True  # the flag wins


def test_the_handshake_before_a_round_is_progress_too(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_module, "REWRITE", 0.0)  # every pull writes
    grid = FakeGrid()
    RoundProgress(grid, tmp_path, rounds=5)
    grid.push_messages([_message(MessageType.QUERY) for _ in range(3)])
    grid.replies = [_message("", reply_to="m1")]
    grid.pull_messages(["m0", "m1", "m2"])
    state = read_progress(tmp_path)
    assert (state["round"], state["stage"], state["sampled"], state["replied"]) == (1, "handshake", 3, 1)
    out = io.StringIO()
    _write_rows(tmp_path, [{"round": 0, "test_accuracy": 0.1, "test_loss": 2.3}])
    write_progress(tmp_path, {**state, "started": state["started"] - 20})
    Progress(tmp_path, 5, live=False, out=out, every=10)()
    assert "round   1/5  in progress: 1/3 nodes answered the partition handshake  20s" in out.getvalue()


def test_a_resumed_run_redoes_the_clients_rows_past_its_checkpoint(tmp_path):
    config = fast_config(num_server_rounds=2, run_dir=str(tmp_path / "r"))
    run_dir, _ = run_inprocess(config, 2)
    with (run_dir / "clients.jsonl").open("a") as f:  # a row the killed run wrote past its checkpoint
        f.write(json.dumps({"round": 3, "partition": 0, "status": "stale"}) + "\n")
    run_inprocess({**config, "num-server-rounds": 3, "resume": True}, 2)
    rows = clients(run_dir)
    assert [r["round"] for r in rows] == [1, 1, 2, 2, 3, 3]
    assert all(r["status"] == "accepted" for r in rows)
