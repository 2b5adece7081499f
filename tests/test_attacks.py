"""The server trusts nothing a client says (docs/reliability.md, "The principle").

Each case of issue 13 is an attack by one client (tests/malicious.py): over the in-process
grid, the attacker's replies are refused with a reason and the final model is that of a run in
which the attacker simply fails; handshake lies leave the other nodes untouched. A fuzz test
sends at least 25 randomly malformed replies to each algorithm of the registry; one real loopback
deployment shows the same over Flower's transport."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flatflower.client.app import app as client_app
from flatflower.common.config import RunConfig
from flatflower.strategies.registry import ALGORITHMS
from flatflower.server.run import run_server
from tests import malicious
from flatflower.runtime.engines.inprocess import InProcessGrid
from tests.helpers import DEPLOYED, ROOT, deployed, fast_config, flower_pids, metrics, run_with_faults, same


# ---------------------------------------------------------------- one client's lies, in-process
ATTACKER = 3  # of partitions 0..3


CONFIG = {"algorithm": "scaffold", "num_server_rounds": 3}  # SCAFFOLD: an upload record too


def attacked(tmp_path, name, attacks: dict[int, str], clients: int = 4, **overrides):
    """An in-process run in which partition p behaves as ``attacks[p]`` (tests/malicious.py)."""
    return run_with_faults(tmp_path, name, client=malicious.malicious_app(attacks), clients=clients,
               **{**CONFIG, "fraction_evaluate": 1.0, **overrides})


def refusals(rows: list[dict], stage: str, partition: int | None = None) -> list[dict]:
    return [r for row in rows for r in row.get("rejections", [])
            if r["stage"] == stage and (partition is None or r["partition"] == partition)]


@pytest.fixture(scope="module")
def without_attacker(tmp_path_factory):
    """The model of the same run in which the attacker's training fails every round."""
    return run_with_faults(tmp_path_factory.mktemp("ref"), "fails", {ATTACKER: "raise"}, clients=4,
               **{**CONFIG, "fraction_evaluate": 1.0})[1]


TRAIN_ATTACKS = {  # attack -> what the refusal says
    "data-lie": "is float32[1], expected float32[10, 20]",
    "shape-lie": "is float32[3, 3], expected float32[10, 20]",
    "complex-nan": "is complex128[10, 20], expected float32[10, 20]",
    "not-numpy": "unreadable: ValueError",
    "oversized": "holds 4000128 bytes, more than float32[10, 20] needs",
    "num-examples-list": "'num-examples'=[10, 20] is not a whole number",
    "num-examples-huge": "'num-examples'=1.797e+308 is not a whole number",
    "weight-inflation": "reply claims 1000000000 examples, partition 3 has",
    "steps-inflation": "reply claims 1000000 local steps, the round asks for 2",
    # numbers beyond meaning (finite, >= 0: they passed before)
    "train-loss:1e300": "metric 'train-loss'=1e+300 is out of range [0, 1e+06]",
    "loss-before:1e300": "metric 'loss-before'=1e+300 is out of range [0, 1e+06]",
    # records and keys beyond the protocol, of any type
    "train-extra-config": "unexpected config records ['surprise']",
    "train-extra-metrics": "unexpected metric records ['surprise']",
    "train-extra-arrays": "array records ['arrays', 'control_delta', 'surprise'] do not match",
    "train-extra-key": "metrics hold unexpected keys ['junk']",
}


@pytest.mark.parametrize("attack", sorted(TRAIN_ATTACKS))
def test_a_train_reply_that_lies_is_refused_and_the_model_is_that_of_a_run_without_it(
        tmp_path, attack, without_attacker):
    rows, final = attacked(tmp_path, attack, {ATTACKER: attack})
    for row in rows[1:]:
        (refusal,) = refusals([row], "train")
        assert refusal["partition"] == ATTACKER and TRAIN_ATTACKS[attack] in refusal["reason"]
        assert row["rejected_partitions"] == [ATTACKER] and row["skipped"] == 0
    assert all(torch.isfinite(v).all() for v in final.values())
    assert same(final, without_attacker)


def test_two_clients_claiming_overflowing_sizes_cannot_crash_the_round(tmp_path):
    """num-examples 1.797e308 from two clients used to overflow the weight sum."""
    rows, final = attacked(tmp_path, "two", {2: "num-examples-huge", 3: "num-examples-huge"})
    assert all(r["rejected_partitions"] == [2, 3] and r["skipped"] == 0 for r in rows[1:])
    assert all(torch.isfinite(v).all() for v in final.values())


def test_a_replayed_reply_is_refused_from_the_round_after(tmp_path):
    rows, _ = attacked(tmp_path, "replay", {ATTACKER: "replay"})
    assert rows[1]["rejected_partitions"] == []  # its first reply is its real one
    for row in rows[2:]:
        (refusal,) = refusals([row], "train", ATTACKER)
        assert "does not echo this message's nonce" in refusal["reason"]


HANDSHAKE_ATTACKS = {
    "no-metrics": "reply has no 'metrics' record",
    "list-partition": "'partition-id'=[0, 1] is not a whole number",
    "one-partition": "node is configured for num-partitions=1, the run has 4",
    "huge-partition": "'partition-id'=1000000 is out of range [0, 3]",
    "steal:0": "claims partition 0, which node 1000 holds",
    "query-extra-config": "unexpected config records ['surprise']",
    "query-extra-metrics": "unexpected metric records ['surprise']",
    "query-extra-arrays": "unexpected array records ['surprise']",
    "query-extra-key": "metrics hold unexpected keys ['junk']",
    "query-long-device": "config record 'node' holds other than texts of at most 100 characters",
}


def offline_run(tmp: Path, clients: int = 4, **overrides) -> dict:
    """The final model of the same run with the attacker's node offline from the start."""
    cfg = RunConfig.from_mapping(fast_config(run_dir=str(tmp / "r"), num_partitions=clients,
                                             **{**CONFIG, "fraction_evaluate": 1.0, **overrides}))
    grid = InProcessGrid(client_app, clients, cfg.to_dict())
    grid.offline = {1000 + ATTACKER}
    run_server(grid, cfg)
    return torch.load(tmp / "r" / "model_final.pt")


@pytest.fixture(scope="module")
def attacker_offline(tmp_path_factory):
    return offline_run(tmp_path_factory.mktemp("offline"))


@pytest.mark.parametrize("attack", sorted(HANDSHAKE_ATTACKS))
def test_a_handshake_lie_shuts_out_only_the_liar(tmp_path, attack, attacker_offline):
    """N comes from the run config and each partition from a checked claim: the liar is
    refused (asked again each round), the other nodes train as if it were not there."""
    rows, final = attacked(tmp_path, attack.replace(":", "-"), {ATTACKER: attack})
    for row in rows[1:]:
        assert row["sampled_partitions"] == [0, 1, 2]
        assert row["rejected_partitions"] == [] and row["skipped"] == 0
        found = refusals([row], "handshake")
        assert found and all(HANDSHAKE_ATTACKS[attack] in r["reason"] for r in found)
        assert all(r["node"] == 1000 + ATTACKER for r in found)
    assert same(final, attacker_offline)


def test_a_handshake_size_that_differs_from_the_servers_is_refused(tmp_path, attacker_offline):
    """The server computes every partition's size; a node whose data differs is left out."""
    def shrink(reply, msg, context, x):
        return malicious.with_metric(reply, "num-examples", 7)

    malicious.ATTACKS["shrink"] = ("query", shrink)
    try:
        rows, final = attacked(tmp_path, "shrink", {ATTACKER: "shrink"})
    finally:
        del malicious.ATTACKS["shrink"]
    assert all("declares 7 examples, partition 3 has" in r["reason"]
               for r in refusals(rows, "handshake"))
    assert same(final, attacker_offline)


# ---------------------------------------------------------------- an honest model with a poisoned upload
UPLOADS = {"scaffold": "control_delta", "fedgamma": "control_delta", "fedsmoo": "perturbation_correction"}


@pytest.mark.parametrize("algorithm", sorted(UPLOADS))
def test_the_outlier_rule_measures_every_upload_not_only_the_model(tmp_path, algorithm):
    """Issue 23: an honest model with Δc (SCAFFOLD, FedGAMMA) or s̃ (FedSMOO) = 1e30, under the
    mean and outlier-norm-factor 5, used to pass (the rule measured ||w_i - w|| only) and sent
    the server's c to 7e29. Each upload is measured against its own round median: the client
    is refused every round, naming the record, and the run is the one without it."""
    config = {"algorithm": algorithm, "outlier_norm_factor": 5.0}
    rows, final = attacked(tmp_path, "poisoned", {ATTACKER: "records:1e30"}, **config)
    for row in rows[1:]:
        (refusal,) = refusals([row], "train")
        assert refusal["partition"] == ATTACKER and row["skipped"] == 0
        assert refusal["reason"].startswith(f"{UPLOADS[algorithm]} norm 1.449e+31 > 5 x round median ")
    assert same(final, offline_run(tmp_path / "offline", **config))


@pytest.mark.parametrize("rule", ["median", "trimmed-mean", "krum", "multi-krum", "bulyan",
                                  "norm-clip", "centered-clip"])
def test_every_robust_rule_keeps_a_poisoned_upload_out_of_the_server_state(tmp_path, rule):
    """The same attacker (one of 7, SCAFFOLD) under each robust rule, without the outlier
    rule: the server's control variate c stays within the range the clean run's c spans
    (the mean puts it at ~1e29)."""
    def control(rows_and_dir) -> torch.Tensor:
        state = torch.load(tmp_path / rows_and_dir / "checkpoint.pt")["strategy"]["records"]
        return torch.cat([v.reshape(-1) for v in state["control_variate"].values()])

    attacked(tmp_path, "clean", {}, clients=7, aggregator=rule)
    attacked(tmp_path, "poisoned", {ATTACKER: "records:1e30"}, clients=7, aggregator=rule)
    clean, poisoned = control("clean"), control("poisoned")
    assert bool(torch.isfinite(poisoned).all())
    assert float(poisoned.abs().max()) <= 2 * float(clean.abs().max())


# ---------------------------------------------------------------- colluding attackers (ALIE, IPM)
def test_alie_and_ipm_on_hand_computed_numbers():
    honest = torch.tensor([[0.0, 1.0], [2.0, 1.0], [4.0, 1.0]], dtype=torch.float64)  # mean (2, 1), std (2, 0)
    z = 0.2533471031357997  # Φ^-1(0.6): n = 10, f = 2, s = floor(10/2 + 1) - 2 = 4, (10 - 4) / 10
    assert malicious.alie(honest, 10, 2, None).tolist() == pytest.approx([2 - 2 * z, 1.0])
    assert malicious.alie(honest, 10, 2, 1.5).tolist() == pytest.approx([-1.0, 1.0])
    assert malicious.ipm(honest, 10, 2, 4.0).tolist() == pytest.approx([-8.0, -4.0])


def colluded(tmp_path, name: str, attack: str, clients: int = 7, **overrides):
    """An in-process FedAvg run (uniform weights) on which partitions 0 and 1 collude."""
    cfg = RunConfig.from_mapping(fast_config(
        run_dir=str(tmp_path / name), num_partitions=clients, algorithm="fedavg",
        aggregation="uniform", num_server_rounds=3, **overrides))
    grid = malicious.colluding_grid(client_app, clients, cfg.to_dict(), attack, [0, 1]) if attack \
        else InProcessGrid(client_app, clients, cfg.to_dict())
    run_server(grid, cfg)
    return metrics(tmp_path / name), torch.load(tmp_path / name / "model_final.pt")


def distance(a, b) -> float:
    return float(sum(((a[k] - b[k]).double() ** 2).sum() for k in a) ** 0.5)


def test_ipm_cancels_the_mean_through_the_outlier_rule_and_a_robust_rule_holds(tmp_path):
    """Issue 23: 2 colluding clients of 7 send -2.5 x the 5 honest clients' mean: the uniform
    mean of the round is 0, so the model never moves, and the attackers' norm (2.5 x the mean's)
    passes outlier-norm-factor 5. Multi-Krum (f = 2) drops them and learns as the clean run."""
    _, clean = colluded(tmp_path, "clean", "")
    initial = torch.load(tmp_path / "clean" / "model_init.pt")
    rows, stuck = colluded(tmp_path, "ipm", "ipm:2.5", outlier_norm_factor=5.0)
    assert not refusals(rows, "train")
    assert distance(stuck, initial) < 1e-4 * distance(clean, initial)
    _, held = colluded(tmp_path, "krum", "ipm:2.5", aggregator="multi-krum", aggregator_f=2)
    _, held_clean = colluded(tmp_path, "krum-clean", "", aggregator="multi-krum", aggregator_f=2)
    assert distance(held, held_clean) < 0.2 * distance(held_clean, initial)


EVALUATE_ATTACKS = {
    "accuracy-1000": "'eval-accuracy'=1000.0 is out of range",
    "eval-loss:1e300": "'eval-loss'=1e+300 is out of range [0, 1e+06]",
    "evaluate-extra-config": "unexpected config records ['surprise']",
    "evaluate-extra-metrics": "unexpected metric records ['surprise']",
    "evaluate-extra-arrays": "unexpected array records ['surprise']",
    "evaluate-extra-key": "metrics hold unexpected keys ['junk']",
}


@pytest.fixture(scope="module")
def clean_evaluation(tmp_path_factory):
    return attacked(tmp_path_factory.mktemp("clean"), "clean", {})[0]


@pytest.mark.parametrize("attack", sorted(EVALUATE_ATTACKS))
def test_an_impossible_evaluation_is_refused(tmp_path, attack, clean_evaluation):
    rows, _ = attacked(tmp_path, "eval", {ATTACKER: attack})
    for row, ref in zip(rows[1:], clean_evaluation[1:]):
        (refusal,) = refusals([row], "evaluate")
        assert refusal["partition"] == ATTACKER and EVALUATE_ATTACKS[attack] in refusal["reason"]
        assert 0.0 <= row["federated_accuracy"] <= 1.0 and ref["federated_accuracy"] <= 1.0
        assert row["federated_loss"] < 1e6


# ---------------------------------------------------------------- fuzzing: malformed replies for every algorithm
ROUNDS = 14


FUZZER = 2  # node 1002


def one_run(tmp_path, name: str, algorithm: str, app, offline=()) -> tuple[list[dict], dict]:
    cfg = RunConfig.from_mapping(fast_config(
        **ALGORITHMS[algorithm].example_config(), run_dir=str(tmp_path / name), num_partitions=3,
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
    assert len(sent) >= 25, f"only {len(sent)} malformed replies"  # for each algorithm of the registry
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


# ---------------------------------------------------------------- over Flower's transport
def malicious_app_dir(tmp_path: Path) -> Path:
    """A copy of this Flower App whose ClientApp is tests/malicious.py (for its SuperNodes)."""
    app = tmp_path / "app"
    for package in ("flatflower", "client", "common", "server", "strategies", "runtime", "tools"):
        shutil.copytree(ROOT / package, app / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "tests" / "malicious.py", app / "malicious.py")
    toml = (ROOT / "pyproject.toml").read_text()
    assert 'clientapp = "flatflower.client.app:app"' in toml and 'fab-include = ["flatflower/**/*.py",' in toml
    (app / "pyproject.toml").write_text(
        toml.replace('clientapp = "flatflower.client.app:app"', 'clientapp = "malicious:app"')
        .replace('fab-include = ["flatflower/**/*.py",', 'fab-include = ["malicious.py", "flatflower/**/*.py",'))
    shutil.copy(ROOT / "README.md", app / "README.md")
    return app


@pytest.mark.integration
@pytest.mark.slow
def test_a_deployed_attacker_is_refused_over_the_real_transport(tmp_path):
    """3 SuperNodes on loopback; node 2 sends the header-lie array, replays, and reports an
    impossible accuracy. Every lie is refused with its reason, and the final model is that of
    the in-process run of the same attack."""
    before = flower_pids()
    config = {**DEPLOYED, "algorithm": "fedsam", "num-server-rounds": 2, "fraction-evaluate": 1.0}
    attack = "data-lie+accuracy-1000"
    _, run_dir = deployed(tmp_path, "dep", config, 3, node_configs={2: {"attack": attack}},
                           app=malicious_app_dir(tmp_path))
    assert flower_pids() - before == set(), "Flower processes left behind"
    rows = metrics(run_dir)
    for row in rows[1:]:
        assert [r["partition"] for r in refusals([row], "train")] == [2]
        assert [r["partition"] for r in refusals([row], "evaluate")] == [2]
        assert "expected float32" in refusals([row], "train")[0]["reason"]
    _, inproc = run_with_faults(tmp_path, "inp", client=malicious.malicious_app({2: attack}), clients=3,
                    **{k.replace("-", "_"): v for k, v in config.items()})
    assert same(torch.load(run_dir / "model_final.pt"), inproc)


@pytest.mark.integration
@pytest.mark.slow
def test_numbers_and_records_beyond_the_protocol_are_refused_over_the_real_transport(tmp_path):
    """Node 2 reports loss-before = 1e300 (without client-eval no one else reports it: alone in
    its TensorBoard histogram it ended the run) and adds a MetricRecord to its evaluation
    replies. Both are refused with their reasons; the run completes, TensorBoard on."""
    config = {**DEPLOYED, "algorithm": "fedavg", "num-server-rounds": 2, "fraction-evaluate": 1.0,
              "client-eval": False, "tensorboard": True}
    _, run_dir = deployed(tmp_path, "dep", config, 3, app=malicious_app_dir(tmp_path),
                          node_configs={2: {"attack": "loss-before:1e300+evaluate-extra-metrics"}})
    for row in metrics(run_dir)[1:]:
        (train,) = refusals([row], "train")
        assert train["partition"] == 2 and "'loss-before'=1e+300 is out of range" in train["reason"]
        (evaluation,) = refusals([row], "evaluate")
        assert evaluation["partition"] == 2 and "unexpected metric records ['surprise']" in evaluation["reason"]
    assert list(run_dir.glob("events.out.tfevents.*"))


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("dp", [True, False])
def test_rounds_with_no_accepted_update_are_skipped_over_the_real_transport(tmp_path, dp):
    """Issue 44: under aggregation = uniform (which DP needs) a round with no accepted update
    ended the run. Over a loopback deployment, in round 1 one client fails and the other two
    send NaN updates (refused): the round is skipped (the model does not move), round 2 runs,
    the run completes, and under DP the ledger records round 1 as releasing nothing."""
    config = {**DEPLOYED, "algorithm": "fedavg", "num-server-rounds": 2, "aggregation": "uniform",
              "fraction-train": 1.0}
    if dp:
        config.update({"dp.clip": 1.0, "dp.noise-multiplier": 1.0})
    faults = {0: "raise@1-1", 1: "nan@1-1", 2: "nan@1-1"}
    _, run_dir = deployed(tmp_path, "dep", config, 3, node_configs={p: {"inject-fault": f} for p, f in faults.items()})
    rows = metrics(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert [r["skipped"] for r in rows[1:]] == [1, 0]
    assert [r["clients_rejected"] + r["clients_failed"] for r in rows[1:]] == [3, 0]
    assert rows[1]["test_accuracy"] == rows[0]["test_accuracy"]  # round 1 left the model as it was
    if dp:
        ledger = [json.loads(line) for line in (run_dir / "privacy.jsonl").read_text().splitlines()]
        assert [e["dp_noise_multiplier"] for e in ledger] == [None, 1.0]
        assert rows[1]["dp_epsilon"] == 0.0 < rows[2]["dp_epsilon"]
