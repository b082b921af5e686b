"""Probe: layouts cut at the fill caps' cut points (octoplan.tuner.fill_caps) as seeds of the
tuner, on the workloads whose tuned plans they might improve.

For each shape (a V, a loop of 2, a zigzag and a loop of 3 stages per rank) the cut points come
from CP-SAT (``fill_cap``, ``--cap-time`` deterministic seconds per shape) or, with ``--cuts
local``, from a fast local search over the same model: runs of consecutive boundaries moved by
one layer while the sorted figures fall (``--pairs``: then pairs of boundaries too;
``--rank-balanced``: also started from the rank-balanced loop and V cuts). Each layout is
ordered by the policy scheduler, justified, by the shifting-bottleneck procedure and longest
tail first (:func:`probe_start_aware_loops.orders`), with its one-machine relaxation. With
``--tune N`` the layouts are also one more seed family (policy orders, and each layout's best
rebuilt longest tail first before the climbs) in a tune with ``--max-plans N``, beside the
same tune without them (and without the tuner's own fill-capped seeds, which these replace).
``--order-search S`` also gives CP-SAT's order search (in flight unbounded) S seconds from
each layout's fastest order. ``--rounds`` also orders each loop by Megatron-LM's interleaved
rule (rounds of pp microbatches), with the backward whole or split and the Ws lagging.

    cd benchmarks && ../.venv/bin/python probe_fill_seeds.py --only internvl2-8b jamba-v0.1 [--cuts local] [--tune 2500]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

from bench_tuner import FILL_SHAPES
from probe_start_aware_loops import best_by_kind, orders, tune_beside, workloads

from octoplan.costs import cheaper_backward, to_ticks
from octoplan.schedules.exact import order_bound, relaxation_bound
from octoplan.schedules.looped import looped_schedule
from octoplan.tuner.fill_caps import _even_cuts, _figure, _fill_terms, _tables, fill_cap, shape_ranks
from octoplan.tuner.placed_cuts import loop_cuts, v_cuts
from octoplan.tuner.seeds.base import with_policies
from octoplan.tuner.seeds.fill_capped import ORIGIN, FillCappedSeeds
from octoplan.tuner.space import Candidate, Config


def local_cut(profile, cluster, microbatches, ranks, start, *, pairs: bool, max_trials: int):
    """Cut points whose sorted fill figures are low, by moving runs of consecutive boundaries
    (and with ``pairs`` any two boundaries) by one layer; (cut points, largest figure in ms)."""
    t = _tables(profile, cluster)
    num_stages = len(ranks)
    trials = 0

    def figures(cuts):
        nonlocal trials
        trials += 1
        return sorted(_figure(_fill_terms(*[[table[c] for c in cuts] for table in (t.fwd, t.back, t.down)], ranks,
                                          microbatches, t)), reverse=True)

    def legal(cuts):
        return all(a < b for a, b in zip(cuts, cuts[1:]))

    cuts = list(start)
    best = figures(cuts)
    improved = True
    while improved and trials < max_trials:
        improved = False
        for first in range(1, num_stages):
            for step in (-1, 1):
                for last in range(first, num_stages):
                    trial = cuts[:first] + [c + step for c in cuts[first:last + 1]] + cuts[last + 1:]
                    if trials < max_trials and legal(trial) and (found := figures(trial)) < best:
                        cuts, best, improved = trial, found, True
        if improved or not pairs:
            continue
        for a in range(1, num_stages):
            for b in range(a + 1, num_stages):
                for da in (-1, 1):
                    for db in (-1, 1):
                        trial = list(cuts)
                        trial[a] += da
                        trial[b] += db
                        if trials < max_trials and legal(trial) and (found := figures(trial)) < best:
                            cuts, best, improved = trial, found, True
    return tuple(cuts), best[0] / 1000.0


def cut_points(profile, cluster, config: Config, shape: str, k: int, args):
    """(cut points, the fill figure of those cut points in ms) of one shape, or None."""
    ranks = shape_ranks(shape, config.pp, k)
    if len(ranks) > profile.num_layers:
        return None
    if args.cuts == "cap":
        cap = fill_cap(profile, cluster, microbatches=config.microbatches, ranks=ranks, time_limit_s=args.cap_time)
        return None if cap is None else (cap.bounds, cap.found_ms)
    starts = [_even_cuts(profile.num_layers, len(ranks))]
    if args.rank_balanced and k == 2:
        work = [to_ticks(layer.forward_ms + sum(cheaper_backward(layer))) for layer in profile.layers]
        starts.append(list((v_cuts if shape == "zigzag" else loop_cuts)(work, config.pp).bounds))
    found = [local_cut(profile, cluster, config.microbatches, ranks, start, pairs=args.pairs,
                       max_trials=400_000 // len(ranks)) for start in starts]
    return min(found, key=lambda item: item[1])


class FillCapped(FillCappedSeeds):
    """The tuner's family (:mod:`octoplan.tuner.seeds.fill_capped`), its longest-tail-first
    rebuilds included, with this probe's cut points and shapes, outside the tune's clock."""

    def __init__(self, args):
        self.args = args

    def seeds(self, ctx, config, earlier):
        out = []
        for shape, k in FILL_SHAPES:
            found = cut_points(ctx.profile, ctx.cluster, config, shape, k, self.args)
            if found is not None:
                out += with_policies(config, found[0], shape_ranks(shape, config.pp, k), f"{ORIGIN} {shape} x{k}")
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=["internvl2-8b", "jamba-v0.1"])
    p.add_argument("--cuts", choices=("cap", "local"), default="cap")
    p.add_argument("--cap-time", type=float, default=10.0, help="CP-SAT's deterministic seconds per shape")
    p.add_argument("--pairs", action="store_true", help="--cuts local: move pairs of boundaries too")
    p.add_argument("--rank-balanced", action="store_true", help="--cuts local: start from the rank-balanced cuts too")
    p.add_argument("--order-search", type=float, default=0, metavar="S",
                   help="also give CP-SAT's order search S seconds from each layout's fastest order")
    p.add_argument("--rounds", action="store_true",
                   help="also order each loop by Megatron-LM's interleaved rule, rounds of pp microbatches")
    p.add_argument("--tune", type=int, default=0, metavar="MAX_PLANS", help="also tune with and without these seeds")
    args = p.parse_args()
    for w, profile, cluster, ev, config in workloads(args.only):
        for shape, k in FILL_SHAPES:
            started = time.perf_counter()
            found = cut_points(profile, cluster, config, shape, k, args)
            if found is None:
                continue
            cut_s = time.perf_counter() - started
            ranks = shape_ranks(shape, w.pp, k)
            made = orders(ev, config, found[0], ranks, shape)
            first = made[0][1]
            relax = relaxation_bound(ev.schedule(first), list(ranks), ev.costs(first), cluster=cluster,
                                     parallel=config.parallel())
            best = best_by_kind(ev, made)
            print(f"{w.name} {shape} x{k} ({args.cuts} cuts, {cut_s:.1f} s): fill figure {found[1]:.1f} ms, "
                  f"relaxation {relax:.1f} ms; " + ", ".join(f"{kind} {ms:.1f}" for kind, ms in best.items()), flush=True)
            if args.order_search:
                fastest = min((c for _, c in made if ev.score(c).fits), key=lambda c: ev.score(c).iteration_ms)
                searched = order_bound(ev.schedule(fastest), list(ranks), ev.costs(fastest), cluster=cluster,
                                       parallel=config.parallel(), time_limit_s=args.order_search, keep_memory=False)
                scored = ev.score(dataclasses.replace(fastest, fixed=searched.order, fixed_id="order search"))
                print(f"  CP-SAT's order search from the fastest, {args.order_search:g} s: {searched.status}, "
                      f"{scored.iteration_ms:.1f} ms simulated (fits: {scored.fits}), no order below "
                      f"{searched.lower_bound_ms:.1f}", flush=True)
            if args.rounds and shape == "loop":
                print(f"  {rounds_orders(ev, config, found[0], ranks, k)}", flush=True)
        if args.tune:
            tune_beside(w, FillCapped(args), args.tune)


def rounds_orders(ev, config: Config, bounds, ranks, chunks: int) -> str:
    """The fastest order that fits memory of Megatron-LM's interleaved rule on a loop of
    ``chunks`` stages per rank (:func:`octoplan.schedules.looped.looped_schedule`: rounds of pp
    microbatches, a warm-up of (chunks - 1) pp + 2 (pp - 1 - r) forwards plus 0, 2, ..., 2 pp
    more), backward whole or split with Ws lagging a r + b backwards (a, b in 0-2)."""
    pp = config.pp
    best = (float("inf"), "")
    for split, extra, a, b in itertools.product((False, True), range(0, 2 * pp + 1, 2), range(3), range(3)):
        if not split and (a or b):
            continue
        order = looped_schedule(pp, config.microbatches, chunks=chunks, split=split,
                                warmup=lambda r: (chunks - 1) * pp + 2 * (pp - 1 - r) + extra,
                                w_lag=lambda r: a * r + b)
        label = f"rounds split={split} warm-up +{extra} W lag {a}r+{b}"
        scored = ev.score(Candidate(config, tuple(bounds), tuple(ranks), None, tuple(map(tuple, order)), label, label))
        if scored.fits:
            best = min(best, (scored.iteration_ms, label))
    return f"interleaved rounds: best {best[0]:.1f} ms ({best[1]})"


if __name__ == "__main__":
    main()
