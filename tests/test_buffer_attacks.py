"""Buffers are checked like parameters (issue 58, item 2), run as the attacker would: the real
ServerApp and ClientApps in-process, one client (partition 3) tampering with the BatchNorm
buffers of its train replies (tests/malicious.py's tampering ClientApp).

Before, under ``buffers = global`` and ``aggregator = mean``, a running_mean of 1e30 (or a
running_var of 3e38) took the global model to chance with no reply refused, a counter of 2^62
became the global one, ``outlier-norm-factor`` measured no buffer, and under DP one client's
changed buffers moved the global statistics that docs/privacy.md says stay fixed. Now each such
reply is refused with its reason, and the final model is bit for bit that of the run in which
the attacker's training fails (strategies/buffers.py ``check_reply``)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from flatflower.common import codec
from flatflower.common import protocol as P
from flatflower.strategies.buffers import STAT_LIMIT
from tests import malicious
from tests.helpers import run_with_faults, same

ATTACKER = 3  # of partitions 0..3
BN = {"algorithm": "fedavg", "dataset": "digits", "model": "tests.bn_models:small_bn_cnn",
      "num_server_rounds": 3, "local_steps": 3, "batch_size": 16, "buffers": "global", "aggregator": "mean"}
DP = {"dp.clip": 0.2, "dp.noise-multiplier": 0.0, "aggregation": "uniform"}  # sigma = 0: runs repeat bit for bit


def with_buffers(reply, suffix: str, make):
    """The reply with every model entry whose name ends with ``suffix`` replaced by ``make(entry)``."""
    model = codec.from_record(reply.content[P.MODEL])
    reply.content[P.MODEL] = codec.to_record(OrderedDict(
        (k, make(v) if k.endswith(suffix) else v) for k, v in model.items()))
    return reply


BUFFER_ATTACKS = {  # name -> the train reply's tampering (x: the attack's number)
    "running-mean": lambda r, m, c, x: with_buffers(r, "running_mean", lambda v: torch.full_like(v, x)),
    "running-var": lambda r, m, c, x: with_buffers(r, "running_var", lambda v: torch.full_like(v, x)),
    "shift-mean": lambda r, m, c, x: with_buffers(r, "running_mean", lambda v: v + x),
    "counter": lambda r, m, c, x: with_buffers(r, "num_batches_tracked", lambda v: torch.full_like(v, int(x))),
}


@pytest.fixture(autouse=True)
def buffer_attacks():
    """The attacks above, known to tests/malicious.py's ClientApp while a test runs."""
    malicious.ATTACKS.update({name: ("train", tamper) for name, tamper in BUFFER_ATTACKS.items()})
    yield
    for name in BUFFER_ATTACKS:
        malicious.ATTACKS.pop(name, None)


def attacked(tmp_path, name: str, attack: str, **overrides):
    """(metrics rows, final model) of the BatchNorm run in which partition 3 sends ``attack``."""
    return run_with_faults(tmp_path, name, client=malicious.malicious_app({ATTACKER: attack}), clients=4,
                           **{**BN, **overrides})


def without_attacker(tmp_path, **overrides):
    """(rows, final model) of the same run in which the attacker's training fails every round."""
    return run_with_faults(tmp_path, "without", {ATTACKER: "raise"}, clients=4, **{**BN, **overrides})


def refusal_reasons(rows: list[dict]) -> list[list[str]]:
    """Per training round, the reasons of its refused train replies (each must be the attacker's)."""
    out = []
    for row in rows[1:]:
        assert all(r["partition"] == ATTACKER for r in row["rejections"]) and row["skipped"] == 0
        out.append([r["reason"] for r in row["rejections"] if r["stage"] == "train"])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return without_attacker(tmp_path_factory.mktemp("ref"))


IMPOSSIBLE = {  # attack -> what its refusal says
    "running-mean:1e30": f"key '1.running_mean' holds 1e+30, a magnitude above {STAT_LIMIT:g}",
    "running-var:3e38": "key '1.running_var' holds 3e+38, a variance above 1e+36",
    "running-var:-1": "key '1.running_var' is a variance with negative entries",
    "counter:4611686018427387904": "key '1.num_batches_tracked' is a counter of 4611686018427387904, outside [",
}


@pytest.mark.parametrize("attack", sorted(IMPOSSIBLE))
def test_statistics_no_data_gives_are_refused_under_the_mean(tmp_path, attack, reference):
    """Issue 58: running_mean = 1e30 or running_var = 3e38 from one client of four took the
    mean's global model to chance (0.85 -> 0.10) with no reply refused. Now every such reply
    is refused, and the run is bit for bit the one without the attacker: its accuracy kept."""
    rows, final = attacked(tmp_path, "attacked", attack)
    ref_rows, ref_final = reference
    assert all(len(reasons) == 1 and IMPOSSIBLE[attack] in reasons[0] for reasons in refusal_reasons(rows))
    assert same(final, ref_final)
    assert rows[-1]["test_accuracy"] == ref_rows[-1]["test_accuracy"] > 0.5
    assert int(final["1.num_batches_tracked"]) == 3 * 3  # rounds x local steps, from the honest clients


def test_the_outlier_rule_measures_the_buffers(tmp_path):
    """A running_mean of 1e6 is a statistic data can give (within STAT_LIMIT), so only the norm
    rule can see it: ``outlier-norm-factor`` measures the buffers' update as a quantity of its
    own (before it measured the parameters' update only and let it through)."""
    rows, final = attacked(tmp_path, "attacked", "running-mean:1e6", outlier_norm_factor=5.0)
    ref_rows, ref_final = without_attacker(tmp_path, outlier_norm_factor=5.0)
    for reasons in refusal_reasons(rows):
        assert len(reasons) == 1 and reasons[0].startswith("buffers norm 2e+06 > 5 x round median ")
    assert same(final, ref_final) and rows[-1]["test_accuracy"] == ref_rows[-1]["test_accuracy"]


def test_under_dp_a_client_whose_buffers_moved_is_refused_and_the_global_ones_stay_fixed(tmp_path):
    """docs/privacy.md: under DP buffers go back as received, so "the global statistics do not
    move". One client shifting its running_mean by 4 used to move them (4.01 in the issue's run). Now its reply is refused every round; the global buffers are the initial
    model's, bit for bit, and the model is the run's without the attacker."""
    rows, final = attacked(tmp_path, "attacked", "shift-mean:4", **DP)
    _, ref_final = without_attacker(tmp_path, **DP)
    for reasons in refusal_reasons(rows):
        assert len(reasons) == 1 and "key '1.running_mean' differs from the buffer the server sent: under DP" in reasons[0]
    initial = torch.load(tmp_path / "attacked" / "model_init.pt", weights_only=True)
    assert all(torch.equal(final[k], initial[k]) for k in ("1.running_mean", "1.running_var", "1.num_batches_tracked"))
    assert not torch.equal(final["0.weight"], initial["0.weight"])  # the parameters did train
    assert same(final, ref_final)


@pytest.mark.parametrize("rule", ["median", "trimmed-mean", "multi-krum"])
def test_robust_rules_keep_the_buffers_within_the_honest_clients(tmp_path, rule):
    """Statistics within the bound (a running_mean of 1e17) from one client of five: a robust
    ``aggregator`` combines every buffer by the coordinate-wise median of the clients', so the
    global running_mean stays of the honest clients' size and the model learns."""
    overrides = {"aggregator": rule, "aggregator_f": 1}
    rows, final = run_with_faults(tmp_path, "attacked", client=malicious.malicious_app({ATTACKER: "running-mean:1e17"}),
                                  clients=5, **{**BN, **overrides})
    assert all(row["rejections"] == [] for row in rows[1:])  # within every bound: accepted
    assert float(final["1.running_mean"].abs().max()) < 100 and rows[-1]["test_accuracy"] > 0.5
