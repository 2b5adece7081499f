"""The prepared GPU benchmark (docs/benchmarks.md, "One GPU: the prepared benchmark") skips
cleanly, in one line, on a machine without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "results" / "gpu_bench.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure")
def test_gpu_bench_skips_in_one_line_without_cuda(capsys):
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    assert capsys.readouterr().out == "gpu bench: skipped, no CUDA device on this machine\n"
    assert not (SCRIPT.parent / "gpu-bench").exists() or not any((SCRIPT.parent / "gpu-bench").iterdir())


def test_make_bench_gpu_runs_the_script():
    makefile = (SCRIPT.parent.parent.parent / "Makefile").read_text()
    assert "bench-gpu:" in makefile and "docs/results/run_gpu_bench.sh" in makefile
    assert "gpu_bench.py" in (SCRIPT.parent / "run_gpu_bench.sh").read_text()


@pytest.mark.slow
def test_the_gpu_bench_runs_through_on_the_cpu_and_records_every_section(tmp_path):
    """``--cpu-dry-run`` (the script's own check, not a measurement) runs every section the GPU
    session will run and writes them to --out (never into the repository)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent.parent), "FLWR_HOME": str(tmp_path / "flwr"),
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run", "--out", str(tmp_path / "out")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "cpu-dry-run.json").read_text())
    assert [r["engine"] for r in report["study"]] == ["in-process", "in-process", "vectorised", "vectorised"]
    assert report["long"]["round_seconds"] and report["resnet18"]
    assert report["study_compiled"]["compile"] == "on" and report["study_compiled"]["round_seconds"]
    assert not (SCRIPT.parent / "gpu-bench").exists() or not any((SCRIPT.parent / "gpu-bench").iterdir())
