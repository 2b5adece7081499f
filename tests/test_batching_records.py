"""docs/benchmarks.md, "Batching on a CPU": its table is the records in
docs/results/batching-cpu/ that docs/results/batching_rule.py wrote (every row re-rendered here
is in the doc, and the doc has no other row), the rule's column is what the engine's rule
decides today, and the counts the doc quotes are the records'; the script still runs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from flatflower.runtime.engines.vectorized import CONV_FLOPS_LIMIT, batching_rule

ROOT = Path(__file__).resolve().parent.parent
RECORDS = sorted((ROOT / "docs" / "results" / "batching-cpu").glob("*.json"))
SECTION = "### Batching on a CPU"


def cases() -> dict[tuple, list[dict]]:
    """(model, input shape, batch size) -> its rows, one per record (run), in run order."""
    out: dict[tuple, list[dict]] = {}
    for path in RECORDS:
        for row in json.loads(path.read_text())["rows"]:
            out.setdefault((row["model"], tuple(row["input_shape"]), row["batch_size"]), []).append(row)
    return out


def table_rows() -> list[str]:
    rows = []
    for (model, shape, batch), runs in sorted(cases().items(), key=lambda kv: (kv[1][0]["conv_flops"], kv[0])):
        flops = runs[0]["conv_flops"]
        rule = "batched" if batching_rule(flops, torch.device("cpu")) else "one by one"
        ratios = " / ".join(f"{r['batched_over_single']:.2f}" for r in runs)
        rows.append(f"| {model} | {'x'.join(map(str, shape))} | {batch} | {flops:.3g} | {ratios} | {rule} |")
    return rows


def section() -> str:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    start = text.index(SECTION)
    return text[start:text.index("\n#", start + len(SECTION))]


def test_the_docs_table_is_the_records():
    doc = [line for line in section().splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert RECORDS and doc == table_rows()


def test_the_counts_the_docs_quote_are_the_records():
    rows = [r for runs in cases().values() for r in runs]
    within = [r["batched_over_single"] for r in rows if r["conv_flops"] <= CONV_FLOPS_LIMIT]
    above = [r["batched_over_single"] for r in rows if r["conv_flops"] > CONV_FLOPS_LIMIT]
    text = " ".join(section().split())
    assert (f"batched was faster in {sum(x < 1 for x in within)} of {len(within)} measurements "
            f"(median {statistics.median(within):.2f}x;") in text
    assert (f"slower in {sum(x > 1 for x in above)} of {len(above)} (median "
            f"{statistics.median(above):.2f}x, never below {min(above):.2f}x)") in text
    assert f"`CONV_FLOPS_LIMIT` = {CONV_FLOPS_LIMIT:.2g}" in text


def test_the_script_runs_and_records_each_case(tmp_path, monkeypatch):
    """docs/results/batching_rule.py on two small cases, one repeat: a row per case with both
    CPU times and the FLOPs the rule reads."""
    import runpy
    import sys

    out = tmp_path / "run.json"
    script = ROOT / "docs" / "results" / "batching_rule.py"
    module = runpy.run_path(str(script), run_name="batching_rule")
    monkeypatch.setitem(module["main"].__globals__, "CASES", [("mlp", (1, 8, 8), (8,)), ("cnn", (1, 8, 8), (8,))])
    monkeypatch.setitem(module["main"].__globals__, "REPEATS", 1)
    monkeypatch.setattr(sys, "argv", ["batching_rule.py", "--out", str(out)])
    module["main"]()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["batch_size"]) for r in rows] == [("mlp", 8), ("cnn", 8)]
    assert rows[0]["conv_flops"] == 0 and rows[1]["conv_flops"] == 8 * 165_888
    assert all(r["cpu_batched_s"] > 0 and r["cpu_single_s"] > 0 for r in rows)
    assert all(r["batched_over_single"] == r["cpu_batched_s"] / r["cpu_single_s"] for r in rows)
