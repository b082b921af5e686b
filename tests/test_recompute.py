"""Activation recomputation in the planner: its costs, its memory, the plan file, the
baselines and the tuner. (octorun's execution of it: tests/test_runtime_recompute.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from octoplan.costs import LayerTable, stage_costs
from octoplan.errors import InputError
from octoplan.ops import Kind, Op, parse_ops
from octoplan.plan import Cluster, Parallel, Plan, Stage, load_plan, plan_from_dict, plan_to_dict, save_plan
from octoplan.profile import Layer, ModelRef, Profile
from octoplan.simulator import simulate
from octoplan.tuner import TuneOptions, tune

from conftest import free_cluster

GB = 10**9


def _profile() -> Profile:
    # three layers: F, I, W ms; activations 30, 20, 10 bytes; outputs 4, 3, 1 bytes
    return Profile(model=ModelRef("t"), layers=(
        Layer("a", "layer", 1.0, 2.0, 3.0, 0, 30, 4),
        Layer("b", "layer", 4.0, 5.0, 6.0, 0, 20, 3),
        Layer("c", "head", 7.0, 8.0, 9.0, 0, 10, 1),
    ))


def test_a_recomputed_stage_keeps_its_input_and_pays_a_forward_in_its_first_backward():
    table = LayerTable(_profile())
    plain = table.stage(1, 3)
    again = table.stage(1, 3, recompute=True)
    assert (plain.forward_ms, plain.backward_input_ms, plain.backward_weight_ms, plain.b_ms) == (11, 13, 15, 28)
    # I (and B) run the forward again first; W does not
    assert (again.forward_ms, again.backward_input_ms, again.backward_weight_ms, again.b_ms) == (11, 24, 15, 39)
    # F keeps only the stage's input (layer a's output, 4 bytes); the rebuild holds the rest
    assert (plain.activation_bytes, plain.recompute_bytes) == (30, 0)
    assert (again.activation_bytes, again.recompute_bytes) == (4, 26)
    # the first stage's input is the microbatch itself, which the profile does not size
    first = table.stage(0, 2, recompute=True)
    assert (first.activation_bytes, first.recompute_bytes) == (0, 50)
    # a stage's output, once sent, no tape holds (only its gradient edge): not in its figure
    assert table.stage(0, 2).activation_bytes == 50
    # a measured fused backward gets the forward too
    fused = Profile(model=ModelRef("t"), layers=tuple(replace(layer, backward_ms=1.5) for layer in _profile().layers))
    assert LayerTable(fused).stage(1, 3, recompute=True).b_ms == pytest.approx(3.0 + 11.0)
    assert stage_costs([Stage(0, 1, 0), Stage(1, 3, 1, recompute=True)], table) == [table.stage(0, 1), again]


def _one_rank_plan(schedule: str, *, recompute: bool) -> Plan:
    # stage 0 = layer a, stage 1 = layers b and c, both on one rank: stage 1's input is 4 bytes
    return Plan(
        model=ModelRef("t"), cluster=free_cluster(1), parallel=Parallel(pp=1, dp=1, microbatches=2),
        stages=(Stage(0, 1, 0), Stage(1, 3, 0, recompute=recompute)),
        schedule=(tuple(parse_ops(schedule)),),
    )


def test_fused_backward_holds_the_rebuilt_activations_only_while_it_runs():
    schedule = "0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1"
    plain = simulate(_one_rank_plan(schedule, recompute=False), _profile())
    again = simulate(_one_rank_plan(schedule, recompute=True), _profile())
    # without: after 1F1 the rank holds 2 x (30 + 30) = 120 bytes
    assert plain.peak_memory_bytes == (120,)
    # with: 2 x 30 (stage 0) + 2 x 4 (stage 1's inputs) = 68 after 1F1; 1B0 rebuilds 26 bytes
    # on top while it runs: 94; then 1B0 frees 4, 0B0 30: 34; 1B1's rebuild reaches 34 + 26 = 60
    assert again.peak_memory_bytes == (94,)
    # every 1B is 11 ms longer (stage 1's forward again): two of them
    assert again.iteration_ms == pytest.approx(plain.iteration_ms + 2 * 11)
    spans = {str(s.op): (s.start_ms, s.end_ms) for s in again.spans()}
    assert spans["1B0"][1] - spans["1B0"][0] == pytest.approx(11 + 28)


def test_split_backward_holds_the_rebuilt_activations_from_i_to_w():
    schedule = "0F0 1F0 0F1 1F1 1I0 1I1 0B0 0B1 1W0 1W1"
    again = simulate(_one_rank_plan(schedule, recompute=True), _profile())
    # 68 after 1F1; 1I0 +26 = 94; 1I1 +26 = 120; 0B0 -30, 0B1 -30; 1W0, 1W1 free 30 each
    assert again.peak_memory_bytes == (120,)
    ops = {str(s.op): s.end_ms - s.start_ms for s in again.spans()}
    assert ops["1I0"] == pytest.approx(13 + 11) and ops["1W0"] == pytest.approx(15)


def test_the_plan_file_keeps_recompute_and_rejects_a_value_that_is_not_a_boolean(tmp_path):
    plan = _one_rank_plan("0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1", recompute=True)
    save_plan(plan, tmp_path / "p.yaml")
    loaded = load_plan(tmp_path / "p.yaml")
    assert [s.recompute for s in loaded.stages] == [False, True]
    data = plan_to_dict(plan)
    assert "recompute" not in data["stages"][0] and data["stages"][1]["recompute"] is True
    data["stages"][1]["recompute"] = "yes"
    with pytest.raises(InputError) as info:
        plan_from_dict(data, file="p.yaml")
    assert str(info.value).startswith("p.yaml: stages[1].recompute: must be true or false, got 'yes'")


def test_recomputing_a_stages_first_layers_keeps_the_rest_and_pays_only_their_forward():
    table = LayerTable(_profile())
    # stage b, c with only b recomputing: F keeps b's input (a's output, 4 bytes) and c's 10
    # bytes; the backward runs b's forward (4 ms) again and rebuilds b's 20 bytes less the
    # input (b's rebuilt output no tape keeps: c holds the one F made)
    some = table.stage(1, 3, recompute=True, recompute_layers=1)
    assert (some.forward_ms, some.backward_input_ms, some.backward_weight_ms, some.b_ms) == (11, 17, 15, 32)
    assert (some.activation_bytes, some.recompute_bytes) == (14, 16)
    # a, b of a, b, c (the first stage: its input is not sized): 1 + 4 ms again, 50 bytes rebuilt
    first = table.stage(0, 3, recompute=True, recompute_layers=2)
    assert (first.backward_input_ms, first.activation_bytes, first.recompute_bytes) == (20, 10, 50)
    # as many layers as the stage has, or more, is full recomputation
    assert table.stage(1, 3, recompute=True, recompute_layers=2) == table.stage(1, 3, recompute=True)
    assert table.stage(1, 3, recompute=True, recompute_layers=9) == table.stage(1, 3, recompute=True)
    # a plan stage says so, and the costs follow it
    stage = Stage(1, 3, 0, recompute=True, recompute_layers=1)
    assert (stage.recomputed_layers, Stage(1, 3, 0, recompute=True).recomputed_layers, Stage(1, 3, 0).recomputed_layers) == (1, 2, 0)
    assert stage_costs([stage], table) == [some]
    # while the rebuild lives, the stage holds what it would hold without recomputation
    assert some.activation_bytes + some.recompute_bytes == table.stage(1, 3).activation_bytes


def test_the_plan_file_keeps_recompute_layers_and_rejects_bad_counts(tmp_path):
    plan = _one_rank_plan("0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1", recompute=True)
    plan = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], recompute_layers=1)))
    save_plan(plan, tmp_path / "p.yaml")
    assert load_plan(tmp_path / "p.yaml").stages == plan.stages
    data = plan_to_dict(plan)
    assert data["stages"][1] == {"layers": [1, 3], "rank": 0, "recompute": True, "recompute_layers": 1}
    for value, problem in ((3, "must be <= 2, got 3"), (0, "must be >= 1, got 0"), (True, "must be a whole number, got True")):
        data["stages"][1]["recompute_layers"] = value
        with pytest.raises(InputError) as info:
            plan_from_dict(data, file="p.yaml")
        assert str(info.value).startswith(f"p.yaml: stages[1].recompute_layers: {problem}"), str(info.value)
    data["stages"][1].update(recompute=False, recompute_layers=1)
    with pytest.raises(InputError) as info:
        plan_from_dict(data, file="p.yaml")
    assert "stages[1].recompute_layers: is 1 but the stage does not recompute" in str(info.value)
    assert "add recompute: true, or drop recompute_layers" in str(info.value)


def _memory_bound_profile() -> Profile:
    # 8 equal layers of 10 GB activations each but small outputs
    return Profile(model=ModelRef("t"), layers=tuple(
        Layer(f"l{i}", "layer", 0.5, 1.0, 1.0, 0, 10 * GB, GB // 100) for i in range(8)))


def test_the_tuner_recomputes_where_nothing_fits_without_it():
    # 2 ranks, 25 GB each: a rank's share of a microbatch (4 layers, 40 GB) never fits, however
    # the layers are cut, unless its stages recompute (a stage of 2 layers rebuilds 20 GB)
    profile = _memory_bound_profile()
    cluster = free_cluster(2, memory_gb=25)
    opts = TuneOptions(gpus=2, pp=2, microbatches=8, max_plans=400, chunks_max=2)
    with pytest.raises(InputError) as info:
        tune(profile, cluster, replace(opts, recompute=False))
    assert "no plan fits 25 GB per GPU; the leanest plan found needs 40 GB" in str(info.value)
    assert "drop --no-recompute" in str(info.value)
    result = tune(profile, cluster, opts)
    # every stage recomputes but the last, whose microbatch runs F and its backward back to
    # back: one microbatch's 20 GB at a time fits beside its rank's other (recomputing) stage
    assert result.scored.fits
    assert [stage.recompute for stage in result.plan.stages] == [True] * (result.plan.num_stages - 1) + [False]
    assert max(simulate(result.plan, profile).peak_memory_bytes) <= 25 * GB
    # every layer's work is 2.5 ms plus a recomputed forward of 0.5: 8 microbatches x 4 layers
    # x 3 ms = 96 ms per rank at least
    assert result.scored.iteration_ms >= 96
    # the summary counts the busiest rank's forwards run again: 8 microbatches x its layers x 0.5 ms
    busiest = result.stats["busiest_rank"]
    layers = sum(stage.end - stage.start for stage in result.plan.stages if stage.rank == busiest and stage.recompute)
    assert result.stats["busiest_recompute_ms"] == pytest.approx(8 * layers * 0.5)
    # the baselines that do not fit are priced with full recomputation too
    names = [row.name for row in result.baselines]
    assert "1f1b/uniform" in names and "1f1b/uniform+recompute" in names
    row = next(r for r in result.baselines if r.name == "1f1b/uniform+recompute")
    assert all(stage.recompute for stage in row.candidate.stages())
    assert result.scored.iteration_ms <= min(r.scored.iteration_ms for r in result.baselines if r.scored.fits)


def test_baseline_cli_recompute_flag(tmp_path, profile_file):
    from typer.testing import CliRunner

    from octoplan.cli import app

    path = profile_file(_memory_bound_profile())
    runner = CliRunner()
    common = [str(path), "--gpus", "2", "--schedule", "1f1b", "--microbatches", "4", "--memory-gb", "50"]
    plain = runner.invoke(app, ["baseline", *common, "-o", str(tmp_path / "a.yaml")])
    again = runner.invoke(app, ["baseline", *common, "--recompute", "-o", str(tmp_path / "b.yaml")])
    assert plain.exit_code == 0 and again.exit_code == 0
    # 1F1B on 2 ranks: rank 0 holds 2 microbatches of 40 GB; recomputing, 40 GB of one rebuild;
    # each of the 4 layers' forward again in every B: 4 microbatches x 4 x 0.5 ms more per rank
    assert "does not fit" in plain.output and "with --recompute it fits, at" in plain.output
    assert "40.0 GB" in plain.output
    assert "does not fit" not in again.output and "recomputing" in again.output
    profile = _memory_bound_profile()
    a, b = simulate(load_plan(tmp_path / "a.yaml"), profile), simulate(load_plan(tmp_path / "b.yaml"), profile)
    assert all(s.recompute for s in load_plan(tmp_path / "b.yaml").stages)
    assert not a.fits_memory and b.fits_memory
    # 1F1B on 2 ranks, 4 microbatches: rank 0 holds 2 x 40 GB without; with, one 40 GB rebuild
    # (its inputs are the microbatches, which no profile sizes)
    assert a.peak_activation_bytes[0] == 2 * 40 * GB
    assert b.peak_activation_bytes[0] == pytest.approx(40 * GB, rel=1e-3)


def test_export_notes_the_recomputing_stages(tmp_path):
    from typer.testing import CliRunner

    from octoplan.cli import app

    plan = _one_rank_plan("0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1", recompute=True)
    save_plan(plan, tmp_path / "p.yaml")
    result = CliRunner().invoke(app, ["export", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "p.csv")])
    assert result.exit_code == 0, result.output
    assert "stages 1 recompute their activations" in result.output and "torch.utils.checkpoint" in result.output
    assert (tmp_path / "p.csv").read_text().splitlines()[0].startswith("0F0")
    # a stage that recomputes only its first layers says how many, in the note and in the trace
    some = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], recompute_layers=1)))
    save_plan(some, tmp_path / "q.yaml")
    result = CliRunner().invoke(app, ["export", str(tmp_path / "q.yaml"), "-o", str(tmp_path / "q.csv")])
    assert result.exit_code == 0 and "stages 1 (its first 1 layers) recompute" in result.output, result.output
    from octoplan.timeline.trace import trace_events

    args = {e["name"]: e["args"] for e in trace_events(some, simulate(some, _profile())) if e.get("ph") == "X" and "mb" in e.get("args", {})}
    assert args["1B0"] == {"stage": 1, "mb": 0, "recompute": True, "recompute_layers": 1}
    assert args["0F0"] == {"stage": 0, "mb": 0}
    from octoplan.timeline._layout import describe_plan

    assert describe_plan(some).endswith("2 stages (1 recompute, 1 of them only their first layers: their I/B run F again)")
    assert describe_plan(plan).endswith("2 stages (1 recompute: their I/B run F again)")


def test_climb_moves_turn_recomputation_on_where_memory_is_short_and_off_where_it_is_not():
    import random

    from octoplan.schedules import get_schedule
    from octoplan.tuner.moves import neighbours
    from octoplan.tuner.space import Candidate, Config, Evaluator

    profile = _memory_bound_profile()
    config = Config(2, 1, 8)
    order = tuple(tuple(ops) for ops in get_schedule("1f1b").generate(2, 8, 2))
    start = Candidate(config, (0, 4, 8), (0, 1), None, order, "1f1b", "1f1b")
    tight = Evaluator(profile, free_cluster(2, memory_gb=45))
    result = tight.simulate(start)
    assert not result.fits_memory  # 1F1B: rank 0 holds 2 microbatches of 40 GB
    moves = {m.origin: m for m in neighbours(start, result, rng=random.Random(0))}
    assert moves["rank 0: recompute"].recompute == {0}
    assert moves["every rank recomputes"].recompute == {0, 1}
    assert tight.score(moves["rank 0: recompute"]).fits
    assert not any("recompute" in origin for origin in
                   (m.origin for m in neighbours(start, result, rng=random.Random(0), allow_recompute=False)))
    # with memory to spare, a recomputing rank is offered its memory back for the time
    roomy = Evaluator(profile, free_cluster(2, memory_gb=1000))
    both = replace(start, recompute=frozenset({0, 1}))
    moves = {m.origin: m for m in neighbours(both, roomy.simulate(both), rng=random.Random(0))}
    assert moves["rank 1: no recompute"].recompute == {0}
    assert roomy.score(moves["rank 1: no recompute"]).iteration_ms < roomy.score(both).iteration_ms


def test_with_memory_to_spare_no_stage_recomputes():
    result = tune(_memory_bound_profile(), free_cluster(2, memory_gb=1000),
                  TuneOptions(gpus=2, pp=2, microbatches=8, max_plans=300, chunks_max=2))
    assert not any(stage.recompute for stage in result.plan.stages)
    assert not any(row.name.endswith("+recompute") for row in result.baselines)


def test_the_policy_scheduler_runs_a_deferred_w_before_rebuilt_activations_overflow_memory():
    from octoplan.schedules.policy import default_policies
    from octoplan.tuner.space import Candidate, Config, Evaluator

    # a V of 4 stages of 2 layers on 2 ranks, all recomputing: a microbatch keeps 10 MB per
    # stage after F, and each I rebuilds 20 GB that only its W frees; 30 GB per GPU hold one
    # rebuild, not two. Ws may wait (w_cap 64), and the second stage on a rank admits nothing,
    # so only the budget can make the rank run a W before the next I.
    evaluator = Evaluator(_memory_bound_profile(), free_cluster(2, memory_gb=30))
    ranks = (0, 1, 1, 0)
    policies = tuple(replace(p, w_cap=64) for p in default_policies(ranks, 2, 8, split=True))
    cand = Candidate(Config(2, 1, 8), (0, 2, 4, 6, 8), ranks, policies, recompute=frozenset({0, 1, 2, 3}))
    result = evaluator.simulate(cand)
    assert result.fits_memory, result.peak_memory_bytes
    # each rank's peak: one rebuild (20 GB) on top of the inputs its microbatches keep
    assert max(result.peak_memory_bytes) <= 20 * GB + 16 * GB // 100


def test_a_whole_rank_swap_carries_the_ranks_recomputation_with_it():
    import random

    from octoplan.schedules.policy import default_policies
    from octoplan.tuner.moves import neighbours
    from octoplan.tuner.space import Candidate, Config, Evaluator

    # 4 ranks on 2 nodes joined by a slow link: the transfers across it stall, so the tuner
    # offers to swap whole ranks; rank 1 recomputes, and its stage must keep recomputing
    profile = Profile(model=ModelRef("t"), layers=tuple(
        Layer(f"l{i}", "layer", 1.0, 1.0, 1.0, 0, 1000, 10**9) for i in range(8)))
    cluster = Cluster(gpus=4, gpus_per_node=2, inter_node_gbps=1.0, intra_node_gbps=1000.0, latency_us=0)
    ranks = (0, 1, 2, 3)
    cand = Candidate(Config(4, 1, 8), (0, 2, 4, 6, 8), ranks, default_policies(ranks, 4, 8), recompute=frozenset({1}))
    result = Evaluator(profile, cluster).simulate(cand)
    swaps = [m for m in neighbours(cand, result, rng=random.Random(0), dimensions=("placement",))
             if m.origin.startswith("swap ranks")]
    assert swaps
    for moved in swaps:
        assert [stage.recompute for stage in moved.stages()] == [False, True, False, False], moved.origin


def test_the_climb_turns_recomputation_off_one_stage_at_a_time_where_a_whole_rank_would_not_fit():
    import random

    from octoplan.schedules import get_schedule
    from octoplan.tuner.moves import neighbours
    from octoplan.tuner.space import Candidate, Config, Evaluator

    # ZB-V on 2 ranks, every stage (2 layers, 20 GB of activations) recomputing: rank 1 holds
    # three 20 GB rebuilds while their Ws wait, and rank 0 one. 61 GB per GPU: either rank keeping all its activations needs 80 GB, but
    # keeping one stage's (the rank's later one first) fits
    profile = _memory_bound_profile()
    spec = get_schedule("zbv")
    order = tuple(tuple(ops) for ops in spec.generate(2, 8, 2))
    start = Candidate(Config(2, 1, 8), (0, 2, 4, 6, 8), tuple(spec.placement(2, 4)), None, order, "zbv", "zbv",
                      recompute=frozenset(range(4)))
    evaluator = Evaluator(profile, free_cluster(2, memory_gb=61))
    result = evaluator.simulate(start)
    assert result.fits_memory and list(result.peak_activation_bytes) == [20 * GB, 3 * 20 * GB]
    moves = {m.origin: m for m in neighbours(start, result, rng=random.Random(0)) if "recompute" in m.origin}
    assert moves["rank 0: no recompute"].recompute == {1, 2} and moves["rank 1: no recompute"].recompute == {0, 3}
    assert moves["stage 3 (rank 0): no recompute"].recompute == {0, 1, 2}
    assert moves["stage 2 (rank 1): no recompute"].recompute == {0, 1, 3}
    for whole in ("rank 0: no recompute", "rank 1: no recompute"):
        assert not evaluator.score(moves[whole]).fits, whole
    for stage in ("stage 3 (rank 0): no recompute", "stage 2 (rank 1): no recompute"):
        scored = evaluator.score(moves[stage])
        assert scored.fits and scored.iteration_ms < result.iteration_ms, stage
    # the plan says which stages recompute, one by one
    assert [s.recompute for s in moves["stage 2 (rank 1): no recompute"].stages()] == [True, True, False, True]


def test_splits_and_merges_carry_each_stages_recomputation():
    from octoplan.tuner.moves import _renumbered
    from octoplan.tuner.space import Candidate, Config

    # stages 0..4 of 2 layers; stages 1 and 3 recompute, stage 3 only its first layer
    cand = Candidate(Config(2, 1, 8), (0, 2, 4, 6, 8, 10), (0, 1, 0, 1, 0), None, recompute=frozenset({1, 3}),
                     recompute_layers=((3, 1),))
    assert [s.recomputed_layers for s in cand.stages()] == [0, 2, 0, 1, 0]
    # a split recomputes the same layers: both 1-layer halves of stage 1; stage 3 is now 4
    assert _renumbered(cand, split=1, at=3) == ({1, 2, 4}, ((4, 1),))
    assert _renumbered(cand, split=2, at=5) == ({1, 4}, ((4, 1),))
    assert _renumbered(cand, split=3, at=7) == ({1, 3}, ())  # stage 3's recomputed layer is the first half
    # a merge recomputes a prefix: stages 1 + 2 recompute stage 1's 2 layers of 4; 3 is now 2
    assert _renumbered(cand, merged=1) == ({1, 2}, ((1, 2), (2, 1)))
    assert _renumbered(cand, merged=3) == ({1, 3}, ((3, 1),))  # stages 3 + 4: the first layer of 4
    # stages 0 + 1: the second recomputes, so the merged stage recomputes all of the first and
    # the second's 2 layers: all 4
    assert _renumbered(cand, merged=0) == ({0, 2}, ((2, 1),))
    assert _renumbered(Candidate(Config(2, 1, 8), (0, 2, 4), (0, 1), None), merged=0) == (frozenset(), ())
    # a long stage recomputing 1 of its 8 layers, split in the middle: the first half keeps it
    long = Candidate(Config(2, 1, 8), (0, 8, 10), (0, 1), None, recompute=frozenset({0}), recompute_layers=((0, 1),))
    assert _renumbered(long, split=0, at=4) == ({0}, ((0, 1),))


def _sixteen_layers() -> Profile:
    # 16 equal layers of 10 GB activations (F 0.5, I 1, W 1 ms): stages of 4 layers hold 40 GB per microbatch
    return Profile(model=ModelRef("t"), layers=tuple(
        Layer(f"l{i}", "layer", 0.5, 1.0, 1.0, 0, 10 * GB, GB // 100) for i in range(16)))


def test_the_climb_recomputes_fewer_of_a_stages_layers_where_keeping_all_would_not_fit():
    import random

    from octoplan.schedules import get_schedule
    from octoplan.tuner.moves import neighbours
    from octoplan.tuner.space import Candidate, Config, Evaluator

    # ZB-V on 2 ranks, 4 stages of 4 layers, all recomputing; rank 0's first stage has 4
    # microbatches in flight. Keeping its activations needs 4 x 40 = 160 GB; recomputing 2 of
    # its 4 layers keeps 4 x 20 GB and rebuilds 20 GB: 100 GB; 3 of 4: 4 x 10 + 30 = 70 GB
    spec = get_schedule("zbv")
    order = tuple(tuple(ops) for ops in spec.generate(2, 8, 2))
    start = Candidate(Config(2, 1, 8), (0, 4, 8, 12, 16), tuple(spec.placement(2, 4)), None, order, "zbv", "zbv",
                      recompute=frozenset(range(4)))
    evaluator = Evaluator(_sixteen_layers(), free_cluster(2, memory_gb=125))
    result = evaluator.simulate(start)
    assert result.fits_memory and result.peak_activation_bytes[0] == 40 * GB  # one rebuild
    moves = {m.origin: m for m in neighbours(start, result, rng=random.Random(0)) if "recompute" in m.origin}
    peak = {name: evaluator.simulate(moves[name]).peak_activation_bytes[0] for name in
            ("stage 0 (rank 0): no recompute", "stage 0 (rank 0): recompute 2 of 4 layers",
             "stage 0 (rank 0): recompute 3 of 4 layers")}
    assert peak == {"stage 0 (rank 0): no recompute": 160 * GB,
                    "stage 0 (rank 0): recompute 2 of 4 layers": 100 * GB,
                    "stage 0 (rank 0): recompute 3 of 4 layers": 70 * GB}
    half = moves["stage 0 (rank 0): recompute 2 of 4 layers"]
    assert half.recompute == {0, 1, 2, 3} and half.recompute_layers == ((0, 2),)
    assert half.stages()[0] == Stage(0, 4, 0, recompute=True, recompute_layers=2)
    # stage 3 (the latest on rank 0) recomputing 2 of 4 layers saves 8 microbatches x 2 x 0.5 ms of rank 0's work
    fewer = evaluator.simulate(moves["stage 3 (rank 0): recompute 2 of 4 layers"])
    assert fewer.busy_ms[0] == pytest.approx(result.busy_ms[0] - 8)


def test_the_tuner_recomputes_part_of_a_stage_where_that_is_what_fits():
    # at 45 GB the tuner recomputes every stage but the last (192 ms); at 65 GB it keeps some
    # of the recomputing stages' layers and is faster (188.5 ms, found within 800 plans: the
    # seeds' rebuilt orders take some of them)
    profile = _sixteen_layers()
    opts = TuneOptions(gpus=2, pp=2, microbatches=8, max_plans=800, chunks_max=2)
    lean = tune(profile, free_cluster(2, memory_gb=45), opts)
    roomier = tune(profile, free_cluster(2, memory_gb=65), opts)
    assert lean.scored.fits and roomier.scored.fits
    assert max(simulate(roomier.plan, profile).peak_memory_bytes) <= 65 * GB
    assert any(0 < s.recomputed_layers < s.end - s.start for s in roomier.plan.stages)
    assert roomier.scored.iteration_ms < lean.scored.iteration_ms
    # what the plan file says is what the simulator priced
    assert simulate(roomier.plan, profile).iteration_ms == pytest.approx(roomier.scored.iteration_ms)
    # the summary counts only the recomputed layers' forwards: 8 microbatches x 0.5 ms each
    busiest = roomier.stats["busiest_rank"]
    again = sum(s.recomputed_layers for s in roomier.plan.stages if s.rank == busiest)
    assert roomier.stats["busiest_recompute_ms"] == pytest.approx(8 * 0.5 * again)


def test_tune_cli_says_which_stages_recompute_only_their_first_layers(tmp_path, profile_file):
    from typer.testing import CliRunner

    from octoplan.cli import app

    path = profile_file(_sixteen_layers())
    out = tmp_path / "plan.yaml"
    result = CliRunner().invoke(app, ["tune", str(path), "--gpus", "2", "--pp", "2", "--microbatches", "8",
                                      "--memory-gb", "65", "--chunks-max", "2", "--max-plans", "600", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    some = [s for s in plan.stages if s.recompute and s.recompute_layers is not None]
    assert some and all(0 < s.recompute_layers < s.end - s.start for s in some)
    assert f"{plan.num_recomputing} recomputing their activations ({len(some)} only their first layers)" in result.output


def test_a_baseline_that_does_not_fit_recomputes_the_fewest_layers_per_stage_that_fit():
    from octoplan.tuner import compare_baselines
    from octoplan.tuner.space import Evaluator

    # 1F1B on 2 ranks of 8 layers: rank 0 holds 2 microbatches x 80 GB; recomputing its first
    # N layers keeps 2 x (8 - N) x 10 GB and rebuilds N x 10 GB: (16 - N) x
    # 10 GB, within 125 GB from N = 4 on (rank 1, one microbatch at a time, needs less)
    profile = _sixteen_layers()
    cluster = free_cluster(2, memory_gb=125)
    rows = {row.name: row for row in compare_baselines(profile, cluster, TuneOptions(gpus=2, pp=2, microbatches=8))}
    assert not rows["1f1b/uniform"].scored.fits
    row = rows["1f1b/uniform+recompute"]
    assert row.scored.fits and row.candidate.recompute == {0, 1}
    assert row.candidate.recompute_layers == ((0, 4), (1, 4))
    assert row.candidate.origin == "1f1b/uniform+recompute (first 4 layers per stage)"
    evaluator = Evaluator(profile, cluster)
    assert evaluator.simulate(row.candidate).peak_activation_bytes[0] == 120 * GB
    three = replace(row.candidate, recompute_layers=((0, 3), (1, 3)))
    assert evaluator.simulate(three).peak_activation_bytes[0] == 130 * GB  # one layer fewer does not fit


def test_a_layer_count_that_a_boundary_shift_made_whole_is_written_as_the_whole_stage(tmp_path):
    from octoplan.tuner.space import Candidate, Config

    # stage 1 recomputes 3 of its 4 layers; a shift leaves it 3 layers: all of them recompute
    cand = Candidate(Config(2, 1, 8), (0, 4, 8), (0, 1), None, recompute=frozenset({1}), recompute_layers=((1, 3),))
    assert cand.stages()[1] == Stage(4, 8, 1, recompute=True, recompute_layers=3)
    shifted = replace(cand, bounds=(0, 5, 8))
    assert shifted.stages()[1] == Stage(5, 8, 1, recompute=True)  # a valid plan stage, not 3 of 3
    assert shifted.recomputed_layers(1) == 3 and cand.recomputed_layers(0) == 0


def test_a_shift_that_makes_a_stage_no_longer_than_its_count_drops_the_count():
    import random

    from octoplan.tuner.moves import neighbours
    from octoplan.tuner.space import Candidate, Config, Evaluator

    # stage 1 (layers 4..8) recomputes its first 3: shifting boundary 1 by +1 leaves it 3 layers,
    # all recomputed, and the candidate says so (not a hidden 3 that a later shift would revive)
    from octoplan.schedules import get_schedule

    profile = _memory_bound_profile()
    order = tuple(tuple(ops) for ops in get_schedule("1f1b").generate(2, 8, 2))
    cand = Candidate(Config(2, 1, 8), (0, 4, 8), (0, 1), None, order, "1f1b", "1f1b", recompute=frozenset({1}),
                     recompute_layers=((1, 3),))
    result = Evaluator(profile, free_cluster(2, memory_gb=1000)).simulate(cand)
    shifted = next(m for m in neighbours(cand, result, rng=random.Random(0)) if m.origin == "shift boundary 1 by +1")
    assert shifted.bounds == (0, 5, 8) and shifted.recompute == {1} and shifted.recompute_layers == ()
    with pytest.raises(ValueError, match="recompute at least 1 layer"):
        Stage(0, 4, 0, recompute=True, recompute_layers=0)


def test_tune_table_names_the_layers_a_recompute_baseline_recomputes(tmp_path, profile_file):
    from typer.testing import CliRunner

    from octoplan.cli import app

    # as in the bisection test above: 1F1B/uniform fits 125 GB with each stage's first 4 of 8 layers recomputed
    path = profile_file(_sixteen_layers())
    result = CliRunner().invoke(app, ["compare", str(path), "--gpus", "2", "--pp", "2", "--microbatches", "8",
                                      "--memory-gb", "125", "--max-plans", "200"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "1f1b/uniform+recompute (first 4 layers)" in result.output
