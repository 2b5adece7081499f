"""A node decides what code a run config makes it run (issue 58, item 1; client/allowed_code.py).

A reference in the run config (model, dataset, train-transform, algorithm = package.module:callable)
resolves on a node only when the node allows it (node config ``allow-code``, or
FLATFLOWER_ALLOW_CODE) or it lies in a Flower App the node installed; anything else is refused
before any import or call, in one line the server learns."""

from __future__ import annotations

import json
import sys

import pytest

from flatflower.client import allowed_code
from flatflower.common.references import BadReference
from tests.helpers import ROOT, round_deadline
from tests.test_local_data import local_config, node_configs, sites

MARKER_MODULE = '''
import pathlib
pathlib.Path({path!r}).write_text("imported")
def make(*args):
    pathlib.Path({path!r}).write_text("called")
'''


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """A module that leaves a file when it is imported or called: the node must do neither."""
    name = f"marker_{abs(hash(str(tmp_path))) % 10**8}"
    flag = tmp_path / "flag"
    (tmp_path / f"{name}.py").write_text(MARKER_MODULE.format(path=str(flag)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(allowed_code.ALLOW_ENV, raising=False)
    yield name, flag
    sys.modules.pop(name, None)


def test_built_in_names_need_no_allowance(monkeypatch):
    monkeypatch.delenv(allowed_code.ALLOW_ENV, raising=False)
    run_config = {"model": "cnn", "dataset": "digits", "algorithm": "fedsam", "partition": "fds:DirichletPartitioner",
                  "train-transform": "crop-flip", "run-dir": "a:b"}
    assert allowed_code.refusal(run_config, {}) is None


@pytest.mark.parametrize("key", ["model", "dataset", "train-transform", "algorithm"])
def test_a_reference_the_node_did_not_allow_is_refused_before_it_is_imported(marker, key):
    name, flag = marker
    with pytest.raises(BadReference) as refused:
        allowed_code.check({key: f"{name}:make"}, {"partition-id": 0, "num-partitions": 1})
    text = str(refused.value)
    assert "\n" not in text and f"{key}='{name}:make'" in text and "allow-code" in text
    assert not flag.exists() and name not in sys.modules  # neither imported nor called


@pytest.mark.parametrize("entries, allowed", [
    ("*", True), ("{m}", True), ("{m}:make", True), ("{m}:other", False), ("{m}x", False),
    ("other, {m}", True), ("", False),
])
def test_the_node_config_allow_list(marker, entries, allowed):
    name, _ = marker
    node = {"allow-code": entries.format(m=name)}
    assert (allowed_code.refusal({"model": f"{name}:make"}, node) is None) is allowed


def test_a_module_allows_its_submodules_and_the_environment_is_a_second_list(monkeypatch):
    monkeypatch.delenv(allowed_code.ALLOW_ENV, raising=False)
    assert allowed_code.refusal({"model": "mypkg.nets.res:resnet"}, {"allow-code": "mypkg"}) is None
    assert allowed_code.refusal({"model": "mypkgs.nets:resnet"}, {"allow-code": "mypkg"}) is not None
    monkeypatch.setenv(allowed_code.ALLOW_ENV, "mypkg.nets")
    assert allowed_code.refusal({"model": "mypkg.nets.res:resnet"}, {}) is None
    assert allowed_code.refusal({"model": "mypkg.other:x"}, {}) is not None


def test_code_inside_a_flower_app_the_node_installed_is_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv(allowed_code.ALLOW_ENV, raising=False)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    app = tmp_path / "flwr" / "apps" / "me.app.1-0-0.abcdef12"
    app.mkdir(parents=True)
    (app / "fab_nets.py").write_text("def net(): pass\n")
    monkeypatch.syspath_prepend(str(app))
    assert allowed_code.refusal({"model": "fab_nets:net"}, {}) is None
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "other_nets.py").write_text("def net(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    assert allowed_code.refusal({"model": "other_nets:net"}, {}) is not None


def test_flatflowers_own_engines_allow_what_their_user_names():
    from flatflower.common.config import RunConfig
    from flatflower.runtime.engines import allow_code

    env = allow_code({allowed_code.ALLOW_ENV: "theirs"}, ["mymods.nets:resnet", "data_mod:load"])
    assert env[allowed_code.ALLOW_ENV] == "theirs,mymods.nets,data_mod"
    import flatflower  # noqa: F401 - the in-process grid's nodes: one process, one person

    from flatflower.runtime.engines.inprocess import InProcessGrid
    from flatflower.client.app import app as client_app

    grid = InProcessGrid(client_app, 2, RunConfig.from_mapping({"algorithm": "fedavg"}).to_dict())
    assert all(ctx.node_config["allow-code"] == "*" for ctx in grid.contexts.values())


@pytest.mark.slow
@pytest.mark.integration
def test_a_run_config_cannot_make_real_supernodes_delete_their_data(tmp_path, monkeypatch):
    """The issue's attack, as its attacker runs it: three SuperNodes whose operators allowed no
    code, each with its own data folder; a run config with dataset = shutil:rmtree and partition =
    local. Every node refuses at its handshake, the folders survive, and the server says why."""
    from flatflower.common.config import RunConfig
    from flatflower.runtime.engines.federation import LocalFederation

    monkeypatch.delenv(allowed_code.ALLOW_ENV, raising=False)
    folders = sites(tmp_path / "data")
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*"))
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    config = {**local_config(tmp_path), "dataset": "shutil:rmtree", "run-dir": str(run_dir),
              "min-available-nodes": 3, "num-partitions": 3, "round-timeout": round_deadline(fresh=True)}
    values = RunConfig.from_mapping(config).to_dict()
    with LocalFederation(3, tmp_path / "work", run_dir / "logs", node_configs=node_configs(folders)) as fed:
        run_id = fed.submit(ROOT, values)
        row = fed.wait(run_id, 500, poll=0.5)
        fed.save_log(run_id, run_dir / "logs" / "run.log")
    assert row["status"] != "finished:completed"
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*")) == before
    log = (run_dir / "logs" / "run.log").read_text() + json.dumps(row)
    assert "this node does not run dataset='shutil:rmtree'" in log, log[-3000:]
