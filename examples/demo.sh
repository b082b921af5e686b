#!/usr/bin/env bash
# The whole OctoPipe flow on a bundled example, on this machine's CPU (make demo).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out plans profiles
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# Four CPU processes stand in for four GPUs: a gloo transfer between them costs about 1 ms and
# the runtime about 0.7 ms around each op on this 2-core machine (docs/BENCHMARKS.md).
LINK=(--latency-us 1000 --intra-node-gbps 1 --op-overhead-us 700)
export OMP_NUM_THREADS=1  # one thread per process (torchrun would set it and warn)
RUN=(torchrun --standalone --nproc-per-node 4 -m octorun)

step "1. Profile the hybrid SSM / attention / MoE example model on this CPU"
octoplan profile examples/models/hybrid.py -o profiles/hybrid.yaml --repeat 5

step "2. Tune it for 4 GPUs — partition, placement and schedule together — against every baseline"
octoplan tune profiles/hybrid.yaml --gpus 4 --microbatches 8 "${LINK[@]}" --time-limit 20 -o plans/hybrid.yaml
octoplan baseline profiles/hybrid.yaml --gpus 4 --schedule 1f1b --microbatches 8 "${LINK[@]}" -o plans/hybrid-1f1b.yaml

step "3. The tuned plan's timeline (also out/hybrid.svg, and out/hybrid-trace.json for Perfetto)"
octoplan show plans/hybrid.yaml --svg out/hybrid.svg --trace out/hybrid-trace.json

step "4. Train the real model with the tuned plan: torchrun, 4 processes, gloo"
"${RUN[@]}" plans/hybrid.yaml --steps 6 --optimizer adamw --lr 3e-3 --metrics out/train.jsonl

step "5. Predicted vs measured, and the speedup over 1F1B"
# Four processes share two cores here, so real compute would be slowed by the sharing itself;
# --replay runs every op for exactly its profiled time (sleeping), as four GPUs would.
"${RUN[@]}" plans/hybrid.yaml --replay --steps 5 --metrics out/tuned.jsonl --trace out/tuned-measured.json
"${RUN[@]}" plans/hybrid-1f1b.yaml --replay --steps 5 --metrics out/1f1b.jsonl
python examples/report.py plans/hybrid.yaml=out/tuned.jsonl plans/hybrid-1f1b.yaml=out/1f1b.jsonl
octoplan show plans/hybrid.yaml --measured out/tuned-measured.json --width 100 | tail -n 9
