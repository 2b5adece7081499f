"""The machine a run ran on (server/machine.py): recorded in config.json by a real run, kept
and extended (never overwritten) by a resume on another machine, and named by
``flatflower report`` when the runs it compares come from different machines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flatflower.runtime.engines.inprocess  # noqa: F401  (flwr's log handler: see tests/test_bad_input.py)
from flatflower.server import machine
from flatflower.server.machine import ID_FIELDS, describe, fingerprint, history, machine_id
from flatflower.tools.cli import main

BASE = ["simulate", "--engine", "inprocess", "--clients", "3", "--dataset", "synthetic", "--model", "logreg",
        "--partition", "iid", "--set", "local-steps=1", "--no-tensorboard", "--algorithm", "feddyn"]


def machines(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "config.json").read_text())["machines"]


def test_the_fingerprint_names_what_moves_numbers():
    """CPU model and a digest of its flags, torch's kernel level (AVX2, AVX-512...), its build
    (BLAS, LAPACK, oneDNN, the whole torch.__config__.show() as a digest), numpy's BLAS and the
    threads; ``id`` changes with any of them, not with the kernel release or the core count."""
    fp = fingerprint()
    assert fp["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert fp["torch"] == torch.__version__ and fp["threads"] == torch.get_num_threads()
    assert fp["interop_threads"] == torch.get_num_interop_threads()
    assert fp["mkl"] == torch.backends.mkl.is_available()
    assert fp["torch_config"] == machine.short_digest(torch.__config__.show())
    assert set(ID_FIELDS) <= set(fp) and fp["cuda"] is None and fp["id"] == machine_id(fp)
    for field in ID_FIELDS:
        assert machine_id({**fp, field: "another"}) != fp["id"], field
    assert machine_id({**fp, "platform": "another kernel", "cpus": 999}) == fp["id"]
    assert describe(fp).endswith(f"(id {fp['id']})") and fp["cpu"] in describe(fp)


def test_history_appends_another_machine_and_keeps_the_same_one():
    a = {"id": "a" * 16, "cpu": "A"}
    b = {"id": "b" * 16, "cpu": "B"}
    first = history(None, a, 1)
    assert first == [{"from_round": 1, **a}]
    assert history(first, a, 5) == first  # the same machine: config.json as it was
    assert history(first, b, 5) == [*first, {"from_round": 5, **b}]
    assert history([*first, "junk", {"no": "id"}], b, 5) == [*first, {"from_round": 5, **b}]
    assert history({"not": "a list"}, b, 5) == [{"from_round": 5, **b}]


def test_a_run_records_its_machine_and_a_resume_elsewhere_adds_one(tmp_path, monkeypatch):
    """A real run: config.json's machines is this machine, with the server's threads
    (server-threads = 1). Resumed here: the list as it was. Resumed on a machine
    with another CPU (its fingerprint stubbed): a second entry from the round it resumed at,
    the first kept; the manifest vouches for the new config.json (a further resume passes)."""
    run = tmp_path / "run"
    assert main([*BASE, "--rounds", "2", "--run-dir", str(run)]) == 0
    (entry,) = machines(run)
    here = fingerprint()
    assert entry["from_round"] == 1 and entry["threads"] == 1 and entry["cpu"] == here["cpu"]
    assert entry["id"] == machine_id(entry) and entry["torch_config"] == here["torch_config"]
    assert main(["simulate", "--engine", "inprocess", "--resume", str(run), "--rounds", "3"]) == 0
    assert machines(run) == [entry]

    # each resume in a copy: this process keeps its claim on a directory it resumed
    static = machine._static()
    monkeypatch.setattr(machine, "_static", lambda: {**static, "cpu": "Another CPU", "cpu_capability": "AVX2"})
    assert main(["simulate", "--engine", "inprocess", "--resume", str(moved := copy(run, "b")), "--rounds", "5"]) == 0
    first, second = machines(moved)
    assert first == entry
    assert second["from_round"] == 4 and second["cpu"] == "Another CPU" and second["id"] != entry["id"]
    monkeypatch.undo()
    assert main(["simulate", "--engine", "inprocess", "--resume", str(back := copy(moved, "c")), "--rounds", "6"]) == 0
    assert [m["from_round"] for m in machines(back)] == [1, 4, 6]  # back here: a third stretch
    assert machines(back)[2]["id"] == entry["id"]


def copy(run: Path, name: str) -> Path:
    import shutil

    return Path(shutil.copytree(run, run.parent / name))


def _run_on(root: Path, name: str, seed: int, fp: dict | None) -> Path:
    from tests.test_report import write_run

    run_dir = write_run(root, name, [0.1, 0.5, 0.7], seed=seed)
    if fp is not None:
        data = json.loads((run_dir / "config.json").read_text())
        data["machines"] = [{"from_round": 1, **fp}]
        (run_dir / "config.json").write_text(json.dumps(data))
    return run_dir


def test_report_names_runs_of_different_machines(tmp_path, capsys):
    """One warning line naming each machine and its runs; report.json says so. Runs of one
    machine, or of a flatflower that recorded none, get no warning."""
    from flatflower.tools.report import main as report

    here = fingerprint()
    other = {**here, "cpu": "Other CPU", "cpu_capability": "AVX2"}
    other["id"] = machine_id(other)
    a, b = _run_on(tmp_path, "a", 0, here), _run_on(tmp_path, "b", 1, here)
    c, old = _run_on(tmp_path, "c", 2, other), _run_on(tmp_path, "old", 3, None)
    js = tmp_path / "r.json"
    assert report([str(a), str(b), str(old), "--out", str(tmp_path / "p.png"), "--json", str(js)]) == 0
    assert "machines" not in capsys.readouterr().err
    payload = json.loads(js.read_text())
    assert payload["different_machines"] is False and [g["runs"] for g in payload["machines"]] == [["a", "b"]]
    assert report([str(a), str(b), str(c), "--out", str(tmp_path / "p.png"), "--json", str(js)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "machines" in line]
    assert len(err) == 1 and err[0].startswith("warning: the runs ran on different machines, whose CPU kernels "
                                                "can move numbers from round 0 on (docs/run-directory.md): ")
    assert f"{describe(here)} (a, b); {describe(other)} (c)" in err[0]
    payload = json.loads(js.read_text())
    assert payload["different_machines"] is True
    assert [(g["id"], g["runs"]) for g in payload["machines"]] == [(here["id"], ["a", "b"]), (other["id"], ["c"])]


def test_a_run_resumed_on_another_machine_alone_is_named(tmp_path, capsys):
    from flatflower.tools.report import main as report

    here = fingerprint()
    other = {**here, "threads": 64}
    other["id"] = machine_id(other)
    run_dir = _run_on(tmp_path, "r", 0, here)
    data = json.loads((run_dir / "config.json").read_text())
    data["machines"].append({"from_round": 2, **other})
    (run_dir / "config.json").write_text(json.dumps(data))
    assert report([str(run_dir), "--out", str(tmp_path / "p.png")]) == 0
    err = capsys.readouterr().err
    assert "different machines" in err and f"{describe(here)} (r); {describe(other)} (r)" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_device_is_named():
    fp = fingerprint("cuda")
    assert fp["cuda"]["device"] == torch.cuda.get_device_name(0)
    assert fp["cuda"]["cuda"] == torch.version.cuda and fp["id"] != fingerprint()["id"]


def test_run_directory_md_documents_every_field_and_the_warning():
    """docs/run-directory.md's table of a machine entry names every field a run records, says
    which are no part of ``id``, and quotes report's warning as it is printed."""
    import re

    from tests.helpers import ROOT, markdown_section

    text = markdown_section((ROOT / "docs" / "run-directory.md").read_text(), "## Bit for bit, on the same machine")
    cells = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    documented = {name for cell in cells for name in re.findall(r"`([a-z_]+)`", cell)}
    assert documented == {*fingerprint(), "from_round"}
    assert set(fingerprint()) - {"id", *ID_FIELDS} == {"platform", "cpus"}
    assert "(all but `platform` and `cpus`)" in text and "(recorded, no part of `id`)" in text
    assert "`warning: the runs ran on different machines, whose CPU kernels can move numbers from round 0 on " \
           "...: AMD EPYC, AVX512, torch 2.14.1, threads 1 (id ...) (a, b); ... (c)`" in " ".join(text.split())
