"""Fuzzing the server with malformed replies, for every algorithm.

One client of three answers every handshake (half of them), train and evaluate message with
a randomly malformed reply (tests/malicious.py, ``fuzz``): arrays whose data is not what the
header says, garbage bytes, wrong dtypes and shapes, NaN/Inf, missing and extra keys and
records, metrics of the wrong type, out of range or missing, stale nonces. Over 20 algorithms
that is more than 500 malformed replies. The server must never crash, refuse every one of
them with a reason, and end with the model of the run in which that client is offline.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fast_config

import malicious
from client.app import app as client_app
from common.config import RunConfig
from common.registry import ALGORITHMS
from tools.inprocess import InProcessGrid
from server.run import run_server
from test_integration import metrics

ROUNDS = 14
FUZZER = 2  # node 1002


def one_run(tmp_path, name: str, algorithm: str, app, offline=()) -> tuple[list[dict], dict]:
    cfg = RunConfig.from_mapping(fast_config(
        algorithm=algorithm, run_dir=str(tmp_path / name), num_partitions=3,
        num_server_rounds=ROUNDS, fraction_evaluate=1.0, checkpoint_every=0))
    grid = InProcessGrid(app, 3, cfg.to_dict())
    grid.offline = {1000 + p for p in offline}
    run_server(grid, cfg)
    return metrics(tmp_path / name), torch.load(tmp_path / name / "model_final.pt")


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_malformed_replies_never_crash_the_server_and_are_each_refused(tmp_path, algorithm):
    malicious.SENT.clear()
    app = malicious.malicious_app({FUZZER: f"fuzz:{sorted(ALGORITHMS).index(algorithm)}"})
    rows, fuzzed = one_run(tmp_path, "fuzzed", algorithm, app)
    sent = [s for s in malicious.SENT if s["node"] == 1000 + FUZZER]
    refused = [r for row in rows for r in row.get("rejections", []) if r["node"] == 1000 + FUZZER]
    assert len(sent) >= 25, f"only {len(sent)} malformed replies"  # >= 500 over the 20 algorithms
    print(f"{algorithm}: {len(sent)} malformed replies refused")
    assert {s["stage"] for s in sent} == {"query", "train", "evaluate"}
    assert sorted(r["stage"] for r in refused) == sorted(
        {"query": "handshake"}.get(s["stage"], s["stage"]) for s in sent), \
        "every malformed reply is refused, and nothing else"
    assert all(r["reason"] for r in refused)
    assert not any(r for row in rows for r in row.get("rejections", []) if r["node"] != 1000 + FUZZER)
    assert all(row["skipped"] == 0 for row in rows[1:])
    assert all(torch.isfinite(v).all() for v in fuzzed.values())
    _, offline = one_run(tmp_path, "offline", algorithm, client_app, offline=[FUZZER])
    assert all(torch.equal(fuzzed[k], offline[k]) for k in fuzzed), \
        "the fuzzing client must leave no trace in the model"
