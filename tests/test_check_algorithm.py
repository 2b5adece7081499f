"""``flatflower check-algorithm REF`` (tools/conformance.py, docs/check-algorithm.md): every built-in
passes the conformance kit; a plugin that breaks resume, sends an undeclared record, keeps
undeclared client state or lets a bad key through fails the check that says so, in one line;
a user's float64 reference of one round passes when right and fails when wrong; a reference
that does not load is one ``error:`` line, exit 2."""

from __future__ import annotations

import re

import pytest

from flatflower.common import config
from flatflower.strategies import registry
from flatflower.strategies.registry import ALGORITHMS, BUILT_IN
from flatflower.tools.cli import main as cli
from flatflower.tools.conformance import CHECKS, BadInput, run_checks
from tests.helpers import user_module_file


def checks(algorithm: str, **options) -> dict:
    """The kit's checks of ``algorithm`` on 3 clients and 2 rounds, by name."""
    results = run_checks(algorithm, **{"rounds": 2, "clients": 3, "out": lambda line: None, **options})
    assert [r.name for r in results] == list(CHECKS)
    assert all("\n" not in r.line for r in results)
    return {r.name: r for r in results}


@pytest.mark.parametrize("algorithm", BUILT_IN)
def test_every_built_in_passes_the_kit(algorithm):
    found = checks(algorithm)
    assert all(r.ok for r in found.values()), [r.line for r in found.values() if not r.ok]
    assert [n for n, r in found.items() if r.skipped] == ["reference"]  # no --reference given
    assert "vectorized vs inprocess max abs diff" in found["engines agree"].line
    assert "bit for bit" in found["resume"].line
    if ALGORITHMS[algorithm].state:
        assert "bit for bit" in found["client state"].line and "fresh nodes" in found["client state"].line
    else:
        assert "no client state" in found["client state"].line


# ---------------------------------------------------------------- plugins that break a check
HALVES = '''
from dataclasses import dataclass

from flatflower import AlgorithmSpec, ClientRule, Params, ServerRule, key
from flatflower.params import UNIT
from flatflower.tensors import add, scale, sub


class Client(ClientRule):
    """FedAvg's client: plain gradient steps."""


class Server(ServerRule):
    """FedAvg's server: w <- w + sum_i p_i (w_i - w)."""

    def update(self, server_round, updates, weights):
        start = self.start_point()
        self.model = add(self.model, self.aggregate([sub(u.model, start) for u in updates], weights))
'''

PLUGINS = {
    # a record name the protocol reserves: the registry refuses the spec
    "reserved": '''
def spec():
    return AlgorithmSpec("reserved", Server, Client, down=("arrays",))
''',
    # the client rule keeps its last loss on itself, undeclared
    "undeclared": '''
class RememberingClient(Client):
    def gradient(self, w, batch):
        loss, g = batch.grad()
        self.last_loss = loss
        return loss, g


def spec():
    return AlgorithmSpec("undeclared", Server, RememberingClient)
''',
    # the server counts its rounds on itself, outside its records: lost on a restart
    "counter": '''
class CountingServer(Server):
    def update(self, server_round, updates, weights):
        self.seen = getattr(self, "seen", 0) + 1
        start = self.start_point()
        delta = self.aggregate([sub(u.model, start) for u in updates], weights)
        self.model = add(self.model, scale(delta, 1.0 / self.seen))


def spec():
    return AlgorithmSpec("counter", CountingServer, Client)
''',
    # the client uploads a record the spec does not declare in ``up``
    "leaky": '''
class LeakyClient(Client):
    def uploads(self, w):
        return {"extra": w}


def spec():
    return AlgorithmSpec("leaky", Server, LeakyClient)
''',
    # the client keeps a record between its rounds that the spec's ``state`` does not declare
    "hoarder": '''
class HoardingClient(Client):
    def new_state(self, w):
        return {"last_model": w}


def spec():
    return AlgorithmSpec("hoarder", Server, HoardingClient)
''',
    # one key without a check (its type alone is checked), one with
    "keys": '''
@dataclass(frozen=True)
class Keys(Params):
    note: float = key("ckkeys.note", 1.0, "a key without a check")
    mix: float = key("ckkeys.mix", 0.5, "a key with a check", UNIT)


class KeyedClient(Client):
    Params = Keys


def spec():
    return AlgorithmSpec("keys", Server, KeyedClient)
''',
    # its check is declared, but its params' problems() drop it: bad values get through
    "lax": '''
@dataclass(frozen=True)
class LaxKeys(Params):
    mix: float = key("cklax.mix", 0.5, "a key whose check is never applied", UNIT)

    def problems(self, cfg):
        return []


class LaxClient(Client):
    Params = LaxKeys


def spec():
    return AlgorithmSpec("lax", Server, LaxClient)
''',
}


def forget(reference: str) -> None:
    """Unregister a plugin the kit registered (this process's other tests see the 28 built-ins)."""
    registry.ALGORITHMS.pop(reference, None)
    config._ALGORITHMS.pop(reference, None)
    config._parsed.cache_clear()


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """``plugin(name)`` -> the reference ``module:spec`` of PLUGINS[name], importable from here;
    unregistered afterwards."""
    made = []

    def make(name: str) -> str:
        gen = user_module_file(tmp_path, monkeypatch, f"ck_{name}", HALVES + PLUGINS[name])
        made.append((gen, f"{next(gen)}:spec"))
        return made[-1][1]

    yield make
    for gen, reference in made:
        forget(reference)
        next(gen, None)


def test_a_spec_the_registry_refuses_fails_loading_and_nothing_runs(plugin, capsys):
    reference = plugin("reserved")
    assert cli(["check-algorithm", reference]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FAIL loads: the registry refuses the spec: down names ['arrays'] must be distinct")
    assert [line.split(":")[0] for line in lines[1:-1]] == [f"SKIP {name}" for name in CHECKS[1:]]
    assert all(line.endswith(": the algorithm does not load") for line in lines[1:-1])
    assert lines[-1].startswith(f"{len(CHECKS)} checks: 0 passed, 1 failed, {len(CHECKS) - 1} skipped (")


def test_a_client_rule_keeping_undeclared_state_fails_loading(plugin):
    found = checks(plugin("undeclared"))
    line = found["loads"].line
    assert line.startswith("FAIL loads: the registry's checks pass; the declared client-state check fails: "
                           "client rule RememberingClient breaks its declared state"), line
    assert "keeps last_loss undeclared" in line
    assert all(r.skipped for r in list(found.values())[1:])  # the registry refuses it: nothing runs


def test_a_server_keeping_state_outside_its_records_fails_resume(plugin):
    found = checks(plugin("counter"))
    line = found["resume"].line
    assert line.startswith("FAIL resume: stopped after round 1 (checkpoint)"), line
    assert "bit-identical expected" in line and "max abs diff" in line
    assert "state kept elsewhere on the rule" in line
    assert found["engines agree"].ok and found["records on the wire"].ok  # only resume is broken


def test_a_client_uploading_an_undeclared_record_fails_the_wire_check(plugin):
    found = checks(plugin("leaky"))
    line = found["records on the wire"].line
    assert line.startswith("FAIL records on the wire: the reply from node"), line
    assert "undeclared 'extra' (declared up: none)" in line
    # the server's validation refused every such reply: the run itself failed too, and says why
    assert re.search(r"; the last refusal: client \d: array records \['arrays', 'extra'\] do not match the "
                     r"protocol \['arrays'\]$", line), line
    assert not found["engines agree"].ok


def test_a_client_keeping_undeclared_state_fails_the_client_state_check(plugin):
    found = checks(plugin("hoarder"))
    line = found["client state"].line
    assert line == ("FAIL client state: the clients keep records last_model that the spec's state (none) does not "
                    "declare: they are never read back"), line


def test_keys_with_a_check_are_probed_and_keys_without_one_fail_nothing(plugin):
    found = checks(plugin("keys"))
    assert all(r.ok for r in found.values()), [r.line for r in found.values() if not r.ok]
    line = found["bad hyperparameters"].line
    # ckkeys.note: a wrong type; ckkeys.mix: a wrong type, NaN, -1 and inf
    assert line.startswith("PASS bad hyperparameters: 5 bad values of 2 keys"), line
    assert line.endswith("without a check (any value of its type goes): ckkeys.note"), line


def test_a_check_the_run_config_does_not_apply_fails_the_bad_hyperparameters_check(plugin):
    line = checks(plugin("lax"))["bad hyperparameters"].line
    assert line.startswith("FAIL bad hyperparameters: cklax.mix=nan accepted (its check: in [0, 1])"), line


# ---------------------------------------------------------------- the user's reference of one round
REFERENCES = '''
def fedsam(problem):
    """FedSAM's round: K local SAM steps per client, then w + server_lr sum_i p_i (w_i - w)."""
    rho = problem.params["sam.rho"]
    deltas = []
    for x, y in problem.clients:
        w = [a.copy() for a in problem.w0]
        for _ in range(problem.local_steps):
            w = [a - problem.lr * g for a, g in zip(w, problem.sam_grad(w, x, y, rho))]
        deltas.append([a - b for a, b in zip(w, problem.w0)])
    mean = [sum(p * d[j] for p, d in zip(problem.weights, deltas)) for j in range(len(problem.w0))]
    return [w + problem.server_lr * m for w, m in zip(problem.w0, mean)]


def fedavg(problem):
    """FedAvg's round (plain gradients): not FedSAM's."""
    deltas = []
    for x, y in problem.clients:
        w = [a.copy() for a in problem.w0]
        for _ in range(problem.local_steps):
            w = [a - problem.lr * g for a, g in zip(w, problem.grad(w, x, y))]
        deltas.append([a - b for a, b in zip(w, problem.w0)])
    return [w + sum(p * d[j] for p, d in zip(problem.weights, deltas)) for j, w in enumerate(problem.w0)]


def shapeless(problem):
    return [problem.w0[0]]
'''


@pytest.fixture
def references(tmp_path, monkeypatch):
    gen = user_module_file(tmp_path, monkeypatch, "ck_references", REFERENCES)
    yield next(gen)
    next(gen, None)


def test_a_right_reference_passes_and_a_wrong_one_fails(references, capsys):
    assert cli(["check-algorithm", "fedsam", "--rounds", "2", "--reference", f"{references}:fedsam"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(CHECKS) + 1 and all(line.startswith("PASS ") for line in lines[:-1]), lines
    assert lines[-1].startswith(f"{len(CHECKS)} checks: {len(CHECKS)} passed ("), lines[-1]
    right = lines[len(CHECKS) - 1]
    assert right.startswith(f"PASS reference: one round (3 clients, 3 full-batch steps) vs {references}:fedsam "
                            "(float64): max abs diff "), right
    assert float(right.split("max abs diff ")[1].split()[0]) <= 1e-6

    wrong = checks("fedsam", reference=f"{references}:fedavg")["reference"]
    assert not wrong.ok and wrong.line.startswith("FAIL reference: one round"), wrong.line
    assert float(wrong.line.split("max abs diff ")[1].split()[0]) > 1e-4
    shapes = checks("fedavg", reference=f"{references}:shapeless")["reference"]
    assert shapes.line.startswith(f"FAIL reference: {references}:shapeless returned arrays of shapes [[10, 20]], the model's "
                                   "trainable parameters have [[10, 20], [10]]"), \
        shapes.line


def test_a_reference_that_does_not_load_is_bad_input(references):
    with pytest.raises(BadInput, match=f"--reference='{references}:nothing': .* has no attribute 'nothing'"):
        run_checks("fedavg", reference=f"{references}:nothing", out=lambda line: None)


@pytest.mark.parametrize("argv,message", [
    (["nope:x"], "error: algorithm='nope:x': module 'nope' is not found on this machine"),
    (["nope"], "error: unknown algorithm 'nope'; valid names:"),
    (["fedavg", "--reference", "nope:y"], "error: --reference='nope:y': module 'nope' is not found"),
])
def test_an_algorithm_or_reference_that_does_not_load_is_one_error_line_exit_2(capsys, argv, message):
    assert cli(["check-algorithm", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(message), err


@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.slow
def test_ray_agrees_with_the_in_process_engines():
    found = checks("scaffold", engines=("inprocess", "vectorized", "ray"))
    assert all(r.ok for r in found.values()), [r.line for r in found.values() if not r.ok]
    assert "ray vs inprocess max abs diff" in found["engines agree"].line
