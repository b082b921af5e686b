"""``octoplan tune`` and ``octoplan compare``: thin commands over :func:`octoplan.tuner.tune`.

``register(app)`` adds both to the planner's typer app. Parse, call the tuner with a rich
progress line (best iteration time and bubble ratio so far), render the comparison table,
write the plan.
"""

from __future__ import annotations

import re
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


def comparison_rows(result) -> list[dict]:
    """The tuned plan against every baseline on the same GPUs, as plain rows."""
    tuned_ms = result.scored.iteration_ms
    c = result.candidate.config
    rows = [{
        "plan": "tuned", "config": c.label(), "short": _short(c), "iteration_ms": tuned_ms, "speedup": 1.0,
        "bubble_ratio": result.scored.bubble_ratio, "efficiency": result.scored.efficiency,
        "peak_memory_gb": result.scored.peak_memory_bytes / 1e9, "fits": result.scored.fits,
        "runs_on": list(result.runs_on),
    }]
    for row in result.baselines:
        s = row.scored
        rows.append({
            "plan": _label(row), "config": row.config.label(), "short": _short(row.config), "iteration_ms": s.iteration_ms,
            "speedup": _ratio(s.iteration_ms, tuned_ms), "bubble_ratio": s.bubble_ratio,
            "efficiency": s.efficiency, "peak_memory_gb": s.peak_memory_bytes / 1e9, "fits": s.fits,
            "runs_on": list(row.runs_on),
        })
    return rows


def _label(row) -> str:
    """A baseline's name; a +recompute one's stages recompute their first N layers, or all."""
    layers = max((k for _, k in row.candidate.recompute_layers), default=None)
    return row.name if layers is None else f"{row.name} (first {layers} layers)"


def _short(config) -> str:
    order = "" if config.dp == 1 else (" pi" if config.rank_order == "pp-inner" else " di")
    return f"{config.pp}.{config.dp}.{config.microbatches}{order}"


def shown_rows(rows: list[dict]) -> list[dict]:
    """The rows the table prints: interleaved 1F1B is priced with every chunk count the layers
    allow (up to 32 rows per partition), so of each partition's it shows the default 2 chunks
    and the fastest other count (one that fits, where any does)."""
    best: dict[str, dict] = {}
    for row in rows:
        match = re.fullmatch(r"interleaved-1f1b\(v=\d+\)/(\w+)(\+recompute)?( \(first \d+ layers\))?", row["plan"])
        if match:
            key = match.group(1) + (match.group(2) or "")
            if key not in best or (not best[key]["fits"], best[key]["iteration_ms"]) > (not row["fits"], row["iteration_ms"]):
                best[key] = row
    keep = {id(row) for row in best.values()}
    return [row for row in rows if not row["plan"].startswith("interleaved-1f1b(v=") or id(row) in keep]


def _table(result) -> Table:
    table = Table(title="tuned plan vs the baselines (docs/FORMATS.md section 6) on the same GPUs",
                  caption="pp.dp.mb: pipeline degree, data-parallel degree, microbatches per pipeline "
                          "(pi / di: pp-inner / dp-inner rank order); tuned x: how much faster the tuned plan is; "
                          "interleaved-1f1b(v=N): of the chunk counts above 2, the fastest; runs on: the "
                          "frameworks that run the plan as planned (torch: torch.distributed.pipelining)")
    rows = shown_rows(comparison_rows(result))
    for name, justify in (("plan", "left"), ("pp.dp.mb", "left"), ("iter ms", "right"), ("tuned x", "right"),
                          ("bubble", "right"), ("eff", "right"), ("peak GB", "right"), ("fits", "center")):
        table.add_column(name, justify=justify, overflow="fold")
    # narrow: the frameworks wrap before a plan's name does
    table.add_column("runs on", justify="left", overflow="fold", max_width=16)
    for row in rows:
        style = "bold green" if row["plan"] == "tuned" else (None if row["fits"] else "dim")
        table.add_row(
            row["plan"], row["short"], f"{row['iteration_ms']:.2f}", f"{row['speedup']:.3f}x",
            f"{row['bubble_ratio']:.1%}", f"{row['efficiency']:.3f}", f"{row['peak_memory_gb']:.1f}",
            "yes" if row["fits"] else "no", ", ".join(row["runs_on"]), style=style,
        )
    return table


def _verdict(result, memory_gb: float) -> str:
    """The line under the table: the comparison that counts, against baselines that fit."""
    best = result.best_baseline()
    if best is None:
        return f"no baseline fits {memory_gb:g} GB per GPU; the tuned plan does"
    ratio = _ratio(best.scored.iteration_ms, result.scored.iteration_ms)
    tie = ": the search found nothing faster than this baseline" if ratio < 1.0005 else ""
    return (f"fastest baseline that fits: {_label(best)} ({best.config.label()}), {best.scored.iteration_ms:.2f} ms; "
            f"the tuned plan is {ratio:.3f}x faster{tie}")


def _framework_costs(result) -> list[str]:
    """What staying on a framework that cannot run the tuned plan costs: the fastest row that
    fits and that it runs, against the tuned plan."""
    lines = []
    for framework, runs_on in (("Megatron-LM", "megatron"), ("torchtitan", "loop")):
        if framework in result.runs_on:
            continue
        rows = [row for row in result.baselines if row.scored.fits and framework in row.runs_on]
        best = min(rows, key=lambda row: row.scored.iteration_ms, default=None)
        if best is None:
            lines.append(f"{framework} runs none of the baselines that fit; `octoplan tune --runs-on {runs_on}` "
                         "looks for a plan it runs")
            continue
        ratio = _ratio(best.scored.iteration_ms, result.scored.iteration_ms)
        also = " (or v)" if framework == "torchtitan" else ""
        lines.append(f"staying on {framework}: its fastest baseline that fits here is {_label(best)} "
                     f"({best.config.label()}), {best.scored.iteration_ms:.2f} ms, {ratio:.3f}x the tuned plan's time; "
                     f"`octoplan tune --runs-on {runs_on}`{also} tunes the best plan it runs")
    return lines


def _run(source, gpus, microbatches, pp, global_batch, time_limit, seed, chunks_max, no_cpsat, cluster_opts,
         max_plans=None, workers=1, no_recompute=False, runs_on="any"):
    from rich.live import Live

    from octoplan.tuner.search import TuneOptions, tune

    path, profile = source  # read_profile's: read once, before anything is written
    cluster = cluster_from(gpus, cluster_opts, profile)
    opts = TuneOptions(gpus=gpus, pp=pp, microbatches=microbatches, global_batch=global_batch,
                       time_limit_s=time_limit, seed=seed, chunks_max=chunks_max, use_cpsat=not no_cpsat,
                       max_plans=max_plans, workers=workers, recompute=not no_recompute, runs_on=runs_on)
    with Live(console=console, transient=True, refresh_per_second=4) as live:
        live.update(f"tuning {path} on {gpus} GPUs ...")

        def progress(best, evaluations, elapsed):
            state = f"{best.iteration_ms:.2f} ms, bubble {best.bubble_ratio:.1%}" if best.fits else \
                f"nothing fits yet (leanest {best.peak_memory_bytes / 1e9:.1f} GB)"
            live.update(f"tuning: best {state} - {evaluations} plans simulated, {elapsed:.1f}/{time_limit:g} s")

        result = tune(profile, cluster, opts, profile_path=path, progress=progress)
    return result


_GPN, _MEM, _INTRA, _INTER, _LAT, _OVH = GPUS_PER_NODE, MEMORY_GB, INTRA_NODE_GBPS, INTER_NODE_GBPS, LATENCY_US, OP_OVERHEAD_US
_MB = typer.Option(None, "--microbatches", help="microbatches per pipeline (pins them)")
_PP = typer.Option(None, "--pp", help="pipeline degree (pins it; default: every divisor of --gpus)")
_GB = typer.Option(None, "--global-batch", help="samples per iteration (default 2 x GPUs x microbatch size)")
_TL = typer.Option(60.0, "--time-limit", help="seconds to search")
_SEED = typer.Option(0, "--seed", help="seed of the search's tie-breaking")
_CHUNKS = typer.Option(None, "--chunks-max", help="most stages per rank, in the search's layouts and among the baselines "
                       "[default: 3 in the search's layouts; interleaved 1F1B with every chunk count the layers allow, "
                       "up to 32, among the baselines]")
_NOCP = typer.Option(False, "--no-cpsat", help="skip the CP-SAT partition + placement seeds")
_NORC = typer.Option(False, "--no-recompute", help="never recompute activations (by default, stages may recompute "
                                                 "where memory is short, and baselines that do not fit are also "
                                                 "priced with full recomputation)")
_MAXP = typer.Option(None, "--max-plans", help="stop after simulating this many plans instead of at --time-limit: "
                                             "the same plan on any machine at any load (with one worker)")
_RUNS_ON = typer.Option("any", "--runs-on", help="the plans to tune: any (octorun and torch run every plan), "
                       "megatron (those Megatron-LM runs: its loop placement and 1F1B or interleaved 1F1B order, only "
                       "the partition tuned), loop or v (torchtitan's two stage placements, the order tuned)")
_WORKERS = typer.Option(1, "--workers", help="processes that hill-climb at once, one per core to spare: the climbs "
                                            "from several seeds run side by side (the result then depends on timing)")


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


def register(app: typer.Typer) -> None:
    """Add ``tune`` and ``compare`` to the planner's command line."""

    @app.command()
    @guarded
    def tune(
        profile_path: Optional[Path] = typer.Argument(None, metavar="PROFILE", help="profile (default: newest in profiles/)"),
        gpus: int = typer.Option(..., "--gpus", help="number of GPUs"),
        output: Path = typer.Option(..., "-o", "--output", help="plan file to write"),
        microbatches: Optional[int] = _MB, pp: Optional[int] = _PP, global_batch: Optional[int] = _GB,
        time_limit: float = _TL, seed: int = _SEED, chunks_max: Optional[int] = _CHUNKS, no_cpsat: bool = _NOCP,
        gpus_per_node: int = _GPN, memory_gb: Optional[float] = _MEM, intra_node_gbps: float = _INTRA,
        inter_node_gbps: float = _INTER, latency_us: float = _LAT, op_overhead_us: float = _OVH,
        max_plans: Optional[int] = _MAXP, workers: int = _WORKERS, no_recompute: bool = _NORC,
        runs_on: str = _RUNS_ON,
    ) -> None:
        """Co-optimize partition, placement and schedule; write the fastest plan that fits."""
        from octoplan.plan import save_plan

        source = read_profile(profile_path)
        check_writable(output, "-o", inputs=(source[0],))
        result = _run(source, gpus, microbatches, pp, global_batch, time_limit, seed, chunks_max, no_cpsat,
                      ClusterOptions(gpus_per_node, memory_gb, intra_node_gbps, inter_node_gbps, latency_us, op_overhead_us),
                      max_plans, workers, no_recompute, runs_on)
        save_plan(result.plan, output)
        console.print(_table(result))
        console.print(_verdict(result, result.plan.cluster.memory_gb), soft_wrap=True)
        for line in _framework_costs(result):
            console.print(line, soft_wrap=True)
        plan = result.plan
        # soft_wrap: long lines wrap at the terminal's edge, never inside a path or a number
        recomputing = plan.num_recomputing
        some = plan.num_recomputing_part
        stages = f"{plan.num_stages} stages" + (f", {recomputing} recomputing their activations" if recomputing else "") + (
            f" ({some} only their first layers)" if some else "")
        console.print(f"tuned plan for {gpus} GPUs ({result.candidate.config.label()}, {stages}) -> "
                      f"{escape(str(output))}, runs on {', '.join(result.runs_on)}: predicted "
                      f"{plan.predicted['iteration_ms']:.2f} ms, bubble "
                      f"{plan.predicted['bubble_ratio']:.1%}, efficiency {plan.predicted['efficiency']:.3f} "
                      f"({result.stats['evaluations']} plans simulated in {result.stats['wall_s']:.1f} s)", soft_wrap=True)
        console.print(_where_the_time_goes(result.stats, plan.predicted["efficiency"]), soft_wrap=True)
        bound = result.stats["order_bound_ms"]
        console.print(f"a quick bound (each rank alone, any memory): no op order of these stages and placement beats "
                      f"{bound:.2f} ms, so reordering could save at most "
                      f"{max(0.0, 1 - _ratio(bound, plan.predicted['iteration_ms'])):.1%}; `octoplan bound {escape(str(output))}` "
                      f"proves a tighter bound with CP-SAT and searches for such an order", soft_wrap=True)

    @app.command()
    @guarded
    def compare(
        profile_path: Optional[Path] = typer.Argument(None, metavar="PROFILE", help="profile (default: newest in profiles/)"),
        gpus: int = typer.Option(..., "--gpus", help="number of GPUs"),
        microbatches: Optional[int] = _MB, pp: Optional[int] = _PP, global_batch: Optional[int] = _GB,
        time_limit: float = _TL, seed: int = _SEED, chunks_max: Optional[int] = _CHUNKS, no_cpsat: bool = _NOCP,
        gpus_per_node: int = _GPN, memory_gb: Optional[float] = _MEM, intra_node_gbps: float = _INTRA,
        inter_node_gbps: float = _INTER, latency_us: float = _LAT, op_overhead_us: float = _OVH,
        max_plans: Optional[int] = _MAXP, workers: int = _WORKERS, no_recompute: bool = _NORC,
        runs_on: str = _RUNS_ON,
    ) -> None:
        """Tune, and print the tuned plan against every baseline without writing a plan."""
        result = _run(read_profile(profile_path), gpus, microbatches, pp, global_batch, time_limit, seed, chunks_max, no_cpsat,
                      ClusterOptions(gpus_per_node, memory_gb, intra_node_gbps, inter_node_gbps, latency_us, op_overhead_us),
                      max_plans, workers, no_recompute, runs_on)
        console.print(_table(result))
        console.print(_verdict(result, result.plan.cluster.memory_gb), soft_wrap=True)
        for line in _framework_costs(result):
            console.print(line, soft_wrap=True)
