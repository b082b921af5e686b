"""Hill climbs in parallel processes (``octoplan tune --workers N``).

The search's climbs are independent once the seeds are ranked: each starts from its own seed
and only reads the simulator. With ``workers`` > 1 they run in a pool of processes, each with
its own :class:`~octoplan.tuner.space.Evaluator`, so N cores climb N seeds at once and a climb
that needs long (a plan of many stages) is not cut short by the ones queued behind it. The
main process hands out the climbs in the sequential search's order and with its deadlines,
scaled to the number of workers, and judges each climb's result with its own simulator, so the
plan it writes is priced exactly as with one worker.

Processes are started with ``spawn``: OR-Tools and the rich display may hold threads in the
parent, which ``fork`` would copy half-held. Which climb ends first depends on the machine, so
with several workers a run is reproducible only up to timing (also under ``--max-plans``).
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import replace
from typing import NamedTuple, Sequence

from octoplan.plan import Cluster
from octoplan.profile import Profile
from octoplan.tuner.climb import Clock, Search
from octoplan.tuner.space import Candidate, Evaluator

__all__ = ["Climb", "climb_in_parallel"]

# one evaluator per worker process, built once by the pool's initializer
_worker: dict = {}


class Climb(NamedTuple):
    """One climb to hand out: its start, and whether it gets an equal share of the time left
    (the best seed of each family) or may run to the end (the next-best seeds after them)."""

    start: Candidate
    shared: bool


def _init_worker(profile: Profile, cluster: Cluster, opts, neighbourhoods) -> None:
    _worker["evaluator"] = Evaluator(profile, cluster)
    _worker["opts"] = opts
    _worker["neighbourhoods"] = neighbourhoods


def _climb(start: Candidate, end_wall: float, plan_budget: int | None, seed: int) -> tuple[Candidate, list[str], int]:
    """Climb from ``start`` until a local optimum, ``end_wall`` (``time.time()``), or — with a
    plan budget — that many simulated plans; the candidate reached, the accepted moves, and
    the plans simulated."""
    evaluator: Evaluator = _worker["evaluator"]
    before = evaluator.evaluations
    clock = Clock(max(end_wall - time.time(), 1e-6), max_plans=plan_budget, plans=lambda: evaluator.evaluations - before)
    search = Search(evaluator, replace(_worker["opts"], seed=seed), None, clock=clock,
                    neighbourhoods=_worker["neighbourhoods"])
    final = search.climb(start, deadline=clock.limit_s)
    return final, search.accepted_moves, evaluator.evaluations - before


def climb_in_parallel(search, profile: Profile, cluster: Cluster, opts, climbs: Sequence[Climb], *,
                      end_s: float) -> int:
    """Run ``climbs`` on ``opts.workers`` processes until each has ended or the search's clock
    reaches ``end_s``; every result is offered to ``search``, and the plans the workers simulated
    are added to ``search.extra_plans``. Returns how many climbs ran.

    A climb gets a share of what is left, as in the sequential search. In seconds: the time
    left times the workers (they run side by side), divided among the ``shared`` climbs not yet
    started; a later climb may run to the end. In plans (``--max-plans``), which all workers
    draw from: what is left and not yet promised to a running climb (whose plans reach the
    clock only when it ends), divided among the shared climbs not yet started, or for a later
    climb among the free workers."""
    if not climbs or search.clock.elapsed() >= end_s:
        return 0  # no time left to start the processes in
    workers = opts.workers
    queue = list(climbs)
    shared_left = sum(1 for c in queue if c.shared)
    end_plans = end_s / opts.time_limit_s * opts.max_plans if opts.max_plans else None
    started = 0
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_init_worker,
                             initargs=(profile, cluster, opts, search.neighbourhoods)) as pool:
        running: dict[Future, int | None] = {}  # each running climb's plan budget
        while queue or running:
            while queue and len(running) < workers:
                plan_budget = None
                if end_plans is None:
                    left_s = end_s - search.clock.elapsed()
                    if left_s <= 0:
                        break
                    share_s = min(left_s, left_s * workers / shared_left) if queue[0].shared else left_s
                else:
                    unpromised = end_plans - search.clock.plans() - sum(b for b in running.values() if b)
                    plan_budget = int(unpromised / (shared_left if queue[0].shared else workers - len(running)))
                    if plan_budget < 1:
                        break
                    share_s = opts.time_limit_s  # the plan budget stops the climb, not the clock
                climb = queue.pop(0)
                shared_left -= climb.shared
                # the worker's deadline as wall-clock time, which every process reads alike
                end_wall = time.time() + share_s
                seed = opts.seed * 1_000_003 + started
                started += 1
                running[pool.submit(_climb, climb.start, end_wall, plan_budget, seed)] = plan_budget
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                running.pop(future)
                final, moves, plans = future.result()
                search.extra_plans += plans
                search.accepted_moves.extend(moves)
                search.offer(final)
    return started
