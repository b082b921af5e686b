"""Evaluation on held-out data (``octorun --eval-data``): when it runs and what it reads.

After the last step, and after every ``--eval-every`` N steps (step k where (k + 1) % N == 0,
counted from step 0 as ``--save-every`` counts), the run passes ``--eval-batches`` K global
batches of the held-out token file forward through the plan's own pipeline: every rank runs its
F ops in the plan's order (:func:`octorun.lowering.forward_only`), under ``torch.no_grad``, with
every layer in eval mode (no dropout), at the run's precision, on the weights the step's update
left. Nothing is kept for a backward and nothing changes: the training that follows is the one
that would have run without it (random draws in eval mode come from a forked generator).

Every evaluation reads the same samples: stream indices 0 to K x G - 1 of the file's window
order under seed 0 (:mod:`octorun.data`), G samples a global batch, whatever ``--seed``, so the
evaluations of one run, of its resumes and of runs under other plans are comparable. With the
default K (every whole global batch the file holds) that is every window of the file once,
but for fewer than G of them. The loss is the mean of the microbatches' losses, as a step's training loss is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from octoplan.errors import InputError
from octorun.data import TokenData

if TYPE_CHECKING:
    from octoplan.modelfile import ModelFile

__all__ = ["Evaluation", "EVAL_ORDER_SEED"]

EVAL_ORDER_SEED = 0  # the window order every evaluation reads, whatever the run's --seed
_CHECKED_WINDOWS = 4096  # windows read at a time as the file opens


@dataclass(frozen=True)
class Evaluation:
    data: TokenData
    every: int | None  # --eval-every; None: after the last step only
    batches: int  # global batches per evaluation
    global_batch: int  # samples a global batch

    @classmethod
    def open(cls, config: Any, model: "ModelFile", *, global_batch: int) -> "Evaluation":
        """``config``'s (an octorun RunConfig) held-out file, checked like ``--data``'s and for
        holding the global batches asked of it; :class:`InputError` where it does not."""
        data = TokenData.open(config.eval_data_path, model, seed=EVAL_ORDER_SEED, dtype=config.data_dtype)
        whole = data.num_windows // global_batch
        if whole < 1:
            raise InputError(data.path, "size", f"holds {data.num_windows} windows of {data.tokens_per_sample} tokens, "
                             f"fewer than one global batch of {global_batch} samples (--eval-data)",
                             "give a longer held-out token file")
        if config.eval_batches is not None and config.eval_batches > whole:
            raise InputError(None, "--eval-batches", f"is {config.eval_batches}, but {data.path} holds {whole} global "
                             f"batch{'es' if whole > 1 else ''} of {global_batch} samples ({data.num_windows} windows)",
                             f"give at most {whole}, or a longer --eval-data")
        evaluation = cls(data=data, every=config.eval_every, batches=config.eval_batches or whole, global_batch=global_batch)
        # every window an evaluation reads, now: an id beyond the vocab among them is one line
        # before the launch, not a failure after the training's first steps
        for first in range(0, evaluation.batches * global_batch, _CHECKED_WINDOWS):
            data.windows(first, min(_CHECKED_WINDOWS, evaluation.batches * global_batch - first))
        return evaluation

    def due(self, step: int, last_step: int) -> bool:
        """Whether an evaluation follows ``step`` of a run whose last step is ``last_step``."""
        return step == last_step or (self.every is not None and (step + 1) % self.every == 0)

    def rounds(self, steps: range) -> Iterator[bool]:
        """The rounds of messages a run of ``steps`` exchanges, in order (octorun.comm.Transport):
        False for a training step, True for each forward-only pass of an evaluation. A resume
        with no step left to train evaluates the checkpoint's weights once."""
        if not steps:
            yield from (True for _ in range(self.batches))
            return
        for step in steps:
            yield False
            if self.due(step, steps[-1]):
                yield from (True for _ in range(self.batches))

    def microbatch(self, *, batch: int, replica: int, mb: int, microbatches: int, microbatch_size: int) -> tuple[Any, Any]:
        """Microbatch ``mb`` of replica ``replica`` in global batch ``batch`` of every evaluation."""
        return self.data.microbatch(consumed=batch * self.global_batch, replica=replica, mb=mb,
                                    microbatches=microbatches, microbatch_size=microbatch_size)
