"""The tuner end to end: valid plans, never worse than the best baseline, memory, determinism."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from octoplan.cli import app
from octoplan.errors import InputError
from octoplan.plan import Cluster, check_structure, load_plan, plan_to_dict
from octoplan.simulator import simulate
from octoplan.tuner import TuneOptions, compare_baselines, configs_for, tune
from octoplan.yamlio import file_sha256
from tests.conftest import free_cluster, make_profile

KINDS = ["embedding"] + ["layer"] * 10 + ["head"]


def heavy_head(head_params: int = 10**6, block_params: int = 10**6):
    """An embedding, ten equal blocks and a head six times a block (a large vocabulary)."""
    profile = make_profile([(0.5, 0.5, 0.5)] + [(1, 1, 1)] * 10 + [(6, 6, 6)], act=10**6, out=10**6,
                           params=block_params, kinds=KINDS)
    layers = list(profile.layers)
    layers[-1] = layers[-1].__class__(**{**layers[-1].__dict__, "param_bytes": head_params})
    return profile.with_layers(layers)


@pytest.fixture(scope="module")
def tuned():
    # a plan budget keeps the result independent of the clock and the tune short: 600 plans
    # reach the optimum that the search's convergence finds (about 20 s a tune)
    return tune(heavy_head(), free_cluster(4), TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=120, seed=0,
                                                           max_plans=600))


def test_tuned_plan_is_valid_and_its_prediction_reproduces(tuned):
    profile = heavy_head()
    check_structure(tuned.plan, num_layers=profile.num_layers)
    result = simulate(tuned.plan, profile)  # no DeadlockError
    assert result.iteration_ms == pytest.approx(tuned.plan.predicted["iteration_ms"], abs=1e-3)
    assert result.fits_memory
    assert set(tuned.plan.predicted) == {"iteration_ms", "bubble_ratio", "efficiency", "peak_activation_bytes",
                                         "peak_with_message_bytes"}
    assert tuned.plan.predicted["peak_activation_bytes"] == list(result.peak_activation_bytes)
    # tapes and messages together: the peak less what weights and optimizer state take
    assert tuned.plan.predicted["peak_with_message_bytes"] == [
        peak - static for peak, static in zip(result.peak_memory_bytes, result.static_memory_bytes)]
    assert tuned.plan.extra["tuner"]["seed"] == 0


def test_the_tuned_order_is_proven_optimal_for_its_stages_and_placement(tuned):
    # the head (6 + 6 + 6 ms) is alone on the last rank: 8 x 18 = 144 ms of work, which cannot
    # start before microbatch 0 crossed the three stages before it (2.5 + 3 + 5 ms here), so no
    # order of this layout beats 154.5 ms, and the tuned order takes exactly that
    stages = [(s.start, s.end) for s in tuned.plan.stages]
    assert stages[-1] == (11, 12) and sum(heavy_head().layers[i].forward_ms for i in range(11)) == 10.5
    assert tuned.stats["order_bound_ms"] == tuned.plan.predicted["iteration_ms"] == 154.5
    # where the time goes: the head's rank carries 8 x 18 = 144 ms, FORMATS.md section 7's lower bound
    # (the largest layer's work; the even share is 8 x 49.5 / 4 = 99), so the balance is 1; it
    # idles only the 10.5 ms before microbatch 0 reaches it: schedule 144 / 154.5
    stats = tuned.stats
    assert stats["busiest_rank"] == tuned.plan.stages[-1].rank and stats["busiest_busy_ms"] == 144
    assert stats["lower_bound_ms"] == 144
    assert stats["balance"] == 1.0 and stats["schedule"] == round(144 / 154.5, 6)
    assert stats["busiest_idle_ms"] == {"warm_up": 10.5, "between": 0.0, "drain": 0.0}


def test_heavy_head_beats_megatron_1f1b_clearly(tuned):
    rows = {row.name: row.scored.iteration_ms for row in tuned.baselines}
    # 1F1B, uniform: the last stage holds 2 blocks + the head = 24 ms per microbatch; the first
    # microbatch reaches it after 3.5 + 3 + 2 ms of forwards, it then runs 8 x 24 ms, and the
    # last gradient drains back through 4 + 6 + 7 ms of backwards: 217.5 ms
    assert rows["1f1b/uniform"] == pytest.approx(217.5)
    # the head alone on a rank bounds any plan below by 8 x 18 = 144 ms; the tuned plan
    # (the head alone, I/W split, Ws deferred into the drain) gets within 10.5 ms of that
    assert tuned.scored.iteration_ms == pytest.approx(154.5)
    assert rows["1f1b/uniform"] / tuned.scored.iteration_ms > 1.4


def test_never_worse_than_the_best_fitting_baseline(tuned):
    best = tuned.best_baseline()
    assert best is not None
    assert tuned.scored.iteration_ms <= best.scored.iteration_ms + 1e-9
    # every baseline of FORMATS.md section 6 that applies is in the table (dualpipev needs 2pp = 8 mbs)
    names = {row.name for row in tuned.baselines}
    assert {"gpipe/uniform", "1f1b/uniform", "interleaved-1f1b/uniform", "zb-h1/balanced", "zb-h2/uniform",
            "zbv/balanced", "dualpipev/uniform"} <= names


def test_same_seed_same_plan():
    # run to convergence (about 5 s a tune, far inside its limit), not to a plan budget
    opts = TuneOptions(gpus=4, pp=2, microbatches=4, time_limit_s=120, seed=3)
    first = tune(heavy_head(), free_cluster(4), opts)
    second = tune(heavy_head(), free_cluster(4), opts)
    strip = lambda plan: {k: v for k, v in plan_to_dict(plan).items() if k != "tuner"}
    assert strip(first.plan) == strip(second.plan)
    assert first.stats["evaluations"] == second.stats["evaluations"]


def test_a_plan_budget_makes_the_search_independent_of_the_clock():
    # A larger profile whose search would not converge in the budget: with --max-plans the
    # stopping point is counted in plans, so two runs agree even though their timings differ.
    opts = TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=1.0, max_plans=150, seed=5)
    first = tune(heavy_head(), free_cluster(4), opts)
    second = tune(heavy_head(), free_cluster(4), opts)
    strip = lambda plan: {k: v for k, v in plan_to_dict(plan).items() if k != "tuner"}
    assert strip(first.plan) == strip(second.plan)
    assert first.stats["evaluations"] == second.stats["evaluations"]
    assert first.stats["evaluations"] <= 150 + 60  # the budget, plus the climb step that crossed it


def test_fits_memory_when_a_plan_can():
    # the head's 1e9 fp32 bytes of weights need 4 GB of weights, gradients and Adam state, a
    # block's 1e8 bytes 0.4 GB; with 4.5 GB per GPU the uniform split (head + 2 blocks, 4.8 GB)
    # does not fit, the head alone does
    profile = heavy_head(head_params=10**9, block_params=10**8)
    cluster = free_cluster(4, memory_gb=4.5)
    result = tune(profile, cluster, TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=20, use_cpsat=False, max_plans=600))
    rows = {row.name: row.scored for row in result.baselines}
    assert not rows["1f1b/uniform"].fits
    assert result.scored.fits
    assert max(simulate(result.plan, profile).peak_memory_bytes) <= 4.5e9


def test_nothing_fits_names_the_least_memory():
    profile = heavy_head(head_params=10**9)
    with pytest.raises(InputError) as info:
        tune(profile, free_cluster(4, memory_gb=1.0),
             TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=10, use_cpsat=False, max_plans=600))
    assert "no plan fits 1 GB per GPU; the leanest plan found needs 4" in str(info.value)
    assert info.value.field == "--memory-gb"
    assert "left unpriced" not in str(info.value)  # every baseline was priced: memory is the whole story


def test_nothing_fits_within_a_budget_that_left_baselines_unpriced_says_so():
    """llama3-8b on 8 H100s with --max-plans 1: the plan priced first needs 167 GB, and more
    memory was the only fix offered, though a fitting baseline lay beyond the budget."""
    from octoplan.arch import analytic_profile

    with pytest.raises(InputError) as info:
        tune(analytic_profile("llama3-8b", "h100"), Cluster(gpus=8, memory_gb=80), TuneOptions(gpus=8, max_plans=1))
    assert info.value.field == "--memory-gb"
    assert "baselines were left unpriced by the budget, and one of them may fit: give a larger --max-plans" in info.value.fix


def test_configs_follow_the_global_batch():
    profile = heavy_head()
    configs = configs_for(profile, TuneOptions(gpus=4, global_batch=16))
    # pp 1 and pp 4 (dp 1) number ranks alike in both orders
    assert [(c.pp, c.dp, c.microbatches, c.rank_order) for c in configs] == [
        (1, 4, 4, "pp-inner"), (2, 2, 8, "pp-inner"), (2, 2, 8, "dp-inner"), (4, 1, 16, "pp-inner"),
    ]
    # given the cluster, a second rank order is searched only where it puts other ranks on
    # shared nodes: 2 nodes of 2 GPUs, not 1 node of 4 nor 4 nodes of 1
    def orders(gpus_per_node: int, rank_order: str | None = None) -> list[tuple[int, str]]:
        cluster = Cluster(gpus=4, gpus_per_node=gpus_per_node)
        opts = TuneOptions(gpus=4, global_batch=16, rank_order=rank_order)
        return [(c.pp, c.rank_order) for c in configs_for(profile, opts, cluster)]

    assert orders(2) == [(c.pp, c.rank_order) for c in configs]
    assert orders(4) == orders(1) == [(1, "pp-inner"), (2, "pp-inner"), (4, "pp-inner")]
    assert orders(4, "dp-inner") == [(1, "dp-inner"), (2, "dp-inner"), (4, "pp-inner")]  # as asked
    with pytest.raises(InputError):
        configs_for(profile, TuneOptions(gpus=4, pp=3))
    with pytest.raises(InputError):
        configs_for(profile, TuneOptions(gpus=4, global_batch=16, microbatches=4))
    with pytest.raises(InputError, match="--time-limit"):
        tune(profile, free_cluster(4), TuneOptions(gpus=4, time_limit_s=0))


def test_where_ops_cost_nothing_a_near_tie_goes_to_the_plan_of_fewest_stages():
    """pp 1 on the hybrid example's H200 profile: the fastest plans cut the 4 replicas' model into
    several stages (interleaved 1F1B with 10 chunks, the search's own of 9), whose gradients'
    all-reduces overlap more, 0.05% faster, and only because each extra op is free. Without a
    priced per-op cost the tie goes to one stage (a plan every framework runs); with one
    (calibrated), the search's own choice stands."""
    from octoplan.profile import load_profile

    profile = load_profile(Path(__file__).resolve().parents[1] / "profiles" / "h200" / "hybrid.yaml")
    opts = TuneOptions(gpus=4, pp=1, max_plans=300)
    result = tune(profile, Cluster(gpus=4), opts)
    fastest = min((row for row in result.baselines if row.scored.fits), key=lambda row: row.scored.judged_ms)
    assert fastest.name == "interleaved-1f1b(v=10)/balanced" and result.candidate.num_stages == 1
    assert fastest.scored.iteration_ms < result.scored.iteration_ms <= fastest.scored.iteration_ms * 1.001
    assert result.configs[0] == (result.candidate, result.scored)  # the configurations' table shows the plan written
    assert "torchtitan" in result.runs_on and "torchtitan" not in _runs_on(profile, fastest.candidate)
    from octoplan.tuner.cli import _verdict  # the line under tune's table says why a baseline is faster

    assert _verdict(result, 141).endswith("the tuned plan is 1.001x slower: a tie within 0.1% goes to the plan of "
                                          "fewer stages where no per-op cost is given (--op-overhead-us), whose extra "
                                          "ops would cost more than that")
    priced = tune(profile, Cluster(gpus=4, op_overhead_us=1.0), opts)
    assert priced.candidate.num_stages > 1 and priced.scored == priced.configs[0][1]


def _runs_on(profile, cand) -> tuple[str, ...]:
    from octoplan.tuner.frameworks import Frameworks

    return Frameworks(profile).runs_on(cand)


def test_the_final_plans_work_is_kept_out_of_the_search_by_its_size():
    """The search leaves the final plan's work (its stats, quick bound and file) 20 us per op of
    the largest configuration's plan of as many stages per rank as its layouts hold (3, or
    --chunks-max, or as many as the layers allow), at most a quarter of the limit, and nothing
    under --max-plans, whose plans must not depend on the machine."""
    from octoplan.tuner.search import final_work_s
    from octoplan.tuner.space import Config

    configs = [Config(4, 1, 4096), Config(2, 2, 2048)]
    one_stage = 4 * 4096 * 3 * 2e-5  # 0.98 s for 4 ranks of one stage each
    assert final_work_s(configs, TuneOptions(gpus=4, time_limit_s=60), 12) == pytest.approx(3 * one_stage)
    assert final_work_s(configs, TuneOptions(gpus=4, time_limit_s=60, chunks_max=2), 12) == pytest.approx(2 * one_stage)
    assert final_work_s(configs, TuneOptions(gpus=4, time_limit_s=60), 4) == pytest.approx(one_stage)  # a layer a rank
    assert final_work_s(configs, TuneOptions(gpus=4, time_limit_s=5), 12) == pytest.approx(1.25)  # a quarter of 5 s
    assert final_work_s([Config(4, 1, 8)], TuneOptions(gpus=4, time_limit_s=60), 4) == pytest.approx(96 * 2e-5)
    assert final_work_s(configs, TuneOptions(gpus=4, time_limit_s=5, max_plans=100), 12) == 0.0


def test_max_plans_writes_the_same_plan_file_byte_for_byte(tmp_path):
    # it differed in the tuner's wall seconds and in a time limit less the wall time spent
    # before the search: a diff or a hash could not show that two runs agree
    runner = CliRunner()
    profile = Path(__file__).resolve().parents[1] / "profiles" / "h200" / "tiny_gpt.yaml"
    args = ["tune", str(profile), "--gpus", "4", "--pp", "2", "--max-plans", "80"]
    files = []
    for run in ("a", "b"):
        out = tmp_path / f"{run}.yaml"
        result = runner.invoke(app, [*args, "-o", str(out)])
        assert result.exit_code == 0, result.output
        files.append(out.read_bytes())
    assert files[0] == files[1]
    assert b"wall_s" not in files[0] and b"time_limit_s: 60" in files[0]


def test_cli_tune_writes_a_plan_and_compare_prints_the_table(profile_file, tmp_path):
    path = profile_file(heavy_head())
    out = tmp_path / "plan.yaml"
    runner = CliRunner()
    args = [str(path), "--gpus", "4", "--pp", "4", "--microbatches", "8", "--time-limit", "20",
            "--latency-us", "0", "--intra-node-gbps", "1e12", "--inter-node-gbps", "1e12", "--max-plans", "600"]
    result = runner.invoke(app, ["tune", *args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.profile == str(path)
    assert plan.profile_sha256 == file_sha256(path)
    assert plan.predicted["iteration_ms"] == pytest.approx(154.5)
    assert "beats 154.50 ms, so reordering could save at most 0.0%" in " ".join(result.output.split())
    assert ("efficiency 0.932 = balance 1.000 (the busiest rank, 3, works 144.00 ms; the lower bound is 144.00) x "
            "schedule 0.932 (rank 3 idles 10.50 ms before its first op, 0.00 between its ops, 0.00 after its last)"
            ) in " ".join(result.output.split())
    # the layers' balance cap (octoplan.tuner.caps): this plan's balance already reaches it
    assert ("no layout of these layers balances 4 ranks better than 1.000 (proven); the tuned plan is at it"
            ) in " ".join(result.output.split())
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0
    compare = runner.invoke(app, ["compare", *args])
    assert compare.exit_code == 0, compare.output
    assert "1f1b/uniform" in compare.output and "tuned" in compare.output
    verdict = re.search(r"fastest baseline that fits: (\S+) \(.*\), ([\d.]+) ms; the tuned plan is ([\d.]+)x faster",
                        " ".join(compare.output.split()))
    assert verdict is not None, compare.output
    assert float(verdict.group(3)) == pytest.approx(float(verdict.group(2)) / 154.5, abs=1e-3)
    assert f"│ {verdict.group(1)} " in compare.output  # a row of the table above it
    failed = runner.invoke(app, ["tune", str(path), "--gpus", "4", "--pp", "3", "-o", str(out)])
    assert failed.exit_code == 2
    assert "--pp" in failed.output


def test_justification_closes_bubbles_the_policy_knobs_leave():
    # deepseek-v3 in small: a light embedding, a heavy head, short Ws. Rank loads allow 80 ms
    # (ZB-V's rank 0 holds the embedding and the head: 10 ms per microbatch); the best
    # policy-scheduled plan the knobs reach takes 87 ms. Justifying its order (W moved into
    # bubbles, forwards pulled ahead) gives 85.
    profile = make_profile([(1, 1, 0)] + [(2, 2, 1)] * 6 + [(3, 3, 2)], act=10**6, out=10**6, params=10**6)
    result = tune(profile, free_cluster(4), TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=60,
                                                         max_plans=400, seed=0))
    assert result.scored.iteration_ms == pytest.approx(85.0)
    assert "justified" in result.candidate.origin
    assert simulate(result.plan, profile).iteration_ms == pytest.approx(85.0)


def test_a_climb_in_a_worker_process_is_the_climb_in_this_one():
    # One climb, from Megatron's 1F1B (217.5 ms), handed to a pool of 2 processes: with time
    # to spare it reaches the same local optimum, move for move, as the same climb (same seed)
    # run here, and the main process prices what comes back itself.
    import random

    from octoplan.tuner.pool import Climb, climb_in_parallel
    from octoplan.tuner.search import _Search
    from octoplan.tuner.space import Evaluator

    profile, cluster = heavy_head(), free_cluster(4)
    opts = TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=120, seed=7, workers=2)
    start = next(row.candidate for row in compare_baselines(profile, cluster, opts) if row.name == "1f1b/uniform")
    here = _Search(Evaluator(profile, cluster), opts, None)
    here.rng = random.Random(7 * 1_000_003)  # the pool seeds its first climb so
    local = here.climb(start, deadline=120)
    assert here.ev.score(local).iteration_ms < 217.5 - 10 and here.accepted_moves

    pooled = _Search(Evaluator(profile, cluster), opts, None)
    assert climb_in_parallel(pooled, profile, cluster, opts, [Climb(start, True)], end_s=120) == 1
    assert pooled.best == local and pooled.best.ranks == local.ranks
    assert pooled.best_scored == here.ev.score(local)
    assert pooled.accepted_moves == here.accepted_moves
    assert pooled.extra_plans > 0 and pooled.ev.evaluations == 1  # the main process priced the result only


def test_workers_tune_to_the_proven_optimum_and_count_their_plans():
    result = tune(heavy_head(), free_cluster(4), TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=120, workers=2))
    assert result.scored.iteration_ms == pytest.approx(154.5)
    check_structure(result.plan, num_layers=heavy_head().num_layers)
    assert result.stats["workers"] == 2 and result.stats["moves_accepted"] > 0
    assert result.stats["climbs"] > 2 and result.stats["plans_in_workers"] > 0
    # the workers draw from one plan budget: a climb may price its start beyond its share, and
    # the main process prices each climb's end again, so the search stops within 2 per climb
    for workers in (2, 4):
        budget = tune(heavy_head(), free_cluster(4), TuneOptions(gpus=4, pp=4, microbatches=8, time_limit_s=1.0,
                                                                 max_plans=300, seed=5, workers=workers))
        assert budget.stats["plans_in_workers"] > 0
        assert budget.stats["evaluations"] <= 300 + 2 * budget.stats["climbs"]


def test_cli_rejects_zero_workers(profile_file, tmp_path):
    path = profile_file(heavy_head())
    result = CliRunner().invoke(app, ["tune", str(path), "--gpus", "4", "--workers", "0", "-o", str(tmp_path / "plan.yaml")])
    assert result.exit_code == 2
    assert "--workers" in result.output and "at least 1" in result.output
    assert not (tmp_path / "plan.yaml").exists()


def _compound_case():
    """ZB-V on 4 ranks, 4 microbatches, 9 uneven layers, its partition jittered: a climb whose
    plain moves stop at 100 ms (found by a seeded random search over small cases)."""
    from octoplan.baseline import make_baseline
    from octoplan.tuner.space import Candidate, Config, Evaluator

    layers = [(4, 2, 2), (2, 4, 1), (1, 3, 2), (4, 3, 3), (3, 4, 2), (4, 4, 3), (2, 2, 1), (2, 2, 1), (3, 1, 2)]
    profile, cluster = make_profile(layers), free_cluster(4)
    zbv = make_baseline(profile, schedule="zbv", gpus=4, microbatches=4, cluster=cluster)
    start = Candidate(Config(4, 1, 4), (0, 1, 2, 3, 4, 6, 7, 8, 9), tuple(s.rank for s in zbv.stages), None,
                      tuple(tuple(ops) for ops in zbv.schedule), "jittered zbv", "jittered zbv")
    return Evaluator(profile, cluster), start


def test_a_layer_shifted_with_its_order_justified_gets_past_a_local_optimum():
    # Plain moves (a boundary shift in the old order, reorders, the whole order justified)
    # stop at 100 ms. A shift followed by a justification, tried at that local optimum, goes
    # on to 87 ms; without it (a limit of 0 shifts) the same climb ends at 100. (The
    # rebuilt orders, off here to isolate the compound move, take the climb with it further.)
    from octoplan.tuner.climb import Search
    from octoplan.tuner.neighbourhoods import (COMPOUND_SHIFTS, NEIGHBOURHOODS, BottleneckOrder,
                                               LongestTailOrder, ShiftedAndJustified)

    ends = {}
    for shifts in (0, COMPOUND_SHIFTS):
        chosen = [ShiftedAndJustified(shifts) if isinstance(n, ShiftedAndJustified) else n
                  for n in NEIGHBOURHOODS if not isinstance(n, (BottleneckOrder, LongestTailOrder))]
        evaluator, start = _compound_case()
        climber = Search(evaluator, TuneOptions(gpus=4, pp=4, microbatches=4, time_limit_s=600,
                                                dimensions=("partition", "schedule")), None, neighbourhoods=chosen)
        end = climber.climb(start, deadline=600)
        ends[shifts] = (evaluator.score(end).iteration_ms, climber.accepted_moves)
    assert ends[0][0] == 100.0
    assert ends[COMPOUND_SHIFTS][0] == 87.0
    assert any(move.startswith("shift boundary") and move.endswith("justified") for move in ends[COMPOUND_SHIFTS][1])


def test_the_shifts_worth_justifying_move_a_layer_off_a_hotter_rank():
    from octoplan.tuner.moves import heat_of, shifts_off_hot_ranks

    evaluator, start = _compound_case()
    result = evaluator.timeline(start)
    heat = heat_of(result)
    # every stage but stage 4 (layers 4 and 5) holds one layer, so only stage 4 can give one:
    # to stage 3, on the same rank (the V's turn), which changes no rank's load, or to stage 5
    # on a cooler rank, the one move worth a justification
    shifts = shifts_off_hot_ranks(start, result, limit=5)
    assert [moved.origin for moved in shifts] == ["shift boundary 5 by -1"]
    moved = shifts[0]
    assert moved.bounds == (0, 1, 2, 3, 4, 5, 7, 8, 9) and moved.ranks == start.ranks and moved.fixed == start.fixed
    giver, taker = start.ranks[4], start.ranks[5]
    assert start.ranks[3] == giver and heat.heat(giver) > heat.heat(taker)
    assert shifts_off_hot_ranks(start, result, limit=0) == []


def test_a_cheaper_fused_backward_makes_the_tuner_keep_b_whole():
    # One rank: a split plan costs 4 x (F + I + W), a fused one 4 x (F + B). With B at 0.6 of
    # I + W (as measured on a GPU for launch-bound layers) only plain B ops are optimal:
    # 4 x (16.5 + 0.6 x 33) = 145.2 ms, where I + W would cost 4 x 49.5 = 198 ms.
    from dataclasses import replace

    profile = heavy_head()
    profile = profile.with_layers([replace(l, backward_ms=0.6 * (l.backward_input_ms + l.backward_weight_ms))
                                   for l in profile.layers])
    result = tune(profile, free_cluster(1), TuneOptions(gpus=1, pp=1, microbatches=4, time_limit_s=60, seed=0))
    assert result.plan.predicted["iteration_ms"] == pytest.approx(145.2)
    assert result.plan.predicted["efficiency"] == pytest.approx(1.0)  # the bound takes the fused backward too
    assert {op.kind.value for ops in result.plan.schedule for op in ops} == {"F", "B"}
    rows = {row.name: row.scored.iteration_ms for row in result.baselines}
    assert rows["zb-h1/uniform"] == pytest.approx(198.0)  # the split baseline pays I + W


def test_the_verdict_says_when_no_baseline_fits():
    from types import SimpleNamespace

    from octoplan.tuner.cli import _verdict

    result = SimpleNamespace(best_baseline=lambda: None)
    assert _verdict(result, 80.0) == "no baseline fits 80 GB per GPU; the tuned plan does"


def test_the_verdict_calls_a_slower_tuned_plan_slower_and_says_why():
    """--runs-on v confines the plan to V placements, which the fastest baseline is not: the
    verdict read "0.895x faster: the search found nothing faster than this baseline"."""
    from types import SimpleNamespace

    from octoplan.tuner.cli import _verdict

    baseline = SimpleNamespace(name="1f1b/balanced", candidate=SimpleNamespace(recompute_layers=()),
                               config=SimpleNamespace(label=lambda: "pp=4 dp=2"),
                               scored=SimpleNamespace(judged_ms=90.0, iteration_ms=90.0), allowed=False)
    for confined, why in (("v", "--runs-on v confines it to plans that framework runs, and this baseline is not one"),
                          ("any", "the search did not reach this baseline's layout within its budget")):
        result = SimpleNamespace(best_baseline=lambda: baseline, scored=SimpleNamespace(judged_ms=100.0, samples=1),
                                 stats={"runs_on": confined})
        assert _verdict(result, 80.0) == ("fastest baseline that fits: 1f1b/balanced (pp=4 dp=2), 90.00 ms; the tuned "
                                          f"plan is 1.111x slower: {why}")
    # within the near tie, the cause is --runs-on where it refuses the baseline, the tie where it allows it
    tie = ": a tie within 0.1% goes to the plan of fewer stages"
    result.scored.judged_ms = 90.05
    for confined, allowed, why in (("v", False, ": --runs-on v confines"), ("v", True, tie), ("any", True, tie)):
        baseline.allowed = allowed
        result.stats = {"runs_on": confined, "near_tie": True}
        assert why in _verdict(result, 80.0), (confined, allowed)
    result.scored.judged_ms = 90.0
    assert _verdict(result, 80.0).endswith("1.000x faster: the search found nothing faster than this baseline")


def test_the_baselines_have_every_interleaved_chunk_count_the_layers_allow():
    # 8 layers of F = I = W = 1 ms on 2 ranks, 2 microbatches, free links. Interleaved 1F1B with
    # v chunks per rank takes (m v + p - 1) chunk times of 12 / v ms (a chunk's F + B):
    # 24 + 12 / v, so 30 ms with the default 2 chunks and 27 with 4 (a layer each); 5 chunks
    # would need 10 layers.
    profile, cluster = make_profile([(1, 1, 1)] * 8), free_cluster(2)
    opts = TuneOptions(gpus=2, pp=2, microbatches=2, max_plans=200)
    rows = {row.name: row.scored for row in compare_baselines(profile, cluster, opts)}
    assert {name for name in rows if name.startswith("interleaved-1f1b")} == {
        f"interleaved-1f1b{v}/{partition}" for v in ("", "(v=3)", "(v=4)") for partition in ("uniform", "balanced")}
    assert rows["interleaved-1f1b/uniform"].iteration_ms == pytest.approx(30.0)
    assert rows["interleaved-1f1b(v=4)/uniform"].iteration_ms == pytest.approx(27.0)
    # 4 chunks is the fastest baseline here (ZB-H1 takes 28 ms), and more than the search's
    # own layouts hold by default: the tuned plan is still never slower than it
    assert min(s.iteration_ms for s in rows.values() if s.fits) == pytest.approx(27.0)
    assert tune(profile, cluster, opts).scored.iteration_ms <= 27.0 + 1e-9
    # a given --chunks-max bounds the baselines too
    capped = {row.name for row in compare_baselines(profile, cluster, TuneOptions(gpus=2, pp=2, microbatches=2, chunks_max=3))}
    assert "interleaved-1f1b(v=3)/uniform" in capped and not any("(v=4)" in name for name in capped)
    # --chunks-max 1: no baseline of two stages per rank (interleaved, ZB-V, DualPipe-V), and no
    # tuned plan either, though the fastest seeds hold several (27 ms against 1F1B's 36)
    one = TuneOptions(gpus=2, pp=2, microbatches=2, chunks_max=1, max_plans=200)
    assert {row.name.split("/")[0] for row in compare_baselines(profile, cluster, one)} == {"gpipe", "1f1b", "zb-h1",
                                                                                             "zb-h2"}
    tuned = tune(profile, cluster, one)
    assert [stage.rank for stage in tuned.plan.stages] == [0, 1]
    with pytest.raises(InputError, match="--chunks-max: is 1, and --runs-on v places two stages on every rank"):
        tune(profile, cluster, replace(one, runs_on="v"))


def test_the_baselines_take_at_most_half_the_budget_the_most_run_first():
    # the 16 baselines of the test above, one plan each. Under --max-plans 8 the clock counts
    # plans, and the baselines stop at half of it (4 plans): 1F1B and interleaved 1F1B of 2
    # chunks, each with both partitions, priced in that order; the other 12 are left out and
    # counted. (On 4096 microbatches pricing them all took 28 s of a 5 s --time-limit.)
    from octoplan.schedules import SCHEDULES
    from octoplan.tuner.seeds.baselines import PRICING_ORDER

    assert sorted(PRICING_ORDER) == sorted(SCHEDULES)  # every schedule has its place
    profile, cluster = make_profile([(1, 1, 1)] * 8), free_cluster(2)
    cut = tune(profile, cluster, TuneOptions(gpus=2, pp=2, microbatches=2, max_plans=8))
    assert [row.name for row in cut.baselines] == ["1f1b/uniform", "1f1b/balanced", "interleaved-1f1b/uniform",
                                                   "interleaved-1f1b/balanced"]
    assert cut.stats["baselines_unpriced"] == 12
    whole = tune(profile, cluster, TuneOptions(gpus=2, pp=2, microbatches=2, max_plans=200))
    assert len(whole.baselines) == 16 and whole.stats["baselines_unpriced"] == 0
    assert [row.name for row in whole.baselines][:4] == ["gpipe/uniform", "gpipe/balanced", "1f1b/uniform", "1f1b/balanced"]


def test_the_table_shows_the_default_chunk_count_and_the_fastest_other():
    from octoplan.tuner.cli import shown_rows

    def row(plan, ms, fits=True):
        return {"plan": plan, "iteration_ms": ms, "fits": fits}

    rows = [row("tuned", 20), row("interleaved-1f1b/uniform", 30), row("interleaved-1f1b(v=3)/uniform", 28),
            row("interleaved-1f1b(v=4)/uniform", 27), row("interleaved-1f1b(v=5)/uniform", 26, fits=False),
            row("interleaved-1f1b(v=3)/balanced", 29, fits=False), row("interleaved-1f1b(v=4)/balanced", 31, fits=False),
            row("interleaved-1f1b(v=3)/balanced+recompute (first 2 layers)", 39),
            row("interleaved-1f1b(v=4)/balanced+recompute (first 1 layers)", 38), row("zbv/uniform", 25)]
    # per partition, the fastest count above 2 that fits; where none fits, the fastest
    assert [r["plan"] for r in shown_rows(rows)] == [
        "tuned", "interleaved-1f1b/uniform", "interleaved-1f1b(v=4)/uniform", "interleaved-1f1b(v=3)/balanced",
        "interleaved-1f1b(v=4)/balanced+recompute (first 1 layers)", "zbv/uniform"]


def test_nothing_allowed_fits_names_the_options_that_confine_the_search():
    """Plans that fit were priced, but --runs-on or --chunks-max let the search keep none: the
    line names those options, and the budget only where it ran out."""
    from types import SimpleNamespace

    from octoplan.tuner.search import _best_that_fits

    def search(runs_on, stage_cap, out):
        return SimpleNamespace(best=None, best_scored=None, stage_cap=stage_cap,
                               opts=SimpleNamespace(max_plans=None, runs_on=runs_on, recompute=True),
                               ev=SimpleNamespace(least_memory=lambda: 52e9, cluster=Cluster(gpus=2, memory_gb=80)),
                               clock=SimpleNamespace(out=lambda: out))

    with pytest.raises(InputError) as info:
        _best_that_fits(search("megatron", None, True), "p.yaml")
    assert (info.value.field, info.value.problem, info.value.fix) == (
        "--time-limit", "no plan that --runs-on megatron allows was found that fits 80 GB per GPU; plans it does not "
        "allow fit in 52 GB", "give a longer --time-limit, or tune without --runs-on megatron")
    with pytest.raises(InputError) as info:
        _best_that_fits(search("any", 1, False), "p.yaml")
    assert (info.value.field, info.value.problem, info.value.fix) == (
        "--memory-gb", "no plan that --chunks-max 1 allows fits 80 GB per GPU; plans it does not allow fit in 52 GB",
        "use more GPUs or a larger --memory-gb, or tune without --chunks-max 1")
