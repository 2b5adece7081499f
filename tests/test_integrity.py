"""Run files that cannot lie silently (issue 44, item 3): manifest.json records the sha256
and size of every file a resume reads (server/manifest.py), and a resume verifies them before
anything starts; client state of the wrong shape, dtype or with non-finite values is refused
even without a manifest (an older run directory).

Each refusal: exit code 2, exactly one ``error: ...`` line naming the file, nothing on disk
changed. Two real run directories are made once per module (feddyn, with client state; a DP
run, with a privacy ledger) and copied per test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import flatflower.runtime.engines.inprocess  # noqa: F401  (flwr's log handler: see tests/test_bad_input.py)
from flatflower.server import manifest
from flatflower.server.manifest import MANIFEST, Manifest, ManifestError
from tests.test_bad_input import USAGE, assert_untouched, run_cli, snapshot
from flatflower.tools.cli import main

BASE = ["simulate", "--engine", "inprocess", "--clients", "3", "--dataset", "synthetic", "--model", "logreg",
        "--partition", "iid", "--set", "local-steps=1", "--no-tensorboard"]
RESUME = ["simulate", "--engine", "inprocess", "--resume", "{tmp}/run", "--rounds", "3"]


def _made(tmp_path_factory, name: str, *extra: str, rounds: int = 2) -> Path:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    assert main([*BASE, *extra, "--rounds", str(rounds), "--run-dir", str(run_dir)]) == 0
    assert (run_dir / MANIFEST).is_file()
    return run_dir


@pytest.fixture(scope="module")
def feddyn_run(tmp_path_factory) -> Path:
    """feddyn (client state: dual), 3 clients, 2 rounds (read-only: copy it)."""
    return _made(tmp_path_factory, "feddyn", "--algorithm", "feddyn")


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory) -> Path:
    """fedavg under client-level DP: privacy.jsonl (read-only: copy it)."""
    return _made(tmp_path_factory, "dp", "--algorithm", "fedavg", "--set", "dp.clip=1.0",
                 "--set", "dp.noise-multiplier=0.5", "--set", "aggregation=uniform")


def refused(argv, tmp: Path, capfd, message: str) -> str:
    """Exit 2, one ``error:`` line holding ``message``, no traceback, nothing on disk changed."""
    before = snapshot(tmp)
    code, out, err = run_cli(argv, tmp, capfd)
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == USAGE and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    for part in message.split(" ... "):  # "a ... b": both, in any order
        assert part.format(tmp=tmp) in lines[0], lines[0]
    assert_untouched(before, snapshot(tmp))
    return lines[0]


# ------------------------------------------------------------------------- damage to the files
STATE0, STATE2 = "client-state/partition-0/round-000002.pt", "client-state/partition-2/round-000002.pt"


def edit_tensor(name: str, change):
    """Load a torch file of the run, change it (``change(obj)``), save it back."""
    def setup(run: Path) -> None:
        obj = torch.load(run / name, weights_only=True)
        change(obj)
        torch.save(obj, run / name)
    return setup


def checkpoint_value_1e30(run: Path) -> None:
    """The first entry of the checkpoint's global model set to 1e30 in the file's own bytes: the
    checkpoint is right in every field and has its size (a torch.save of the edited checkpoint
    changes its size or not depending on the test's temporary path, which the pickle holds, and
    the message with it), so only the digest can tell."""
    path = run / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    tensor = next(iter(torch.load(path, weights_only=True)["strategy"]["model"].values()))
    raw = tensor.contiguous().numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0, "the tensor's bytes, once in the file"
    data[at:at + tensor.element_size()] = torch.tensor([1e30], dtype=tensor.dtype).numpy().tobytes()
    path.write_bytes(data)
    assert next(iter(torch.load(path, weights_only=True)["strategy"]["model"].values())).view(-1)[0] == 1e30


def dual(change):
    def edit(state) -> None:
        key = next(iter(state["dual"]))
        state["dual"][key] = change(state["dual"][key])
    return edit


def copy(src: str, dst: str):
    return lambda run: shutil.copyfile(run / src, run / dst)


def truncate(name: str, keep: float = 0.5):
    def setup(run: Path) -> None:
        data = (run / name).read_bytes()
        (run / name).write_bytes(data[: int(len(data) * keep)])
    return setup


def remove(name: str):
    return lambda run: (run / name).unlink()


def edit_line(name: str, number: int, change):
    """Change line ``number`` (0-based) of a JSON-lines file, as a careless edit would."""
    def setup(run: Path) -> None:
        lines = (run / name).read_text().splitlines()
        row = json.loads(lines[number])
        change(row)
        lines[number] = json.dumps(row)
        (run / name).write_text("".join(line + "\n" for line in lines))
    return setup


def edit_json(name: str, change):
    def setup(run: Path) -> None:
        data = json.loads((run / name).read_text())
        change(data)
        (run / name).write_text(json.dumps(data, indent=1))
    return setup


CASES = [
    # the checkpoint: what its own checks cannot tell from a real one
    pytest.param(checkpoint_value_1e30, "{tmp}/run/checkpoint.pt is changed since the run wrote it",
                 id="checkpoint-scalar-1e30"),
    pytest.param(truncate("checkpoint.pt"), "{tmp}/run/checkpoint.pt is corrupt or unreadable", id="checkpoint-truncated"),
    pytest.param(remove("checkpoint.pt"), "no checkpoint in {tmp}/run", id="checkpoint-deleted"),
    # the clients' state
    pytest.param(copy(STATE0, STATE2), f"{{tmp}}/run/{STATE2} is changed since the run wrote it",
                 id="client-state-swapped"),
    pytest.param(edit_tensor(STATE2, dual(lambda t: t * 1.5)), f"{{tmp}}/run/{STATE2} is changed",
                 id="client-state-scaled"),
    pytest.param(truncate(STATE2), f"{{tmp}}/run/{STATE2} is damaged or unreadable", id="client-state-truncated"),
    pytest.param(remove(STATE2), f"{{tmp}}/run/{STATE2} is missing", id="client-state-deleted"),
    pytest.param(edit_tensor(STATE2, dual(torch.Tensor.double)), f"{STATE2}: dual.1.weight has shape [10, 20] "
                 "and dtype float64; this run's model has shape [10, 20] and dtype float32",
                 id="client-state-float64"),
    pytest.param(edit_tensor(STATE2, dual(lambda t: t[:3])), f"{STATE2}: dual.1.weight has shape [3, 20]",
                 id="client-state-wrong-shape"),
    pytest.param(edit_tensor(STATE2, dual(lambda t: t.fill_(float("nan")))),
                 f"{STATE2}: dual.1.weight holds values that are not finite", id="client-state-nan"),
    pytest.param(edit_tensor(STATE2, dual(lambda t: t.fill_(float("inf")))),
                 f"{STATE2}: dual.1.weight holds values that are not finite", id="client-state-inf"),
    # config.json and partition.json
    pytest.param(edit_json("config.json", lambda d: d["config"].update({"round-timeout": 7.0})),
                 "{tmp}/run/config.json is ... the resume refuses it", id="config-json-edited"),
    pytest.param(edit_json("partition.json", lambda d: d["partitions"].update({"0": d["partitions"]["1"]})),
                 "{tmp}/run/partition.json is ... the resume refuses it", id="partition-json-swapped"),
    pytest.param(remove("partition.json"), "{tmp}/run/partition.json is missing", id="partition-json-deleted"),
    # the logs a resume keeps
    pytest.param(edit_line("metrics.jsonl", 1, lambda r: r.update(test_accuracy=0.99)),
                 "{tmp}/run/metrics.jsonl (its rows up to the checkpoint) is ... the resume refuses it",
                 id="metrics-row-edited"),
    pytest.param(truncate("metrics.jsonl", 0.6), "{tmp}/run/metrics.jsonl (its rows up to the checkpoint) is "
                 "shorter than the run wrote it", id="metrics-truncated"),
    pytest.param(remove("metrics.jsonl"), "{tmp}/run/metrics.jsonl is missing",
                 id="metrics-deleted"),
    pytest.param(edit_line("clients.jsonl", 0, lambda r: r.update(status="rejected")),
                 "{tmp}/run/clients.jsonl (its rows up to the checkpoint) is ... the resume refuses it",
                 id="clients-row-edited"),
    # the manifest itself
    pytest.param(lambda run: (run / MANIFEST).write_text("{not json"), "manifest.json is unreadable or damaged",
                 id="manifest-not-json"),
    pytest.param(lambda run: (run / MANIFEST).write_text("[" * 100_000), "manifest.json is unreadable or damaged",
                 id="manifest-nested-deeply"),
    pytest.param(edit_json(MANIFEST, lambda d: d["files"].update({"../../etc/passwd": d["files"]["config.json"]})),
                 "is not a path inside the run directory", id="manifest-path-outside"),
    pytest.param(edit_json(MANIFEST, lambda d: d["files"].pop("checkpoint.pt")),
                 "manifest.json does not match its seal", id="manifest-without-checkpoint"),  # issue 58: sealed
]


@pytest.mark.parametrize("damage, message", CASES)
def test_a_damaged_resume_input_is_refused_in_one_line(tmp_path, capfd, feddyn_run, damage, message):
    shutil.copytree(feddyn_run, tmp_path / "run")
    damage(tmp_path / "run")
    refused(RESUME, tmp_path, capfd, message)


DP_CASES = [
    pytest.param(edit_line("privacy.jsonl", 0, lambda r: r.update(dp_noise_multiplier=1000.0)),
                 "{tmp}/run/privacy.jsonl (its rows up to the checkpoint) is ... the resume refuses it",
                 id="ledger-noise-raised"),
    pytest.param(truncate("privacy.jsonl", 0.5), "privacy.jsonl (its rows up to the checkpoint) is shorter",
                 id="ledger-truncated"),
    pytest.param(remove("privacy.jsonl"), "{tmp}/run/privacy.jsonl is missing",
                 id="ledger-deleted"),
]


@pytest.mark.parametrize("damage, message", DP_CASES)
def test_a_damaged_privacy_ledger_is_refused_in_one_line(tmp_path, capfd, dp_run, damage, message):
    shutil.copytree(dp_run, tmp_path / "run")
    damage(tmp_path / "run")
    refused(RESUME, tmp_path, capfd, message)


NO_MANIFEST_CASES = [c for c in CASES if c.id in ("client-state-float64", "client-state-wrong-shape",
                                                  "client-state-nan", "client-state-inf")]


@pytest.mark.parametrize("damage, message", NO_MANIFEST_CASES)
def test_bad_client_state_is_refused_without_a_manifest_too(tmp_path, capfd, feddyn_run, damage, message):
    """An older run directory (no manifest): the tensors themselves are checked."""
    shutil.copytree(feddyn_run, tmp_path / "run")
    (tmp_path / "run" / MANIFEST).unlink()
    damage(tmp_path / "run")
    refused(RESUME, tmp_path, capfd, message)


# ------------------------------------------------------------------------- what still resumes
def _final(run: Path) -> dict:
    return torch.load(run / "model_final.pt", weights_only=True)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    return _made(tmp_path_factory, "full", "--algorithm", "feddyn", rounds=3)


def test_a_moved_run_directory_resumes_to_the_uninterrupted_model(tmp_path, feddyn_run, uninterrupted):
    """Paths in the manifest are relative: a copied (or moved) directory resumes, and a second
    resume of it (its manifest now of round 3, rewritten by the first) verifies too."""
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(feddyn_run, moved)
    assert main(["simulate", "--resume", str(moved), "--rounds", "3"]) == 0
    assert _same(_final(moved), _final(uninterrupted))
    assert manifest.read(moved)["round"] == 3
    assert manifest.verify(moved, sorted(moved.glob("client-state/*/round-000003.pt"))) == 3


def test_rows_appended_after_the_checkpoint_do_not_matter(tmp_path, feddyn_run, uninterrupted):
    """A run killed after its checkpoint left rows (and a line cut short) past it: the resume
    redoes those rounds, the prefix the checkpoint recorded is intact."""
    run = tmp_path / "run"
    shutil.copytree(feddyn_run, run)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({**row, "round": 3}) + '\n{"round": 4, "test_acc')
    assert main(["simulate", "--resume", str(run), "--rounds", "3"]) == 0
    assert _same(_final(run), _final(uninterrupted))
    assert [json.loads(line)["round"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_a_run_directory_without_a_manifest_resumes_only_when_trusted(tmp_path, capfd, feddyn_run, uninterrupted):
    """A run directory without a manifest (a flatflower that kept none, or one removed: what
    a forger would do) is refused in one line (issue 58); with --trust-run-dir it resumes
    (one note line, recorded in config.json), and gets a sealed manifest from the resume."""
    run = tmp_path / "run"
    shutil.copytree(feddyn_run, run)
    (run / MANIFEST).unlink()
    refused(RESUME, tmp_path, capfd, "{tmp}/run has no manifest.json ... --trust-run-dir")
    run = Path(shutil.copytree(run, tmp_path / "again"))  # this process keeps its claim on a directory it resumed
    capfd.readouterr()
    assert main(["simulate", "--resume", str(run), "--rounds", "3", "--trust-run-dir"]) == 0
    notes = [line for line in capfd.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "no manifest.json" in notes[0] and "unchecked" in notes[0]
    assert _same(_final(run), _final(uninterrupted))
    assert manifest.read(run)["round"] == 3 and manifest.read(run)["seal"]["algorithm"] == "hmac-sha256"
    (note,) = json.loads((run / "config.json").read_text())["resume_notes"]
    assert note["from_round"] == 3 and "--trust-run-dir" in note["note"]


class Crash(Exception):
    pass


def test_a_crash_while_a_checkpoint_is_written_leaves_a_resumable_directory(tmp_path, feddyn_run, uninterrupted):
    """The manifest accepts the old and the new checkpoint while the new one is written: a
    process killed in between (here: the write raises after the manifest's first step) leaves
    the old checkpoint, which resumes."""
    run = tmp_path / "run"
    shutil.copytree(feddyn_run, run)
    with pytest.raises(Crash), Manifest(run).checkpoint(3, b"the next checkpoint", []):
        raise Crash
    versions = manifest.read(run)["files"]["checkpoint.pt"]
    assert len(versions) == 2 and versions[0]["size"] == len(b"the next checkpoint")
    assert main(["simulate", "--resume", str(run), "--rounds", "3"]) == 0
    assert _same(_final(run), _final(uninterrupted))
    assert len(manifest.read(run)["files"]["checkpoint.pt"]) == 1


def test_a_crash_while_config_json_is_rewritten_leaves_a_resumable_directory(tmp_path, feddyn_run):
    run = tmp_path / "run"
    shutil.copytree(feddyn_run, run)
    with pytest.raises(Crash), Manifest(run).replacing("config.json", manifest.digest(b"{}")):
        raise Crash
    assert len(manifest.read(run)["files"]["config.json"]) == 2
    assert manifest.verify(run, []) == 2


def test_verify_names_a_needed_client_file_the_manifest_does_not_hold(tmp_path, feddyn_run):
    run = tmp_path / "run"
    shutil.copytree(feddyn_run, run)
    stray = run / "client-state" / "partition-0" / "round-000005.pt"
    shutil.copyfile(run / STATE0, stray)
    with pytest.raises(ManifestError, match="round-000005.pt is not in manifest.json"):
        manifest.verify(run, [stray])
    assert manifest.verify(run, [run / STATE0]) == 2


def test_client_side_state_check_names_the_file_and_the_tensor():
    """A client whose state lives in a node-local state-dir (which the server cannot see)
    checks the file it loads the same way (client/app.py: TrainCall.open)."""
    from collections import OrderedDict

    from flatflower.client.layout import Layout
    from flatflower.client.state import check_state
    from flatflower.common.models import build_model

    model = build_model("logreg", (4,), 3, seed=0)
    layout = Layout(model)
    good = OrderedDict((n, torch.zeros_like(p)) for n, p in zip(layout.names, layout.params))
    check_state({"dual": good}, layout, "f.pt")
    name = layout.names[0]
    for bad, message in ((good[name].double(), "dtype float64"), (good[name][:1], "shape"),
                         (torch.full_like(good[name], float("nan")), "not finite")):
        with pytest.raises(ValueError, match=f"f.pt: dual.{name} .*{message}"):
            check_state({"dual": {**good, name: bad}}, layout, "f.pt")
    with pytest.raises(ValueError, match="missing"):
        check_state({"dual": {}}, layout, "f.pt")


def test_a_node_local_state_file_that_does_not_fit_fails_that_client_in_one_line(tmp_path):
    """Node-local client state (node-config ``state-dir``, which the server cannot see): the
    client checks the file it loads and fails the round with the line naming file and tensor;
    it never trains with a float64 dual, and the other clients' round goes on."""
    from flatflower.runtime.engines.inprocess import run_inprocess

    config = {"algorithm": "feddyn", "dataset": "synthetic", "model": "logreg", "partition": "iid",
              "local-steps": 1, "num-server-rounds": 2, "run-dir": str(tmp_path / "run"), "tensorboard": False}
    nodes = {i: {"state-dir": str(tmp_path / f"node{i}")} for i in range(3)}
    run_inprocess(config, 3, node_configs=nodes)
    state_file = tmp_path / "node0" / "partition-0" / "round-000002.pt"
    edit_tensor(state_file.name, dual(torch.Tensor.double))(state_file.parent)
    run_dir, _ = run_inprocess({**config, "num-server-rounds": 3, "resume": True}, 3, node_configs=nodes)
    rows = [json.loads(text) for text in (run_dir / "clients.jsonl").read_text().splitlines()]
    mine = [r for r in rows if r["round"] == 3 and r["partition"] == 0]
    assert len(mine) == 1 and mine[0]["status"] == "failed"
    assert f"{state_file}: dual.1.weight has shape [10, 20] and dtype float64" in mine[0]["reason"]
    assert all(r["status"] == "accepted" for r in rows if r["round"] == 3 and r["partition"] != 0)


def test_the_python_api_refuses_a_damaged_resume_input_and_writes_nothing(tmp_path, feddyn_run):
    """run_inprocess (the ServerApp's own setup) refuses as the command line does, and leaves
    the directory as it found it (no failed summary.json over the run's)."""
    from flatflower.runtime.engines.inprocess import run_inprocess
    from flatflower.server.rundir import RunDirError

    run = tmp_path / "run"
    shutil.copytree(feddyn_run, run)
    copy(STATE0, STATE2)(run)
    config = json.loads((run / "config.json").read_text())["config"]
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError, match=f"{STATE2} is changed since the run wrote it"):
        run_inprocess({**config, "num-server-rounds": 3, "resume": True, "run-dir": str(run)}, 3)
    assert_untouched(before, snapshot(tmp_path))
