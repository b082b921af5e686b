"""OctoPipe planner: profiles, plans, baseline schedules, simulator and tuner."""

__version__ = "0.1.0"
