#!/usr/bin/env bash
# The GPU checks in one prepared run, for a machine with one GPU (written for an H200):
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=480)
# It needs only what that machine's python3 has (torch, typer, pyyaml, rich, pytest); OR-Tools
# is not needed: nothing here tunes. Results land in $OUT (the device tool brings back at most 8
# files, so the per-model files travel as one archive), or in out/gpu-check when run elsewhere.
# DEVICE=cpu runs the same steps on a CPU, which is how the script itself is tested
# (tests/test_gpu_check_script.py, with ROUNDS=1 PYTEST=0).
#
# What it checks:
#   1. the profiler with CUDA events: every example model's per-layer F+I+W against its
#      whole-model step (benchmarks/bench_profiler.py), at the examples' own sizes and, on a GPU,
#      at GPU-sized layers (--size large);
#   2. the profiler's tests on this machine (its CUDA test runs only where there is CUDA);
#   3. octorun on the GPU: one process, the nccl backend, a 1-rank plan of each example model's
#      measured profile (both sizes on a GPU), 3 steps, its ops timed with CUDA events in the
#      metrics and the trace;
#   4. octorun's multi-process path: 2 and 4 processes on the one GPU (each told LOCAL_RANK=0),
#      pipelines of 1F1B, interleaved 1F1B and ZB-V, a tuple-passing model and dp 2, each run's
#      losses against the 1-rank run of step 3. NCCL refuses two ranks on one GPU (2.28.9 on the
#      H200, 2026-11-30: "invalid usage" at the first send, and every rank of octorun exited 1
#      naming op 0F0): the step records that, and the path needs a machine with two or more GPUs.
#      On the CPU the same runs use gloo.
#   5. training as users run it, on one GPU: each example model profiled with --precision bf16,
#      a 1-rank plan of it trained 4 steps with --precision bf16 (AdamW, clipping, a cosine
#      schedule, --activation-memory against the bf16 profile's prediction), saving a checkpoint
#      after step 2 (torch.distributed.checkpoint from CUDA tensors); then resumed from that
#      checkpoint, whose steps 2 and 3 must repeat the first run's losses bit for bit.
#   6. the profiler's repeatability: PROFILES (3) back-to-back `octoplan profile` commands per
#      example model at each size, each profile's layers' F + B against the whole model timed in
#      the same run, and how far each layer's share moved between them
#      (benchmarks/bench_profiler.py repeatability).
# MODELS="tiny_gpt" runs every step on that example model only (step 4: its own pipelines), as
# the suite's short rehearsal on the CPU does; BF16_MODELS="tiny_gpt" narrows step 5 alone.
# STEPS="1 6" runs only those steps, in the order below (step 4 needs step 3 and the small size); SIZES="small"
# skips the GPU-sized models.
set -euo pipefail
DEVICE="${DEVICE:-cuda}"
PY="${PY:-python3}"
OUT="${OUT:-out/gpu-check}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
# what the steps wrote is archived on any exit, a failed step's included
trap 'tar -czf "$OUT/models.tar.gz" -C "$WORK" . 2>/dev/null; rm -rf "$WORK"' EXIT
export COLUMNS=200 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ROUNDS="${ROUNDS:-3}"
if [ "$DEVICE" = cuda ]; then SIZES="${SIZES:-small large}"; else SIZES="${SIZES:-small}"; fi
STEPS="${STEPS:-1 2 3 4 5 6}"  # which of the steps below to run
MODELS="${MODELS:-tiny_gpt vlm hybrid}"  # which example models they run on
step() { [[ " $STEPS " == *" $1 "* ]]; }
has_model() { [[ " $MODELS " == *" $1 "* ]]; }
if step 4 && ! step 3; then echo "gpu_check.sh: STEPS=\"$STEPS\": step 4 trains on step 3's profiles; add 3" >&2; exit 2; fi
if step 4 && [[ " $SIZES " != *" small "* ]]; then echo "gpu_check.sh: SIZES=\"$SIZES\": step 4 uses the small models; add small" >&2; exit 2; fi

echo "== device"
"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"

if step 1; then
    for size in $SIZES; do
        echo "== 1. profiler accuracy on $DEVICE, $size layers (sum of layers against the whole model)"
        "$PY" benchmarks/bench_profiler.py --device "$DEVICE" --rounds "$ROUNDS" --size "$size" --models $MODELS | tee -a "$OUT/profiler.md"
    done
fi

if step 2 && [ "${PYTEST:-1}" != 0 ]; then
    echo "== 2. the profiler's own tests on this machine"
    # failures are reported (here and in pytest-profiler.txt), not fatal: the GPU steps after it still run
    { "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_profiler.py 2>&1 || true; } | tail -25 | tee "$OUT/pytest-profiler.txt"
fi

if step 3; then
    echo "== 3. profile each example model on $DEVICE, then train 3 steps of 1-rank plans of it with octorun:
   1F1B (fused backwards, B) and ZB-H1 (split backwards, I and W)"
    for size in $SIZES; do
        for model in $MODELS; do
            name=$model; config=()
            if [ "$size" = large ]; then
                name=$model-large
                args=$("$PY" benchmarks/bench_profiler.py --config-args "$model")  # a failure here stops the script
                read -ra config <<<"$args"
            fi
            "$PY" -m octoplan.cli profile "examples/models/$model.py" "${config[@]}" --device "$DEVICE" --repeat 5 -o "$WORK/$name.yaml" | tail -1
            for schedule in 1f1b zb-h1; do
                run=$name; [ "$schedule" = 1f1b ] || run=$name-$schedule
                "$PY" -m octoplan.cli baseline "$WORK/$name.yaml" --gpus 1 --schedule $schedule --microbatches 4 -o "$WORK/$run-plan.yaml" | tail -1
                "$PY" -m octorun "$WORK/$run-plan.yaml" --steps 3 --metrics "$WORK/$run.metrics.jsonl" --trace "$WORK/$run.trace.json" \
                    --timeout 120 | tee "$WORK/$run.octorun.txt"
            done
        done
    done
fi

multi() {  # multi NAME MODEL PROCESSES MICROBATCHES baseline-options...; losses compared when dp is 1
    local name=$1 model=$2 procs=$3 mbs=$4; shift 4
    "$PY" -m octoplan.cli baseline "$WORK/$model.yaml" --gpus "$procs" --microbatches "$mbs" "$@" -o "$WORK/$name-plan.yaml" | tail -1
    if timeout 180 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$procs" --no-python "${LAUNCH[@]}" \
        "$PY" -m octorun "$WORK/$name-plan.yaml" --steps 3 --backend "$BACKEND" --timeout 60 \
        --metrics "$WORK/$name.metrics.jsonl" --trace "$WORK/$name.trace.json" >"$WORK/$name.octorun.txt" 2>&1; then
        "$PY" - "$WORK/$model.metrics.jsonl" "$WORK/$name.metrics.jsonl" "$name" "$mbs" <<'PY'
import json, sys
one, many = ([json.loads(line) for line in open(path)] for path in sys.argv[1:3])
same_batches = sys.argv[4] == "4"  # step 3's 1-rank plan draws microbatches 0..3 of replica 0
diff = f"largest difference from 1 rank {max(abs(a['loss'] - b['loss']) for a, b in zip(one, many)):.2e}" if same_batches else "dp 2"
print(f"{sys.argv[3]}: ok, losses {[round(s['loss'], 6) for s in many]}, {diff}, "
      f"iteration {many[-1]['iteration_ms']:.2f} ms (predicted {many[-1].get('predicted_iteration_ms', 0):.2f})")
PY
    else
        echo "$name: FAILED (exit $?), the last lines:"; tail -5 "$WORK/$name.octorun.txt"
    fi
}

if step 4; then
    echo "== 4. several processes on one $DEVICE: pipelines of 2 and 4 ranks, losses against the 1-rank run"
    if [ "$DEVICE" = cuda ]; then LAUNCH=(env LOCAL_RANK=0); BACKEND=nccl; else LAUNCH=(); BACKEND=gloo; fi
    if has_model tiny_gpt; then
        multi tiny_gpt-1f1b-pp2 tiny_gpt 2 4 --schedule 1f1b
        multi tiny_gpt-interleaved-pp2 tiny_gpt 2 4 --schedule interleaved-1f1b
        multi tiny_gpt-zbv-pp2 tiny_gpt 2 4 --schedule zbv
        multi tiny_gpt-1f1b-pp2-dp2 tiny_gpt 4 2 --schedule 1f1b --pp 2
    fi
    if has_model vlm; then multi vlm-1f1b-pp2 vlm 2 4 --schedule 1f1b; fi
    if has_model hybrid; then multi hybrid-zbv-pp4 hybrid 4 4 --schedule zbv; fi
fi
if step 5; then
    echo "== 5. bf16 training on $DEVICE: profile --precision bf16, a 1-rank plan, 4 steps saving after step 2, then a resume"
    TRAIN=(--precision bf16 --optimizer adamw --lr 3e-3 --grad-clip 1.0 --lr-schedule cosine --steps 4 --timeout 120)
    for model in ${BF16_MODELS:-$MODELS}; do
        "$PY" -m octoplan.cli profile "examples/models/$model.py" --precision bf16 --device "$DEVICE" --repeat 5 \
            -o "$WORK/$model-bf16.yaml" | tail -1
        "$PY" -m octoplan.cli baseline "$WORK/$model-bf16.yaml" --gpus 1 --schedule 1f1b --microbatches 4 \
            -o "$WORK/$model-bf16-plan.yaml" | tail -1
        "$PY" -m octorun "$WORK/$model-bf16-plan.yaml" "${TRAIN[@]}" --activation-memory --save "$WORK/$model-ck" --save-every 2 \
            --metrics "$WORK/$model-bf16.metrics.jsonl" | tee "$WORK/$model-bf16.octorun.txt"
        "$PY" -m octorun "$WORK/$model-bf16-plan.yaml" "${TRAIN[@]}" --resume "$WORK/$model-ck/step_00000002" \
            --metrics "$WORK/$model-bf16-resumed.metrics.jsonl" > "$WORK/$model-bf16-resumed.octorun.txt" 2>&1
        "$PY" - "$WORK/$model-bf16.metrics.jsonl" "$WORK/$model-bf16-resumed.metrics.jsonl" "$model" <<'PY'
import json, sys
whole, resumed = ([json.loads(line) for line in open(path)] for path in sys.argv[1:3])
same = [r["loss"] for r in resumed] == [w["loss"] for w in whole[2:]]  # steps 2 and 3, bit for bit
print(f"{sys.argv[3]} bf16: losses {[round(w['loss'], 6) for w in whole]}, iteration {whole[-1]['iteration_ms']:.2f} ms "
      f"(predicted {whole[-1].get('predicted_iteration_ms', 0):.2f}); resume from step 2 {'bit-identical' if same else 'DIFFERS'}")
PY
    done
fi
if step 6; then
    for size in $SIZES; do
        echo "== 6. the profiler's repeatability on $DEVICE, $size layers: ${PROFILES:-3} back-to-back profiles per model"
        "$PY" benchmarks/bench_profiler.py repeatability --device "$DEVICE" --size "$size" --profiles "${PROFILES:-3}" --models $MODELS \
            | tee -a "$OUT/repeatability.md"
    done
fi
echo "== done: $OUT (profiler.md, repeatability.md, models.tar.gz: each model's profile, plan, metrics and trace)"
