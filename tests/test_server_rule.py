"""The server rule apart from the Flower strategy: pure tensor code, tested without Flower."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from flatflower.common.config import RunConfig
from flatflower.strategies.registry import ALGORITHMS
from flatflower.strategies.validation import ClientUpdate

ROOT = Path(__file__).resolve().parent.parent
MODEL = OrderedDict([("0.weight", torch.randn(3, 4, generator=torch.Generator().manual_seed(0))),
                     ("0.bias", torch.zeros(3))])


def test_every_algorithms_two_halves_import_no_flower():
    """Each algorithm's server rule and client rule, and the bases they build on, load in an
    interpreter where Flower was never imported: they cannot reach a grid or a message."""
    modules = sorted({cls.__module__ for spec in ALGORITHMS.values() for cls in (spec.server, spec.client)}
                     | {"flatflower.strategies.base", "flatflower.client.algorithms.base"})
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [], out.stdout
    assert len(modules) >= 2 * 15


def _update(rule, pid: int, shift: float) -> ClientUpdate:
    model = OrderedDict((k, v + shift) for k, v in rule.start_point().items())
    uploads = {name: OrderedDict((k, torch.full_like(v, shift)) for k, v in MODEL.items()) for name in rule.spec.up}
    return ClientUpdate(100 + pid, pid, 10, 2, 1.0, model, uploads)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_non_finite_result_leaves_the_rule_as_it_was(name):
    """One round whose result holds NaN: apply says so, and the model and every record are
    the ones from before the round, value for value; a finite round then moves the model."""
    rule = ALGORITHMS[name].new_rule(RunConfig.from_mapping(ALGORITHMS[name].example_config()), MODEL, num_partitions=4)
    before = rule.state_dict()
    assert rule.apply(1, [_update(rule, 0, 0.1), _update(rule, 1, float("nan"))], [0.5, 0.5]) is False
    after = rule.state_dict()
    for k in MODEL:
        assert torch.equal(after["model"][k], before["model"][k])
    assert after["records"].keys() == before["records"].keys()
    for n, r in before["records"].items():
        assert all(torch.equal(after["records"][n][k], r[k]) for k in r), (name, n)
    assert rule.apply(1, [_update(rule, 0, 0.1), _update(rule, 1, 0.2)], [0.5, 0.5]) is True
    assert any(not torch.equal(rule.model[k], before["model"][k]) for k in MODEL)


@pytest.mark.parametrize("name,record,key,value", [
    ("fedgf", "divergence_window", "exceeded", 0.5), ("fedwmsam", "gradient_weight", "alpha", 1.5)])
def test_a_checkpoint_whose_server_scalars_the_rule_never_makes_is_refused(name, record, key, value):
    """A damaged checkpoint (finite, right shapes) with a window entry other than -1/0/1 or an
    alpha outside [0, 1) is refused naming the record, and the strategy keeps its own state."""
    from tests.helpers import fast_config, make_strategy

    cfg = RunConfig.from_mapping(fast_config(**ALGORITHMS[name].example_config()))
    state = make_strategy(cfg).state_dict()
    damaged = state["records"][record][key].clone()
    damaged.view(-1)[-1] = value
    state["records"][record][key] = damaged
    fresh = make_strategy(cfg)
    before = fresh.state_dict()
    with pytest.raises(ValueError, match=record):
        fresh.load_state_dict({**state, "round": 3})
    assert fresh.round == 0 and fresh.participation.state_dict() == before["participation"]
    assert all(torch.equal(fresh.rule.records[record][k], before["records"][record][k]) for k in before["records"][record])
