"""Shared code of the runtime tests: a tiny model file, plan builders, the single-process
reference, and a launcher that runs octorun jobs on N gloo processes.

The launcher starts one process group per world size and runs a whole batch of jobs in it, so
that the cost of starting processes (importing torch, the gloo rendezvous) is paid once per
batch, not once per parametrized case.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import multiprocessing
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from octoplan.modelfile import as_args, load_model_file
from octoplan.ops import Kind, Op, parse_ops
from octoplan.plan import Cluster, Parallel, Plan, Stage
from octoplan.profile import ModelRef
from octorun.runtime import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "models"

# A chain with a tuple boundary: (float hidden, int64 ids) flows between layers, ids pass through
# without gradient. ``vary`` > 0 makes the sequence length change from microbatch to microbatch
# (up to ``vary`` more tokens), which octorun runs with --dynamic-shapes.
TINY_MODEL = '''
import torch
from torch import nn

CONFIG = {"vocab": 13, "hidden": 8, "depth": 6, "seq": 5, "vary": 0}

def num_layers(vocab, hidden, depth, seq, vary=0):
    return depth

class Embed(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
    def forward(self, ids):
        return self.emb(ids), ids

class Block(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.mix = nn.Embedding(vocab, hidden)
    def forward(self, h, ids):
        return h + torch.tanh(self.lin(h)) * torch.sigmoid(self.mix(ids)), ids

class Head(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.out = nn.Linear(hidden, vocab)
    def forward(self, h, ids):
        return self.out(h)

def build_layer(index, vocab, hidden, depth, seq, vary=0):
    if index == 0:
        return Embed(vocab, hidden)
    if index == depth - 1:
        return Head(vocab, hidden)
    return Block(vocab, hidden)

def sample_batch(mbs, generator, vocab, hidden, depth, seq, vary=0):
    if vary:  # a sequence length that changes from microbatch to microbatch
        seq += int(torch.randint(0, vary + 1, (1,), generator=generator))
    ids = torch.randint(0, vocab, (mbs, seq), generator=generator)
    targets = torch.randint(0, vocab, (mbs, seq), generator=generator)
    return ids, targets

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
'''

# Small configs of the example models, so each step takes milliseconds on a CPU.
EXAMPLE_CONFIGS: dict[str, dict[str, Any]] = {
    # 10 layers each: with the embedding and head joining the end stages, V and interleaved
    # schedules on 4 ranks get one layer per stage
    "tiny_gpt": {"vocab": 64, "hidden": 16, "layers": 8, "heads": 2, "seq": 8, "mlp_ratio": 2, "data_vocab": 32},
    "vlm": {"image_size": 8, "channels": 3, "patch": 4, "vision_hidden": 16, "vision_layers": 2, "hidden": 16,
            "decoder_layers": 5, "heads": 2, "vocab": 32, "text_len": 6, "num_classes": 4},
    "hybrid": {"vocab": 64, "hidden": 16, "seq": 8, "pattern": "mameamea", "heads": 2, "experts": 2, "top_k": 1,
               "expert_hidden": 16, "data_vocab": 32},
}


def write_tiny_model(folder: Path) -> Path:
    path = folder / "tiny_model.py"
    path.write_text(TINY_MODEL)
    return path


def saved_entries(root: Path) -> list[str]:
    """A --save root's entries, sorted, but for the lock file the run that saves into it holds
    (octorun.checkpoint.hold_root)."""
    from octorun.checkpoint import LOCK_FILE

    return sorted(entry.name for entry in Path(root).iterdir() if entry.name != LOCK_FILE)


def model_spec(name: str, folder: Path) -> tuple[Path, dict[str, Any]]:
    """(model file, config) of ``tiny`` (6 layers), ``tiny10`` (10 layers), ``tiny-vary`` (6 layers,
    shapes that change between microbatches and steps) or an example model."""
    if name == "tiny":
        return write_tiny_model(folder), {}
    if name == "tiny-vary":
        return write_tiny_model(folder), {"vary": 2}
    if name == "tiny10":
        return write_tiny_model(folder), {"depth": 10}
    return EXAMPLES / f"{name}.py", dict(EXAMPLE_CONFIGS[name])


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------


def make_plan(
    model_path: Path,
    config: dict[str, Any],
    *,
    stages: list[tuple[int, int, int]],
    schedule: list[str] | list[list[Op]],
    microbatches: int,
    dp: int = 1,
    microbatch_size: int = 2,
    rank_order: str = "pp-inner",
) -> Plan:
    pp = len(schedule)
    ops = tuple(tuple(parse_ops(s) if isinstance(s, str) else s) for s in schedule)
    return Plan(
        model=ModelRef(name=Path(model_path).stem, source=str(model_path), config=dict(config)),
        cluster=Cluster(gpus=pp * dp),
        parallel=Parallel(pp=pp, dp=dp, microbatches=microbatches, rank_order=rank_order),
        stages=tuple(Stage(a, b, r) for a, b, r in stages),
        schedule=ops,
        extra={"microbatch_size": microbatch_size},
    )


def even_stages(num_layers: int, ranks: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous stages, as even as possible, stage i on ``ranks[i]``."""
    count = len(ranks)
    bounds = [round(i * num_layers / count) for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1], ranks[i]) for i in range(count)]


def list_schedule(
    ranks: list[int], microbatches: int, *, split: Callable[[int, int], bool], rng: random.Random | None = None,
    priority: Callable[[Op], Any] | None = None,
) -> list[list[Op]]:
    """A runnable schedule for any placement: a global topological order, split per rank.

    ``split(stage, mb)`` chooses I+W over B. Among the runnable ops, ``rng`` picks at random
    (irregular orders) or ``priority`` picks the smallest.
    """
    num_stages, pp = len(ranks), max(ranks) + 1
    last = num_stages - 1
    todo: set[Op] = set()
    for s in range(num_stages):
        for m in range(microbatches):
            todo.add(Op(s, Kind.F, m))
            if split(s, m):
                todo |= {Op(s, Kind.I, m), Op(s, Kind.W, m)}
            else:
                todo.add(Op(s, Kind.B, m))
    done: set[Op] = set()

    def grad_done(s: int, m: int) -> bool:
        return Op(s, Kind.I, m) in done or Op(s, Kind.B, m) in done

    def ready(op: Op) -> bool:
        if op.kind is Kind.F:
            return op.stage == 0 or Op(op.stage - 1, Kind.F, op.mb) in done
        if op.kind is Kind.W:
            return Op(op.stage, Kind.I, op.mb) in done
        return Op(op.stage, Kind.F, op.mb) in done and (op.stage == last or grad_done(op.stage + 1, op.mb))

    schedule: list[list[Op]] = [[] for _ in range(pp)]
    while todo:
        runnable = sorted(op for op in todo if ready(op))
        op = rng.choice(runnable) if rng else min(runnable, key=priority)
        todo.remove(op)
        done.add(op)
        schedule[ranks[op.stage]].append(op)
    return schedule


def hand_plans(model_path: Path, config: dict[str, Any], num_layers: int) -> dict[str, tuple[Plan, int]]:
    """Hand-written irregular plans: name -> (plan, world size)."""
    plans: dict[str, tuple[Plan, int]] = {}
    # V placement on 2 ranks, 4 stages; rank 1 holds the two middle stages (adjacent: no send)
    v_ranks = [0, 1, 1, 0]
    plans["v-shape-iw"] = (make_plan(
        model_path, config, stages=even_stages(num_layers, v_ranks), microbatches=3,
        schedule=["0F0 0F1 3F0 3I0 0F2 3W0 3F1 3B1 3F2 0B0 3I2 0I1 3W2 0W1 0B2",
                  "1F0 2F0 1F1 2F1 2I0 2W0 1B0 2B1 1F2 2F2 1B1 2B2 1B2"],
    ), 2)
    # reversed placement: the model's first stages on the last rank, mixed B and I+W, depth-first
    ranks = [1, 1, 0]
    plans["reversed"] = (make_plan(
        model_path, config, stages=even_stages(num_layers, ranks), microbatches=3,
        schedule=list_schedule(ranks, 3, split=lambda s, m: (s + m) % 2 == 0, priority=lambda op: (op.mb, op.kind != Kind.F)),
    ), 2)
    # 3 ranks, reversed and interleaved: stage i on rank 2 - (i % 3), random order
    ranks = [2, 1, 0, 2, 1, 0]
    plans["reversed-3ranks"] = (make_plan(
        model_path, config, stages=even_stages(num_layers, ranks), microbatches=3,
        schedule=list_schedule(ranks, 3, split=lambda s, m: s % 2 == 0, rng=random.Random(11)),
    ), 3)
    # interleaved placement, mixed B and I+W, random (irregular) order, dp = 2 with pp-inner ranks
    ranks = [0, 1, 0, 1]
    plans["random-pp2-dp2"] = (make_plan(
        model_path, config, stages=even_stages(num_layers, ranks), microbatches=4, dp=2,
        schedule=list_schedule(ranks, 4, split=lambda s, m: (s * 3 + m) % 3 == 0, rng=random.Random(7)),
    ), 4)
    # dp-inner rank order, 2 ranks x dp 2, a 1F1B-like order with I/W split on one rank only
    plans["dp-inner"] = (make_plan(
        model_path, config, stages=even_stages(num_layers, [0, 1]), microbatches=2, dp=2, rank_order="dp-inner",
        schedule=["0F0 0F1 0B0 0B1", "1F0 1I0 1F1 1I1 1W0 1W1"],
    ), 4)
    # 4 ranks, random placement with several stages per rank and a fully random order
    ranks = [0, 2, 2, 3, 1, 3, 0] if num_layers >= 7 else [0, 2, 3, 1]
    plans["random-pp4"] = (make_plan(
        model_path, config, stages=even_stages(num_layers, ranks), microbatches=3,
        schedule=list_schedule(ranks, 3, split=lambda s, m: m != 1, rng=random.Random(3)),
    ), 4)
    return plans


def baseline_plan(
    schedule: str, model_path: Path, config: dict[str, Any], folder: Path, *, gpus: int, pp: int,
    microbatches: int, microbatch_size: int = 2, precision: str = "fp32", extra: dict[str, Any] | None = None,
) -> Plan:
    """A plan from octoplan.baseline.make_baseline, with a made-up profile of the model file
    (``extra``: more top-level fields of the profile, such as the profiler's settings)."""
    from octoplan.baseline import make_baseline
    from octoplan.profile import profile_from_dict, save_profile

    model = load_model_file(model_path, config)
    count = model.num_layers()
    kind = getattr(model.module, "layer_kind", None)
    layers = [
        {"name": f"l{i}", "kind": kind(i, **model.config) if kind else ("embedding" if i == 0 else "head" if i == count - 1 else "block"),
         "forward_ms": 1.0, "backward_input_ms": 1.0, "backward_weight_ms": 1.0, "param_bytes": 1000,
         "activation_bytes": 1000, "output_bytes": 100}
        for i in range(count)
    ]
    profile = profile_from_dict({
        "format": "octoplan-profile/1",
        "model": {"name": model.name, "source": str(model_path), "config": model.config},
        "device": {"name": "cpu", "memory_gb": 24}, "microbatch_size": microbatch_size, "dtype": "float32",
        "precision": precision, "layers": layers, **(extra or {}),
    })
    named = repr(sorted(model.config.items())) + ("" if precision == "fp32" else f" {precision}") + repr(extra or "")
    tag = hashlib.sha256(named.encode()).hexdigest()[:8]
    profile_path = folder / f"profile-{Path(model_path).stem}-{tag}.yaml"
    save_profile(profile, profile_path)
    return make_baseline(profile, schedule=schedule, gpus=gpus, pp=pp, microbatches=microbatches,
                         profile_path=profile_path)


# ---------------------------------------------------------------------------------------------
# The single-process reference
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    losses: list[float]
    state: dict[int, dict[str, torch.Tensor]]
    grad_norms: list[float] = field(default_factory=list)  # torch.nn.utils.clip_grad_norm_'s, before clipping
    lrs: list[float] = field(default_factory=list)


def reference(
    model_path: Path, config: dict[str, Any], *, steps: int, microbatches: int, dp: int, microbatch_size: int,
    optimizer: str, lr: float, seed: int = 0, dtype: str = "float32", optim: Any = None, precision: str = "fp32",
    initial: dict[int, dict[str, torch.Tensor]] | None = None,
) -> Reference:
    """Every layer in one process; per step the mean loss over all microbatches of all replicas.

    ``initial``: each layer's state_dict to start from, by layer index (else the model file's
    own initialization under ``seed``); a fresh optimizer either way.

    ``optim`` (an octorun.optim.OptimizerConfig) gives the whole optimizer step (weight decay,
    clipping with torch.nn.utils.clip_grad_norm_, the schedule); by default it is ``optimizer``
    at a constant ``lr``. Tied parameters (the model file's tied_parameters) are one Parameter.
    Memoized: every schedule of one model, microbatch count and optimizer shares one reference
    (one that starts from ``initial`` weights is not kept).
    """
    from octorun.optim import OptimizerConfig

    optim = optim or OptimizerConfig(name=optimizer, lr=lr)
    key = (str(model_path), repr(sorted(config.items())), steps, microbatches, dp, microbatch_size, optim, seed, dtype, precision)
    if initial is None and key in _REFERENCES:
        return _REFERENCES[key]
    previous, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(getattr(torch, dtype))
    torch.set_num_threads(1)  # tiny ops: threads only contend on a shared 2-core machine
    try:
        found = _reference(model_path, config, steps=steps, microbatches=microbatches, dp=dp,
                           microbatch_size=microbatch_size, optim=optim, seed=seed, precision=precision, initial=initial)
    finally:
        torch.set_default_dtype(previous)
        torch.set_num_threads(threads)
    if initial is None:
        _REFERENCES[key] = found
    return found


_REFERENCES: dict[tuple, Reference] = {}


def seed_draws(*, seed: int, step: int, position: int, layer: int) -> None:
    """What FORMATS.md section 4 says comes before a layer's training forward: torch's generator
    seeded by the run's seed, the step, the microbatch's position in the global batch and the
    layer's index (torch.manual_seed here, from the spec's own formula, not octorun's code path)."""
    digest = hashlib.blake2b(f"{seed} {step} {position} {layer}".encode(), digest_size=8).digest()
    torch.manual_seed(int.from_bytes(digest, "little") >> 1)


def reference_optimizer(params: list[torch.nn.Parameter], optim: Any) -> torch.optim.Optimizer:
    """The optimizer as docs/FORMATS.md describes it, built here from torch alone so that the
    references do not share octorun.optim's construction: SGD without momentum, or AdamW with
    the config's betas and eps whose weight decay skips 1-D parameters (biases, norm scales)."""
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr)
    matrices = {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay}
    vectors = {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}
    return torch.optim.AdamW([g for g in (matrices, vectors) if g["params"]], lr=optim.lr, betas=optim.betas, eps=optim.eps)


def _reference(
    model_path: Path, config: dict[str, Any], *, steps: int, microbatches: int, dp: int, microbatch_size: int,
    optim: Any, seed: int, precision: str = "fp32", initial: dict[int, dict[str, torch.Tensor]] | None = None,
) -> Reference:
    from octoplan.precision import autocast
    from octorun.optim import lr_at
    from octorun.tied import tie_local, tied_groups

    model = load_model_file(model_path, config, seed=seed)
    layers = [model.build_layer(i) for i in range(model.num_layers())]
    tie_local(model.path, dict(enumerate(layers)), tied_groups(model), model.build_layer)
    for index, state in (initial or {}).items():
        layers[index].load_state_dict(state)
    params = list({id(p): p for layer in layers for p in layer.parameters()}.values())  # a tied module once
    opt = reference_optimizer(params, optim)
    losses, norms, lrs = [], [], []
    for step in range(steps):
        step_losses = []
        for replica in range(dp):
            for mb in range(microbatches):
                value, targets = model.sample_batch(microbatch_size, step=step, replica=replica, mb=mb)
                for index, layer in enumerate(layers):
                    seed_draws(seed=seed, step=step, position=replica * microbatches + mb, layer=index)
                    with autocast("cpu", precision):
                        value = layer(*as_args(value))
                        if index == len(layers) - 1:
                            step_losses.append(model.loss(value, targets))
        loss = torch.stack(step_losses).mean()
        loss.backward()
        clip = optim.grad_clip if optim.grad_clip is not None else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        lrs.append(lr_at(optim, step, steps))
        for group in opt.param_groups:
            group["lr"] = lrs[-1]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return Reference(losses, {i: {k: v.detach().clone() for k, v in layer.state_dict().items()} for i, layer in enumerate(layers)},
                     norms, lrs)


# ---------------------------------------------------------------------------------------------
# Launching octorun jobs on N gloo processes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    name: str
    config: Any  # octorun.runtime.RunConfig
    fault: dict[str, Any] = field(default_factory=dict)  # see _apply_fault
    dtype: str = "float32"  # torch's default dtype while the job runs
    # per-rank RunConfig fields that differ from ``config`` (a test that needs one rank's
    # deadline to pass first gives the other ranks a longer --timeout)
    rank_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)

    def config_for(self, rank: int) -> Any:
        return dataclasses.replace(self.config, **self.rank_overrides.get(rank, {}))


@dataclass(frozen=True)
class Launch:
    exitcodes: list[int | None]  # None: still running at the deadline (then killed)
    logs: list[str]
    seconds: float
    folder: Path

    def result(self, job: str, rank: int) -> dict[str, Any]:
        return torch.load(self.folder / f"{job}.rank{rank}.pt", weights_only=False)


def _injected_failure() -> None:
    raise RuntimeError("injected failure")


# what an op fault does as its op begins: the process vanishes, the op raises, or it never ends
# with its process otherwise alive (a kernel that hangs)
_OP_FAULTS = {"die": lambda: os._exit(17), "raise": _injected_failure, "stuck-op": lambda: time.sleep(3600)}


def _apply_fault(fault: dict[str, Any], rank: int) -> None:
    """Test-only sabotage, patched into one process (never into octorun's code)."""
    from octorun import comm, runtime

    if fault.get("rank") != rank:
        return
    if fault["kind"] in _OP_FAULTS:  # the named op
        strike, original = _OP_FAULTS[fault["kind"]], runtime._Interpreter._run_op

        def sabotaged(self, op, state):
            if str(op) == fault["op"]:
                strike()
            return original(self, op, state)

        runtime._Interpreter._run_op = sabotaged
    elif fault["kind"] == "drop-send":  # the named op's message is never sent
        original_send = comm.Transport.send

        def dropping(self, message, tensors, *, dst, step, **named):
            if (message.kind, message.stage, message.mb) == tuple(fault["message"]):
                return
            return original_send(self, message, tensors, dst=dst, step=step, **named)

        comm.Transport.send = dropping
    elif fault["kind"] == "slow-save":  # each checkpoint's shard takes ``seconds`` longer (slow storage)
        original_state = runtime._Interpreter._checkpoint_state

        def slow(self):
            time.sleep(fault["seconds"])
            return original_state(self)

        runtime._Interpreter._checkpoint_state = slow


def _worker(rank: int, world: int, port: int, jobs: list[Job], folder: str) -> None:
    log = open(os.path.join(folder, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    # like torchrun: the launcher hosts the store, so it outlives any worker
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist

    from octorun.runtime import run

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for job in jobs:
        if job.fault:
            _apply_fault(job.fault, rank)
        torch.set_default_dtype(getattr(torch, job.dtype))
        began = time.monotonic()
        result = run(job.config_for(rank))
        print(f"job {job.name}: {time.monotonic() - began:.2f} s", flush=True)
        torch.save({"metrics": result.metrics, "state": result.state, "pp_rank": result.pp_rank, "dp_rank": result.dp_rank},
                   os.path.join(folder, f"{job.name}.rank{rank}.pt"))
    dist.barrier()
    log.flush()
    os._exit(0)  # skip interpreter teardown: the process group's threads need not be joined


def launch(world: int, jobs: list[Job], folder: Path, *, timeout_s: float = 120.0) -> Launch:
    """Run ``jobs`` one after another on ``world`` fresh gloo processes; kill them at the deadline.

    Like torchrun, this process hosts the rendezvous store, so the store outlives any worker.

    Forked by default: the children inherit this process's imported torch (and torch._dynamo,
    which the first optimizer imports: seconds per process on a small CPU). The parent never
    creates a process group, and the children use one intra-op thread, so nothing forked is in
    use. OCTORUN_TEST_START=spawn starts them fresh instead.
    """
    folder.mkdir(parents=True, exist_ok=True)
    method = os.environ.get("OCTORUN_TEST_START", "fork")
    if method == "fork":
        import torch._dynamo  # noqa: F401  (see above)
    ctx = multiprocessing.get_context(method)
    port = free_port()
    started = time.monotonic()
    procs = [ctx.Process(target=_worker, args=(r, world, port, jobs, str(folder)), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    # The store is created after forking, so no child inherits a copy of its server.
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    deadline = started + timeout_s
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.01))
    codes = []
    for proc in procs:
        if proc.is_alive():
            proc.kill()  # only the processes this function started
            proc.join(5)
            codes.append(None)
        else:
            codes.append(proc.exitcode)
    del store
    logs = [(folder / f"rank{r}.log").read_text() if (folder / f"rank{r}.log").exists() else "" for r in range(world)]
    return Launch(codes, logs, time.monotonic() - started, folder)


def max_abs_diff(a: dict[int, dict[str, torch.Tensor]], b: dict[int, dict[str, torch.Tensor]]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    worst = 0.0
    for layer in a:
        assert set(a[layer]) == set(b[layer])
        for key in a[layer]:
            x, y = a[layer][key], b[layer][key]
            if x.is_floating_point():
                if x.numel():  # a NaN on one side only is the largest difference, not none (max() drops NaN)
                    same = (x == y) | (x.isnan() & y.isnan())
                    diff = torch.where(same, 0.0, (x.double() - y.double()).abs())
                    worst = max(worst, torch.nan_to_num(diff, nan=math.inf).max().item())
            else:
                assert torch.equal(x, y)
    return worst
