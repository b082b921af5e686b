"""Profiles measured at a training precision (``octoplan profile --precision fp32|bf16``) and the
memory model's static bytes for them.

Under bf16 every layer's forward runs in ``octoplan.precision.autocast``, as octorun runs it: a
matrix product saves its inputs cast to bfloat16 (and the bfloat16 copy of its weight, a new
tensor each microbatch) and outputs bfloat16; parameters stay fp32. The activation bytes a bf16
profile measures are, byte for byte, what octorun's tapes hold under the same autocast."""

from __future__ import annotations

import subprocess

import pytest
import torch
import yaml
from typer.testing import CliRunner

from octoplan.cli import app
from octoplan.costs import LayerTable
from octoplan.memory import static_bytes
from octoplan.modelfile import load_model_file
from octoplan.precision import autocast
from octoplan.profile import Layer, ModelRef, Profile, load_profile, profile_from_dict, profile_to_dict
from octoplan.profiler import profile_model_file
from octoplan.simulator import simulate
from octorun.activations import ActivationMeter
from octorun.stage import StageExecutor

from conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_GPT = str(REPO / "examples" / "models" / "tiny_gpt.py")
# 4 x 32 = 128 tokens of width 16: the blocks' activations outweigh their weights' bf16 copies
TINY = ["vocab=64", "hidden=16", "layers=1", "heads=2", "seq=32", "data_vocab=32"]
TINY_CONFIG = {"vocab": 64, "hidden": 16, "layers": 1, "heads": 2, "seq": 32, "data_vocab": 32}


def _cli_profile(tmp_path, precision: str | None, *extra: str) -> tuple[dict, str]:
    out = tmp_path / f"gpt-{precision}.yaml"
    args = ["profile", TINY_GPT, "--repeat", "1", "--device", "cpu", "--microbatch-size", "4", "-o", str(out)]
    for item in TINY:
        args += ["--config", item]
    if precision is not None:
        args += ["--precision", precision]
    done = CliRunner().invoke(app, [*args, *extra], terminal_width=200)
    assert done.exit_code == 0, done.output
    return yaml.safe_load(out.read_text()), done.output


def test_a_bf16_profile_of_tiny_gpt_records_its_precision_and_its_blocks_keep_less(tmp_path):
    fp32, _ = _cli_profile(tmp_path, None)
    bf16, printed = _cli_profile(tmp_path, "bf16", "--check-whole")
    assert (fp32["dtype"], "precision" in fp32) == ("float32", False)  # fp32 profiles as before
    assert (bf16["dtype"], bf16["precision"]) == ("bfloat16", "bf16")
    assert "whole model" in printed  # --check-whole timed the whole model under autocast too
    assert load_profile(tmp_path / "gpt-bf16.yaml").precision == "bf16"
    by_name = {name: {layer["name"]: layer for layer in data["layers"]} for name, data in (("fp32", fp32), ("bf16", bf16))}
    tokens, hidden, vocab = 4 * 32, 16, 64
    for name in by_name["fp32"]:
        low, full = by_name["bf16"][name], by_name["fp32"][name]
        assert low["param_bytes"] == full["param_bytes"]  # fp32 master weights either way
    block_low, block_full = by_name["bf16"]["block.0"], by_name["fp32"]["block.0"]
    assert block_low["activation_bytes"] < block_full["activation_bytes"]
    # the residual stream stays fp32 (x + a bf16 branch is fp32); the head ends in a matrix
    # product, whose bf16 logits it outputs
    assert block_low["output_bytes"] == block_full["output_bytes"] == tokens * hidden * 4
    assert (by_name["fp32"]["head"]["output_bytes"], by_name["bf16"]["head"]["output_bytes"]) == (
        tokens * vocab * 4, tokens * vocab * 2)


MLP = '''
import torch
from torch import nn

H = 8

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, 4 * H)
        self.down = nn.Linear(4 * H, H)
    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))

def num_layers():
    return 3

def build_layer(index):
    return Mlp() if index < 2 else nn.Linear(H, 2)

def sample_batch(mbs, generator):
    return torch.randn(mbs, 4, H, generator=generator), torch.randn(mbs, 4, 2, generator=generator)

def loss_fn(outputs, targets):
    return nn.functional.mse_loss(outputs, targets)
'''


def test_an_mlp_keeps_what_autocast_saves_by_hand(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    kwargs = dict(microbatch_size=2, repeat=1, warmup=0, device="cpu")
    fp32 = profile_model_file(str(path), **kwargs)
    bf16 = profile_model_file(str(path), precision="bf16", **kwargs)
    T, H = 2 * 4, 8  # tokens, width
    # fp32: up saves its input (T x H), gelu the up output (T x 4H), down the gelu output (T x 4H),
    # 4 bytes each; layer 1's input is that saved input.
    assert [layer.activation_bytes for layer in fp32.layers[:2]] == [36 * T * H, 36 * T * H]
    # bf16: up saves its input cast to bf16 (2 T H) and, where its input needs a gradient, its
    # weight's bf16 copy (4H x H x 2); gelu its bf16 input (8 T H); down the bf16 gelu output
    # (8 T H) and its weight's copy (H x 4H x 2). Layer 0's fp32 input is data: no tape keeps it
    # and up needs no weight for an input gradient. Layer 1's input is layer 0's bf16 output,
    # which up uses as it is: it counts once.
    assert [layer.activation_bytes for layer in bf16.layers[:2]] == [18 * T * H + 8 * H * H, 18 * T * H + 16 * H * H]
    assert [layer.output_bytes for layer in fp32.layers] == [T * H * 4, T * H * 4, T * 2 * 4]
    assert [layer.output_bytes for layer in bf16.layers] == [T * H * 2, T * H * 2, T * 2 * 2]
    assert [layer.param_bytes for layer in bf16.layers] == [layer.param_bytes for layer in fp32.layers]
    assert (bf16.dtype, bf16.precision, fp32.dtype, fp32.precision) == ("bfloat16", "bf16", "float32", "fp32")


@pytest.mark.parametrize("start,end", [(0, 3), (1, 3), (1, 2), (2, 3)])
def test_octoruns_tapes_hold_what_the_bf16_profile_measured(start, end):
    """The figures the memory model takes from a bf16 profile, against octorun's stage executor
    with its activation meter, both under bf16 autocast: after F, the most above that during I,
    after I, and nothing after W."""
    profile = profile_model_file(TINY_GPT, config=TINY_CONFIG, microbatch_size=2, repeat=1, warmup=0, device="cpu",
                                 precision="bf16")
    cost = LayerTable(profile).stage(start, end)
    model = load_model_file(TINY_GPT, TINY_CONFIG)
    layers = [model.build_layer(i) for i in range(model.num_layers())]
    value, targets = model.sample_batch(2, step=0, replica=0, mb=0)
    with torch.no_grad():
        for layer in layers[:start]:  # the stage's input as the stages before make it
            with autocast("cpu", "bf16"):
                value = layer(value)
    stage = layers[start:end]
    meter = ActivationMeter([t for layer in stage for t in (*layer.parameters(), *layer.buffers())])
    last = end == len(layers)
    executor = StageExecutor(stage, first=start == 0, last=last, loss_fn=model.loss, loss_scale=1.0, meter=meter,
                             precision="bf16")
    output, tape = executor.forward(value, targets)
    grad = None if last else (torch.ones_like(output),)
    del output
    after_f = meter.current
    meter.reset()
    executor.backward_input(tape, grad)
    during_i, after_i = meter.peak - after_f, meter.current
    executor.backward_weight(tape)
    assert (after_f, during_i, after_i, meter.current) == (
        cost.activation_bytes, cost.i_peak_bytes, cost.activation_bytes + cost.i_delta_bytes, 0)


# ----------------------------------------------------------------------------- the profile file


def _two_layers(**fields) -> Profile:
    return Profile(model=ModelRef("t"), layers=(
        Layer("a", "layer", 1.0, 1.0, 1.0, 4_000_000, 100, 10),
        Layer("b", "head", 1.0, 1.0, 1.0, 0, 100, 10)), **fields)


def test_precision_is_written_only_when_not_fp32_and_older_profiles_read_as_fp32():
    data = profile_to_dict(_two_layers())
    assert "precision" not in data and "tied" not in data
    assert profile_from_dict(data).precision == "fp32"
    bf16 = _two_layers(dtype="bfloat16", precision="bf16")
    assert profile_to_dict(bf16)["precision"] == "bf16"
    assert profile_from_dict(profile_to_dict(bf16)) == bf16
    # the tracked ones: `make demo` writes profiles/hybrid.yaml (bf16, git-ignored) beside them
    listed = subprocess.run(["git", "ls-files", "profiles"], cwd=REPO, capture_output=True, text=True, check=True)
    shipped = sorted(REPO / name for name in listed.stdout.split() if name.endswith(".yaml"))
    assert shipped, "the repository ships profiles"
    for path in shipped:  # written before these fields: they load unchanged
        loaded = load_profile(path)
        assert (loaded.precision, loaded.tied) == ("fp32", ())


def test_an_unknown_precision_is_refused():
    from octoplan.errors import InputError

    data = {**profile_to_dict(_two_layers()), "precision": "fp8"}
    with pytest.raises(InputError, match="precision: is 'fp8'"):
        profile_from_dict(data, file="p.yaml")
    done = CliRunner().invoke(app, ["profile", TINY_GPT, "--precision", "fp16", "-o", "/nonexistent/x.yaml"])
    assert done.exit_code == 2 and "--precision" in done.stderr and done.stderr.count("\n") == 1, done.output
    done = CliRunner().invoke(app, ["profile", "--arch", "llama3-8b", "--precision", "bf16"])
    assert done.exit_code == 2 and "--precision" in done.stderr and "--arch" in done.stderr, done.output


# ----------------------------------------------------------------------------- static memory


def test_static_bytes_by_hand():
    # 1 M parameters. fp32 (4 bytes each): weights 4 MB + grads 4 MB + Adam's two moments 8 MB.
    assert static_bytes(4_000_000, dtype_bytes=4) == 16_000_000
    assert static_bytes(4_000_000, dtype_bytes=4, optimizer="sgd") == 8_000_000
    # 2 M parameters in 4 MB of bf16 (an analytic profile): bf16 weights and grads 8 MB, fp32
    # master 8 MB, moments 16 MB
    assert static_bytes(4_000_000, dtype_bytes=2) == 32_000_000
    assert static_bytes(4_000_000, dtype_bytes=2, optimizer="sgd") == 16_000_000


def test_a_bf16_profile_keeps_fp32_masters_and_does_not_halve_the_static_bytes():
    from octoplan.ops import parse_ops
    from octoplan.plan import Cluster, Parallel, Plan, Stage

    plan = Plan(model=ModelRef("t"), cluster=Cluster(gpus=1), parallel=Parallel(pp=1, microbatches=1),
                stages=(Stage(0, 2, 0),), schedule=(tuple(parse_ops("0F0 0B0")),))
    fp32 = _two_layers()
    bf16 = _two_layers(dtype="bfloat16", precision="bf16")
    analytic = _two_layers(dtype="bfloat16")  # param_bytes in bf16, as octoplan.arch writes them
    assert (fp32.param_dtype_bytes, bf16.param_dtype_bytes, analytic.param_dtype_bytes) == (4, 4, 2)
    # 4 MB of fp32 parameters: 1 M of them, 16 bytes each (fp32 weight, gradient, m and v)
    assert simulate(plan, bf16).static_memory_bytes == simulate(plan, fp32).static_memory_bytes == (16_000_000,)
    assert simulate(plan, bf16, optimizer="sgd").static_memory_bytes == (8_000_000,)
    assert simulate(plan, analytic).static_memory_bytes == (32_000_000,)


def test_the_profile_command_says_at_which_precision_it_measured(tmp_path):
    _, printed = _cli_profile(tmp_path, "bf16")
    assert "measured at bf16: forwards under autocast, parameters fp32" in printed
    _, printed = _cli_profile(tmp_path, "fp32")
    assert "measured at" not in printed
