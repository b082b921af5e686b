"""What every command line shares: turning bad input into exit 2 with one line, and the
cluster options of FORMATS.md section 5."""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import typer
import yaml
from rich.console import Console

from octoplan.errors import InputError
from octoplan.plan import CLUSTER_RANGES, MAX_GPUS, Cluster, uneven_nodes
from octoplan.profile import Profile, load_profile

__all__ = ["terminal", "guarded", "fail", "ClusterOptions", "cluster_from", "memory_of", "read_profile", "log_setup",
           "GPUS_PER_NODE", "MEMORY_GB", "INTRA_NODE_GBPS", "INTER_NODE_GBPS", "LATENCY_US", "OP_OVERHEAD_US"]

# The cluster options of FORMATS.md section 5, shared by every command that takes them.
GPUS_PER_NODE = typer.Option(8, "--gpus-per-node", help="GPUs per node")
MEMORY_GB = typer.Option(None, "--memory-gb",
                         help="memory per GPU, GB \\[default: the profile's GPU memory; 80 for a CPU-measured profile]")
DEFAULT_MEMORY_GB = 80.0  # an 80 GB A100/H100, for profiles that name no GPU
INTRA_NODE_GBPS = typer.Option(450.0, "--intra-node-gbps", help="GB/s between GPUs of a node")
INTER_NODE_GBPS = typer.Option(50.0, "--inter-node-gbps", help="GB/s between nodes")
LATENCY_US = typer.Option(10.0, "--latency-us", help="latency per point-to-point transfer, us")
OP_OVERHEAD_US = typer.Option(0.0, "--op-overhead-us", help="fixed runtime cost added to every op, us (CPU stand-ins for GPUs)")


class _Terminal(Console):
    """rich's console, except where stdout closes (``octoplan show PLAN --svg F | head``): the
    command still writes its files and ends well, printing nothing more. rich's own handling
    exits 1 at once, silently, before the files."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def terminal(width: int | None = None) -> Console:
    """The console a command prints to: ``width`` columns if given, else the terminal's (or
    ``COLUMNS``), and 130 when the output goes to a file or a pipe, where rich's default 80
    would cut the tables' numbers short (and the tune table's plan names, beside its "runs on"
    column)."""
    if width is None and not (sys.stdout.isatty() or os.environ.get("COLUMNS")):
        width = 130
    return _Terminal(width=width)


def fail(error: InputError) -> None:
    typer.echo(f"error: {error.line()}", err=True)
    raise SystemExit(2)


def guarded(fn: Callable) -> Callable:
    """Run a command: InputError -> exit 2 and one line on stderr; anything else -> exit 1.
    Python warnings raised on the way (a model file's code making torch warn) are held and shown
    at the end, except after bad input, whose one line is then all that is said."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        held: list[warnings.WarningMessage] = []
        bad_input = False
        try:
            with warnings.catch_warnings(record=True) as held:
                return _run(fn, args, kwargs)
        except SystemExit as exc:
            bad_input = exc.code == 2
            raise
        finally:  # outside catch_warnings: shown as Python shows them
            if not bad_input:
                for w in held:
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)

    return wrapper


def _run(fn: Callable, args: Any, kwargs: Any) -> Any:
    """``fn``, its failures turned into exits: 2 with one line for bad input, 1 for ours."""
    try:
        return fn(*args, **kwargs)
    except InputError as exc:
        fail(exc)
    except (typer.Exit, typer.Abort, SystemExit, KeyboardInterrupt):
        raise
    except BrokenPipeError:
        raise SystemExit(0)
    except OSError as exc:  # a path the user gave that cannot be read or written
        if exc.filename:
            fail(InputError(str(exc.filename), None, exc.strerror or str(exc), "check the path"))
        # no file named: the command's own output (stdout redirected to a full disk)
        fail(InputError("stdout", None, f"cannot be written: {exc.strerror or exc}",
                        "check where the output goes and its free space"))
    except Exception as exc:  # a failure of ours, not bad input: keep the trace for debugging
        logging.getLogger("octoplan").debug("failure", exc_info=True)
        typer.echo(f"error: {type(exc).__name__}: {exc}", err=True)
        raise SystemExit(1)


def log_setup(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)


@dataclass(frozen=True)
class ClusterOptions:
    gpus_per_node: int = 8
    memory_gb: float | None = None  # None: the profile's GPU memory (see memory_of)
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    latency_us: float = 10.0
    op_overhead_us: float = 0.0


def memory_of(profile: Profile) -> float:
    """The GPU memory to plan for when --memory-gb is not given: the profile's device's, unless
    it was measured on a CPU (whose RAM says nothing about the GPUs the plan is for)."""
    device = profile.device or {}
    memory = device.get("memory_gb")
    if str(device.get("name", "cpu")).lower() == "cpu" or not isinstance(memory, (int, float)) or isinstance(memory, bool):
        return DEFAULT_MEMORY_GB
    return float(memory)


def cluster_from(gpus: int, opts: ClusterOptions, profile: Profile | None = None) -> Cluster:
    """The cluster the options describe, held to the same ranges as a plan file's; memory not
    given comes from ``profile`` (:func:`memory_of`)."""
    if opts.memory_gb is None:
        opts = replace(opts, memory_gb=memory_of(profile) if profile is not None else DEFAULT_MEMORY_GB)
    for name, value in (("--gpus", gpus), ("--gpus-per-node", opts.gpus_per_node)):
        if not 1 <= value <= MAX_GPUS:
            raise InputError(None, name, f"is {value}", f"use 1 to {MAX_GPUS}")
    if gpus > opts.gpus_per_node and gpus % opts.gpus_per_node:
        raise InputError(None, "--gpus", uneven_nodes(gpus, opts.gpus_per_node),
                         f"give a multiple of --gpus-per-node {opts.gpus_per_node}, or the --gpus-per-node the nodes have")
    for field_name, (least, most) in CLUSTER_RANGES.items():
        flag = "--" + field_name.replace("_", "-")
        value = getattr(opts, field_name)
        if not (math.isfinite(value) and least <= value <= most):
            raise InputError(None, flag, f"is {value:g}", f"use a value from {least:g} to {most:g}")
    return Cluster(gpus=gpus, gpus_per_node=opts.gpus_per_node, memory_gb=opts.memory_gb,
                   intra_node_gbps=opts.intra_node_gbps, inter_node_gbps=opts.inter_node_gbps,
                   latency_us=opts.latency_us, op_overhead_us=opts.op_overhead_us)


def read_profile(given: Optional[Path]) -> tuple[Path, Profile]:
    """PROFILE as given, else the newest file in profiles/ (FORMATS.md section 5), and the profile it holds."""
    if given is not None:
        return given, load_profile(given)
    folder = Path("profiles")
    candidates = sorted((p for p in folder.glob("*.yaml") if p.is_file()), key=lambda p: p.stat().st_mtime) \
        if folder.is_dir() else []
    if not candidates:
        raise InputError("profiles/", None, "no profile given and none in profiles/", "run octoplan profile first or name a PROFILE")
    newest = sorted((p for p in candidates if p.stat().st_mtime == candidates[-1].stat().st_mtime), key=lambda p: p.name)
    if len(newest) > 1:  # a fresh clone's bundled profiles: which one is "newest" would be chance
        raise InputError("profiles/", None, f"no profile given, and {len(newest)} are the newest alike "
                         f"({', '.join(p.name for p in newest[:3])}{', ...' if len(newest) > 3 else ''})",
                         "name a PROFILE")
    # read before saying so: a file that is no profile gets the one line of its error alone
    profile = load_profile(candidates[-1])
    typer.echo(f"using the newest profile, {candidates[-1]}", err=True)  # on stderr: stdout may be JSON
    return candidates[-1], profile


def dump_json(data: Any) -> str:
    import json

    return json.dumps(data, indent=2, sort_keys=False)


def yaml_text(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False)
