"""Export a plan into other tools' schedule formats.

``torch-csv`` is the compute-only CSV that torch.distributed.pipelining's
``_PipelineScheduleRuntime._load_csv(filename, format="compute_only")`` reads: row ``r`` holds
pipeline rank ``r``'s ops in execution order, one op per cell. Our op strings (``0F3``, ``1I2``,
``1W2``, ``2B5``; FORMATS.md section 1) are exactly the strings torch's ``_Action.from_str`` parses, so
a row is the plan's schedule of that rank, cell by cell. Torch lowers the rows itself: it infers
the stage → rank mapping from which row names each stage, checks the op counts, and adds the
sends and receives (``_add_send_recv``).

What the CSV does not carry, and the user of torch must set to match the plan:

- ``n_microbatches`` of the schedule = ``plan.microbatches``; every ``PipelineStage`` is built
  with ``num_stages = plan.num_stages`` from the plan's layers ``[start, end)`` of that stage, on
  the pipeline rank that the plan puts it on;
- the loss must be a mean over the microbatch (torch's default ``scale_grads=True`` then divides
  the accumulated gradients by the microbatch count, as FORMATS.md section 4's mean asks).

Data parallelism (``dp > 1``) lies outside the pipeline: the CSV is the schedule of one pipeline,
and each of the ``dp`` replicas runs the same CSV in its own pipeline process group (the plan's
``rank_order`` says which global ranks form a group). Torch averages gradients across replicas
only when the stage modules are wrapped in DDP or FSDP (it syncs on each stage's last backward);
with plain modules that all-reduce is the user's job.

Torch's runtime differs from octorun in one place that changes timing, not results: on stage 0
its ``I`` does nothing (the stage input carries no gradient) and its ``W`` runs the stage's whole
backward.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path

from octoplan.errors import InputError
from octoplan.outputs import write_text
from octoplan.plan import Plan, check_structure
from octoplan.validate import check_runnable

__all__ = ["EXPORT_FORMATS", "PROFILE_FORMATS", "WEIGHT_FORMATS", "export_plan", "export_torch_csv", "torch_csv_rows"]

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("torch-csv",)
# the formats that also need the plan's profile (its layers' kinds): Megatron-LM's layout and
# torchtitan's module names (octoplan.export_megatron, octoplan.export_torchtitan)
PROFILE_FORMATS = ("megatron", "torchtitan")
# the weights of a checkpoint of the plan's model, rather than the plan: octorun.hf_export and
# octorun.weights_export
WEIGHT_FORMATS = ("hf", "safetensors")


def torch_csv_rows(plan: Plan, *, file: str = "<plan>") -> list[list[str]]:
    """The CSV's rows: pipeline rank r's op strings in execution order.

    Raises :class:`InputError` for a plan torch cannot run: a broken structure, a rank with no
    ops (torch's lowering needs every rank's list non-empty), or orders that cannot run to the
    end (torch's lowering would stop with "Malformed compute schedule").
    """
    check_structure(plan, file=file)
    if len(plan.schedule) != plan.pp:
        raise InputError(file, "schedule", f"has {len(plan.schedule)} ranks but parallel.pp is {plan.pp}", "list one op string per pipeline rank")
    for rank, ops in enumerate(plan.schedule):
        if not ops:
            # check_structure already demands a stage on every rank, hence ops; say it in torch's
            # terms anyway, since torch fails on an empty row with a bare assertion.
            raise InputError(file, f"schedule.{rank}", "is empty; torch needs ops on every pipeline rank", "give the rank a stage and its ops")
    check_runnable(plan, file=file)
    return [[str(op) for op in ops] for ops in plan.schedule]


def export_torch_csv(plan: Plan, path: str | Path, *, file: str = "<plan>") -> None:
    """Write ``plan`` as the compute-only CSV of torch.distributed.pipelining (see module docstring).

    ``file`` names the plan in error messages. Raises :class:`InputError` as
    :func:`torch_csv_rows` does; nothing is written then.
    """
    rows = torch_csv_rows(plan, file=file)
    text = io.StringIO()
    csv.writer(text).writerows(rows)
    # newline="" as torch's reader opens it: the csv module writes its own line endings.
    write_text(path, text.getvalue(), newline="")
    logger.info("wrote %s: %d ranks, %d stages, %d microbatches", path, plan.pp, plan.num_stages, plan.microbatches)


def export_plan(plan: Plan, path: str | Path, *, format: str, file: str = "<plan>") -> None:
    """Write ``plan`` to ``path`` in ``format`` (one of :data:`EXPORT_FORMATS`)."""
    if format == "torch-csv":
        export_torch_csv(plan, path, file=file)
        return
    if format in PROFILE_FORMATS:  # these read the layers' kinds: octoplan.export_megatron, export_torchtitan
        raise InputError(None, "--format", f"{format} needs the plan's profile; this function writes torch-csv only",
                         f"run octoplan export --format {format}, which reads the profile")
    raise InputError(None, "--format", f"unknown export format {format!r}",
                     f"use one of {', '.join(EXPORT_FORMATS + PROFILE_FORMATS + WEIGHT_FORMATS)}")
