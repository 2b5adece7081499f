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
