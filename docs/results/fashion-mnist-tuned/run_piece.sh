#!/usr/bin/env bash
# The tuned Fashion-MNIST study (docs/benchmarks.md, "Fashion-MNIST, tuned"), one piece at a time:
#   bash docs/results/fashion-mnist-tuned/run_piece.sh ALGORITHM [WORK_DIR]
# tunes ALGORITHM with the study's equal budget (8 trials x 20 rounds x 100 clients of the preset
# fashion-mnist-bench, the validation split 0.1 of the training split, the median pruner), runs the
# best setting for seeds 0, 1 and 2 (--final-rounds 100: the study's length, the test split), and copies the records (trials.csv,
# best.json, tune.json, each final run's config.json and metrics.jsonl) here, beside this script.
# Resumable: run it again after an interruption (the tune goes on where it stopped). A piece is
# about 20-40 minutes on 2 free cores; run several with `nice -n 19` beside other work (the numbers
# do not depend on the load: the in-process engine).
set -euo pipefail
ALGORITHM=${1:?usage: run_piece.sh ALGORITHM [WORK_DIR]}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${2:-fashion-mnist-tuned}
FLATFLOWER=${FLATFLOWER:-flatflower}
export FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0
$FLATFLOWER tune --preset fashion-mnist-bench --algorithms "$ALGORITHM" --trials 8 --rounds 20 --last-k 5 \
    --seeds 0,1,2 --final-rounds 100 --engine inprocess --out "$WORK/$ALGORITHM"
DEST="$HERE/$ALGORITHM"
mkdir -p "$DEST"
cp "$WORK/$ALGORITHM/tune.json" "$WORK/$ALGORITHM/$ALGORITHM/trials.csv" "$WORK/$ALGORITHM/$ALGORITHM/best.json" "$DEST/"
for run in "$WORK/$ALGORITHM"/final/"$ALGORITHM"-s?; do
    mkdir -p "$DEST/$(basename "$run")"
    cp "$run/config.json" "$run/metrics.jsonl" "$DEST/$(basename "$run")/"
done
echo "records of $ALGORITHM in $DEST"
