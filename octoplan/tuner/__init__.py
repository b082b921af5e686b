"""The tuner: co-optimizes partition, placement and schedule (``octoplan tune``)."""

from octoplan.tuner.search import BaselineRow, TuneOptions, TuneResult, compare_baselines, configs_for, tune

__all__ = ["BaselineRow", "TuneOptions", "TuneResult", "compare_baselines", "configs_for", "tune"]
