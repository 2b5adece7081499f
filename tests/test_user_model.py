"""Your own model: ``model = package.module:callable`` (common/models.py, common/references.py).

A model defined in a user's own file (written here in tmp_path, imported from that directory as
the user's working directory would be) trains with FedSAM, FedGMT, SCAFFOLD and FedDyn in the
in-process and the vectorised engines and in ``flatflower local`` (real processes, which get the
file's directory on their PYTHONPATH); every bad reference is one line naming the key and the
reference: in ``build_model``, in the CLI (exit code 2, one ``error:`` line), at a node's handshake.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import flatflower.runtime.engines.inprocess  # noqa: F401 (flwr's log handler: see tests/test_bad_input.py)
from flatflower.common.config import ConfigError, RunConfig
from flatflower.common.models import build_model, register_model
from flatflower.common.references import BadReference
from flatflower.strategies import registry  # noqa: F401 (registers the algorithms' keys)
from tests.test_bad_input import check_cli
from flatflower.runtime.engines.inprocess import run_inprocess

USER_MODELS = '''
import torch
from torch import nn


def tiny(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 16), nn.ReLU(), nn.Linear(16, num_classes))


def no_arguments():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def wrong_classes(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes + 1))


def not_a_module(input_shape, num_classes):
    return "resnet"


def frozen(input_shape, num_classes):
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def raises(input_shape, num_classes):
    raise RuntimeError("out of memory")


def bad_forward(input_shape, num_classes):
    return nn.Sequential(nn.Linear(3, num_classes))


def nan_output(input_shape, num_classes):
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
    nn.init.constant_(model[1].bias, float("nan"))
    return model


class NanOnData(nn.Module):
    """Finite on zero inputs (what build_model's own check feeds it), NaN on any real example."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(torch.sqrt(-x.abs()).flatten(1))


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's folder holding ``my_models_<id>.py`` (a fresh module name per test: imports are
    per process), on sys.path as the user's working directory is; the module name."""
    name = f"my_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def final(run_dir: Path) -> tuple[dict, list[dict]]:
    return (json.loads((run_dir / "summary.json").read_text()),
            [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


# ------------------------------------------------------------------ it trains, in every engine
@pytest.mark.parametrize("vectorized", [False, True], ids=["inprocess", "vectorized"])
@pytest.mark.parametrize("algorithm", ["fedsam", "fedgmt", "scaffold", "feddyn"])
def test_a_users_model_trains(user_dir, tmp_path, algorithm, vectorized):
    run_dir, _ = run_inprocess({"algorithm": algorithm, "dataset": "digits", "model": f"{user_dir}:tiny",
                                "num-server-rounds": 2, "local-steps": 2, "run-dir": str(tmp_path / "r")},
                               2, vectorized=vectorized)
    summary, rows = final(run_dir)
    assert summary["status"] == "completed"
    assert rows[-1]["test_loss"] < rows[0]["test_loss"]  # it learnt something in 2 rounds
    assert json.loads((run_dir / "config.json").read_text())["model"] == f"{user_dir}:tiny"
    init = torch.load(run_dir / "model_init.pt", weights_only=True)
    assert [tuple(v.shape) for v in init.values()] == [(16, 64), (16,), (10, 16), (10,)]


def test_the_seed_decides_a_users_initial_weights(user_dir):
    a, b = (build_model(f"{user_dir}:tiny", (1, 8, 8), 10, seed=3) for _ in range(2))
    c = build_model(f"{user_dir}:tiny", (1, 8, 8), 10, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a[1].weight, c[1].weight)


def test_a_builder_of_no_arguments(user_dir):
    model = build_model(f"{user_dir}:no_arguments", (1, 8, 8), 10)
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def test_register_model_is_in_process(tmp_path):
    register_model("tiny-registered", lambda shape, classes: nn.Sequential(nn.Flatten(), nn.Linear(64, classes)))
    assert RunConfig.from_mapping({"model": "tiny-registered"}).resolved_model() == "tiny-registered"
    run_dir, _ = run_inprocess({"algorithm": "fedavg", "dataset": "digits", "model": "tiny-registered",
                                "num-server-rounds": 1, "local-steps": 1, "run-dir": str(tmp_path / "r")}, 2)
    assert final(run_dir)[0]["status"] == "completed"
    for bad in ("auto", "cnn", "pkg.mod:fn", ""):
        with pytest.raises(ValueError, match="is not a new model name"):
            register_model(bad, nn.Linear)


def test_the_config_accepts_a_reference_without_importing_it():
    # the import and the checks happen where the model is built (preflight, ServerApp, ClientApp)
    assert RunConfig.from_mapping({"model": "not_yet_there.models:net"}).resolved_model() == "not_yet_there.models:net"
    with pytest.raises(ConfigError, match=r"model='vgg16' is not one of: .*or a reference package.module:callable"):
        RunConfig.from_mapping({"model": "vgg16"})


# ------------------------------------------------------------------ each bad reference: one line
BAD = [
    ("nowhere_module_xyz:net", "module 'nowhere_module_xyz' is not found on this machine"),
    ("{mod}:missing", "has no attribute 'missing'"),
    ("{mod}:NOT_CALLABLE", "NOT_CALLABLE is a int, not a callable"),
    ("{mod}:raises", "calling it raised RuntimeError: out of memory"),
    ("{mod}:not_a_module", "returned a str, not a torch.nn.Module"),
    ("{mod}:wrong_classes", "is (2, 11), not (2, 10)"),
    ("{mod}:frozen", "has no trainable parameters"),
    ("{mod}:bad_forward", "its forward pass on a batch of 2 inputs of shape (1, 8, 8) raised RuntimeError"),
]


@pytest.mark.parametrize("reference, message", BAD, ids=[m.split(" ")[0] if "{" not in r else r.split(":")[1]
                                                         for r, m in BAD])
def test_a_bad_reference_is_one_line_in_build_model(user_dir, reference, message):
    reference = reference.format(mod=user_dir)
    with pytest.raises(BadReference) as err:
        build_model(reference, (1, 8, 8), 10, seed=0)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"model={reference!r}") and message in text


@pytest.mark.parametrize("reference, message", BAD[:1] + BAD[4:6], ids=["not-found", "not-a-module", "wrong-classes"])
def test_a_bad_reference_is_one_error_line_in_the_cli(user_dir, tmp_path, capfd, caplog, reference, message):
    argv = ["simulate", "--engine", "inprocess", "--clients", "2", "--dataset", "digits", "--model",
            reference.format(mod=user_dir), "--rounds", "1", "--set", "local-steps=1", "--run-dir", "{tmp}/run"]
    check_cli(argv, tmp_path, capfd, caplog, 2, message)


@pytest.mark.parametrize("builder", ["nan_output", "NanOnData"])
def test_a_model_whose_output_is_not_finite_is_one_error_line_before_anything_starts(user_dir, tmp_path, capfd,
                                                                                     caplog, builder):
    """Issue 57, item 7: a model whose output is NaN passed the pre-run check and failed every
    client's first step later ("local loss became nan", a flattened traceback in the warnings).
    Its output on a sample batch of the run's data is checked before anything starts."""
    argv = ["simulate", "--engine", "inprocess", "--clients", "2", "--dataset", "digits", "--model",
            f"{user_dir}:{builder}", "--rounds", "1", "--set", "local-steps=1", "--run-dir", "{tmp}/run"]
    check_cli(argv, tmp_path, capfd, caplog, 2, f"model='{user_dir}:{builder}': its output on a sample batch "
              "(2 examples of the training split) is not finite (20 of 20 values are NaN or inf) before any training")


def test_a_node_without_the_module_answers_the_handshake_with_one_line(make_message):
    """A SuperNode on which the user's module is not installed fails the handshake with a
    BadReference naming the module; the server refuses the node with that one-line reason
    (Flower's error reply, as flatflower.strategies.participation.error_text shows it) before any round."""
    from flwr.app import ConfigRecord, Context, Error, Message, MessageType, RecordDict

    from flatflower.client.app import query
    from flatflower.common import protocol as P
    from flatflower.strategies.participation import error_text

    context = Context(run_id=1, node_id=1, state=RecordDict(),  # the operator allowed it; it is not installed
                      node_config={"partition-id": 0, "num-partitions": 2, "allow-code": "nowhere_module_abc"},
                      run_config={"dataset": "digits", "model": "nowhere_module_abc:net"})
    msg = make_message(RecordDict({P.CONFIG: ConfigRecord({P.NONCE: 7})}), message_type=MessageType.QUERY)
    with pytest.raises(BadReference) as err:
        query(msg, context)
    # what Flower's ClientApp runtime sends back for it, and what the server's log then says
    reply = Message(Error(code=2, reason=f"{type(err.value)}:<'{err.value}'>"), reply_to=msg)
    reason = error_text(reply)
    assert "\n" not in reason and reason.startswith("error 2: BadReference: model='nowhere_module_abc:net': "
                                                    "module 'nowhere_module_abc' is not found on this machine")


# ------------------------------------------------------------------ real processes
BN_MODEL = '''
from torch import nn


def bn_net(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * h * w, num_classes))
'''


@pytest.mark.integration
@pytest.mark.slow
def test_flatflower_local_trains_a_users_batchnorm_model_from_its_folder(tmp_path, monkeypatch, capsys):
    """``flatflower local`` (a real SuperLink and 2 SuperNodes, each a process of its own) with a
    model from the user's folder (a BatchNorm one, with SCAFFOLD's client state): the ServerApp
    and the ClientApps find it through the PYTHONPATH the engine hands them; the run ends with
    the in-process run's model, buffers included. About 30-40 s on 2 busy cores (slow)."""
    from tests.helpers import flower_pids
    from flatflower.tools.cli import main as cli

    name = f"user_bn_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(BN_MODEL)
    # on this process's sys.path only (not its working directory, which the processes it starts
    # share): the SuperNodes and the ServerApp can find it only through the PYTHONPATH handed to them
    monkeypatch.syspath_prepend(str(tmp_path))
    before = flower_pids()
    args = ["--algorithm", "scaffold", "--clients", "2", "--rounds", "2", "--dataset", "digits",
            "--model", f"{name}:bn_net", "--set", "local-steps=2"]
    t0 = time.monotonic()
    code = cli(["local", "--fast-poll", *args, "--run-dir", str(tmp_path / "dep"), "--timeout", "300"])
    took = time.monotonic() - t0
    out = capsys.readouterr().out
    assert code == 0, out
    assert flower_pids() - before == set()
    assert cli(["simulate", "--engine", "inprocess", *args, "--run-dir", str(tmp_path / "inp")]) == 0
    a, b = (torch.load(tmp_path / d / "model_final.pt", weights_only=True) for d in ("dep", "inp"))
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert a["1.num_batches_tracked"].dtype == torch.int64 and int(a["1.num_batches_tracked"]) == 4
    print(f"flatflower local with a user's model: {took:.1f}s")
    sys.modules.pop(name, None)


def test_the_engines_hand_the_users_folder_to_the_processes_they_start(user_dir, tmp_path, capsys):
    """run_local/run_ray put the folder of the run's own code on the PYTHONPATH of every process
    they start; a module inside the app directory but outside its FAB gets a note, since
    ``flwr run`` to a real deployment would not ship it."""
    from flatflower.runtime.engines import hand_user_code, outside_fab, user_code

    cfg = RunConfig.from_mapping({"model": f"{user_dir}:tiny"})
    texts, roots = user_code(cfg)
    assert texts == [f"{user_dir}:tiny"] and roots == [str(tmp_path)]
    env = hand_user_code({"PYTHONPATH": "/already"}, cfg, Path(__file__).resolve().parent.parent)
    assert env["PYTHONPATH"].split(":") == ["/already", str(tmp_path)]
    assert capsys.readouterr().out == ""  # not in the app directory: nothing to say
    # the same module seen as part of an app directory whose FAB holds common/ only
    (tmp_path / "pyproject.toml").write_text('[tool.flwr.app]\nfab-include = ["common/**/*.py"]\n')
    assert outside_fab(tmp_path, roots, texts) == [f"{user_dir}.py"]
    hand_user_code({}, cfg, tmp_path)
    note = capsys.readouterr().out.strip().splitlines()
    assert len(note) == 1 and note[0].startswith(f"note: {user_dir}.py (your code, in the app directory) is not in the FAB")
    # a zoo model: no code of the user's, nothing changes
    assert hand_user_code({"A": "1"}, RunConfig.from_mapping({}), tmp_path) == {"A": "1"}
