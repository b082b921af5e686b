#!/usr/bin/env bash
# The GPU checks in one prepared run, for a session that is lent the device machine (one H200):
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=480)
# It needs only what that machine's python3 has (torch, typer, pyyaml, rich, pytest); OR-Tools
# is not needed: nothing here tunes. Results land in $OUT (the device tool brings back at most 8
# files, so the per-model files travel as one archive), or in out/gpu-check when run elsewhere.
# DEVICE=cpu runs the same steps on a CPU, which is how the script itself is tested
# (tests/test_gpu_check_script.py, with ROUNDS=1 PYTEST=0).
#
# What it checks:
#   1. the profiler with CUDA events: every example model's per-layer F+I+W against its
#      whole-model step (benchmarks/bench_profiler.py), and each model's profile written;
#   2. the profiler's CUDA test (tests/test_profiler.py -k cuda);
#   3. octorun on the GPU: one process, the nccl backend, a 1-rank plan of each example model's
#      measured profile, 3 steps, its ops timed with CUDA events in the metrics and the trace.
# Not checked here: octorun's multi-process NCCL path. NCCL refuses two ranks on one GPU, so
# that needs a machine with two or more.
set -euo pipefail
DEVICE="${DEVICE:-cuda}"
PY="${PY:-python3}"
OUT="${OUT:-out/gpu-check}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ROUNDS="${ROUNDS:-3}"

echo "== device"
"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"

echo "== 1. profiler accuracy on $DEVICE (sum of layers against the whole model)"
"$PY" benchmarks/bench_profiler.py --device "$DEVICE" --rounds "$ROUNDS" | tee "$OUT/profiler.md"

if [ "${PYTEST:-1}" != 0 ]; then
    echo "== 2. the profiler's own tests on this machine"
    "$PY" -m pytest -q -p no:cacheprovider tests/test_profiler.py 2>&1 | tail -3 | tee "$OUT/pytest-profiler.txt"
fi

echo "== 3. profile each example model on $DEVICE, then train 3 steps of a 1-rank plan of it with octorun"
for model in tiny_gpt vlm hybrid; do
    "$PY" -m octoplan.cli profile "examples/models/$model.py" --device "$DEVICE" --repeat 5 -o "$WORK/$model.yaml" | tail -1
    "$PY" -m octoplan.cli baseline "$WORK/$model.yaml" --gpus 1 --schedule 1f1b --microbatches 4 -o "$WORK/$model-plan.yaml" | tail -1
    "$PY" -m octorun "$WORK/$model-plan.yaml" --steps 3 --metrics "$WORK/$model.metrics.jsonl" --trace "$WORK/$model.trace.json" \
        --timeout 120 | tee "$WORK/$model.octorun.txt"
done
tar -czf "$OUT/models.tar.gz" -C "$WORK" .
echo "== done: $OUT (profiler.md, models.tar.gz: each model's profile, plan, metrics and trace)"
