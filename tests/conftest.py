"""Shared fixtures: small profiles built in code, so tests state their costs exactly."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from octoplan.ops import parse_ops
from octoplan.plan import Cluster, Parallel, Plan, Stage
from octoplan.profile import Layer, LayerTimes, ModelRef, Profile, save_profile

REPO = Path(__file__).resolve().parent.parent

T = TypeVar("T")


def remeasured(measure: Callable[[], T], misses: Callable[[T], list[str]], *, attempts: int = 5,
               first_pause_s: float = 0.25) -> list[str]:
    """What the last of up to ``attempts`` measurements misses; [] as soon as one misses nothing.

    For timing tests whose errors go one way only: a shared machine can stall a process (a
    descheduled thread, a late wake-up, a hypervisor taking the core), which only adds time, and
    a stall can last a second or more. So a miss is measured again after a pause that doubles
    each time (0.25 s, 0.5 s, 1 s, 2 s), while code that sleeps or spins the wrong time misses
    in every attempt. Bounds that a stall cannot break (a time *below* what was built) belong in
    ``measure`` itself, asserted on every attempt."""
    pause = first_pause_s
    for attempt in range(attempts):
        found = misses(measure())
        if not found:
            return []
        if attempt + 1 < attempts:
            time.sleep(pause)
            pause *= 2
    return found


def make_profile(times, *, act=0, out=0, params=0, name="synthetic", kinds=None) -> Profile:
    """A profile from a list of (forward, input-grad, weight-grad) ms per layer."""
    layers = []
    for i, (f, ib, wb) in enumerate(times):
        kind = kinds[i] if kinds else "layer"
        layers.append(Layer(f"l{i}", kind, float(f), float(ib), float(wb), params, act, out))
    return Profile(model=ModelRef(name), layers=tuple(layers))


def assert_layers_round_trip(loaded: Profile, written: Profile) -> None:
    """Every field of every layer came back from a file: the measured ones as written (times to
    the file's 6 decimals, spreads to 4), each checked on its own, so that a field the writer drops is caught
    (comparing both sides through profile_to_dict would drop it from both)."""
    assert len(loaded.layers) == len(written.layers)
    for got, want in zip(loaded.layers, written.layers):
        for field in dataclasses.fields(Layer):
            a, b = getattr(got, field.name), getattr(want, field.name)
            if isinstance(b, float):  # the file keeps a spread to 4 decimals
                assert a == pytest.approx(b, abs=5e-5 if field.name == "spread" else 1e-6), (want.name, field.name, a, b)
            elif isinstance(b, LayerTimes):
                assert dataclasses.astuple(a) == pytest.approx(dataclasses.astuple(b), abs=1e-6), (want.name, field.name)
            else:
                assert a == b, (want.name, field.name, a, b)


def uniform_profile(num_layers: int, t: float = 1.0, **kwargs) -> Profile:
    return make_profile([(t, t, t)] * num_layers, **kwargs)


def free_cluster(gpus: int, **kwargs) -> Cluster:
    """No communication cost at all: closed forms hold exactly."""
    return Cluster(gpus=gpus, latency_us=0.0, intra_node_gbps=1e12, inter_node_gbps=1e12, **kwargs)


def hand_plan(stages, schedule, *, cluster, microbatches, dp=1) -> Plan:
    """A plan written out by hand: ``stages`` as (first layer, end layer, rank), ``schedule`` one
    op string per rank ("0F0 0F1 0B0 0B1": stage, kind, microbatch), pp as many as the strings."""
    return Plan(
        model=ModelRef("t"),
        cluster=cluster,
        parallel=Parallel(pp=len(schedule), dp=dp, microbatches=microbatches),
        stages=tuple(Stage(s, e, r) for s, e, r in stages),
        schedule=tuple(tuple(parse_ops(text)) for text in schedule),
    )


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared machine, threads on tiny ops only wait on each
    other's turn (``pytestmark = pytest.mark.usefixtures("one_thread")`` in a test module)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def profile_file(tmp_path):
    def write(profile: Profile, name: str = "p.yaml") -> Path:
        path = tmp_path / name
        save_profile(profile, path)
        return path

    return write
