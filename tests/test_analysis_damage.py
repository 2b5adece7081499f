"""The analysis commands read run directories that may be damaged, edited by hand or handed
over by someone else (issue 44, item 3): ``flatflower report``, ``flatness`` and
``landscape`` answer every damaged file with exactly one ``error: ...`` line and exit code 2,
never a traceback; text from a file never reaches the terminal unescaped.

One tiny real run is made per module and copied per case; each case damages one file in one
way (non-finite numbers, wrong JSON types, huge numbers, deep JSON, control characters and
escapes, a line cut short, an empty file, binary garbage, missing keys).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

import flatflower.runtime.engines.inprocess  # noqa: F401  (flwr's log handler: see tests/test_bad_input.py)
from flatflower.tools.cli import main

GARBAGE = random.Random(44).randbytes(3000)
DEEP = "[" * 100_000


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """fedavg, 3 clients, 2 rounds: metrics.jsonl, clients.jsonl, config.json, partition.json,
    model_init.pt, model_final.pt, checkpoint.pt (read-only: copy it)."""
    run_dir = tmp_path_factory.mktemp("analysis") / "run"
    assert main(["simulate", "--engine", "inprocess", "--algorithm", "fedavg", "--clients", "3", "--rounds", "2",
                 "--dataset", "synthetic", "--model", "logreg", "--partition", "iid", "--set", "local-steps=1",
                 "--no-tensorboard", "--run-dir", str(run_dir)]) == 0
    return run_dir


def line(number: int, change):
    """Replace line ``number`` of a JSON-lines file by ``change(its text, its row)``."""
    def damage(path: Path) -> None:
        lines = path.read_text().splitlines()
        lines[number] = change(lines[number], json.loads(lines[number]))
        path.write_text("".join(text + "\n" for text in lines))
    return damage


NUMBER = {"metrics.jsonl": "test_accuracy", "clients.jsonl": "update_norm"}  # a number each file holds


def field(key: str | None, text: str):
    """Line 1's ``key`` (None: the file's NUMBER) written as the raw JSON ``text`` (NaN,
    1e999, a string...)."""
    def damage(path: Path) -> None:
        name = key or NUMBER[path.name]
        line(1, lambda raw, row: json.dumps({**row, name: "@@"}).replace('"@@"', text))(path)
    return damage


def content(data: bytes | str):
    return lambda path: path.write_bytes(data if isinstance(data, bytes) else data.encode())


def cut_line(number: int):
    return line(number, lambda raw, row: raw[: len(raw) // 2])


def drop(key: str):
    return line(1, lambda raw, row: json.dumps({k: v for k, v in row.items() if k != key}))


# (damage, message in the error line) per JSON-lines file; message None: the report runs (exit 0)
JSONL_DAMAGE = {
    "nan": (field(None, "NaN"), "not a number flatflower writes"),
    "infinity": (field(None, "Infinity"), "not a number flatflower writes"),
    "beyond-float": (field(None, "1e999"), "beyond any float"),
    "huge-int-round": (field("round", "1" + "0" * 400), "round is"),
    "int-too-long-for-python": (field("round", "1" * 5000), "line 2"),
    "round-a-string": (field("round", '"1"'), "round is '1'"),
    "round-a-bool": (field("round", "true"), "round is True"),
    "negative-round": (field("round", "-1"), "round is -1"),
    "row-a-list": (line(1, lambda raw, row: "[1, 2]"), "not a JSON object (a list)"),
    "row-a-number": (line(1, lambda raw, row: "7"), "not a JSON object (a int)"),
    "deep-line": (line(1, lambda raw, row: DEEP), "nested too deeply"),
    "deep-field": (field(None, "[" * 50_000 + "]" * 50_000), "nested too deeply"),
    "control-characters": (field(None, json.dumps("\x1b[2J\x1b[31m\u202e[/]")), "\\x1b[2J"),
    "cut-short": (cut_line(1), "line 2: not a JSON line"),
    "binary-garbage": (content(GARBAGE), "is not UTF-8 text"),
    "missing-round": (drop("round"), "no round"),
}
METRICS_ONLY = {  # fields of metrics.jsonl the report reads
    "accuracy-a-string": (field("test_accuracy", '"0.5"'), "test_accuracy is '0.5'"),
    "accuracy-above-one": (field("test_accuracy", "7.5"), "not a finite number in [0, 1]"),
    "loss-a-dict": (field("test_loss", '{"a": 1}'), "test_loss is"),
    "bytes-negative": (field("bytes_up", "-5"), "bytes_up is -5"),
    "bytes-huge": (field("bytes_down", "9" * 300), "bytes_down is"),
    "seconds-a-list": (field("seconds", "[1]"), "seconds is [1]"),
    "empty": (content(b""), "no rounds recorded"),
    "only-a-line-being-written": (content('{"round": 0, "test_acc'), "no rounds recorded"),
}


def cases(name: str, extra: dict) -> list:
    return [pytest.param(name, damage, message, id=f"{name}-{case}")
            for case, (damage, message) in {**JSONL_DAMAGE, **extra}.items()]


REPORT_CASES = [
    *cases("metrics.jsonl", METRICS_ONLY),
    *cases("clients.jsonl", {"empty": (content(b""), None),  # no client rows yet: no drift table
                             "control-characters": (field(None, json.dumps("\x1b[2J[/]")), None)}),
    # config.json: what the report needs of it is a JSON object; the rest is shown escaped
    pytest.param("config.json", content(GARBAGE), "is not UTF-8 text", id="config-binary-garbage"),
    pytest.param("config.json", content(DEEP), "nested too deeply", id="config-deep"),
    pytest.param("config.json", content("[1]"), "not a JSON object (a list)", id="config-a-list"),
    pytest.param("config.json", content('{"config": {"lr": NaN}}'), "not a number flatflower writes",
                 id="config-nan"),
    pytest.param("config.json", content('{"config": {"seed": 1e999, "fedgf.threshold": Infinity}}'), None,
                 id="config-infinite-values"),  # a run-config value may be infinite (fedgf.threshold)
    pytest.param("config.json", content(""), "is not valid JSON", id="config-empty"),
    pytest.param("config.json", content('{"versions": 3}'), None, id="config-missing-keys"),
    pytest.param("config.json", content('{"config": {"algorithm": "\\u001b[2J[/]\\n", "seed": "x"}}'), None,
                 id="config-escapes-in-the-algorithm"),
    pytest.param("flatness.json", content(DEEP), None, id="flatness-json-deep"),
]


def one_line(capfd, code: int, message: str | None) -> None:
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err
    assert "\x1b" not in out + err  # a file's escape sequences are shown escaped, never sent
    if message is None:
        assert code == 0, err
        return
    lines = [text for text in err.splitlines() if text.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert message in lines[0], lines[0]


@pytest.mark.parametrize("name, damage, message", REPORT_CASES)
def test_report_answers_a_damaged_file_in_one_line(tmp_path, capfd, finished, name, damage, message):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    damage(run / name)
    capfd.readouterr()
    code = main(["report", str(run), "--out", str(tmp_path / "out" / "report.png"), "--runs-csv",
                 str(tmp_path / "out" / "runs.csv"), "--csv", str(tmp_path / "out" / "rows.csv")])
    one_line(capfd, code, message)
    if message is not None:
        assert not (tmp_path / "out").exists()  # nothing written


def test_the_stored_study_results_still_report(tmp_path, capfd):
    """The study results in the repository (docs/results) read as before."""
    runs = sorted(p.parent for p in Path("docs/results").glob("*/*/metrics.jsonl"))
    assert runs
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "r.png")]) == 0


def edit_model(change):
    def damage(path: Path) -> None:
        state = torch.load(path, weights_only=True)
        path.unlink()
        torch.save(change(state), path)
    return damage


def first(change):
    def edit(state):
        key = next(iter(state))
        state[key] = change(state[key])
        return state
    return edit


SAVED_CASES = [
    pytest.param("config.json", content(GARBAGE), "is not UTF-8 text", id="config-binary-garbage"),
    pytest.param("config.json", content(DEEP), "nested too deeply", id="config-deep"),
    pytest.param("config.json", content("[]"), "not a JSON object (a list)", id="config-a-list"),
    pytest.param("config.json", content('{"config": [1]}'), "'config' is not a JSON object", id="config-config-a-list"),
    pytest.param("config.json", content('{"config": {"lr": NaN}}'), "not a number flatflower writes",
                 id="config-nan"),
    pytest.param("config.json", content('{"model": "x"}'), "'config' is not a JSON object", id="config-missing-key"),
    pytest.param("config.json", content('{"config": {"lr": "\\u001b[2J"}}'), "config.json", id="config-escapes"),
    pytest.param("config.json", content(""), "is not valid JSON", id="config-empty"),
    pytest.param("model_final.pt", content(GARBAGE), "is corrupt or unreadable", id="model-binary-garbage"),
    pytest.param("model_final.pt", content(b""), "is corrupt or unreadable", id="model-empty"),
    pytest.param("model_final.pt", edit_model(first(lambda t: t.fill_(float("nan")))), "not finite", id="model-nan"),
    pytest.param("model_final.pt", edit_model(first(lambda t: t.fill_(float("inf")))), "not finite", id="model-inf"),
    pytest.param("model_final.pt", edit_model(first(torch.Tensor.double)), "dtype float64", id="model-float64"),
    pytest.param("model_final.pt", edit_model(first(lambda t: t[:1])), "does not fit", id="model-wrong-shape"),
    pytest.param("model_final.pt", edit_model(lambda s: dict(list(s.items())[1:])), "does not fit",
                 id="model-key-missing"),
    pytest.param("model_final.pt", edit_model(lambda s: [1, 2]), "holds no model state dict", id="model-a-list"),
    pytest.param("model_final.pt", edit_model(first(lambda t: t.tolist())), "holds no model state dict",
                 id="model-value-a-list"),
]
TRAIN_SPLIT_CASES = [
    pytest.param("partition.json", content(GARBAGE), "is not UTF-8 text", id="partition-binary-garbage"),
    pytest.param("partition.json", content(DEEP), "nested too deeply", id="partition-deep"),
    pytest.param("partition.json", content('{"partitions": {"0": [1e999]}}'), "beyond any float", id="partition-inf"),
    pytest.param("partition.json", content('{"partitions": {"0": [' + "9" * 400 + "]}}"), "lists of indices",
                 id="partition-huge-index"),
    pytest.param("partition.json", content('{"partitions": {"0": ["1"]}}'), "lists of indices",
                 id="partition-index-a-string"),
    pytest.param("partition.json", content('{"partitions": {"0": [1.5]}}'), "lists of indices",
                 id="partition-index-a-fraction"),
    pytest.param("partition.json", content('{"partitions": [[1]]}'), "lists of indices", id="partition-a-list"),
    pytest.param("partition.json", content('{"other": 1}'), "lists of indices", id="partition-missing-key"),
    pytest.param("partition.json", content('{"partitions": {"0": [99999999]}}'), "outside the training split",
                 id="partition-index-outside"),
]


@pytest.mark.parametrize("name, damage, message", [*SAVED_CASES, *TRAIN_SPLIT_CASES])
def test_flatness_answers_a_damaged_file_in_one_line(tmp_path, capfd, finished, name, damage, message):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    damage(run / name)
    capfd.readouterr()
    code = main(["flatness", str(run), "--split", "train", "--iters", "1", "--probes", "1"])
    one_line(capfd, code, message)


@pytest.mark.parametrize("name, damage, message", [
    *SAVED_CASES,
    *(pytest.param("model_init.pt", p.values[1], "does not fit" if p.values[2] == "does not fit" else p.values[2],
                   id=f"init-{p.id}") for p in SAVED_CASES if p.values[0] == "model_final.pt"),
])
def test_landscape_answers_a_damaged_file_in_one_line(tmp_path, capfd, finished, name, damage, message):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    damage(run / name)
    capfd.readouterr()
    code = main(["landscape", str(run), "--interpolate", "--steps", "3", "--out", str(tmp_path / "l.png")])
    one_line(capfd, code, message)
    assert not (tmp_path / "l.png").exists()
