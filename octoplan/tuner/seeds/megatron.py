"""Megatron-LM's plans (``--runs-on megatron``): 1F1B and interleaved 1F1B in Megatron's own
order, on partitions snapped to the layer boundaries Megatron can express."""

from __future__ import annotations

from typing import Sequence

from octoplan.errors import InputError
from octoplan.partition import partition
from octoplan.schedules import loop_placement
from octoplan.tuner.frameworks import MEGATRON_ID
from octoplan.tuner.seeds.base import SeedContext, SeedFamily
from octoplan.tuner.seeds.baselines import fewest_recomputed_layers
from octoplan.tuner.space import Candidate, Config, bounds_of

__all__ = ["MegatronSeeds", "snapped"]


def snapped(bounds: tuple[int, ...], cuts: set[int]) -> tuple[int, ...] | None:
    """``bounds`` with every inner boundary moved to the nearest layer index in ``cuts`` (a
    split-blocks profile's block starts), kept strictly increasing; None where that fails."""
    allowed = sorted(cuts)
    out = [bounds[0]]
    for b in bounds[1:-1]:
        options = [c for c in allowed if out[-1] < c < bounds[-1]]
        if not options:
            return None
        out.append(min(options, key=lambda c: (abs(c - b), c)))
    out.append(bounds[-1])
    return tuple(out)


class MegatronSeeds(SeedFamily):
    """Megatron-LM's plans on a configuration: 1F1B, and interleaved 1F1B with every chunk count
    up to the baselines' that Megatron runs, each with a uniform and a balanced partition snapped
    to Megatron's layer boundaries, in Megatron's order
    (:func:`octoplan.export_megatron.megatron_order`) and marked so (:data:`MEGATRON_ID`);
    where one does not fit memory, also with the fewest layers recomputed per stage that fit
    (Megatron's block method)."""

    name = "Megatron-LM"

    def applies(self, ctx: SeedContext) -> bool:
        return ctx.opts.runs_on == "megatron"

    def seeds(self, ctx: SeedContext, config: Config, earlier: Sequence[Candidate]) -> list[Candidate]:
        search, profile = ctx.search, ctx.profile
        frameworks = search.frameworks
        assert frameworks.letters is not None
        out: list[Candidate] = []
        # Megatron's users choose their virtual stages as the baselines' chunk counts go
        for chunks in range(1, max(1, ctx.baseline_chunks) + 1):
            num_stages = chunks * config.pp
            if num_stages > profile.num_layers:
                break
            order = frameworks.order(config.pp, config.microbatches, chunks)
            if order is None:
                continue
            ranks = tuple(loop_placement(config.pp, num_stages))
            what = "1F1B" if chunks == 1 else f"interleaved 1F1B with {chunks} virtual stages"
            for method in ("uniform", "balanced"):
                try:
                    pairs = partition(profile, num_stages, method, fused_backward=True)
                except (InputError, ValueError):
                    continue
                bounds = snapped(bounds_of(pairs), frameworks.letters.cuts)
                if bounds is None:
                    continue
                label = f"{MEGATRON_ID}(v={chunks})/{method}"
                cand = Candidate(config, bounds, ranks, None, order, f"Megatron-LM {what}, {method} partition", label)
                if not frameworks.megatron_layout_ok(cand):
                    continue
                out.append(cand)
                if search.opts.recompute and not search.offer(cand).fits:
                    out.append(fewest_recomputed_layers(search, cand, f"{cand.origin}, recomputing"))
        return out
