"""A client rule's declared state (client/rule_state.py): every built-in rule keeps exactly
what its ``Keeps`` say, and a rule that keeps anything else -- an undeclared attribute, a
declared one of another kind, or one whose structure changes from step to step -- is refused
in one line by :func:`check_declared_state` when it is loaded, and by the vectorised engine
before its group trains, never in the middle of a run."""

from __future__ import annotations

import pytest
import torch

from flatflower.client.algorithms.base import ClientRule
from flatflower.client.algorithms.fedavg import FedAvgClient
from flatflower.client.algorithms.fedlesam import FedLESAMSClient
from flatflower.client.algorithms.scaffold import ScaffoldClient
from flatflower.client.rule_state import (CONSTANT, MODEL, RECORDS, SCALAR, RuleStateError, check_declared_state,
                                          declared_state, keeps, optional)
from flatflower.client.train import build_rule
from flatflower.common.config import RunConfig
from flatflower.common.models import build_model
from flatflower.common.tensors import add, zeros_like
from flatflower.runtime.engines.vectorized import StackedRule
from flatflower.strategies.registry import ALGORITHMS


def refusal(rule_class, **kwargs) -> str:
    """The one-line message check_declared_state refuses ``rule_class`` with."""
    with pytest.raises(RuleStateError) as caught:
        check_declared_state(rule_class, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, ValueError)
    assert rule_class.__qualname__ in message
    return message


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_built_in_rule_keeps_to_its_declared_state(algorithm):
    spec = ALGORITHMS[algorithm]
    check_declared_state(spec.client, down=spec.down, values=spec.values, state=spec.state)


def test_the_declarations_merge_along_the_classes():
    base = {"params": CONSTANT, "start": MODEL, "broadcast": RECORDS, "state": RECORDS, "lr": CONSTANT,
            "initial": CONSTANT}
    assert declared_state(ClientRule) == base
    assert declared_state(FedAvgClient) == base  # no state of its own
    scaffold = {**base, "c": MODEL, "c_i": MODEL, "c_minus_ci": MODEL, "steps": SCALAR,
                "_new_control": optional(MODEL)}
    assert declared_state(ScaffoldClient) == scaffold
    # FedLESAM-S: SCAFFOLD's and the FedLESAM mixin's (its offset, none on a first round)
    assert declared_state(FedLESAMSClient) == {**scaffold, "offset": optional(MODEL)}

    class Redeclared(ScaffoldClient):
        Keeps = keeps(steps=CONSTANT)

    assert declared_state(Redeclared)["steps"] == CONSTANT and declared_state(ScaffoldClient)["steps"] == SCALAR


def test_a_declaration_takes_kinds_only():
    with pytest.raises(TypeError, match="keeps\\(steps=...\\) takes a kind"):
        keeps(steps="scalar")
    with pytest.raises(TypeError, match="optional\\(\\) takes one of"):
        optional("model")


# ---------------------------------------------------------------- rules that break it
class LeakyClient(FedAvgClient):
    """Keeps the last loss on itself without declaring it."""

    def direction(self, w, batch):
        loss, g = super().direction(w, batch)
        self.last_loss = loss
        return loss, g


def test_an_undeclared_attribute_is_refused_in_one_line_naming_it():
    message = refusal(LeakyClient)
    assert "keeps last_loss undeclared" in message and "after local step 1" in message


class UndeclaredInInit(ClientRule):
    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        self.momentum = zeros_like(self.start)
        self.count = 0


def test_undeclared_attributes_set_by_init_are_refused_all_at_once():
    message = refusal(UndeclaredInInit)
    assert "keeps momentum, count undeclared" in message and "after __init__" in message


class GrowingClient(ClientRule):
    """Declares its gradients as records, then adds one record per step."""

    Keeps = keeps(history=RECORDS)

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        self.history = {}

    def direction(self, w, batch):
        loss, g = batch.grad()
        self.history = {**self.history, f"step{len(self.history)}": g}
        return loss, g


def test_a_declared_attribute_that_changes_structure_is_refused_at_check_time():
    message = refusal(GrowingClient)
    assert "history (declared records) changed its structure at local step 1" in message


class LateRegister(ClientRule):
    """An optional gradient register first set at the second step: a group whose clients
    differ in step count could not mask it."""

    Keeps = keeps(previous=optional(MODEL), taken=CONSTANT)

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        self.previous, self.taken = None, 0

    def direction(self, w, batch):
        loss, g = batch.grad()
        if self.taken:  # a Python count: the same for every client
            self.previous = g
        self.taken += 1
        return loss, g


def test_an_optional_attribute_set_after_the_first_step_is_refused():
    message = refusal(LateRegister)
    assert "previous (declared optional(model)) changed its structure at local step 2" in message
    assert "from None to a list of 2" in message


class WrongKinds(ClientRule):
    Keeps = keeps(steps=SCALAR, scale_by=CONSTANT, dual=MODEL)

    def __init__(self, params, start, broadcast, state, lr, initial=None):
        super().__init__(params, start, broadcast, state, lr, initial)
        self.steps = torch.zeros(1)  # not 0-d
        self.scale_by = torch.tensor(2.0)  # a tensor, shared as a constant
        self.dual = [torch.zeros(3)]  # one tensor, not the model's two


def test_declared_attributes_of_another_kind_or_shape_are_refused_naming_each():
    message = refusal(WrongKinds)
    assert "steps (declared scalar) is a tensor of shape [1], not a 0-d tensor" in message
    assert "scale_by (declared constant) is a tensor of shape [] holding tensors" in message
    assert "dual (declared model) is a list of 1 (shapes [3]), not a list of 2 tensors" in message


class NeverSet(ClientRule):
    Keeps = keeps(dual=MODEL)


def test_a_declared_attribute_init_does_not_set_is_refused():
    assert "dual declared but not set by __init__" in refusal(NeverSet)


def test_a_rule_that_cannot_be_built_on_the_probe_is_refused_in_one_line():
    """SCAFFOLD reads the server's control variate: without the records it reads (down=...),
    the probe cannot build it, and says so."""
    message = refusal(ScaffoldClient)
    assert "could not be probed" in message and "KeyError: 'control_variate'" in message


def test_the_probe_runs_a_first_round_and_one_with_state():
    """The check builds a stateful rule without and with its stored records: FedLESAM's offset
    is None on a first round and a model-aligned list after."""
    seen = []

    class Watched(FedLESAMSClient):
        def uploads(self, w):
            seen.append(self.offset is None)
            return super().uploads(w)

    spec = ALGORITHMS["fedlesam-s"]
    check_declared_state(Watched, down=spec.down, state=spec.state)
    assert seen == [True, False]


# ---------------------------------------------------------------- the vectorised engine
def rules(algorithm: str, n: int = 3) -> tuple[list, list]:
    cfg = RunConfig.from_mapping({"batch-size": 32, "algorithm": algorithm})
    model = build_model("logreg", (1, 8, 8), 10, seed=0)
    spec = ALGORITHMS[algorithm]
    named = dict(model.state_dict())
    built = [build_rule(spec, cfg, model, {name: named for name in spec.down}, {}, 0.1)[0] for _ in range(n)]
    return built, [p.shape for p in model.parameters()]


def test_the_engine_stacks_the_declared_state_and_shares_the_constants():
    built, shapes = rules("scaffold")
    stacked = StackedRule(built, shapes)
    assert set(stacked.tensors()) == {"start", "broadcast", "state", "c", "c_i", "c_minus_ci", "steps",
                                      "_new_control"}
    assert stacked.tensors()["_new_control"] == []  # None until uploads: no tensors yet
    assert set(stacked.constants) == {"params", "lr", "initial"}
    assert stacked.tensors()["steps"][0].shape == (3,)  # one count per client
    again = stacked.client(1)
    assert type(again) is ScaffoldClient and vars(again).keys() == vars(built[1]).keys()
    assert again.params is built[0].params and again._new_control is None
    assert all(torch.equal(a, b) for a, b in zip(again.c_minus_ci, built[1].c_minus_ci))


def test_the_engine_refuses_a_rule_with_an_undeclared_attribute_before_training():
    built, shapes = rules("fedavg")
    built[2].momentum = add(built[2].start, built[2].start)
    with pytest.raises(RuleStateError, match="FedAvgClient breaks its declared state in the vectorised engine: "
                                             "keeps momentum undeclared"):
        StackedRule(built, shapes)


def test_a_declaration_that_is_not_of_kinds_is_refused_in_one_line():
    class Plain(ClientRule):
        Keeps = {"dual": "model"}  # a plain dict, not keeps(...)

    with pytest.raises(RuleStateError, match=r"Plain.Keeps declares dual='model': each value must be a kind"):
        check_declared_state(Plain)
