"""Task theft where TLS and SuperNode authentication are on, as across machines (issue 58,
item 6; docs/deployment.md "Who can act as a node").

* Another user of a node's machine asks the node's Runtime API for its tasks (issue 44's
  attack, tests/test_appauth.py) in a federation with TLS and node authentication: refused.
* A dishonest node answers another node's train message over the Fleet API, signing with its
  own registered key, the message's id read from the victim's log (tests/fleet_forgery.py).
  Flower 1.39's SuperLink stores it: it checks that a reply's source is the destination of the
  message it answers, not who sent it. Each message now carries a nonce of its own, which
  only its node sees: the forged reply does not echo it and is refused. The victim's own reply
  is lost (the SuperLink keeps the first reply to a message): the attacker can cost another
  node its rounds, no longer put its update in the model under that node's name
  (tests/test_strategy.py has the same attack in-process, for every commit).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import fast_config, flower_pids, metrics, round_deadline, run_with_faults, same
from tests.test_appauth import assert_every_request_refused, attack_during_a_run, needs_root
from tests.test_attacks import malicious_app_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@needs_root
def test_another_user_cannot_take_a_nodes_task_under_tls_and_node_authentication(tmp_path):
    assert_every_request_refused(*attack_during_a_run(tmp_path, seconds_budget=4 * round_deadline(), tls=True))


def forgery_app_dir(tmp_path: Path) -> Path:
    """tests/test_attacks.py's malicious App, with tests/fleet_forgery.py beside its ClientApp."""
    app = malicious_app_dir(tmp_path)
    (app / "fleet_forgery.py").write_text((Path(__file__).parent / "fleet_forgery.py").read_text())
    toml = (app / "pyproject.toml").read_text()
    (app / "pyproject.toml").write_text(toml.replace('fab-include = ["malicious.py",',
                                                     'fab-include = ["malicious.py", "fleet_forgery.py",'))
    return app


def test_a_node_cannot_answer_another_nodes_task_over_the_fleet_api(tmp_path):
    """3 nodes under TLS and node authentication; node 1's operator pushes, with node 1's key,
    a reply as node 0 (node 1's update reversed and amplified) to node 0's train message of
    each round, which node 0 answers 3 s late. The SuperLink stores it (and drops node 0's own,
    a second reply); the server refuses it (not this message's nonce): the model is that of
    the in-process run in which node 0 failed those rounds. With one nonce a round, node 1's
    reversed update went into the model as node 0's."""
    from flatflower.runtime.engines.federation import COMPLETED, LocalFederation

    before = flower_pids()
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    target, found = tmp_path / "target.json", tmp_path / "found.jsonl"
    rounds = 2
    config = {**fast_config(num_server_rounds=rounds), "algorithm": "fedavg",
              "round-timeout": round_deadline(fresh=True), "fraction-train": 1.0, "fraction-evaluate": 0.0,
              "min-available-nodes": 3, "num-partitions": 3}
    nodes = {0: {"inject-fault": "late:3"}, 1: {"attack": "answer-for:-5", "forge-target": str(target)}}
    with LocalFederation(3, tmp_path / "work", run_dir / "logs", tls=True, node_configs=nodes) as fed:
        target.write_text(json.dumps({
            "node": fed.node_ids["node-0"], "partition": 0, "log": str(run_dir / "logs" / "supernode-0.log"),
            "key": str(fed.certs.node_keys[1]), "superlink": f"{fed.dial_host}:{fed.fleet_port}",
            "ca": str(fed.certs.ca_cert), "out": str(found)}))
        run_id = fed.submit(forgery_app_dir(tmp_path), {**config, "run-dir": str(run_dir)})
        row = fed.wait(run_id, 20 * round_deadline(), poll=0.5)
        fed.save_log(run_id, run_dir / "logs" / "run.log")
    assert row["status"] == COMPLETED, row
    assert flower_pids() - before == set(), "Flower processes left behind"
    tries = [json.loads(line) for line in found.read_text().splitlines()]
    assert [(t["round"], t["stored"], t["error"]) for t in tries] == [(r, True, None) for r in range(1, rounds + 1)], \
        ("the SuperLink stores a reply as node 0 from node 1", tries)
    rows = metrics(run_dir)
    for r in rows[1:]:
        (refusal,) = r["rejections"]
        assert refusal["partition"] == 0 and "nonce" in refusal["reason"], r
        assert r["clients_replied"] == 3 and r["clients_rejected"] == 1 and r["failed_partitions"] == [], r
    _, lost = run_with_faults(tmp_path, "inp", {0: "raise"}, clients=3,
                              **{k.replace("-", "_"): v for k, v in config.items()})
    assert same(torch.load(run_dir / "model_final.pt"), lost)
