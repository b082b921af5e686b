"""``octoplan export --format megatron`` and ``--format torchtitan``: the command's rendering.

Thin, as the rest of the command line: read, call :mod:`octoplan.export_megatron` or
:mod:`octoplan.export_torchtitan` (and, for a plan Megatron-LM cannot run, the tuner confined to
the plans it can), write, print.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import typer
from rich.console import Console
from rich.markup import escape

from octoplan.errors import InputError
from octoplan.plan import Plan
from octoplan.profile import Profile

__all__ = ["FRAMEWORK_FORMATS", "FrameworkOptions", "run_framework_export", "megatron_fallback",
           "check_framework_options"]

FRAMEWORK_FORMATS = ("megatron", "torchtitan")


@dataclass(frozen=True)
class FrameworkOptions:
    kind_letters: tuple[str, ...] = ()  # --kind-letter KIND=LETTER
    fqn_style: str = "llama"  # --fqn-style
    time_limit_s: float = 10.0  # --time-limit: the Megatron-confined tune of a plan Megatron cannot run
    max_plans: int | None = None  # --max-plans: the same, bounded by work (deterministic)


def megatron_fallback(plan: Plan, profile: Profile, *, profile_path: str | Path | None, time_limit_s: float,
                      max_plans: int | None = None, letters: Mapping[str, str] | None = None):
    """The best plan Megatron-LM can run on ``plan``'s GPUs, pipeline degree, microbatches and rank order
    (its own, dp-inner, where it cannot number ranks as the plan does):
    the tuner confined to Megatron's placement and order (``--runs-on megatron``), reading the
    layers' kinds with ``letters`` (``--kind-letter``) as the export does."""
    from octoplan.export_megatron import MEGATRON_RANK_ORDER, expert_parallel, megatron_rank_order_problem
    from octoplan.tuner.search import TuneOptions, tune

    # the plan's rank order where Megatron-LM can number ranks so, else its own
    order = (plan.parallel.rank_order if megatron_rank_order_problem(plan.parallel, plan.cluster,
                                                                     expert_parallel(profile)) is None
             else MEGATRON_RANK_ORDER)
    opts = TuneOptions(gpus=plan.pp * plan.parallel.dp, pp=plan.pp, microbatches=plan.microbatches,
                       time_limit_s=time_limit_s, max_plans=max_plans, runs_on="megatron", baselines=False,
                       kind_letters=tuple(sorted((letters or {}).items())), rank_order=order)
    return tune(profile, plan.cluster, opts, profile_path=profile_path)


def run_framework_export(console: Console, plan: Plan, profile: Profile, *, plan_path: Path, profile_path: Path | None,
                         format: str, output: Path, options: FrameworkOptions) -> None:
    if format == "torchtitan":
        from octoplan.export_torchtitan import checkpoint_mode, export_torchtitan

        export, csv_path = export_torchtitan(plan, profile, output, style=options.fqn_style, file=str(plan_path))
        console.print(f"torchtitan settings ({export.placement} placement, {plan.num_stages} stages on {plan.pp} ranks) "
                      f"-> {escape(str(output))}; its schedule CSV -> {escape(str(csv_path))}", soft_wrap=True)
        if checkpoint_mode(plan) is None:  # stages that recompute unlike the others
            _recompute_note(plan, "torchtitan takes one [activation_checkpoint] mode for every model part, so recomputing "
                                  "only these needs its model code changed")
        return
    _megatron(console, plan, profile, plan_path=plan_path, profile_path=profile_path, output=output, options=options)


def _megatron(console: Console, plan: Plan, profile: Profile, *, plan_path: Path, profile_path: Path | None,
              output: Path, options: FrameworkOptions) -> None:
    from octoplan.export_megatron import (LayerLetters, expert_parallel, export_megatron, megatron_problem,
                                          parse_kind_letters, tensor_parallel)

    from octoplan.tuner.search import TuneOptions, check_options
    from octoplan.validate import check_runnable

    # before any work: a plan that cannot run (a deadlock) is bad input, not the failure of the
    # search for one Megatron-LM runs in its place (torchtitan's export checks it as it reads it)
    check_runnable(plan, file=str(plan_path))

    # the search's options are checked whether or not this plan needs the search: a bad value
    # must not pass only because the plan happened to fit Megatron-LM
    check_options(TuneOptions(gpus=plan.pp * plan.parallel.dp, time_limit_s=options.time_limit_s, max_plans=options.max_plans))
    letters = parse_kind_letters(options.kind_letters)
    problem = megatron_problem(plan, LayerLetters(profile, letters=letters, file=str(profile_path or plan_path)),
                               ep=expert_parallel(profile), tp=tensor_parallel(profile))
    chosen, title = plan, f"Megatron-LM arguments for {plan_path} (octoplan export --format megatron)"
    if problem is not None:
        from octoplan.simulator import simulate

        budget = f"{options.max_plans} plans" if options.max_plans else f"{options.time_limit_s:g} s"
        console.print(f"Megatron-LM cannot run {escape(str(plan_path))} as planned: {escape(problem)}. Tuning the best "
                      f"plan it can run on the same {plan.pp * plan.parallel.dp} GPUs (pp {plan.pp}, "
                      f"{plan.microbatches} microbatches; {budget}) ...", soft_wrap=True)
        result = megatron_fallback(plan, profile, profile_path=profile_path, time_limit_s=options.time_limit_s,
                                   max_plans=options.max_plans, letters=letters)
        chosen = result.plan
        planned_ms = simulate(plan, profile).iteration_ms
        megatron_ms = result.scored.iteration_ms
        slower = megatron_ms / planned_ms - 1 if planned_ms > 0 else 0.0
        console.print(f"the best plan Megatron-LM can run ({result.candidate.origin}): {megatron_ms:.2f} ms per "
                      f"iteration, {abs(slower):.1%} {'slower' if slower >= 0 else 'faster'} than the plan's "
                      f"{planned_ms:.2f} ms; `octoplan tune --runs-on megatron` writes it as a plan", soft_wrap=True)
        title = (f"Megatron-LM arguments: the best plan it can run in place of {plan_path} "
                 f"({megatron_ms:.2f} ms against {planned_ms:.2f} ms)")
    export = export_megatron(chosen, profile, output, letters=letters, file=str(plan_path), title=title)
    console.print(f"--pipeline-model-parallel-layout {escape(export.layout)}", soft_wrap=True)
    console.print(escape(shlex.join(export.arguments)), soft_wrap=True)
    for note in export.notes:
        console.print(f"note: {escape(note)}", soft_wrap=True)
    console.print(escape(f"megatron -> {output} (a bash array: source it, pass \"${{MEGATRON_PP_ARGS[@]}}\")"),
                  soft_wrap=True)


def _recompute_note(plan: Plan, what: str) -> None:
    recomputing = [str(s) for s, stage in enumerate(plan.stages) if stage.recompute]
    if recomputing:
        typer.echo(f"note: stages {', '.join(recomputing)} recompute their activations in this plan; the export "
                   f"carries the order and the stages only: {what}, or the run will need more memory than the plan "
                   "predicts", err=True)


def check_framework_options(format: str, given: Sequence[str]) -> None:
    """Refuse the options of one format given with another (they would be ignored without a word)."""
    own = {"megatron": ("--kind-letter", "--time-limit", "--max-plans"), "torchtitan": ("--fqn-style",),
           "hf": ("--checkpoint", "--dtype"), "safetensors": ("--checkpoint", "--dtype")}
    for flag in given:
        if flag not in own.get(format, ()):
            formats = " or ".join(name for name, flags in own.items() if flag in flags)
            raise InputError(None, flag, f"does not apply to --format {format}", f"drop {flag}; it applies to --format {formats}")
