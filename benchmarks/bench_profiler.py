"""Profiler accuracy: the sum over layers of F+I+W against a measured whole-model
forward+backward of the same microbatch, for every example model (target: within 15%).

Run: .venv/bin/python benchmarks/bench_profiler.py [--rounds 4] [--device cpu|cuda] [--size small|large]

``--size large`` gives each model GPU-sized layers (hidden 2048, sequences of 256-1024). On a GPU
the default sizes time mostly kernel launches and the autograd engine's per-call work, which
the per-layer measurement pays once per layer and op and a fused whole-model backward does not.

Each round profiles the model between two whole-model measurements and compares with their
mean, so both see the same conditions on a shared machine; the median ratio is reported.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from octoplan.profiler import measure_whole_model_ms, profile_model_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "models"
MODELS = ("tiny_gpt", "vlm", "hybrid")
# Config overrides that make each example's layers take milliseconds on a GPU.
LARGE = {
    "tiny_gpt": {"vocab": 32768, "hidden": 2048, "heads": 16, "seq": 1024},
    "vlm": {"image_size": 224, "patch": 14, "vision_hidden": 1024, "hidden": 2048, "heads": 16, "vocab": 32768,
            "text_len": 512},
    "hybrid": {"vocab": 32768, "hidden": 2048, "heads": 16, "seq": 256, "expert_hidden": 4096},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (layers timed with CUDA events)")
    parser.add_argument("--size", choices=("small", "large"), default="small", help="large: GPU-sized layers")
    parser.add_argument("--config-args", metavar="MODEL", choices=MODELS,
                        help="only print MODEL's large config as octoplan profile options")
    args = parser.parse_args()
    if args.config_args:
        print(" ".join(f"--config {key}={value}" for key, value in LARGE[args.config_args].items()))
        return
    # F+I+W is what the target compares; F+B (B: the fused backward, as a 1F1B plan runs
    # it) is the like-for-like sum, since the whole model's backward is one fused pass too.
    print("| model | layers | sum of layers F+I+W ms | whole model ms | ratio (median of rounds) | rounds | F+B ratio |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name in MODELS:
        path = str(EXAMPLES / f"{name}.py")
        config = LARGE[name] if args.size == "large" else None
        kwargs = dict(config=config, microbatch_size=4, repeat=args.repeat, device=args.device, seed=0)
        before = measure_whole_model_ms(path, **kwargs)
        sums, wholes, ratios, fused_ratios = [], [], [], []
        for _ in range(args.rounds):
            profile = profile_model_file(path, **kwargs)
            after = measure_whole_model_ms(path, **kwargs)
            sums.append(sum(layer.total_ms for layer in profile.layers))
            wholes.append((before + after) / 2)
            ratios.append(sums[-1] / wholes[-1])
            fused_ratios.append(sum(layer.forward_ms + layer.b_ms for layer in profile.layers) / wholes[-1])
            before = after
        rounds = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"| {name} | {profile.num_layers} | {statistics.median(sums):.1f} | {statistics.median(wholes):.1f} | "
              f"{statistics.median(ratios):.3f} | {rounds} | {statistics.median(fused_ratios):.3f} |")


if __name__ == "__main__":
    main()
