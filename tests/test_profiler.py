"""The profiler (octoplan/profiler.py): exact bytes, the I/W split, contract errors, config
overrides, profile files, and per-layer times that add up to the whole model's time."""

from __future__ import annotations

import os

import re
import textwrap
from pathlib import Path

import pytest
import torch

from octoplan.errors import InputError
from octoplan.profile import MAX_MICROBATCH_SIZE, load_profile, profile_to_dict, save_profile
from octoplan.profiler import (
    backward_input,
    backward_weight,
    measure_whole_model_ms,
    parse_config_overrides,
    profile_model_file,
)
from octoplan.splitgrad import SavedTensors, root_edge

from conftest import assert_layers_round_trip, make_profile, remeasured

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "models"

# Layer 0: Linear(8, h) -> tanh -> Linear(h, h); layer 1: Linear(h, 4) with an MSE loss.
TWO_LINEAR = """
import torch
from torch import nn

NAME = "two-linear"
CONFIG = {"hidden": 16, "middle": 0}

def num_layers(hidden, middle):
    return 2 + middle

def build_layer(index, hidden, middle):
    if index == 0:
        return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, hidden))
    if index <= middle:
        return nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
    return nn.Linear(hidden, 4)

def sample_batch(microbatch_size, generator, hidden, middle):
    return torch.randn(microbatch_size, 8, generator=generator), torch.randn(microbatch_size, 4, generator=generator)

def loss_fn(outputs, targets):
    return torch.nn.functional.mse_loss(outputs, targets)
"""

# Token ids in, a tuple passed between layers, named layers: the shape of the real examples.
TOKENS = """
import torch
from torch import nn

CONFIG = {"vocab": 64, "hidden": 32, "blocks": 3}

class Embed(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
    def forward(self, ids):
        return self.emb(ids), ids

class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
    def forward(self, x, ids):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x)))), ids

class Head(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)
    def forward(self, x, ids):
        return self.out(self.ln(x))

def num_layers(vocab, hidden, blocks):
    return blocks + 2

def layer_name(index, vocab, hidden, blocks):
    return "embed" if index == 0 else "head" if index == blocks + 1 else f"block.{index - 1}"

def build_layer(index, vocab, hidden, blocks):
    if index == 0:
        return Embed(vocab, hidden)
    if index == blocks + 1:
        return Head(hidden, vocab)
    return Block(hidden)

def sample_batch(microbatch_size, generator, vocab, hidden, blocks):
    ids = torch.randint(0, vocab, (microbatch_size, 17), generator=generator)
    return ids[:, :-1], ids[:, 1:]

def loss_fn(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
"""


def write_model(tmp_path: Path, text: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def fast_profile(path: str, **kwargs):
    # The CPU unless a test names a device: profile_model_file picks CUDA where there is one.
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("repeat", 2)
    kwargs.setdefault("warmup", 1)
    return profile_model_file(path, **kwargs)


# ----------------------------------------------------------------------------- exact fields


def test_two_linear_bytes_are_exact(tmp_path):
    path = write_model(tmp_path, TWO_LINEAR)
    mbs, hidden, f32 = 3, 16, 4
    profile = fast_profile(path, microbatch_size=mbs)
    first, last = profile.layers
    # Parameters: weights and biases of the two Linears of layer 0, of the one of layer 1.
    assert first.param_bytes == ((8 * hidden + hidden) + (hidden * hidden + hidden)) * f32 == 1664
    assert last.param_bytes == (hidden * 4 + 4) * f32 == 272
    assert first.output_bytes == mbs * hidden * f32 == 192
    assert last.output_bytes == mbs * 4 * f32 == 48
    # Kept for the backward: the first Linear keeps its input (the data: its weight gradient
    # needs it), tanh its output, which the second Linear keeps too (one storage). The weights
    # are not activations, nor is the layer's output (the next layer's input, counted there).
    assert first.activation_bytes == (mbs * 8 + mbs * hidden) * f32 == 288
    # Layer 1 keeps its input (octorun's tape holds it as the leaf its backward ends at, and
    # the Linear saves it, one storage), and the MSE keeps the prediction and the targets.
    assert last.activation_bytes == (mbs * hidden + mbs * 4 + mbs * 4) * f32 == 288
    # What a split backward's I leaves for W: the gradients W starts from. Layer 0's input
    # needs no gradient, so its I does nothing and W starts at the output's gradient; layer
    # 1's I captures the gradient at its Linear's output, the prediction's.
    assert first.pending_w_bytes == mbs * hidden * f32 == 192
    assert last.pending_w_bytes == mbs * 4 * f32 == 48
    # What stays from I to W: layer 0 has no input path (its input is data), so its I reads
    # nothing and W needs all it saved. Layer 1's I reads the MSE's prediction and targets,
    # which octorun then releases; the Linear's saved input (its weight gradient's) stays.
    assert first.w_saved_bytes == first.activation_bytes == 288
    assert last.w_saved_bytes == mbs * hidden * f32 == 192
    # FLOPs of the forward: 2 * m * k * n per matmul.
    assert first.flops == 2 * mbs * 8 * hidden + 2 * mbs * hidden * hidden
    assert last.flops == 2 * mbs * hidden * 4
    # The first layer's input is data: no input gradient. Layer 1 has both halves of backward.
    assert first.backward_input_ms == 0.0
    assert first.backward_weight_ms > 0 and first.forward_ms > 0
    assert last.backward_input_ms > 0 and last.backward_weight_ms > 0
    assert [layer.kind for layer in profile.layers] == ["layer", "head"]
    assert [layer.name for layer in profile.layers] == ["Sequential", "Linear"]
    assert profile.microbatch_size == mbs and profile.dtype == "float32"
    assert profile.model.name == "two-linear" and profile.model.source == path
    assert profile.device["name"] == "cpu"
    # decimal GB, the unit the plan's memory_gb and the simulator's limit use (not GiB)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert profile.device["memory_gb"] == round(total / 1e9, 1)


def test_a_layer_does_not_count_its_own_output_even_where_autograd_saves_it(tmp_path):
    # the middle layer is Linear then Tanh: tanh saves its result, which is the layer's output,
    # held by the next layer as its input (and counted there); the layer keeps its input (the
    # Linear saves it, and the tape holds it), one storage
    path = write_model(tmp_path, TWO_LINEAR)
    mbs, hidden, f32 = 3, 16, 4
    first, middle, last = fast_profile(path, microbatch_size=mbs, config={"middle": 1}).layers
    assert middle.activation_bytes == mbs * hidden * f32 == 192
    assert last.activation_bytes == (mbs * hidden + mbs * 4 + mbs * 4) * f32  # as with no middle layer
    # the middle layer's I captures the gradient at its Linear's output for W
    assert middle.pending_w_bytes == mbs * hidden * f32
    # and keeps the Linear's input for W; tanh's saved result, the layer's own output, it
    # holds itself from F until its I (only I reads it); its input it keeps until W
    assert middle.w_saved_bytes == mbs * hidden * f32
    assert (middle.output_saved_bytes, middle.output_w_bytes, middle.input_freed_bytes) == (mbs * hidden * f32, 0, 0)
    assert (first.output_saved_bytes, last.output_saved_bytes) == (0, 0)  # a Linear's output, the loss



BUFFERED = """
import torch
from torch import nn

def num_layers():
    return 2

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", torch.ones(4096))

    def forward(self, x):
        return self.lin(x) * self.table[:8]

def build_layer(index):
    return Scaled()

def sample_batch(mbs, generator):
    return torch.randn(mbs, 8, generator=generator), torch.randn(mbs, 8, generator=generator)

def loss_fn(out, targets):
    return ((out - targets) ** 2).mean()
"""


def test_a_buffer_the_forward_saves_is_not_an_activation(tmp_path):
    # the multiply by the table's slice (a view of the 16 KB buffer) saves only that slice,
    # which stays whatever the schedule: layer 0 counts only the data its Linear saves; layer 1
    # its input (the Linear saves it too, one storage) and the difference the loss squares
    path = write_model(tmp_path, BUFFERED)
    mbs, f32 = 3, 4
    first, last = fast_profile(path, microbatch_size=mbs).layers
    assert first.activation_bytes == mbs * 8 * f32
    assert last.activation_bytes == (mbs * 8 + mbs * 8) * f32

def test_bytes_do_not_depend_on_timing_settings(tmp_path):
    path = write_model(tmp_path, TWO_LINEAR)
    a = fast_profile(path, microbatch_size=5, repeat=1, warmup=0)
    b = fast_profile(path, microbatch_size=5, repeat=3, warmup=2, seed=7)
    fields = lambda p: [(l.param_bytes, l.activation_bytes, l.output_bytes, l.flops) for l in p.layers]  # noqa: E731
    assert fields(a) == fields(b)


def test_token_model_names_kinds_and_tuples(tmp_path):
    path = write_model(tmp_path, TOKENS)
    seen = []
    profile = fast_profile(path, microbatch_size=2, on_layer=lambda i, n, name: seen.append((i, n, name)))
    names = ["embed", "block.0", "block.1", "block.2", "head"]
    assert seen == [(i, 5, name) for i, name in enumerate(names)]
    assert [layer.name for layer in profile.layers] == names
    # No layer_kind in the file: an Embedding first layer is "embedding", the last one "head".
    assert [layer.kind for layer in profile.layers] == ["embedding", "layer", "layer", "layer", "head"]
    embed = profile.layers[0]
    assert embed.backward_input_ms == 0.0  # token ids carry no gradient
    # so its W and B are one autograd pass, and the profile gives them one figure: a B op on
    # stage 0 is priced as what the runtime runs for it
    assert embed.backward_ms == embed.backward_weight_ms > 0
    assert embed.param_bytes == 64 * 32 * 4
    # A tuple output counts every tensor: activations (2, 16, 32) float32 plus ids (2, 16) int64.
    assert embed.output_bytes == 2 * 16 * 32 * 4 + 2 * 16 * 8
    assert profile.layers[-1].output_bytes == 2 * 16 * 64 * 4
    assert all(layer.backward_input_ms > 0 for layer in profile.layers[1:])


# ----------------------------------------------------------------------------- files and config


def test_profile_round_trips_through_save_and_load(tmp_path):
    path = write_model(tmp_path, TWO_LINEAR)
    profile = fast_profile(path, microbatch_size=2, config={"middle": 1})
    out = tmp_path / "profiles" / "p.yaml"
    save_profile(profile, out)
    loaded = load_profile(out)
    assert profile_to_dict(loaded) == profile_to_dict(profile)
    assert_layers_round_trip(loaded, profile)
    # the byte fields a split backward's memory rests on were measured, so the check above saw them
    assert all(l.pending_w_bytes > 0 and l.w_saved_bytes for l in profile.layers[1:])
    assert loaded.model.config == {"hidden": 16, "middle": 1}
    assert loaded.extra["profiler"]["threads"] == 1
    assert loaded.extra["profiler"]["repeat"] == 2
    assert all(l.backward_ms is not None and l.backward_ms > 0 for l in loaded.layers)
    assert [l.backward_ms for l in loaded.layers] == [round(l.backward_ms, 6) for l in profile.layers]
    assert [l.param_bytes for l in loaded.layers] == [l.param_bytes for l in profile.layers]


def test_config_overrides_change_the_model(tmp_path):
    path = write_model(tmp_path, TWO_LINEAR)
    overrides = parse_config_overrides(["hidden=4", "middle=2"])
    assert overrides == {"hidden": 4, "middle": 2}
    profile = fast_profile(path, microbatch_size=1, config=overrides)
    assert profile.num_layers == 4
    assert profile.model.config == {"hidden": 4, "middle": 2}
    assert [l.param_bytes for l in profile.layers] == [(8 * 4 + 4 + 4 * 4 + 4) * 4, (4 * 4 + 4) * 4, (4 * 4 + 4) * 4, (4 * 4 + 4) * 4]
    assert [l.kind for l in profile.layers] == ["layer", "layer", "layer", "head"]


def test_unknown_config_key_is_an_input_error(tmp_path):
    path = write_model(tmp_path, TWO_LINEAR)
    with pytest.raises(InputError) as err:
        fast_profile(path, config={"hiden": 4})
    assert err.value.file == path and "hiden" in err.value.line()


def test_parse_config_overrides_values_are_yaml_scalars():
    assert parse_config_overrides(["a=3", "b=0.5", "c=true", "d=gelu", "e='7'", "f=1e-3", "g = x=y", "noise=5e-1"]) == {
        "a": 3,
        "b": 0.5,
        "c": True,
        "d": "gelu",
        "e": "7",
        # YAML 1.2's floats, as the plan's and profile's model.config read them (yaml.safe_load,
        # YAML 1.1, read both as strings)
        "f": 0.001,
        "g": "x=y",
        "noise": 0.5,
    }
    assert parse_config_overrides([]) == {}


@pytest.mark.parametrize("item", ["hidden", "=3", "hidden=", "hidden=[1, 2]", "hidden={a: 1}", "hidden=[1"])
def test_parse_config_overrides_rejects_bad_items(item):
    with pytest.raises(InputError) as err:
        parse_config_overrides([item])
    assert err.value.file is None and err.value.field == "--config"


def test_bad_options_are_input_errors(tmp_path):
    path = write_model(tmp_path, TWO_LINEAR)
    for size in (0, MAX_MICROBATCH_SIZE + 1):  # too large: refused before a batch is built (or a profile written
        with pytest.raises(InputError) as err:  # that every reader refuses)
            fast_profile(path, microbatch_size=size)
        assert err.value.field == "--microbatch-size"
    with pytest.raises(InputError) as err:
        fast_profile(path, repeat=0)
    assert err.value.field == "--repeat"
    with pytest.raises(InputError) as err:
        fast_profile(path, device="tpu")
    assert err.value.field == "--device"
    if not torch.cuda.is_available():
        with pytest.raises(InputError) as err:
            fast_profile(path, device="cuda")
        assert err.value.field == "--device" and "CUDA" in err.value.problem


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
def test_cuda_profile_is_timed_with_events_and_sizes_like_the_cpu(tmp_path):
    path = write_model(tmp_path, TWO_LINEAR)
    gpu, cpu = fast_profile(path, device="cuda"), fast_profile(path, device="cpu")
    assert gpu.extra["profiler"]["clock"] == "cuda-events" and "threads" not in gpu.extra["profiler"]
    assert gpu.device["name"] == torch.cuda.get_device_name() and gpu.device["memory_gb"] > 0
    sizes = lambda profile: [(l.param_bytes, l.activation_bytes, l.output_bytes) for l in profile.layers]
    assert sizes(gpu) == sizes(cpu)  # bytes come from tensors, not from the device
    assert all(l.forward_ms > 0 and l.backward_weight_ms > 0 for l in gpu.layers)
    assert all(l.backward_input_ms > 0 for l in gpu.layers[1:])


def test_threads_are_fixed_and_restored(tmp_path):
    path = write_model(tmp_path, TWO_LINEAR)
    before = torch.get_num_threads()
    profile = fast_profile(path, threads=2)
    assert profile.extra["profiler"]["threads"] == 2
    assert profile.extra["profiler"]["clock"] == "wall"
    assert fast_profile(path).extra["profiler"]["clock"] == "thread-cpu-time"
    assert torch.get_num_threads() == before


def test_the_unsteady_layers_warning_names_the_widest_by_index(capsys):
    from dataclasses import replace

    from octoplan.cli import _warn_unsteady_layers
    from octoplan.profile import Profile

    base = make_profile([(1, 1, 1)] * 10)
    spreads = [0.05, 0.20, 0.11, 0.30, 0.12, 0.13, 0.14, 0.15, 0.10, None]
    layers = tuple(replace(layer, name="ReLU", spread=spread) for layer, spread in zip(base.layers, spreads))
    _warn_unsteady_layers(Profile(model=base.model, layers=layers))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: 7 of 10 layers' times spread over 10% between repeats ")
    assert "(#3 ReLU 30.0%, #1 ReLU 20.0%, #7 ReLU 15.0%, #6 ReLU 14.0%, #5 ReLU 13.0%, #4 ReLU 12.0%, and 1 more)" in err
    _warn_unsteady_layers(Profile(model=base.model, layers=layers[:1] + layers[8:]))  # 0.05, 0.10 (not over), None
    assert capsys.readouterr().err == ""


def test_the_clock_a_gpu_profile_reads():
    # built without a GPU: the choice only (a reading would need CUDA)
    from octoplan.profiler import _Clock

    gpu = torch.device("cuda")
    assert (_Clock(gpu, threads=1).kind, _Clock(gpu, threads=1).cuda) == ("cuda-events", True)
    wall = _Clock(gpu, threads=1, clock="wall")  # a model that sleeps: no CUDA event sees it
    assert (wall.kind, wall.cuda, wall.now_ns) == ("wall", False, _Clock._synced_wall_ns)
    with pytest.raises(InputError) as error:
        _Clock(gpu, threads=1, clock="cpu")
    assert error.value.field == "--clock" and error.value.fix == "use auto or wall, or --device cpu"


# ----------------------------------------------------------------------------- broken model files

BROKEN = {
    # name: (replacement source, expected field, words the message must hold)
    "missing_function": (TWO_LINEAR.replace("def loss_fn", "def loss"), "loss_fn", "is not defined"),
    "shape_mismatch": (
        TWO_LINEAR.replace("return nn.Linear(hidden, 4)", "return nn.Linear(hidden + 1, 4)"),
        "layer 1 (Linear)",
        "its forward raised on layer 0's output: RuntimeError",
    ),
    "exception_in_layer": (
        TWO_LINEAR.replace("return nn.Linear(hidden, 4)", "return Boom()")
        + "\nclass Boom(nn.Module):\n    def forward(self, x):\n        raise ValueError('kaboom')\n",
        "layer 1 (Boom)",
        "ValueError: kaboom",
    ),
    "first_layer_rejects_inputs": (
        TWO_LINEAR.replace("nn.Linear(8, hidden), nn.Tanh()", "nn.Linear(9, hidden), nn.Tanh()"),
        "layer 0 (Sequential)",
        "its forward raised on sample_batch's inputs",
    ),
    "non_scalar_loss": (
        TWO_LINEAR.replace("mse_loss(outputs, targets)", "mse_loss(outputs, targets, reduction='none')"),
        "loss_fn",
        "not a scalar",
    ),
    "loss_raises": (
        TWO_LINEAR.replace("return torch.nn.functional.mse_loss(outputs, targets)", "raise KeyError('labels')"),
        "loss_fn",
        "failed on the output of layer 1 (Linear): KeyError",
    ),
    "dict_output": (
        TWO_LINEAR.replace("nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, hidden))", "DictOut(hidden)")
        + "\nclass DictOut(nn.Module):\n    def __init__(self, h):\n        super().__init__()\n        self.l = nn.Linear(8, h)\n"
        "    def forward(self, x):\n        return {'x': self.l(x)}\n",
        "layer 0 (DictOut)",
        "returned a dict",
    ),
    "tuple_with_non_tensor": (
        TWO_LINEAR.replace("nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, hidden))", "PairOut(hidden)")
        + "\nclass PairOut(nn.Module):\n    def __init__(self, h):\n        super().__init__()\n        self.l = nn.Linear(8, h)\n"
        "    def forward(self, x):\n        return self.l(x), 3\n",
        "layer 0 (PairOut)",
        "returned a tuple of (Tensor, int)",
    ),
    "build_layer_raises": (
        TWO_LINEAR.replace("if index == 0:", "if index == 1:\n        raise RuntimeError('no weights')\n    if index == 0:"),
        "build_layer(1)",
        "RuntimeError: no weights",
    ),
    "build_layer_not_a_module": (
        TWO_LINEAR.replace("return nn.Linear(hidden, 4)", "return 'linear'"),
        "build_layer(1)",
        "returned str",
    ),
    "sample_batch_not_tensors": (
        TWO_LINEAR.replace("return torch.randn(microbatch_size, 8, generator=generator), torch", "return [1.0], torch"),
        "sample_batch",
        "inputs are a list of (float)",
    ),
    "config_not_a_mapping": (
        TWO_LINEAR.replace('CONFIG = {"hidden": 16, "middle": 0}', "CONFIG = [16, 0]"),
        "CONFIG",
        "is a list, not a mapping",
    ),
    "exits_at_import": (
        "import sys\nsys.exit(3)\n" + TWO_LINEAR,
        None,
        "exits when imported (status 3)",
    ),
    # a model's own exit (sys.exit, argparse's error) is its failure, named, not a silent end
    "num_layers_exits": (
        TWO_LINEAR.replace("return 2 + middle", "raise SystemExit(2)"),
        "num_layers",
        "raised SystemExit: 2",
    ),
    "build_layer_exits": (
        TWO_LINEAR.replace("if index == 0:", "if index == 1:\n        raise SystemExit('bye')\n    if index == 0:", 1),
        "build_layer(1)",
        "SystemExit: bye",
    ),
    "forward_exits": (
        TWO_LINEAR.replace("return nn.Linear(hidden, 4)", "return Quits()")
        + "\nclass Quits(nn.Module):\n    def forward(self, x):\n        import sys\n        sys.exit(0)\n",
        "layer 1 (Quits)",
        "exits in its forward: SystemExit: 0",
    ),
    "loss_exits": (
        TWO_LINEAR.replace("return torch.nn.functional.mse_loss(outputs, targets)", "raise GeneratorExit('loss broke')"),
        "loss_fn",
        "GeneratorExit: loss broke",
    ),
    "too_many_layers": (
        TWO_LINEAR.replace("return 2 + middle", "return 10**9"),
        "num_layers",
        "returned 1000000000",
    ),
    "head_kind_in_the_middle": (
        TWO_LINEAR + "\ndef layer_kind(index, hidden, middle):\n    return 'head'\n",
        "layer_kind(0)",
        "reserved for the last layer",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_model_files_are_input_errors(tmp_path, case):
    text, field, words = BROKEN[case]
    path = write_model(tmp_path, text, name=f"{case}.py")
    with pytest.raises(InputError) as err:
        fast_profile(path)
    assert err.value.file == path
    assert err.value.field == field
    assert words in err.value.line()


def test_missing_model_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError) as err:
        fast_profile(str(tmp_path / "nope.py"))
    assert "no such model file" in err.value.line()


# ----------------------------------------------------------------------------- split backward


class _Tied(torch.nn.Module):
    """A layer that uses one Linear twice and a LayerNorm weight in two places, and has a
    second output that does not depend on the input: the awkward cases of the split."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.ln = torch.nn.LayerNorm(8)

    def forward(self, x):
        h = torch.tanh(self.lin(self.ln(x)))
        return torch.tanh(self.lin(h) * self.ln.weight), self.lin.bias * 2


def _split_matches_autograd(layer, inputs, outputs):
    params = list(layer.parameters())
    grads = [torch.randn_like(t) for t in outputs]
    grad_inputs = [t for t in inputs if t.requires_grad]
    expected = torch.autograd.grad(outputs, grad_inputs + params, grads, retain_graph=True, allow_unused=True)
    got_inputs, pending = backward_input(outputs, grads, grad_inputs, params)
    got_params = backward_weight(pending)
    assert len(got_inputs) == len(grad_inputs) and len(got_params) == len(params)
    for got, want in zip(list(got_inputs) + list(got_params), expected):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want)
    # W is repeatable (the profiler times it many times) and gives the same answer.
    for got, want in zip(backward_weight(pending), got_params):
        torch.testing.assert_close(got, want)


def test_split_backward_equals_autograd_for_a_transformer_block():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    _split_matches_autograd(layer, [x], [layer(x)])


def test_split_backward_equals_autograd_with_shared_parameters():
    torch.manual_seed(0)
    layer = _Tied()
    x = torch.randn(3, 8, requires_grad=True)
    _split_matches_autograd(layer, [x], list(layer(x)))


def test_split_backward_without_input_gradient():
    torch.manual_seed(0)
    layer = torch.nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2, 2, 7]])
    _split_matches_autograd(layer, [ids], [layer(ids)])


def test_split_backward_without_creation_order(monkeypatch):
    """The graph is normally ordered by autograd's creation numbers; when that order is wrong
    the planner falls back to a search and the gradients are still exact."""
    import octoplan.splitgrad as profiler

    fallbacks = []
    real_post_order = profiler._post_order
    monkeypatch.setattr(profiler, "_creation_order", lambda children: list(children))  # parents first
    monkeypatch.setattr(profiler, "_post_order", lambda children: fallbacks.append(1) or real_post_order(children))
    torch.manual_seed(0)
    layer = _Tied()
    x = torch.randn(3, 8, requires_grad=True)
    _split_matches_autograd(layer, [x], list(layer(x)))
    assert fallbacks


def _released_split(layer, inputs, forward):
    """The split as octorun runs it: F recorded into boxes, I, the boxes only I read released,
    then W. Returns (input grads, param grads, the saved tensors, how many boxes I released),
    after checking the gradients against the split without release, bit for bit."""
    params = list(layer.parameters())
    grad_inputs = [t for t in inputs if t.requires_grad]
    torch.manual_seed(1)
    plain_outputs = forward()
    grads = [torch.randn_like(t) for t in plain_outputs]
    plain_inputs, plain_pending = backward_input(plain_outputs, grads, grad_inputs, params)
    plain_params = backward_weight(plain_pending)
    saved = SavedTensors()
    torch.manual_seed(1)
    with saved.recording():
        outputs = forward()
    boxes = len(saved.boxes)
    got_inputs, pending = backward_input([root_edge(t) for t in outputs], grads, grad_inputs, params, saved=saved)
    del outputs  # octorun's tape keeps only the edges
    saved.release()
    got_params = backward_weight(pending)
    for got, want in zip([*got_inputs, *got_params], [*plain_inputs, *plain_params]):
        assert (got is None) == (want is None)
        if want is not None:
            assert torch.equal(got, want)
    return saved, boxes - len(saved.boxes)


def test_i_releases_what_only_the_input_path_read_and_w_still_gives_the_same_gradients():
    # Linear, GELU, Linear: W reads the first Linear's input and the second's (the GELU's
    # output); only the GELU's saved input is the input path's alone
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    layer = torch.nn.ModuleList([first, second])
    x = torch.randn(4, 8, requires_grad=True)
    saved, released = _released_split(layer, [x], lambda: [second(torch.nn.functional.gelu(first(x)))])
    assert released == 1
    kept = [tuple(t.shape) for t in saved.kept() if not any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                                                            for p in layer.parameters())]
    assert sorted(kept) == [(4, 8), (4, 16)]  # x and the GELU's output


def test_i_releases_the_attention_and_activation_tensors_of_a_transformer_block():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True)
    layer.train()
    x = torch.randn(2, 5, 16, requires_grad=True)
    saved, released = _released_split(layer, [x], lambda: [layer(x)])
    assert released > 0


def test_a_parameter_at_two_boundary_nodes_releases_nothing():
    # W runs the input path between the two nodes where the tied Linear's branches leave it:
    # the split then releases nothing, and the gradients stay exact
    torch.manual_seed(0)
    layer = _Tied()
    x = torch.randn(3, 8, requires_grad=True)
    saved, released = _released_split(layer, [x], lambda: list(layer(x)))
    assert released == 0


def test_a_released_tensor_read_again_is_a_clear_error():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    saved = SavedTensors()
    with saved.recording():
        out = torch.sin(x) @ w
    backward_input([out], [torch.ones_like(out)], [x], [w], saved=saved)
    saved.release()  # sin's saved input
    with pytest.raises(RuntimeError, match="released after the input gradient"):
        torch.autograd.grad(out, x, torch.ones_like(out))


def test_split_weight_pass_skips_the_input_path():
    """W must not redo I's work: with the input gradient captured, a deep stack of
    parameter-free ops before the first Linear is not walked again by W."""

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(4, 4)
            self.last = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.first(x)
            for _ in range(50):
                h = torch.sin(h)
            return self.last(h)

    layer = Deep()
    x = torch.randn(2, 4, requires_grad=True)
    out = layer(x)
    calls = []
    sin_nodes = []
    node = out.grad_fn.next_functions[1][0]  # the last Linear's input: the top SinBackward
    while type(node).__name__.startswith("SinBackward"):
        sin_nodes.append(node)
        node = node.next_functions[0][0]
    assert len(sin_nodes) == 50
    _, pending = backward_input([out], [torch.ones_like(out)], [x], list(layer.parameters()))
    handles = [n.register_prehook(lambda g: calls.append(1)) for n in sin_nodes]
    try:
        backward_weight(pending)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == []


# ----------------------------------------------------------------------------- accuracy

# Layers that burn a fixed amount of the thread's CPU time in their forward and on each backward
# branch (the replay model's layout, spinning instead of sleeping). The profiler's default clock
# is that thread's CPU time, which other processes on a shared machine do not advance, so what
# it must recover is known exactly, under any load. How close the per-layer sum of a *real*
# model comes to its whole-model time depends on caches and load; that is a benchmark
# (benchmarks/bench_profiler.py, docs/BENCHMARKS.md), not a unit test.
SPIN = """
import time
import torch
from torch import nn

# (forward, input-gradient, weight-gradient) ms of CPU time per layer; layer 0 gets token-free
# data that needs no gradient, so its input branch never runs
COSTS = [(2.0, 0.0, 1.0), (1.0, 2.5, 0.5), (3.0, 1.0, 2.0), (0.5, 1.5, 3.0)]
CONFIG = {}

def _spin(ms):
    end = time.thread_time_ns() + int(ms * 1e6)
    while time.thread_time_ns() < end:
        pass

class _SpinOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, ms):
        ctx.ms = ms
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        _spin(ctx.ms)
        return grad, None

class SpinLayer(nn.Module):
    def __init__(self, forward_ms, input_ms, weight_ms):
        super().__init__()
        self.costs = (forward_ms, input_ms, weight_ms)
        self.weight = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        forward_ms, input_ms, weight_ms = self.costs
        _spin(forward_ms)
        return _SpinOnBackward.apply(x, input_ms) + _SpinOnBackward.apply(self.weight, weight_ms)

def num_layers():
    return len(COSTS)

def build_layer(index):
    return SpinLayer(*COSTS[index])

def sample_batch(microbatch_size, generator):
    return torch.randn(microbatch_size, 8, generator=generator), torch.randn(microbatch_size, 8, generator=generator)

def loss_fn(outputs, targets):
    return torch.nn.functional.mse_loss(outputs, targets)
"""
SPIN_COSTS = [(2.0, 0.0, 1.0), (1.0, 2.5, 0.5), (3.0, 1.0, 2.0), (0.5, 1.5, 3.0)]


def _close(measured: float, built: float) -> bool:
    # every timed call spins at least its built time on the same clock; autograd and Python add
    # 0.05-0.2 ms per call, while a lost or doubled branch would be off by 0.5 ms or more
    return built <= measured <= built + 0.3 + 0.05 * built


def test_profiler_recovers_known_forward_input_and_weight_times(tmp_path):
    path = write_model(tmp_path, SPIN)

    def measure():
        profile = profile_model_file(path, microbatch_size=4, repeat=5, warmup=1, device="cpu")
        # no stall makes a spin shorter: these bounds hold in every attempt
        for index, (layer, (f_ms, i_ms, w_ms)) in enumerate(zip(profile.layers, SPIN_COSTS)):
            got = (layer.forward_ms, layer.backward_input_ms, layer.backward_weight_ms, layer.backward_ms)
            assert all(g >= w for g, w in zip(got, (f_ms, i_ms, w_ms, i_ms + w_ms))), f"layer {index}: {got} under what was built"
        # layer 0's input is data with no gradient: its B is its W pass, one measured figure
        assert profile.layers[0].backward_ms == profile.layers[0].backward_weight_ms
        return profile

    def misses(profile):
        found = []
        for index, (layer, (f_ms, i_ms, w_ms)) in enumerate(zip(profile.layers, SPIN_COSTS)):
            got = (layer.forward_ms, layer.backward_input_ms, layer.backward_weight_ms)
            if not all(_close(g, w) for g, w in zip(got, (f_ms, i_ms, w_ms))):
                found.append(f"layer {index}: measured F, I, W {got}, built {(f_ms, i_ms, w_ms)}")
            # the fused backward runs both spinning branches in one pass: at least both built
            # times, and each branch's call may add its own autograd overhead
            built = i_ms + w_ms
            if not layer.backward_ms <= built + 0.6 + 0.05 * built:
                found.append(f"layer {index}: fused B {layer.backward_ms}, built {built}")
        return found

    missed = remeasured(measure, misses)
    assert not missed, missed


SLOW_START = """
import time
import torch
from torch import nn

CONFIG = {"slow_calls": 6}

def _spin(ms):
    end = time.thread_time_ns() + int(ms * 1e6)
    while time.thread_time_ns() < end:
        pass

class SlowToSettle(nn.Module):
    # 4 ms a forward for its first slow_calls calls, then 1 ms: a layer still warming up after
    # the profiler's fixed warm-up
    def __init__(self, slow_calls):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8))
        self.calls, self.slow_calls = 0, slow_calls

    def forward(self, x):
        self.calls += 1
        _spin(4.0 if self.calls <= self.slow_calls else 1.0)
        return x * self.weight

def num_layers(**config):
    return 1

def build_layer(index, slow_calls):
    return SlowToSettle(slow_calls)

def sample_batch(microbatch_size, generator, **config):
    return torch.randn(microbatch_size, 8, generator=generator), torch.randn(microbatch_size, 8, generator=generator)

def loss_fn(outputs, targets):
    return torch.nn.functional.mse_loss(outputs, targets)
"""


def test_leading_slow_calls_count_as_warm_up(tmp_path):
    # Before the forward is timed it runs once to get the layer's output, once to count its
    # FLOPs and once to warm up; so of its 5 timed calls the first 3 take 4 ms. A fixed warm-up
    # reports their median, 4 ms; the leading slow calls are dropped and timed again instead.
    path = write_model(tmp_path, SLOW_START)
    # a layer that never settles within ``repeat`` more calls keeps the median of what was timed
    for slow_calls, settled_ms in ((6, 1.0), (40, 4.0)):
        def forward_ms():
            (layer,) = profile_model_file(path, config={"slow_calls": slow_calls}, microbatch_size=4, repeat=5,
                                          warmup=1, device="cpu").layers
            assert layer.forward_ms >= settled_ms
            return layer.forward_ms

        missed = remeasured(forward_ms, lambda ms: [] if _close(ms, settled_ms) else [f"{slow_calls} slow calls: {ms} ms"])
        assert not missed, missed


def test_layer_sum_equals_the_whole_model_time(tmp_path):
    path = write_model(tmp_path, SPIN)
    kwargs = dict(microbatch_size=4, repeat=5, device="cpu")
    total = sum(layer.total_ms for layer in profile_model_file(path, **kwargs).layers)
    whole = measure_whole_model_ms(path, **kwargs)
    assert total >= sum(map(sum, SPIN_COSTS))
    assert abs(whole - total) <= 1.0 + 0.03 * total, f"sum of layers {total:.2f} ms, whole model {whole:.2f} ms"


def test_cli_check_whole_reports_the_ratio(tmp_path):
    # --check-whole is still accepted; the comparison is in every profile of a model file now
    from typer.testing import CliRunner

    from octoplan.cli import app

    path = write_model(tmp_path, SPIN)
    out = tmp_path / "spin.yaml"
    runner = CliRunner()
    done = runner.invoke(app, ["profile", path, "--repeat", "3", "--device", "cpu", "--check-whole", "-o", str(out)], terminal_width=200)
    assert done.exit_code == 0, done.output
    line = next(line for line in done.output.splitlines() if line.startswith("whole model"))
    whole, layers, ratio = (float(x) for x in re.findall(r"(\d+\.\d+)(?= ms|\))", line))
    profile = load_profile(out)
    assert layers == pytest.approx(sum(layer.forward_ms + layer.b_ms for layer in profile.layers), abs=2e-3)
    assert (whole, layers) == pytest.approx((profile.whole_model.ms, profile.whole_model.layers_sum_ms), abs=1e-3)
    assert ratio == pytest.approx(layers / whole, abs=1e-3)
    assert abs(whole - layers) <= 1.0 + 0.03 * layers  # the spin model's times are exact (above)
    assert "off the whole model" not in done.output
    bad = runner.invoke(app, ["profile", "--arch", "llama3-8b", "--check-whole", "-o", str(tmp_path / "a.yaml")])
    assert bad.exit_code == 2 and "--check-whole" in bad.output and bad.output.count("\n") == 1


# ---------------------------------------------------------------------- bad model files, found by a review


def test_the_dtype_is_the_one_holding_most_bytes():
    from octoplan.profiler import _dtype_name

    # a bf16 matrix beside two fp32 norms is a bf16 layer, though fp32 has more tensors
    assert _dtype_name([(torch.bfloat16, 131072), (torch.float32, 1024), (torch.float32, 1024)]) == "bfloat16"
    assert _dtype_name([(torch.bfloat16, 1024), (torch.float32, 4096)]) == "float32"
    assert _dtype_name([(torch.int64, 64)]) == "float32"


def test_a_model_file_off_its_config_or_name_is_refused_as_it_loads(tmp_path):
    from octoplan.modelfile import load_model_file

    path = write_model(tmp_path, TWO_LINEAR)
    with pytest.raises(InputError) as found:
        load_model_file(path, {"hiden": 32}, config_given=True)  # typed: --config
    assert found.value.field == "--config hiden" and "did you mean hidden?" in str(found.value)
    # a plan's config is the file's business: its functions say what they take (this one raises)
    assert load_model_file(path, {"hiden": 32}).config == {"hidden": 16, "middle": 0, "hiden": 32}
    for bad, field in (('CONFIG = {"hidden": 16, "middle": 0, "act": torch.nn.ReLU}', "CONFIG.act"),
                       ('CONFIG = {"hidden": 16, "middle": 0, 1: 2}', "CONFIG"),
                       ('NAME = "../escaped"', "NAME"), ('NAME = "a\\nb"', "NAME"), ('NAME = "a\\\\b"', "NAME")):
        source = TWO_LINEAR.replace('CONFIG = {"hidden": 16, "middle": 0}', bad) if bad.startswith("CONFIG") \
            else TWO_LINEAR.replace('NAME = "two-linear"', bad)
        with pytest.raises(InputError) as found:
            load_model_file(write_model(tmp_path, source, f"m{len(field)}{bad.count('n')}.py"))
        assert found.value.field == field, bad


def test_meta_tensors_from_a_model_file_are_bad_input(tmp_path):
    layer_on_meta = TWO_LINEAR.replace("def build_layer(index, hidden, middle):",
                                       "def build_layer(index, hidden, middle):\n    with torch.device('meta'):\n        return _build(index, hidden, middle)\n\ndef _build(index, hidden, middle):")
    batch_on_meta = TWO_LINEAR.replace("return torch.randn(microbatch_size, 8, generator=generator), ",
                                       "return torch.empty(microbatch_size, 8, device='meta'), ")
    for source, field in ((layer_on_meta, "build_layer(0)"), (batch_on_meta, "sample_batch")):
        with pytest.raises(InputError) as found:
            fast_profile(write_model(tmp_path, source, f"{field[:5]}.py"))
        assert found.value.field == field and "meta device" in str(found.value)


def test_a_sample_batch_that_ignores_its_microbatch_size_is_bad_input(tmp_path):
    """Its layers would be timed, and plans' batches counted, at a size the model never drew."""
    fixed = TWO_LINEAR.replace("return torch.randn(microbatch_size, 8, generator=generator), torch.randn(microbatch_size, 4,",
                               "return torch.randn(2, 8, generator=generator), torch.randn(2, 4,")
    assert fixed != TWO_LINEAR
    with pytest.raises(InputError) as found:
        fast_profile(write_model(tmp_path, fixed, "fixed.py"))
    assert found.value.field == "sample_batch"
    assert "the same shapes for microbatch_size 4 and 5" in str(found.value), found.value  # 4: the default
    # a size that one tensor follows is followed (here the inputs; the targets are fixed at 4)
    inputs_only = TWO_LINEAR.replace("torch.randn(microbatch_size, 4, generator=generator)",
                                     "torch.randn(4, 4, generator=generator)")
    assert inputs_only != TWO_LINEAR
    assert fast_profile(write_model(tmp_path, inputs_only, "inputs_only.py")).num_layers == 2
    # a model of pairs that refuses an odd size cannot be checked, and is profiled
    pairs = TWO_LINEAR.replace("def sample_batch(microbatch_size, generator, hidden, middle):\n",
                               "def sample_batch(microbatch_size, generator, hidden, middle):\n"
                               "    assert microbatch_size % 2 == 0, 'pairs'\n")
    assert pairs != TWO_LINEAR
    assert fast_profile(write_model(tmp_path, pairs, "pairs.py")).num_layers == 2


SLEEPY = TWO_LINEAR.replace("import torch\n", "import time\nimport torch\n", 1).replace(
    "def num_layers(hidden, middle):", """class Sleepy(nn.Linear):
    def forward(self, x):
        time.sleep(0.02)  # waits, as the replay model's layers do; long beside any CPU work, on any machine
        return super().forward(x)

def num_layers(hidden, middle):""").replace("return nn.Linear(hidden, 4)", "return Sleepy(hidden, 4)")


def test_a_model_whose_layers_wait_is_timed_by_the_wall_clock(tmp_path, caplog):
    """On one CPU thread, auto counts the thread's CPU time, which leaves a sleep out."""
    assert "Sleepy(hidden, 4)" in SLEEPY
    plain = write_model(tmp_path, SLEEPY, "sleepy.py")
    with caplog.at_level("WARNING", logger="octoplan.profiler"):
        counted = fast_profile(plain, clock="cpu", threads=1)
    assert counted.extra["profiler"]["clock"] == "thread-cpu-time" and counted.layers[1].forward_ms < 20
    assert [r.message for r in caplog.records if "longer by the wall clock" in r.message], caplog.text
    caplog.clear()
    # the model file says that its layers wait: auto takes the wall clock, and no warning
    said = write_model(tmp_path, SLEEPY.replace('NAME = "two-linear"', 'NAME = "two-linear"\nPROFILE_CLOCK = "wall"'),
                       "said.py")
    with caplog.at_level("WARNING", logger="octoplan.profiler"):
        walled = fast_profile(said, threads=1)
    assert walled.extra["profiler"]["clock"] == "wall" and walled.layers[1].forward_ms >= 20
    assert "longer by the wall clock" not in caplog.text
    with pytest.raises(InputError) as found:
        fast_profile(write_model(tmp_path, SLEEPY.replace('NAME = "two-linear"', 'PROFILE_CLOCK = "cpu"'), "bad.py"))
    assert found.value.field == "PROFILE_CLOCK" and "'cpu'" in str(found.value)


def test_the_default_profile_path_is_checked_before_measuring(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from octoplan.cli import app

    model = write_model(tmp_path, TWO_LINEAR)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "profiles").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "profiles" / "two-linear.yaml").symlink_to(tmp_path / "fifo")
    result = CliRunner().invoke(app, ["profile", model, "--device", "cpu", "--repeat", "1"])
    assert result.exit_code == 2 and "FIFO" in result.output, result.output
    assert (tmp_path / "fifo").is_fifo()
    result = CliRunner().invoke(app, ["profile", model, "--device", "cpu", "--repeat", "10001"])
    assert result.exit_code == 2 and "--repeat" in result.output, result.output


def test_buffers_are_static_memory(tmp_path):
    # a causal-mask buffer of 64 x 64 fp32 per layer: 16,384 bytes the plan holds beside the
    # weights, once per layer, with no gradient or optimizer state
    from octoplan.baseline import make_baseline
    from octoplan.simulator import simulate

    source = TWO_LINEAR.replace('''    return nn.Linear(hidden, 4)
''', '''    return nn.Linear(hidden, 4)

class Masked(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("mask", torch.ones(64, 64))
    def forward(self, x):
        return self.inner(x)
''').replace("def build_layer(index, hidden, middle):", "def build_layer(index, hidden, middle):\n    return Masked(_build(index, hidden, middle))\n\ndef _build(index, hidden, middle):")
    profile = fast_profile(write_model(tmp_path, source))
    plain = fast_profile(write_model(tmp_path, TWO_LINEAR, "plain.py"))
    assert [layer.buffer_bytes for layer in profile.layers] == [16384, 16384]
    assert [layer.buffer_bytes for layer in plain.layers] == [0, 0]
    save_profile(profile, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml").layers[0].buffer_bytes == 16384
    save_profile(plain, tmp_path / "plain.yaml")  # a profile without buffers is written as before
    assert "buffer_bytes" not in (tmp_path / "plain.yaml").read_text()
    assert (tmp_path / "p.yaml").read_text().count("buffer_bytes: 16384") == 2
    plans = [make_baseline(p, schedule="1f1b", gpus=2, microbatches=2) for p in (profile, plain)]
    statics = [simulate(plan, p).static_memory_bytes for plan, p in zip(plans, (profile, plain))]
    assert [a - b for a, b in zip(*statics)] == [16384, 16384]
    # the tuner's budget and the CP-SAT partition count them as the simulator does
    from octoplan.costs import LayerTable, stage_costs
    from octoplan.tuner.cpsat import problem_for
    from octoplan.tuner.space import Candidate, Config, Evaluator

    budgets = []
    for plan, p in zip(plans, (profile, plain)):
        cand = Candidate(Config(pp=2, dp=1, microbatches=2), (0, 1, 2), (0, 1))
        budgets.append(Evaluator(p, plan.cluster).activation_budget(cand, stage_costs(plan.stages, LayerTable(p))))
    assert [a - b for a, b in zip(*budgets)] == [-16384, -16384]
    import dataclasses

    big = plain.with_layers([dataclasses.replace(layer, buffer_bytes=5_000_000) for layer in plain.layers])
    mb = [problem_for(Evaluator(p, plans[0].cluster), Config(pp=2, dp=1, microbatches=2), 2).static_mb for p in (big, plain)]
    assert [a - b for a, b in zip(*mb)] == [5, 5]  # MB per layer


def test_bad_input_is_one_line_even_where_the_model_makes_python_warn(tmp_path):
    # in a real process: pytest would catch the warnings itself
    import subprocess
    import sys

    noisy = TWO_LINEAR.replace("def loss_fn(outputs, targets):", "def loss_fn(outputs, targets):\n"
                               "    import warnings; warnings.warn('the model file speaks')")
    bad = noisy.replace("mse_loss(outputs, targets)", "mse_loss(outputs, targets, reduction='none')")

    def profile(source: str, name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "octoplan.cli", "profile", write_model(tmp_path, source, f"{name}.py"),
                               "--device", "cpu", "--repeat", "1", "-o", str(tmp_path / f"{name}.yaml")],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})

    failed = profile(bad, "bad")
    assert failed.returncode == 2 and len(failed.stderr.splitlines()) == 1, failed.stderr
    assert failed.stderr.startswith("error: ") and "loss_fn" in failed.stderr
    done = profile(noisy, "good")  # a run that succeeds still shows them, once it is done
    assert done.returncode == 0 and "UserWarning: the model file speaks" in done.stderr, done.stderr


# ----------------------------------------------------------------------------- out of memory


def test_a_model_too_large_for_the_cpu_stops_before_the_oom_killer(tmp_path, monkeypatch):
    """On a CPU, Linux lets a model too large be allocated until its OOM killer ends the process
    with no message. After each layer, what is left must hold one more like it, and after the
    last the trainable parameters' gradients; each storage counts once."""
    from octoplan import profiler
    from octoplan.headroom import SHRINK_FIX

    path = write_model(tmp_path, TWO_LINEAR)
    layer0, layer1 = ((8 * 16 + 16) + (16 * 16 + 16)) * 4, (16 * 4 + 4) * 4  # 1664 and 272 bytes (test above)
    monkeypatch.setattr(profiler, "bytes_left", lambda device: layer0 - 1)
    with pytest.raises(InputError) as caught:
        fast_profile(path, microbatch_size=3)
    assert caught.value.line().endswith(
        f"build_layer(0): the first 1 of 2 layers hold 0.00 GB, and 0.00 GB is left on cpu: the rest of the model, its "
        f"gradients and activations cannot fit ({SHRINK_FIX})")
    # room for each layer but not for both layers' gradients
    monkeypatch.setattr(profiler, "bytes_left", lambda device: layer0 + layer1 - 1)
    with pytest.raises(InputError, match=r"build_layer\(1\): the first 2 of 2 layers hold 0\.00 GB, .*: its gradients "
                                         r"and activations cannot fit"):
        fast_profile(path, microbatch_size=3)
    monkeypatch.setattr(profiler, "bytes_left", lambda device: layer0 + layer1)
    assert fast_profile(path, microbatch_size=3).layers[0].param_bytes == layer0
    # a 4 MB table every layer holds as a buffer: once, and without a gradient (32 layers of it
    # were refused as 32 GB against the 23 left, a model of 1.3 GB)
    shared = write_model(tmp_path, """
        import torch
        from torch import nn

        TABLE = torch.ones(1 << 20)

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(4, 4)
                self.register_buffer("table", TABLE, persistent=False)

            def forward(self, x):
                return self.linear(x) + self.table[:4]

        def num_layers():
            return 8

        def build_layer(index):
            return Layer()

        def sample_batch(microbatch_size, generator):
            return torch.randn(microbatch_size, 4, generator=generator), torch.randn(microbatch_size, 4, generator=generator)

        def loss_fn(outputs, targets):
            return torch.nn.functional.mse_loss(outputs, targets)
    """, name="shared.py")
    linear = (4 * 4 + 4) * 4
    monkeypatch.setattr(profiler, "bytes_left", lambda device: (1 << 22) + 8 * linear)
    assert len(fast_profile(shared, microbatch_size=2).layers) == 8


def test_a_layer_is_built_under_a_memory_cap(monkeypatch, tmp_path):
    """Inside the cap an allocation beyond what is left fails (and says so) instead of waking the
    OOM killer, while a file far larger than it maps (a model reading its weights through
    np.memmap: RLIMIT_DATA counts private writable memory only); after it the process's limit
    is as it was, and a failed mmap counts as running out of memory."""
    import errno
    import resource

    import numpy as np

    from octoplan import headroom

    before = resource.getrlimit(resource.RLIMIT_DATA)
    big = tmp_path / "weights.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of file, no disk
    monkeypatch.setattr(headroom, "bytes_left", lambda device: 64 << 20)
    with headroom.memory_capped(torch.device("cpu")):
        with pytest.raises(RuntimeError, match="can't allocate memory"):
            torch.empty(1 << 30, dtype=torch.uint8)  # 1 GiB, never touched
        assert float(np.memmap(big, dtype=np.float32, mode="r")[-1]) == 0.0
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert torch.empty(1 << 30, dtype=torch.uint8).numel() == 1 << 30
    assert headroom.out_of_memory(OSError(errno.ENOMEM, "Cannot allocate memory"))
    assert not headroom.out_of_memory(OSError(errno.ENOENT, "No such file"))


def test_running_out_of_memory_in_model_code_names_the_size_not_the_code(tmp_path):
    """A GPU's OutOfMemoryError in build_layer is the size's fault: the line says to profile a
    shrunken copy, not "fix build_layer"."""
    from octoplan.headroom import SHRINK_FIX

    path = write_model(tmp_path, TWO_LINEAR.replace("def build_layer(index, hidden, middle):",
                                                    "def build_layer(index, hidden, middle):\n"
                                                    "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 9.00 GiB')"))
    with pytest.raises(InputError) as caught:
        fast_profile(path, microbatch_size=3)
    assert "build_layer(0): raised: OutOfMemoryError: CUDA out of memory. Tried to allocate 9.00 GiB" in caught.value.line()
    assert caught.value.line().endswith(f"({SHRINK_FIX})")
