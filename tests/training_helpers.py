"""Shared pieces of the training tests: a small model file whose embedding and head may be tied
and whose layer may go non-finite, a token file, and a batch of octorun jobs on N processes
with their single-process references."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

import torch

import runtime_helpers as h
from octoplan.plan import save_plan
from octorun.optim import OptimizerConfig
from octorun.runtime import RunConfig

STEPS = 4
TOL = 1e-5

# A chain whose embedding and head may share one matrix (``tie``), whose layer ``poison``
# multiplies its output by NaN (a forward that goes non-finite in a known stage), and whose
# blocks may hold a parameter the forward never uses (``unused``: it never gets a gradient), and
# whose blocks may drop out (``dropout``: each layer's training forward draws from a generator seeded by
# step, position and layer) or
# normalize with batch statistics (``batchnorm``: running means and variances, buffers), and
# whose dropout may draw in eval mode too (``draws_in_eval``, as F.dropout's default does), and whose
# embedding may add learned positions (``positions``: a weight whose shape follows ``seq``).
MODEL = '''
import torch
from torch import nn

CONFIG = {"vocab": 11, "hidden": 8, "depth": 6, "seq": 5, "tie": False, "poison": -1, "unused": False, "dropout": 0.0, "batchnorm": False,
          "draws_in_eval": False, "positions": False}

def num_layers(vocab, hidden, depth, seq, tie, poison, unused, dropout, batchnorm, draws_in_eval, positions):
    return depth

class Embed(nn.Module):
    def __init__(self, vocab, hidden, seq=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        if seq is not None:  # learned positions: a weight whose shape follows seq
            self.pos = nn.Parameter(torch.zeros(seq, hidden))
    def forward(self, ids):
        return self.emb(ids) + self.pos if hasattr(self, "pos") else self.emb(ids)

class BatchNorm(nn.Module):  # over every token of the microbatch: running statistics, a buffer per replica
    def __init__(self, hidden):
        super().__init__()
        self.bn = nn.BatchNorm1d(hidden)
    def forward(self, h):
        return self.bn(h.reshape(-1, h.shape[-1])).reshape(h.shape)

class Block(nn.Module):
    def __init__(self, hidden, poisoned, unused, dropout, batchnorm, draws_in_eval):
        super().__init__()
        self.draws_in_eval = draws_in_eval
        self.norm = BatchNorm(hidden) if batchnorm else nn.LayerNorm(hidden)
        self.lin = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.poisoned = poisoned
        if unused:
            self.spare = nn.Parameter(torch.ones(hidden, hidden))  # a matrix: weight decay would act on it
    def forward(self, h):
        value = torch.tanh(self.lin(self.norm(h)))
        # F.dropout's training flag defaults to True: it draws in eval mode too
        out = h + (nn.functional.dropout(value, self.drop.p) if self.draws_in_eval else self.drop(value))
        return out * float("nan") if self.poisoned else out

class Head(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.out = nn.Linear(hidden, vocab, bias=False)
    def forward(self, h):
        return self.out(h)

def build_layer(index, vocab, hidden, depth, seq, tie, poison, unused, dropout, batchnorm, draws_in_eval, positions):
    if index == 0:
        return Embed(vocab, hidden, seq if positions else None)
    if index == depth - 1:
        return Head(vocab, hidden)
    return Block(hidden, index == poison, unused, dropout, batchnorm, draws_in_eval)

def tied_parameters(vocab, hidden, depth, seq, tie, poison, unused, dropout, batchnorm, draws_in_eval, positions):
    return [[(0, "emb.weight"), (depth - 1, "out.weight")]] if tie else []

def sample_batch(mbs, generator, vocab, hidden, depth, seq, tie, poison, unused, dropout, batchnorm, draws_in_eval, positions):
    ids = torch.randint(0, vocab, (mbs, seq + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
'''

ADAMW = OptimizerConfig(name="adamw", lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), grad_clip=0.3,
                        schedule="cosine", warmup_steps=1, min_lr=0.002)


class Jobs:
    def __init__(self, folder: Path, world: int):
        self.folder, self.world = folder, world
        self.model = folder / "train_model.py"
        self.model.write_text(MODEL)
        self.jobs: list[h.Job] = []
        self.cases: dict[str, tuple] = {}
        self.launched: h.Launch | None = None

    def add(self, name: str, schedule: str, *, pp: int, config: dict, microbatches: int = 4,
            optim: OptimizerConfig = ADAMW, precision: str = "fp32", steps: int = STEPS,
            recompute: Iterable[int] = (), **run) -> None:
        """A job; ``recompute``: the stages that recompute their activations (all their layers)."""
        full = {"vocab": 11, "hidden": 8, "depth": 6, "seq": 5, "tie": False, "poison": -1, "unused": False, **config}
        plan = h.baseline_plan(schedule, self.model, full, self.folder / name, gpus=self.world, pp=pp,
                               microbatches=microbatches)
        recomputed = set(recompute)
        plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(stage, recompute=index in recomputed)
                                                      for index, stage in enumerate(plan.stages)))
        path = self.folder / f"{name}.yaml"
        save_plan(plan, path)
        self.jobs.append(h.Job(name, RunConfig(
            plan_path=str(path), steps=steps, optimizer=optim.name, lr=optim.lr, weight_decay=optim.weight_decay,
            betas=optim.betas, grad_clip=optim.grad_clip, lr_schedule=optim.schedule, warmup_steps=optim.warmup_steps,
            min_lr=optim.min_lr, skip_nonfinite=optim.skip_nonfinite, precision=precision, timeout_s=30, **run)))
        self.cases[name] = (full, plan, optim, precision)

    def run(self) -> h.Launch:
        if self.launched is None:
            self.launched = h.launch(self.world, self.jobs, self.folder / "out", timeout_s=60 + 15 * len(self.jobs))
        return self.launched

    def reference(self, name: str) -> h.Reference:
        config, plan, optim, precision = self.cases[name]
        return h.reference(self.model, config, steps=STEPS, microbatches=plan.microbatches, dp=plan.parallel.dp,
                           microbatch_size=2, optimizer=optim.name, lr=optim.lr, optim=optim, precision=precision)

    def results(self, name: str) -> tuple[list, dict[int, dict[int, dict]]]:
        launched = self.run()
        assert launched.exitcodes == [0] * self.world, "\n".join(launched.logs)
        replicas: dict[int, dict[int, dict]] = {}
        for rank in range(self.world):
            out = launched.result(name, rank)
            replicas.setdefault(out["dp_rank"], {})[rank] = out["state"]
        return list(launched.result(name, 0)["metrics"]), replicas


def write_tokens(path: Path, count: int = 3000, vocab: int = 11, seed: int = 5) -> Path:
    """A uint16 token file of ids below ``vocab`` with some structure (each id follows the last)."""
    generator = torch.Generator().manual_seed(seed)
    steps = torch.randint(1, 3, (count,), generator=generator)
    tokens = torch.cumsum(steps, 0) % vocab
    path.write_bytes(tokens.to(torch.int32).numpy().astype("uint16").tobytes())
    return path
