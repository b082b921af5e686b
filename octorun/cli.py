"""The ``octorun`` command (docs/FORMATS.md section 5): parse, call :func:`octorun.runtime.run`, summarize.

``torchrun --nproc-per-node N -m octorun PLAN [--steps K] [--seed S] [--optimizer sgd|adamw]
[--lr LR] [--metrics FILE.jsonl] [--trace FILE.json] [--timeout S] [--replay [SCALE]]
[--dynamic-shapes] [--backend auto|gloo|nccl] [--activation-memory]``, and the training flags:
precision, the optimizer step and its schedule, token data and held-out data, checkpoints
(``octorun --help``). Without torchrun it runs
as one process. Exit status: 0 success, 2 bad input (one line on stderr), 1 any other failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn, Sequence

from octoplan import __version__

__all__ = ["main", "build_parser"]


class _StoreOnce(argparse._StoreAction):
    """argparse's plain store, except that an option given twice with two different values is
    a usage error: argparse would keep the last without a word (``--lr 0.1 ... --lr 0.01``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.dest in parser.given:
            first = parser.given[self.dest]
            if first != values and not (first != first and values != values):  # (nan, once or twice, is one value)
                parser.error(f"{'/'.join(self.option_strings)} given twice ({first!r}, then {values!r}): give it once")
        parser.given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)  # every option that stores a value
        self.register("action", "store", _StoreOnce)
        self.given: dict[str, object] = {}  # an option's dest -> the value it was first given

    def parse_known_args(self, args=None, namespace=None):
        self.given = {}
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:  # one line, exit 2, as every bad input
        from octoplan.errors import InputError  # its line cuts an echoed value that runs for pages

        sys.stderr.write(f"octorun: {InputError(None, None, message, 'see octorun --help').line()}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="octorun", description="Train a plan's model with pipeline and data parallelism (launch with torchrun).")
    parser.add_argument("plan", help="plan file (octoplan tune / baseline)")
    parser.add_argument("--version", action="version", version=f"octorun (octopipe) {__version__}")
    parser.add_argument("--steps", type=int, default=1, help="training steps (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed, 0 to 913458 (default 0; docs/FORMATS.md section 4)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="sgd is plain: no momentum, no weight decay (default sgd)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--metrics", metavar="FILE.jsonl", help="global rank 0 writes one JSON object per step")
    parser.add_argument("--trace", metavar="FILE.json", help="Chrome trace of the last step's ops on every rank")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="deadline of every wait once the first step has ended, seconds (default 300)")
    parser.add_argument("--init-timeout", type=float, metavar="S",
                        help="deadline of every wait until the first step ends: the process group forms, stages "
                             "build, a checkpoint loads (default: --timeout, at least 300)")
    parser.add_argument("--replay", nargs="?", type=float, const=1.0, metavar="SCALE",
                        help="run the plan's profile through the replay model: every op sleeps its profiled time x SCALE "
                             "(default 1), so CPU processes emulate the plan's GPUs")
    parser.add_argument("--dynamic-shapes", action="store_true",
                        help="send each message's shapes every step (default: only in step 0; later steps must match it)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="auto: nccl with CUDA, else gloo")
    parser.add_argument("--activation-memory", action="store_true",
                        help="count the activation bytes each rank's tapes hold (autograd's saved tensors, the tapes' "
                             "inputs, what I keeps for W) and report every rank's peak beside the plan's "
                             "prediction (in --metrics too); costs a little time per saved tensor")
    training = parser.add_argument_group("training")
    training.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                          help="bf16: each layer's forward under bf16 autocast, fp32 master weights, gradients and "
                               "optimizer state (profile with the same --precision so predictions hold)")
    training.add_argument("--weight-decay", type=float, default=0.0, metavar="WD",
                          help="AdamW's decoupled weight decay, on matrices and embeddings only (default 0)")
    training.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999), metavar=("B1", "B2"), help="AdamW's betas (default 0.9 0.999)")
    training.add_argument("--grad-clip", type=float, metavar="MAX_NORM",
                          help="clip the global gradient 2-norm over every stage of every rank to MAX_NORM")
    training.add_argument("--lr-schedule", choices=("constant", "linear", "cosine"), default="constant",
                          help="after --warmup-steps, linear and cosine fall from --lr to --min-lr at the last step")
    training.add_argument("--warmup-steps", type=int, default=0, metavar="N", help="linear warm-up steps (default 0)")
    training.add_argument("--min-lr", type=float, default=0.0, metavar="LR", help="the schedule's last learning rate (default 0)")
    training.add_argument("--decay-steps", type=int, metavar="N",
                          help="the steps the schedule spans (default --steps): a run stopped early, to resume "
                               "under another plan, keeps the whole training's curve")
    training.add_argument("--skip-nonfinite", action="store_true",
                          help="skip the update of a step whose loss or gradient norm is not finite (counted in the "
                               "metrics) instead of stopping the run")
    data = parser.add_argument_group("data")
    data.add_argument("--data", metavar="TOKENS.bin",
                      help="train on a flat binary token file (uint16/uint32, as nanoGPT and Megatron-LM write them; "
                           "octoplan tokenize makes one from text) instead of the model's sample_batch")
    data.add_argument("--data-dtype", choices=("uint16", "uint32"),
                      help="the token files' dtype (default: from a Megatron .idx beside each, else uint16)")
    data.add_argument("--eval-data", metavar="TOKENS.bin",
                      help="a held-out token file: after the last step (and every --eval-every steps) a forward-only "
                           "pass through the plan's pipeline measures the mean loss on it, in eval mode")
    data.add_argument("--eval-every", type=int, metavar="N", help="also evaluate after every N steps")
    data.add_argument("--eval-batches", type=int, metavar="K",
                      help="global batches of --eval-data per evaluation, the same samples every time "
                           "(default: every whole global batch the file holds)")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--save", metavar="DIR", help="write checkpoints into DIR (at the last step, and every --save-every steps)")
    ckpt.add_argument("--save-every", type=int, metavar="N", help="also save after every N steps")
    ckpt.add_argument("--keep", type=int, metavar="N", help="how many newest checkpoints to keep (default 2)")
    ckpt.add_argument("--resume", metavar="DIR|auto",
                      help="continue from a checkpoint (written under any plan of this model); auto: the newest in "
                           "--save DIR, or a fresh start when there is none. --steps still counts from step 0")
    ckpt.add_argument("--init-from", metavar="DIR",
                      help="start from the weights of a checkpoint (written under any plan of this model) with a "
                           "fresh optimizer, learning-rate schedule and data position: fine-tuning, or a new dataset. "
                           "A run that --resume finds a checkpoint for continues that one instead")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="octorun: %(message)s")
    try:
        _train(args)
    except KeyboardInterrupt:  # at any point, the imports included
        from octorun.native_stderr import restore_stderr

        restore_stderr()  # (an interrupt may have cut short the hold of c10d's messages)
        # a terminal's Ctrl-C reaches every process of its node: the node's first one speaks, so
        # that each node's terminal says why its job ended (torchrun's summary names no signal)
        if _speaks_for_its_node():
            kept = " (--metrics replaces its file only when a run ends well)" if args.metrics else ""
            sys.stderr.write(f"octorun: interrupted{kept}\n")
        # no interpreter shutdown: the transport's receiver threads wait inside gloo, and tearing
        # them down aborts the process (SIGABRT, "terminate called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


def _train(args: argparse.Namespace) -> None:
    from octoplan.errors import InputError
    from octorun.agreement import JobStopped
    from octorun.runtime import LAUNCH_VARIABLES, LaunchError, RunConfig, run

    config = RunConfig(
        plan_path=args.plan, steps=args.steps, seed=args.seed, optimizer=args.optimizer, lr=args.lr,
        metrics_path=args.metrics, trace_path=args.trace, timeout_s=args.timeout, backend=args.backend,
        replay_time_scale=args.replay, dynamic_shapes=args.dynamic_shapes, activation_memory=args.activation_memory,
        precision=args.precision, weight_decay=args.weight_decay, betas=tuple(args.betas), grad_clip=args.grad_clip,
        lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr, decay_steps=args.decay_steps,
        skip_nonfinite=args.skip_nonfinite, data_path=args.data, data_dtype=args.data_dtype,
        eval_data_path=args.eval_data, eval_every=args.eval_every, eval_batches=args.eval_batches,
        save_dir=args.save, save_every=args.save_every, keep=args.keep, resume=args.resume,
        init_from=args.init_from, init_timeout_s=args.init_timeout, print_steps=True,
    )
    try:
        result = run(config)
    except JobStopped as exc:  # this process's or a peer's bad input, told once per node
        if exc.line is not None:
            sys.stderr.write(f"octorun: {exc.line}\n")
        sys.exit(2)
    except InputError as exc:
        # bad input no peer heard of (a process alone, launch variables that name no job, peers
        # that never came): every process reads the same files and fails the same way, so one
        # per node speaks; but each has its own launch variables, and the bad one may not be
        # that process's
        if _speaks_for_its_node() or exc.field in LAUNCH_VARIABLES:
            sys.stderr.write(f"octorun: {exc.line()}\n")
        sys.exit(2)
    except OSError as exc:
        if exc.filename is None:  # not a path's: a failure of the run itself
            raise
        # a path the job reads or writes that the file system refuses (too long a name, no
        # permission): bad input, as octoplan treats it
        if _speaks_for_its_node():
            sys.stderr.write(f"octorun: {InputError(str(exc.filename), None, exc.strerror or str(exc), 'check the path').line()}\n")
        sys.exit(2)
    except LaunchError as exc:
        sys.stderr.write(f"octorun: rank {os.environ.get('RANK', '?')}: {exc}\n")
        sys.exit(1)
    if result.global_rank == 0:  # its step lines were printed as the steps ended
        if result.metrics and result.metrics[-1].peak_activation_bytes is not None:
            print(_activation_line(result.metrics[-1]))
            print(_with_messages_line(result.metrics))
    if result.stopped_early:  # receivers still wait for steps that will not come (octorun.runtime.RunResult)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(0)


def _speaks_for_its_node() -> bool:
    """Whether this process reports what all of its node's processes met (bad input, a Ctrl-C):
    the node's first (LOCAL_RANK 0), or the only one when no launcher set the variables."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


def _mib(values) -> str:
    return " ".join(f"{n / 2**20:.2f}" for n in values)


def _activation_line(m) -> str:
    """The last step's peak activation memory per pipeline rank, beside the plan's prediction."""
    line = f"peak activation MiB per pipeline rank (step {m.step}): {_mib(m.peak_activation_bytes)}"
    if m.predicted_peak_activation_bytes is not None:
        line += f"  (predicted {_mib(m.predicted_peak_activation_bytes)})"
    return line


def _with_messages_line(metrics) -> str:
    """Tapes and messages together, the most of any step per pipeline rank: step 0 posts its
    receive buffers only as the headers come, and the last step posts none for a next one,
    while the prediction is of a step between two others."""
    most = [max(values) for values in zip(*(m.peak_with_message_bytes for m in metrics))]
    line = f"peak activation + message MiB per pipeline rank (most of any step): {_mib(most)}"
    if metrics[-1].predicted_peak_with_message_bytes is not None:
        line += f"  (predicted {_mib(metrics[-1].predicted_peak_with_message_bytes)})"
    return line


if __name__ == "__main__":
    main()
