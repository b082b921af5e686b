"""The ``octoplan`` command line (docs/FORMATS.md section 5). Thin: parse, call one library function,
write the file, render with rich."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from octoplan.cliutil import (
    GPUS_PER_NODE, INTER_NODE_GBPS, INTRA_NODE_GBPS, LATENCY_US, MEMORY_GB, OP_OVERHEAD_US,
    ClusterOptions, cluster_from, dump_json, fail, guarded, log_setup, read_profile, terminal,
)
from octoplan.errors import InputError
from octoplan.outputs import check_distinct, check_writable
from octoplan.plan import Plan, load_plan, load_plan_profile, plan_microbatch_size, resolve_profile_path, save_plan
from octoplan.profile import MAX_MICROBATCH_SIZE, Profile, save_profile
from octoplan.tuner.cli import register as register_tuner_commands
from octoplan.tuner.search import MAX_WORKERS

app = typer.Typer(add_completion=False, no_args_is_help=True, help="OctoPipe planner: profile, tune, simulate and show pipeline plans.")
console = terminal()

_GPN, _MEM, _INTRA, _INTER, _LAT, _OVH = GPUS_PER_NODE, MEMORY_GB, INTRA_NODE_GBPS, INTER_NODE_GBPS, LATENCY_US, OP_OVERHEAD_US


def _load_plan_with_profile(path: Path) -> tuple[Plan, Profile]:
    plan = load_plan(path)
    return plan, load_plan_profile(plan, path)


def _gb(num_bytes: float) -> str:
    """Bytes as GB: three significant digits (0.024, 58.6), whole GB from 1,000 on (1858)."""
    gb = num_bytes / 1e9
    return f"{gb:.0f}" if gb >= 999.5 else f"{gb:.3g}"  # .3g of 999.5 and up writes 1e+03


def _plan_files(plan: Plan, path: Path) -> tuple[Path, Path | None]:
    """The files a command on ``plan`` reads, which none of its outputs may overwrite: the
    plan and the profile it names."""
    return path, resolve_profile_path(plan, path)


def _print_version(given: bool) -> None:
    if given:
        from octoplan import __version__

        print(f"octoplan (octopipe) {__version__}")
        raise typer.Exit()


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="log what the library does"),
          version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    log_setup(verbose)


@app.command()
@guarded
def profile(
    model: Optional[Path] = typer.Argument(None, help="model file (docs/FORMATS.md section 4), or hf:FOLDER: a Hugging Face "
                                           "transformers model from its config.json (and safetensors files, if any)"),
    arch: Optional[str] = typer.Option(None, "--arch", help="write an analytic profile of a known architecture"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU of the analytic profile \\[default: h100]"),
    list_known: bool = typer.Option(False, "--list", help="name the known architectures and GPUs"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="sequence length (analytic)"),
    microbatch_size: Optional[int] = typer.Option(None, "--microbatch-size", help="samples per microbatch "
                                                  "\\[default: 4 for a model file, 1 for --arch]"),
    tp: Optional[int] = typer.Option(None, "--tp", help="tensor-parallel degree (analytic) \\[default: 1]"),
    split_blocks: bool = typer.Option(False, "--split-blocks",
                                      help="one layer per block's mixer and per its MLP/MoE (analytic): finer stage boundaries"),
    repeat: Optional[int] = typer.Option(None, "--repeat", help="timed repeats per layer, round-robin; each time is the least of them \\[default: 10]"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda if present)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads to time the layers with; octorun then trains "
                                          "with as many per process (a CPU profile) \\[default: 1]"),
    clock: Optional[str] = typer.Option(None, "--clock",
                                        help="auto, wall or cpu (thread CPU time; wall for models that sleep) \\[default: auto]"),
    config: List[str] = typer.Option([], "--config", help="model config override key=value (repeatable)"),
    check_whole: bool = typer.Option(False, "--check-whole",
                                     help="accepted for older scripts: every profile of a model file times the whole model's "
                                          "forward+backward in the same run and compares the sum of the layers"),
    precision: Optional[str] = typer.Option(None, "--precision",
                                            help="fp32, or bf16: every forward under bf16 autocast over fp32 parameters, "
                                                 "as octorun --precision bf16 trains \\[default: fp32]"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="profile file to write"),
) -> None:
    """Measure every layer of a model file, or write an analytic profile of a known architecture."""
    # an option of the other kind of profile, or any with --list, would be ignored without a word: refuse it
    given = {"--gpu": gpu, "--tp": tp, "--seq-len": seq_len, "--split-blocks": split_blocks or None,
             "--repeat": repeat, "--device": device, "--threads": threads, "--clock": clock, "--config": config or None,
             "--check-whole": check_whole or None, "--precision": precision}
    if list_known:
        from octoplan.arch import list_architectures, list_gpus

        others = [flag for flag, value in (("MODEL", model), ("--arch", arch), *given.items(),
                                           ("--microbatch-size", microbatch_size), ("-o", output)) if value is not None]
        if others:
            raise InputError(None, "--list", f"given with {', '.join(others)}", "run --list alone, then profile")

        table = Table(title="architectures")
        table.add_column("name")
        table.add_column("description")
        for name, text in list_architectures():
            table.add_row(name, text)
        console.print(table)
        gpus = Table(title="GPUs")
        gpus.add_column("name")
        gpus.add_column("description")
        for name, text in list_gpus():
            gpus.add_row(name, text)
        console.print(gpus)
        return
    if arch is not None and model is not None:
        raise InputError(None, "--arch", f"given with the model file {model}", "profile either a model file or --arch NAME")
    if arch is not None:
        for flag in ("--repeat", "--device", "--threads", "--clock", "--config", "--check-whole", "--precision"):
            if given[flag] is not None:
                raise InputError(None, flag, "applies to measuring a model file, not to --arch",
                                 f"drop {flag}, or profile a model file")
    elif model is not None:
        for flag in ("--gpu", "--tp", "--seq-len", "--split-blocks"):
            if given[flag] is not None:
                raise InputError(None, flag, "applies to analytic profiles (--arch), not to a model file",
                                 f"drop {flag} (a model file is measured on this machine; see --config for its settings)")
    # every reader of the profile holds it to this range: refused before anything is measured or written
    if microbatch_size is not None and not 1 <= microbatch_size <= MAX_MICROBATCH_SIZE:
        raise InputError(None, "--microbatch-size", f"is {microbatch_size}",
                         f"use 1 to {MAX_MICROBATCH_SIZE} samples per microbatch")
    if output is not None:
        from octoplan.hf import model_source_files

        check_writable(output, "-o", inputs=model_source_files(model) if model is not None else ())
    if arch is not None:
        from octoplan.arch import analytic_profile

        gpu, tp = gpu or "h100", 1 if tp is None else tp
        result = analytic_profile(arch, gpu, seq_len=seq_len, microbatch_size=microbatch_size, tp=tp, split_blocks=split_blocks)
        out = output or Path("profiles") / f"{arch}-{gpu}{f'-tp{tp}' if tp > 1 else ''}{'-split' if split_blocks else ''}.yaml"
        if output is None:
            _check_default_path(out)
    elif model is not None:
        from rich.progress import Progress

        from octoplan.profiler import parse_config_overrides, profile_model_file

        from octoplan.precision import DEFAULT_PRECISION, check_precision

        repeat, clock = 10 if repeat is None else repeat, clock or "auto"
        precision = check_precision(precision or DEFAULT_PRECISION)
        if not 1 <= repeat <= MAX_REPEAT:
            raise InputError(None, "--repeat", f"is {repeat}", f"use 1 to {MAX_REPEAT} timed runs per layer")
        if threads is not None and not 1 <= threads <= MAX_THREADS:
            raise InputError(None, "--threads", f"is {threads}", f"use 1 to {MAX_THREADS} threads")
        overrides = parse_config_overrides(config)
        chosen: list[Path] = [output] if output is not None else []

        def check_default_path(loaded) -> None:
            """The default file, checked as -o is, once the model's name is known and before
            anything is measured."""
            if output is None:
                from octoplan.hf import model_source_files

                chosen.append(Path("profiles") / f"{loaded.name}.yaml")
                _check_default_path(chosen[0], inputs=model_source_files(model))

        with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
            task = progress.add_task(f"profiling {model.name}", total=None)

            def on_layer(index: int, total: int, name: str) -> None:
                progress.update(task, total=total, completed=index + 1, description=f"profiling {name}")

            result = profile_model_file(
                str(model), config=overrides, microbatch_size=microbatch_size or 4, repeat=repeat,
                device=device, threads=threads, on_layer=on_layer, clock=clock, precision=precision,
                on_loaded=check_default_path,
            )
        out = chosen[0]
    else:
        raise InputError(None, "MODEL", "nothing to profile", "give a model file, or --arch NAME (see --list)")
    save_profile(result, out)
    _print_profile(result, out)
    from octoplan.hf import is_hf_source

    if model is not None and is_hf_source(str(model)) and "seq" not in overrides:
        # the times, the memory and octorun's token windows all follow from seq: say which one
        console.print(f"profiled at seq {result.model.config.get('seq')} tokens per sample, hf:'s default; give "
                      "--config seq=N for the sequence length you train at", soft_wrap=True)
    if result.whole_model is not None:
        _print_whole_model(result)
        _warn_unsteady_layers(result)


# How far the layers' sum may be from the whole model before the profile command says so: the
# profiler's accuracy target
WHOLE_MODEL_TOLERANCE = 0.05


def _print_whole_model(result: Profile) -> None:
    """The layers' sum against the whole model timed in the same run; then the pass the layers'
    times come from, whole (what octorun does around each layer is in it, not in the plain whole
    model), and the layers timed alone (the cross-check)."""
    check = result.whole_model
    console.print(f"whole model, forward + loss + backward: {check.ms:.3f} ms; sum of the layers' F + B: "
                  f"{check.layers_sum_ms:.3f} ms (ratio {check.ratio:.3f})", soft_wrap=True)
    parts = []
    if check.in_sequence_ms is not None:
        parts.append(f"the layers' F then B as one pass, as octorun runs a stage: {check.in_sequence_ms:.3f} ms "
                     f"({check.in_sequence_ratio:.3f} x the whole model)")
    if check.isolated_sum_ms is not None:
        parts.append(f"timed alone, the layers sum to {check.isolated_sum_ms:.3f} ms (ratio {check.isolated_ratio:.3f})")
    if parts:
        console.print("; ".join(parts), soft_wrap=True)
    if not abs(check.ratio - 1) <= WHOLE_MODEL_TOLERANCE:
        console.print(f"[yellow]the layers' sum is off the whole model by more than {WHOLE_MODEL_TOLERANCE:.0%}: a busy "
                      "machine (see the layers' spread), or the runtime's per-layer work (many small layers) weighs in; "
                      "plans inherit that error[/]", soft_wrap=True)


def _check_default_path(path: Path, *, inputs=()) -> None:
    """``profile``'s default output, checked as -o is; the fix names -o, the user gave no path."""
    try:
        check_writable(path, "the default path", inputs=inputs)
    except InputError as exc:
        raise InputError(exc.file, exc.field, exc.problem, "give -o FILE, or move what is there") from None


MAX_REPEAT = 10_000  # timed runs per layer: beyond it a profile would take days, and a typo looks like it
MAX_THREADS = 1024  # --threads: more than any CPU has cores
UNSTEADY_NAMED = 6  # layers the unsteady-layers warning names: the line stays one readable line


def _warn_unsteady_layers(result: Profile) -> None:
    """One line on stderr naming the layers whose repeats disagreed by more than SPREAD_WARNING."""
    from octoplan.profiler import SPREAD_WARNING

    wide = sorted(((index, layer) for index, layer in enumerate(result.layers)
                   if layer.spread is not None and layer.spread > SPREAD_WARNING), key=lambda item: -item[1].spread)
    if not wide:
        return
    # the widest few, each by index too (a model's layers often share a name); the profile holds every spread
    named = (", ".join(f"#{index} {layer.name} {layer.spread:.1%}" for index, layer in wide[:UNSTEADY_NAMED])
             + (f", and {len(wide) - UNSTEADY_NAMED} more" if len(wide) > UNSTEADY_NAMED else ""))
    typer.echo(f"warning: {len(wide)} of {result.num_layers} layers' times spread over {SPREAD_WARNING:.0%} between repeats "
               f"({named}): the machine was busy or these layers' times vary; re-profile on an idle machine, or raise "
               "--repeat", err=True)


def _print_profile(result: Profile, out: Path) -> None:
    table = Table(title=f"{result.model.name} on {result.device.get('name', '?')} -> {out}")
    # "I -> W MB": what a split backward holds from its I to its W (saved tensors W reads, and
    # the gradients it starts from)
    spreads = any(layer.spread is not None for layer in result.layers)  # measured profiles: how steady each layer was
    columns = ("#", "layer", "kind", "F ms", "I ms", "W ms", "B ms", "params MB", "act MB", "I -> W MB", "out MB")
    for column in columns + (("spread",) if spreads else ()):
        # fold, not "…": in a narrow terminal a number breaks across lines but is never cut
        table.add_column(column, justify="right" if column not in ("layer", "kind") else "left", overflow="fold")
    rows = list(enumerate(result.layers))
    if len(rows) > 24:
        rows = rows[:10] + [(-1, None)] + rows[-10:]
    for i, layer in rows:
        if layer is None:
            table.add_row("…", "…", *[""] * (len(table.columns) - 2))
            continue
        spread = ("" if layer.spread is None else f"{layer.spread:.0%}",) if spreads else ()
        table.add_row(str(i), layer.name, layer.kind, f"{layer.forward_ms:.3f}", f"{layer.backward_input_ms:.3f}",
                      f"{layer.backward_weight_ms:.3f}", f"{layer.b_ms:.3f}", f"{layer.param_bytes / 1e6:.2f}",
                      f"{layer.activation_bytes / 1e6:.2f}", f"{(layer.held_for_w_bytes + layer.pending_w_bytes) / 1e6:.2f}",
                      f"{layer.output_bytes / 1e6:.2f}", *spread)
    console.print(table)
    total = sum(layer.total_ms for layer in result.layers)
    fused = result.fused_backward_ratio
    ratio = f"; fused backward B = {fused:.2f} x (I + W)" if fused is not None and fused != 1.0 else ""
    console.print(f"{result.num_layers} layers, F+I+W = {total:.3f} ms per microbatch of {result.microbatch_size}{ratio}")
    if result.precision != "fp32":
        console.print(f"measured at {result.precision}: forwards under autocast, parameters fp32")
    for group in result.tied:
        members = ", ".join(f"layer {layer} {name}" for layer, name in group.members)
        console.print(f"tied: {members} ({group.bytes / 1e6:.2f} MB, one tensor)", soft_wrap=True)


@app.command()
@guarded
def baseline(
    profile_path: Optional[Path] = typer.Argument(None, metavar="PROFILE", help="profile (default: newest in profiles/)"),
    gpus: int = typer.Option(..., "--gpus", help="number of GPUs"),
    schedule: str = typer.Option(..., "--schedule", help="gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zbv, dualpipev"),
    partition: str = typer.Option("uniform", "--partition", help="uniform or balanced"),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="stages per rank for interleaved-1f1b \\[default: 2]"),
    microbatches: Optional[int] = typer.Option(None, "--microbatches", help="microbatches per pipeline \\[default: 2 x pp]"),
    pp: Optional[int] = typer.Option(None, "--pp", help="pipeline degree (default: all GPUs)"),
    output: Path = typer.Option(..., "-o", "--output", help="plan file to write"),
    recompute: bool = typer.Option(False, "--recompute", help="every stage recomputes its activations (full "
                                                               "recomputation: F keeps only the stage input)"),
    gpus_per_node: int = _GPN, memory_gb: Optional[float] = _MEM, intra_node_gbps: float = _INTRA,
    inter_node_gbps: float = _INTER, latency_us: float = _LAT, op_overhead_us: float = _OVH,
) -> None:
    """Write a plan of a known schedule, for comparison (docs/FORMATS.md section 6)."""
    from octoplan.baseline import simulated_baseline, split_gpus

    path, prof = read_profile(profile_path)
    check_writable(output, "-o", inputs=(path,))
    cluster = cluster_from(gpus, ClusterOptions(gpus_per_node, memory_gb, intra_node_gbps, inter_node_gbps, latency_us,
                                                op_overhead_us), prof)
    pp_value, _ = split_gpus(gpus, pp)
    options = dict(schedule=schedule, gpus=gpus, pp=pp_value,
                   microbatches=2 * pp_value if microbatches is None else microbatches,
                   partition_method=partition, chunks=chunks, cluster=cluster, profile_path=path)
    plan, result = simulated_baseline(prof, recompute=recompute, **options)
    save_plan(plan, output)
    console.print(f"{schedule} plan for {gpus} GPUs (pp={plan.pp}, dp={plan.parallel.dp}, "
                  f"{plan.microbatches} microbatches, {plan.num_stages} stages{', recomputing' if recompute else ''}) -> "
                  f"{escape(str(output))}: "
                  f"predicted {plan.predicted['iteration_ms']:.2f} ms, bubble {plan.predicted['bubble_ratio']:.1%}",
                  soft_wrap=True)
    # a baseline is written even when it does not fit (it is for comparison), but never silently
    if not result.fits_memory:
        fullest = max(range(plan.pp), key=lambda r: result.peak_memory_bytes[r])
        hint = ""
        if not recompute:  # say so where recomputation is what would make it fit
            again, fits = simulated_baseline(prof, recompute=True, **options)
            if fits.fits_memory:
                hint = (f"; with --recompute it fits, at {again.predicted['iteration_ms']:.2f} ms and "
                        f"{max(fits.peak_memory_bytes) / 1e9:.1f} GB")
        typer.echo(f"warning: this plan does not fit: rank {fullest} peaks at "
                   f"{_gb(result.peak_memory_bytes[fullest])} GB, over the {cluster.memory_gb:g} GB per GPU "
                   f"(--memory-gb); octoplan tune finds plans that fit{hint}", err=True)


@app.command()
@guarded
def simulate(
    plan_path: Path = typer.Argument(..., metavar="PLAN"),
    json_out: bool = typer.Option(False, "--json", help="print FORMATS.md section 7's JSON object"),
) -> None:
    """Predict a plan's iteration (docs/FORMATS.md section 7)."""
    from octoplan.simulator import simulate as run_simulation
    from octoplan.validate import check_runnable

    plan, prof = _load_plan_with_profile(plan_path)
    check_runnable(plan, file=str(plan_path))
    result = run_simulation(plan, prof)
    summary = result.summary()
    if json_out:
        typer.echo(dump_json(summary))
        return
    table = Table(title=f"{plan_path}: pp={plan.pp} dp={plan.parallel.dp} microbatches={plan.microbatches} stages={plan.num_stages}")
    table.add_column("figure", overflow="fold")
    table.add_column("value", justify="right", overflow="fold")
    table.add_row("iteration", f"{result.iteration_ms:.3f} ms")
    table.add_row("lower bound", f"{result.lower_bound_ms:.3f} ms")
    table.add_row("efficiency", f"{result.efficiency:.3f}")
    table.add_row("bubble ratio", f"{result.bubble_ratio:.1%}")
    table.add_row("peak memory", f"{_gb(max(result.peak_memory_bytes))} GB (limit {_gb(result.memory_limit_bytes)})")
    table.add_row("fits memory", "yes" if result.fits_memory else "[red]NO[/red]")
    for ar in result.tied_allreduces:  # the profile's tied tensors held on several ranks
        table.add_row(f"tied group {ar.group} all-reduce", f"{ar.end_ms - ar.start_ms:.3f} ms (ranks "
                      f"{', '.join(map(str, ar.ranks))}, ends at {ar.end_ms:.3f})")
    console.print(table)
    by_rank = Table(title="per rank")
    for column in ("rank", "stages", "busy ms", "idle ms", "idle: warm-up / between / drain", "peak GB",
                   "largest bubble (waits for)"):
        by_rank.add_column(column, justify="right", overflow="fold")
    for r in range(plan.pp):
        gaps = [b for b in result.bubbles if b.rank == r and b.reason != "drain"]
        worst = max(gaps, key=lambda b: b.duration_ms, default=None)
        worst_text = f"{worst.duration_ms:.2f} ms ({worst.waits_for} from rank {worst.from_rank}, {worst.reason})" if worst else "-"
        parts = " / ".join(f"{ms:.2f}" for ms in result.idle_parts(r))
        by_rank.add_row(str(r), ",".join(map(str, plan.stages_of(r))), f"{result.busy_ms[r]:.2f}",
                        f"{result.iteration_ms - result.busy_ms[r]:.2f}", parts, f"{result.peak_memory_bytes[r] / 1e9:.2f}",
                        worst_text)
    console.print(by_rank)


@app.command()
@guarded
def validate(plan_path: Path = typer.Argument(..., metavar="PLAN")) -> None:
    """Check every rule of FORMATS.md section 3."""
    from octoplan.validate import check_runnable

    plan = load_plan(plan_path)
    # the profile it names (hash, layer count, model), or without one what octorun reads instead
    plan_microbatch_size(plan, plan_path)
    check_runnable(plan, file=str(plan_path))
    num_ops = sum(len(ops) for ops in plan.schedule)
    # without a profile nothing says how many layers the model has, so the last stage's end is unchecked
    unchecked = "" if plan.profile is not None else "; no profile field, so whether the stages cover every layer is not checked"
    recomputing = plan.num_recomputing
    console.print(f"{plan_path}: valid ({plan.num_stages} stages on {plan.pp} ranks"
                  f"{f', {recomputing} recomputing' if recomputing else ''}, {plan.microbatches} microbatches, "
                  f"{num_ops} ops{unchecked})")


@app.command()
@guarded
def show(
    plan_path: Path = typer.Argument(..., metavar="PLAN"),
    svg: Optional[Path] = typer.Option(None, "--svg", help="also write the timeline as an SVG picture"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="also write Chrome trace-event JSON (Perfetto)"),
    measured: Optional[Path] = typer.Option(None, "--measured", help="a measured trace from octorun: report the error per op type"),
    width: Optional[int] = typer.Option(None, "--width", help="columns for the timeline"),
) -> None:
    """Draw the per-rank timeline."""
    from octoplan.simulator import simulate as run_simulation
    from octoplan import timeline
    from octoplan.validate import check_runnable

    if width is not None and not 40 <= width <= 2000:
        raise InputError(None, "--width", f"is {width}", "use 40 to 2000 columns")
    plan, prof = _load_plan_with_profile(plan_path)
    check_distinct({"--svg": svg, "--trace": trace})
    for flag, path in (("--svg", svg), ("--trace", trace)):
        if path is not None:
            check_writable(path, flag, inputs=(*_plan_files(plan, plan_path), measured))
    check_runnable(plan, file=str(plan_path))
    result = run_simulation(plan, prof)
    # the measured trace is read and checked before anything is drawn or written: a trace that
    # is refused leaves no --svg or --trace behind
    rows = timeline.compare_measured(plan, result, measured) if measured else None
    out = terminal(width) if width else console
    out.print(timeline.render_terminal(plan, result, width=width))
    if svg:
        timeline.write_svg(plan, result, svg, title=str(plan_path))
        console.print(f"SVG -> {svg}")
    if trace:
        timeline.write_trace(plan, result, trace)
        console.print(f"trace -> {trace}")
    if rows is not None:
        out.print(timeline.render_comparison(rows, title=f"predicted vs measured ({measured})"))


# the fix for a plan whose stages take microbatches out of order, which justify and bound refuse
_IN_MICROBATCH_ORDER = "run each stage's F, I/B and W in microbatch order, as every octoplan order does"


def _keeps(before, after) -> bool:
    """Whether a reordered plan simulated as ``after`` replaces the one simulated as ``before``:
    faster, and within memory unless the original was not either."""
    return after.iteration_ms < before.iteration_ms and (after.fits_memory or not before.fits_memory)


def _save_with_prediction(plan: Plan, result, output: Path) -> None:
    """Write ``plan`` with its ``predicted`` figures set to the simulated ``result``."""
    from dataclasses import replace

    save_plan(replace(plan, predicted={**(plan.predicted or {}), **result.prediction()}), output)


@app.command()
@guarded
def justify(
    plan_path: Path = typer.Argument(..., metavar="PLAN"),
    output: Path = typer.Option(..., "-o", "--output", help="plan file to write"),
    unbounded: bool = typer.Option(False, "--unbounded-in-flight",
                                   help="let stages hold more microbatches in flight than PLAN does (more memory)"),
    reorder: bool = typer.Option(False, "--reorder",
                                 help="first build a new order by the shifting-bottleneck procedure, then justify "
                                      "that (slower: seconds on plans of thousands of ops and tens of ranks)"),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", metavar="S",
                                               help="with --reorder: after S seconds the procedure orders the ranks "
                                                    "left one pass each, without re-optimizing (a worse order, in "
                                                    "bounded time; default: no limit)"),
) -> None:
    """Repair PLAN's op order: every op as late, then as early as its inputs and its rank's gaps
    allow (same stages, same placement); writes the faster order that fits memory."""
    import time

    from octoplan.costs import LayerTable, stage_costs
    from octoplan.schedules.bottleneck import bottleneck_order
    from octoplan.schedules.justify import justify as justify_order
    from octoplan.schedules.opgraph import OutOfMicrobatchOrder
    from octoplan.simulator import simulate as run_simulation
    from octoplan.validate import check_runnable

    if time_limit is not None and not reorder:
        raise InputError(None, "--time-limit", "limits --reorder only", "add --reorder, or drop --time-limit")
    if time_limit is not None and not 0 < time_limit <= 1e9:  # (NaN fails both)
        raise InputError(None, "--time-limit", f"is {time_limit:g}", "give a number of seconds above 0")
    plan, prof = _load_plan_with_profile(plan_path)
    check_writable(output, "-o", inputs=_plan_files(plan, plan_path))
    check_runnable(plan, file=str(plan_path))
    before = run_simulation(plan, prof)
    costs = stage_costs(plan.stages, LayerTable(prof))
    ranks = [s.rank for s in plan.stages]
    start = plan.schedule
    try:
        if reorder:
            deadline = None if time_limit is None else time.perf_counter() + time_limit
            start, _ = bottleneck_order(plan.schedule, ranks, costs, cluster=plan.cluster, parallel=plan.parallel,
                                        keep_memory=not unbounded, deadline=deadline)
        order, _ = justify_order(start, ranks, costs, cluster=plan.cluster, parallel=plan.parallel,
                                 keep_memory=not unbounded)
    except OutOfMicrobatchOrder as exc:  # it runs, but justification keeps each stage's microbatches in order
        raise InputError(str(plan_path), "schedule", f"cannot be justified: {exc}", _IN_MICROBATCH_ORDER) from None
    candidate = plan.with_schedule(order)
    after = run_simulation(candidate, prof)
    better = _keeps(before, after)
    chosen, result = (candidate, after) if better else (plan, before)
    _save_with_prediction(chosen, result, output)
    table = Table(title=f"{plan_path} -> {output}")
    for column in ("order", "iteration ms", "bubble", "peak GB", "fits"):
        table.add_column(column, justify="right", overflow="fold")
    new_name = "reordered, justified" if reorder else "justified"
    for name, res in (("given", before), (new_name, after)):
        table.add_row(name, f"{res.iteration_ms:.3f}", f"{res.bubble_ratio:.1%}",
                      f"{max(res.peak_memory_bytes) / 1e9:.2f}", "yes" if res.fits_memory else "[red]NO[/red]")
    console.print(table)
    if better:
        saved = before.iteration_ms - after.iteration_ms  # a ratio of 1.000x would hide a small gain
        console.print(f"{new_name} order written: {before.iteration_ms / after.iteration_ms:.3f}x faster "
                      f"({saved:.3f} ms less, {saved / before.iteration_ms:.2%})")
    else:
        why = "does not fit memory" if not after.fits_memory else "is not faster"
        console.print(f"the {new_name} order {why}; the given order was written unchanged")


@app.command()
@guarded
def bound(
    plan_path: Path = typer.Argument(..., metavar="PLAN"),
    time_limit: float = typer.Option(30.0, "--time-limit",
                                     help="seconds CP-SAT may search, for the order (wall) and for the placement's cap "
                                          "(deterministic)"),
    unbounded: bool = typer.Option(False, "--unbounded-in-flight",
                                   help="bound every order, whatever its memory (default: orders that hold no more "
                                        "microbatches in flight per stage than PLAN)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output",
                                          help="write the best order found if the simulator finds it faster and it fits memory (or PLAN does not fit either), else PLAN unchanged"),
    workers: int = typer.Option(1, "--workers", help="CP-SAT search workers (more search faster; results may then vary)"),
    json_out: bool = typer.Option(False, "--json", help="print the figures as one JSON object"),
) -> None:
    """How far PLAN's op order is from the best order of its stages and placement: CP-SAT's best
    order and a proven lower bound on the iteration of every order (link contention aside)."""
    from octoplan.costs import LayerTable, stage_costs
    from octoplan.schedules.exact import order_bound
    from octoplan.simulator import simulate as run_simulation
    from octoplan.validate import check_runnable

    if not 0 < time_limit < math.inf:
        raise InputError(None, "--time-limit", f"is {time_limit:g}", "give CP-SAT a positive, finite number of seconds")
    if not 1 <= workers <= MAX_WORKERS:
        raise InputError(None, "--workers", f"is {workers}", f"use 1 to {MAX_WORKERS}")
    plan, prof = _load_plan_with_profile(plan_path)
    if output is not None:
        check_writable(output, "-o", inputs=_plan_files(plan, plan_path))
    check_runnable(plan, file=str(plan_path))
    before = run_simulation(plan, prof)
    costs = stage_costs(plan.stages, LayerTable(prof))
    try:
        result = order_bound(plan.schedule, [s.rank for s in plan.stages], costs, cluster=plan.cluster,
                             parallel=plan.parallel, time_limit_s=time_limit, keep_memory=not unbounded, workers=workers)
    except ValueError as exc:  # an order that runs but takes some stage's microbatches out of order
        raise InputError(str(plan_path), "schedule", f"cannot be bounded: {exc}", _IN_MICROBATCH_ORDER) from None
    candidate = plan.with_schedule(result.order)
    after = run_simulation(candidate, prof) if result.best_ms < result.given_ms else before
    if output is not None:
        better = _keeps(before, after)
        _save_with_prediction(candidate if better else plan, after if better else before, output)
    cap = _placement_cap(plan, prof, time_limit)
    if json_out:
        typer.echo(dump_json({
            "iteration_ms": before.iteration_ms, "best_found_iteration_ms": after.iteration_ms,
            "best_found_fits_memory": after.fits_memory, "model_ms": result.given_ms,
            "best_found_model_ms": result.best_ms, "lower_bound_ms": result.lower_bound_ms,
            "relaxation_ms": result.relaxation_ms, "gap": result.gap, "status": result.status,
            "in_flight": "any" if unbounded else "plan's", "wall_s": result.wall_s,
            "relaxation_by_rank": [{"rank": b.rank, "bound_ms": b.bound_ms, "first_start_ms": b.first_start_ms,
                                    "busy_ms": b.busy_ms} for b in result.by_rank],
            "placement_cap_ms": None if cap is None else cap.proven_ms,
            "placement_cap_found_ms": None if cap is None else cap.found_ms,
        }))
        return
    table = Table(title=f"op orders of {plan_path}'s stages and placement")
    for column in ("order", "iteration ms (simulated)", "makespan ms (model)", "peak GB", "fits"):
        table.add_column(column, justify="right", overflow="fold")
    table.add_row("PLAN's", f"{before.iteration_ms:.3f}", f"{result.given_ms:.3f}",
                  f"{max(before.peak_memory_bytes) / 1e9:.2f}", "yes" if before.fits_memory else "[red]NO[/red]")
    table.add_row("best found", f"{after.iteration_ms:.3f}", f"{result.best_ms:.3f}",
                  f"{max(after.peak_memory_bytes) / 1e9:.2f}", "yes" if after.fits_memory else "[red]NO[/red]")
    table.add_row("no order beats", "", f"{result.lower_bound_ms:.3f}", "", "")
    console.print(table)
    memory = "any order" if unbounded else "orders with PLAN's in-flight microbatches per stage"
    proof = "the one-machine relaxation" if result.by_relaxation else "CP-SAT"
    if result.status == "OPTIMAL" and result.best_ms >= result.given_ms:
        console.print(f"PLAN's order is optimal among {memory} (proven by {proof}, {result.wall_s:.1f} s)")
    else:
        console.print(f"a better order could save at most {result.gap:.2%} of PLAN's {result.given_ms:.3f} ms "
                      f"among {memory} (bound by {proof}; CP-SAT {result.status}, {result.wall_s:.1f} s)")
    if result.by_rank:
        console.print(_binding_ranks(result.by_rank), soft_wrap=True)
    if cap is not None:
        console.print(_placement_cap_line(plan, prof, before.iteration_ms, cap), soft_wrap=True)
    else:
        console.print(f"CP-SAT found no cut points for PLAN's placement within --time-limit ({time_limit:g} "
                      "deterministic s); a longer one lets it bound every layout with that placement")
    if result.status == "UNKNOWN":
        console.print(f"CP-SAT returned no order in {time_limit:g} s ({sum(map(len, plan.schedule))} ops); "
                      "a longer --time-limit may let it search, the bound above holds either way")
    if output is not None:
        console.print(f"{'the best order found' if better else 'PLAN (no faster order that fits)'} -> {output}")


def _placement_cap(plan, prof, time_limit: float):
    """The fill cap of every layout with PLAN's placement, whatever its cut points
    (:mod:`octoplan.tuner.fill_caps`), CP-SAT for ``time_limit`` of its deterministic seconds
    from PLAN's own cut points; None where it found none in that time."""
    from octoplan.tuner.fill_caps import fill_cap

    return fill_cap(prof, plan.cluster, microbatches=plan.parallel.microbatches, ranks=[s.rank for s in plan.stages],
                    time_limit_s=time_limit, hint=[s.start for s in plan.stages] + [plan.stages[-1].end])


def _placement_cap_line(plan, prof, iteration_ms: float, cap) -> str:
    """What no layout with PLAN's placement can beat: a faster plan may need another placement."""
    from octoplan.costs import lower_bound_ms
    from octoplan.tuner.fill_caps import shape_label, shape_of

    ranks = [s.rank for s in plan.stages]
    shape = shape_of(ranks, plan.parallel.pp)
    placed = (f"{len(ranks)} stages on {plan.parallel.pp} ranks as PLAN places them" if shape is None
              else f"{shape_label(*shape)}, as PLAN places its stages")
    bound = lower_bound_ms(prof, pp=plan.parallel.pp, microbatches=plan.parallel.microbatches,
                           op_overhead_ms=plan.cluster.op_overhead_us / 1000.0)
    proof = "proven" if cap.is_proven else f"CP-SAT's bound; the best cut points it found allow {cap.found_ms:.3f}"
    return (f"no layout of {placed} (any cut points) runs faster than {cap.proven_ms:.3f} ms once the pipeline's "
            f"fill is counted, an efficiency of at most {_efficiency(bound, cap.proven_ms)} ({proof}); PLAN's "
            f"{iteration_ms:.3f} ms is {_efficiency(bound, iteration_ms)}")


def _efficiency(bound_ms: float, ms: float) -> str:
    """``bound_ms / ms``; 1 for a plan whose ops take no time (a profile of zeros), where both are 0."""
    return f"{bound_ms / ms:.3f}" if ms > 0 else "1.000"


def _binding_ranks(by_rank) -> str:
    """The rank whose bound is the one-machine relaxation's, and what that bound is made of. No
    order changes it: a late first op asks for less work on that rank or an earlier first
    stage, a long forced wait for stages whose dataflow leaves the rank less to wait on. The
    next two ranks say how much moving that rank's work could buy, and the rank furthest under
    it is where that work could go."""
    worst = sorted(by_rank, key=lambda b: (-b.bound_ms, b.rank))
    top, room = worst[0], worst[-1]
    following = ", ".join(f"rank {b.rank} {b.bound_ms:.3f} ms" for b in worst[1:3])
    return (f"the one-machine relaxation's {top.bound_ms:.3f} ms is rank {top.rank}'s: its first op cannot start "
            f"before {top.first_start_ms:.3f} ms, it runs {top.busy_ms:.3f} ms of ops, and the dataflow forces "
            f"{top.forced_wait_ms:.3f} ms of waiting on it" + (f"; next: {following}" if following else "")
            + (f"; most room: rank {room.rank}, {top.bound_ms - room.bound_ms:.3f} ms under it" if len(worst) > 1 else ""))


@app.command()
@guarded
def calibrate(
    plan_path: Path = typer.Argument(..., metavar="PLAN"),
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="octorun --trace of PLAN, measured on the target machine"),
    flags: bool = typer.Option(False, "--flags", help="print only the cluster options to plan with (for scripts)"),
) -> None:
    """What a transfer and the runtime around each op cost in a measured run of PLAN: the
    --latency-us and --op-overhead-us to tune and predict with on that machine."""
    from octoplan.calibrate import calibrate as calibrate_trace
    from octoplan.validate import check_runnable

    plan, prof = _load_plan_with_profile(plan_path)
    check_runnable(plan, file=str(plan_path))
    cal = calibrate_trace(plan, prof, trace_path, plan_path=plan_path)
    if flags:
        typer.echo(cal.flags())
        return
    table = Table(title=f"calibration from {trace_path}")
    table.add_column("figure", overflow="fold")
    table.add_column("measured", justify="right", overflow="fold")
    table.add_column("plan has", justify="right", overflow="fold")
    table.add_column("from", overflow="fold")
    latency = "-" if cal.latency_ms is None else f"{1000 * cal.latency_ms:.0f} us"
    table.add_row("latency / transfer", latency, f"{plan.cluster.latency_us:.0f} us",
                  f"{cal.counts['transfers']} waits, {cal.counts['pairs']} pairs both ways")
    table.add_row("runtime gap / op", f"{1000 * cal.gap_ms:.0f} us", "", f"mean of {cal.counts['gaps']} gaps")
    table.add_row("op excess", f"{1000 * cal.excess_ms:.0f} us", "", f"median of {cal.counts['ops']} ops: measured - profiled")
    table.add_row("overhead / op", f"{1000 * cal.op_overhead_ms:.0f} us", f"{plan.cluster.op_overhead_us:.0f} us", "gap + excess")
    console.print(table)
    console.print(f"plan with: {cal.flags()}")


@app.command()
@guarded
def export(
    plan_path: Path = typer.Argument(..., metavar="PLAN"),
    format: str = typer.Option("torch-csv", "--format", help="torch-csv: torch.distributed.pipelining's compute-only CSV; "
                               "megatron: Megatron-LM's --pipeline-model-parallel-layout and arguments (a bash array); "
                               "torchtitan: its \\[parallelism] settings (TOML) and the schedule CSV beside them; "
                               "hf: the weights of an octorun --checkpoint of PLAN's hf: model, as a transformers "
                               "model folder; safetensors: those of PLAN's model file, as one file"),
    output: Path = typer.Option(..., "-o", "--output", help="file to write (hf: a new folder)"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="hf, safetensors: the octorun checkpoint to "
                                             "write (a step_* folder, or the --save folder holding them: its newest), "
                                             "of any plan of PLAN's model"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="hf, safetensors: float32, bfloat16 or float16 "
                                        "\\[default: hf: the dtype of the model folder's config.json, else float32]"),
    kind_letter: List[str] = typer.Option([], "--kind-letter", help="megatron: the layout letter of a profile layer "
                                          "kind, KIND=LETTER with LETTER one of E, t, m, L (repeatable)"),
    fqn_style: Optional[str] = typer.Option(None, "--fqn-style", help="torchtitan: module names, llama (tok_embeddings, "
                                            "layers.N, norm, output) or profile (the profile's layer names) \\[default: llama]"),
    time_limit: Optional[float] = typer.Option(None, "--time-limit", help="megatron: seconds to tune the best plan "
                                               "Megatron-LM can run, when PLAN is not one \\[default: 10]"),
    max_plans: Optional[int] = typer.Option(None, "--max-plans", help="megatron: that tune stops after this many "
                                            "simulated plans instead (the same result on any machine)"),
) -> None:
    """Write PLAN in another tool's format, or (--format hf, safetensors) a checkpoint of its model's weights."""
    from octoplan.export import export_plan
    from octoplan.export_cli import FRAMEWORK_FORMATS, FrameworkOptions, check_framework_options, run_framework_export

    check_framework_options(format, [flag for flag, value in (
        ("--kind-letter", kind_letter or None), ("--fqn-style", fqn_style), ("--time-limit", time_limit),
        ("--max-plans", max_plans), ("--checkpoint", checkpoint), ("--dtype", dtype)) if value is not None])
    if format in ("hf", "safetensors"):
        _export_weights(format, plan_path, checkpoint, output, dtype)
        return
    if format in FRAMEWORK_FORMATS:  # both read the layers' kinds from the plan's profile
        plan = load_plan(plan_path)
        profile = load_plan_profile(plan, plan_path)
        check_writable(output, "-o", inputs=_plan_files(plan, plan_path))
        if format == "torchtitan":
            from octoplan.export_torchtitan import csv_path_for

            check_writable(csv_path_for(output), "-o", inputs=_plan_files(plan, plan_path))
        options = FrameworkOptions(tuple(kind_letter), fqn_style or "llama",
                                   10.0 if time_limit is None else time_limit, max_plans)
        run_framework_export(console, plan, profile, plan_path=plan_path, profile_path=resolve_profile_path(plan, plan_path),
                             format=format, output=output, options=options)
        return

    plan = load_plan(plan_path)
    if plan.profile is not None:  # a plan whose profile changed or went missing is refused here as everywhere
        load_plan_profile(plan, plan_path)
    check_writable(output, "-o", inputs=_plan_files(plan, plan_path))
    export_plan(plan, output, format=format, file=str(plan_path))
    console.print(f"{format} -> {escape(str(output))}", soft_wrap=True)
    recomputing = [str(s) if stage.recompute_layers is None else f"{s} (its first {stage.recomputed_layers} layers)"
                   for s, stage in enumerate(plan.stages) if stage.recompute]
    if recomputing:  # the CSV holds the op order only; recomputation lives in the stage modules
        whole = len(recomputing) == plan.num_stages and not plan.num_recomputing_part
        which = f"all {len(recomputing)} stages" if whole else f"stages {', '.join(recomputing)}"
        typer.echo(f"note: {which} recompute their activations in this plan; the CSV carries "
                   f"only the op order, so wrap those stage modules in torch.utils.checkpoint, or the run will "
                   f"need more memory than the plan predicts", err=True)


def _export_weights(format: str, plan_path: Path, checkpoint: Optional[str], output: Path, dtype: Optional[str]) -> None:
    if checkpoint is None:
        raise InputError(None, "--checkpoint", f"is missing: --format {format} writes the weights of a checkpoint",
                         "give --checkpoint the folder octorun --save wrote (or one step_* folder in it)")
    plan = load_plan(plan_path)
    if plan.profile is not None:  # a plan whose profile changed or went missing is refused here as everywhere
        load_plan_profile(plan, plan_path)
    if format == "safetensors":
        from octorun.weights_export import export_safetensors

        check_writable(output, "-o", inputs=_plan_files(plan, plan_path))
        done = export_safetensors(plan, plan_path, checkpoint, output, dtype=dtype)
        written, copied = done.file, ""
    else:
        from octorun.hf_export import export_hf

        done = export_hf(plan, plan_path, checkpoint, output, dtype=dtype)
        written, copied = done.folder, f"; copied {', '.join(done.copied)}" if done.copied else ""
    console.print(f"{format}: {done.tensors} tensors ({done.bytes / 2**20:.1f} MiB, {done.dtype}) of "
                  f"{escape(str(done.checkpoint))} (after {done.step} steps) -> {escape(str(written))}{escape(copied)}",
                  soft_wrap=True)


@app.command()
@guarded
def tokenize(
    text: Path = typer.Argument(..., metavar="INPUT", help="UTF-8 text file"),
    output: Path = typer.Option(..., "-o", "--output", help="token file to write (for octorun --data)"),
    dtype: str = typer.Option("uint16", "--dtype", help="uint16 or uint32: the width of each token id in the file"),
    holdout: Optional[float] = typer.Option(None, "--holdout", metavar="FRACTION",
                                            help="write the text's last FRACTION (0.05: 5%) to --holdout-output instead"),
    holdout_output: Optional[Path] = typer.Option(None, "--holdout-output", metavar="FILE",
                                                  help="the held-out token file (for octorun --eval-data)"),
) -> None:
    """Turn a text file into a byte-level token file (each UTF-8 byte one token id 0..255) for octorun --data,
    and with --holdout a held-out one from its end for octorun --eval-data."""
    from octoplan.tokenfile import DTYPES, tokenize_text

    count = tokenize_text(text, output, dtype=dtype, holdout=holdout, holdout_output=holdout_output)
    console.print(f"{count} tokens ({dtype}, one per byte) -> {escape(str(output))}", soft_wrap=True)
    if holdout_output is not None:
        held = Path(holdout_output).stat().st_size // DTYPES[dtype].itemsize
        console.print(f"{held} tokens held out -> {escape(str(holdout_output))}", soft_wrap=True)


# tune and compare live beside the tuner they drive.
register_tuner_commands(app)


# the options that name a file to write; the command line's text of each is checked before
# typer makes it a Path, which drops a trailing slash (and would write a file named like the folder)
_OUTPUT_FLAGS = ("-o", "--output", "--svg", "--trace", "--holdout-output")


def _output_value(argv: list[str], index: int) -> tuple[str, str] | None:
    """(flag, value) where ``argv[index]`` is an output option, in each spelling click takes:
    ``--output VALUE``, ``--output=VALUE``, ``-o VALUE`` and ``-oVALUE`` (-o is the only short
    option of the commands, so it is never in a group like ``-xo``)."""
    token = argv[index]
    following = argv[index + 1] if index + 1 < len(argv) else ""
    if token.startswith("--"):
        flag, equals, value = token.partition("=")
        return (flag, value if equals else following) if flag in _OUTPUT_FLAGS else None
    flag = token[:2]
    if flag in _OUTPUT_FLAGS:
        return flag, token[2:] or following  # click reads "-o=x" as "=x": so does this
    return None


def _writes_a_folder(argv: list[str]) -> bool:
    """``export --format hf``, whose -o is a folder: ``DIR/`` (a shell's completion) names it too."""
    head = argv[:argv.index("--")] if "--" in argv else argv
    formats = [token.partition("=")[2] if token.startswith("--format=") else head[index + 1]
               for index, token in enumerate(head)
               if token.startswith("--format=") or (token == "--format" and index + 1 < len(head))]
    return "export" in head and formats[-1:] == ["hf"]


def _refuse_folder_outputs(argv: list[str]) -> None:
    if _writes_a_folder(argv):
        return
    for index, token in enumerate(argv):
        if token == "--":  # the rest are arguments, not options
            return
        found = _output_value(argv, index)
        if found is not None and found[1].endswith(("/", os.sep)):
            fail(InputError(found[1], None, f"{found[0]} names a folder (it ends in /)", "give a file path"))


def _repeated_option(argv: list[str]) -> str | None:
    """The first single-valued option given twice with two different values, in words; None if
    there is none. click keeps the last value without a word, so ``-o a.yaml ... -o b.yaml``
    would write only b.yaml. The command's own options say which take a value, so a value that
    looks like an option (``--lr -0.1``) is read as click reads it."""
    head = argv[:argv.index("--")] if "--" in argv else argv
    name = next((token for token in head if not token.startswith("-")), None)
    command = getattr(typer.main.get_command(app), "commands", {}).get(name)
    if command is None or "--help" in head:  # no command or an unknown one (click says so), or help asked for
        return None
    options = {flag: param for param in command.params if getattr(param, "param_type_name", "") == "option"
               for flag in (*param.opts, *param.secondary_opts)}
    given: dict[str, str] = {}  # the option's name -> its first value, as typed
    rest = head[head.index(name) + 1:]
    index = 0
    while index < len(rest):
        token = rest[index]
        index += 1
        flag, equals, value = token.partition("=") if token.startswith("--") else (token[:2], "", token[2:])
        param = options.get(flag) if token.startswith("-") else None
        if param is None:
            continue
        if param.is_flag or param.count:
            value = flag  # --x and --no-x are two values of one option
        elif not equals and not value:  # the value is the next token(s): "-o FILE", "--betas 0.9 0.95"
            value = " ".join(rest[index:index + param.nargs])
            index += param.nargs
        if param.multiple or param.count:
            continue
        first = given.setdefault(param.name, value)
        if first != value and _as_typed(first) != _as_typed(value):  # --memory-gb 80 and 80.0 agree
            return f"{'/'.join(param.opts)} given twice ({first!r}, then {value!r}): give it once"
    return None


def _as_typed(value: str) -> object:
    """``value`` as a number where it reads as one (80 and 80.0 are one --memory-gb), else as
    typed. (Typer's options carry their types in ways that change between its versions.)"""
    try:
        return float(value)
    except ValueError:
        return value


def main() -> None:
    """Run the command line; usage errors are bad input too: one line, exit 2 (docs/FORMATS.md section 5)."""
    _refuse_folder_outputs(sys.argv[1:])
    repeated = _repeated_option(sys.argv[1:])
    if repeated is not None:
        typer.echo(f"error: {repeated} (see octoplan --help)", err=True)
        raise SystemExit(2)
    # Typer before 0.2x raises click's exceptions; later ones raise those of the click it carries
    # (typer._click), which are TyperExceptions and not click's even where click is installed too.
    problems: list[type] = []
    with contextlib.suppress(ImportError):  # an older typer has no exception of its own: click's covers it
        from typer.exceptions import TyperException

        problems.append(TyperException)
    with contextlib.suppress(ImportError):  # a typer built without click raises no usage error of that kind
        from click import ClickException

        problems.append(ClickException)
    UsageProblem = tuple(problems)
    try:
        # without standalone mode, click turns Ctrl-C into a returned 130 instead of raising
        code = app(standalone_mode=False)
    except typer.Exit as exc:  # --help and friends
        raise SystemExit(exc.exit_code) from None
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    except UsageProblem as exc:
        message = exc.format_message() or "no command given"  # click shows the help then, with no message
        typer.echo(f"error: {message} (see octoplan --help)", err=True)
        raise SystemExit(2) from None
    if code == 130:
        typer.echo("interrupted (an output file is written whole or not at all)", err=True)
    if isinstance(code, int) and code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
