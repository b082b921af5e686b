"""Timeline views of a simulated iteration: terminal, SVG picture, Chrome trace.

``octoplan show`` draws a plan's timeline with :func:`render_terminal`, writes a picture with
:func:`write_svg` and a Perfetto / chrome://tracing file with :func:`write_trace`, and checks
the simulator against a measured ``octorun --trace`` file with :func:`compare_measured`. All
of them read a :class:`~octoplan.simulator.SimResult` and never simulate themselves.
"""

from octoplan.timeline.svg import write_svg
from octoplan.timeline.terminal import render_terminal
from octoplan.timeline.trace import compare_measured, render_comparison, trace_events, write_trace

__all__ = ["render_terminal", "write_svg", "write_trace", "trace_events", "compare_measured", "render_comparison"]
