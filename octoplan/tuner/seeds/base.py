"""What a seed family is: one source of the plans the search ranks and climbs from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Iterable, Sequence

from octoplan.plan import Cluster
from octoplan.profile import Profile
from octoplan.schedules.policy import default_policies
from octoplan.tuner.space import Candidate, Config, Evaluator

if TYPE_CHECKING:
    from octoplan.tuner.climb import Search
    from octoplan.tuner.search import TuneOptions

__all__ = ["SeedContext", "SeedFamily", "Ranked", "SPLIT_SETTINGS", "with_policies"]

# a ranked seed: (its score, the index of the seed it was made from, the candidate); ranked by
# the first two, so a seed made from another sits right after it among equals
Ranked = tuple[tuple[int, float], int, Candidate]


# the policy knobs (split backward, warm-up depth, warm-up gap) a new layout is tried at: I and W
# apart, warm-ups of the pipeline's depth and of twice it, with and without the gap
SPLIT_SETTINGS = ((True, 1.0, False), (True, 2.0, False), (True, 2.0, True))


def with_policies(config: Config, bounds: tuple[int, ...], ranks: tuple[int, ...], origin: str,
                  settings=SPLIT_SETTINGS) -> list[Candidate]:
    """The layout (``bounds``, ``ranks``) of ``config`` once per policy setting, each candidate's
    origin ``origin`` with its setting appended."""
    return [Candidate(config, bounds, ranks,
                      default_policies(ranks, config.pp, config.microbatches, split=split, depth=depth, warmup_gap=gap),
                      None, f"{origin}, split={split}, depth={depth:g}, warm-up gap={gap}")
            for split, depth, gap in settings]


@dataclass
class SeedContext:
    """What every seed family may read while the search seeds one profile."""

    search: Search  # its offer() prices a candidate (and keeps it, if it is the best so far)
    configs: Sequence[Config]  # every outer configuration the options allow
    baseline_chunks: int  # the most interleaved-1F1B chunks among the baselines
    # what the families report into the plan's tuner stats, by key (CP-SAT: each solve's
    # status, objective, bound and time)
    stats: dict[str, list] = field(default_factory=dict)

    @property
    def evaluator(self) -> Evaluator:
        return self.search.ev

    @property
    def profile(self) -> Profile:
        return self.search.ev.profile

    @property
    def cluster(self) -> Cluster:
        return self.search.ev.cluster

    @property
    def opts(self) -> TuneOptions:
        """The search's options: ``chunks_max`` is its bound on stages per rank (set)."""
        return self.search.opts


class SeedFamily:
    """A source of seeds. The search asks every family that :meth:`applies`, in the registry's
    order (:data:`octoplan.tuner.seeds.SEED_FAMILIES`), first for the seeds of each
    configuration (:meth:`seeds`), then, once all of them are priced and ranked, for seeds
    made from the best ones (:meth:`from_ranked`). A family implements either or both.

    Deterministic: a family may read the search's clock to stop early, but what it yields up
    to then must not depend on the machine (with ``--max-plans`` the clock counts plans)."""

    name: ClassVar[str] = ""

    def applies(self, ctx: SeedContext) -> bool:
        """Whether the options let this family's seeds be tuned (its dimensions, ``--runs-on``)."""
        return True

    def seeds(self, ctx: SeedContext, config: Config, earlier: Sequence[Candidate]) -> Iterable[Candidate]:
        """Candidates of ``config``, unpriced (the search prices them all, in order, when it
        ranks them). ``earlier``: the seeds of ``config`` so far (the baselines', then the
        families' before this one)."""
        return ()

    def from_ranked(self, ctx: SeedContext, ranked: Sequence[Ranked]) -> Iterable[tuple[int, Candidate]]:
        """Candidates made from the seeds ranked so far (best first), each with the index of
        the seed it was made from. Each is priced as soon as it is yielded, so a family can
        stop by :func:`~octoplan.tuner.climb.climbs_end_s`, as the seeds' pricing does (the
        rest of the time limit is the polish's and the final plan's)."""
        return ()
