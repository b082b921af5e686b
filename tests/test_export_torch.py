"""``octoplan export --format torch-csv``: torch.distributed.pipelining really trains with our plans.

The CSV is checked cell by cell against torch's own parser, and then loaded into torch's
``_PipelineScheduleRuntime`` on 2 gloo processes, for baseline plans with several stages per rank
and an I/W split and for a tuned plan: three SGD steps must give the losses and the final
parameters of a single-process reference built from the same model file and seeds.
"""

from __future__ import annotations

import csv
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from octoplan.baseline import make_baseline
from octoplan.errors import InputError
from octoplan.export import EXPORT_FORMATS, export_plan, export_torch_csv, torch_csv_rows
from octoplan.modelfile import as_args, load_model_file
from octoplan.ops import Kind, Op
from octoplan.plan import Cluster, Plan
from octoplan.profile import Layer, ModelRef, Profile
from octorun.runtime import free_port

NUM_STEPS = 3
LR = 0.1
TOLERANCE = 1e-5

# A float chain: 6 layers of different widths, so every boundary has its own shape.
MODEL = '''
import torch
from torch import nn

WIDTHS = [5, 8, 6, 8, 7, 8, 3]

def num_layers():
    return len(WIDTHS) - 1

class Block(nn.Module):
    def __init__(self, n_in, n_out, last):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.last = last
    def forward(self, x):
        y = self.lin(x)
        return y if self.last else torch.tanh(y) + 0.1 * y

def build_layer(index):
    return Block(WIDTHS[index], WIDTHS[index + 1], index == len(WIDTHS) - 2)

def sample_batch(mbs, generator):
    return torch.randn(mbs, WIDTHS[0], generator=generator), torch.randn(mbs, WIDTHS[-1], generator=generator)

def loss_fn(outputs, targets):
    return (outputs - targets).pow(2).mean()
'''

MICROBATCH_SIZE = 2
# Heterogeneous layer costs so that the tuner has something to balance (the costs only shape the
# plans; torch runs the real model above).
TIMES = [(1.0, 1.0, 1.0), (3.0, 2.0, 2.0), (1.0, 1.0, 2.0), (2.0, 1.0, 1.0), (1.0, 2.0, 1.0), (4.0, 3.0, 3.0)]


def _profile(model_path: Path) -> Profile:
    layers = tuple(
        Layer(f"l{i}", "layer", f, i_ms, w_ms, param_bytes=1024, activation_bytes=256, output_bytes=64)
        for i, (f, i_ms, w_ms) in enumerate(TIMES)
    )
    return Profile(model=ModelRef("chain", source=str(model_path), config={}), layers=layers, microbatch_size=MICROBATCH_SIZE)


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "chain.py"
    path.write_text(MODEL)
    return path


def _baselines(profile: Profile) -> dict[str, Plan]:
    return {
        "zbv": make_baseline(profile, schedule="zbv", gpus=2, microbatches=4),
        "interleaved-1f1b": make_baseline(profile, schedule="interleaved-1f1b", gpus=2, microbatches=4, chunks=3),
        "zb-h1": make_baseline(profile, schedule="zb-h1", gpus=2, microbatches=4, partition_method="balanced"),
    }


def _tuned(profile: Profile) -> Plan:
    from octoplan.tuner import TuneOptions, tune

    opts = TuneOptions(gpus=2, pp=2, microbatches=4, time_limit_s=2.0, use_cpsat=False)
    return tune(profile, Cluster(gpus=2), opts).plan


# ---------------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------------


def test_rows_are_the_plan_ops_as_torch_parses_them(tmp_path, model_path):
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    plan = _baselines(_profile(model_path))["zbv"]
    out = tmp_path / "zbv.csv"
    export_torch_csv(plan, out)
    with open(out, newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows == [[str(op) for op in ops] for ops in plan.schedule]
    assert len(rows) == plan.pp == 2
    kinds = set()
    for rank, row in enumerate(rows):
        for cell, op in zip(row, plan.schedule[rank], strict=True):
            action = _Action.from_str(cell)
            assert (action.stage_index, action.computation_type, action.microbatch_index) == (
                op.stage, _ComputationType(op.kind.value), op.mb,
            )
            assert str(action) == cell
            kinds.add(op.kind)
    assert kinds == {Kind.F, Kind.I, Kind.W}  # the split really is in the file
    assert EXPORT_FORMATS == ("torch-csv",)


def test_unrunnable_orders_are_refused_before_writing(tmp_path, model_path):
    plan = make_baseline(_profile(model_path), schedule="1f1b", gpus=2, microbatches=2)
    rank0 = list(plan.schedule[0])
    # B of microbatch 0 first: it waits on its own rank's later F(0, 0), a cycle torch's lowering
    # would report only as "Malformed compute schedule".
    rank0.remove(Op(0, Kind.B, 0))
    broken = plan.with_schedule([[Op(0, Kind.B, 0), *rank0], list(plan.schedule[1])])
    out = tmp_path / "broken.csv"
    with pytest.raises(InputError) as info:
        export_torch_csv(broken, out, file="broken.yaml")
    assert info.value.file == "broken.yaml" and info.value.field == "schedule"
    assert not out.exists()


def test_data_parallel_plans_export_their_one_pipeline(tmp_path, model_path):
    plan = make_baseline(_profile(model_path), schedule="zb-h1", gpus=4, pp=2, microbatches=3)
    assert plan.parallel.dp == 2
    # dp lies outside the pipeline: one row per pipeline rank, not per global rank
    assert torch_csv_rows(plan) == [[str(op) for op in ops] for ops in plan.schedule]


def test_unknown_format_names_the_known_ones(tmp_path, model_path):
    plan = make_baseline(_profile(model_path), schedule="1f1b", gpus=2, microbatches=2)
    with pytest.raises(InputError, match="torch-csv"):
        export_plan(plan, tmp_path / "x", format="megatron")
    assert torch_csv_rows(plan)[1] == [str(op) for op in plan.schedule[1]]


# ---------------------------------------------------------------------------------------------
# Torch trains with it
# ---------------------------------------------------------------------------------------------


class _Chain(torch.nn.Module):
    """Layers [start, end) of the model file; a tuple output is spread as the next layer's args."""

    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, *args):
        out = args
        for layer in self.layers:
            out = layer(*as_args(out))
        return out


def _batch(model, num_mb: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole step's batch: SPEC microbatches stacked, so torch's even split gives them back."""
    pairs = [model.sample_batch(MICROBATCH_SIZE, step=step, replica=0, mb=j) for j in range(num_mb)]
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])


def _reference(model_path: Path, num_mb: int) -> tuple[list[float], dict[int, dict[str, torch.Tensor]]]:
    model = load_model_file(model_path)
    layers = [model.build_layer(i) for i in range(model.num_layers())]
    chain = _Chain(layers)
    opt = torch.optim.SGD(chain.parameters(), lr=LR)
    losses = []
    for step in range(NUM_STEPS):
        opt.zero_grad()
        pairs = [model.sample_batch(MICROBATCH_SIZE, step=step, replica=0, mb=j) for j in range(num_mb)]
        loss = sum(model.loss(chain(x), y) for x, y in pairs) / num_mb
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {i: {k: v.detach().clone() for k, v in layer.state_dict().items()} for i, layer in enumerate(layers)}


def _worker(rank: int, world: int, port: int, model_path: str, jobs: list[tuple[str, Plan, str]], out_dir: str) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60),
    )
    try:
        model = load_model_file(model_path)
        results = {}
        for name, plan, csv_path in jobs:
            mine = plan.stages_of(rank)
            layers = {i: model.build_layer(i) for s in mine for i in plan.stages[s].layers}
            stages = [
                PipelineStage(_Chain([layers[i] for i in plan.stages[s].layers]), s, plan.num_stages, torch.device("cpu"))
                for s in mine
            ]
            schedule = _PipelineScheduleRuntime(stages, n_microbatches=plan.microbatches, loss_fn=model.loss)
            schedule._load_csv(csv_path, format="compute_only")
            opt = torch.optim.SGD([p for layer in layers.values() for p in layer.parameters()], lr=LR)
            step_losses = []
            for step in range(NUM_STEPS):
                opt.zero_grad()
                inputs, targets = _batch(model, plan.microbatches, step)
                mb_losses: list[torch.Tensor] = []
                schedule.step(inputs, target=targets, losses=mb_losses)
                opt.step()
                if mb_losses:  # only the rank with the last stage sees the losses
                    step_losses.append(torch.stack(mb_losses).mean().item())
            results[name] = {
                "losses": step_losses,
                "params": {i: {k: v.detach().clone() for k, v in layer.state_dict().items()} for i, layer in layers.items()},
            }
            torch.distributed.barrier()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_torch_runtime_trains_exported_plans_like_the_reference(tmp_path, model_path):
    profile = _profile(model_path)
    plans = {**_baselines(profile), "tuned": _tuned(profile)}
    # What makes these plans worth exporting: several stages on a rank, and I/W splits.
    assert len(plans["zbv"].stages_of(0)) == 2 and len(plans["interleaved-1f1b"].stages_of(1)) == 3
    assert any(op.kind is Kind.W for ops in plans["zb-h1"].schedule for op in ops)
    jobs = []
    for name, plan in plans.items():
        path = tmp_path / f"{name}.csv"
        export_torch_csv(plan, path)
        jobs.append((name, plan, str(path)))

    torch.multiprocessing.spawn(
        _worker, args=(2, free_port(), str(model_path), jobs, str(tmp_path)), nprocs=2, join=True,
    )
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref_losses, ref_params = _reference(model_path, 4)
    initial = load_model_file(model_path).build_layer(5).lin.weight
    # SGD moves the weights, so equal parameters below mean equal training, not no training.
    assert (ref_params[5]["lin.weight"] - initial).abs().max().item() > 1e-3
    for name, plan in plans.items():
        last_rank = plan.stages[-1].rank
        losses = per_rank[last_rank][name]["losses"]
        assert losses == pytest.approx(ref_losses, abs=TOLERANCE), name
        seen = set()
        for rank in range(2):
            for index, state in per_rank[rank][name]["params"].items():
                seen.add(index)
                for key, value in state.items():
                    diff = (value - ref_params[index][key]).abs().max().item()
                    assert diff <= TOLERANCE, f"{name}: layer {index} {key} differs by {diff}"
        assert seen == set(range(len(TIMES)))
