"""Regenerate docs/img/timeline-4.svg and timeline-32.svg: .venv/bin/python docs/img/make_timelines.py"""
from octoplan.baseline import make_baseline
from octoplan.profile import Layer, ModelRef, Profile
from octoplan.simulator import simulate
from octoplan.timeline import write_svg

MB = 1 << 20


def gpt_like(num_blocks: int) -> Profile:
    # Heavy embedding and head (a large vocabulary): the uniform partition leaves ranks 0 and
    # pp-1 with the extra work, which the timeline shows as everyone else waiting.
    layers = [Layer("embed", "embedding", 1.5, 0.0, 2.5, 400 * MB, 8 * MB, 8 * MB)]
    layers += [Layer(f"block{i}", "block", 1.0, 1.0, 0.8, 200 * MB, 24 * MB, 8 * MB) for i in range(num_blocks)]
    layers += [Layer("head", "head", 3.0, 2.5, 2.5, 400 * MB, 32 * MB, 4 * MB)]
    return Profile(model=ModelRef("gpt-like"), layers=tuple(layers), dtype="bf16")


for pp, blocks, schedule, mbs, path in (
    (4, 16, "zb-h1", 8, "docs/img/timeline-4.svg"),
    (32, 64, "1f1b", 64, "docs/img/timeline-32.svg"),
):
    profile = gpt_like(blocks)
    plan = make_baseline(profile, schedule=schedule, gpus=pp, microbatches=mbs)
    result = simulate(plan, profile)
    write_svg(plan, result, path, title="Heavy embedding and head")
    print(path, result.summary()["iteration_ms"], result.summary()["bubble_ratio"])
