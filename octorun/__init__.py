"""OctoPipe runtime: executes any valid plan with torch.distributed (``torchrun ... -m octorun PLAN``).

Reads plans through :mod:`octoplan.plan` and ops through :mod:`octoplan.ops`; never needs
OR-Tools or the simulator.
"""

__all__ = ["RunConfig", "RunResult", "run"]


def __getattr__(name: str):
    # torch is heavy: import the runtime only when it is used
    if name in __all__:
        from octorun import runtime

        return getattr(runtime, name)
    raise AttributeError(name)
