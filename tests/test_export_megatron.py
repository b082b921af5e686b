"""``octoplan export --format megatron`` and ``tune --runs-on megatron``.

The layout strings are checked three ways: against exact hand-written strings, against this
module's own reading of the grammar (``parse_layout``/``check_layout``, which always run), and,
where megatron-core imports here, against its own ``PipelineParallelLayerLayout`` parser and
validator (the test skips when it is not installed; megatron-core is no dependency of octoplan).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from octoplan.baseline import make_baseline
from octoplan.errors import InputError
from octoplan.export_megatron import (
    LayerLetters, check_layout, layout_string, megatron_export, megatron_order, megatron_problem, parse_kind_letters,
    parse_layout,
)
from octoplan.plan import Cluster, Parallel, Plan, Stage, load_plan, save_plan
from octoplan.profile import Layer, ModelRef, Profile, save_profile
from octoplan.schedules.looped import looped_schedule, one_f_one_b
from octoplan.tuner.frameworks import Frameworks
from octoplan.tuner.search import TuneOptions, tune
from octoplan.tuner.space import Candidate, Config

# embedding, 6 decoder layers, one MTP layer, the head: 9 layers, uneven costs
KINDS = ["embedding"] + ["transformer"] * 3 + ["moe"] * 3 + ["mtp", "head"]
TIMES = [(0.5, 0.3, 0.2), (1, 1, 1), (1, 1, 1), (1, 1, 1), (2, 2, 2), (2, 2, 2), (2, 2, 2), (1.5, 1, 1), (3, 2, 2)]


def _profile(kinds=KINDS, times=TIMES, names=None, microbatch_size=2) -> Profile:
    names = names or [f"l{i}" for i in range(len(kinds))]
    layers = tuple(Layer(name, kind, f, i, w, 1000, 100, 10) for name, kind, (f, i, w) in zip(names, kinds, times))
    return Profile(model=ModelRef("m"), layers=layers, microbatch_size=microbatch_size)


def _plan(bounds, ranks, schedule, *, pp, microbatches, dp=1, rank_order="pp-inner", recompute=None,
          gpus_per_node=8) -> Plan:
    recompute = recompute or {}
    stages = tuple(Stage(a, b, r, s in recompute, recompute.get(s)) for s, (a, b, r) in
                   enumerate(zip(bounds, bounds[1:], ranks)))
    return Plan(model=ModelRef("m"), cluster=Cluster(gpus=pp * dp, gpus_per_node=gpus_per_node),
                parallel=Parallel(pp, microbatches, dp, rank_order),
                stages=stages, schedule=tuple(tuple(ops) for ops in schedule))


def _interleaved_plan(**kwargs) -> Plan:
    # pp 2, 2 virtual stages per rank: [E t t | t t | t t | m L]
    return _plan((0, 3, 5, 7, 9), (0, 1, 0, 1), megatron_order(2, 4, 2), pp=2, microbatches=4, **kwargs)


def test_layout_strings_are_exact_and_read_back():
    stages = ["Ettt"] + ["tt"] * 29 + ["m", "L"]  # DeepSeek-V3 on pp 16 with 2 virtual stages
    assert layout_string(stages) == "Et*3(|tt)*29|m|L"
    assert layout_string(["Et", "tt", "tt", "tL"]) == "Et(|tt)*2|tL"
    assert layout_string(["EtttL"]) == "Et*3L"
    assert layout_string(["Ett", "tt", "ttt", "ttt", "ttt", "mL"]) == "Ett|tt(|t*3)*3|mL"
    for case in (stages, ["Et", "tt", "tt", "tL"], ["EtttL"], ["Ett", "tt", "ttt", "ttt", "ttt", "mL"]):
        assert parse_layout(layout_string(case)) == case
    # Megatron-LM's documented example reads as the same stages
    assert parse_layout("Et*3|(tt|)*29,m|L") == stages


@pytest.mark.parametrize("text", ["Ex|L", "E(t(t)*2)*2|L", "Et*0|L", "E(t|L", "Et)|L", "E()*2|tL"])
def test_the_grammar_refuses_what_megatron_cannot_read(text):
    with pytest.raises(ValueError):
        parse_layout(text)


@pytest.mark.parametrize("stages, pp, num_layers, mtp, rule", [
    (["Ett", "ttL", "t"], 2, 5, 0, "multiple of pp"),
    (["tE", "ttL"], 2, 3, 0, "start with E"),
    (["EtE", "ttL"], 2, 3, 0, "E appears 2 times"),
    (["Ett", "tLtL"], 2, 4, 0, "L appears 2 times"),
    (["Ett", "tLt"], 2, 4, 0, "end with L"),
    (["Ett", "ttL"], 2, 5, 0, "--num-layers is 5"),
    (["Etm", "ttL"], 2, 3, 1, "follows an MTP layer"),
    (["Ett", "tmmL"], 2, 3, 1, "--mtp-num-layers is 1"),
    (["Et", "tm", "tt", "L"], 2, 4, 1, "follows an MTP"),
    (["Et", "tt", "m", "t", "tt", "L"], 3, 6, 1, "follows an MTP"),
    (["Et", "tt", "tm", "mL"], 2, 4, 2, "not one"),
    (["Et", "tt", "t", "t", "tt", "mL"], 4, 7, 1, "multiple of pp"),
])
def test_check_layout_names_the_rule_broken(stages, pp, num_layers, mtp, rule):
    with pytest.raises(ValueError, match=rule):
        check_layout(stages, pp, num_layers=num_layers, mtp_layers=mtp)


def test_mtp_must_sit_in_its_ranks_last_virtual_stage():
    check_layout(["Et", "tt", "tt", "mL"], 2, num_layers=5, mtp_layers=1)  # stage 3: rank 1's last
    with pytest.raises(ValueError, match="last virtual stage"):
        check_layout(["Ett", "tm", "", "L"], 2, num_layers=3, mtp_layers=1)  # stage 1: rank 1's first


def test_megatron_orders():
    assert megatron_order(3, 5, 1) == one_f_one_b(3, 5)
    assert megatron_order(2, 5, 2) is None  # interleaved needs a multiple of pp
    # exactly pp microbatches: rank 0 warms up with 2 (pp - 1) + (v - 1) pp = 4 forwards, all it
    # has, and runs them before any backward; rank 1 with 2, then alternates (megatron-core's
    # get_pp_rank_microbatches: no case of its own for microbatches = pp, as before it)
    rank0, rank1 = megatron_order(2, 2, 2)
    assert [str(op) for op in rank0] == ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"]
    assert [str(op) for op in rank1] == ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"]
    # 4 microbatches on pp 2: rank 1 warms up with (v-1) x pp = 2 forwards, then alternates
    rank1 = megatron_order(2, 4, 2)[1]
    assert [str(op) for op in rank1[:5]] == ["1F0", "1F1", "3F0", "3B0", "3F1"]


def test_interleaved_plan_exports_exact_arguments(tmp_path):
    plan = _interleaved_plan(dp=2, gpus_per_node=2)  # pp-inner: each pipeline on a node of its own
    export = megatron_export(plan, _profile())
    assert export.stages == ("Ett", "tt", "tt", "mL")
    assert export.layout == "Ett(|tt)*2|mL"
    assert export.arguments == (
        "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett(|tt)*2|mL",
        "--num-layers", "6", "--mtp-num-layers", "1", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--use-tp-pp-dp-mapping",
    )
    text = export.shell(title="t")
    assert text.splitlines()[:9] == [
        "# t", "MEGATRON_PP_ARGS=(", "  --pipeline-model-parallel-size 2",
        "  --pipeline-model-parallel-layout 'Ett(|tt)*2|mL'", "  --num-layers 6", "  --mtp-num-layers 1",
        "  --micro-batch-size 2", "  --global-batch-size 16", "  --use-tp-pp-dp-mapping",
    ]
    # bash reads the array back as the arguments, the layout one word
    script = tmp_path / "args.sh"
    script.write_text(text)
    words = subprocess.run(["bash", "-c", f'source {script}; printf "%s\\n" "${{MEGATRON_PP_ARGS[@]}}"'],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert tuple(words) == export.arguments
    # dp-inner is Megatron's default rank order: no mapping flag; nor where both orders put the
    # same ranks on each node (all 4 GPUs on one)
    assert "--use-tp-pp-dp-mapping" not in megatron_export(
        _interleaved_plan(dp=2, rank_order="dp-inner", gpus_per_node=2), _profile()).arguments
    assert "--use-tp-pp-dp-mapping" not in megatron_export(_interleaved_plan(dp=2), _profile()).arguments


def test_megatron_numbers_pp_inner_ranks_across_nodes_only_without_expert_parallelism():
    """Megatron-LM refuses --use-tp-pp-dp-mapping with expert parallelism ("context_parallel and
    expert_model_parallel can't be used with tp-pp-dp mapping"): a pp-inner plan whose pipelines
    sit on other nodes than dp-inner's is one it cannot run; one node, or dp-inner, it can."""
    moe = replace(_profile(), model=ModelRef("m", config={"ep": 2}))
    letters = LayerLetters(moe)
    across = _interleaved_plan(dp=2, gpus_per_node=2)
    assert megatron_problem(across, letters, ep=2) == ("its pp-inner rank order needs --use-tp-pp-dp-mapping, which "
                                                       "Megatron-LM refuses with expert parallelism (the profile's ep "
                                                       "2); its own order is dp-inner")
    with pytest.raises(InputError, match="expert parallelism"):
        megatron_export(across, moe)
    for runnable in (_interleaved_plan(dp=2, gpus_per_node=2, rank_order="dp-inner"), _interleaved_plan(dp=2)):
        assert megatron_problem(runnable, letters, ep=2) is None
        assert "--use-tp-pp-dp-mapping" not in megatron_export(runnable, moe).arguments
    assert megatron_problem(across, letters) is None  # without experts: the mapping flag


def test_one_stage_per_rank_and_missing_embedding_and_head():
    kinds = ["block"] * 5
    profile = _profile(kinds=kinds, times=[(1, 1, 1)] * 5)
    plan = _plan((0, 2, 5), (0, 1), one_f_one_b(2, 3), pp=2, microbatches=3)
    export = megatron_export(plan, profile, letters=parse_kind_letters(["block=t"]))
    assert export.layout == "Ett|t*3L"  # E and L attached to the first and last stage
    assert export.arguments[:6] == ("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                                    "Ett|t*3L", "--num-layers", "5")
    with pytest.raises(InputError, match="'block'"):
        megatron_export(plan, profile)  # an unknown kind is refused, not guessed


def test_block_recomputation_maps_to_decoder_layers():
    uniform = _interleaved_plan(recompute={0: 2, 1: 2, 2: 2, 3: 2})
    args, notes = megatron_export(uniform, _profile()).arguments, megatron_export(uniform, _profile()).notes
    assert args[-6:] == ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2")
    # Megatron-LM's block method checkpoints layer by layer (a checkpoint per layer index), the
    # plan its N layers as one: the memory differs, and a note says how
    assert [note for note in notes if "on its own" in note] == [
        "Megatron-LM checkpoints each of the 2 layers on its own: it keeps each one's input, where the plan keeps the "
        "stage's input only, and reruns them one at a time in the backward, where the plan reruns them together; its "
        "peak memory differs from the plan's by those inputs less the rerun layers' activations but one"]
    one = _interleaved_plan(recompute={0: 2, 1: 1, 2: 1, 3: 1})  # E t | t | t | m: one decoder layer each
    assert not [note for note in megatron_export(one, _profile()).notes if "on its own" in note]
    export = megatron_export(_interleaved_plan(recompute={0: 3, 1: 3, 2: 3, 3: 3}), _profile())
    # stage 0's first 3 layers are E t t: 2 decoder layers, as every other stage's (all of theirs)
    assert export.arguments[-1] == "2"
    uneven = _interleaved_plan(recompute={0: 1, 1: 2})
    assert "one N" in megatron_problem(uneven, LayerLetters(_profile()))
    # [E t t | t t | t t | m L], the last stage keeping its MTP layer and head: 3, 2, 2, 0 profile
    # layers but 2 decoder layers wherever there are any, which is Megatron-LM's N = 2 exactly
    decoders = _interleaved_plan(recompute={0: 3, 1: 2, 2: 2})
    assert megatron_problem(decoders, LayerLetters(_profile())) is None
    export = megatron_export(decoders, _profile())
    assert export.arguments[-2:] == ("--recompute-num-layers", "2")
    assert not [note for note in export.notes if "recompute fewer" in note]
    # and the tuner's tables say Megatron-LM runs it (one rule for both)
    frameworks = Frameworks(_profile())
    cand = Candidate(Config(decoders.pp, 1, decoders.microbatches), (0, 3, 5, 7, 9), (0, 1, 0, 1), None,
                     tuple(map(tuple, decoders.schedule)), "", "", frozenset({0, 1, 2}), ((0, 3), (1, 2), (2, 2)))
    assert frameworks.megatron_layout_ok(cand) and "Megatron-LM" in frameworks.runs_on(cand)
    # every stage recomputing all its layers: [E t t | t t | t t | m L]. Megatron-LM's block method
    # recomputes 2 decoder layers per stage, never E, m or L, which the plan counts recomputed
    everything = megatron_export(_interleaved_plan(recompute={0: 3, 1: 2, 2: 2, 3: 2}), _profile())
    assert everything.arguments[-1] == "2"
    assert [note for note in everything.notes if "never recomputes" in note] == [
        "the plan also recomputes layers Megatron-LM's block recomputation never recomputes (stage 0: the embedding; "
        "stage 3: an MTP layer and the loss head): under Megatron-LM those stages keep these layers' activations (the "
        "head's are vocabulary-sized) and need more memory than the plan predicts"]


def test_plans_megatron_cannot_run_are_refused_with_the_reason():
    profile = _profile()
    letters = LayerLetters(profile)
    base = _interleaved_plan()
    swapped = replace(base, stages=tuple(replace(s, rank=1 - s.rank) for s in base.stages))
    assert "stage 0 is on rank 1" in megatron_problem(swapped, letters)
    split = make_baseline(profile, schedule="zb-h1", gpus=2, microbatches=4)
    assert "splits backwards" in megatron_problem(split, letters)
    reordered = [list(ops) for ops in base.schedule]
    reordered[1][3], reordered[1][4] = reordered[1][4], reordered[1][3]
    assert "rank 1's op order" in megatron_problem(base.with_schedule(reordered), letters)
    early_mtp = _plan((0, 2, 4, 8, 9), (0, 1, 0, 1), megatron_order(2, 4, 2), pp=2, microbatches=4)
    assert megatron_problem(early_mtp, letters) is None  # m in stage 2, rank 0's last virtual stage
    # pp 1: Megatron-LM refuses virtual stages without a pipeline ("pipeline-model-parallel size
    # should be greater than 1 with interleaved schedule"); one stage is plain data parallelism
    one_rank = _plan((0, 3, 5, 7, 9), (0, 0, 0, 0), looped_schedule(1, 4, chunks=4, warmup=lambda r: 16), pp=1, microbatches=4)
    assert megatron_problem(one_rank, letters) == ("a rank of 4 stages needs a pipeline: Megatron-LM's virtual stages "
                                                   "need pp 2 or more, and it runs pp 1 as one stage")
    assert megatron_problem(_plan((0, 9), (0,), megatron_order(1, 4, 1), pp=1, microbatches=4), letters) is None
    too_early = _plan((0, 3, 8, 9), (0, 1, 2), one_f_one_b(3, 3), pp=3, microbatches=3)
    assert megatron_problem(too_early, letters) is None  # one stage per rank: every stage is its rank's last
    with pytest.raises(InputError, match="Megatron-LM cannot run this plan: .*splits backwards"):
        megatron_export(split, profile)


def test_split_blocks_merge_and_refuse_a_cut_inside_a_block():
    kinds = ["embedding", "transformer.mixer", "transformer.ffn", "transformer.mixer", "transformer.ffn", "head"]
    names = ["embed", "layers.0.mixer", "layers.0.ffn", "layers.1.mixer", "layers.1.ffn", "head"]
    profile = _profile(kinds=kinds, times=[(1, 1, 1)] * 6, names=names)
    whole = _plan((0, 3, 6), (0, 1), one_f_one_b(2, 2), pp=2, microbatches=2)
    assert megatron_export(whole, profile).layout == "Et|tL"  # two layers of the profile, one t each
    inside = _plan((0, 2, 6), (0, 1), one_f_one_b(2, 2), pp=2, microbatches=2)
    assert "inside a split block" in megatron_problem(inside, LayerLetters(profile))


def test_hybrid_kinds_are_refused_even_mapped():
    """A hybrid model's Mamba layers have no letter, and mapping them is refused too: Megatron-LM
    builds such a model as a MambaModel, whose MambaStack splits the layers evenly over pp and
    reads no layout (megatron/core/ssm/mamba_block.py), so the layout would not be what it runs."""
    profile = _profile(kinds=["embedding", "mamba", "attention", "mamba", "head"], times=[(1, 1, 1)] * 5)
    with pytest.raises(InputError, match="'mamba'"):
        LayerLetters(profile)
    with pytest.raises(InputError, match=r"--kind-letter: maps the layers of a hybrid model \(kinds mamba\): "
                                         r"Megatron-LM builds it as a MambaModel"):
        LayerLetters(profile, letters={"mamba": "t", "attention": "t"})
    # another unlettered kind maps as the user says
    other = _profile(kinds=["embedding", "block", "attention", "block", "head"], times=[(1, 1, 1)] * 5)
    assert "".join(LayerLetters(other, letters={"block": "t", "attention": "t"}).letter) == "EtttL"
    # a kind with a letter keeps it: a head as a decoder layer added one to --num-layers
    with pytest.raises(InputError, match="--kind-letter: maps 'head' to t, a kind whose letter is L"):
        LayerLetters(other, letters={"block": "t", "attention": "t", "head": "t"})
    assert "".join(LayerLetters(other, letters={"block": "t", "attention": "t", "head": "L"}).letter) == "EtttL"
    # hf: profiles of configs with layer_types (Qwen2/3, Gemma 2/3) name decoder layers by their
    # attention: both are Megatron transformer layers
    hf = _profile(kinds=["embedding", "sliding_attention", "full_attention", "head"], times=[(1, 1, 1)] * 4)
    assert "".join(LayerLetters(hf).letter) == "EttL"
    # a misspelt kind is refused, naming the kinds there are, before the one it meant goes unmapped
    with pytest.raises(InputError, match=r"--kind-letter: maps 'mambaa', a kind no layer of the profile has "
                                         r"\(map one of the profile's kinds: attention, embedding, head, mamba\)"):
        LayerLetters(profile, letters={"mambaa": "t", "attention": "t"})


@pytest.mark.parametrize("pairs", [["block"], ["block=x"], ["=t"], ["block=tt"], ["block=t", "block=m"]])
def test_kind_letter_options_are_checked(pairs):
    with pytest.raises(InputError, match="--kind-letter"):
        parse_kind_letters(pairs)
    assert parse_kind_letters(["block=t", "block=t", "mamba=m"]) == {"block": "t", "mamba": "m"}  # the same twice is one


def test_megatron_core_parser_accepts_our_layouts():
    layout_module = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    parser = layout_module.PipelineParallelLayerLayout
    cases = [
        (megatron_export(_interleaved_plan(), _profile()).layout, 2, 6, 1, ["Ett", "tt", "tt", "mL"]),
        (layout_string(["Ettt"] + ["tt"] * 29 + ["m", "L"]), 16, 61, 1, ["Ettt"] + ["tt"] * 29 + ["m", "L"]),
        (layout_string(["Ett", "tt", "ttt", "ttt", "ttt", "mL"]), 3, 13, 1, ["Ett", "tt", "ttt", "ttt", "ttt", "mL"]),
    ]
    letter = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    for text, pp, num_layers, mtp, stages in cases:
        assert ["".join(letter[t.name] for t in stage) for stage in parser.parse_str_to_list(text)] == stages
        parser(text, pp).validate_layer_layout(num_layers, mtp)
    with pytest.raises(AssertionError):  # and it refuses what check_layout refuses
        parser("Ett|tmL|t|t", 2).validate_layer_layout(4, 1)
    with pytest.raises(ValueError):
        check_layout(parse_layout("Ett|tmL|t|t"), 2, num_layers=4, mtp_layers=1)


def test_tune_runs_on_megatron_returns_a_plan_megatron_runs():
    profile = _profile()
    opts = TuneOptions(gpus=2, pp=2, microbatches=4, max_plans=300, runs_on="megatron")
    result = tune(profile, Cluster(gpus=2), opts)
    assert "Megatron-LM" in result.runs_on
    assert megatron_problem(result.plan, LayerLetters(profile)) is None
    export = megatron_export(result.plan, profile)
    check_layout(parse_layout(export.layout), 2, num_layers=6, mtp_layers=1)
    # never slower than the Megatron-runnable baselines that fit (its seeds cover them)
    runnable = [row for row in result.baselines if "Megatron-LM" in row.runs_on and row.scored.fits]
    assert runnable and all(result.scored.iteration_ms <= row.scored.iteration_ms + 1e-9 for row in runnable)
    names = {row.name: row.runs_on for row in result.baselines}
    assert "Megatron-LM" in names["1f1b/uniform"] and "Megatron-LM" in names["interleaved-1f1b/balanced"]
    assert "Megatron-LM" not in names["zb-h1/uniform"] and "Megatron-LM" not in names["gpipe/uniform"]
    # the MTP layer has no module in torchtitan's Llama-style models, but the profile's own
    # names (l0, l1, ...) export with --fqn-style profile
    assert names["zbv/uniform"] == ("octorun", "torch", "torchtitan")


def test_tune_runs_on_megatron_refuses_models_without_letters():
    profile = _profile(kinds=["embedding", "block", "attention", "block", "head"], times=[(1, 1, 1)] * 5)
    with pytest.raises(InputError, match="--runs-on megatron"):
        tune(profile, Cluster(gpus=2), TuneOptions(gpus=2, max_plans=50, runs_on="megatron"))
    with pytest.raises(InputError, match="--runs-on"):
        tune(profile, Cluster(gpus=2), TuneOptions(gpus=2, max_plans=50, runs_on="deepspeed"))
    # mapped as the user says (tune's --kind-letter, as export's), it tunes a plan Megatron-LM runs
    letters = (("attention", "t"), ("block", "t"))
    mapped = tune(profile, Cluster(gpus=2), TuneOptions(gpus=2, pp=2, microbatches=4, max_plans=50, runs_on="megatron",
                                                        kind_letters=letters))
    assert megatron_problem(mapped.plan, LayerLetters(profile, letters=dict(letters))) is None


def test_tune_cli_takes_kind_letters_and_refuses_a_misspelt_kind(tmp_path):
    profile = _profile(kinds=["embedding", "block", "attention", "block", "head"], times=[(1, 1, 1)] * 5)
    save_profile(profile, tmp_path / "h.yaml")
    args = ("tune", "h.yaml", "--gpus", "2", "--pp", "2", "--microbatches", "4", "--max-plans", "50", "--runs-on",
            "megatron", "-o", "p.yaml")
    done = _cli(*args, "--kind-letter", "block=t", "--kind-letter", "attention=t", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = _cli(*args, "--kind-letter", "blockk=t", "--kind-letter", "attention=t", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: --kind-letter: maps 'blockk', a kind no layer of the profile has (map one of the profile's kinds: "
        "attention, block, embedding, head)"]


def test_frameworks_of_candidates():
    profile = _profile()
    frameworks = Frameworks(profile)
    plain = tune(profile, Cluster(gpus=2), TuneOptions(gpus=2, pp=2, microbatches=4, max_plans=200))
    assert plain.runs_on[:2] == ("octorun", "torch")
    assert ("Megatron-LM" in plain.runs_on) == frameworks.megatron_runs(plain.candidate)


def _cli(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "octoplan.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env)


def test_cli_exports_a_runnable_plan_and_tunes_for_one_that_is_not(tmp_path):
    save_profile(_profile(), tmp_path / "p.yaml")
    base = make_baseline(_profile(), schedule="interleaved-1f1b", gpus=2, microbatches=4, chunks=2,
                         profile_path=tmp_path / "p.yaml")
    save_plan(base, tmp_path / "il.yaml")
    done = _cli("export", "il.yaml", "--format", "megatron", "-o", "il.sh", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    expected = megatron_export(load_plan(tmp_path / "il.yaml"), _profile())
    assert f"--pipeline-model-parallel-layout {expected.layout}" in done.stdout
    assert f"'{expected.layout}'" in (tmp_path / "il.sh").read_text()

    zb = make_baseline(_profile(), schedule="zb-h1", gpus=2, microbatches=4, profile_path=tmp_path / "p.yaml")
    save_plan(zb, tmp_path / "zb.yaml")
    done = _cli("export", "zb.yaml", "--format", "megatron", "-o", "zb.sh", "--max-plans", "200", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Megatron-LM cannot run zb.yaml as planned" in done.stdout and "than the plan's" in done.stdout
    layout = next(line.split()[1].strip("'") for line in (tmp_path / "zb.sh").read_text().splitlines()
                  if "--pipeline-model-parallel-layout" in line)
    check_layout(parse_layout(layout), 2, num_layers=6, mtp_layers=1)


@pytest.mark.parametrize("order", ["pp-inner", "dp-inner"])
def test_the_fallback_keeps_the_plans_rank_order(order):
    """The plan Megatron-LM runs in place of one it cannot keeps the nodes' layout the user chose:
    dp-inner is what Megatron-LM needs beside context or expert parallelism."""
    from octoplan.export_cli import megatron_fallback

    zb = make_baseline(_profile(), schedule="zb-h1", gpus=4, pp=2, microbatches=4)
    zb = replace(zb, parallel=replace(zb.parallel, rank_order=order))
    result = megatron_fallback(zb, _profile(), profile_path=None, time_limit_s=60, max_plans=100)
    assert result.plan.parallel.rank_order == order and result.plan.parallel.dp == 2
    assert megatron_problem(result.plan, LayerLetters(_profile())) is None


def test_cli_refuses_in_one_line_and_writes_nothing(tmp_path):
    profile = _profile(kinds=["embedding", "block", "attention", "block", "head"], times=[(1, 1, 1)] * 5)
    save_profile(profile, tmp_path / "h.yaml")
    save_plan(make_baseline(profile, schedule="1f1b", gpus=2, microbatches=2, profile_path=tmp_path / "h.yaml"),
              tmp_path / "h-plan.yaml")
    done = _cli("export", "h-plan.yaml", "--format", "megatron", "-o", "out.sh", cwd=tmp_path)
    assert done.returncode == 2 and "'block'" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.sh").exists()
    done = _cli("export", "h-plan.yaml", "--format", "torch-csv", "-o", "out.csv", "--kind-letter", "block=t",
                cwd=tmp_path)
    assert done.returncode == 2 and "--kind-letter" in done.stderr and not (tmp_path / "out.csv").exists()
    done = _cli("export", "h-plan.yaml", "--format", "megatron", "-o", "out.sh", "--kind-letter", "block=t",
                "--kind-letter", "attention=t", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "'Ett|tL'" in (tmp_path / "out.sh").read_text()
    # a plan Megatron-LM cannot run as planned (ZB-H1 splits backwards): the tune for one it can
    # reads the layers with the same letters (it refused 'block' as unmapped)
    save_plan(make_baseline(profile, schedule="zb-h1", gpus=2, microbatches=4, profile_path=tmp_path / "h.yaml"),
              tmp_path / "zb.yaml")
    done = _cli("export", "zb.yaml", "--format", "megatron", "-o", "zb.sh", "--kind-letter", "block=t",
                "--kind-letter", "attention=t", "--max-plans", "100", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Megatron-LM cannot run zb.yaml as planned" in done.stdout
    layout = next(line.split()[1].strip("'") for line in (tmp_path / "zb.sh").read_text().splitlines()
                  if "--pipeline-model-parallel-layout" in line)
    check_layout(parse_layout(layout), 2, num_layers=3, mtp_layers=0)


def test_cli_refuses_a_plan_that_deadlocks_before_tuning_in_its_place(tmp_path):
    """A ZB-H1 plan needs the Megatron-confined tune; one whose last rank waits for itself is
    bad input before that tune, as for every other command (it ended in a DeadlockError, exit 1)."""
    save_profile(_profile(), tmp_path / "p.yaml")
    plan = make_baseline(_profile(), schedule="zb-h1", gpus=2, microbatches=4, profile_path=tmp_path / "p.yaml")
    last = list(plan.schedule[-1])
    first_i = next(i for i, op in enumerate(last) if op.kind.value == "I")
    last.insert(0, last.pop(first_i))  # its first I before the F it needs
    save_plan(replace(plan, schedule=(*plan.schedule[:-1], tuple(last))), tmp_path / "deadlock.yaml")
    done = _cli("export", "deadlock.yaml", "--format", "megatron", "-o", "d.sh", "--max-plans", "50", cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "deadlock.yaml: schedule: deadlock" in done.stderr and "Tuning" not in done.stdout
    assert not (tmp_path / "d.sh").exists()


@pytest.mark.parametrize("option", [("--max-plans", "0"), ("--max-plans", "-1"), ("--time-limit", "-5")])
def test_cli_checks_the_search_options_for_a_plan_megatron_runs_as_is(tmp_path, option):
    # the interleaved plan needs no search, yet a bad search option is still an error
    save_profile(_profile(), tmp_path / "p.yaml")
    save_plan(make_baseline(_profile(), schedule="interleaved-1f1b", gpus=2, microbatches=4, chunks=2,
                            profile_path=tmp_path / "p.yaml"), tmp_path / "il.yaml")
    done = _cli("export", "il.yaml", "--format", "megatron", "-o", "il.sh", *option, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and f"{option[0]}: is {option[1]} " in done.stderr
    assert not (tmp_path / "il.sh").exists()


def test_runs_on_megatron_keeps_the_baselines_megatron_runs():
    """Only the Megatron seed family's plans were allowed: with the budget spent on pp=1 seeds,
    which do not fit, it said "no plan fits 80 GB" beside a fitting 1F1B baseline Megatron runs."""
    from octoplan.arch import analytic_profile
    from octoplan.tuner.search import tune

    profile = analytic_profile("llama3-8b", "h100")
    result = tune(profile, Cluster(gpus=8, memory_gb=80), TuneOptions(gpus=8, max_plans=200, runs_on="megatron"))
    assert result.scored.fits and "Megatron-LM" in result.runs_on
    assert megatron_problem(result.plan, LayerLetters(profile)) is None


def test_virtual_stages_at_pp_2_keep_the_p2p_overlap():
    """Megatron-LM asserts pp > 2 for virtual stages unless its p2p overlap is on, which it is by
    default in the versions that read a layout (megatron/training/arguments.py defines only
    --no-overlap-p2p-communication there): an interleaved plan at pp 2 passes no flag, and its
    note says not to turn the overlap off; one stage per rank needs no note."""
    export = megatron_export(_interleaved_plan(), _profile())
    assert not any("overlap" in argument for argument in export.arguments)
    assert any("give no --no-overlap-p2p-communication" in note for note in export.notes)
    one_each = _plan((0, 4, 9), (0, 1), one_f_one_b(2, 4), pp=2, microbatches=4)
    assert not any("overlap" in note for note in megatron_export(one_each, _profile()).notes)


def test_expert_parallel_groups_need_tp_times_dp_a_multiple_of_ep():
    """Megatron-LM takes a stage's expert-parallel groups from its tensor- and data-parallel
    ranks (world size a multiple of expert-tp x ep x pp): ep 4 runs at dp 4, or at dp 2 beside
    tp 2, not at dp 2 alone; the tuner does not call such a plan Megatron's."""
    from octoplan.export_megatron import megatron_expert_problem

    assert megatron_expert_problem(Parallel(2, 4, 4), ep=4) is None
    assert megatron_expert_problem(Parallel(2, 4, 2), ep=4, tp=2) is None
    assert megatron_expert_problem(Parallel(2, 4, 2), ep=4) == (
        "Megatron-LM forms the profile's expert-parallel groups (ep 4) from a stage's tensor- and data-parallel ranks, "
        "and tp 1 x dp 2 is not a multiple of 4")
    moe = replace(_profile(), model=ModelRef("m", config={"ep": 4}))
    plan = _interleaved_plan(dp=2, rank_order="dp-inner")
    assert "tp 1 x dp 2 is not a multiple of 4" in megatron_problem(plan, LayerLetters(moe), ep=4)
    # beside tp 2 it runs, with expert tensor parallelism 1 (Megatron-LM's default is tp): a note says so
    wide = replace(_profile(), model=ModelRef("m", config={"ep": 4, "tp": 2}))
    assert any("only with --expert-tensor-parallel-size 1" in note for note in megatron_export(plan, wide).notes)
    with pytest.raises(InputError, match=r"--runs-on megatron: Megatron-LM forms the profile's expert-parallel groups "
                                         r"\(ep 4\).*no split of 2 pipeline GPUs"):
        tune(moe, Cluster(gpus=2), TuneOptions(gpus=2, max_plans=50, runs_on="megatron"))
