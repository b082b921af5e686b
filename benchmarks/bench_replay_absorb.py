"""How much a replayed layer's backward runs over its profiled time, per layer: this tree's
replay model beside another revision's (``--against FILE``, e.g. ``git show REV:octorun/replay.py
> /tmp/old.py``), rounds alternating between them.

A chain of layers of F 0 ms, I 1 ms, W 1 ms and B 2 ms runs its backward 25 times; the median
excess over 2 ms a layer, at 12 layers less at 2 layers, over 10, is the excess each layer adds
(the pass's fixed start cancels out).

    .venv/bin/python benchmarks/bench_replay_absorb.py --against /tmp/old.py --rounds 5
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch


def _module(path: str | None):
    if path is None:
        import octorun.replay as replay

        return replay
    spec = importlib.util.spec_from_file_location("replay_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def excess_per_layer_ms(replay) -> float:
    def excess(count: int) -> float:
        layers = [replay.ReplayLayer(name=f"l{i}", kind="k", in_elements=64, out_elements=64, forward_ms=0.0,
                                     input_ms=1.0, weight_ms=1.0, fused_ms=2.0) for i in range(count)]
        lasted = []
        for _ in range(25):
            y = torch.randn(2, 64, requires_grad=True)
            for layer in layers:
                y = layer(y)
            began = time.perf_counter()
            y.sum().backward()
            lasted.append(time.perf_counter() - began - count * 0.002)
        return statistics.median(lasted)

    return (excess(12) - excess(2)) / 10 * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="another revision's octorun/replay.py")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = {"this tree": _module(None), **({"against": _module(args.against)} if args.against else {})}
    found: dict[str, list[float]] = {name: [] for name in modules}
    for index in range(args.rounds):
        for name in (list(modules) if index % 2 == 0 else list(reversed(modules))):
            found[name].append(excess_per_layer_ms(modules[name]))
    for name, values in found.items():
        print(f"{name}: median {statistics.median(values):.4f} ms per layer over its B "
              f"({min(values):.4f}-{max(values):.4f}, {len(values)} rounds)")


if __name__ == "__main__":
    main()
