"""Tied parameters in the planner: the model file declares them (``tied_parameters``), the
profiler checks and records them, and the simulator prices what octorun does with them — one
copy per rank that holds a member (once on a rank holding several), and after the step's ops and
data-parallel all-reduces, a blocking all-reduce of the copies' gradient among the ranks of each
replica that hold one. Timelines are computed by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from octoplan.costs import tied_allreduce_ms
from octoplan.errors import InputError
from octoplan.memory import static_bytes
from octoplan.modelfile import load_model_file
from octoplan.plan import Cluster, Parallel
from octoplan.profile import Layer, ModelRef, Profile, TiedParameter, load_profile, profile_from_dict, profile_to_dict, save_profile
from octoplan.profiler import profile_model_file
from octoplan.simulator import simulate

from conftest import hand_plan

# 1 ms latency, 1 GB/s inside a node, 0.5 GB/s between nodes
SLOW_LINK = dict(gpus_per_node=8, intra_node_gbps=1.0, inter_node_gbps=0.5, latency_us=1000.0)
MB4 = 4_000_000


def _profile(*, tied: bool = True, params=(MB4, MB4)) -> Profile:
    # layer 0: F 2, I 1, W 1, sends 2 MB; layer 1: F 1, I 2, W 2. Both hold a 4 MB tied matrix.
    group = (TiedParameter(((0, "embed.weight"), (1, "proj.weight")), MB4),) if tied else ()
    return Profile(model=ModelRef("t"), layers=(
        Layer("a", "layer", 2.0, 1.0, 1.0, params[0], 100, 2_000_000),
        Layer("b", "head", 1.0, 2.0, 2.0, params[1], 1000, 8),
    ), tied=group)


GPIPE = ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]


# ----------------------------------------------------------------------------- the timeline


def test_a_tie_across_two_ranks_adds_its_all_reduce_after_the_last_rank_is_done():
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], GPIPE, cluster=Cluster(gpus=2, **SLOW_LINK), microbatches=2)
    untied = simulate(plan, _profile(tied=False))
    tied = simulate(plan, _profile())
    # The ops are those of tests/test_simulator.py's GPipe case: rank 0 ends at 22, rank 1 at 17.
    assert untied.iteration_ms == 22 and untied.tied_allreduces == ()
    # The sum of the two copies starts when the later rank is done (22) and takes a 2-rank ring
    # inside the node: 2(k-1) latencies + 2(k-1)/k x 4 MB / 1 GB/s = 2 + 4 = 6 ms.
    assert [(ar.group, ar.ranks, ar.start_ms, ar.end_ms) for ar in tied.tied_allreduces] == [(0, (0, 1), 22, 28)]
    assert tied.iteration_ms == 28
    assert tied.op_times() == untied.op_times()
    # both ranks wait for it after their last op: rank 0 6 ms, rank 1 11 ms
    assert [tied.idle_parts(r)[2] for r in range(2)] == [6, 11]
    assert tied.prediction()["iteration_ms"] == 28 and tied.prediction()["tied_allreduce_ms"] == [6]
    assert tied.summary()["tied_allreduce_ms"] == [6]
    assert "tied_allreduce_ms" not in untied.prediction() and "tied_allreduce_ms" not in untied.summary()
    # each rank holds its own copy: static memory as without the tie (fp32: 16 bytes per parameter)
    assert tied.static_memory_bytes == untied.static_memory_bytes == (4 * MB4, 4 * MB4)


def test_with_data_parallelism_the_tie_waits_for_each_ranks_gradient_all_reduce():
    # pp 2 x dp 2, 2 GPUs per node, pp-inner: a replica's two pipeline ranks share a node (the
    # tie's ring is intra-node), each dp group spans both nodes (0.5 GB/s).
    cluster = Cluster(gpus=4, **{**SLOW_LINK, "gpus_per_node": 2})
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], GPIPE, cluster=cluster, microbatches=2, dp=2)
    result = simulate(plan, _profile())
    # dp all-reduces of 4 MB each: 2 x 1 ms + 4 MB / 0.5 GB/s = 10 ms, after each rank's last backward
    assert [(a.rank, a.stage, a.start_ms, a.end_ms) for a in result.allreduces] == [(0, 0, 22, 32), (1, 1, 17, 27)]
    # the tie: when rank 0's all-reduce ends (32), 6 ms in each replica at once
    assert [(ar.ranks, ar.start_ms, ar.end_ms) for ar in result.tied_allreduces] == [((0, 1), 32, 38)]
    assert result.iteration_ms == 38


def test_on_one_rank_the_tie_costs_no_time_and_its_tensor_counts_once():
    cluster = Cluster(gpus=1, **SLOW_LINK)
    plan = hand_plan([(0, 1, 0), (1, 2, 0)], ["0F0 1F0 1B0 0B0"], cluster=cluster, microbatches=1)
    untied, tied = simulate(plan, _profile(tied=False)), simulate(plan, _profile())
    # 0F0 [0,2] 1F0 [2,3] 1B0 [3,7] 0B0 [7,9]: nothing to sum across ranks
    assert tied.iteration_ms == untied.iteration_ms == 9 and tied.tied_allreduces == ()
    # 8 MB of parameters of which 4 MB are one tensor twice: 4 MB x 16 bytes/4 bytes per parameter
    assert untied.static_memory_bytes == (static_bytes(2 * MB4, dtype_bytes=4),) == (32_000_000,)
    assert tied.static_memory_bytes == (16_000_000,)
    assert tied.peak_memory_bytes[0] == untied.peak_memory_bytes[0] - 16_000_000
    # with sgd (weights and gradients only): 8 bytes per fp32 parameter, the tensor once
    assert simulate(plan, _profile(), optimizer="sgd").static_memory_bytes == (8_000_000,)


def test_one_rank_with_data_parallelism_reduces_the_tied_tensor_once_with_the_later_stage():
    # pp 1 x dp 2 on one node. The rank's stage 1 backward ends at 7, stage 0's at 9: octorun
    # reduces the shared tensor with stage 0 (the later all-reduce), so stage 1 has nothing left
    # to reduce and stage 0 its 4 MB: 2 x 1 ms + 4 MB / 1 GB/s = 6 ms.
    cluster = Cluster(gpus=2, **SLOW_LINK)
    plan = hand_plan([(0, 1, 0), (1, 2, 0)], ["0F0 1F0 1B0 0B0"], cluster=cluster, microbatches=1, dp=2)
    untied, tied = simulate(plan, _profile(tied=False)), simulate(plan, _profile())
    assert [(a.stage, a.start_ms, a.end_ms) for a in untied.allreduces] == [(1, 7, 13), (0, 13, 19)]
    assert [(a.stage, a.start_ms, a.end_ms) for a in tied.allreduces] == [(1, 7, 7), (0, 9, 15)]
    assert (untied.iteration_ms, tied.iteration_ms) == (19, 15)


def test_two_groups_run_one_after_the_other_on_the_ranks_they_share():
    # three layers on three ranks; group 0 ties layers 0 and 2, group 1 layers 1 and 2 (1 MB).
    profile = Profile(model=ModelRef("t"), layers=tuple(
        Layer(f"l{i}", "layer", 1.0, 1.0, 1.0, MB4, 0, 0) for i in range(3)),
        tied=(TiedParameter(((0, "w"), (2, "w")), MB4), TiedParameter(((1, "v"), (2, "v")), 1_000_000)))
    plan = hand_plan([(0, 1, 0), (1, 2, 1), (2, 3, 2)], ["0F0 0B0", "1F0 1B0", "2F0 2B0"],
                 cluster=Cluster(gpus=3, **{**SLOW_LINK, "latency_us": 0.0}), microbatches=1)
    result = simulate(plan, profile)
    # 0F0 [0,1] 1F0 [1,2] 2F0 [2,3] 2B0 [3,5] 1B0 [5,7] 0B0 [7,9] (free transfers: no latency,
    # 0 bytes). Group 0 (ranks 0, 2): from 9, 4 MB / 1 GB/s = 4 ms; group 1 (ranks 1, 2): rank 2
    # joins after group 0, at 13, 1 ms.
    assert [(ar.group, ar.ranks, ar.start_ms, ar.end_ms) for ar in result.tied_allreduces] == [
        (0, (0, 2), 9, 13), (1, (1, 2), 13, 14)]
    assert result.iteration_ms == 14


def test_the_tied_ring_is_the_all_reduce_link_model_over_k_ranks():
    cluster = Cluster(gpus=4, **{**SLOW_LINK, "gpus_per_node": 2})
    parallel = Parallel(pp=4, dp=1, microbatches=1)
    # ranks 0 and 1 share node 0: 2 x 1 ms + 1 x 4 MB / 1 GB/s
    assert tied_allreduce_ms(cluster, parallel, (0, 1), MB4) == 6
    # ranks 0, 1, 3 span both nodes: 4 x 1 ms + 4/3 x 4 MB / 0.5 GB/s
    assert tied_allreduce_ms(cluster, parallel, (0, 1, 3), MB4) == pytest.approx(4 + 4 / 3 * 8)
    assert tied_allreduce_ms(cluster, parallel, (2,), MB4) == 0
    # pp 2 x dp 2, dp-inner: replica 0 is global ranks 0 and 2 (two nodes), replica 1 ranks 1, 3
    wide = Parallel(pp=2, dp=2, microbatches=1, rank_order="dp-inner")
    assert tied_allreduce_ms(cluster, wide, (0, 1), MB4) == 2 + 8
    # pp 2 x dp 2, pp-inner, 3 GPUs a node: replica 0 (ranks 0, 1) stays on node 0, but
    # replica 1 (ranks 2, 3) spans nodes 0 and 1, and the slowest replica's ring decides
    odd = Cluster(gpus=4, **{**SLOW_LINK, "gpus_per_node": 3})
    assert tied_allreduce_ms(odd, Parallel(pp=2, dp=2, microbatches=1), (0, 1), MB4) == 2 + 8


def test_the_tuned_plans_prediction_includes_the_tie():
    from octoplan.tuner import TuneOptions, tune

    # three layers on three ranks: every plan holds the tied layers 0 and 2 on two ranks
    profile = Profile(model=ModelRef("t"), layers=tuple(
        Layer(f"l{i}", "layer", 1.0, 1.0, 1.0, MB4, 1000, 1000) for i in range(3)),
        tied=(TiedParameter(((0, "w"), (2, "w")), MB4),))
    cluster = Cluster(gpus=3, **SLOW_LINK)
    result = tune(profile, cluster, TuneOptions(gpus=3, pp=3, microbatches=3, max_plans=30, use_cpsat=False))
    judged = simulate(result.plan, profile)
    assert judged.tied_allreduce_ms == [6]  # 2 x 1 ms + 4 MB / 1 GB/s between two ranks of one node
    assert result.plan.predicted["tied_allreduce_ms"] == [6]
    assert result.plan.predicted["iteration_ms"] == round(judged.iteration_ms, 4)
    assert result.scored.iteration_ms == pytest.approx(judged.iteration_ms)
    assert judged.iteration_ms == pytest.approx(max(ar.end_ms for ar in judged.tied_allreduces))


# ----------------------------------------------------------------------------- the profile field


def test_a_profile_keeps_its_tied_groups_and_older_profiles_have_none(tmp_path):
    path = tmp_path / "p.yaml"
    save_profile(_profile(), path)
    text = path.read_text()
    assert "tied:" in text and "embed.weight" in text
    loaded = load_profile(path)
    assert loaded.tied == (TiedParameter(((0, "embed.weight"), (1, "proj.weight")), MB4),)
    assert loaded == _profile()
    save_profile(_profile(tied=False), path)
    assert "tied" not in path.read_text() and load_profile(path).tied == ()


@pytest.mark.parametrize("tied,field,words", [
    ([{"members": [[0, "w"]], "bytes": 4}], "tied[0].members", "two or more distinct"),
    ([{"members": [[0, "w"], [0, "w"]], "bytes": 4}], "tied[0].members", "two or more distinct"),
    ([{"members": [[0, "w"], [2, "w"]], "bytes": 4}], "tied[0].members[1]", "layer 2 of a 2-layer"),
    ([{"members": [[0, "w"], ["x", "w"]], "bytes": 4}], "tied[0].members[1]", "is ['x', 'w']"),
    ([{"members": [[0, "w"], [1, "w"]], "bytes": MB4 + 1}], "tied[0].bytes", "more than layer 0's param_bytes"),
    ([{"members": [[0, "w"], [1, "w"]], "byte": 4}], "tied[0].byte", "not a field"),
    ({"members": []}, "tied", "must be a list"),
])
def test_a_bad_tied_field_is_refused_naming_it(tied, field, words):
    data = profile_to_dict(_profile(tied=False))
    data["tied"] = tied
    with pytest.raises(InputError) as caught:
        profile_from_dict(data, file="p.yaml")
    assert caught.value.field == field and words in str(caught.value), str(caught.value)


# ----------------------------------------------------------------------------- the model file and the profiler

MODEL = '''
import torch
from torch import nn

CONFIG = {"tie": "ok"}

def num_layers(tie):
    return 3

class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
    def forward(self, ids):
        return self.emb(ids)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    def forward(self, h):
        return torch.tanh(self.lin(h))

class Head(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.out = nn.Linear(8, vocab, bias=False)
    def forward(self, h):
        return self.out(h)

def build_layer(index, tie):
    return [Embed, Block, lambda: Head(12 if tie == "shapes" else 11)][index]()

def tied_parameters(tie):
    return {
        "ok": [[(2, "out.weight"), (0, "emb.weight")]],
        "none": [],
        "shapes": [[(0, "emb.weight"), (2, "out.weight")]],
        "unknown": [[(0, "emb.weight"), (2, "out.weights")]],
        "single": [[(0, "emb.weight")]],
        "repeated": [[(0, "emb.weight"), (0, "emb.weight")]],
        "range": [[(0, "emb.weight"), (3, "out.weight")]],
        "twice": [[(0, "emb.weight"), (2, "out.weight")], [(1, "lin.weight"), (2, "out.weight")]],
        "shape": [(0, "emb.weight"), (2, "out.weight")],
        "type": "emb.weight",
    }[tie]

def sample_batch(mbs, generator, tie):
    ids = torch.randint(0, 11, (mbs, 6), generator=generator)
    return ids[:, :-1], ids[:, 1:]

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
'''


@pytest.fixture
def model_path(tmp_path) -> Path:
    path = tmp_path / "tied_model.py"
    path.write_text(MODEL)
    return path


def test_the_profiler_records_the_groups_the_model_file_declares(model_path):
    assert load_model_file(model_path).tied_groups() == [[(0, "emb.weight"), (2, "out.weight")]]  # canonical first
    assert load_model_file(model_path, {"tie": "none"}).tied_groups() == []
    profile = profile_model_file(str(model_path), microbatch_size=2, repeat=1, warmup=0, device="cpu")
    # an 11 x 8 fp32 matrix, in both layers' param_bytes
    assert profile.tied == (TiedParameter(((0, "emb.weight"), (2, "out.weight")), 11 * 8 * 4),)
    assert profile.layers[0].param_bytes == profile.layers[2].param_bytes == 352
    assert profile_from_dict(profile_to_dict(profile)).tied == profile.tied
    assert profile_model_file(str(model_path), config={"tie": "none"}, microbatch_size=2, repeat=1, warmup=0,
                              device="cpu").tied == ()


@pytest.mark.parametrize("tie,words", [
    ("shapes", "layer 2's out.weight has shape (12, 8) but layer 0's emb.weight has (11, 8)"),
    ("unknown", "layer 2 has no parameter 'out.weights'"),
    ("single", "1 distinct member"),
    ("repeated", "1 distinct member"),
    ("range", "names layer 3 (out.weight) of a 3-layer model"),
    ("twice", "repeats (2, 'out.weight') of group 0"),
    ("shape", "not a list of (layer index, parameter name)"),
    ("type", "returned str, not a list of groups"),
])
def test_a_bad_tied_group_is_an_input_error_naming_the_file_and_the_group(model_path, tie, words):
    with pytest.raises(InputError) as caught:
        profile_model_file(str(model_path), config={"tie": tie}, microbatch_size=2, repeat=1, warmup=0, device="cpu")
    error = caught.value
    assert error.file == str(model_path) and words in str(error), str(error)
    assert error.field.startswith("tied_parameters")
    if tie not in ("type",):
        assert error.field.startswith("tied_parameters group ")


def test_the_cli_refuses_a_bad_group_in_one_line_and_writes_nothing(model_path, tmp_path):
    from typer.testing import CliRunner

    from octoplan.cli import app

    out = tmp_path / "p.yaml"
    done = CliRunner().invoke(app, ["profile", str(model_path), "--config", "tie=shapes", "--repeat", "1",
                                    "--device", "cpu", "-o", str(out)])
    # stderr holds the one line (the progress display's own line break goes to stdout)
    assert done.exit_code == 2 and done.stderr.count("\n") == 1 and "shape (12, 8)" in done.stderr, done.output
    assert not out.exists()
    done = CliRunner().invoke(app, ["profile", str(model_path), "--repeat", "1", "--device", "cpu", "-o", str(out)],
                              terminal_width=200)
    assert done.exit_code == 0 and "tied: layer 0 emb.weight, layer 2 out.weight (0.00 MB, one tensor)" in done.output, done.output
    assert load_profile(out).tied[0].bytes == 352


def test_octoplan_simulate_shows_the_tied_all_reduce(tmp_path):
    import json
    from dataclasses import replace

    from typer.testing import CliRunner

    from octoplan.cli import app
    from octoplan.plan import save_plan
    from octoplan.yamlio import file_sha256

    save_profile(_profile(), tmp_path / "p.yaml")
    plan = hand_plan([(0, 1, 0), (1, 2, 1)], GPIPE, cluster=Cluster(gpus=2, **SLOW_LINK), microbatches=2)
    save_plan(replace(plan, profile="p.yaml", profile_sha256=file_sha256(tmp_path / "p.yaml")), tmp_path / "plan.yaml")
    runner = CliRunner()
    done = runner.invoke(app, ["simulate", str(tmp_path / "plan.yaml"), "--json"])
    assert done.exit_code == 0, done.output
    figures = json.loads(done.output)
    assert (figures["iteration_ms"], figures["tied_allreduce_ms"]) == (28, [6])
    done = runner.invoke(app, ["simulate", str(tmp_path / "plan.yaml")], terminal_width=200)
    assert done.exit_code == 0 and "tied group 0 all-reduce" in done.output and "6.000 ms (ranks 0, 1, ends at 28.000)" in done.output, done.output
