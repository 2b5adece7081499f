"""The registry: one name per algorithm, each half owning the keys it reads, the registry as data."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from flatflower.common.config import ConfigError, RunConfig, algorithm_params
from flatflower.common.params import Params, combine, key
from flatflower.strategies.registry import ALGORITHMS, FAMILIES, as_data
from tests.helpers import initial_model

ROOT = Path(__file__).resolve().parent.parent


def _file_of(name: str) -> str:
    """The file stem an algorithm's halves live in: its own name (a ``-`` written ``_``, as a
    module name must: dp-fedsam in dp_fedsam.py), or its family's."""
    return next((family for family, names in FAMILIES.items() if name in names), name.replace("-", "_"))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_each_half_lives_in_the_file_named_after_its_algorithm(name):
    spec = ALGORITHMS[name]
    stem = _file_of(name)
    assert spec.server.__module__ == f"flatflower.strategies.{stem}"
    assert spec.client.__module__ == f"flatflower.client.algorithms.{stem}"


def test_every_algorithm_file_holds_a_registered_half():
    """No leftover half: each file of strategies/ and client/algorithms/ (but the shared
    machinery) is some algorithm's or family's."""
    stems = {_file_of(name) for name in ALGORITHMS}
    shared = {"strategies": {"base", "strategy", "aggregate", "participation", "validation", "registry",
                             "buffers", "compatibility"},
              "client/algorithms": {"base"}}
    for folder, machinery in shared.items():
        files = {p.stem for p in (ROOT / folder).glob("*.py")} - {"__init__"} - machinery
        assert files == stems, folder


def test_families_name_registered_algorithms():
    assert all(name in ALGORITHMS for names in FAMILIES.values() for name in names)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_run_config_holds_both_halves_keys_and_each_half_sees_only_its_own(name):
    spec = ALGORITHMS[name]
    cfg = RunConfig.from_mapping(spec.example_config())
    server_keys, client_keys = spec.server.Params.fields(), spec.client.Params.fields()
    assert set(cfg.params.fields()) == set(server_keys) | set(client_keys)
    assert algorithm_params()[name] is spec.params
    rule = spec.new_strategy(cfg, initial_model(cfg)).rule
    assert type(rule.params) is spec.server.Params
    assert set(rule.params.fields()) == set(server_keys)
    for k in set(client_keys) - set(server_keys):  # a client-only key is out of the server's reach
        with pytest.raises(AttributeError):
            getattr(rule.params, spec.params.fields()[k].name)


def test_keys_read_by_both_halves_are_declared_once():
    """A key both halves read comes from one declaration (the client half's), so its default,
    meaning and check cannot differ between the halves."""
    both = 0
    for spec in ALGORITHMS.values():
        server, client = spec.server.Params.fields(), spec.client.Params.fields()
        for k in set(server) & set(client):
            assert server[k] is client[k] or server[k].metadata is client[k].metadata, (spec.name, k)
            both += 1
    assert both >= 5  # feddyn.alpha, fedgmt.beta, fednsam.lambda, fedtoga.alpha, sam.rho (FedSMOO)


def test_server_only_keys_are_declared_by_the_server_half():
    owners = {spec.name: spec.key_owners() for spec in ALGORITHMS.values()}
    assert owners["fedadam"] == {k: "server" for k in ("fedopt.eta", "fedopt.beta1", "fedopt.beta2", "fedopt.tau")}
    assert owners["fedtoga"]["fedtoga.dual-divisor"] == owners["fedtoga"]["fedtoga.delta-scale"] == "server"
    assert owners["fedtoga"]["fedtoga.alpha"] == "both" and owners["fedtoga"]["fedtoga.kappa"] == "client"
    assert owners["fedacg"] == {"fedacg.lambda": "server", "fedacg.beta": "client"}
    assert owners["fedgmt"]["fedgmt.alpha"] == "server" and owners["fedgmt"]["fedgmt.beta"] == "both"
    assert owners["fedcm"]["fedcm.server-step"] == "server"


def test_combine_refuses_one_field_with_two_keys():
    @dataclasses.dataclass(frozen=True)
    class A(Params):
        x: float = key("a.x", 1.0, "x of a")

    @dataclasses.dataclass(frozen=True)
    class B(Params):
        x: float = key("b.x", 1.0, "x of b")

    with pytest.raises(TypeError, match="clashes"):
        combine("AB", A, B)


def test_combined_params_survive_pickling():
    """Run configs cross process boundaries (sweeps, Ray): a combined params class is rebuilt."""
    cfg = RunConfig.from_mapping({"algorithm": "fedtoga", "fedtoga.dual-divisor": "N", "sam.rho": 0.2})
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and type(again.params) is type(cfg.params)


def test_algorithms_json_is_the_registry_as_data(tmp_path):
    out = subprocess.run([sys.executable, "-m", "flatflower.tools.cli", "algorithms", "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert data == json.loads(json.dumps(as_data()))
    assert [a["name"] for a in data] == list(ALGORITHMS)
    for alg in data:
        spec = ALGORITHMS[alg["name"]]
        assert alg["server"] == f"{spec.server.__module__}.{spec.server.__name__}"
        assert alg["client"] == f"{spec.client.__module__}.{spec.client.__name__}"
        assert [k["name"] for k in alg["keys"]] == list(spec.params.fields())
        assert all(k["read_by"] in ("client", "server", "both") and k["meaning"] for k in alg["keys"])
        assert (alg["down"], alg["up"], alg["state"]) == (list(spec.down), list(spec.up), list(spec.state))


def test_the_run_config_needs_the_registry_and_says_so():
    """The ground floor does not import the halves: without the registry a run config cannot
    be checked, and the error says what to import."""
    code = ("from flatflower.common.config import RunConfig\n"
            "try:\n    RunConfig.from_mapping({})\n"
            "except Exception as err:\n    print(type(err).__name__, err)\n"
            "import flatflower.strategies.registry\n"
            "print(RunConfig.from_mapping({'algorithm': 'fedsam'}).params)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith(ConfigError.__name__) and "import flatflower.strategies.registry" in out[0]
    assert out[1] == "SAMParams(rho=0.1)"
