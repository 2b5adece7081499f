#!/bin/bash
# Issue 27's methods on a GPU + Ray's --gpus-per-client + ResNet-18's step cost. QUICK=1: CPU dry run here.
set -u
T0=$(date +%s); BUDGET=${BUDGET:-430}; OUT=${OUT:-/tmp/gpu-out}; mkdir -p $OUT; W=/tmp/gpuw3; rm -rf $W; mkdir -p $W
el() { echo $(( $(date +%s) - T0 )); }; log() { echo "[$(el)s] $*"; }; left() { echo $(( BUDGET - $(el) )); }
export FLWR_HOME=/tmp/flwr FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1
NEW="fedgloss fedswa fedmoswa fedgf fedwmsam fedsol dp-fedsam"
if [ "${QUICK:-0}" = 1 ]; then PY=/work/main/.venv/bin/python; RV="--rounds 1"; DEV=cpu; NEW=${ONLY:-$NEW}
else PY=python3; RV="--rounds 2"; DEV=cuda
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -3
  $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
  mkdir -p /usr/share/datasets/fashion-mnist
  for f in .gpu/data/*.xz; do xz -dc $f | gzip -1 > /usr/share/datasets/fashion-mnist/$(basename $f .xz).gz; done
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 1 > $OUT/nvidia-smi.csv 2>&1 &
  ( while sleep 1; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | sed "s/^/$(date +%T) /"; done > $OUT/gpu-processes.txt ) &
fi
FF="$PY -m tools.cli"; log "setup done"
$PY -c "import torch, importlib.metadata as m; print('torch', torch.__version__, 'flwr', m.version('flwr'), 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '', 'cpus', __import__('os').cpu_count())"
step() { local name=$1 cap=$2; shift 2
  if [ $(left) -lt $(( cap * ${CAPX:-1} )) ]; then log "SKIP $name (only $(left)s left)"; return; fi
  local t=$(date +%s); timeout $(( cap * ${CAPX:-1} )) "$@" > $W/$name.log 2>&1; local rc=$?
  log "$name rc=$rc wall=$(( $(date +%s) - t ))s"; tail -2 $W/$name.log; }
SIM="$FF simulate --preset fashion-mnist-bench --seed 0 --no-tensorboard"
# 1. Issue 27's seven methods, clients on the GPU, the preset's in-process engine, 2 rounds each
for a in $NEW; do step inp-$a 40 $SIM --algorithm $a --engine inprocess --rounds 2 --run-dir $W/inp-$a; done
# 2. The same through the vectorised engine (on a GPU it batches), 2 rounds
for a in $NEW; do step vec-$a 40 $SIM --algorithm $a --engine vectorized $RV --run-dir $W/vec-$a; done
# 3. A real deployment with client-level DP on the GPU: SuperLink + 4 SuperNodes on loopback
step local-dp 90 $FF local --preset digits-quick --algorithm dp-fedsam --clients 4 --device $DEV --rounds 3 --set aggregation=uniform --set dp.clip=0.5 --set dp.noise-multiplier=0.5 --run-dir $W/local-dp --no-tensorboard
# 4. Ray with --gpus-per-client: 4 clients share the GPU
step ray-gpu 120 $FF simulate --preset digits-quick --engine ray --gpus-per-client 0.25 --rounds 3 --seed 0 --no-tensorboard --run-dir $W/ray-gpu
# 5. The papers' ResNet-18 (GroupNorm), one client's step cost on the GPU
step bench-resnet 60 $FF bench --sections compute --model resnet18-gn --input-shape 3,32,32 --classes 10 --device $DEV --steps 5 --repeats 3 --out $W/bench-resnet.json
log "all done"; kill $(jobs -p) 2>/dev/null
cd $W && tar czf $OUT/gpu3.tgz --exclude='checkpoint*' --exclude='model_init.pt' --exclude='events.*' . 2>/dev/null; ls -la $OUT
