"""Which training frameworks can run a candidate plan, and the search's constraint for ``--runs-on``.

octorun and torch.distributed.pipelining (octoplan's ``torch-csv`` export) run any plan.
torchtitan runs a plan whose stages sit in a loop (stage s on rank s mod pp) or in a V of two
stages per rank (:mod:`octoplan.export_torchtitan`); Megatron-LM one in a loop with its own
1F1B or interleaved 1F1B order, a layout its layer letters can express, and one recomputation
count for every stage (:mod:`octoplan.export_megatron`). Across nodes, each also numbers the
ranks its own way: torchtitan dp-inner only, Megatron-LM either way but for expert parallelism
(dp-inner only).

``--runs-on`` confines the search to the plans one of them runs: ``megatron`` (only the
partition is tuned, under Megatron's order; recomputation only as Megatron's block method),
``loop`` and ``v`` (torchtitan's two placements; partition and order are tuned).
"""

from __future__ import annotations

from typing import Mapping

from octoplan.errors import InputError
from octoplan.export_megatron import (MEGATRON_RANK_ORDER, LayerLetters, expert_parallel, megatron_order,
                                      megatron_expert_problem, megatron_rank_order_problem, one_recompute_count,
                                      tensor_parallel)
from octoplan.export_torchtitan import TORCHTITAN_RANK_ORDER, torchtitan_cuts
from octoplan.plan import Cluster
from octoplan.profile import Profile
from octoplan.schedules import framework_placement
from octoplan.tuner.space import Candidate

__all__ = ["RUNS_ON", "FRAMEWORKS", "PARTIAL_FRAMEWORKS", "Frameworks", "MEGATRON_ID", "frameworks_order"]

RUNS_ON = ("any", "megatron", "loop", "v")
FRAMEWORKS = ("octorun", "torch", "torchtitan", "Megatron-LM")
# the frameworks that run only some plans (their own placements, orders and rank numbering)
PARTIAL_FRAMEWORKS = ("torchtitan", "Megatron-LM")
MEGATRON_ID = "megatron"  # the fixed_id prefix of the search's Megatron-ordered seeds


def frameworks_order(runs_on: str, profile: Profile) -> str | None:
    """The one rank order that ``--runs-on`` allows where the two put different ranks on a node
    (None: either): torchtitan's for its placements; Megatron-LM's own under expert
    parallelism, where it refuses the mapping that gives the other."""
    if runs_on in ("loop", "v"):
        return TORCHTITAN_RANK_ORDER
    if runs_on == "megatron" and expert_parallel(profile) > 1:
        return MEGATRON_RANK_ORDER
    return None


class Frameworks:
    """The frameworks of one profile's candidates on ``cluster`` (None: rank orders are not
    checked); ``letters`` are None when Megatron-LM's layout cannot express the profile's
    layers (``megatron_reason`` says why)."""

    def __init__(self, profile: Profile, *, letters: Mapping[str, str] | None = None, cluster: Cluster | None = None):
        try:
            self.letters: LayerLetters | None = LayerLetters(profile, letters=letters)
            self.megatron_reason = ""
        except InputError as exc:
            self.letters, self.megatron_reason = None, f"{exc.field} {exc.problem}"
        self._orders: dict[tuple[int, int, int], tuple | None] = {}
        self.cluster, self.ep, self.tp = cluster, expert_parallel(profile), tensor_parallel(profile)
        # where torchtitan's export may start a stage: by default (--fqn-style llama; None: it
        # names no module for some layer, and refuses every plan), and with the profile's names
        self.llama_cuts, self.profile_cuts = torchtitan_cuts(profile, "llama"), torchtitan_cuts(profile, "profile")

    def torchtitan_numbers(self, cand: Candidate) -> bool:
        """torchtitan numbers the ranks as ``cand`` does, or alike on its nodes."""
        return self.cluster is None or cand.config.parallel().runs_in_order(TORCHTITAN_RANK_ORDER, self.cluster)

    def torchtitan_splits(self, cand: Candidate) -> bool:
        """One of torchtitan's export styles splits its modules where ``cand``'s stages start:
        Llama-style names, or the profile's own where they are module names (not an analytic or
        an hf: profile's). One stage is no split (at pp 1 torchtitan builds no pipeline)."""
        starts = cand.bounds[:-1]
        return len(starts) == 1 or any(cuts is not None and all(start in cuts for start in starts)
                                       for cuts in (self.llama_cuts, self.profile_cuts))

    def megatron_numbers(self, cand: Candidate) -> bool:
        """Megatron-LM can group and number the ranks as ``cand`` does (:func:`megatron_expert_problem`,
        :func:`megatron_rank_order_problem`)."""
        parallel = cand.config.parallel()
        if megatron_expert_problem(parallel, self.ep, self.tp) is not None:
            return False
        return self.cluster is None or megatron_rank_order_problem(parallel, self.cluster, self.ep) is None

    def order(self, pp: int, microbatches: int, chunks: int) -> tuple | None:
        key = (pp, microbatches, chunks)
        if key not in self._orders:
            found = megatron_order(pp, microbatches, chunks)
            self._orders[key] = None if found is None else tuple(tuple(ops) for ops in found)
        return self._orders[key]

    @staticmethod
    def placement(cand: Candidate) -> str | None:
        return framework_placement(cand.config.pp, cand.ranks)

    def megatron_layout_ok(self, cand: Candidate) -> bool:
        """Loop placement, boundaries Megatron's letters allow, one recomputation count."""
        if self.letters is None or self.placement(cand) != "loop":
            return False
        if self.letters.bounds_problem(cand.bounds, cand.config.pp) is not None:
            return False
        return one_recompute_count(cand.stages(), self.letters)

    def megatron_runs(self, cand: Candidate) -> bool:
        """Megatron-LM runs ``cand`` as planned: its layout, and Megatron's order exactly."""
        # the order first: a tuple compare that fails at once for most plans, where the layout
        # check builds the stages (the search asks this of every plan under --runs-on megatron)
        if cand.fixed is None or cand.num_stages % cand.config.pp:
            return False
        order = self.order(cand.config.pp, cand.config.microbatches, cand.num_stages // cand.config.pp)
        return cand.fixed == order and self.megatron_layout_ok(cand)

    def runs_on(self, cand: Candidate) -> tuple[str, ...]:
        """The frameworks that run ``cand`` as planned, in :data:`FRAMEWORKS` order."""
        out = ["octorun", "torch"]
        if self.placement(cand) is not None and self.torchtitan_numbers(cand) and self.torchtitan_splits(cand):
            out.append("torchtitan")
        if self.megatron_runs(cand) and self.megatron_numbers(cand):
            out.append("Megatron-LM")
        return tuple(out)

    def allows(self, cand: Candidate, runs_on: str) -> bool:
        """Whether the search confined by ``runs_on`` may keep ``cand``. For ``megatron``: a
        plan of the search's Megatron-ordered seeds (boundary shifts keep their order, every
        reordering renames it) whose layout is :meth:`megatron_layout_ok`, or any other whose
        order is Megatron's own (:meth:`megatron_runs`, which builds that order to compare)."""
        if runs_on == "any":
            return True
        if runs_on == "megatron":
            if not self.megatron_numbers(cand):
                return False
            if cand.fixed is not None and cand.fixed_id.startswith(MEGATRON_ID) and "+" not in cand.fixed_id:
                return self.megatron_layout_ok(cand)
            # a baseline whose order is Megatron's own (1F1B, interleaved 1F1B) under another name
            return self.megatron_runs(cand)
        return self.placement(cand) == runs_on and self.torchtitan_numbers(cand) and self.torchtitan_splits(cand)
