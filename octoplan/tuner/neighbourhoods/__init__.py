"""The climbs' neighbourhoods: every kind of move a hill climb tries, in the order it tries them.

A neighbourhood (:class:`Neighbourhood`) turns the current candidate and its simulated timeline
into moved candidates, most promising first and lazily; the one climb loop
(:meth:`octoplan.tuner.climb.Search.climb`) walks :data:`NEIGHBOURHOODS` in order and takes
the first move that is faster. So the cheap, many moves come first, and those that cost a pass
over every op (a justification, a rebuilt order) only at a local optimum of the ones before.
A neighbourhood may instead be the final polish's alone (``climbs`` false, ``polish`` true):
the polish climbs over those from the best plan the climbs found.

A new kind of move is a new module here: a subclass of :class:`Neighbourhood` with its
``dimensions`` and ``moves``, added to :data:`NEIGHBOURHOODS` where it should be tried
(``tune(..., neighbourhoods=...)`` takes another list, for an experiment).
"""

from octoplan.tuner.neighbourhoods.base import Neighbourhood
from octoplan.tuner.neighbourhoods.basic import BasicMoves
from octoplan.tuner.neighbourhoods.chains import CHAIN_SHIFTS, ChainShifts
from octoplan.tuner.neighbourhoods.compound import COMPOUND_SHIFTS, PEELS, PeeledAndJustified, ShiftedAndJustified
from octoplan.tuner.neighbourhoods.orders import BottleneckOrder, JustifiedOrder, LongestTailOrder

__all__ = ["Neighbourhood", "NEIGHBOURHOODS", "BasicMoves", "JustifiedOrder", "BottleneckOrder", "LongestTailOrder",
           "ShiftedAndJustified", "PeeledAndJustified", "ChainShifts", "COMPOUND_SHIFTS", "PEELS",
           "CHAIN_SHIFTS"]

NEIGHBOURHOODS: tuple[Neighbourhood, ...] = (
    BasicMoves(),  # boundaries, stages, placement, policy knobs, recomputation, op edits at bubbles
    JustifiedOrder(),  # at a local optimum of those: the whole order justified
    BottleneckOrder(),  # rebuilt by the shifting-bottleneck procedure
    LongestTailOrder(),  # rebuilt by the longest-tail-first list scheduler
    ShiftedAndJustified(COMPOUND_SHIFTS),  # a layer off a hot rank, the order justified around it
    PeeledAndJustified(PEELS),  # a layer peeled into a new stage, the order carried and justified
    ChainShifts(CHAIN_SHIFTS),  # the polish's only: a layer passed along a run of stages, the order justified
)
