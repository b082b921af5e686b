#!/usr/bin/env bash
# How far a resume under another plan drifts from the run it continues, in fp32 and bf16: the
# hybrid example trains 130 steps as pp 4 (saving at step 30), and again from that checkpoint as
# pp 2 x dp 2; the two runs' losses are compared step by step (steps 30-129).
#   bash benchmarks/replan_drift.sh [WORKDIR]     (about 10 minutes on 2 cores)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="$ROOT/.venv/bin"
WORK="${1:-$(mktemp -d)}"
mkdir -p "$WORK" && cd "$WORK"
export OMP_NUM_THREADS=1
"$BIN/octoplan" profile "$ROOT/examples/models/hybrid.py" -o prof.yaml --precision bf16 > /dev/null
"$BIN/octoplan" baseline prof.yaml --gpus 4 --schedule 1f1b --microbatches 8 -o pp4.yaml > /dev/null
"$BIN/octoplan" baseline prof.yaml --gpus 4 --pp 2 --schedule 1f1b --microbatches 4 -o pp2dp2.yaml > /dev/null
"$BIN/octoplan" tokenize "$ROOT/examples/data/corpus.txt" -o corpus.bin > /dev/null
RUN=("$BIN/torchrun" --standalone --nproc-per-node 4 -m octorun)
for precision in bf16 fp32; do
    rm -rf "ck_$precision"
    TRAIN=(--data corpus.bin --precision "$precision" --optimizer adamw --lr 3e-3 --min-lr 3e-4 --weight-decay 0.1
           --betas 0.9 0.95 --grad-clip 1.0 --lr-schedule cosine --warmup-steps 4 --decay-steps 130 --steps 130)
    "${RUN[@]}" pp4.yaml "${TRAIN[@]}" --save "ck_$precision" --save-every 30 --keep 5 --metrics "ref_$precision.jsonl" > /dev/null 2>&1
    "${RUN[@]}" pp2dp2.yaml "${TRAIN[@]}" --resume "ck_$precision/step_00000030" --metrics "re_$precision.jsonl" > /dev/null 2>&1
done
"$BIN/python" - <<'PY'
import json
for precision in ("bf16", "fp32"):
    ref = {r["step"]: r["loss"] for r in map(json.loads, open(f"ref_{precision}.jsonl"))}
    resumed = {r["step"]: r["loss"] for r in map(json.loads, open(f"re_{precision}.jsonl"))}
    diff = {step: abs(ref[step] - loss) for step, loss in resumed.items()}
    print(f"{precision}: steps {min(diff)}-{max(diff)}, largest |loss difference| {max(diff.values()):.2e} "
          f"(in the first 10 steps {max(d for s, d in diff.items() if s < min(diff) + 10):.2e}), "
          f"final loss {ref[max(ref)]:.4f}")
PY
