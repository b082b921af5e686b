"""What a neighbourhood is: one kind of move a climb tries (:meth:`octoplan.tuner.climb.Search.climb`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Iterator

from octoplan.simulator import SimResult
from octoplan.tuner.space import Candidate

if TYPE_CHECKING:
    from octoplan.tuner.climb import Search

__all__ = ["Neighbourhood"]


class Neighbourhood(ABC):
    """One kind of move. A climb asks each neighbourhood in turn, at every step, for the
    candidates one move away from the current one, and takes the first that is faster; so a
    neighbourhood yields its most promising moves first, and lazily: the climb stops reading
    at the first improvement, and reads a later neighbourhood only once this one is spent.

    ``dimensions``: those the search must tune (``TuneOptions.dimensions``) for the
    neighbourhood to apply: a move that reorders ops needs ``schedule``, one that moves a
    boundary ``partition`` too."""

    name: ClassVar[str] = ""
    dimensions: ClassVar[tuple[str, ...]] = ()
    # whether every climb tries it, and whether the search's final polish climbs over it from
    # the best plan (before a climb over every neighbourhood, if that found a faster plan): a
    # move worth its cost only on the best plan is the polish's alone
    climbs: ClassVar[bool] = True
    polish: ClassVar[bool] = False

    @abstractmethod
    def moves(self, search: Search, cand: Candidate, timeline: SimResult, deadline: float) -> Iterator[Candidate]:
        """The candidates one move from ``cand``, whose simulated ``timeline`` is given; the
        search's clock must not pass ``deadline`` (seconds since tuning began) for a move
        that costs more than a simulation. Moves may repeat or break a rule: the climb skips
        what the evaluator rejects and what ``--runs-on`` does not allow."""
