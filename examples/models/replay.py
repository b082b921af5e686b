"""The replay model as a model file (FORMATS.md section 4): see :mod:`octorun.replay`.

Config ``profile=PATH``, ``time_scale=S``, ``bytes_scale=B``: layer i sleeps S times the
profile's forward, input-gradient and weight-gradient times, so N processes on a CPU emulate
an N-GPU pipeline of a model far too large to run here. ``octorun PLAN --replay`` uses the same
model directly on a plan's profile.
"""

from octorun.replay import CONFIG, PROFILE_CLOCK, ReplayLayer, build_layer, layer_kind, layer_name, loss_fn, num_layers, sample_batch

__all__ = ["CONFIG", "PROFILE_CLOCK", "ReplayLayer", "num_layers", "build_layer", "sample_batch", "loss_fn", "layer_kind", "layer_name"]
