"""The replay model through the profiler: its measured profile is the source profile times
the time scale, layer by layer, within 5% (SPEC section 4 model, octoplan profile)."""

from __future__ import annotations

import pytest

from octoplan.profiler import profile_model_file

from conftest import REPO, make_profile


@pytest.mark.slow
def test_replayed_profile_matches_the_source_times_the_scale(profile_file):
    source = make_profile([(10, 12, 8), (20, 16, 24), (8, 10, 14), (30, 25, 20)], out=40_000, act=10)
    path = profile_file(source, "source.yaml")
    scale = 1.5  # ops of 12-45 ms
    measured = profile_model_file(
        str(REPO / "examples/models/replay.py"), config={"profile": str(path), "time_scale": scale},
        microbatch_size=1, repeat=5, warmup=1, clock="wall",
    )
    assert measured.num_layers == source.num_layers
    for got, want in zip(measured.layers, source.layers):
        for field in ("forward_ms", "backward_input_ms", "backward_weight_ms"):
            expected = scale * getattr(want, field)
            if field == "backward_input_ms" and got is measured.layers[0]:
                continue  # the first layer's input is data: it gets no gradient
            assert getattr(got, field) == pytest.approx(expected, rel=0.05), (got.name, field)
