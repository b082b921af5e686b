"""Export a plan as Megatron-LM (megatron-core) arguments: ``--pipeline-model-parallel-layout``.

Megatron-LM takes an uneven partition as a layout string (class
``megatron.core.transformer.pipeline_parallel_layer_layout.PipelineParallelLayerLayout``):
stages separated by ``|``, one letter per layer — ``E`` embedding, ``t`` decoder layer, ``m``
MTP layer, ``L`` loss (the final norm, output layer and loss) — with ``x*n`` repeating a letter,
``(...)*n`` repeating a group (no nesting) and ``,`` as a cosmetic separator. ``E`` comes first
and ``L`` last, each exactly once; the ``t`` count is ``--num-layers``, the ``m`` count
``--mtp-num-layers``; MTP layers follow every decoder layer, all in one stage, and that stage is
the last of its rank's virtual stages. The stage count is a multiple of pp and stage ``i`` runs
on rank ``i mod pp`` (Megatron's virtual stages, as in octoplan's loop placement).

Megatron runs only that placement, with its own order: 1F1B with one stage per rank, interleaved
1F1B with several (then the microbatches must be a multiple of pp, and rank r warms up with
2 (pp - 1 - r) + (chunks - 1) pp forwards), never a split backward (I/W). A plan is
*Megatron-runnable* when it has that placement and that order (:func:`megatron_order`); only
such a plan is exported, so the iteration time octoplan predicts is the one Megatron runs.
Recomputation maps to ``--recompute-method block --recompute-num-layers N`` when every stage
recomputes its first N layers (all of a shorter stage's); other recomputation Megatron cannot
express.

Layers map to letters by their profile ``kind`` (:data:`KIND_LETTERS`; ``--kind-letter``
overrides): ``embedding`` is E, ``head`` is L, ``mtp`` is m, decoder blocks (``transformer``,
``transformer-swa``, ``moe``, ``decoder``) are t. A split-blocks profile's ``NAME.mixer`` and
``NAME.ffn`` layers (kinds ``K.mixer``, ``K.ffn``) make one t together, so a stage boundary
between them is refused. A profile with no embedding layer gets E on the first stage, one
with no head L on the last. Kinds Megatron's layout has no letter for (Mamba and MLP-only
blocks of hybrid models, vision encoders) are refused: Megatron-LM builds those models with
other arguments.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from octoplan.errors import InputError, one_line
from octoplan.ops import Kind, Op
from octoplan.outputs import write_text
from octoplan.plan import Cluster, Parallel, Plan, Stage, check_structure
from octoplan.profile import Profile
from octoplan.schedules.looped import interleaved_1f1b
from octoplan.schedules.placement import framework_placement

__all__ = ["KIND_LETTERS", "LayerLetters", "MegatronExport", "megatron_order", "layout_string", "parse_layout",
           "check_layout", "megatron_problem", "megatron_export", "export_megatron", "parse_kind_letters",
           "check_kind_letters", "MEGATRON_RANK_ORDER", "expert_parallel", "megatron_rank_order_problem",
           "megatron_expert_problem", "tensor_parallel"]

# A profile layer's kind -> its letter in the layout (a split block's K.mixer / K.ffn read as K's).
KIND_LETTERS: dict[str, str] = {
    "embedding": "E", "head": "L", "mtp": "m",
    "transformer": "t", "transformer-swa": "t", "moe": "t", "decoder": "t",
    # the decoder layers of hf: profiles whose config lists layer_types (Qwen2/3, Gemma 2/3):
    # attention over the whole sequence or a window, both a transformer layer to Megatron-LM
    "full_attention": "t", "sliding_attention": "t",
}
LETTERS = "EtmL"
# kinds of a hybrid model's state-space layers (Megatron-LM's MambaModel, not its layout)
MAMBA_KINDS = ("mamba", "ssm")
_SPLIT_PARTS = ("mixer", "ffn")


def parse_kind_letters(pairs: Sequence[str]) -> dict[str, str]:
    """``--kind-letter KIND=LETTER`` options as a dict (LETTER one of E, t, m, L)."""
    out: dict[str, str] = {}
    for pair in pairs:
        kind, equals, letter = pair.partition("=")
        if not equals or not kind or letter not in LETTERS or len(letter) != 1:
            raise InputError(None, "--kind-letter", f"is {pair!r}", "write KIND=LETTER with LETTER one of E, t, m, L")
        if out.get(kind, letter) != letter:  # as any option given twice with other values (FORMATS section 5)
            raise InputError(None, "--kind-letter", f"maps {kind!r} twice, to {out[kind]} and to {letter}",
                             "give one letter a kind")
        out[kind] = letter
    return out


def _kind_and_block(kind: str, name: str) -> tuple[str, str | None]:
    """A layer's kind for the letters, and the block it is part of (None: a whole layer): the
    parts of a split block ("block.mixer", "block.ffn") are one Megatron layer of their base kind."""
    base, _, part = kind.rpartition(".")
    return (base, name.rpartition(".")[0]) if part in _SPLIT_PARTS and base else (kind, None)


def check_kind_letters(profile: Profile, letters: Mapping[str, str]) -> None:
    """``InputError`` for a ``--kind-letter`` that maps a kind no layer of ``profile`` has (a
    misspelt kind, whose layer would go unmapped without a word), a kind that has its letter
    already (a head as a decoder layer would add one to --num-layers), or the layers of a
    hybrid model: Megatron-LM builds those as its MambaModel, whose MambaStack splits the layers
    evenly (num_layers // pp) and takes no layout and no virtual stages
    (megatron/core/ssm/mamba_block.py), so a layout for them would not be the one it runs."""
    kinds = {_kind_and_block(layer.kind, layer.name)[0] for layer in profile.layers}
    for kind, letter in letters.items():
        if kind not in kinds:
            raise InputError(None, "--kind-letter", f"maps {kind!r}, a kind no layer of the profile has",
                             f"map one of the profile's kinds: {', '.join(sorted(kinds))}")
        if kind in KIND_LETTERS and KIND_LETTERS[kind] != letter:
            raise InputError(None, "--kind-letter", f"maps {kind!r} to {letter}, a kind whose letter is "
                             f"{KIND_LETTERS[kind]}", "map only kinds Megatron-LM's layout has no letter for")
    hybrid = sorted(kind for kind in kinds if kind.startswith(MAMBA_KINDS))
    if letters and hybrid:
        raise InputError(None, "--kind-letter", f"maps the layers of a hybrid model (kinds {', '.join(hybrid)}): "
                         "Megatron-LM builds it as a MambaModel, whose layers it splits evenly over pp with no "
                         "layout and no virtual stages, so the exported layout would not be the split it runs",
                         "tune hybrid models for octorun (or torch), without --runs-on megatron")


class LayerLetters:
    """A profile's layers as Megatron layout letters: which letter each layer stands for, where
    a stage may start (never inside a split block), and where the MTP layers are."""

    def __init__(self, profile: Profile, *, letters: Mapping[str, str] | None = None, file: str | None = None):
        table = {**KIND_LETTERS, **(letters or {})}
        self.num_layers = profile.num_layers
        # per layer: its letter when it starts a Megatron layer, "" when it continues one
        self.letter: list[str] = []
        self.cuts: set[int] = {0, profile.num_layers}  # layer indices a stage may start at
        previous_block = None
        kinds_blocks = [_kind_and_block(layer.kind, layer.name) for layer in profile.layers]
        check_kind_letters(profile, letters or {})
        for index, (layer, (kind, block)) in enumerate(zip(profile.layers, kinds_blocks)):
            if kind not in table:
                known = ", ".join(sorted(table))
                raise InputError(file, f"layers.{index}.kind",
                                 f"is {layer.kind!r} ({layer.name}): Megatron-LM's pipeline layout has letters only "
                                 f"for embedding (E), decoder layers (t), MTP layers (m) and the loss (L)",
                                 f"layer kinds it maps: {known}; map others with --kind-letter KIND=LETTER where a "
                                 f"Megatron decoder layer is what that layer is")
            continues = block is not None and block == previous_block
            self.letter.append("" if continues else table[kind])
            if not continues:
                self.cuts.add(index)
            previous_block = block
        letters_seen = "".join(self.letter)
        for letter, where in (("E", "first"), ("L", "last")):
            if letters_seen.count(letter) > 1:
                raise InputError(file, "layers", f"has {letters_seen.count(letter)} layers of letter {letter}",
                                 f"Megatron-LM's layout holds exactly one {letter}, the model's {where} layer")
        if "E" in letters_seen and self.letter[0] != "E":
            raise InputError(file, "layers.0", "is not the embedding, but a later layer is",
                             "Megatron-LM's layout starts with the embedding (E)")
        if "L" in letters_seen and letters_seen[-1] != "L":
            raise InputError(file, f"layers.{self.num_layers - 1}", "is not the head, but an earlier layer is",
                             "Megatron-LM's layout ends with the loss (L)")
        stripped = letters_seen.strip("EL")
        if "m" in stripped and "t" in stripped[stripped.index("m"):]:
            raise InputError(file, "layers", "has decoder layers after an MTP layer",
                             "Megatron-LM builds every MTP layer after the decoder layers")
        self.mtp = [i for i, letter in enumerate(self.letter) if letter == "m"]

    def stage_letters(self, bounds: Sequence[int]) -> list[str]:
        """Each stage's letters, for stage boundaries ``bounds`` (S + 1 cut points); E and L
        added to the first and last stage where no layer is the embedding or the head."""
        out = ["".join(self.letter[a:b]) for a, b in zip(bounds, bounds[1:])]
        if "E" not in "".join(out):
            out[0] = "E" + out[0]
        if "L" not in "".join(out):
            out[-1] = out[-1] + "L"
        return out

    def bounds_problem(self, bounds: Sequence[int], pp: int) -> str | None:
        """Why Megatron cannot take stages with these boundaries on ``pp`` ranks (None: it can)."""
        inside = [b for b in bounds if b not in self.cuts]
        if inside:
            return (f"a stage starts at layer {inside[0]}, inside a split block: Megatron-LM's t is a whole decoder "
                    f"layer (its mixer and its MLP together)")
        if self.mtp:
            stages = {next(s for s in range(len(bounds) - 1) if bounds[s] <= i < bounds[s + 1]) for i in self.mtp}
            if len(stages) > 1:
                return "the MTP layers are split over several stages; Megatron-LM keeps them in one"
            (stage,) = stages
            num_stages = len(bounds) - 1
            if num_stages % pp == 0 and stage < num_stages - pp:
                return (f"the MTP layers are in stage {stage}, not in its rank's last virtual stage "
                        f"(stages {num_stages - pp} to {num_stages - 1}), where Megatron-LM requires them")
        return None


def megatron_order(pp: int, microbatches: int, chunks: int) -> list[list[Op]] | None:
    """The op order Megatron-LM runs for ``chunks`` stages per rank in a loop: 1F1B, or its
    interleaved 1F1B (microbatches taken in groups of pp, each rank warming up with
    2 (pp - 1 - r) + (chunks - 1) pp forwards, all of them where that is every forward: with
    exactly pp microbatches only the first ranks run every forward first, as megatron-core's
    ``get_pp_rank_microbatches`` counts them; Megatron-LM before it ran every rank so). None
    where Megatron refuses (interleaved with microbatches not a multiple of pp)."""
    if chunks > 1 and microbatches % pp:
        return None
    return interleaved_1f1b(pp, microbatches, chunks)


def uniform_recompute(stages: Sequence[Stage], letters: Sequence[str] | None = None) -> int | None | bool:
    """Megatron's ``--recompute-num-layers`` for these stages: False when none recomputes, the
    N every stage recomputes its first N layers with (all of a shorter stage's), None when no
    single N describes them. Counted in profile layers, or with ``letters`` (each profile layer's
    layout letter) in decoder layers (t), as Megatron-LM counts them."""
    def among(start: int, end: int) -> int:
        return end - start if letters is None else letters[start:end].count("t")

    counts = [among(s.start, s.start + s.recomputed_layers) for s in stages]
    if not any(s.recomputed_layers for s in stages):
        return False
    n = max(counts)
    if all(c == min(n, among(s.start, s.end)) for c, s in zip(counts, stages)):
        return n
    return None


def one_recompute_count(stages: Sequence[Stage], letters: LayerLetters) -> bool:
    """Whether one ``--recompute-num-layers`` N describes the stages' recomputation: one N in
    profile layers (the embedding or a split block's half then counts, which the export notes)
    or in decoder layers, as Megatron-LM counts them."""
    return uniform_recompute(stages) is not None or uniform_recompute(stages, letters.letter) is not None


# Megatron-LM's own rank order, tp-cp-ep-dp-pp: a stage's data-parallel replicas on consecutive
# ranks; --use-tp-pp-dp-mapping gives pp-inner instead, which it refuses with expert parallelism
MEGATRON_RANK_ORDER = "dp-inner"


def _degree(profile: Profile, key: str) -> int:
    """A parallel degree a profile was made for (``model.config[key]``; 1 without one)."""
    try:
        return max(1, int(profile.model.config.get(key) or 1))
    except (TypeError, ValueError):
        return 1


def expert_parallel(profile: Profile) -> int:
    """The expert-parallel degree a profile was made for (``model.config.ep``; 1 without one)."""
    return _degree(profile, "ep")


def tensor_parallel(profile: Profile) -> int:
    """The tensor-parallel degree a profile was made for (``model.config.tp``; 1 without one)."""
    return _degree(profile, "tp")


def megatron_rank_order_problem(parallel: Parallel, cluster: Cluster, ep: int) -> str | None:
    """Why Megatron-LM cannot number the ranks as ``parallel`` does on ``cluster`` (None: it
    can, by its own order, by ``--use-tp-pp-dp-mapping``, or because both orders put the same
    ranks on each node)."""
    if parallel.runs_in_order(MEGATRON_RANK_ORDER, cluster) or ep == 1:
        return None
    return (f"its {parallel.rank_order} rank order needs --use-tp-pp-dp-mapping, which Megatron-LM refuses with "
            f"expert parallelism (the profile's ep {ep}); its own order is {MEGATRON_RANK_ORDER}")


def megatron_problem(plan: Plan, letters: LayerLetters, *, ep: int = 1, tp: int = 1) -> str | None:
    """Why Megatron-LM cannot run ``plan`` as planned (None: it can); ``ep`` and ``tp``: the
    profile's expert- and tensor-parallel degrees (:func:`expert_parallel`, :func:`tensor_parallel`)."""
    pp, num_stages = plan.pp, plan.num_stages
    ranks = [s.rank for s in plan.stages]
    if framework_placement(pp, ranks) != "loop":
        if pp == 1:
            return (f"a rank of {num_stages} stages needs a pipeline: Megatron-LM's virtual stages need pp 2 or more, "
                    "and it runs pp 1 as one stage")
        wrong = next((s for s, r in enumerate(ranks) if r != s % pp), None)
        where = (f"stage {wrong} is on rank {ranks[wrong]}, not {wrong % pp}" if wrong is not None
                 else f"{num_stages} stages are not a multiple of pp {pp}")
        return f"Megatron-LM places stage i on rank i mod pp with the same stage count on every rank; {where}"
    bounds = [plan.stages[0].start] + [s.end for s in plan.stages]
    problem = letters.bounds_problem(bounds, pp)
    if problem:
        return problem
    chunks = num_stages // pp
    if any(op.kind in (Kind.I, Kind.W) for ops in plan.schedule for op in ops):
        return "the plan splits backwards into I and W; Megatron-LM runs each backward whole"
    order = megatron_order(pp, plan.microbatches, chunks)
    if order is None:
        return (f"Megatron-LM's interleaved 1F1B needs the microbatches ({plan.microbatches}) to be a multiple "
                f"of pp ({pp})")
    if [list(ops) for ops in plan.schedule] != order:
        which = "1F1B" if chunks == 1 else f"interleaved 1F1B with {chunks} virtual stages per rank"
        rank = next(r for r in range(pp) if list(plan.schedule[r]) != order[r])
        return f"rank {rank}'s op order is not Megatron-LM's {which}"
    if not one_recompute_count(plan.stages, letters):
        return ("its stages recompute different numbers of layers; Megatron-LM's --recompute-num-layers is one N "
                "for every stage")
    return megatron_expert_problem(plan.parallel, ep, tp) or megatron_rank_order_problem(plan.parallel, plan.cluster, ep)


def megatron_expert_problem(parallel: Parallel, ep: int, tp: int = 1) -> str | None:
    """Why Megatron-LM cannot form ``ep``-wide expert-parallel groups under ``parallel`` with
    ``tp``-wide tensor parallelism (None: it can). It takes them from a stage's tensor- and
    data-parallel ranks (megatron.core.parallel_state: the world size a multiple of expert
    tensor-parallel x ep x pp), so at its most lenient (expert tensor parallelism 1) tp x dp
    must be a multiple of ep."""
    if ep <= 1 or (tp * parallel.dp) % ep == 0:
        return None
    return (f"Megatron-LM forms the profile's expert-parallel groups (ep {ep}) from a stage's tensor- and data-parallel "
            f"ranks, and tp {tp} x dp {parallel.dp} is not a multiple of {ep}")


def _compress_stage(letters: str) -> str:
    # runs of 3 or more as x*n; shorter runs spelled out (tt reads better than t*2)
    return "".join(m.group(1) * len(m.group(0)) if len(m.group(0)) < 3 else f"{m.group(1)}*{len(m.group(0))}"
                   for m in re.finditer(r"(.)\1*", letters))


def layout_string(stages: Sequence[str]) -> str:
    """The layout of per-stage letter strings, with repeated stages written once as
    ``(|s)*n``: ``["Ett", "tt", "tt", "tL"]`` is ``Ett(|tt)*2|tL``. The first stage is never
    part of a group (it alone holds E), so a group always follows a stage, never dangles."""
    if not stages:
        raise ValueError("a layout needs at least one stage")
    out = [_compress_stage(stages[0])]
    i = 1
    while i < len(stages):
        j = i
        while j < len(stages) and stages[j] == stages[i]:
            j += 1
        text = _compress_stage(stages[i])
        out.append(f"|{text}" if j - i == 1 else f"(|{text})*{j - i}")
        i = j
    return "".join(out)


def parse_layout(text: str) -> list[str]:
    """The stages (letter strings) of a layout string, by the grammar of the module docstring;
    ``ValueError`` on anything else, including nested groups (Megatron's parser cannot
    expand those)."""
    body = text.replace(",", "")
    pos = 0

    def count() -> int:
        nonlocal pos
        if pos >= len(body) or body[pos] != "*":
            return 1
        match = re.match(r"\*(\d+)", body[pos:])
        if not match or int(match.group(1)) < 1:
            raise ValueError(f"'*' at {pos} is not followed by a positive count")
        pos += len(match.group(0))
        return int(match.group(1))

    def sequence(nested: bool) -> str:
        nonlocal pos
        out = []
        while pos < len(body):
            char = body[pos]
            if char == ")":
                if not nested:
                    raise ValueError(f"unmatched ')' at {pos}")
                return "".join(out)
            pos += 1
            if char == "(":
                if nested:
                    raise ValueError(f"nested group at {pos - 1}")
                inner = sequence(True)
                if pos >= len(body) or not inner:
                    raise ValueError("a group is empty or not closed")
                pos += 1  # the ')'
                out.append(inner * count())
            elif char in LETTERS:
                out.append(char * count())
            elif char == "|":
                out.append("|")
            else:
                raise ValueError(f"unknown character {char!r} at {pos - 1}")
        if nested:
            raise ValueError("a group is not closed")
        return "".join(out)

    return sequence(False).split("|")


def check_layout(stages: Sequence[str], pp: int, *, num_layers: int, mtp_layers: int = 0) -> None:
    """Megatron-LM's rules for a layout of ``stages`` on ``pp`` ranks; ``ValueError`` naming the
    rule broken."""
    if len(stages) % pp:
        raise ValueError(f"{len(stages)} stages are not a multiple of pp {pp}")
    flat = "".join(stages)
    if not flat or flat[0] != "E" or flat[-1] != "L":
        raise ValueError("the layout must start with E and end with L")
    for letter in "EL":
        if flat.count(letter) != 1:
            raise ValueError(f"{letter} appears {flat.count(letter)} times, not once")
    if flat.count("t") != num_layers:
        raise ValueError(f"{flat.count('t')} decoder layers (t), but --num-layers is {num_layers}")
    if flat.count("m") != mtp_layers:
        raise ValueError(f"{flat.count('m')} MTP layers (m), but --mtp-num-layers is {mtp_layers}")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        raise ValueError("a decoder layer (t) follows an MTP layer (m)")
    holding = [s for s, text in enumerate(stages) if "m" in text]
    if len(holding) > 1:
        raise ValueError(f"the MTP layers are in stages {holding}, not one")
    if holding and holding[0] < len(stages) - pp:
        raise ValueError(f"the MTP layers are in stage {holding[0]}, not in its rank's last virtual stage")


@dataclass(frozen=True)
class MegatronExport:
    """A Megatron-runnable plan as Megatron-LM arguments."""

    layout: str
    stages: tuple[str, ...]  # each stage's letters, unrolled
    arguments: tuple[str, ...]  # the command-line arguments, one option or value per item
    notes: tuple[str, ...]  # what the arguments cannot carry

    def shell(self, *, title: str) -> str:
        """The arguments as a bash array, to ``source`` and pass as ``"${MEGATRON_PP_ARGS[@]}"``."""
        lines = [f"# {one_line(title)}", "MEGATRON_PP_ARGS=("]
        args = list(self.arguments)
        while args:
            option = args.pop(0)
            value = [] if not args or args[0].startswith("--") else [args.pop(0)]
            lines.append("  " + " ".join(shlex.quote(part) for part in [option, *value]))
        lines.append(")")
        lines.extend(f"# note: {one_line(note)}" for note in self.notes)
        return "\n".join(lines) + "\n"


def megatron_export(plan: Plan, profile: Profile, *, letters: Mapping[str, str] | None = None,
                    file: str = "<plan>") -> MegatronExport:
    """``plan`` as Megatron-LM arguments; :class:`InputError` naming why Megatron-LM cannot run
    it (the layer kinds, the placement, the order, the recomputation)."""
    check_structure(plan, file=file, num_layers=profile.num_layers)
    table = LayerLetters(profile, letters=letters, file=plan.profile or file)
    ep, tp = expert_parallel(profile), tensor_parallel(profile)
    problem = megatron_problem(plan, table, ep=ep, tp=tp)
    if problem:
        raise InputError(file, None, f"Megatron-LM cannot run this plan: {problem}",
                         "octoplan tune --runs-on megatron finds the best plan it can run")
    bounds = [plan.stages[0].start] + [s.end for s in plan.stages]
    stages = table.stage_letters(bounds)
    layout = layout_string(stages)
    num_layers, mtp = "".join(stages).count("t"), "".join(stages).count("m")
    check_layout(parse_layout(layout), plan.pp, num_layers=num_layers, mtp_layers=mtp)  # our own output, checked
    dp = plan.parallel.dp
    args = ["--pipeline-model-parallel-size", str(plan.pp), "--pipeline-model-parallel-layout", layout,
            "--num-layers", str(num_layers)]
    if mtp:
        args += ["--mtp-num-layers", str(mtp)]
    args += ["--micro-batch-size", str(profile.microbatch_size),
             "--global-batch-size", str(profile.microbatch_size * plan.microbatches * dp)]
    notes = [f"{plan.microbatches} microbatches per pipeline: Megatron-LM takes global batch / (micro batch x "
             f"data-parallel size), with data-parallel size {dp} = GPUs / (pp {plan.pp} x your tensor-parallel size)",
             "the layout sets the virtual stages per rank; give no --num-layers-per-virtual-pipeline-stage, "
             "--num-virtual-stages-per-pipeline-rank, --decoder-first/last-pipeline-num-layers or "
             "--account-for-embedding/loss-in-pipeline-split beside it"]
    if plan.pp == 2 and plan.num_stages > plan.pp:
        # megatron/training/arguments.py asserts pp > 2 for virtual stages unless the p2p overlap
        # is on, which it is by default in every version that reads a layout (an older flag,
        # --overlap-p2p-communication, is unknown to those)
        notes.append("virtual stages at pp 2 need Megatron-LM's p2p overlap, on by default: give no "
                     "--no-overlap-p2p-communication")
    if ep > 1 and plan.parallel.dp % ep:
        notes.append(f"tp {tp} x dp {plan.parallel.dp} forms the profile's expert-parallel groups (ep {ep}) only with "
                     f"--expert-tensor-parallel-size 1 (its default is the tensor-parallel size)")
    if not plan.parallel.runs_in_order(MEGATRON_RANK_ORDER, plan.cluster):
        # a pipeline's ranks consecutive, as the plan's pp-inner order; where both orders put the
        # same ranks on each node, Megatron-LM's own order runs the plan as planned without it
        args.append("--use-tp-pp-dp-mapping")
        notes.append("--use-tp-pp-dp-mapping puts a pipeline's ranks next to each other, as the plan's pp-inner rank "
                     "order does; Megatron-LM refuses it with context parallelism: there, plan with the dp-inner "
                     "order (Megatron-LM's default)")
    if any(stage.recomputed_layers for stage in plan.stages):
        args += _recompute_arguments(plan, table, notes)
    return MegatronExport(layout, tuple(stages), tuple(args), tuple(notes))


def _recompute_arguments(plan: Plan, table: LayerLetters, notes: list[str]) -> list[str]:
    """Megatron's block recomputation for a plan whose stages recompute their first N profile
    layers: ``--recompute-num-layers`` counts decoder layers (t), so N becomes the decoder layers
    among a stage's first N layers (a split block counts once its mixer is among them)."""
    recomputed = [table.letter[s.start:s.start + s.recomputed_layers].count("t") for s in plan.stages]
    decoders = [table.letter[s.start:s.end].count("t") for s in plan.stages]
    n = max(recomputed)
    differ = [str(i) for i, (k, total) in enumerate(zip(recomputed, decoders)) if k != min(n, total)]
    if differ:
        notes.append(f"Megatron-LM recomputes the first {n} decoder layers of every stage; the plan's stages "
                     f"{', '.join(differ)} recompute fewer (their embedding or a split block's half counts in the "
                     "plan), so under Megatron-LM they need less memory and a little more time than the plan predicts")
    names = {"E": "the embedding", "m": "an MTP layer", "L": "the loss head"}
    kept = {i: sorted({names[c] for c in table.letter[s.start:s.start + s.recomputed_layers] if c in names})
            for i, s in enumerate(plan.stages)}
    kept = {i: what for i, what in kept.items() if what}
    if kept:  # the plan prices them recomputed; Megatron-LM keeps their activations
        which = "; ".join(f"stage {i}: {' and '.join(what)}" for i, what in kept.items())
        notes.append(f"the plan also recomputes layers Megatron-LM's block recomputation never recomputes ({which}): "
                     "under Megatron-LM those stages keep these layers' activations (the head's are vocabulary-sized) "
                     "and need more memory than the plan predicts")
    if n == 0:
        notes.append("the plan recomputes no decoder layer, and Megatron-LM recomputes only decoder layers")
        return []
    if n > 1:  # (with one layer the two agree)
        notes.append(f"Megatron-LM checkpoints each of the {n} layers on its own: it keeps each one's input, where "
                     "the plan keeps the stage's input only, and reruns them one at a time in the backward, where the "
                     "plan reruns them together; its peak memory differs from the plan's by those inputs less the "
                     "rerun layers' activations but one")
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(n)]


def export_megatron(plan: Plan, profile: Profile, path: str | Path, *, letters: Mapping[str, str] | None = None,
                    file: str = "<plan>", title: str | None = None) -> MegatronExport:
    """Write ``plan``'s Megatron-LM arguments to ``path`` as a bash array (see
    :meth:`MegatronExport.shell`); nothing is written when it raises."""
    export = megatron_export(plan, profile, letters=letters, file=file)
    write_text(path, export.shell(title=title or f"Megatron-LM arguments for {file} (octoplan export --format megatron)"))
    return export
