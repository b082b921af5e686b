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
    # 1F1B on 2 ranks, 4 microbatches: rank 0 holds 2 x 40 GB without; with, 2 x 0.01 + one 40 GB rebuild
    assert a.peak_memory_bytes[0] == 80 * GB
    assert b.peak_memory_bytes[0] == pytest.approx(40 * GB, rel=1e-3)


def test_export_notes_the_recomputing_stages(tmp_path):
    from typer.testing import CliRunner

    from octoplan.cli import app

    plan = _one_rank_plan("0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1", recompute=True)
    save_plan(plan, tmp_path / "p.yaml")
    result = CliRunner().invoke(app, ["export", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "p.csv")])
    assert result.exit_code == 0, result.output
    assert "stages 1 recompute their activations" in result.output and "torch.utils.checkpoint" in result.output
    assert (tmp_path / "p.csv").read_text().splitlines()[0].startswith("0F0")


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
    # three 20 GB rebuilds while their Ws wait. 61 GB per GPU: either rank keeping all its
    # activations needs 80 GB, but keeping one stage's (the rank's later one first) fits
    profile = _memory_bound_profile()
    spec = get_schedule("zbv")
    order = tuple(tuple(ops) for ops in spec.generate(2, 8, 2))
    start = Candidate(Config(2, 1, 8), (0, 2, 4, 6, 8), tuple(spec.placement(2, 4)), None, order, "zbv", "zbv",
                      recompute=frozenset(range(4)))
    evaluator = Evaluator(profile, free_cluster(2, memory_gb=61))
    result = evaluator.simulate(start)
    assert result.fits_memory and [p / GB for p in result.peak_memory_bytes] == [20, 60]
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

    # stages 0..4, stages 1 and 3 recompute
    flags = frozenset({1, 3})
    assert _renumbered(flags, split=1) == {1, 2, 4}  # both halves of stage 1; stage 3 is now 4
    assert _renumbered(flags, split=2) == {1, 4}
    assert _renumbered(flags, merged=1) == {1, 2}  # stages 1 + 2 recompute as one; 3 is now 2
    assert _renumbered(flags, merged=3) == {1, 3}  # stages 3 + 4: the merged stage keeps it
    assert _renumbered(flags, merged=0) == {0, 2}  # stages 0 + 1 merged: recomputes, as 1 did
    assert _renumbered(frozenset(), merged=0) == frozenset()
