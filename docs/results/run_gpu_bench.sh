#!/bin/bash
# Issue 45's GPU figures in one call (about 5 minutes on an H100/H200), from the repo root:
#   bash docs/results/run_gpu_bench.sh        (no CUDA: one line, exit 0)
# Writes docs/results/gpu-bench/<GPU name>.json and prints its table.
set -eu
export PYTHONPATH=$PWD FLWR_HOME=${FLWR_HOME:-/tmp/flwr} FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1
exec timeout ${BUDGET:-540} ${PY:-python3} docs/results/gpu_bench.py "$@"
