"""The tuner: co-optimize partition, placement and schedule (``octoplan tune``).

:func:`tune` runs these steps, each a function below:
1. Check the options (:func:`check_options`, :func:`_checked`) and enumerate the outer choices (:class:`Config`):
   every pp dividing the GPU count (``pp`` pins it) with the microbatch count a global batch
   implies, and both global rank orders when dp > 1 and they differ on the cluster's nodes
   (:func:`configs_for`).
2. Seed (:func:`_seeds`): every baseline of FORMATS.md section 6 that applies
   (:mod:`octoplan.tuner.seeds.baselines`: schedule x partition, interleaved 1F1B with every
   chunk count the layers allow up to ``MAX_BASELINE_CHUNKS``, or up to ``chunks_max`` where it
   is given), so the answer is never worse than the best baseline that fits; then, per
   configuration, the seeds of every family in :data:`octoplan.tuner.seeds.SEED_FAMILIES`
   that applies: Megatron-LM's orders (``--runs-on megatron``), policy-scheduled seeds
   (balanced partitions in loop and V placements), loops and Vs cut for the busiest rank's
   least work and, in tunes of 30 s or more, for the least fill cap
   (:mod:`octoplan.tuner.seeds.fill_capped`), the CP-SAT partition + placement
   (:mod:`octoplan.tuner.cpsat`), and every seed layout re-placed so that late-starting ranks
   carry less (:mod:`octoplan.tuner.arrange`).
3. Rank (:func:`_ranked`): price every seed, best first; then the families add seeds made
   from the best ones, ranked with them: recomputing copies of the fastest that do not fit,
   the justified orders of the best layouts (:mod:`octoplan.schedules.justify`: every op
   pushed as late, then as early as its dataflow and its rank's gaps allow, which moves Ws
   into bubbles and forwards ahead of them), and the best layouts' orders rebuilt by the
   longest-tail-first list scheduler (:mod:`octoplan.schedules.list_order`), justified.
4. Climb (:func:`_climbs`): hill-climb from the best seed of each kind of plan
   (configuration x stage count x fixed or policy order) with the moves of
   :data:`octoplan.tuner.neighbourhoods.NEIGHBOURHOODS`, tried in order by the one climb
   loop (:meth:`octoplan.tuner.climb.Search.climb`): simulate, read who waits on whom, try
   the most promising basic moves first (:mod:`octoplan.tuner.moves`), keep the first one
   that is faster (or, while nothing fits, leaner); at a local optimum of those, justify the
   order, rebuild it by the shifting-bottleneck procedure (:mod:`octoplan.schedules.bottleneck`)
   where the time left allows and by the longest-tail-first list scheduler, then try
   compound moves, each justified: a layer shifted off a hot rank, and a layer peeled off a
   rank that finishes last into a new stage on one that finishes first, the order carried
   over (:mod:`octoplan.tuner.carry`); go on from there if that is faster; until no move
   helps or time runs out. Time the climbs leave unused goes
   to climbs from the next-best seeds, each followed by a restart: a climb from the first
   seeds again, on layer times shaken by 0.1%, whose end is judged on the true times (a
   climb's path turns on near-ties, and one seed's local optima differ by percents);
   restarts stop after 3 rounds over those seeds find nothing. With ``workers`` > 1 the
   climbs run side by side in that many processes (:mod:`octoplan.tuner.pool`), and the
   restarts follow in this one. The climbs end 1.5 margins before the time limit (a margin:
   2 s, or 5% of a shorter limit). Last, the polish (:meth:`~octoplan.tuner.climb.Search.polish`):
   the best plan's order rebuilt both ways (the shifting-bottleneck procedure if it fits in
   the time left), a climb from the fastest over chain shifts alone (a layer passed along a
   run of stages off the rank that finishes last, every boundary of the run moved by one:
   :mod:`octoplan.tuner.neighbourhoods.chains`), and a climb over every move if that found
   a faster plan, until one margin before the limit; the rest is the final plan's.
5. Report (:func:`_stats`): the best plan that fits, with where its time goes.

Where to extend: a new source of seeds is a new module in :mod:`octoplan.tuner.seeds`, a
:class:`~octoplan.tuner.seeds.SeedFamily` added to ``SEED_FAMILIES``; a new kind of move is a
new module in :mod:`octoplan.tuner.neighbourhoods`, a
:class:`~octoplan.tuner.neighbourhoods.Neighbourhood` added to ``NEIGHBOURHOODS``. Neither
needs a change here.

Deterministic for a given seed: moves are tried in a fixed order with ties broken by
``random.Random(seed)``; the clock only decides when to stop, and whether a rebuilt order
still fits before a deadline (with one worker; with several, which climb ends first also
depends on the machine). With ``max_plans`` the clock counts plans and every rebuild runs.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from octoplan.errors import InputError
from octoplan.ops import Kind
from octoplan.plan import MAX_MICROBATCHES, Cluster, Plan, check_structure
from octoplan.profile import Profile
from octoplan.tuner.climb import DEFAULT_CHUNKS, ProgressFn, Restarts, Search, climbs_end_s
from octoplan.export_megatron import expert_parallel, tensor_parallel
from octoplan.export_torchtitan import non_llama_kind, torchtitan_cuts
from octoplan.tuner.frameworks import RUNS_ON, Frameworks, frameworks_order
from octoplan.tuner.moves import DIMENSIONS
from octoplan.tuner.neighbourhoods import Neighbourhood
from octoplan.tuner.seeds import SEED_FAMILIES, Ranked, SeedContext, SeedFamily
from octoplan.tuner.seeds.baselines import BaselineRow, Baselines, baseline_chunks, collect_baselines
from octoplan.tuner.space import Candidate, Config, Evaluator, Scored
from octoplan.yamlio import file_sha256

# re-exported: tests and benchmarks import these from here
from octoplan.tuner.climb import RESTART_PATIENCE, Clock as _Clock, Restarts as _Restarts, Search as _Search  # noqa: F401
from octoplan.tuner.neighbourhoods import COMPOUND_SHIFTS, PEELS  # noqa: F401
from octoplan.tuner.seeds.baselines import MAX_BASELINE_CHUNKS  # noqa: F401
from octoplan.tuner.seeds.baselines import baseline_candidates as _baseline_candidates  # noqa: F401
from octoplan.tuner.seeds.baselines import fewest_recomputed_layers as _fewest_recomputed_layers  # noqa: F401
from octoplan.tuner.seeds.policy import policy_seeds as _policy_seeds  # noqa: F401

__all__ = ["TuneOptions", "BaselineRow", "TuneResult", "ProgressFn", "configs_for", "tune", "compare_baselines"]

log = logging.getLogger("octoplan.tuner")

DEFAULT_MICROBATCHES_PER_PP = 2  # without --global-batch or --microbatches: 2 per pipeline rank, as `baseline`
MAX_WORKERS = 1024  # --workers: far above any machine's cores, below where process counts overflow
MAX_SEED = 2**31 - 1  # --seed: CP-SAT's random_seed is a 32-bit signed int
# The share of the time limit the baselines may take (they are seeds and the table's rows)
BASELINES_SHARE = 0.5
# Seconds per op of the final plan's work after the search (its structure check, its stats and
# quick order bound, the plan file): 0.5 s for a plan of 49,152 ops (4 ranks x 4096
# microbatches x 3 ops) here, taken twice for a loaded machine
FINAL_S_PER_OP = 2e-5
# the most of the time limit the final plan's work is given before the search
FINAL_SHARE = 0.25
# Where ops cost nothing extra, plans this close to the fastest count as a tie, which the one
# of fewest stages (fewest ops) wins (_fewest_stages_of_a_tie)
NEAR_TIE = 1e-3


@dataclass(frozen=True)
class TuneOptions:
    gpus: int
    pp: int | None = None
    microbatches: int | None = None
    global_batch: int | None = None
    time_limit_s: float = 60.0
    # A budget of simulated plans instead of seconds: the search then measures its progress in
    # plans, so the result no longer depends on the machine's speed or load.
    max_plans: int | None = None
    seed: int = 0
    # the most stages per rank, in the layouts the search builds and among the baselines; None:
    # DEFAULT_CHUNKS in the search's layouts, every count up to MAX_BASELINE_CHUNKS among the
    # baselines (so a tuned plan may hold more stages per rank when a baseline is its seed)
    chunks_max: int | None = None
    dimensions: tuple[str, ...] = DIMENSIONS
    use_cpsat: bool = True
    baselines: bool = True  # seed with (and report) FORMATS.md section 6's baselines
    max_configs: int = 3  # outer configurations the local search visits, best seeds first
    max_starts: int = 6  # hill climbs, from the best seed of each kind of plan (_climb_starts)
    # processes that climb at once (:mod:`octoplan.tuner.pool`); they are spawned, so a script
    # that calls tune() with workers > 1 needs the usual `if __name__ == "__main__":` guard
    workers: int = 1
    # may stages recompute their activations (octoplan.costs.StageCost)? The tuner then also
    # prices every baseline that does not fit memory with full recomputation, as its users would
    recompute: bool = True
    # the plans the search may return (:mod:`octoplan.tuner.frameworks`): any, or only those
    # Megatron-LM ("megatron") or torchtitan ("loop", "v": its two stage placements) can run
    runs_on: str = "any"
    # Megatron-LM layout letters for layer kinds its layout has none for (export's --kind-letter:
    # (kind, letter) pairs), so that its runs_on="megatron" fallback reads the layers as the user said
    kind_letters: tuple[tuple[str, str], ...] = ()
    # the rank order the plans must keep (None: both are tried where dp > 1), so that a plan tuned
    # in place of another keeps the node layout its user chose (export's Megatron-LM fallback)
    rank_order: str | None = None


@dataclass(frozen=True)
class TuneResult:
    plan: Plan
    scored: Scored
    candidate: Candidate
    baselines: tuple[BaselineRow, ...]
    stats: dict = field(default_factory=dict)
    runs_on: tuple[str, ...] = ()  # the frameworks that run the tuned plan as planned
    # every configuration's best candidate the search priced, best first (the winner's first)
    configs: tuple[tuple[Candidate, Scored], ...] = ()
    # the fastest plan priced, before the near tie gave the plan to one of fewer stages
    # (_fewest_stages_of_a_tie); the near tie across microbatch sizes starts from it
    fastest: Scored | None = None
    # the fastest baseline that fits each of torchtitan and Megatron-LM runs (Baselines.by_framework)
    by_framework: tuple[BaselineRow, ...] = ()

    def best_baseline(self) -> BaselineRow | None:
        fitting = [row for row in self.baselines if row.scored.fits]
        return min(fitting, key=lambda row: row.scored.judged_ms, default=None)


def configs_for(profile: Profile, opts: TuneOptions, cluster: Cluster | None = None) -> list[Config]:
    """Every (pp, dp, microbatches, rank order) the options allow. Given the ``cluster``, a
    configuration whose two rank orders are the same hardware (every GPU on one node, each on
    its own, or pp 1, where they number ranks alike) is searched in one order only, pp-inner,
    unless ``opts.rank_order`` names one: the costs see only which ranks share a node, so a
    second order would spend the search's time on the same plans again. Where they differ, ``--runs-on`` may allow one order only
    (:func:`octoplan.tuner.frameworks.frameworks_order`)."""
    gpus = opts.gpus
    if gpus < 1:
        raise InputError(None, "--gpus", f"is {gpus}", "use a positive number")
    if opts.pp is not None:
        if opts.pp < 1:
            raise InputError(None, "--pp", f"is {opts.pp}", "use a pipeline degree of 1 or more")
        if gpus % opts.pp:
            raise InputError(None, "--pp", f"{opts.pp} does not divide --gpus {gpus}", "pick a pp that divides the GPU count")
        if opts.pp > profile.num_layers:
            raise InputError(None, "--pp", f"{opts.pp} exceeds the profile's {profile.num_layers} layers",
                             "use a pp no larger than the layer count")
        pps = [opts.pp]
    else:
        pps = [p for p in range(1, gpus + 1) if gpus % p == 0 and p <= profile.num_layers]
    mbs = profile.microbatch_size
    if opts.global_batch is not None and opts.microbatches is not None:
        raise InputError(None, "--global-batch", "and --microbatches are both given", "give one of them")
    out = []
    too_many = 0  # the most microbatches per pipeline of a config left out for having too many
    for pp in pps:
        dp = gpus // pp
        if opts.microbatches is not None:
            if not 1 <= opts.microbatches <= MAX_MICROBATCHES:
                raise InputError(None, "--microbatches", f"is {opts.microbatches}", f"use 1 to {MAX_MICROBATCHES}")
            num_mb = opts.microbatches
        else:
            batch = opts.global_batch if opts.global_batch is not None else DEFAULT_MICROBATCHES_PER_PP * gpus * mbs
            if batch < 1:
                raise InputError(None, "--global-batch", f"is {batch}", "use a positive number of samples")
            if batch % (dp * mbs):
                continue
            num_mb = batch // (dp * mbs)
            if num_mb > MAX_MICROBATCHES:
                too_many = max(too_many, num_mb)
                continue
        if opts.rank_order and dp > 1:
            orders: tuple[str, ...] = (opts.rank_order,)
        elif dp == 1 or pp == 1 or (cluster is not None and cluster.rank_orders_alike(gpus)):
            orders = ("pp-inner",)
        else:  # where the orders differ, the one that --runs-on's framework runs, or both
            only = frameworks_order(opts.runs_on, profile)
            orders = ("pp-inner", "dp-inner") if only is None else (only,)
        for order in orders:
            out.append(Config(pp, dp, num_mb, order))
    if not out and too_many:
        raise InputError(None, "--global-batch", f"{opts.global_batch} samples make {too_many} microbatches per pipeline, "
                         f"more than {MAX_MICROBATCHES}", "profile a larger --microbatch-size or give a smaller --global-batch")
    if not out:
        raise InputError(
            None, "--global-batch",
            f"{opts.global_batch} samples do not split into whole microbatches of {mbs} for any dp dividing {gpus}",
            f"use a multiple of {mbs} x a dp that divides {gpus}, e.g. {mbs * gpus}",
        )
    return out


def compare_baselines(profile: Profile, cluster: Cluster, opts: TuneOptions, *,
                      evaluator: Evaluator | None = None, until_s: float | None = None) -> list[BaselineRow]:
    """The baselines alone (``octoplan compare`` adds the tuned plan to them). ``evaluator``:
    one to price them with and keep them in (see :func:`tune`). ``until_s``: seconds (of
    ``opts``' clock) after which no more are priced (:func:`collect_baselines`); None: all."""
    cluster = _with_gpus(cluster, opts.gpus)
    configs = configs_for(profile, opts, cluster)
    search = Search(_evaluator_for(profile, cluster, evaluator), opts, None)
    search.ev.judge_per_sample(configs)
    rows = collect_baselines(profile, cluster, configs, opts, search, until_s=until_s).rows
    return [replace(row, runs_on=search.frameworks.runs_on(row.candidate),
                    allowed=search.frameworks.allows(row.candidate, opts.runs_on)) for row in rows]


def _with_gpus(cluster: Cluster, gpus: int) -> Cluster:
    return cluster if cluster.gpus == gpus else Cluster(**{**cluster.to_dict(), "gpus": gpus})


def _evaluator_for(profile: Profile, cluster: Cluster, given: Evaluator | None) -> Evaluator:
    """``given`` where it prices this profile on this cluster, a new one where none is given."""
    if given is None:
        return Evaluator(profile, cluster)
    if given.profile is not profile or given.cluster != cluster:
        raise ValueError("the evaluator given prices another profile or cluster")
    return given


def tune(
    profile: Profile,
    cluster: Cluster,
    opts: TuneOptions,
    *,
    profile_path: str | Path | None = None,
    progress: ProgressFn | None = None,
    seed_families: Sequence[SeedFamily] | None = None,
    neighbourhoods: Sequence[Neighbourhood] | None = None,
    evaluator: Evaluator | None = None,
) -> TuneResult:
    """The fastest plan the search finds that fits memory; ``InputError`` if none fits.
    ``seed_families`` and ``neighbourhoods`` replace :data:`~octoplan.tuner.seeds.SEED_FAMILIES`
    and :data:`~octoplan.tuner.neighbourhoods.NEIGHBOURHOODS` (in order). ``evaluator``: one that
    priced plans of this profile and cluster (its ``gpus`` set to ``opts.gpus``) before, such as
    :func:`compare_baselines`'s, so they cost nothing again; its plans count as the search's."""
    opts = _checked(profile, opts, profile_path)
    cluster = _with_gpus(cluster, opts.gpus)
    configs = configs_for(profile, opts, cluster)
    # the search's own bound on stages per rank: no rank can hold more stages than there are
    # layers, so a larger --chunks-max changes nothing (the baselines read the bound as given);
    # and its end, early enough for the final plan's work to end within the time limit too
    search = Search(_evaluator_for(profile, cluster, evaluator),
                    replace(opts, chunks_max=min(opts.chunks_max or DEFAULT_CHUNKS, profile.num_layers),
                            time_limit_s=opts.time_limit_s - final_work_s(configs, opts, profile.num_layers)),
                    progress, neighbourhoods=neighbourhoods, stage_cap=opts.chunks_max)
    search.ev.judge_per_sample(configs)
    # the baselines may take up to half the time limit: at thousands of microbatches they alone
    # take longer than a short one (--time-limit 5 on 4096 microbatches: 28 s)
    collected = (collect_baselines(profile, cluster, configs, opts, search, until_s=BASELINES_SHARE * opts.time_limit_s)
                 if opts.baselines else Baselines([], 0))
    baselines = collected.rows
    ctx = SeedContext(search, configs, baseline_chunks(opts))
    families = [family for family in (SEED_FAMILIES if seed_families is None else seed_families) if family.applies(ctx)]

    seeds = _seeds(ctx, families, baselines)
    ranked = _ranked(ctx, families, seeds)
    seeded_s = search.clock.elapsed()
    starts, later = _climb_starts(ranked, search.opts)
    climbed = _climbs(search, starts, later)

    fastest = _best_that_fits(search, profile_path, unpriced=collected.unpriced)
    best, best_scored = _fewest_stages_of_a_tie(search, *fastest)
    search.config_best[best.config] = (best, best_scored)  # the configurations' table shows the plan written
    plan = _final_plan(search.ev, best, profile_path=profile_path)
    stats = _stats(search, best, plan, climbed=climbed, configs=len(configs), seeds=len(seeds), seeded_s=seeded_s,
                   families=ctx.stats, baselines_unpriced=collected.unpriced, time_limit_s=opts.time_limit_s)
    stats["near_tie"] = best is not fastest[0]  # fewer stages won within NEAR_TIE of the fastest (tune's verdict says so)
    plan = replace(plan, extra={"tuner": stats if opts.max_plans is None else _without_wall_times(stats)})
    log.info("tuned in %.1f s, %d evaluations: %.4f ms", stats["wall_s"], stats["evaluations"], best_scored.iteration_ms)
    frameworks = search.frameworks
    rows, by_framework = (tuple(replace(row, runs_on=frameworks.runs_on(row.candidate),
                                        allowed=frameworks.allows(row.candidate, opts.runs_on)) for row in found)
                          for found in (baselines, collected.by_framework))
    configs_best = tuple(sorted(search.config_best.values(),  # the written plan's configuration first (a near tie
                                # may have written it over a faster one), then the rest by their time
                                key=lambda item: (item[0].config != best.config, item[1].score, item[0].config)))
    return TuneResult(plan, best_scored, best, rows, stats, frameworks.runs_on(best), configs_best, fastest[1], by_framework)


def check_options(opts: TuneOptions) -> None:
    """``InputError`` for an option no profile makes right, with the value as the user gave it
    (callers that share the budget out check before they divide it)."""
    if not 0 < opts.time_limit_s < math.inf:
        raise InputError(None, "--time-limit", f"is {opts.time_limit_s:g}",
                         "give the search a positive, finite number of seconds (--max-plans bounds it by work instead)")
    if opts.max_plans is not None and opts.max_plans < 1:
        raise InputError(None, "--max-plans", f"is {opts.max_plans}", "give a positive number of plans, or leave it out")
    if opts.chunks_max is not None and opts.chunks_max < 1:
        raise InputError(None, "--chunks-max", f"is {opts.chunks_max}", "allow at least 1 stage per rank")
    if opts.workers < 1:
        raise InputError(None, "--workers", f"is {opts.workers}", "use at least 1 process")
    if opts.workers > MAX_WORKERS:
        raise InputError(None, "--workers", f"is {opts.workers}", f"use at most {MAX_WORKERS} processes (one per core to spare)")
    if not 0 <= opts.seed <= MAX_SEED:
        raise InputError(None, "--seed", f"is {opts.seed}", f"use a seed from 0 to {MAX_SEED}")
    if opts.runs_on not in RUNS_ON:
        raise InputError(None, "--runs-on", f"is {opts.runs_on!r}", f"use one of {', '.join(RUNS_ON)}")
    if opts.runs_on == "v" and opts.chunks_max is not None and opts.chunks_max < 2:
        raise InputError(None, "--chunks-max", f"is {opts.chunks_max}, and --runs-on v places two stages on every rank",
                         "give --chunks-max 2 or more, or another --runs-on")


def _checked(profile: Profile, opts: TuneOptions, profile_path: str | Path | None) -> TuneOptions:
    """``opts``, checked; under ``--runs-on megatron`` confined to the partition (Megatron runs
    its own order: boundary shifts keep it, every other move would leave it)."""
    check_options(opts)
    if opts.runs_on == "megatron":
        reason = Frameworks(profile, letters=dict(opts.kind_letters)).megatron_reason
        if reason:
            raise InputError(str(profile_path) if profile_path else None, "--runs-on megatron", reason,
                             "Megatron-LM's pipeline layout cannot express this model as it is: map its kinds with "
                             "--kind-letter KIND=LETTER, or tune for octorun or torch")
        ep, tp = expert_parallel(profile), tensor_parallel(profile)
        pps = [opts.pp] if opts.pp else [p for p in range(1, opts.gpus + 1) if opts.gpus % p == 0]
        if ep > 1 and not any(opts.gpus % p == 0 and (tp * opts.gpus // p) % ep == 0 for p in pps):
            at = f" at pp {opts.pp}" if opts.pp else ""
            raise InputError(str(profile_path) if profile_path else None, "--runs-on megatron",
                             f"Megatron-LM forms the profile's expert-parallel groups (ep {ep}) from a stage's tensor- "
                             f"and data-parallel ranks, and no split of {opts.gpus} pipeline GPUs{at} (tp {tp}) leaves "
                             f"tp x dp a multiple of {ep}", "give more GPUs, or tune for octorun or torch")
        opts = replace(opts, dimensions=tuple(d for d in opts.dimensions if d == "partition"))
    if opts.runs_on in ("loop", "v") and torchtitan_cuts(profile, "llama") is None and torchtitan_cuts(profile, "profile") is None:
        raise InputError(str(profile_path) if profile_path else None, f"--runs-on {opts.runs_on}",
                         f"torchtitan's export has no module name for the profile's {non_llama_kind(profile)!r} "
                         "layers (a Llama-style model has none), and this profile's own layer names are no "
                         "module names either",
                         "tune without --runs-on, or profile a model file whose layer_name gives each layer's "
                         "module name and export with --fqn-style profile")
    return opts


def _seeds(ctx: SeedContext, families: Sequence[SeedFamily], baselines: Sequence[BaselineRow]) -> list[Candidate]:
    """The baselines, then configuration by configuration every family's seeds, unpriced. A
    configuration is seeded whole or not at all, so one starts only where, at the pace of the
    slowest so far, it should end by the climbs' end: one started just before the limit ran past
    it (gemma2-27b on 64 GPUs under --time-limit 10: 12 configurations, seeding until 10.2 s)."""
    clock = ctx.search.clock
    end_s = climbs_end_s(ctx.search.opts.time_limit_s)
    seeds = [row.candidate for row in baselines]
    slowest_s = 0.0
    for config in ctx.configs:
        started_s = clock.elapsed()
        if started_s + slowest_s >= end_s:
            break
        earlier = [cand for cand in seeds if cand.config == config]
        for family in families:
            found = list(family.seeds(ctx, config, tuple(earlier)))
            seeds += found
            earlier += found
        slowest_s = max(slowest_s, clock.elapsed() - started_s)
    return seeds


def _ranked(ctx: SeedContext, families: Sequence[SeedFamily], seeds: Sequence[Candidate]) -> list[Ranked]:
    """``seeds`` priced and ranked (score, then index), with every family's seeds made from the
    ranked ones ranked among them, family by family; only those ``--runs-on`` allows."""
    search = ctx.search
    # priced until the climbs' end, as every family's rebuilds are: the rest of the limit is the
    # final plan's (pricing one of llama3-70b-a100's seeds takes up to 0.8 s)
    end_s = climbs_end_s(search.opts.time_limit_s)
    ranked: list[Ranked] = []
    for index, cand in enumerate(seeds):
        if search.clock.elapsed() >= end_s and search.best is not None:
            break
        ranked.append((search.offer(cand).score, index, cand))
    ranked.sort(key=lambda item: (item[0], item[1]))
    for family in families:
        more = [(search.offer(cand).score, index, cand) for index, cand in family.from_ranked(ctx, ranked)]
        if more:
            ranked = sorted(ranked + more, key=lambda item: (item[0], item[1]))
    ranked = [item for item in ranked if search.allowed(item[2])]
    if not ranked and search.best is None:  # (a budget spent on the baselines leaves none to rank, yet a best)
        runs_on = search.opts.runs_on
        raise InputError(None, "--runs-on", f"{runs_on}: no plan of that kind applies to these GPUs and "
                         "microbatches", _NO_SEED_FIX.get(runs_on, "tune with --runs-on any"))
    return ranked


_NO_SEED_FIX = {
    "megatron": "Megatron-LM needs a stage per rank at least, and for interleaved 1F1B microbatches that are a "
                "multiple of pp; give --pp and --microbatches that allow it",
    "loop": "a loop needs the same number of stages on every rank: give a --pp no larger than the layer count",
    "v": "a V needs two stages per rank: give a --pp of at most half the layer count",
}


def _climb_starts(ranked: Sequence[Ranked], opts: TuneOptions) -> tuple[list[Candidate], list[Candidate]]:
    """Where the climbs start: the best seed of each kind of plan (configuration x stage count
    x fixed or policy order), best kinds first, in the ``max_configs`` most promising
    configurations, at most ``max_starts``; then, for the time those climbs leave unused (they
    stop at local optima), the next-best seeds of those configurations, any kind, best first,
    so a converged search keeps looking elsewhere."""
    starts: list[Candidate] = []
    kinds: set = set()
    configs_seen: list[Config] = []
    for _, _, cand in ranked:
        if cand.config not in configs_seen:
            configs_seen.append(cand.config)
        if configs_seen.index(cand.config) >= opts.max_configs:
            continue
        kind = (cand.config, cand.num_stages, cand.fixed is None)
        if kind not in kinds:
            kinds.add(kind)
            starts.append(cand)
    starts = starts[:opts.max_starts]
    first = set(starts)
    later = list(dict.fromkeys(cand for _, _, cand in ranked
                               if cand not in first and configs_seen.index(cand.config) < opts.max_configs))
    return starts, later


def _climbs(search: Search, starts: Sequence[Candidate], later: Sequence[Candidate]) -> int:
    """The climbs from ``starts``, then from ``later`` each followed by a restart, then restarts
    alone while they pay, and the polish; how many climbs ran (restarts aside)."""
    opts = search.opts
    end_s = climbs_end_s(opts.time_limit_s)  # the rest is the polish's and the final plan's
    restarts = Restarts(search, starts)
    if opts.workers > 1:
        from octoplan.tuner.pool import Climb, climb_in_parallel

        climbs = [Climb(cand, True) for cand in starts] + [Climb(cand, False) for cand in later]
        climbed = climb_in_parallel(search, search.ev.profile, search.ev.cluster, opts, climbs, end_s=end_s)
    else:
        climbed = 0
        # each of the first climbs gets an equal share of the time left before end_s; what a
        # climb leaves unused passes on
        for index, start in enumerate(starts):
            if search.clock.elapsed() >= end_s:
                break
            share = (end_s - search.clock.elapsed()) / (len(starts) - index)
            search.climb(start, deadline=search.clock.elapsed() + share)
            climbed += 1
        # then climbs from the next-best seeds, each followed by a restart (a climb from the
        # first seeds again, on shaken times) until the restarts stop paying
        for cand in later:
            if search.clock.elapsed() >= end_s:
                break
            search.climb(cand, deadline=end_s)
            climbed += 1
            restarts.next(end_s)
    # and in the time left, only restarts
    while not restarts.done and search.clock.elapsed() < end_s:
        restarts.next(end_s)
    if "schedule" in opts.dimensions:
        search.polish()
    return climbed


def _best_that_fits(search: Search, profile_path: str | Path | None, *, unpriced: int = 0) -> tuple[Candidate, Scored]:
    """The search's best plan; ``InputError`` naming the leanest plan's memory if none fits
    (``unpriced``: baselines the budget left unpriced, among which one may fit)."""
    best, best_scored = search.best, search.best_scored
    if best is None or best_scored is None or not best_scored.fits:
        least = search.ev.least_memory()
        flag, budget = (("--max-plans", "a larger --max-plans") if search.opts.max_plans is not None
                        else ("--time-limit", "a longer --time-limit"))
        limits = ([f"--runs-on {search.opts.runs_on}"] if search.opts.runs_on != "any" else []) + \
            ([f"--chunks-max {search.stage_cap}"] if search.stage_cap is not None else [])
        if least is not None and least <= search.ev.cluster.memory_bytes and limits:
            # plans that fit were priced, but none that the options allow the search to keep
            allowing = " and ".join(limits)
            spent = search.clock.out() or unpriced > 0
            raise InputError(
                str(profile_path) if profile_path else None, flag if spent else "--memory-gb",
                f"no plan that {allowing} allows{' was found that' if spent else ''} fits "
                f"{search.ev.cluster.memory_gb:g} GB per GPU; plans it does not allow fit in {least / 1e9:.3g} GB",
                (f"give {budget}, or tune without {allowing}" if spent
                 else f"use more GPUs or a larger --memory-gb, or tune without {allowing}"))
        needed = f"{least / 1e9:.3g} GB" if least is not None else "more memory"
        cut_short = (f"; {unpriced} baseline{'s were' if unpriced > 1 else ' was'} left unpriced by the budget, and one "
                     f"of them may fit: "
                     f"give {budget}" if unpriced else "")
        raise InputError(
            str(profile_path) if profile_path else None, "--memory-gb",
            f"no plan fits {search.ev.cluster.memory_gb:g} GB per GPU; the leanest plan found needs {needed} per GPU",
            "use more GPUs, a larger --memory-gb, or a profile of a smaller --microbatch-size"
            + ("" if search.opts.recompute else "; or let stages recompute their activations (drop --no-recompute)")
            + cut_short,
        )
    return best, best_scored


def final_work_s(configs: Sequence[Config], opts: TuneOptions, num_layers: int) -> float:
    """Seconds kept out of the search for the final plan's work, by the size of the largest
    configuration's plan of as many stages per rank as the search's layouts hold (F, I and W of
    every microbatch on each): a tune of thousands of microbatches spends a second or more on
    it. None under ``--max-plans``, whose search stops by plans, not seconds (and must stay the
    same on any machine)."""
    if opts.max_plans is not None:
        return 0.0
    stages_per_rank = [min(opts.chunks_max or DEFAULT_CHUNKS, max(1, num_layers // config.pp)) for config in configs]
    ops = max(config.pp * chunks * config.microbatches * 3 for config, chunks in zip(configs, stages_per_rank))
    return min(FINAL_SHARE * opts.time_limit_s, FINAL_S_PER_OP * ops)


def _fewest_stages_of_a_tie(search: Search, best: Candidate, best_scored: Scored) -> tuple[Candidate, Scored]:
    """Where the cluster prices no cost per op (``op_overhead_us`` 0, as before ``octoplan
    calibrate``), the plan of fewest stages among every fitting plan this process priced (the
    baselines among them) within :data:`NEAR_TIE` of the fastest: a plan that gains less than
    that by cutting the layers into more stages gains it only because its extra ops are free. A
    pp-1 plan of 10 stages on one rank, 0.05% faster in the simulator than the same replicas'
    one stage, ran 1.5x slower replayed on this machine's CPU (docs/BENCHMARKS.md)."""
    if search.ev.cluster.op_overhead_us > 0:
        return best, best_scored
    near = best_scored.judged_ms * (1 + NEAR_TIE)
    ties = [(cand, scored) for cand, scored in search.ev.priced_plans()
            if scored.fits and scored.judged_ms <= near and cand.num_stages < best.num_stages]
    for cand, scored in sorted(ties, key=lambda item: (item[0].num_stages, item[1].judged_ms, item[0].config)):
        if search.frameworks.allows(cand, search.opts.runs_on):
            return cand, scored
    return best, best_scored


def _stats(search: Search, best: Candidate, plan: Plan, *, climbed: int, configs: int, seeds: int, seeded_s: float,
           families: dict[str, list], baselines_unpriced: int, time_limit_s: float) -> dict:
    """The plan's ``extra.tuner``: how the search went, and where the best plan's time goes."""
    from octoplan.schedules.exact import relaxation_bound  # OR-Tools only when the tuner runs

    evaluator, opts = search.ev, search.opts
    # what a better order of the same stages and placement could still save, at most
    order_bound = relaxation_bound(plan.schedule, best.ranks, evaluator.costs(best), cluster=evaluator.cluster,
                                   parallel=best.config.parallel())
    # where the rest of the iteration goes: efficiency = balance (how close the busiest rank's
    # work is to FORMATS.md section 7's lower bound) x schedule (how little that rank idles), and
    # when it idles: a warm-up says it needs less work, waits between ops a lighter neighbour
    timeline = evaluator.timeline(best)
    busiest = timeline.busiest_rank
    warm_up, between, drain = timeline.idle_parts(busiest)
    stats = {
        "seed": opts.seed,
        "time_limit_s": time_limit_s,  # the search's own ends earlier by final_work_s
        # real seconds, also under --max-plans (whose clock counts plans as seconds)
        "wall_s": round(time.perf_counter() - search.clock.start, 3),
        # with workers, a plan simulated in two processes (each has its own cache) counts twice
        "evaluations": search.plans_simulated(),
        "workers": opts.workers,
        "plans_in_workers": search.extra_plans,
        "climbs": climbed,
        "restarts": search.restarts,
        "plans_in_restarts": search.restart_plans,
        "configs": configs,
        "seeds": seeds,
        "baselines_unpriced": baselines_unpriced,
        # the seeds' share of the budget: seconds, or under --max-plans the plans they took
        **({"seeding_s": round(seeded_s, 3)} if opts.max_plans is None else
           {"seeding_plans": round(seeded_s / opts.time_limit_s * opts.max_plans)}),
        "origin": best.origin,
        "moves_accepted": len(search.accepted_moves),
        "order_bound_ms": round(order_bound, 4),
        "busiest_rank": busiest,
        "busiest_busy_ms": round(timeline.busy_ms[busiest], 4),
        # of which the forwards that recomputing stages run again in their I and B ops
        "busiest_recompute_ms": round(sum(evaluator.recomputed_forward_ms(best, op.stage) for op in plan.schedule[busiest]
                                          if op.kind in (Kind.I, Kind.B)), 4),
        "lower_bound_ms": round(timeline.lower_bound_ms, 4),
        # a profile of layers that take no time makes every plan perfect: 1, not a division by 0;
        # 6 decimals, so that tune's 3 are the true value's (4 rounded twice: 0.92754 -> 0.9275 -> 0.927)
        "balance": round(timeline.lower_bound_ms / timeline.busy_ms[busiest], 6) if timeline.busy_ms[busiest] else 1.0,
        "schedule": round(timeline.busy_ms[busiest] / timeline.iteration_ms, 6) if timeline.iteration_ms else 1.0,
        "busiest_idle_ms": {"warm_up": round(warm_up, 4), "between": round(between, 4), "drain": round(drain, 4)},
        "dimensions": list(opts.dimensions),
        "cpsat": [],
    }
    stats.update(families)  # what the seed families report (CP-SAT's solves)
    if best.policies is not None:
        stats["policies"] = [p.to_dict() for p in best.policies]
    stats["runs_on"] = opts.runs_on
    # how plans were compared: per iteration, or per microbatch where configurations train different batches
    stats["judged"] = "per microbatch" if search.ev.per_sample else "per iteration"
    return stats


def _without_wall_times(value):
    """``value`` (the tuner's stats) without its wall-clock seconds (every ``wall_s``): under
    ``--max-plans`` the plan file is then the same byte for byte on any machine at any load."""
    if isinstance(value, dict):
        return {key: _without_wall_times(item) for key, item in value.items() if key != "wall_s"}
    if isinstance(value, list):
        return [_without_wall_times(item) for item in value]
    return value


def _final_plan(evaluator: Evaluator, cand: Candidate, *, profile_path: str | Path | None) -> Plan:
    plan = evaluator.plan(cand)
    check_structure(plan, num_layers=evaluator.num_layers)
    path = str(profile_path) if profile_path else None
    sha = file_sha256(profile_path) if profile_path and Path(profile_path).exists() else None
    return Plan(
        model=plan.model, cluster=plan.cluster, parallel=plan.parallel, stages=plan.stages, schedule=plan.schedule,
        profile=path, profile_sha256=sha,
        predicted=evaluator.simulate(cand).prediction(),  # the figures scored, and octorun's to set beside
    )


