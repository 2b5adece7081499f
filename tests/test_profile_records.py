"""docs/benchmarks.md, "Where a round's time goes": its tables are the records in
docs/results/profile-cpu/ that docs/results/profile_round.py wrote (each row re-rendered here
from its JSON files is in the doc, and the doc has no other row), and the script still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "docs" / "results" / "profile-cpu"
SCRIPT = ROOT / "docs" / "results" / "profile_round.py"
SECTION = "### Where a round's time goes"
STAGES = ("client: open the train message", "client: local training", "client: reply", "server: validate replies",
          "server: aggregate", "server: clients.jsonl rows", "server: sample and send")


def runs() -> dict[tuple[str, str, str], list[dict]]:
    """(engine, local epochs, code) -> the records of its interleaved runs."""
    grouped: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for path in sorted(RECORDS.glob("*.json")):
        record = json.loads(path.read_text())
        grouped[(record["engine"], str(record["epochs"]), record["label"])].append(record)
    return grouped


def stage_ms(records: list[dict], stage: str) -> float:
    """A stage's ms per round, the mean over the runs (the training stage: either engine's)."""
    values = [sum(v for k, v in r["stage_ms_per_round"].items() if k.startswith(stage)) for r in records]
    return sum(values) / len(values)


def stage_rows() -> list[str]:
    rows = []
    for (engine, epochs, code), records in sorted(runs().items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2] != "134a88d")):
        best = min(r["round_seconds_best"] for r in records)
        cells = [engine, epochs, code, f"{best:.3f}", *(f"{stage_ms(records, s):.0f}" for s in STAGES)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def ratio_rows() -> list[str]:
    grouped, rows = runs(), []
    for epochs in sorted({k[1] for k in grouped}):
        for code in sorted({k[2] for k in grouped if k[1] == epochs}, key=lambda c: c != "134a88d"):
            inp = [r["round_seconds_best"] for r in grouped[("inprocess", epochs, code)]]
            vec = [r["round_seconds_best"] for r in grouped[("vectorized", epochs, code)]]
            rows.append(f"| {epochs} | {code} | {min(inp) / min(vec):.1f}x | "
                        f"{min(i / v for i, v in zip(inp, vec)):.1f}-{max(i / v for i, v in zip(inp, vec)):.1f}x |")
    return rows


OPS = ("aten::bmm", "aten::add", "aten::index", "aten::copy_", "aten::select", "aten::slice")


def ops_rows() -> list[str]:
    """The vectorised training's ops under torch.profiler (``--ops``), before and after."""
    before, after = (json.loads((RECORDS / "ops" / f"{code}-vectorized-e5.json").read_text())
                     for code in ("before", "after"))

    def cell(record: dict, op: str) -> str:
        value = record["top_ops_ms_per_round"].get(op)
        return "not in its top 15" if value is None else f"{value:.1f}"

    rows = [f"| all ops | {before['all_ops_ms_per_round']:.1f} | {after['all_ops_ms_per_round']:.1f} |"]
    return rows + [f"| `{op}` | {cell(before, op)} | {cell(after, op)} |" for op in OPS]


def compile_rows() -> list[str]:
    """In-process, vectorised and vectorised with ``compile = on``, measured side by side."""
    found: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)  # (mode, epochs) -> run -> record
    for path in sorted((RECORDS / "compile").glob("*.json")):
        mode, epochs, run = path.stem.split("-")
        record = json.loads(path.read_text())
        assert record["compile"] == ("on" if mode == "compiled" else "off") and f"e{record['epochs']}" == epochs
        found[(mode, epochs[1:])][run] = record
    rows = []
    for epochs in sorted({e for _, e in found}):
        rows.append(f"| {epochs} | {speedup_cells({m: found[(m, epochs)] for m in MODES})} |")
    return rows


MODES = ("inprocess", "eager", "compiled")


def speedup_cells(runs_of: dict[str, dict[str, dict]]) -> str:
    """mode -> run -> record: each mode's best round, the speed-ups of the best rounds over the
    in-process one, and the range of in-process over compiled across the interleaved runs."""
    best = {mode: min(r["round_seconds_best"] for r in rs.values()) for mode, rs in runs_of.items()}
    pairs = [runs_of["inprocess"][run]["round_seconds_best"] / runs_of["compiled"][run]["round_seconds_best"]
             for run in sorted(runs_of["compiled"])]
    return (f"{best['inprocess']:.3f} | {best['eager']:.3f} | {best['compiled']:.3f} | "
            f"{best['inprocess'] / best['eager']:.1f}x | {best['inprocess'] / best['compiled']:.1f}x | "
            f"{min(pairs):.1f}-{max(pairs):.1f}x")


def interleaved_records(folder: str) -> dict[tuple[str, str, str], dict[str, dict]]:
    """(code, mode, local epochs) -> run -> record, of ``folder`` (a change measured before and
    after, in-process, vectorised and vectorised with compile = on, in interleaved runs)."""
    found: dict[tuple[str, str, str], dict[str, dict]] = defaultdict(dict)
    for path in sorted((RECORDS / folder).glob("*.json")):
        code, mode, epochs, run = path.stem.split("-")
        record = json.loads(path.read_text())
        assert record["compile"] == ("on" if mode == "compiled" else "off") and f"e{record['epochs']}" == epochs
        assert record["engine"] == ("inprocess" if mode == "inprocess" else "vectorized")
        found[(record["label"], mode, epochs[1:])][run] = record
    return found


def by_epochs_and_code(folder: str, before: str):
    """(local epochs, code, mode -> run -> record) of ``folder``, epochs ascending, ``before``
    first within each."""
    found = interleaved_records(folder)
    codes = sorted({c for c, _, _ in found}, key=lambda c: c != before)
    for epochs in sorted({e for _, _, e in found}):
        for code in codes:
            yield epochs, code, {mode: found[(code, mode, epochs)] for mode in MODES}


def interleaved_rows(folder: str, before: str) -> list[str]:
    """Per local epochs and code (``before`` first): the best rounds of each mode and the
    speed-ups (the range: over the interleaved runs' pairs), then the stages of the in-process
    and compiled rounds."""
    rows, stages = [], []
    for epochs, code, runs_of in by_epochs_and_code(folder, before):
        rows.append(f"| {epochs} | {code} | {speedup_cells(runs_of)} |")
        for mode, name in (("inprocess", "in-process"), ("compiled", "vectorised, compile = on")):
            records = list(runs_of[mode].values())
            stages.append("| " + " | ".join([name, epochs, code, *(f"{stage_ms(records, s):.0f}" for s in STAGES)]) + " |")
    return rows + stages


RECHECKS = ("halves", "recheck-8-rounds", "recheck-20-rounds")  # re-measurements of the halves' code
SINCE_HALVES = (*RECHECKS, "shared-work")  # every campaign of the code since the halves, oldest first


def recheck_rows() -> list[str]:
    """The re-measurements (``recheck-*``: a campaign of 8 or of 20 rounds a run): per
    campaign, local epochs and code, the best rounds of each mode and the speed-ups."""
    return [f"| {folder.split('-')[1]} | {epochs} | {code} | {speedup_cells(runs_of)} |"
            for folder in RECHECKS[1:] for epochs, code, runs_of in by_epochs_and_code(folder, "34e92ce")]


def compiled_pairs(epochs: str) -> list[float]:
    """In-process over compiled best rounds, pair by pair, in every campaign of SINCE_HALVES
    (the code after the halves)."""
    pairs = []
    for folder in SINCE_HALVES:
        found = interleaved_records(folder)
        for code in {c for c, _, _ in found} - {"6df2e94"}:
            pairs += [found[(code, "inprocess", epochs)][run]["round_seconds_best"] / record["round_seconds_best"]
                      for run, record in found[(code, "compiled", epochs)].items()]
    return sorted(pairs)


def section() -> str:
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    start = doc.index(SECTION)
    end = doc.find("\n#", start + len(SECTION))
    return doc[start:end if end >= 0 else len(doc)]


def test_the_docs_tables_are_the_records():
    text = section()
    expected = stage_rows() + ratio_rows() + ops_rows() + compile_rows() + interleaved_rows("messages", "3b25b5a")
    expected += interleaved_rows("halves", "6df2e94") + recheck_rows() + interleaved_rows("shared-work", "343d29c")
    assert len(runs()) == 8 and all(len(r) == 2 for r in runs().values())
    missing = [row for row in expected if row not in text]
    assert not missing, "\n".join(missing)
    headers = ("| engine", "| local epochs", "| op ", "| rounds a run")  # (the tables' header rows)
    lines = [line.strip() for line in text.splitlines()]
    table_rows = [line for line in lines if line.startswith("| ") and not line.startswith(headers)
                  and not set(line) <= set("|- ")]
    assert sorted(table_rows) == sorted(expected)


def test_the_cores_a_compiled_round_keeps_busy_in_the_docs_are_the_records():
    """docs/benchmarks.md, "The second core": the CPU time over the wall time of the compiled
    five-epoch rounds, before and after the halves, across the interleaved runs."""
    found = interleaved_records("halves")

    def span(code: str) -> str:
        values = [r["cpu_over_wall"] for r in found[(code, "compiled", "5")].values()]
        return f"{min(values):.2f}-{max(values):.2f}"

    said = (f"(the process's CPU time over the wall time of its timed rounds, compiled, five epochs: "
            f"{span('6df2e94')} before, {span('6db0b5a')} after)")
    assert said in " ".join(section().split()), said


def test_the_speed_ups_the_docs_quote_are_the_records():
    """docs/engines.md and benchmarks.md's "5x target" quote the compiled vectorised round
    against the in-process one: the range and median over every interleaved pair of the
    code since the halves (SINCE_HALVES), at five epochs and at one, and how many reach 5x."""
    import statistics

    five, one = compiled_pairs("5"), compiled_pairs("1")
    assert len(five) == len(one) == 25
    engines = " ".join((ROOT / "docs" / "engines.md").read_text().split())
    said = (f"a round {five[0]:.1f}-{five[-1]:.1f}x faster than the in-process engine's "
            f"(median {statistics.median(five):.1f}x over {len(five)} pairs)")
    assert said in engines, said
    target = (f"across the {len(five)} pairs at five epochs, {five[0]:.1f}-{five[-1]:.1f}x, median "
              f"{statistics.median(five):.1f}x ({sum(p >= 5 for p in five)} of them 5x or more); at one "
              f"epoch, {one[0]:.1f}-{one[-1]:.1f}x, median {statistics.median(one):.1f}x")
    assert target in " ".join(section().split()), target


def test_the_profile_script_runs_and_records_every_stage(tmp_path):
    out = tmp_path / "profile.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_HOME": str(tmp_path / "flwr"),
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--engine", "vectorized", "--clients", "4", "--rounds", "3",
                           "--ops", "--label", "test", "--out", str(out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["label"] == "test" and record["engine"] == "vectorized" and record["round_seconds_best"] > 0
    measured = record["stage_ms_per_round"]
    for stage in STAGES:
        assert any(k.startswith(stage) and v > 0 for k, v in measured.items()), (stage, measured)
    assert record["all_ops_ms_per_round"] > 0
    assert any(op.startswith("aten::") for op in record["top_ops_ms_per_round"])
    assert 0 < record["cpu_over_wall"] < 2 * (os.cpu_count() or 1)  # CPU seconds per wall second
