"""Records a forger cannot rewrite, and the code a resume runs (issue 58, items 3 and 4).

Run as the attacker and the careless operator would: real runs of the ServerApp and its
ClientApps (in-process, through the command line), then the run directory changed by hand,
then ``flatflower simulate --resume`` and ``flatflower report``.

* manifest.json is sealed (HMAC-SHA256) under the user's record key, kept outside the run
  directory (server/recordkey.py): privacy.jsonl's sampling rate rewritten from 0.6 to 0.01
  *together with* its manifest entry (a sha256 is no secret) is refused on resume and in the
  report, in one line; so is any file rewritten with its entry.
* the report's privacy is its ledger's, recomputed through the accountant: metrics.jsonl's
  dp_epsilon edited to 0.10 is not what it shows.
* a directory sealed by another key (copied from another machine or user), or not sealed,
  or without a manifest: one line; refused on resume unless the user trusts it
  (--trust-run-dir), a warning in the report.
* the key file is made on first use, mode 0600 in a 0700 folder; one others can read, or a
  link, is refused in one line.
* a referenced module (and flatflower itself) changed between the run and its resume: refused
  in one line naming it, or, with --allow-code-change, resumed with the change in config.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

import flatflower.runtime.engines.inprocess  # noqa: F401  (flwr's log handler: see tests/test_bad_input.py)
from flatflower.common.privacy import PrivacyLedger
from flatflower.server import codeid, manifest, recordkey
from flatflower.server.manifest import MANIFEST
from flatflower.tools.cli import main
from tests.helpers import user_module_file
from tests.test_bad_input import USAGE, run_cli
from tests.test_integrity import BASE, refused

DP = ["--algorithm", "fedavg", "--set", "dp.clip=1.0", "--set", "dp.noise-multiplier=0.8",
      "--set", "aggregation=uniform", "--fraction", "0.6"]
RESUME = ["simulate", "--engine", "inprocess", "--resume", "{tmp}/run", "--rounds", "3"]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory) -> Path:
    """fedavg under client-level DP, 5 clients, 3 sampled a round (q = 0.6), 2 rounds."""
    run_dir = tmp_path_factory.mktemp("dp") / "run"
    argv = [*BASE, *DP, "--rounds", "2", "--run-dir", str(run_dir)]
    argv[argv.index("--clients") + 1] = "5"
    assert main(argv) == 0
    return run_dir


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "run"))


def moved(run: Path) -> Path:
    """A copy of ``run`` beside it: this process keeps its claim on a directory it tried to
    resume (prepare.py), so each further resume here is of a copy."""
    i = 2
    while (to := run.with_name(f"{run.name}-{i}")).exists():
        i += 1
    return Path(shutil.copytree(run, to))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def rewrite_with_entry(run: Path, name: str, change) -> None:
    """What a forger does: change the log ``name`` (``change(rows)``) and write its digest
    into manifest.json's entry, as flatflower would have."""
    rows = _rows(run / name)
    change(rows)
    _write_rows(run / name, rows)
    data = json.loads((run / MANIFEST).read_text())
    data["prefixes"][name] = [manifest.file_digest(run / name)]
    (run / MANIFEST).write_text(json.dumps(data, indent=1))


def forge_ledger(run: Path) -> None:
    def lower(rows):
        assert {r["dp_sampling_rate"] for r in rows} == {0.6}
        for r in rows:
            r["dp_sampling_rate"] = 0.01
    rewrite_with_entry(run, "privacy.jsonl", lower)


def report(tmp_path: Path, capfd, *runs: Path) -> tuple[int, dict | None, list[str]]:
    """``flatflower report RUNS --json``: (exit code, the JSON, stderr's lines)."""
    out = tmp_path / "out"
    capfd.readouterr()
    code = main(["report", *map(str, runs), "--out", str(out / "r.png"), "--json", str(out / "r.json")])
    err = own_lines(capfd.readouterr().err)
    assert not any("Traceback" in line for line in err)
    return code, (json.loads((out / "r.json").read_text()) if code == 0 else None), err


def own_lines(err: str) -> list[str]:
    """stderr's lines but the report's note on a modified checkout (tests run from one)."""
    return [line for line in err.splitlines() if line.strip() and "locally modified flatflower code" not in line]


def ledger_epsilon(run: Path, delta: float = 1e-5) -> float:
    ledger = PrivacyLedger()
    for row in _rows(run / "privacy.jsonl"):
        ledger.add_round(row["dp_sampling_rate"], row["dp_noise_multiplier"])
    return ledger.epsilon(delta)


# ------------------------------------------------------------------------- a forged ledger
def test_a_ledger_forged_with_its_manifest_entry_is_refused_on_resume_and_in_the_report(tmp_path, capfd, dp_run):
    run = _copy(dp_run, tmp_path)
    honest = ledger_epsilon(run)
    forge_ledger(run)
    assert ledger_epsilon(run) < honest / 2  # what the forger wanted the report to say
    assert manifest.check_files(run, manifest.read(run), ["privacy.jsonl"]) == {"privacy.jsonl": None}
    refused(RESUME, tmp_path, capfd, "{tmp}/run/manifest.json does not match its seal ... the resume refuses")
    code, _, err = report(tmp_path, capfd, run)
    assert code == USAGE and len(err) == 1 and err[0].startswith("error: ")
    assert f"{run}/manifest.json does not match its seal" in err[0] and "the report refuses" in err[0]


def test_any_file_rewritten_with_its_entry_is_refused(tmp_path, capfd, dp_run):
    """The seal covers every entry: metrics.jsonl's accuracy rewritten with its digest too."""
    run = _copy(dp_run, tmp_path)
    rewrite_with_entry(run, "metrics.jsonl", lambda rows: rows[-1].update(test_accuracy=0.99))
    refused(RESUME, tmp_path, capfd, "manifest.json does not match its seal")
    assert report(tmp_path, capfd, run)[0] == USAGE


def test_the_report_shows_the_ledgers_epsilon_never_metrics_jsonls(tmp_path, capfd, dp_run):
    """metrics.jsonl's dp_epsilon edited to 0.10: the report shows (table, JSON, CSV) the
    ledger's, with one warning naming the file; the honest run's equals it bit for bit."""
    code, data, err = report(tmp_path, capfd, dp_run)
    assert code == 0 and err == [], err
    spent = data["runs"][0]["dp_epsilon"]
    assert spent == _rows(dp_run / "metrics.jsonl")[-1]["dp_epsilon"] == ledger_epsilon(dp_run)
    run = _copy(dp_run, tmp_path)
    rows = _rows(run / "metrics.jsonl")
    rows[-1]["dp_epsilon"] = 0.10
    _write_rows(run / "metrics.jsonl", rows)
    capfd.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "o2" / "r.png"), "--json", str(tmp_path / "o2" / "r.json"),
                 "--csv", str(tmp_path / "o2" / "rows.csv")]) == 0
    err = own_lines(capfd.readouterr().err)
    assert json.loads((tmp_path / "o2" / "r.json").read_text())["runs"][0]["dp_epsilon"] == spent
    assert f"{run}/metrics.jsonl's dp_epsilon is not its ledger's at rounds [2]" in "\n".join(err)
    assert f"{run}/metrics.jsonl (its rows up to the checkpoint) is" in "\n".join(err)  # and the edit itself
    assert all(line.startswith("warning: ") for line in err) and len(err) == 2, err
    import csv

    with (tmp_path / "o2" / "rows.csv").open(newline="") as f:
        assert [r["dp_epsilon"] for r in csv.DictReader(f)][-1] == repr(spent)


def test_a_ledger_edited_without_its_entry_is_refused_by_the_report(tmp_path, capfd, dp_run):
    run = _copy(dp_run, tmp_path)
    rows = _rows(run / "privacy.jsonl")
    rows[0]["dp_sampling_rate"] = 0.01
    _write_rows(run / "privacy.jsonl", rows)
    code, _, err = report(tmp_path, capfd, run)
    assert code == USAGE and len(err) == 1
    assert f"{run}/privacy.jsonl (its rows up to the checkpoint) is changed" in err[0]
    assert "the report refuses its privacy numbers" in err[0]


# ------------------------------------------------------------------------- another key, no seal
@pytest.fixture
def other_key(tmp_path, monkeypatch) -> Path:
    """This user's key is another than the one the module's runs were sealed with."""
    path = tmp_path / "elsewhere" / "record.key"
    monkeypatch.setenv(recordkey.ENV, str(path))
    recordkey.load(create=True)
    return path


def test_a_directory_sealed_by_another_key_is_one_line_and_resumes_when_trusted(tmp_path, capfd, dp_run, other_key):
    """Copied from another machine or user: its seal names another key. The resume refuses
    it in one line, the report warns in one line; --trust-run-dir resumes it (its digests still
    checked), records that, and seals it under this key, so the next resume needs nothing."""
    run = _copy(dp_run, tmp_path)
    sealed_by = manifest.read(run)["seal"]["key_id"]
    line = refused(RESUME, tmp_path, capfd, f"{{tmp}}/run/manifest.json is sealed by another record key ({sealed_by}; "
                   "yours ... --trust-run-dir")
    assert "its files cannot be told from a forger's" in line
    code, data, err = report(tmp_path, capfd, run)
    assert code == 0 and len(err) == 1 and err[0].startswith("warning: ") and "another record key" in err[0]
    assert data["runs"][0]["dp_epsilon"] == ledger_epsilon(run)
    run = moved(run)
    assert main(["simulate", "--engine", "inprocess", "--resume", str(run), "--rounds", "3", "--trust-run-dir"]) == 0
    seal = manifest.read(run)["seal"]
    assert seal["key_id"] == recordkey.load().id != sealed_by
    (note,) = json.loads((run / "config.json").read_text())["resume_notes"]
    assert note["from_round"] == 3 and "another record key" in note["note"]
    assert main(["simulate", "--engine", "inprocess", "--resume", str(moved(run)), "--rounds", "4"]) == 0


def test_trust_does_not_cover_a_file_changed_since_its_record(tmp_path, capfd, dp_run, other_key):
    run = _copy(dp_run, tmp_path)
    rows = _rows(run / "privacy.jsonl")
    rows[0]["dp_sampling_rate"] = 0.01
    _write_rows(run / "privacy.jsonl", rows)
    refused([*RESUME, "--trust-run-dir"], tmp_path, capfd, "privacy.jsonl (its rows up to the checkpoint) is changed")


def test_an_unsealed_manifest_is_refused_unless_trusted_and_the_report_warns(tmp_path, capfd, dp_run):
    """An older flatflower's manifest (no seal), or a forger's with the seal taken off."""
    run = _copy(dp_run, tmp_path)
    data = json.loads((run / MANIFEST).read_text())
    data.pop("seal")
    (run / MANIFEST).write_text(json.dumps(data))
    refused(RESUME, tmp_path, capfd, "{tmp}/run/manifest.json is not sealed ... --trust-run-dir")
    code, _, err = report(tmp_path, capfd, run)
    assert code == 0 and len(err) == 1 and "is not sealed" in err[0] and err[0].startswith("warning: ")
    run = moved(run)
    (run / MANIFEST).unlink()
    refused(["simulate", "--engine", "inprocess", "--resume", str(run), "--rounds", "3"], tmp_path, capfd,
            f"{run} has no manifest.json ... --trust-run-dir")
    code, _, err = report(tmp_path, capfd, run)  # a DP run: its ledger unchecked is worth a line
    assert code == 0 and len(err) == 1 and "has no manifest.json" in err[0]


def test_the_python_api_takes_the_trust_from_the_environment(tmp_path, dp_run, other_key, monkeypatch):
    """The ServerApp's own setup (run_inprocess, `flwr run`): FLATFLOWER_TRUST_RUN_DIR names
    the run directory it trusts, and no other."""
    from flatflower.runtime.engines.inprocess import run_inprocess
    from flatflower.server.rundir import RunDirError

    run = _copy(dp_run, tmp_path)
    config = {**json.loads((run / "config.json").read_text())["config"], "num-server-rounds": 3, "resume": True,
              "run-dir": str(run)}
    with pytest.raises(RunDirError, match="sealed by another record key"):
        run_inprocess(config, 5)
    monkeypatch.setenv(manifest.TRUST_ENV, str(tmp_path / "another-run"))
    with pytest.raises(RunDirError, match="sealed by another record key"):
        run_inprocess(config, 5)
    monkeypatch.setenv(manifest.TRUST_ENV, str(run))
    run_inprocess(config, 5)
    assert _rows(run / "metrics.jsonl")[-1]["round"] == 3


# ------------------------------------------------------------------------- the key itself
def test_the_key_is_made_on_first_use_0600_in_a_0700_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(recordkey.ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    path = tmp_path / "config" / "flatflower" / "record.key"
    assert recordkey.key_path() == path and recordkey.load(create=False) is None
    run = tmp_path / "run"
    assert main([*BASE, "--algorithm", "fedavg", "--rounds", "1", "--run-dir", str(run)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    key = recordkey.load()
    assert len(path.read_text().strip()) == 64 and manifest.read(run)["seal"]["key_id"] == key.id
    assert key.secret.hex() not in (run / MANIFEST).read_text()
    assert recordkey.load() == key  # used, never replaced
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert recordkey.key_path() == tmp_path / "home" / ".config" / "flatflower" / "record.key"


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.chmod(0o644), "is readable or writable by others (mode 0644"),
    (lambda p: p.write_text("not a key\n"), "is not a flatflower record key (64 hex digits)"),
    (lambda p: (p.rename(p.with_name("real")), p.symlink_to(p.with_name("real"))), "is a symbolic link"),
])
def test_a_key_file_that_cannot_be_trusted_is_refused_in_one_line(tmp_path, capfd, other_key, damage, message):
    recordkey.load(create=True)
    damage(other_key)
    code, _, err = run_cli([*BASE, "--algorithm", "fedavg", "--rounds", "1", "--run-dir", "{tmp}/run"], tmp_path, capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == USAGE and len(lines) == 1 and f"the record key {other_key} " in lines[0] and message in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_two_runs_making_the_key_at_once_share_it(tmp_path, other_key):
    """Created atomically (a temporary file linked to its name): the first one made is
    everyone's."""
    from concurrent.futures import ThreadPoolExecutor

    recordkey._CACHE.clear()
    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda _: recordkey._create(other_key), range(8)))
    assert len({k.secret for k in keys}) == 1 and sorted(os.listdir(other_key.parent)) == ["record.key"]


def test_the_seal_statuses():
    key, other = recordkey.RecordKey(Path("a"), b"a" * 32), recordkey.RecordKey(Path("b"), b"b" * 32)
    data = recordkey.seal({"files": {"x": 1}}, key)
    assert recordkey.check(data, key) == recordkey.SEALED
    assert recordkey.check(data, other) == recordkey.OTHER_KEY
    assert recordkey.check(data, None) == recordkey.OTHER_KEY
    assert recordkey.check({**data, "files": {"x": 2}}, key) == recordkey.BROKEN
    assert recordkey.check({**data, "seal": "x"}, key) == recordkey.BROKEN
    assert recordkey.check({"files": {}}, key) == recordkey.UNSEALED


# ------------------------------------------------------------------------- code identity
MODULE = """
    from torch import nn

    def model(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(20, num_classes){extra})
"""


@pytest.fixture
def mymods(tmp_path, monkeypatch):
    yield from user_module_file(tmp_path, monkeypatch, "mymods", MODULE.format(extra=""))


def test_a_module_changed_between_run_and_resume_is_refused_naming_it_or_allowed(tmp_path, capfd, mymods):
    """The issue's break: the same `mymods:model` reference, a layer added to its module after
    the run (one without parameters, so the checkpoint still loads), resumed with exit 0 and no
    word. Now: one line naming the module; --allow-code-change resumes and config.json keeps
    what changed; a resume after that compares with the new code."""
    run = tmp_path / "run"
    argv = [*BASE, "--algorithm", "fedavg", "--rounds", "2", "--run-dir", str(run)]
    argv[argv.index("--model") + 1] = f"{mymods}:model"
    assert main(argv) == 0
    recorded = json.loads((run / "config.json").read_text())["code"]
    source = tmp_path / f"{mymods}.py"
    assert recorded["modules"][mymods]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert recorded["modules"][mymods]["references"] == {"model": f"{mymods}:model"}
    assert recorded["flatflower"] == codeid.flatflower_identity()

    import textwrap
    source.write_text(textwrap.dedent(MODULE.format(extra=", nn.Identity()")))
    sys.modules.pop(mymods, None)  # a new process would import the new file
    line = refused(RESUME, tmp_path, capfd, f"its code changed since the run last started: module {mymods} "
                   f"(model = '{mymods}:model'; {source}): sha256 ... --allow-code-change")
    assert line.count("sha256") == 1  # the module alone: flatflower is the one the run ran
    capfd.readouterr()
    run = moved(run)
    assert main(["simulate", "--engine", "inprocess", "--resume", str(run), "--rounds", "3", "--allow-code-change"]) == 0
    assert f"note: resumed with changed code (--allow-code-change): module {mymods}" in capfd.readouterr().out
    config = json.loads((run / "config.json").read_text())
    (note,) = config["resume_notes"]
    assert note["from_round"] == 3 and f"module {mymods}" in note["note"]
    assert config["code"]["modules"][mymods]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    run = moved(run)
    assert main(["simulate", "--engine", "inprocess", "--resume", str(run), "--rounds", "4"]) == 0
    assert len(json.loads((run / "config.json").read_text())["resume_notes"]) == 1


def test_a_changed_flatflower_is_refused_naming_it(tmp_path, capfd, dp_run, monkeypatch):
    _copy(dp_run, tmp_path)
    real = codeid.flatflower_identity()
    monkeypatch.setattr(codeid, "flatflower_identity", lambda: {**real, "sha256": "f" * 64, "version": "9.9"})
    refused(RESUME, tmp_path, capfd, f"its code changed since the run last started: flatflower {real['version']} "
            f"(sha256 {real['sha256'][:12]}) -> 9.9 (sha256 ffffffffffff ... --allow-code-change")


def test_a_record_of_the_code_rewritten_to_match_is_refused(tmp_path, capfd, dp_run, monkeypatch):
    """config.json is sealed with the manifest: its code record edited to the new code's digest
    passes the code check, and is refused as a changed file."""
    run = _copy(dp_run, tmp_path)
    real = codeid.flatflower_identity()
    monkeypatch.setattr(codeid, "flatflower_identity", lambda: {**real, "sha256": "f" * 64})
    config = json.loads((run / "config.json").read_text())
    config["code"]["flatflower"]["sha256"] = "f" * 64
    (run / "config.json").write_text(json.dumps(config, indent=1))
    refused(RESUME, tmp_path, capfd, "{tmp}/run/config.json is changed since the run wrote it")


def test_an_honest_resume_needs_no_flag_and_the_run_is_the_uninterrupted_one(tmp_path, dp_run):
    """Nothing changed: no flag, no note, no resume_notes; the ledger goes on."""
    run = _copy(dp_run, tmp_path)
    assert main(["simulate", "--engine", "inprocess", "--resume", str(run), "--rounds", "3"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert "resume_notes" not in config and [r["round"] for r in _rows(run / "privacy.jsonl")] == [1, 2, 3]
    assert torch.load(run / "model_final.pt", weights_only=True).keys()
