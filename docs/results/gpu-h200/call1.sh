#!/bin/bash
# flatflower's GPU checks, one call on a lent GPU machine, from the repo root. QUICK=1: a CPU dry run here.
set -u
T0=$(date +%s); BUDGET=${BUDGET:-520}
OUT=${OUT:-/tmp/gpu-out}; mkdir -p $OUT
W=/tmp/gpuw; rm -rf $W; mkdir -p $W
el() { echo $(( $(date +%s) - T0 )); }
log() { echo "[$(el)s] $*"; }
left() { echo $(( BUDGET - $(el) )); }
export FLWR_HOME=/tmp/flwr FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1
if [ "${QUICK:-0}" = 1 ]; then
  PY=/work/main/.venv/bin/python; R100="--rounds 2"; R10="--rounds 1"; R3="--rounds 1"; DEV=cpu
else
  PY=python3; R100=""; R10="--rounds 10"; R3="--rounds 3"; DEV=cuda
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -3
  $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
  mkdir -p /usr/share/datasets/fashion-mnist
  for f in .gpu/data/*.xz; do xz -dc $f | gzip -1 > /usr/share/datasets/fashion-mnist/$(basename $f .xz).gz; done
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 2 > $OUT/smi.csv 2>&1 &
fi
FF="$PY -m tools.cli"
log "setup done"
$PY -c "import torch, importlib.metadata as m; print('torch', torch.__version__, 'flwr', m.version('flwr'), 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '', 'cpus', __import__('os').cpu_count())" || exit 3
$PY -c "import tools.cli, flwr.superlink.cli, flwr.supernode.cli, tools.engines.vectorized" || exit 4
$FF data check 2>&1 | grep -i fashion
step() {  # step NAME CAP command...: runs when CAP seconds are left, reports wall time and rc
  local name=$1 cap=$2; shift 2
  if [ $(left) -lt $cap ]; then log "SKIP $name (only $(left)s left)"; return; fi
  local t=$(date +%s.%N)
  timeout $cap "$@" > $W/$name.log 2>&1; local rc=$?
  log "$name rc=$rc wall=$(echo "$(date +%s.%N) - $t" | bc)s"; tail -4 $W/$name.log
}
SIM="$FF simulate --preset fashion-mnist-bench --seed 0 --no-tensorboard"
acc() { $PY - "$@" <<'EOF'
import json, sys
for d in sys.argv[1:]:
    try:
        rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
        acc = [r.get("test_accuracy", r.get("accuracy")) for r in rows if r.get("test_accuracy", r.get("accuracy")) is not None]
        s = json.load(open(f"{d}/summary.json")) if __import__("os").path.exists(f"{d}/summary.json") else {}
        print(d, "final", s.get("final_test_accuracy"), "seconds", s.get("seconds"), "rounds", len(acc), "first5", acc[:5], "last3", acc[-3:])
    except Exception as e:
        print(d, "no metrics:", e)
EOF
}
# 1. The study's FedSAM seed-0 row, vectorised engine on the GPU (batching always on a GPU), whole run
step vec-fedsam 200 $SIM --algorithm fedsam --engine vectorized $R100 --run-dir $W/vec-fedsam
# 2. The in-process engine on the GPU (the study's default engine): 10 rounds
step inp-fedsam 120 $SIM --algorithm fedsam --engine inprocess $R10 --run-dir $W/inp-fedsam
# 3. The same on this machine's CPU (CUDA hidden): 3 rounds
step cpu-fedsam 90 env CUDA_VISIBLE_DEVICES= $SIM --algorithm fedsam --engine inprocess $R3 --run-dir $W/cpu-fedsam
acc $W/vec-fedsam $W/inp-fedsam $W/cpu-fedsam
# 4. Flatness of the final model on the GPU and on the CPU (the study's setting): the numbers must agree
step flat-cuda 90 $FF flatness $W/vec-fedsam --split train --method power --iters 10 --probes 1 --tol 1e-3 --device $DEV --json $W/flat-cuda.json
step flat-cpu 120 $FF flatness $W/vec-fedsam --split train --method power --iters 10 --probes 1 --tol 1e-3 --device cpu --threads 8 --json $W/flat-cpu.json
cat $W/flat-cuda.json $W/flat-cpu.json 2>/dev/null | tr -d '\n' | head -c 1500; echo
# 5. A real deployment: SuperLink + 4 SuperNodes on loopback sharing the GPU
( while sleep 2; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | sed "s/^/$(date +%T) /"; done > $OUT/apps.txt ) & APPS=$!
step local-cuda 150 $FF local --preset digits-quick --clients 4 --device $DEV --rounds 3 --run-dir $W/local-cuda --no-tensorboard
kill $APPS 2>/dev/null; log "GPU processes seen during local-cuda: $(cut -d' ' -f2 $OUT/apps.txt 2>/dev/null | sort -u | wc -l)"; tail -3 $OUT/apps.txt 2>/dev/null
acc $W/local-cuda
# 6. bf16 autocast, vectorised, the whole run
step vec-bf16 160 $SIM --algorithm fedsam --engine vectorized $R100 --set amp=bf16 --run-dir $W/vec-bf16
acc $W/vec-bf16
# 7. Repeatability on the GPU: the vectorised run again, 10 rounds, against step 1's first 10
step vec-again 60 $SIM --algorithm fedsam --engine vectorized $R10 --run-dir $W/vec-again
acc $W/vec-again
# 8. Landscape on the GPU
step land-cuda 60 $FF landscape $W/vec-fedsam --steps 9 --device $DEV --out $W/land
# 9. Per-step cost on the GPU: LeNet-5 and the papers' ResNet-18
step bench-lenet 60 $FF bench --sections compute --model lenet5 --input-shape 1,28,28 --classes 10 --device $DEV --steps 5 --repeats 3 --out $W/bench-lenet.json
step bench-resnet 60 $FF bench --sections compute --model resnet18-gn --input-shape 3,32,32 --classes 10 --device $DEV --steps 5 --repeats 3 --out $W/bench-resnet.json
log "all done"
kill $(jobs -p) 2>/dev/null
cd $W && tar czf $OUT/gpu.tgz --exclude='*.pt' --exclude='*.pth' --exclude='ckpt*' . 2>/dev/null; ls -la $OUT
