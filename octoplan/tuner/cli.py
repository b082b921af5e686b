"""``octoplan tune`` and ``octoplan compare``: thin commands over :func:`octoplan.tuner.tune`.

``register(app)`` adds both to the planner's typer app. Parse, call the tuner with a rich
progress line (best iteration time and bubble ratio so far), render the comparison table,
write the plan.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from octoplan.cliutil import (
    GPUS_PER_NODE, INTER_NODE_GBPS, INTRA_NODE_GBPS, LATENCY_US, MEMORY_GB, OP_OVERHEAD_US,
    ClusterOptions, cluster_from, guarded, read_profile, terminal,
)
from octoplan.outputs import check_writable

__all__ = ["register", "comparison_rows", "shown_rows"]

# wide enough for the comparison table even when the output is not a terminal
console = terminal()


def _ratio(ms: float, against_ms: float) -> float:
    """``ms / against_ms``, and 1 where both plans take no time (a profile of 0 ms layers)."""
    return ms / against_ms if against_ms > 0 else 1.0


def comparison_rows(result, sizes: dict[int, int] | None = None, tuned_size: int | None = None) -> list[dict]:
    """The tuned plan against every baseline on the same GPUs, as plain rows. ``sizes``: where
    several microbatch sizes were tuned, each baseline row's (by its index), and the tuned
    plan's ``tuned_size``: the short configuration then names them."""
    tuned_ms = result.scored.iteration_ms
    tuned_judged = result.scored.judged_ms  # per microbatch where the configurations train different batches
    c = result.candidate.config
    rows = [{
        "plan": "tuned", "config": c.label(), "short": _short(c, tuned_size if sizes else None),
        "iteration_ms": tuned_ms, "judged_ms": tuned_judged, "speedup": 1.0,
        "bubble_ratio": result.scored.bubble_ratio, "efficiency": result.scored.efficiency,
        "peak_memory_gb": result.scored.peak_memory_bytes / 1e9, "fits": result.scored.fits,
        "runs_on": list(result.runs_on),
    }]
    for index, row in enumerate(result.baselines):
        s = row.scored
        rows.append({
            "plan": _label(row), "config": row.config.label(), "short": _short(row.config, (sizes or {}).get(index)),
            "iteration_ms": s.iteration_ms, "judged_ms": s.judged_ms,
            "speedup": _ratio(s.judged_ms, tuned_judged), "bubble_ratio": s.bubble_ratio,
            "efficiency": s.efficiency, "peak_memory_gb": s.peak_memory_bytes / 1e9, "fits": s.fits,
            "runs_on": list(row.runs_on),
        })
    return rows


def _label(row) -> str:
    """A baseline's name; a +recompute one's stages recompute their first N layers, or all."""
    layers = max((k for _, k in row.candidate.recompute_layers), default=None)
    return row.name if layers is None else f"{row.name} (first {layers} layers)"


def _short(config, microbatch_size: int | None = None) -> str:
    order = "" if config.dp == 1 else (" pi" if config.rank_order == "pp-inner" else " di")
    size = "" if microbatch_size is None else f" x{microbatch_size}"
    return f"{config.pp}.{config.dp}.{config.microbatches}{size}{order}"


def shown_rows(rows: list[dict]) -> list[dict]:
    """The rows the table prints: interleaved 1F1B is priced with every chunk count the layers
    allow (up to 32 rows per partition), so of each partition's it shows the default 2 chunks
    and the fastest other count (one that fits, where any does)."""
    best: dict[str, dict] = {}
    for row in rows:
        match = re.fullmatch(r"interleaved-1f1b\(v=\d+\)/(\w+)(\+recompute)?( \(first \d+ layers\))?", row["plan"])
        if match:
            key = match.group(1) + (match.group(2) or "")
            if key not in best or _judged(best[key]) > _judged(row):
                best[key] = row
    keep = {id(row) for row in best.values()}
    return [row for row in rows if not row["plan"].startswith("interleaved-1f1b(v=") or id(row) in keep]


def _judged(row: dict) -> tuple[bool, float]:
    """How a row of :func:`comparison_rows` ranks: those that fit first, then by the time the
    search judges (per microbatch where the configurations train different batches)."""
    return (not row["fits"], row.get("judged_ms", row["iteration_ms"]))


def _table(result, sizes: dict[int, int] | None = None, tuned_size: int | None = None) -> Table:
    table = Table(title="tuned plan vs the baselines (docs/FORMATS.md section 6) on the same GPUs",
                  caption="pp.dp.mb: pipeline degree, data-parallel degree, microbatches per pipeline "
                          "(xN: samples per microbatch, where several were tuned; "
                          "pi / di: pp-inner / dp-inner rank order); tuned x: how much faster the tuned plan is "
                          "(per microbatch, ms/mb, where the configurations train different batches); "
                          "interleaved-1f1b(v=N): of the chunk counts above 2, the fastest; runs on: the "
                          "frameworks that run the plan as planned (torch: torch.distributed.pipelining)")
    rows = shown_rows(comparison_rows(result, sizes, tuned_size))
    per = result.scored.samples > 1  # configurations of different batches: judged per microbatch
    for name, justify in (("plan", "left"), ("pp.dp.mb", "left"), ("iter ms", "right"), *([("ms/mb", "right")] if per else []),
                          ("tuned x", "right"), ("bubble", "right"), ("eff", "right"), ("peak GB", "right"),
                          ("fits", "center")):
        table.add_column(name, justify=justify, overflow="fold")
    # narrow: the frameworks wrap before a plan's name does
    table.add_column("runs on", justify="left", overflow="fold", max_width=16)
    for row in rows:
        style = "bold green" if row["plan"] == "tuned" else (None if row["fits"] else "dim")
        table.add_row(
            row["plan"], row["short"], f"{row['iteration_ms']:.2f}", *([f"{row['judged_ms']:.2f}"] if per else []),
            f"{row['speedup']:.3f}x",
            f"{row['bubble_ratio']:.1%}", f"{row['efficiency']:.3f}", f"{row['peak_memory_gb']:.1f}",
            "yes" if row["fits"] else "no", ", ".join(row["runs_on"]), style=style,
        )
    return table


def _verdict(result, memory_gb: float) -> str:
    """The line under the table: the comparison that counts, against baselines that fit."""
    best = result.best_baseline()
    if best is None:
        return f"no baseline fits {memory_gb:g} GB per GPU; the tuned plan does"
    from octoplan.tuner.configs import per_microbatch

    ratio = _ratio(best.scored.judged_ms, result.scored.judged_ms)
    head = f"fastest baseline that fits: {_label(best)} ({best.config.label()}), {best.scored.iteration_ms:.2f} ms; "
    if ratio < 1 / 1.0005:  # slower: a ratio under 1 read as "0.895x faster"
        from octoplan.tuner.search import NEAR_TIE

        confined = result.stats.get("runs_on", "any")
        # a baseline --runs-on refuses could not have been written, whatever the tie rule chose
        if confined != "any" and not best.allowed:
            why = f": --runs-on {confined} confines it to plans that framework runs, and this baseline is not one"
        elif result.stats.get("near_tie") and 1 / ratio <= 1 + NEAR_TIE:
            why = (f": a tie within {NEAR_TIE:.1%} goes to the plan of fewer stages where no per-op cost is given "
                   "(--op-overhead-us), whose extra ops would cost more than that")
        else:
            why = ": the search did not reach this baseline's layout within its budget"
        return f"{head}the tuned plan is {1 / ratio:.3f}x slower{per_microbatch(result.scored)}{why}"
    tie = ": the search found nothing faster than this baseline" if ratio < 1.0005 else ""
    return f"{head}the tuned plan is {ratio:.3f}x faster{per_microbatch(result.scored)}{tie}"


def _framework_costs(result, batch) -> list[str]:
    """What staying on a framework that cannot run the tuned plan costs: the fastest baseline
    that fits and that it runs, on any configuration of any size, against the tuned plan."""
    from octoplan.tuner.configs import per_microbatch

    lines = []
    every = [row for _, row in (*batch.baselines, *batch.by_framework)]
    for framework, runs_on in (("Megatron-LM", "megatron"), ("torchtitan", "loop")):
        if framework in result.runs_on:
            continue
        rows = [row for row in every if row.scored.fits and framework in row.runs_on]
        best = min(rows, key=lambda row: row.scored.judged_ms, default=None)
        if best is None:
            lines.append(f"{framework} runs none of the baselines that fit; `octoplan tune --runs-on {runs_on}` "
                         "looks for a plan it runs")
            continue
        ratio = _ratio(best.scored.judged_ms, result.scored.judged_ms)
        also = " (or v)" if framework == "torchtitan" else ""
        staying = "staying on" if ratio >= 1 else "on"  # (a framework the confined plan does not run may be faster)
        lines.append(f"{staying} {framework}: its fastest baseline that fits here is {_label(best)} "
                     f"({best.config.label()}), {best.scored.iteration_ms:.2f} ms, {ratio:.3f}x the tuned plan's time"
                     f"{per_microbatch(result.scored)}; "
                     f"`octoplan tune --runs-on {runs_on}`{also} tunes the best plan it runs")
    return lines


def _run(sources, gpus, microbatches, pp, global_batch, time_limit, seed, chunks_max, no_cpsat, cluster_opts,
         max_plans=None, workers=1, no_recompute=False, runs_on="any", kind_letters=()):
    """Tune every profile (one per microbatch size) and return the global batch's result
    (:class:`octoplan.tuner.configs.BatchResult`)."""
    from rich.live import Live

    from octoplan.export_megatron import check_kind_letters, parse_kind_letters
    from octoplan.tuner.configs import tune_global_batch
    from octoplan.tuner.search import TuneOptions

    letters = parse_kind_letters(kind_letters or ())
    for _, profile in sources:
        check_kind_letters(profile, letters)
    cluster = cluster_from(gpus, cluster_opts, sources[0][1])
    opts = TuneOptions(gpus=gpus, pp=pp, microbatches=microbatches, global_batch=global_batch,
                       time_limit_s=time_limit, seed=seed, chunks_max=chunks_max, use_cpsat=not no_cpsat,
                       max_plans=max_plans, workers=workers, recompute=not no_recompute, runs_on=runs_on,
                       kind_letters=tuple(sorted(letters.items())))
    what = ", ".join(str(path) for path, _ in sources)
    with Live(console=console, transient=True, refresh_per_second=4) as live:
        live.update(f"tuning {what} on {gpus} GPUs ...")

        def progress(best, evaluations, elapsed):
            state = f"{best.iteration_ms:.2f} ms, bubble {best.bubble_ratio:.1%}" if best.fits else \
                f"nothing fits yet (leanest {best.peak_memory_bytes / 1e9:.1f} GB)"
            live.update(f"tuning: best {state} - {evaluations} plans simulated, {elapsed:.1f}/{time_limit:g} s")

        batch = tune_global_batch(sources, cluster, opts, progress=progress)
    return batch


def _merged(batch):
    """The winning size's result with every size's baselines (each label's best row over the
    sizes), and each row's microbatch size by index (none where one size was tuned)."""
    best: dict[str, tuple[int, object]] = {}
    for size, row in batch.baselines:
        held = best.get(row.name)
        if held is None or row.scored.score < held[1].scored.score:
            best[row.name] = (size, row)
    # a +recompute row is there for a schedule that fits nowhere without: at some size it may
    kept = [best[name] for name in dict.fromkeys(row.name for _, row in batch.baselines)
            if not (name.endswith("+recompute") and best.get(name[:-len("+recompute")], (0, None))[1] is not None
                    and best[name[:-len("+recompute")]][1].scored.fits)]
    result = replace(batch.result, baselines=tuple(row for _, row in kept))
    several = len({size for size, _ in batch.baselines}) > 1 or len({row.microbatch_size for row in batch.configs}) > 1
    return result, ({index: size for index, (size, _) in enumerate(kept)} if several else None)


CONFIG_ROWS = 8  # the configurations the table shows: the fastest that fit, then the fastest that do not


def _configs_table(batch) -> Table:
    rows = batch.configs
    several = len({row.microbatch_size for row in rows}) > 1
    # with a count of microbatches per pipeline over several dp, each configuration trains its own batch
    batch_of = ("configurations, each training dp x its microbatches, ranked by time per microbatch" if rows[0].scored.samples > 1
                else "configurations for this batch")
    table = Table(title=f"{batch_of}: the best plan found for each ({len(rows)} priced"
                        + (f"; {CONFIG_ROWS} shown, the fastest that fit first" if len(rows) > CONFIG_ROWS else "")
                        + ")",
                  caption="the busiest GPU's time in parts: compute (its ops, less recomputed forwards), recompute, "
                          "bubbles (waiting on other GPUs' work), transfers (waiting on the wire), all-reduce (the "
                          "gradient all-reduce left after the last op); why: the part that grew most against the fastest")
    per = rows[0].scored.samples > 1
    columns = (["mbs"] if several else []) + ["pp.dp.mb", "iter ms"] + (["ms/mb"] if per else []) + [
        "compute", "recompute", "bubbles", "transfers", "all-reduce", "fits", "why slower"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("pp.dp.mb", "why slower") else "right", overflow="fold")
    winner = rows[0]
    from octoplan.tuner.configs import TIME_PARTS, why_slower

    for row in rows[:CONFIG_ROWS]:
        cells = ([str(row.microbatch_size)] if several else []) + [_short(row.config), f"{row.scored.iteration_ms:.2f}"]
        cells += [f"{row.scored.judged_ms:.2f}"] if per else []
        cells += [f"{row.parts[part]:.2f}" for part in TIME_PARTS]
        cells += ["yes" if row.scored.fits else "no", why_slower(row, winner)]
        table.add_row(*cells, style="bold green" if row is winner else (None if row.scored.fits else "dim"))
    return table


def _config_verdict(batch) -> str:
    """Which configuration won, and why the next-best lost."""
    from octoplan.tuner.configs import per_microbatch, why_slower

    rows = batch.configs
    winner = rows[0]
    if len(rows) == 1:
        return f"one configuration applies: {winner.label()}"
    runner = rows[1]
    ratio = _ratio(runner.scored.judged_ms, winner.scored.judged_ms)
    slower = f"{ratio:.3f}x the time{per_microbatch(winner.scored)}" if runner.scored.fits else "does not fit"
    # the written plan comes first; where a near tie wrote it, a faster one follows
    won = "fastest configuration" if not runner.scored.fits or ratio >= 1 else "configuration written"
    return f"{won}: {winner.label()}; the next best, {runner.label()}, {slower}; {why_slower(runner, winner)}"


def _report(batch, memory_gb: float) -> None:
    """The tables and lines ``tune`` and ``compare`` print."""
    result, sizes = _merged(batch)
    console.print(_configs_table(batch))
    console.print(_config_verdict(batch), soft_wrap=True)
    if batch.untuned_sizes:
        from octoplan.tuner.configs import MAX_TUNER_GAIN

        untuned = ", ".join(str(size) for size in batch.untuned_sizes)
        console.print(f"microbatch size {untuned}: priced by its baselines only, whose best is more than "
                      f"{MAX_TUNER_GAIN:g}x the best size's (more than the tuner has gained over a baseline)", soft_wrap=True)
    console.print(_table(result, sizes, batch.microbatch_size))
    console.print(_verdict(result, memory_gb), soft_wrap=True)
    unpriced = result.stats.get("baselines_unpriced", 0)
    if unpriced:
        console.print(f"{unpriced} baseline{'s' if unpriced > 1 else ''} (schedule/partition on a configuration) not "
                      f"priced: the baselines may take half of the time limit ({result.stats['time_limit_s']:.3g} s), and "
                      "the table leaves these out; a longer --time-limit (a larger --max-plans, where it is given) "
                      "prices them all", soft_wrap=True)
    for line in _framework_costs(result, batch):
        console.print(line, soft_wrap=True)


_GPN, _MEM, _INTRA, _INTER, _LAT, _OVH = GPUS_PER_NODE, MEMORY_GB, INTRA_NODE_GBPS, INTER_NODE_GBPS, LATENCY_US, OP_OVERHEAD_US
_MB = typer.Option(None, "--microbatches", help="microbatches per pipeline (pins them)")
_PP = typer.Option(None, "--pp", help="pipeline degree (pins it; default: every divisor of --gpus)")
_GB = typer.Option(None, "--global-batch", help="samples per iteration (default 2 x GPUs x microbatch size; needed "
                   "with several profiles)")
_TL = typer.Option(60.0, "--time-limit", help="seconds to search")
_SEED = typer.Option(0, "--seed", help="seed of the search's tie-breaking")
_CHUNKS = typer.Option(None, "--chunks-max", help="most stages per rank, in the search's layouts and among the baselines "
                       "\\[default: 3 in the search's layouts; interleaved 1F1B with every chunk count the layers allow, "
                       "up to 32, among the baselines]")
_NOCP = typer.Option(False, "--no-cpsat", help="skip the CP-SAT partition + placement seeds")
_NORC = typer.Option(False, "--no-recompute", help="never recompute activations (by default, stages may recompute "
                                                 "where memory is short, and a baseline that fits in no configuration "
                                                 "is also priced recomputing each stage's first N layers, the fewest "
                                                 "that fit)")
_MAXP = typer.Option(None, "--max-plans", help="stop after simulating this many plans instead of at --time-limit: "
                                             "the same plan on any machine at any load (with one worker)")
_RUNS_ON = typer.Option("any", "--runs-on", help="the plans to tune: any (octorun and torch run every plan), "
                       "megatron (those Megatron-LM runs: its loop placement and 1F1B or interleaved 1F1B order, only "
                       "the partition tuned), loop or v (torchtitan's two stage placements, the order tuned)")
_KINDS = typer.Option(None, "--kind-letter", help="KIND=LETTER: the Megatron-LM layout letter (E, t, m, L) of a "
                      "layer kind it has none for, as export's (repeatable); which plans Megatron-LM runs, for "
                      "--runs-on megatron and the table")
_WORKERS = typer.Option(1, "--workers", help="processes that hill-climb at once, one per core to spare: the climbs "
                                            "from several seeds run side by side (the result then depends on timing)")


_PROFILES = typer.Argument(None, metavar="PROFILE...", help="profile (default: newest in profiles/); several: one "
                           "model at several --microbatch-size, the fastest for --global-batch wins")


def _read_profiles(paths: Optional[list[Path]]) -> list:
    """Each PROFILE read once, before anything is written; the newest in profiles/ without any."""
    if not paths:
        return [read_profile(None)]
    return [read_profile(path) for path in paths]


def _where_the_time_goes(stats: dict, efficiency: float) -> str:
    """Efficiency as balance x schedule, and the busiest rank's idle time by cause."""
    rank, idle = stats["busiest_rank"], stats["busiest_idle_ms"]
    again = stats.get("busiest_recompute_ms", 0.0)
    recomputed = f", {again:.2f} of them forwards its recomputing stages run again" if again else ""
    return (f"efficiency {efficiency:.3f} = balance {stats['balance']:.3f} (the busiest rank, {rank}, works "
            f"{stats['busiest_busy_ms']:.2f} ms{recomputed}; the lower bound is {stats['lower_bound_ms']:.2f}) x schedule "
            f"{stats['schedule']:.3f} (rank {rank} idles "
            f"{idle['warm_up']:.2f} ms before its first op, {idle['between']:.2f} between its ops, {idle['drain']:.2f} "
            f"after its last)")


def _balance_cap_line(profile, pp: int, balance: float) -> str:
    """How evenly the profile's layers could be spread over ``pp`` ranks at best
    (:func:`octoplan.tuner.caps.balance_cap`), against the tuned plan's balance: whether a
    better layout could still gain, or only finer layers could."""
    from octoplan.tuner.caps import balance_cap

    cap = balance_cap(profile, pp, time_limit_s=1.0)
    if cap.found != cap.found:  # nan: CP-SAT found no assignment in its time
        return f"the layers' balance cap on {pp} ranks: not found in 1 s of CP-SAT"
    bound = f"{cap.proven:.3f} (proven)" if cap.is_proven else f"{cap.proven:.3f} (a layout found reaches {cap.found:.3f})"
    if balance < cap.found - 5e-4:
        where = f"the tuned plan balances {balance:.3f}"
    elif cap.found < 1 - 5e-4:
        where = ("the tuned plan is at it, so only finer layers (a finer decomposition in the model file, or "
                 "--split-blocks for an --arch profile) could balance better")
    else:
        where = "the tuned plan is at it"
    return f"no layout of these layers balances {pp} ranks better than {bound}; {where}"


def register(app: typer.Typer) -> None:
    """Add ``tune`` and ``compare`` to the planner's command line."""

    @app.command()
    @guarded
    def tune(
        profile_paths: Optional[list[Path]] = _PROFILES,
        gpus: int = typer.Option(..., "--gpus", help="number of GPUs"),
        output: Path = typer.Option(..., "-o", "--output", help="plan file to write"),
        microbatches: Optional[int] = _MB, pp: Optional[int] = _PP, global_batch: Optional[int] = _GB,
        time_limit: float = _TL, seed: int = _SEED, chunks_max: Optional[int] = _CHUNKS, no_cpsat: bool = _NOCP,
        gpus_per_node: int = _GPN, memory_gb: Optional[float] = _MEM, intra_node_gbps: float = _INTRA,
        inter_node_gbps: float = _INTER, latency_us: float = _LAT, op_overhead_us: float = _OVH,
        max_plans: Optional[int] = _MAXP, workers: int = _WORKERS, no_recompute: bool = _NORC,
        runs_on: str = _RUNS_ON, kind_letters: Optional[list[str]] = _KINDS,
    ) -> None:
        """Co-optimize partition, placement and schedule; write the fastest plan that fits."""
        from octoplan.plan import save_plan

        sources = _read_profiles(profile_paths)
        check_writable(output, "-o", inputs=tuple(path for path, _ in sources))
        batch = _run(sources, gpus, microbatches, pp, global_batch, time_limit, seed, chunks_max, no_cpsat,
                      ClusterOptions(gpus_per_node, memory_gb, intra_node_gbps, inter_node_gbps, latency_us, op_overhead_us),
                      max_plans, workers, no_recompute, runs_on, kind_letters)
        result = batch.result
        save_plan(result.plan, output)
        _report(batch, result.plan.cluster.memory_gb)
        plan = result.plan
        # soft_wrap: long lines wrap at the terminal's edge, never inside a path or a number
        recomputing = plan.num_recomputing
        some = plan.num_recomputing_part
        stages = f"{plan.num_stages} stage{'s' if plan.num_stages != 1 else ''}" + (f", {recomputing} recomputing their activations" if recomputing else "") + (
            f" ({some} only their first layers)" if some else "")
        size = f"microbatches of {batch.microbatch_size}, " if len(sources) > 1 else ""
        console.print(f"tuned plan for {gpus} GPUs ({size}{result.candidate.config.label()}, {stages}) -> "
                      f"{escape(str(output))}, runs on {', '.join(result.runs_on)}: predicted "
                      f"{plan.predicted['iteration_ms']:.2f} ms, bubble "
                      f"{plan.predicted['bubble_ratio']:.1%}, efficiency {result.scored.efficiency:.3f} "
                      f"({result.stats['evaluations']} plans simulated in {result.stats['wall_s']:.1f} s)", soft_wrap=True)
        # the unrounded efficiency: the plan file's 4 decimals rounded again may differ from the tables' 3
        console.print(_where_the_time_goes(result.stats, result.scored.efficiency), soft_wrap=True)
        if result.candidate.config.pp > 1:
            profile = next((p for _, p in sources if p.microbatch_size == batch.microbatch_size), sources[0][1])
            console.print(_balance_cap_line(profile, result.candidate.config.pp, result.stats["balance"]), soft_wrap=True)
        bound = result.stats["order_bound_ms"]
        console.print(f"a quick bound (each rank alone, any memory): no op order of these stages and placement beats "
                      f"{bound:.2f} ms, so reordering could save at most "
                      f"{max(0.0, 1 - _ratio(bound, plan.predicted['iteration_ms'])):.1%}; `octoplan bound {escape(str(output))}` "
                      f"proves a tighter bound with CP-SAT, searches for such an order, and says what no layout "
                      f"of this placement can beat, whatever its cut points", soft_wrap=True)

    @app.command()
    @guarded
    def compare(
        profile_paths: Optional[list[Path]] = _PROFILES,
        gpus: int = typer.Option(..., "--gpus", help="number of GPUs"),
        microbatches: Optional[int] = _MB, pp: Optional[int] = _PP, global_batch: Optional[int] = _GB,
        time_limit: float = _TL, seed: int = _SEED, chunks_max: Optional[int] = _CHUNKS, no_cpsat: bool = _NOCP,
        gpus_per_node: int = _GPN, memory_gb: Optional[float] = _MEM, intra_node_gbps: float = _INTRA,
        inter_node_gbps: float = _INTER, latency_us: float = _LAT, op_overhead_us: float = _OVH,
        max_plans: Optional[int] = _MAXP, workers: int = _WORKERS, no_recompute: bool = _NORC,
        runs_on: str = _RUNS_ON, kind_letters: Optional[list[str]] = _KINDS,
    ) -> None:
        """Tune, and print the tuned plan against every baseline without writing a plan."""
        batch = _run(_read_profiles(profile_paths), gpus, microbatches, pp, global_batch, time_limit, seed, chunks_max, no_cpsat,
                      ClusterOptions(gpus_per_node, memory_gb, intra_node_gbps, inter_node_gbps, latency_us, op_overhead_us),
                      max_plans, workers, no_recompute, runs_on, kind_letters)
        _report(batch, batch.result.plan.cluster.memory_gb)
