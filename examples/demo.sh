#!/usr/bin/env bash
# The whole OctoPipe flow on a bundled example, on this machine's CPU (make demo).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out plans profiles
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
export OMP_NUM_THREADS=1  # one thread per process (torchrun would set it and warn)
RUN=(torchrun --standalone --nproc-per-node 4 -m octorun)

step "1. Profile the hybrid SSM / attention / MoE example model on this CPU, in bf16 as it will train"
octoplan profile examples/models/hybrid.py -o profiles/hybrid.yaml --repeat 5 --precision bf16

step "2. Calibrate: what a transfer and the runtime around each op cost with 4 processes here"
# Four CPU processes stand in for four GPUs, sharing this machine's cores: gloo's transfers and
# the runtime's own time around each op are measured in a short run of the 1F1B plan, whose
# ops --replay sleeps for exactly their profiled time, as four GPUs would run them.
octoplan baseline profiles/hybrid.yaml --gpus 4 --schedule 1f1b --microbatches 8 -o plans/hybrid-1f1b.yaml
"${RUN[@]}" plans/hybrid-1f1b.yaml --replay --steps 3 --trace out/calibration-trace.json
octoplan calibrate plans/hybrid-1f1b.yaml out/calibration-trace.json
# --replay sends a thousandth of the profile's bytes, so the calibrated latency is the fixed
# cost of a message; the planner adds the model's 64 KB at gloo's ~10 GB/s on top.
read -r -a LINK <<< "$(octoplan calibrate plans/hybrid-1f1b.yaml out/calibration-trace.json --flags) --intra-node-gbps 10"

step "3. Tune it for 4 GPUs — partition, placement and schedule together — against every baseline"
octoplan tune profiles/hybrid.yaml --gpus 4 --pp 4 --microbatches 8 "${LINK[@]}" --time-limit 20 -o plans/hybrid.yaml
octoplan baseline profiles/hybrid.yaml --gpus 4 --schedule 1f1b --microbatches 8 "${LINK[@]}" -o plans/hybrid-1f1b.yaml

step "4. The tuned plan's timeline (also out/hybrid.svg, and out/hybrid-trace.json for Perfetto)"
octoplan show plans/hybrid.yaml --svg out/hybrid.svg --trace out/hybrid-trace.json

step "5. Train it on text with the tuned plan: 4 processes, bf16, AdamW, clipping, a cosine schedule, checkpoints"
echo "The losses are real. The times are not the plan's: four processes share this machine's cores, while"
echo "each layer was profiled with the cores to itself. Step 8 replays the ops at their profiled times."
echo "The memory is the plan's: --activation-memory counts what each rank holds, beside the prediction."
# the corpus's last 5% held out: an evaluation every 10 steps runs it forward through the same pipeline
octoplan tokenize examples/data/corpus.txt -o out/corpus.bin --holdout 0.05 --holdout-output out/held_out.bin
rm -rf out/checkpoints
# one schedule over the whole training (--decay-steps), stopped halfway as if the cluster changed
TRAIN=(--data out/corpus.bin --precision bf16 --optimizer adamw --lr 3e-3 --min-lr 3e-4 --weight-decay 0.1
       --betas 0.9 0.95 --grad-clip 1.0 --lr-schedule cosine --warmup-steps 4 --decay-steps 60 --save out/checkpoints
       --eval-data out/held_out.bin --eval-every 10)
"${RUN[@]}" plans/hybrid.yaml "${TRAIN[@]}" --steps 30 --save-every 10 --metrics out/train-4x1.jsonl --activation-memory

step "6. The cluster changes: re-tune the same 4 GPUs as pp 2 x dp 2, and resume under the new plan"
echo "The checkpoint is keyed by layer, not by stage or rank: the new plan loads it as it is."
octoplan tune profiles/hybrid.yaml --gpus 4 --pp 2 --microbatches 4 "${LINK[@]}" --time-limit 10 -o plans/hybrid-pp2dp2.yaml
"${RUN[@]}" plans/hybrid-pp2dp2.yaml "${TRAIN[@]}" --steps 60 --resume out/checkpoints --metrics out/train-2x2.jsonl

step "7. The loss across the re-plan (out/loss.svg)"
python examples/loss_curve.py "pp 4 (tuned)=out/train-4x1.jsonl" "pp 2 x dp 2 (re-tuned, resumed)=out/train-2x2.jsonl" \
    --title "hybrid example on examples/data/corpus.txt, bf16" -o out/loss.svg

step "8. Predicted vs measured, and the speedup over 1F1B"
# Four processes share the cores here, so real compute would be slowed by the sharing itself;
# --replay runs every op for exactly its profiled time (sleeping), as four GPUs would.
"${RUN[@]}" plans/hybrid.yaml --replay --steps 5 --metrics out/tuned.jsonl --trace out/tuned-measured.json
"${RUN[@]}" plans/hybrid-1f1b.yaml --replay --steps 5 --metrics out/1f1b.jsonl
python examples/report.py plans/hybrid.yaml=out/tuned.jsonl plans/hybrid-1f1b.yaml=out/1f1b.jsonl
octoplan show plans/hybrid.yaml --measured out/tuned-measured.json --width 100 | tail -n 11
