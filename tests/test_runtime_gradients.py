"""Parameter gradients in octorun: what autograd hands back is never stored as ``.grad`` itself,
and a module two layers of one rank share is stepped once.

Both cases run octorun as a single process (no launcher) against the single-process reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import runtime_helpers as h
from octoplan.plan import save_plan
from octorun.runtime import RunConfig, run

TOL = 1e-6
STEPS = 2

# x + p with p of the activation's full shape (microbatch size 1): autograd returns the
# upstream gradient itself as p's gradient, the very tensor that is also the layer's input
# gradient.
ADDITIVE_MODEL = '''
import torch
from torch import nn

CONFIG = {"hidden": 4, "seq": 3}

def num_layers(hidden, seq):
    return 4

class In(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin = nn.Linear(2, hidden)
    def forward(self, x):
        return self.lin(x)

class Offset(nn.Module):
    def __init__(self, hidden, seq):
        super().__init__()
        self.offset = nn.Parameter(torch.randn(1, seq, hidden))
    def forward(self, h):
        return h + self.offset

class Out(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin = nn.Linear(hidden, 1)
    def forward(self, h):
        return self.lin(h)

def build_layer(index, hidden, seq):
    return In(hidden) if index == 0 else Out(hidden) if index == 3 else Offset(hidden, seq)

def sample_batch(mbs, generator, hidden, seq):
    return torch.randn(mbs, seq, 2, generator=generator), torch.randn(mbs, seq, 1, generator=generator)

def loss_fn(out, targets):
    return ((out - targets) ** 2).mean()
'''

# The embedding's module serves the head too (weight tying through a module-level cache, so
# both layers of the one rank hold the same Parameter).
TIED_MODEL = '''
import torch
from torch import nn

CONFIG = {"vocab": 11, "hidden": 6}
_SHARED = {}

def num_layers(vocab, hidden):
    return 3

def _embedding(vocab, hidden):
    if "embedding" not in _SHARED:
        _SHARED["embedding"] = nn.Embedding(vocab, hidden)
    return _SHARED["embedding"]

class Embed(nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding
    def forward(self, ids):
        return self.embedding(ids)

class Mid(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
    def forward(self, h):
        return torch.tanh(self.lin(h))

class Head(nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding
    def forward(self, h):
        return h @ self.embedding.weight.T

def build_layer(index, vocab, hidden):
    if index == 1:
        return Mid(hidden)
    return (Embed if index == 0 else Head)(_embedding(vocab, hidden))

def sample_batch(mbs, generator, vocab, hidden):
    ids = torch.randint(0, vocab, (mbs, 4), generator=generator)
    return ids, torch.randint(0, vocab, (mbs, 4), generator=generator)

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
'''


@pytest.fixture
def one_process(monkeypatch):
    """No launcher variables: octorun runs as a world of one (and the test leaves none behind)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)


def _train(folder: Path, source: str, *, stages, schedule: str, microbatches: int, microbatch_size: int, optimizer: str):
    model_path = folder / "model.py"
    model_path.write_text(source)
    plan = h.make_plan(model_path, {}, stages=stages, schedule=[schedule], microbatches=microbatches,
                       microbatch_size=microbatch_size)
    save_plan(plan, folder / "plan.yaml")
    lr = 0.1 if optimizer == "sgd" else 0.01
    result = run(RunConfig(plan_path=str(folder / "plan.yaml"), steps=STEPS, optimizer=optimizer, lr=lr))
    ref = h.reference(model_path, {}, steps=STEPS, microbatches=microbatches, dp=1, microbatch_size=microbatch_size,
                      optimizer=optimizer, lr=lr)
    return result, ref


@pytest.mark.parametrize("stages, schedule", [
    pytest.param([(0, 4, 0)], "0F0 0F1 0B0 0B1", id="fused-backward"),
    pytest.param([(0, 4, 0)], "0F0 0F1 0I0 0I1 0W1 0W0", id="split-backward"),
    # the second microbatch's gradient reaches stage 0 while stage 1's .grad exists already
    pytest.param([(0, 2, 0), (2, 4, 0)], "0F0 1F0 0F1 1F1 1B0 1B1 0B0 0B1", id="two-stages-breadth-first"),
])
def test_a_gradient_autograd_passes_through_is_not_accumulated_into(tmp_path, one_process, stages, schedule):
    result, ref = _train(tmp_path, ADDITIVE_MODEL, stages=stages, schedule=schedule, microbatches=2, microbatch_size=1,
                         optimizer="sgd")
    assert [m.loss for m in result.metrics] == pytest.approx(ref.losses, abs=TOL)
    # the aliased accumulation was off by 0.03 here
    assert h.max_abs_diff(result.state, ref.state) <= TOL


def test_a_module_two_layers_share_is_stepped_once(tmp_path, one_process):
    result, ref = _train(tmp_path, TIED_MODEL, stages=[(0, 2, 0), (2, 3, 0)], schedule="0F0 1F0 1B0 0B0 0F1 1F1 1B1 0B1",
                         microbatches=2, microbatch_size=2, optimizer="adamw")
    # a Parameter listed twice gets two AdamW updates per step (off by about 2 x lr)
    assert h.max_abs_diff(result.state, ref.state) <= TOL
    assert result.state[0]["embedding.weight"].equal(result.state[2]["embedding.weight"])
