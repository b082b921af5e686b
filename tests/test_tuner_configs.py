"""The whole configuration for a global batch (octoplan.tuner.configs): microbatch sizes
compared on the same batch, every configuration's time in parts, and why the next best lost."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from octoplan.cli import app
from octoplan.costs import allreduce_ms
from octoplan.errors import InputError
from octoplan.plan import Cluster, Parallel, load_plan
from octoplan.tuner import TuneOptions
from octoplan.tuner.configs import TIME_PARTS, ConfigRow, time_parts, tune_global_batch, why_slower
from octoplan.tuner.space import Candidate, Config, Evaluator, Scored
from tests.conftest import make_profile

PARAMS = 10**8  # bytes per layer: a 2-GPU ring moves 2 x 10^8 bytes at 100 GB/s in 2 ms


def two_layers(scale: float = 1.0, size: int = 1):
    """Two layers of F = I = W = ``scale`` ms, measured at ``size`` samples per microbatch."""
    profile = make_profile([(scale, scale, scale)] * 2, act=10**6, out=10**6, params=PARAMS)
    return replace(profile, microbatch_size=size)


def cluster(gpus: int = 2) -> Cluster:
    return Cluster(gpus=gpus, gpus_per_node=gpus, latency_us=0.0, intra_node_gbps=100.0, inter_node_gbps=100.0,
                   op_overhead_us=0.0)


def test_a_data_parallel_configuration_splits_into_compute_and_its_all_reduce_tail():
    # pp 1 x dp 2, 4 samples: each replica runs 2 microbatches of 2 layers x (F 1 + B 2) = 12 ms
    # back to back, then all-reduces both layers' 2 x 10^8 bytes: 2 (dp-1)/dp x 2e8 B / 100 GB/s = 2 ms
    profile = two_layers()
    ev = Evaluator(profile, cluster())
    config = Config(1, 2, 2)
    from octoplan.tuner.seeds.policy import policy_seeds

    cand = policy_seeds(profile, config, 1)[0]
    parts, cross = time_parts(ev, cand)
    assert allreduce_ms(cluster(), Parallel(pp=1, dp=2, microbatches=2), 0, 2 * PARAMS) == pytest.approx(2.0)
    assert parts == pytest.approx({"compute": 12.0, "recompute": 0.0, "bubbles": 0.0, "transfers": 0.0, "allreduce": 2.0})
    assert not cross
    assert sum(parts.values()) == pytest.approx(ev.score(cand).iteration_ms) == pytest.approx(14.0)


@pytest.mark.parametrize("heavy", ["last", "first"])
def test_a_wait_is_a_bubble_until_its_producer_ends_and_a_transfer_after(heavy):
    """pp 2, one microbatch, messages of 10^6 bytes at 0.1 GB/s: 10 ms on the wire. The heavy
    layer (F 2, B 4) sets the busiest GPU. Last heavy: rank 1 waits 0-11, 1 ms for rank 0's F
    and 10 on the wire, then idles 17-29 at the end. First heavy: rank 0 waits 2-25, 13 ms for
    rank 1's F and B and 10 on the wire. Each wait's part before its producer ends is a bubble,
    whatever the simulator names the whole gap by (its larger part)."""
    from octoplan.tuner.seeds.policy import policy_seeds

    light, weighty = (1, 1, 1), (2, 2, 2)
    profile = make_profile([light, weighty] if heavy == "last" else [weighty, light], act=10**6, out=10**6,
                           params=PARAMS)
    slow = replace(cluster(), intra_node_gbps=0.1, inter_node_gbps=0.1)
    ev = Evaluator(profile, slow)
    cand = next(c for c in policy_seeds(profile, Config(2, 1, 1), 1) if not c.policies[0].split)
    parts, _ = time_parts(ev, cand)
    assert ev.score(cand).iteration_ms == pytest.approx(29.0)
    expected = {"compute": 6.0, "recompute": 0.0, "bubbles": 13.0, "transfers": 10.0, "allreduce": 0.0}
    assert parts == pytest.approx(expected)


def test_every_configuration_of_a_batch_is_priced_and_its_parts_add_up():
    batch = tune_global_batch([(None, two_layers())], cluster(),
                              TuneOptions(gpus=2, global_batch=4, max_plans=200, time_limit_s=60))
    labels = {row.config.label() for row in batch.configs}
    # one node: the two rank orders are the same hardware, so pp-inner alone is searched
    assert labels == {"pp=1 dp=2 mb=2 pp-inner", "pp=2 dp=1 mb=4"}
    assert batch.configs[0].scored == batch.result.scored  # the table's first row is the plan written
    for row in batch.configs:
        assert sum(row.parts[p] for p in TIME_PARTS) == pytest.approx(row.scored.iteration_ms, abs=1e-9)
    pipeline = next(row for row in batch.configs if row.config.pp == 2)
    # 2 stages, 4 microbatches of 3 ms each per stage: 12 ms of work on either GPU, no all-reduce
    assert pipeline.parts["compute"] == pytest.approx(12.0) and pipeline.parts["allreduce"] == 0.0


def test_the_microbatch_size_that_runs_the_batch_fastest_wins():
    small = two_layers(1.0, size=1)
    # twice the samples per microbatch in 1.2x the time: fewer samples-ms, so 2 per microbatch wins
    quick = two_layers(1.2, size=2)
    opts = TuneOptions(gpus=2, global_batch=8, max_plans=300, time_limit_s=60)
    batch = tune_global_batch([(None, small), (None, quick)], cluster(), opts)
    assert batch.microbatch_size == 2 and batch.configs[0].microbatch_size == 2
    assert {row.microbatch_size for row in batch.configs} == {1, 2}
    assert batch.untuned_sizes == (1,)  # 1.67x slower per sample: priced by its baselines only
    # its rows say who runs them, as a tuned size's do
    untuned = {row.name: row for size, row in batch.baselines if size == 1}
    assert {"octorun", "torch", "torchtitan"} <= set(untuned["1f1b/uniform"].runs_on)
    # in 3x the time, 2 per microbatch loses: the per-sample cost decides
    slow = two_layers(3.0, size=2)
    batch = tune_global_batch([(None, small), (None, slow)], cluster(), opts)
    assert batch.microbatch_size == 1
    # its best baseline is far more than MAX_TUNER_GAIN behind: priced, not tuned
    assert batch.untuned_sizes == (2,)
    assert min(row.scored.iteration_ms for row in batch.configs if row.microbatch_size == 2) > batch.result.scored.iteration_ms


def test_the_near_tie_spans_the_microbatch_sizes():
    """Where ops cost nothing, each size's tune gives a near tie to its plan of fewest stages;
    across sizes the same rule holds: of the sizes' plans within 0.1% of the fastest any size
    priced, the one of fewest stage passes per sample (stages / microbatch size) is written,
    though another size's plan is 0.05% faster. Priced ops, or a plan outside the 0.1%: the
    fastest."""
    from types import SimpleNamespace

    from octoplan.tuner.configs import _winning_size

    def size(mbs, stages, written_ms, fastest_ms):
        result = SimpleNamespace(scored=Scored(written_ms, 0.0, 0.0, 1, True),
                                 fastest=Scored(fastest_ms, 0.0, 0.0, 1, True),
                                 candidate=SimpleNamespace(num_stages=stages))
        return (None, SimpleNamespace(microbatch_size=mbs), result)

    four_stages = size(1, 4, 100.0, 100.0)  # 4 passes a sample
    two_stages = size(2, 2, 100.05, 100.04)  # 1 pass a sample: its own tie left a faster plan of 6 stages
    assert _winning_size([four_stages, two_stages], cluster()) is two_stages
    assert _winning_size([four_stages, two_stages], replace(cluster(), op_overhead_us=1.0)) is four_stages
    assert _winning_size([four_stages, size(2, 2, 100.2, 100.2)], cluster()) is four_stages


def test_a_size_won_by_the_near_tie_is_the_one_the_table_and_lines_name():
    """Two microbatches of 2 in 2.0018x the time of one: per sample 0.09% slower, in half the
    stage passes. The tie writes size 2; the configurations table starts with it, the line under
    it says it was written (not that it is the fastest), the plan records the tie, and the
    verdict gives the tie as the reason a baseline is faster."""
    from octoplan.tuner.cli import _config_verdict, _merged, _verdict

    opts = TuneOptions(gpus=2, global_batch=8, max_plans=300, time_limit_s=60)
    batch = tune_global_batch([(None, two_layers(1.0, size=1)), (None, two_layers(2.0018, size=2))], cluster(), opts)
    assert batch.microbatch_size == 2 and batch.configs[0].microbatch_size == 2
    faster = min(row.scored.judged_ms for row in batch.configs if row.microbatch_size == 1)
    assert faster < batch.result.scored.judged_ms <= faster * 1.001
    assert batch.result.stats["near_tie"] and batch.result.plan.extra["tuner"]["near_tie"]
    line = _config_verdict(batch)
    assert line.startswith("configuration written: mbs=2 ") and line.endswith("a near tie: faster, in more stages, "
                                                                             "which the tie gives up where no per-op "
                                                                             "cost is priced")
    result, _ = _merged(batch)
    assert "a tie within 0.1% goes to the plan of fewer stages" in _verdict(result, 80.0)


@pytest.mark.parametrize("memory_gb", [None, 4.0])
def test_each_size_keeps_the_baselines_its_pricing_priced_under_a_plan_budget(memory_gb):
    """Under --max-plans a size's pricing counts among its tune's plans, so its tune's clock
    starts past the baselines' share: the baselines priced already (free again) are still its
    rows, not none (which made the table say no baseline fits); with 4 GB per GPU, where they
    fit only recomputing, their +recompute rows too."""
    from octoplan.tuner import compare_baselines
    from octoplan.tuner.search import BASELINES_SHARE

    def sized(scale: float, size: int):
        if memory_gb is None:
            return two_layers(scale, size)
        return replace(make_profile([(scale, scale, scale)] * 4, act=10**9 * size, out=10**6, params=10**6),
                       microbatch_size=size)

    small, large = sized(1.0, 1), sized(2.0, 2)  # alike per sample: both are tuned
    gpus = cluster() if memory_gb is None else replace(cluster(), memory_gb=memory_gb)
    opts = TuneOptions(gpus=2, global_batch=8, max_plans=40 if memory_gb is None else 400, time_limit_s=60)
    batch = tune_global_batch([(None, small), (None, large)], gpus, opts)
    assert batch.untuned_sizes == ()
    for profile in (small, large):
        pricing = compare_baselines(profile, gpus, opts, until_s=BASELINES_SHARE * opts.time_limit_s / 2)
        assert pricing  # the budget prices some
        if memory_gb is not None:
            assert any(row.name.endswith("+recompute") for row in pricing)
        rows = [row for size, row in batch.baselines if size == profile.microbatch_size]
        assert {row.name for row in rows} >= {row.name for row in pricing}


def _row(parts: dict, fits: bool = True, cross: bool = False) -> ConfigRow:
    total = sum(parts.values())
    cand = Candidate(Config(2, 1, 4), (0, 1, 2), (0, 1))
    return ConfigRow(1, cand, Scored(total, 0.0, 1.0, 90 * 10**9, fits), {p: parts.get(p, 0.0) for p in TIME_PARTS}, cross)


def test_microbatches_per_pipeline_over_several_dp_are_judged_per_microbatch():
    """--microbatches 4 without --pp: pp 2 trains 4 microbatches an iteration, pp 1 x dp 2 trains
    8. pp 1: 4 x 2 layers x (F + I + W) = 24 ms, then layer 0's 1 ms all-reduce (layer 1's ran
    under layer 0's last backward): 25 ms, 3.125 ms a microbatch; pp 2 is quicker per iteration
    but not per microbatch. The faster training wins; with --pp (one dp) nothing changes."""
    from octoplan.tuner import tune

    opts = TuneOptions(gpus=2, microbatches=4, max_plans=300, time_limit_s=60)
    result = tune(two_layers(), cluster(), opts)
    assert (result.candidate.config.pp, result.candidate.config.dp) == (1, 2)
    assert result.scored.iteration_ms == pytest.approx(25.0) and result.scored.judged_ms == pytest.approx(25.0 / 8)
    by_config = {cand.config.pp: scored for cand, scored in result.configs}
    assert by_config[2].iteration_ms < 25.0 < 8 * by_config[2].judged_ms
    pinned = tune(two_layers(), cluster(), replace(opts, pp=2))
    assert pinned.candidate.config.pp == 2 and pinned.scored.samples == 1
    # the tables show the figure they rank by, and the plan says which rule chose it
    from octoplan.tuner.cli import _table

    assert "ms/mb" in [column.header for column in _table(result).columns]
    assert "ms/mb" not in [column.header for column in _table(pinned).columns]
    assert result.plan.extra["tuner"]["judged"] == "per microbatch"
    assert pinned.plan.extra["tuner"]["judged"] == "per iteration"


def test_why_the_next_best_lost_names_the_part_that_grew_most():
    base = {"compute": 10.0, "recompute": 0.0, "bubbles": 1.0, "transfers": 0.0, "allreduce": 1.0}
    winner = _row(base)
    assert why_slower(winner, winner) == "fastest"
    assert why_slower(_row({**base, "bubbles": 3.0, "allreduce": 0.5}), winner) == \
        "bubbles: its busiest GPU idles 2.00 ms more"
    assert why_slower(_row({**base, "recompute": 4.0}), winner) == "memory: it recomputes 4.00 ms more of forwards to fit"
    assert why_slower(_row({**base, "transfers": 2.5}, cross=True), winner) == \
        "transfers: its busiest GPU waits 2.50 ms more on activations on the wire between nodes"
    assert why_slower(_row({**base, "allreduce": 1.5}), winner).startswith("all-reduce: 0.50 ms more")
    assert why_slower(_row({**base, "compute": 11.0}), winner) == "balance: its busiest GPU computes 1.00 ms more"
    assert why_slower(_row(base, fits=False), winner) == "memory: needs 90.0 GB on its fullest GPU even recomputing"
    # rows of different batches (--microbatches without --pp) compare per microbatch: the winner
    # trains 16 in 1634 ms (compute 92.5 ms a microbatch), the runner 8 in 965 (102.75)
    many = replace(_row({"compute": 1480.0, "bubbles": 150.0, "allreduce": 4.0}), microbatch_size=1)
    many = replace(many, scored=replace(many.scored, samples=16))
    few = _row({"compute": 822.0, "bubbles": 143.0})
    few = replace(few, scored=replace(few.scored, samples=8))
    assert why_slower(few, many) == "balance: its busiest GPU computes 10.25 ms more per microbatch"


def test_profiles_of_different_models_or_the_same_size_are_refused():
    one = two_layers()
    other = make_profile([(1, 1, 1)] * 3)
    opts = TuneOptions(gpus=2, global_batch=4, max_plans=50)
    with pytest.raises(InputError, match="layers"):
        tune_global_batch([(None, one), (None, other)], cluster(), opts)
    with pytest.raises(InputError, match="microbatch_size"):
        tune_global_batch([(None, one), (None, two_layers(2.0))], cluster(), opts)
    with pytest.raises(InputError, match="--global-batch"):
        tune_global_batch([(None, one), (None, two_layers(2.0, size=2))], cluster(), replace(opts, global_batch=None))
    # the same layers at another sequence length (a batch of other tokens), or on another GPU
    # (whose memory the plan would not be held to): one model config on one GPU only
    larger = two_layers(2.0, size=2)
    for changed, field in ((replace(larger, model=replace(larger.model, config={"seq_len": 1024})), "model.config.seq_len"),
                           (replace(larger, device={"name": "h200", "memory_gb": 141}), "device.name")):
        with pytest.raises(InputError) as found:
            tune_global_batch([(None, one), (None, changed)], cluster(), opts)
        assert found.value.field == field, found.value



@pytest.mark.parametrize("bad, shown", [({"max_plans": 0}, "--max-plans: is 0"), ({"max_plans": -1}, "--max-plans: is -1"),
                                        ({"time_limit_s": -1.0}, "--time-limit: is -1 ")])
def test_the_options_are_checked_as_given_before_the_budget_is_shared(bad, shown):
    # the budget is divided among sizes and configurations: a value checked after that would
    # slip through (--max-plans 0 became 1 plan) or be shown as a tenth of what was typed
    with pytest.raises(InputError) as refused:
        tune_global_batch([(None, two_layers())], cluster(), TuneOptions(gpus=2, global_batch=4, **bad))
    assert shown in str(refused.value) + " "

def test_cli_tunes_several_sizes_and_says_which_configuration_won(profile_file, tmp_path):
    small = profile_file(two_layers(1.0, size=1), "m1.yaml")
    quick = profile_file(two_layers(1.2, size=2), "m2.yaml")
    out = tmp_path / "plan.yaml"
    net = ["--gpus-per-node", "2", "--latency-us", "0", "--intra-node-gbps", "100", "--inter-node-gbps", "100",
           "--op-overhead-us", "0", "--max-plans", "300"]
    runner = CliRunner()
    result = runner.invoke(app, ["tune", str(small), str(quick), "--gpus", "2", "--global-batch", "8", *net, "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "fastest configuration: mbs=2 " in text and "the next best, " in text
    assert "tuned plan for 2 GPUs (microbatches of 2, " in text
    assert load_plan(out).profile == str(quick)  # the plan reads the winning size's profile
    refused = runner.invoke(app, ["tune", str(small), str(quick), "--gpus", "2", *net, "-o", str(out)])
    assert refused.exit_code == 2 and "--global-batch" in refused.output
    same = runner.invoke(app, ["compare", str(small), str(small), "--gpus", "2", "--global-batch", "8", *net])
    assert same.exit_code == 2 and "microbatch_size" in same.output


def test_plans_priced_once_are_not_simulated_again():
    from octoplan.tuner import compare_baselines, tune

    profile, opts = two_layers(), TuneOptions(gpus=2, global_batch=4, max_plans=100)
    ev = Evaluator(profile, cluster())
    first = compare_baselines(profile, cluster(), opts, evaluator=ev)
    priced = ev.evaluations
    assert priced > 0
    assert compare_baselines(profile, cluster(), opts, evaluator=ev) == first and ev.evaluations == priced
    with pytest.raises(ValueError, match="another profile or cluster"):
        tune(profile, cluster(4), replace(opts, gpus=4), evaluator=ev)


def test_staying_on_torchtitan_names_its_fastest_baseline_on_any_configuration(profile_file, tmp_path):
    """Four 1 ms layers whose 100 MB activations cross nodes at 10 GB/s on 2 nodes of 4 GPUs:
    every baseline label's best row numbers ranks pp-inner (its pipelines inside a node), which
    torchtitan does not run across nodes, while slower dp-inner rows of the same labels fit and
    torchtitan runs them. The line must name the fastest of those, ZB-H1 on pp 2 x dp 4, 30 ms
    (one microbatch of two 2-layer stages: F 2, the wire 10, F 2 and I 2 on the second stage,
    the wire 10, I 2 and W 2 on the first), not say that torchtitan runs none."""
    profile = profile_file(make_profile([(1.0, 1.0, 1.0)] * 4, act=1000, out=10**8, params=0), "cross.yaml")
    result = CliRunner().invoke(app, ["tune", str(profile), "--gpus", "8", "--gpus-per-node", "4", "--global-batch", "4",
                                      "--inter-node-gbps", "10", "--latency-us", "0", "--max-plans", "400",
                                      "-o", str(tmp_path / "plan.yaml")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "torchtitan runs none" not in text
    assert "staying on torchtitan: its fastest baseline that fits here is zb-h1/uniform (pp=2 dp=4 mb=1 dp-inner), " \
           "30.00 ms" in text


def test_tune_prints_one_efficiency_rounded_once(profile_file, tmp_path):
    """19.2 ms of work in a 20.7 ms iteration (the 4 MB all-reduce ends 1.5 ms after it) is
    efficiency 0.92754: the baselines table said
    0.928 and the summary lines 0.927, having rounded the plan file's 0.9275 a second time."""
    small = profile_file(make_profile([(1.0, 1.0, 1.0)] * 4, act=1000, params=10**6), "m1.yaml")
    large = profile_file(replace(make_profile([(1.6, 1.6, 1.6)] * 4, act=2000, params=10**6), microbatch_size=2), "m2.yaml")
    result = CliRunner().invoke(app, ["tune", str(small), str(large), "--gpus", "4", "--global-batch", "8",
                                      "--intra-node-gbps", "1", "--latency-us", "0", "--max-plans", "1000",
                                      "-o", str(tmp_path / "plan.yaml")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "predicted 20.70 ms, bubble 7.2%, efficiency 0.928 " in text
    assert "efficiency 0.928 = balance 1.000 " in text and " x schedule 0.928 " in text
    assert "0.927" not in text
