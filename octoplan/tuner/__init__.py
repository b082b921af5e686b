"""The tuner: co-optimizes partition, placement and schedule (``octoplan tune``).

:mod:`octoplan.tuner.search` runs the steps; the seeds come from :mod:`octoplan.tuner.seeds`,
the climbs' moves from :mod:`octoplan.tuner.neighbourhoods`, and the climb loop is
:mod:`octoplan.tuner.climb`'s."""

from octoplan.tuner.search import BaselineRow, TuneOptions, TuneResult, compare_baselines, configs_for, tune

__all__ = ["BaselineRow", "TuneOptions", "TuneResult", "compare_baselines", "configs_for", "tune"]
