"""The profiler's in-sequence timing (octoplan/profiler.py): layers timed as they run in a whole
forward and backward, round-robin repeats, each layer's spread, the whole model timed in the
same run, the isolated times kept as a cross-check, and the profile fields that record them."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from octoplan.cli import app
from octoplan.errors import InputError
from octoplan.profile import load_profile, profile_from_dict, profile_to_dict, save_profile
from octoplan.profiler import SPREAD_WARNING, profile_model_file, relative_spread

from conftest import assert_layers_round_trip, remeasured

pytestmark = pytest.mark.usefixtures("one_thread")

# Layers that burn a fixed amount of the thread's CPU time in their forward and on each backward
# branch, and log what runs: ("F", layer) for a forward, ("I", layer) for the input branch of a
# backward and ("W", layer) for the weight branch. Layer 0 gets data that needs no gradient, so
# its input branch never runs. The profiler's default clock is the thread's CPU time, which other
# processes do not advance: what it must recover is known under any load.
SPIN = """
import time
import torch
from torch import nn

# (forward, input-gradient, weight-gradient) ms of CPU time per layer
COSTS = [(2.0, 0.0, 1.0), (1.0, 2.5, 0.5), (3.0, 1.0, 2.0), (0.5, 1.5, 3.0)]
CONFIG = {"alternate": -1}
LOG = []

def _spin(ms):
    end = time.thread_time_ns() + int(ms * 1e6)
    while time.thread_time_ns() < end:
        pass

class _SpinOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, ms, event):
        ctx.ms, ctx.event = ms, event
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        LOG.append(ctx.event)
        _spin(ctx.ms)
        return grad, None, None

class SpinLayer(nn.Module):
    def __init__(self, index, forward_ms, input_ms, weight_ms, alternate):
        super().__init__()
        self.index, self.costs = index, (forward_ms, input_ms, weight_ms)
        self.alternate, self.calls = alternate, 0
        self.weight = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        forward_ms, input_ms, weight_ms = self.costs
        LOG.append(("F", self.index))
        self.calls += 1
        # the alternating layer: 3x its forward on every other call, a layer whose time moves
        _spin(forward_ms * (3 if self.index == self.alternate and self.calls % 2 else 1))
        return (_SpinOnBackward.apply(x, input_ms, ("I", self.index))
                + _SpinOnBackward.apply(self.weight, weight_ms, ("W", self.index)))

def num_layers(alternate):
    return len(COSTS)

def layer_name(index, alternate):
    return f"spin.{index}"

def build_layer(index, alternate):
    return SpinLayer(index, *COSTS[index], alternate)

def sample_batch(microbatch_size, generator, alternate):
    return torch.randn(microbatch_size, 8, generator=generator), torch.randn(microbatch_size, 8, generator=generator)

def loss_fn(outputs, targets):
    return torch.nn.functional.mse_loss(outputs, targets)
"""
SPIN_COSTS = [(2.0, 0.0, 1.0), (1.0, 2.5, 0.5), (3.0, 1.0, 2.0), (0.5, 1.5, 3.0)]


def write_model(tmp_path: Path, text: str = SPIN, name: str = "spin.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _close(measured: float, built: float) -> bool:
    # every timed stretch spins at least its built time on the same clock; autograd, Python and
    # the marks add 0.05-0.2 ms, while a layer's work put in its neighbour's stretch is 0.5 ms or more
    return built <= measured <= built + 0.3 + 0.05 * built


# ----------------------------------------------------------------------------- known costs


def test_in_sequence_times_recover_the_built_costs_and_the_isolated_ones_are_kept(tmp_path):
    path = write_model(tmp_path)

    def measure():
        profile = profile_model_file(path, microbatch_size=4, repeat=5, warmup=1, device="cpu")
        for index, (layer, (f_ms, i_ms, w_ms)) in enumerate(zip(profile.layers, SPIN_COSTS)):
            # no stall makes a spin shorter: these bounds hold in every attempt
            got = (layer.forward_ms, layer.backward_input_ms, layer.backward_weight_ms, layer.backward_ms)
            assert all(g >= w for g, w in zip(got, (f_ms, i_ms, w_ms, i_ms + w_ms))), f"layer {index}: {got}"
            alone = layer.isolated
            assert alone.forward_ms >= f_ms and alone.backward_ms >= i_ms + w_ms, f"layer {index} alone: {alone}"
        # layer 0's input is data: no I, and W and B are one pass with one figure
        assert profile.layers[0].backward_input_ms == 0.0
        assert profile.layers[0].backward_ms == profile.layers[0].backward_weight_ms
        return profile

    def misses(profile):
        found = []
        for index, (layer, (f_ms, i_ms, w_ms)) in enumerate(zip(profile.layers, SPIN_COSTS)):
            got = (layer.forward_ms, layer.backward_input_ms, layer.backward_weight_ms, layer.backward_ms)
            if not all(_close(g, w) for g, w in zip(got, (f_ms, i_ms, w_ms, i_ms + w_ms))):
                found.append(f"layer {index}: F, I, W, B in sequence {got}, built {(f_ms, i_ms, w_ms, i_ms + w_ms)}")
            alone = (layer.isolated.forward_ms, layer.isolated.backward_ms)
            if not (_close(alone[0], f_ms) and alone[1] <= i_ms + w_ms + 0.6 + 0.05 * (i_ms + w_ms)):
                found.append(f"layer {index}: F, B alone {alone}")
        check = profile.whole_model
        built = sum(f + i + w for f, i, w in SPIN_COSTS)
        # the whole model spins what the layers do, and the layers' marks add next to nothing
        if not (built <= check.ms <= built + 1.0 + 0.05 * built and abs(check.ratio - 1) <= 0.05):
            found.append(f"whole model {check}")
        return found

    missed = remeasured(measure, misses)
    assert not missed, missed


def test_the_sum_of_the_layers_is_the_sum_the_profile_reports(tmp_path):
    profile = profile_model_file(write_model(tmp_path), microbatch_size=2, repeat=2, warmup=0, device="cpu")
    check = profile.whole_model
    assert check.layers_sum_ms == pytest.approx(sum(layer.forward_ms + layer.b_ms for layer in profile.layers))
    assert check.isolated_sum_ms == pytest.approx(sum(layer.isolated.forward_ms + layer.isolated.backward_ms
                                                      for layer in profile.layers))
    assert check.ratio == pytest.approx(check.layers_sum_ms / check.ms)
    # the pass the layers' times come from, start to end: the sum of its marks, so near the
    # layers' sum (the least sum against a sum of least times)
    assert check.in_sequence_ms == pytest.approx(check.layers_sum_ms, rel=0.1)
    assert profile.extra["profiler"]["layer_times"] == "in-sequence"


# ----------------------------------------------------------------------------- round-robin order


def _spin_log(path: str) -> list:
    """The model file's LOG, as the profiler's import of it left it."""
    import sys

    module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == path)
    return module.LOG


def _round(n: int) -> list:
    """What one in-sequence round runs, in order, for an n-layer spin model: F then B (each
    layer's two branches, last layer first), F then I (last first) then W (first to last), and
    the whole model's F and backward. Layer 0's input branch never runs (its input is data)."""
    forward = [("F", i) for i in range(n)]
    fused = [{("I", i), ("W", i)} - {("I", 0)} for i in reversed(range(n))]
    split = [{("I", i)} for i in reversed(range(1, n))] + [{("W", i)} for i in range(n)]
    return [*forward, *fused, *forward, *split, *forward, *fused]


def _grouped(log: list) -> list:
    """Consecutive backward events of one layer as a set (autograd orders a layer's two branches)."""
    out: list = []
    for event in log:
        kind, layer = event
        if kind != "F" and out and isinstance(out[-1], set) and next(iter(out[-1]))[1] == layer and event not in out[-1]:
            out[-1].add(event)
        else:
            out.append({event} if kind != "F" else event)
    return out


def test_repeats_run_round_robin_over_the_layers(tmp_path):
    # round r of every layer (and of the whole model) before round r + 1 of any: a drift in the
    # machine's speed then moves every layer alike
    path = write_model(tmp_path)
    repeat, warmup, n = 3, 2, len(SPIN_COSTS)
    profile_model_file(path, microbatch_size=2, repeat=repeat, warmup=warmup, device="cpu")
    log = _grouped(_spin_log(path))
    one = _round(n)
    rounds = warmup + repeat
    assert log[-rounds * len(one):] == one * rounds
    # and before them, the cross-check: each layer alone, all its calls before the next layer's
    alone = [event for event in log[: -rounds * len(one)] if isinstance(event, tuple)]
    assert [layer for _, layer in alone] == sorted(layer for _, layer in alone)


def test_a_layer_failing_in_sequence_is_named(tmp_path):
    # layer 1 passes its (at most 6) calls alone, then raises: the error names it and the pass it failed in
    text = SPIN.replace("        LOG.append((\"F\", self.index))", "        LOG.append((\"F\", self.index))\n"
                        "        if self.index == 1 and self.calls >= 6:\n            raise ValueError('worn out')")
    assert "worn out" in text
    path = write_model(tmp_path, text, name="worn.py")
    with pytest.raises(InputError) as err:
        profile_model_file(path, microbatch_size=2, repeat=2, warmup=0, device="cpu")
    assert err.value.file == path and err.value.field == "layer 1 (spin.1)"
    assert "failed when run in sequence: ValueError: worn out" in err.value.line()


PASSED_ON = """
import torch
from torch import nn

CONFIG = {}

def num_layers():
    return 3

class Embed(nn.Module):  # hands its integer input on beside the hidden state; the embedding keeps it for its backward
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(11, 4)
    def forward(self, ids):
        return self.tok(ids), ids

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
    def forward(self, h, ids):
        ids += 0  # the bug: the embedding's saved input changes
        return self.lin(h), ids

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(4, 11)
    def forward(self, h, ids):
        return self.out(h)

def build_layer(index):
    return [Embed, Block, Head][index]()

def sample_batch(microbatch_size, generator):
    ids = torch.randint(0, 11, (microbatch_size, 6), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
"""


# the same with a layer between that only hands the ids on: the holder is still the embedding
PASSED_THROUGH = PASSED_ON.replace("return 3", "return 4").replace("[Embed, Block, Head]", "[Embed, Pass, Block, Head]").replace(
    "class Head(", "class Pass(nn.Module):\n    def forward(self, h, ids):\n        return h * 1.0, ids\n\nclass Head(")


@pytest.mark.parametrize("text, culprit", [(PASSED_ON, "layer 1 (Block)"), (PASSED_THROUGH, "layer 2 (Block)")])
def test_a_layer_that_changes_an_integer_input_in_place_is_blamed_not_the_one_before(tmp_path, text, culprit):
    """Block adds to the token ids it is handed in place; the embedding, which holds them for
    its backward, is where autograd notices. The error names Block, the embedding as the
    holder, and the rule."""
    assert text.count("class Pass") == (culprit == "layer 2 (Block)")
    path = write_model(tmp_path, text, name="passed_on.py")
    with pytest.raises(InputError) as err:
        profile_model_file(path, microbatch_size=2, repeat=2, warmup=0, device="cpu")
    assert err.value.field == culprit, err.value.line()
    assert "changes its input in place, which layer 0 holds for its backward" in err.value.line()
    assert "a forward must not change its inputs in place" in err.value.line()


# ----------------------------------------------------------------------------- spread


def test_relative_spread_is_the_p10_to_p90_range_over_the_median():
    assert relative_spread([1.0] * 10) == 0.0
    assert relative_spread([1.0, 3.0] * 5) == pytest.approx((3.0 - 1.0) / 2.0)
    # one stall in ten moves p90 by a tenth of its excess: a steady layer stays steady
    assert relative_spread([1.0] * 9 + [11.0]) == pytest.approx(1.0)  # p90 = 1 + 0.1 * 10
    assert relative_spread(list(range(1, 12))) == pytest.approx((10.0 - 2.0) / 6.0)
    assert relative_spread([2.0]) == 0.0 and relative_spread([0.0, 0.0]) == 0.0


def test_a_layer_whose_time_alternates_is_flagged_and_steady_ones_are_not(tmp_path):
    # layer 2's forward spins 9 ms and 3 ms by turns: each round calls it three times (two
    # in-sequence passes and the whole model), so its first pass alternates from round to round
    path = write_model(tmp_path)
    out = tmp_path / "spin.yaml"

    def measure():
        done = CliRunner().invoke(app, ["profile", path, "--config", "alternate=2", "--repeat", "6", "--device", "cpu",
                                        "-o", str(out)], terminal_width=200)
        assert done.exit_code == 0, done.output
        profile = load_profile(out)
        # F + B is 12 ms and 6 ms by turns: (p90 - p10) / median = 6 / 9
        assert profile.layers[2].spread > 0.5
        warnings = [line for line in done.output.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and "spin.2" in warnings[0], done.output
        return profile, warnings[0]

    def misses(result):
        profile, warning = result
        steady = [layer for i, layer in enumerate(profile.layers) if i != 2]
        return [f"{layer.name} spread {layer.spread:.2f}: {warning}" for layer in steady
                if layer.spread > SPREAD_WARNING or layer.name in warning]

    missed = remeasured(measure, misses)
    assert not missed, missed


# ----------------------------------------------------------------------------- profile fields


def test_the_new_fields_are_written_and_round_trip(tmp_path):
    profile = profile_model_file(write_model(tmp_path), microbatch_size=2, repeat=2, warmup=0, device="cpu")
    out = tmp_path / "p.yaml"
    save_profile(profile, out)
    data = yaml.safe_load(out.read_text())
    assert set(data["whole_model"]) == {"ms", "layers_sum_ms", "in_sequence_ms", "isolated_sum_ms", "ratio"}
    for entry in data["layers"]:
        assert entry["spread"] >= 0
        assert set(entry["isolated"]) == {"forward_ms", "backward_input_ms", "backward_weight_ms", "backward_ms"}
    loaded = load_profile(out)
    assert profile_to_dict(loaded) == profile_to_dict(profile)
    assert_layers_round_trip(loaded, profile)
    assert loaded.whole_model.ms == pytest.approx(profile.whole_model.ms, abs=1e-6)
    assert [layer.isolated for layer in loaded.layers] == [layer.isolated for layer in load_profile(out).layers]


def test_a_profile_without_the_new_fields_loads_as_before(tmp_path):
    data = {"format": "octoplan-profile/1", "model": {"name": "old"},
            "layers": [{"name": "a", "forward_ms": 1, "backward_input_ms": 1, "backward_weight_ms": 1,
                        "param_bytes": 0, "activation_bytes": 0, "output_bytes": 0}]}
    profile = profile_from_dict(data, file="old.yaml")
    assert profile.whole_model is None and profile.layers[0].spread is None and profile.layers[0].isolated is None
    written = profile_to_dict(profile)
    assert "whole_model" not in written and not {"spread", "isolated"} & set(written["layers"][0])


def _measured_dict() -> dict:
    layer = {"name": "a", "forward_ms": 1.0, "backward_input_ms": 1.0, "backward_weight_ms": 1.0, "backward_ms": 1.8,
             "param_bytes": 0, "activation_bytes": 0, "output_bytes": 0, "spread": 0.04,
             "isolated": {"forward_ms": 0.9, "backward_input_ms": 1.1, "backward_weight_ms": 0.9, "backward_ms": 1.7}}
    return {"format": "octoplan-profile/1", "model": {"name": "m"}, "layers": [layer],
            "whole_model": {"ms": 2.7, "layers_sum_ms": 2.8, "in_sequence_ms": 2.75, "isolated_sum_ms": 2.6, "ratio": 1.037}}


BAD = [
    (lambda d: d["layers"][0].update(spread=-0.1), "layers[0].spread", "must be >= 0"),
    (lambda d: d["layers"][0].update(spread="wide"), "layers[0].spread", "must be a number"),
    (lambda d: d["layers"][0].update(spred=0.1), "layers[0].spred", "did you mean spread?"),
    (lambda d: d["layers"][0].update(isolated=[1, 2]), "layers[0].isolated", "must be a mapping"),
    (lambda d: d["layers"][0]["isolated"].pop("forward_ms"), "layers[0].isolated.forward_ms", "is missing"),
    (lambda d: d["layers"][0]["isolated"].update(forward_ms=-1), "layers[0].isolated.forward_ms", "must be >= 0"),
    (lambda d: d["layers"][0]["isolated"].update(forwrd_ms=1), "layers[0].isolated.forwrd_ms", "did you mean forward_ms?"),
    (lambda d: d.update(whole_model=3), "whole_model", "must be a mapping"),
    (lambda d: d.update(whole_modle=d.pop("whole_model")), "whole_modle", "did you mean whole_model?"),
    (lambda d: d["whole_model"].update(ms=0), "whole_model.ms", "must be > 0"),
    (lambda d: d["whole_model"].pop("layers_sum_ms"), "whole_model.layers_sum_ms", "is missing"),
    (lambda d: d["whole_model"].update(ratio=2.0), "whole_model.ratio", "but layers_sum_ms / ms is 1.0370"),
    (lambda d: d["whole_model"].update(mean_ms=2.0), "whole_model.mean_ms", "is not a field here"),
    (lambda d: d["whole_model"].update(isolated_sum_ms=float("nan")), "whole_model.isolated_sum_ms", "finite"),
    (lambda d: d["whole_model"].update(in_sequence_ms="fast"), "whole_model.in_sequence_ms", "must be a number"),
]


def test_the_measured_example_is_good():
    profile = profile_from_dict(_measured_dict(), file="p.yaml")
    assert profile.layers[0].spread == 0.04 and profile.layers[0].isolated.backward_ms == 1.7
    assert profile.whole_model.ratio == pytest.approx(2.8 / 2.7)


@pytest.mark.parametrize("mutate,field,problem", BAD)
def test_bad_new_fields_name_the_file_and_field(tmp_path, mutate, field, problem):
    data = _measured_dict()
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(InputError) as err:
        load_profile(path)
    assert err.value.file == str(path) and err.value.field == field
    assert problem in err.value.line()


def test_a_bad_new_field_is_one_line_and_exit_2(tmp_path):
    data = _measured_dict()
    data["layers"][0]["spread"] = -1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    done = CliRunner().invoke(app, ["baseline", str(path), "--gpus", "1", "--schedule", "1f1b", "-o", str(tmp_path / "p.yaml")])
    assert done.exit_code == 2, done.output
    assert done.output.count("\n") == 1 and str(path) in done.output and "layers[0].spread" in done.output


# ----------------------------------------------------------------------------- the command


def test_every_profile_prints_the_whole_model_line(tmp_path):
    path = write_model(tmp_path)
    out = tmp_path / "p.yaml"
    done = CliRunner().invoke(app, ["profile", path, "--repeat", "2", "--device", "cpu", "-o", str(out)], terminal_width=200)
    assert done.exit_code == 0, done.output
    line = next(line for line in done.output.splitlines() if line.startswith("whole model"))
    check = load_profile(out).whole_model
    assert re.search(rf"{check.ms:.3f} ms; sum of the layers' F \+ B: {check.layers_sum_ms:.3f} ms \(ratio {check.ratio:.3f}\)", line)
    assert "spread" in done.output  # the table's column


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
def test_cuda_in_sequence_times_come_from_events(tmp_path):
    profile = profile_model_file(write_model(tmp_path), microbatch_size=2, repeat=3, warmup=1, device="cuda")
    assert profile.extra["profiler"]["clock"] == "cuda-events"
    # the spin layers' CPU work is what the GPU stream waits on between its events
    for layer, (f_ms, i_ms, w_ms) in zip(profile.layers, SPIN_COSTS):
        assert layer.forward_ms >= 0.9 * f_ms and layer.backward_ms >= 0.9 * (i_ms + w_ms)
    assert 0.8 <= profile.whole_model.ratio <= 1.25


def test_a_layers_time_is_its_least_repeat_as_noise_only_adds():
    from octoplan.sequence_timing import SequenceSamples, in_sequence_times

    # two layers: the first has no floating inputs (data), so its W and B are one figure, the
    # least of both passes' samples; the second's F, I, W and B each their least repeat
    samples = SequenceSamples(
        forward=[[2.0, 1.5, 3.0, 1.6], [4.0, 4.4, 3.9, 5.0]], fused=[[6.0, 5.0], [7.0, 6.5]],
        input=[[9.0, 9.0], [3.0, 2.5]], weight=[[5.5, 4.5], [4.0, 4.1]], f_plus_b=[[], []],
        passes=[], whole=[], has_inputs=[False, True], has_params=[True, True], has_roots=[True, True])
    first, second = in_sequence_times(samples, 0), in_sequence_times(samples, 1)
    assert (first.forward_ms, first.backward_input_ms, first.backward_weight_ms, first.backward_ms) == (1.5, 0.0, 4.5, 4.5)
    assert (second.forward_ms, second.backward_input_ms, second.backward_weight_ms, second.backward_ms) == (3.9, 2.5, 4.0, 6.5)
