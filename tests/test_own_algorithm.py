"""Your own algorithm without a fork (docs/own-algorithm.md): ``algorithm = "package.module:callable"``
names an AlgorithmSpec in the user's code; every engine runs it, bad specs are refused in one line
when they are loaded, and examples/own_algorithm/, copied out of the checkout, runs as its README says."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flatflower
from flatflower.common.config import ConfigError, RunConfig
from flatflower.strategies import registry
from tests.helpers import ROOT, metrics, user_module_file

EXAMPLE = ROOT / "examples" / "own_algorithm"
FLATFLOWER = str(Path(sys.executable).parent / "flatflower")
TINY = ["--dataset", "digits", "--clients", "4", "--rounds", "3", "--set", "emasam.beta=0.5"]


def copied_example(tmp_path: Path) -> Path:
    """The example as an adopter has it: a folder of their own, outside the checkout."""
    folder = tmp_path / "my-project"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def flatflower_cli(folder: Path, *argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, "FLWR_HOME": str(folder / ".flwr"), "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": ""}
    return subprocess.run([FLATFLOWER, *argv], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=timeout)


def final_model(run_dir: Path) -> dict:
    return torch.load(run_dir / "model_final.pt")


def assert_same_run(a: Path, b: Path, atol: float) -> None:
    """Two run directories trained the same model: final weights to ``atol``, the same accuracy."""
    ma, mb = final_model(a), final_model(b)
    assert ma.keys() == mb.keys()
    assert max(float((ma[k] - mb[k]).abs().max()) for k in ma) <= atol
    assert [r.get("test_accuracy") for r in metrics(a)] == [r.get("test_accuracy") for r in metrics(b)]
    initial = torch.load(a / "model_init.pt")
    assert max(float((ma[k] - initial[k]).abs().max()) for k in ma) > 1e-2  # it trained


def test_the_example_out_of_the_checkout_runs_in_process_and_vectorised_alike(tmp_path):
    folder = copied_example(tmp_path)
    runs = {}
    for engine in ("inprocess", "vectorized"):
        runs[engine] = tmp_path / engine
        done = flatflower_cli(folder, "simulate", "--engine", engine, "--algorithm", "emasam:spec", *TINY,
                              "--run-dir", str(runs[engine]))
        assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((runs["vectorized"] / "config.json").read_text())
    assert config["engine"] == "vectorized" and config["algorithm"] == "emasam:spec"
    assert config["config"]["emasam.beta"] == 0.5
    assert_same_run(runs["inprocess"], runs["vectorized"], atol=1e-5)


def test_the_example_out_of_the_checkout_passes_the_conformance_kit_with_its_reference(tmp_path):
    folder = copied_example(tmp_path)
    done = flatflower_cli(folder, "check-algorithm", "emasam:spec", "--reference", "reference:first_round")
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert len(lines) == 7 and all(line.startswith("PASS") for line in lines), done.stdout
    # and the kit is not blind: a reference that forgets the server momentum fails its line
    (folder / "wrong.py").write_text((folder / "reference.py").read_text().replace(
        "mu = problem.params[\"emasam.server-momentum\"]", "mu = 0.0").replace("momentum = [mu * 0.0 + d", "momentum = [0.5 * d"))
    wrong = flatflower_cli(folder, "check-algorithm", "emasam:spec", "--reference", "wrong:first_round")
    assert wrong.returncode == 1 and "FAIL reference" in wrong.stdout, wrong.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_the_example_in_a_loopback_deployment_trains_the_in_process_model(tmp_path):
    """SuperLink + SuperNodes: the nodes import the user's module (the folder is handed to them)
    and Flower accepts its keys (a generated app declares them)."""
    folder = copied_example(tmp_path)
    for command, run_dir in (("simulate", tmp_path / "inprocess"), ("local", tmp_path / "local")):
        done = flatflower_cli(folder, command, "--algorithm", "emasam:spec", *TINY, "--run-dir", str(run_dir))
        assert done.returncode == 0, done.stderr[-2000:]
    assert_same_run(tmp_path / "inprocess", tmp_path / "local", atol=1e-6)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.ray
@pytest.mark.xdist_group("ray")
def test_the_example_on_flowers_ray_engine_trains_the_in_process_model(tmp_path):
    folder = copied_example(tmp_path)
    for engine in ("inprocess", "ray"):
        done = flatflower_cli(folder, "simulate", "--engine", engine, "--algorithm", "emasam:spec", *TINY,
                              "--run-dir", str(tmp_path / engine))
        assert done.returncode == 0, done.stderr[-2000:]
    assert_same_run(tmp_path / "inprocess", tmp_path / "ray", atol=1e-6)


def test_a_sweep_and_its_report_compare_it_with_a_built_in(tmp_path):
    folder = copied_example(tmp_path)
    done = flatflower_cli(folder, "sweep", "--algorithms", "fedsam,emasam:spec", "--seeds", "0", "--dataset", "digits",
                          "--clients", "3", "--rounds", "2", "--out", str(tmp_path / "sweep"))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "sweep" / "report.json").read_text())
    assert "emasam:spec" in json.dumps(report) and "fedsam" in json.dumps(report)
    summary = json.loads((tmp_path / "sweep" / "emasam.spec-s0" / "summary.json").read_text())  # no colon in a path
    assert summary["status"] == "completed"


@pytest.mark.slow
def test_a_tune_searches_its_declared_ranges(tmp_path):
    folder = copied_example(tmp_path)
    done = flatflower_cli(folder, "tune", "--algorithms", "emasam:spec", "--trials", "2", "--rounds", "2", "--last-k", "1",
                          "--seeds", "0", "--dataset", "digits", "--clients", "3", "--out", str(tmp_path / "tune"))
    assert done.returncode == 0, done.stderr[-2000:]
    best = json.loads((tmp_path / "tune" / "emasam.spec" / "best.json").read_text())
    assert best["algorithm"] == "emasam:spec" and best["budget"]["trials_by_state"]["complete"] == 2
    chosen = best["best"]["params"]
    assert 0.001 <= chosen["emasam.rho"] <= 0.5 and 0.0 <= chosen["emasam.server-momentum"] <= 0.9


def test_a_users_algorithm_is_listed_with_its_keys_ranges_and_state(tmp_path):
    folder = copied_example(tmp_path)
    done = flatflower_cli(folder, "algorithms", "--json", "emasam:spec")
    assert done.returncode == 0, done.stderr
    (entry,) = json.loads(done.stdout)
    assert entry["name"] == "emasam:spec" and entry["state"] == ["ema"] and entry["passes"] == 2
    keys = {k["name"]: k for k in entry["keys"]}
    assert keys["emasam.rho"]["search"] == {"low": 0.001, "high": 0.5, "log": True, "integer": False}
    assert keys["emasam.beta"]["read_by"] == "client" and keys["emasam.server-momentum"]["read_by"] == "server"
    bad = flatflower_cli(folder, "algorithms", "emasam:nothing")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "has no attribute 'nothing'" in bad.stderr


@pytest.fixture
def loaded_example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield "emasam:spec"
    registry.ALGORITHMS.pop("emasam:spec", None)
    sys.modules.pop("emasam", None)


def test_its_keys_are_checked_like_a_built_ins(loaded_example):
    cfg = RunConfig.from_mapping({"algorithm": loaded_example, "emasam.beta": 0.25})
    assert cfg.params.to_dict() == {"emasam.rho": 0.05, "emasam.beta": 0.25, "emasam.server-momentum": 0.5}
    with pytest.raises(ConfigError, match=r"emasam\.beta"):
        RunConfig.from_mapping({"algorithm": loaded_example, "emasam.beta": 1.5})
    with pytest.raises(ConfigError, match=r"unknown run-config key\(s\): emasam\.bta"):
        RunConfig.from_mapping({"algorithm": loaded_example, "emasam.bta": 0.5})


def test_the_public_names_are_the_ones_the_built_ins_use():
    from flatflower.client.algorithms.base import ClientRule
    from flatflower.strategies.base import ServerRule

    assert flatflower.ClientRule is ClientRule and flatflower.ServerRule is ServerRule
    assert flatflower.AlgorithmSpec is registry.AlgorithmSpec
    for spec in registry.ALGORITHMS.values():
        assert issubclass(spec.server, flatflower.ServerRule) and issubclass(spec.client, flatflower.ClientRule)


@pytest.mark.parametrize("name", registry.BUILT_IN)
def test_every_built_in_passes_the_checks_a_users_spec_gets(name):
    assert registry.spec_problems(registry.ALGORITHMS[name]) == []


HALVES = '''
from dataclasses import dataclass
from flatflower import AlgorithmSpec, ClientRule, ServerRule
from flatflower.params import Params, Range, key, POSITIVE
from flatflower.strategies.fedavg import FedAvg

class Client(ClientRule):
    pass
'''

BAD_SPECS = {
    "not_a_spec": ("def spec():\n    return 42\n", "returned a int, not a flatflower.AlgorithmSpec"),
    "server_not_a_rule": ("def spec():\n    return AlgorithmSpec('x', dict, Client)\n",
                          "not a subclass of flatflower.ServerRule"),
    "no_update": ("def spec():\n    return AlgorithmSpec('x', ServerRule, Client)\n",
                  "ServerRule does not implement update()"),
    "reserved_record": ("def spec():\n    return AlgorithmSpec('x', FedAvg, Client, down=('arrays',))\n",
                        "down names ['arrays'] must be distinct"),
    "no_namespace": ("@dataclass(frozen=True)\nclass K(Params):\n    a: float = key('alpha', 1.0, 'a', POSITIVE)\n"
                     "class C(Client):\n    Params = K\n"
                     "def spec():\n    return AlgorithmSpec('x', FedAvg, C)\n", "key 'alpha' needs a namespace"),
    "general_key": ("@dataclass(frozen=True)\nclass K(Params):\n    a: float = key('dp.clip', 1.0, 'a', POSITIVE)\n"
                    "class C(Client):\n    Params = K\n"
                    "def spec():\n    return AlgorithmSpec('x', FedAvg, C)\n", "'dp.clip' is a general run-config key"),
    "another_default": ("@dataclass(frozen=True)\nclass K(Params):\n    a: float = key('sam.rho', 0.3, 'a', POSITIVE)\n"
                        "class C(Client):\n    Params = K\n"
                        "def spec():\n    return AlgorithmSpec('x', FedAvg, C)\n",
                        "'sam.rho' is another algorithm's, with another default"),
    "empty_range": ("@dataclass(frozen=True)\nclass K(Params):\n"
                    "    a: float = key('x.a', 1.0, 'a', POSITIVE, search=Range(2.0, 1.0))\n"
                    "class C(Client):\n    Params = K\n"
                    "def spec():\n    return AlgorithmSpec('x', FedAvg, C)\n", "key 'x.a': an empty"),
    "undeclared_state": ("class Keeping(Client):\n"
                         "    def gradient(self, w, batch):\n"
                         "        loss, g = batch.grad()\n"
                         "        self.last = g\n"
                         "        return loss, g\n"
                         "def spec():\n    return AlgorithmSpec('x', FedAvg, Keeping)\n", "last"),
    "raises": ("def spec():\n    raise RuntimeError('no GPU here')\n", "calling it raised RuntimeError: no GPU here"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_a_bad_spec_is_refused_in_one_line_when_a_run_config_names_it(tmp_path, monkeypatch, case):
    source, message = BAD_SPECS[case]
    gen = user_module_file(tmp_path, monkeypatch, f"plugin_{case}", HALVES + source)
    module = next(gen)
    try:
        with pytest.raises(ConfigError) as refused:
            RunConfig.from_mapping({"algorithm": f"{module}:spec"})
        text = str(refused.value)
        assert "\n" not in text and message in text and f"algorithm='{module}:spec'" in text
        assert f"{module}:spec" not in registry.ALGORITHMS  # nothing half-registered
    finally:
        next(gen, None)
