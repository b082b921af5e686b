"""Profiles (docs/FORMATS.md section 2): per-layer costs of one model on one device.

A profile is immutable data. Times are milliseconds per microbatch; sizes are bytes per
microbatch. ``load_profile`` validates everything a later stage relies on, so the simulator and
tuner never check again.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from octoplan.errors import InputError
from octoplan.yamlio import Fields, read_yaml, write_yaml

# GB per GPU a profile's device or a cluster may have: up to a petabyte (octoplan.plan's
# CLUSTER_RANGES holds the same range for plan files and the command line)
MEMORY_GB_RANGE = (0.0, 1e6)
# Samples per microbatch: far beyond any run, small enough that a batch of them can be built
MAX_MICROBATCH_SIZE = 1 << 20

__all__ = [
    "PROFILE_FORMAT",
    "Layer",
    "ModelRef",
    "Profile",
    "load_profile",
    "save_profile",
    "profile_to_dict",
    "profile_from_dict",
    "DTYPE_BYTES",
    "MAX_LAYER_MS",
    "MAX_LAYER_BYTES",
    "check_layer_limits",
    "TiedParameter",
    "LayerTimes",
    "WholeModelCheck",
]

PROFILE_FORMAT = "octoplan-profile/1"

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float64": 8,
    "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


@dataclass(frozen=True)
class LayerTimes:
    """A layer's F, I, W and fused B in milliseconds, as one way of timing measured them (a
    profile layer's ``isolated``: the layer timed alone)."""

    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    backward_ms: float

    @property
    def f_plus_b_ms(self) -> float:
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class WholeModelCheck:
    """The profile's layers against the whole model, timed in the same run (FORMATS.md section 2,
    ``whole_model``): ``ms``, the median whole-model forward + loss + backward of one microbatch;
    ``layers_sum_ms``, the layers' F + B summed; ``in_sequence_ms``, the median pass of every
    layer's F then every layer's B that the layers' times come from, start to end (it differs
    from ``ms`` by what the runtime does per layer, from ``layers_sum_ms`` by taking the median
    of sums rather than the sum of medians); ``isolated_sum_ms``, the layers' F + B timed alone.
    The last two where measured."""

    ms: float
    layers_sum_ms: float
    in_sequence_ms: float | None = None
    isolated_sum_ms: float | None = None

    @property
    def ratio(self) -> float:
        return self.layers_sum_ms / self.ms if self.ms > 0 else math.nan

    @property
    def isolated_ratio(self) -> float | None:
        if self.isolated_sum_ms is None or self.ms <= 0:
            return None
        return self.isolated_sum_ms / self.ms

    @property
    def in_sequence_ratio(self) -> float | None:
        if self.in_sequence_ms is None or self.ms <= 0:
            return None
        return self.in_sequence_ms / self.ms


@dataclass(frozen=True)
class Layer:
    name: str
    kind: str
    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    param_bytes: int
    activation_bytes: int
    output_bytes: int
    flops: float | None = None
    # The layer's buffers (a BatchNorm's statistics, a causal mask, a rotary cache): held once,
    # with no gradient or optimizer state
    buffer_bytes: int = 0
    # The fused backward (I and W in one autograd pass), when measured. A split backward pays
    # its per-call overhead twice, and per kernel where a layer is launch-bound: in octorun on an
    # H200, the hybrid example's fused backward took 58% of its I + W. None: B = I + W.
    backward_ms: float | None = None
    # What an I op of the layer keeps for its W besides the activations: the gradients arriving
    # where its weight branches leave the input path (a linear layer's output gradient), held
    # from the end of I to the end of W. Plans that never split a backward do not pay it.
    pending_w_bytes: int = 0
    # Of activation_bytes, what a split backward still holds from its I to its W: the saved
    # tensors W reads (a matmul's input, a norm's) and the layer's input where W's graph holds it;
    # octorun releases the rest at I. None (profiles written before it was measured): all of it.
    w_saved_bytes: int | None = None
    # How the tensor between this layer and the next is held (octorun's tape; FORMATS.md):
    # of the layer's floating inputs, the bytes its I lets go (a layer with no weight on its
    # input path); of its own floating outputs, the bytes it holds itself from F (autograd saved
    # them, or it passes its input through), and of those the bytes it holds until W.
    input_freed_bytes: int = 0
    output_saved_bytes: int = 0
    output_w_bytes: int = 0
    # How much the layer's time moved between the profiler's repeats: (p90 - p10) / median of
    # its per-repeat F + B. None: not measured (analytic profiles, older ones).
    spread: float | None = None
    # The layer timed alone, the profiler's cross-check of its in-sequence times. A record of
    # the measurement: map_times leaves it as measured. None: not measured.
    isolated: LayerTimes | None = None

    @property
    def held_for_w_bytes(self) -> int:
        """What stays from the layer's I to its W, besides ``pending_w_bytes``."""
        return self.activation_bytes if self.w_saved_bytes is None else self.w_saved_bytes

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_input_ms + self.backward_weight_ms

    @property
    def b_ms(self) -> float:
        """What a B op of this layer costs (docs/FORMATS.md section 2)."""
        return self.backward_input_ms + self.backward_weight_ms if self.backward_ms is None else self.backward_ms

    def map_times(self, fn: Callable[[str, float], float]) -> "Layer":
        """This layer with each time replaced by ``fn(kind, ms)``, kind "F", "I", "W", or "B" for
        the fused backward where one was measured: one place, so no rescaling forgets a time."""
        return replace(self, forward_ms=fn("F", self.forward_ms), backward_input_ms=fn("I", self.backward_input_ms),
                       backward_weight_ms=fn("W", self.backward_weight_ms),
                       backward_ms=None if self.backward_ms is None else fn("B", self.backward_ms))


@dataclass(frozen=True)
class ModelRef:
    """Which model file a profile or plan belongs to (FORMATS.md sections 2 and 4)."""

    name: str
    source: str | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.source is not None:
            out["source"] = self.source
        out["config"] = dict(self.config)
        return out

    @classmethod
    def read(cls, top: Fields) -> "ModelRef":
        """The ``model`` section of a profile or a plan file (the same fields in both)."""
        model = top.mapping("model")
        model.no_misspelling(("name", "source", "config"))
        config = model.raw("config", {})
        if not isinstance(config, dict):
            raise InputError(top.file, "model.config", "must be a mapping", "write key: value pairs")
        return cls(name=model.str("name"), source=model.str("source", None), config=dict(config))


@dataclass(frozen=True)
class TiedParameter:
    """One tensor that several layers use (the model file's ``tied_parameters``): its members
    as (layer index, parameter name), the canonical (lowest) one first, and one member's bytes.
    Each pipeline rank holding a member keeps one copy; the copies' gradients are summed after
    the step's backward (octorun.tied)."""

    members: tuple[tuple[int, str], ...]
    bytes: int

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.members)


@dataclass(frozen=True)
class Profile:
    model: ModelRef
    layers: tuple[Layer, ...]
    device: dict[str, Any] = field(default_factory=lambda: {"name": "cpu", "memory_gb": 24})
    microbatch_size: int = 1
    dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)  # optional extensions (FORMATS.md section 2), kept verbatim
    # The training precision the layers were measured at (octoplan.precision): "fp32", or
    # "bf16", autocast over fp32 master weights. Written only when not fp32.
    precision: str = "fp32"
    tied: tuple[TiedParameter, ...] = ()
    whole_model: WholeModelCheck | None = None  # measured profiles: the layers' sum against the whole model

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def param_dtype_bytes(self) -> int:
        """The bytes of one parameter in ``param_bytes``: the profile's dtype, except under bf16
        autocast, whose layers compute in bfloat16 but keep fp32 parameters (master weights)."""
        return 4 if self.precision == "bf16" else self.dtype_bytes

    @property
    def measures_fused_backward(self) -> bool:
        """Whether any layer carries ``backward_ms``; without, every B is exactly I + W."""
        return any(layer.backward_ms is not None for layer in self.layers)

    @property
    def fused_backward_ratio(self) -> float | None:
        """The whole model's fused backward over its split one, B / (I + W); None where no
        layer measured B or the split backward takes no time."""
        split = sum(layer.backward_input_ms + layer.backward_weight_ms for layer in self.layers)
        if not self.measures_fused_backward or split <= 0:
            return None
        return sum(layer.b_ms for layer in self.layers) / split

    def with_layers(self, layers: list[Layer] | tuple[Layer, ...]) -> "Profile":
        return replace(self, layers=tuple(layers))

    def shaken(self, rel: float, seed: int) -> "Profile":
        """This profile with every time scaled by 1 + ``rel`` x N(0, 1), drawn in layer order by
        ``random.Random(seed)`` (never below 0): the same model measured again, for searches
        whose path turns on near-ties."""
        rng = random.Random(seed)
        return self.with_layers([layer.map_times(lambda _, ms: max(0.0, ms * (1 + rel * rng.gauss(0, 1))))
                                 for layer in self.layers])


# Ceilings far above any real layer (a day per microbatch, a petabyte), below where sums over
# thousands of ops and microbatches, or CP-SAT's 64-bit integer ticks, would overflow.
MAX_LAYER_MS = 86_400_000.0
MAX_LAYER_BYTES = 10**15


# The fields of a profile layer (FORMATS.md section 2). Others are extensions FORMATS.md allows
# another tool to write, and are passed over; a near miss of one of these is refused instead.
_LAYER_FIELDS = ("name", "kind", "forward_ms", "backward_input_ms", "backward_weight_ms", "param_bytes",
                 "activation_bytes", "output_bytes", "flops", "buffer_bytes", "backward_ms", "pending_w_bytes", "w_saved_bytes",
                 "input_freed_bytes", "output_saved_bytes", "output_w_bytes", "spread", "isolated")
# The top-level ones: others are kept verbatim (Profile.extra), near misses refused
_TOP_FIELDS = ("format", "model", "device", "microbatch_size", "dtype", "precision", "tied", "whole_model", "layers")
# A layer's ``isolated`` times and the ``whole_model`` check: every key is the profiler's, so
# any other is refused, not passed over
_TIMES_FIELDS = ("forward_ms", "backward_input_ms", "backward_weight_ms", "backward_ms")
_WHOLE_MODEL_FIELDS = ("ms", "layers_sum_ms", "in_sequence_ms", "isolated_sum_ms", "ratio")
# How far a written ``ratio`` may be from layers_sum_ms / ms: both are rounded when written
_RATIO_TOLERANCE = 1e-3


def _layer_from(entry: Any, *, file: str, index: int) -> Layer:
    f = Fields(entry, file=file, prefix=f"layers[{index}]")
    f.no_misspelling(_LAYER_FIELDS)
    flops = f.number("flops", None)
    layer = Layer(
        name=f.str("name"),
        kind=f.str("kind", "layer"),
        forward_ms=f.number("forward_ms", maximum=MAX_LAYER_MS),
        backward_input_ms=f.number("backward_input_ms", maximum=MAX_LAYER_MS),
        backward_weight_ms=f.number("backward_weight_ms", maximum=MAX_LAYER_MS),
        param_bytes=f.int("param_bytes", maximum=MAX_LAYER_BYTES),
        activation_bytes=f.int("activation_bytes", maximum=MAX_LAYER_BYTES),
        output_bytes=f.int("output_bytes", maximum=MAX_LAYER_BYTES),
        flops=flops,
        buffer_bytes=f.int("buffer_bytes", 0, maximum=MAX_LAYER_BYTES),
        backward_ms=f.number("backward_ms", None, maximum=MAX_LAYER_MS),
        pending_w_bytes=f.int("pending_w_bytes", 0, maximum=MAX_LAYER_BYTES),
        w_saved_bytes=f.int("w_saved_bytes", None, maximum=MAX_LAYER_BYTES),
        input_freed_bytes=f.int("input_freed_bytes", 0, maximum=MAX_LAYER_BYTES),
        output_saved_bytes=f.int("output_saved_bytes", 0, maximum=MAX_LAYER_BYTES),
        output_w_bytes=f.int("output_w_bytes", 0, maximum=MAX_LAYER_BYTES),
        spread=f.number("spread", None),
        isolated=_times_from(f, "isolated") if f.has("isolated") else None,
    )
    _check_parts(layer, file=file, index=index)
    return layer


def _times_from(parent: Fields, key: str) -> LayerTimes:
    f = parent.mapping(key)
    f.only(_TIMES_FIELDS)
    return LayerTimes(*(f.number(name, maximum=MAX_LAYER_MS) for name in _TIMES_FIELDS))


def _whole_model_from(top: Fields) -> WholeModelCheck | None:
    """The optional ``whole_model`` mapping: a positive whole-model time, the layers' sums, and
    a ``ratio`` that, where written, is theirs."""
    if not top.has("whole_model"):
        return None
    f = top.mapping("whole_model")
    f.only(_WHOLE_MODEL_FIELDS)
    ms = f.number("ms", maximum=MAX_LAYER_MS)
    if ms <= 0:
        raise InputError(top.file, "whole_model.ms", "must be > 0, got 0", "re-profile: a whole model takes time")
    check = WholeModelCheck(ms=ms, layers_sum_ms=f.number("layers_sum_ms", maximum=MAX_LAYER_MS),
                            in_sequence_ms=f.number("in_sequence_ms", None, maximum=MAX_LAYER_MS),
                            isolated_sum_ms=f.number("isolated_sum_ms", None, maximum=MAX_LAYER_MS))
    ratio = f.number("ratio", None)
    if ratio is not None and abs(ratio - check.ratio) > _RATIO_TOLERANCE * max(1.0, check.ratio):
        raise InputError(top.file, "whole_model.ratio", f"is {ratio:g}, but layers_sum_ms / ms is {check.ratio:.4f}",
                         "re-profile, or drop ratio")
    return check


def _check_parts(layer: Layer, *, file: str, index: int) -> None:
    """The memory fields that are parts of another must fit in it (the profiler measures them
    so): what an I keeps for W and what it lets go of are disjoint parts of the activations,
    and what the layer holds of its output until W is part of what it holds of it at all."""
    kept = layer.held_for_w_bytes
    if kept + layer.input_freed_bytes > layer.activation_bytes:
        name = "w_saved_bytes" if layer.input_freed_bytes == 0 else "input_freed_bytes"
        raise InputError(file, f"layers[{index}].{name}", f"makes w_saved_bytes + input_freed_bytes = {kept + layer.input_freed_bytes}, more than "
                             f"activation_bytes {layer.activation_bytes}", "both are parts of activation_bytes: re-profile")
    if layer.output_w_bytes > layer.output_saved_bytes:
        raise InputError(file, f"layers[{index}].output_w_bytes", f"is {layer.output_w_bytes}, more than output_saved_bytes {layer.output_saved_bytes}",
                       "it is a part of output_saved_bytes: re-profile")


def check_layer_limits(layers: tuple[Layer, ...] | list[Layer], *, file: str | None, cause: str, fix: str) -> None:
    """Raise :class:`InputError` when a layer made here (not read from a file, which
    :func:`load_profile` checks field by field) exceeds the profile limits: ``cause`` names
    what made it so large, ``fix`` says what to change."""
    for i, layer in enumerate(layers):
        for name, limit in (("forward_ms", MAX_LAYER_MS), ("backward_input_ms", MAX_LAYER_MS),
                            ("backward_weight_ms", MAX_LAYER_MS), ("param_bytes", MAX_LAYER_BYTES),
                            ("activation_bytes", MAX_LAYER_BYTES), ("output_bytes", MAX_LAYER_BYTES),
                            ("pending_w_bytes", MAX_LAYER_BYTES), ("held_for_w_bytes", MAX_LAYER_BYTES)):
            value = getattr(layer, name)
            if not value <= limit:  # also catches NaN
                raise InputError(file, cause, f"set layer {i} ({layer.name}) {name} to {value:.3g}, above the limit {limit:.3g}", fix)


def profile_from_dict(data: dict[str, Any], *, file: str = "<profile>") -> Profile:
    top = Fields.document(data, file=file, format=PROFILE_FORMAT, fields=_TOP_FIELDS, fix="regenerate it with octoplan profile")
    model = ModelRef.read(top)
    device = top.mapping("device", {})
    if device.has("memory_gb"):  # the default of --memory-gb: the same range
        device.number("memory_gb", minimum=MEMORY_GB_RANGE[0], maximum=MEMORY_GB_RANGE[1])
    raw_layers = top.list("layers")
    if not raw_layers:
        raise InputError(file, "layers", "is empty", "a profile needs at least one layer")
    layers = tuple(_layer_from(entry, file=file, index=i) for i, entry in enumerate(raw_layers))
    for i, layer in enumerate(layers):
        if layer.kind == "embedding" and i != 0:
            raise InputError(file, f"layers[{i}].kind", "'embedding' is reserved for the first layer", "rename the kind")
        if layer.kind == "head" and i != len(layers) - 1:
            raise InputError(file, f"layers[{i}].kind", "'head' is reserved for the last layer", "rename the kind")
    dtype = top.str("dtype", "float32")
    if dtype not in DTYPE_BYTES:
        raise InputError(file, "dtype", f"is {dtype!r}", f"use one of {', '.join(DTYPE_BYTES)}")
    precision = top.str("precision", "fp32")
    if precision not in _PRECISIONS:
        raise InputError(file, "precision", f"is {precision!r}", f"use one of {', '.join(_PRECISIONS)}")
    return Profile(
        model=model,
        layers=layers,
        device=dict(device.data),
        microbatch_size=top.int("microbatch_size", 1, minimum=1, maximum=MAX_MICROBATCH_SIZE),
        dtype=dtype,
        extra={k: v for k, v in data.items() if k not in _TOP_FIELDS},
        precision=precision,
        tied=_tied_from(top, layers),
        whole_model=_whole_model_from(top),
    )


# octoplan.precision.PRECISIONS (not imported: that module needs torch, profiles must not)
_PRECISIONS = ("fp32", "bf16")


def _tied_from(top: Fields, layers: tuple[Layer, ...]) -> tuple[TiedParameter, ...]:
    """The optional ``tied`` list: groups of two or more distinct members (layer index of this
    profile, parameter name), whose ``bytes`` fit in each member layer's ``param_bytes``."""
    if not top.has("tied"):
        return ()
    file, groups = top.file, []
    for g, entry in enumerate(top.list("tied")):
        f = Fields(entry, file=file, prefix=f"tied[{g}]")
        f.only(("members", "bytes"))
        raw = f.list("members")
        members = []
        for m, member in enumerate(raw):
            if not (isinstance(member, list) and len(member) == 2 and isinstance(member[0], int)
                    and not isinstance(member[0], bool) and isinstance(member[1], str) and member[1]):
                raise InputError(file, f"tied[{g}].members[{m}]", f"is {member!r}", "write [LAYER INDEX, PARAMETER NAME]")
            if not 0 <= member[0] < len(layers):
                raise InputError(file, f"tied[{g}].members[{m}]", f"names layer {member[0]} of a {len(layers)}-layer profile",
                                 "give layer indices of this profile")
            members.append((member[0], member[1]))
        if len(members) < 2 or len(set(members)) != len(members):
            raise InputError(file, f"tied[{g}].members", f"{raw!r} are not two or more distinct members",
                             "list each tied parameter once, at least two per group")
        size = f.int("bytes", maximum=MAX_LAYER_BYTES)
        for layer_index, name in members:
            if size > layers[layer_index].param_bytes:
                raise InputError(file, f"tied[{g}].bytes", f"is {size}, more than layer {layer_index}'s param_bytes "
                                 f"{layers[layer_index].param_bytes}", "re-profile: the tied tensor is one of the layer's parameters")
        groups.append(TiedParameter(tuple(sorted(members)), size))
    return tuple(groups)


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile; bad input raises :class:`InputError` naming the field."""
    return profile_from_dict(read_yaml(path, what="profile"), file=str(path))


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    layers = []
    for layer in profile.layers:
        entry: dict[str, Any] = {
            "name": layer.name,
            "kind": layer.kind,
            "forward_ms": round(layer.forward_ms, 6),
            "backward_input_ms": round(layer.backward_input_ms, 6),
            "backward_weight_ms": round(layer.backward_weight_ms, 6),
            "param_bytes": int(layer.param_bytes),
            "activation_bytes": int(layer.activation_bytes),
            "output_bytes": int(layer.output_bytes),
        }
        if layer.flops is not None:
            entry["flops"] = float(f"{layer.flops:.6g}")
        if layer.buffer_bytes:
            entry["buffer_bytes"] = int(layer.buffer_bytes)
        if layer.backward_ms is not None:
            entry["backward_ms"] = round(layer.backward_ms, 6)
        if layer.pending_w_bytes:
            entry["pending_w_bytes"] = int(layer.pending_w_bytes)
        if layer.w_saved_bytes is not None:
            entry["w_saved_bytes"] = int(layer.w_saved_bytes)
        for name in ("input_freed_bytes", "output_saved_bytes", "output_w_bytes"):
            if getattr(layer, name):
                entry[name] = int(getattr(layer, name))
        if layer.spread is not None:
            entry["spread"] = round(layer.spread, 4)
        if layer.isolated is not None:
            entry["isolated"] = {name: round(getattr(layer.isolated, name), 6) for name in _TIMES_FIELDS}
        layers.append(entry)
    out: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "model": profile.model.to_dict(),
        "device": dict(profile.device),
        "microbatch_size": profile.microbatch_size,
        "dtype": profile.dtype,
    }
    if profile.precision != "fp32":
        out["precision"] = profile.precision
    if profile.tied:
        out["tied"] = [{"members": [[layer, name] for layer, name in group.members], "bytes": int(group.bytes)}
                       for group in profile.tied]
    if profile.whole_model is not None:
        check = profile.whole_model
        ms, layers_sum = round(check.ms, 6), round(check.layers_sum_ms, 6)
        out["whole_model"] = {"ms": ms, "layers_sum_ms": layers_sum}
        for name in ("in_sequence_ms", "isolated_sum_ms"):
            if getattr(check, name) is not None:
                out["whole_model"][name] = round(getattr(check, name), 6)
        # of the rounded figures, so that a profile read back writes the same ratio
        out["whole_model"]["ratio"] = round(layers_sum / ms, 4)
    out.update(profile.extra)
    out["layers"] = layers
    return out


def save_profile(profile: Profile, path: str | Path) -> None:
    write_yaml(path, profile_to_dict(profile))
