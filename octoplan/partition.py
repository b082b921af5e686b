"""Contiguous layer -> stage splits used by the baselines (FORMATS.md section 6).

``uniform`` is Megatron-LM's default: embedding with the first stage, head with the last, the
other layers split as evenly as possible by count, larger stages first. ``balanced`` minimizes
the largest stage time, the classic linear-partition problem, solved exactly by a search over
the bottleneck. A stage's time is F + I + W, or F + B for an order of fused backwards only,
where a profile measured B (``backward_ms``) cheaper or dearer than I + W.
"""

from __future__ import annotations

from octoplan.costs import LayerTable
from octoplan.errors import InputError
from octoplan.profile import Profile

__all__ = ["uniform_partition", "balanced_partition", "partition", "PARTITIONS"]

PARTITIONS = ("uniform", "balanced")


def _too_few(profile: Profile, num_stages: int, file: str | None) -> InputError:
    return InputError(
        file, "layers", f"{profile.num_layers} layers cannot fill {num_stages} stages",
        "use fewer GPUs, a smaller --pp or --chunks, or a profile with more layers",
    )


def uniform_partition(profile: Profile, num_stages: int, *, file: str | None = None) -> list[tuple[int, int]]:
    layers = profile.layers
    lead = 1 if layers[0].kind == "embedding" else 0
    tail = 1 if layers[-1].kind == "head" and len(layers) > lead else 0
    body = len(layers) - lead - tail
    base, extra = divmod(body, num_stages)
    sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
    sizes[0] += lead
    sizes[-1] += tail
    if len(layers) < num_stages:  # no partition can: --partition balanced would fail too
        raise _too_few(profile, num_stages, file)
    if min(sizes) < 1:
        pinned = " with the embedding and head pinned to the first and last stage" if lead or tail else ""
        raise InputError(
            file, "layers", f"{body} layers{pinned} cannot fill {num_stages} stages uniformly",
            "use --partition balanced, fewer GPUs, a smaller --pp or --chunks",
        )
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def balanced_partition(profile: Profile, num_stages: int, *, file: str | None = None,
                       fused_backward: bool = False) -> list[tuple[int, int]]:
    num_layers = profile.num_layers
    if num_layers < num_stages:
        raise _too_few(profile, num_stages, file)
    if fused_backward and profile.measures_fused_backward:
        costs = [layer.forward_ms + layer.b_ms for layer in profile.layers]
    else:
        costs = LayerTable(profile).layer_total_ms

    def greedy(limit: float) -> list[tuple[int, int]] | None:
        bounds, start, acc = [], 0, 0.0
        for i, cost in enumerate(costs):
            if cost > limit:
                return None
            if acc + cost > limit and i > start:
                bounds.append((start, i))
                start, acc = i, 0.0
            acc += cost
        bounds.append((start, num_layers))
        return bounds if len(bounds) <= num_stages else None

    # The optimal bottleneck is the sum of some contiguous range; bisect on it, then finish
    # with the exact smallest feasible range sum near the bisection's answer.
    low, high = max(costs), sum(costs)
    for _ in range(60):
        mid = (low + high) / 2
        if greedy(mid) is None:
            low = mid
        else:
            high = mid
    bounds = greedy(high)
    assert bounds is not None
    # Split the longest stages (by layer count) until there are exactly num_stages; splitting
    # never raises the bottleneck.
    while len(bounds) < num_stages:
        index = max(range(len(bounds)), key=lambda j: (bounds[j][1] - bounds[j][0], -j))
        start, end = bounds[index]
        cut = _best_cut(costs, start, end)
        bounds[index:index + 1] = [(start, cut), (cut, end)]
    return bounds


def _best_cut(costs: list[float], start: int, end: int) -> int:
    total = sum(costs[start:end])
    acc, best, best_gap = 0.0, start + 1, float("inf")
    for cut in range(start + 1, end):
        acc += costs[cut - 1]
        gap = abs(2 * acc - total)
        if gap < best_gap:
            best, best_gap = cut, gap
    return best


def partition(profile: Profile, num_stages: int, method: str, *, file: str | None = None,
              fused_backward: bool = False) -> list[tuple[int, int]]:
    """``fused_backward``: the schedule runs only B ops (see :func:`balanced_partition`)."""
    if method == "uniform":
        return uniform_partition(profile, num_stages, file=file)
    if method == "balanced":
        return balanced_partition(profile, num_stages, file=file, fused_backward=fused_backward)
    raise InputError(None, "--partition", f"unknown partition {method!r}", f"use one of {', '.join(PARTITIONS)}")
