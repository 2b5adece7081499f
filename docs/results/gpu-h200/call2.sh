#!/bin/bash
set -u
T0=$(date +%s); BUDGET=${BUDGET:-230}; OUT=${OUT:-/tmp/gpu-out}; mkdir -p $OUT; W=/tmp/gpuw; rm -rf $W; mkdir -p $W
el() { echo $(( $(date +%s) - T0 )); }; log() { echo "[$(el)s] $*"; }; left() { echo $(( BUDGET - $(el) )); }
export FLWR_HOME=/tmp/flwr FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1
if [ "${QUICK:-0}" = 1 ]; then PY=/work/main/.venv/bin/python; R5="--rounds 1"; DEV=cpu; else PY=python3; R5="--rounds 5"; DEV=cuda
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -3
  $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
  mkdir -p /usr/share/datasets/fashion-mnist
  for f in .gpu/data/*.xz; do xz -dc $f | gzip -1 > /usr/share/datasets/fashion-mnist/$(basename $f .xz).gz; done
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 1 > $OUT/smi2.csv 2>&1 & fi
FF="$PY -m tools.cli"; log "setup done"
step() { local name=$1 cap=$2; shift 2
  if [ $(left) -lt $cap ]; then log "SKIP $name (only $(left)s left)"; return; fi
  local t=$(date +%s); timeout $cap "$@" > $W/$name.log 2>&1; local rc=$?
  log "$name rc=$rc wall=$(( $(date +%s) - t ))s"; tail -3 $W/$name.log; }
SIM="$FF simulate --preset fashion-mnist-bench --seed 0 --no-tensorboard --algorithm fedsam"
step evaltime 40 $PY .gpu/evaltime.py; cat $W/evaltime.log
step inp5 50 $SIM --engine inprocess $R5 --run-dir $W/inp5
step flat-cuda 40 $FF flatness $W/inp5 --split train --method power --iters 10 --probes 1 --tol 1e-3 --device $DEV --json $W/flat-cuda.json
step flat-cpu 50 $FF flatness $W/inp5 --split train --method power --iters 10 --probes 1 --tol 1e-3 --device cpu --threads 16 --json $W/flat-cpu.json
cat $W/flat-cuda.json; cat $W/flat-cpu.json
step bf16 40 $SIM --engine vectorized $R5 --set amp=bf16 --run-dir $W/bf16
step bench-resnet 50 $FF bench --sections compute --model resnet18-gn --input-shape 3,32,32 --classes 10 --device $DEV --steps 3 --repeats 2 --out $W/bench-resnet.json
step land 30 $FF landscape $W/inp5 --steps 7 --device $DEV --out $W/land
log "all done"; kill $(jobs -p) 2>/dev/null
cd $W && tar czf $OUT/gpu2.tgz --exclude='*.pt' . 2>/dev/null; ls -la $OUT
