"""Demand over time, in percent of one core (or one GPU), sampled at every period's start.

Each shape is read from a scenario's YAML mapping and checked there, so a sampled value is
never negative and never above what the shape declared as its peak.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kuscale.policy.base import FloatArray
from kuscale.sim.located import ScenarioError, Section

Rng = np.random.Generator


@dataclass(frozen=True, slots=True)
class Shape:
    """A demand curve: `values(times, rng)` plus optional Gaussian noise of `noise` percent."""

    kind: str
    peak: float
    curve: Callable[[FloatArray, Rng], FloatArray]
    noise: float = 0.0

    def sample(self, times: FloatArray, rng: Rng, ceiling: float) -> FloatArray:
        values = self.curve(times, rng)
        if self.noise > 0:
            values = values + rng.normal(0.0, self.noise, size=values.shape)
        return np.clip(values, 0.0, ceiling)


def _constant(spec: Section) -> Shape:
    value = spec.number("value")
    return Shape("constant", value, lambda t, _: np.full(t.shape, value))


def _step(spec: Section) -> Shape:
    steps = spec.raw("steps")
    if not isinstance(steps, list) or not steps:
        spec.fail("steps", "must be a non-empty list of [seconds, percent] pairs")
    pairs = []
    for i, step in enumerate(steps):
        if not isinstance(step, list) or len(step) != 2:
            spec.fail(f"steps[{i}]", f"must be a [seconds, percent] pair, got {step!r}")
        pairs.append(
            (spec.check_number(f"steps[{i}]", step[0]), spec.check_number(f"steps[{i}]", step[1]))
        )
    pairs.sort()
    starts = np.array([s for s, _ in pairs])
    levels = np.array([0.0] + [v for _, v in pairs])
    return Shape(
        "step",
        float(levels.max()),
        lambda t, _: levels[np.searchsorted(starts, t, side="right")],
    )


def _square(spec: Section) -> Shape:
    low, high = spec.number("low"), spec.number("high")
    period = spec.number("period", positive=True)
    duty = spec.number("duty", 0.5, maximum=1.0)
    phase = spec.number("phase", 0.0)
    return Shape(
        "square",
        max(low, high),
        lambda t, _: np.where(np.mod(t + phase, period) < duty * period, high, low),
    )


def _ramp(spec: Section) -> Shape:
    start_value, end_value = spec.number("from"), spec.number("to")
    start = spec.number("start", 0.0)
    end = spec.number("end", positive=True)
    if end <= start:
        spec.fail("end", f"must be after start ({start:g}), got {end:g}")

    def curve(t: FloatArray, _: Rng) -> FloatArray:
        progress = np.clip((t - start) / (end - start), 0.0, 1.0)
        return start_value + (end_value - start_value) * progress

    return Shape("ramp", max(start_value, end_value), curve)


def _sine(spec: Section) -> Shape:
    mean, amplitude = spec.number("mean"), spec.number("amplitude")
    period = spec.number("period", positive=True)
    phase = spec.number("phase", 0.0)
    if amplitude > mean:
        spec.fail("amplitude", f"{amplitude:g} above the mean {mean:g} makes demand negative")
    return Shape(
        "sine",
        mean + amplitude,
        lambda t, _: mean + amplitude * np.sin(2 * math.pi * (t + phase) / period),
    )


def _seconds_range(spec: Section, key: str) -> tuple[float, float]:
    value = spec.raw(key)
    if not isinstance(value, list) or len(value) != 2:
        spec.fail(key, f"must be a [shortest, longest] pair of seconds, got {value!r}")
    low = spec.check_number(key, value[0], positive=True)
    high = spec.check_number(key, value[1], positive=True)
    if high < low:
        spec.fail(key, f"longest ({high:g}) is below shortest ({low:g})")
    return low, high


def _bursts(spec: Section) -> Shape:
    """Alternating quiet and busy spells, each of a uniformly random length."""
    base, peak = spec.number("base"), spec.number("peak")
    on, off = _seconds_range(spec, "on"), _seconds_range(spec, "off")

    def curve(t: FloatArray, rng: Rng) -> FloatArray:
        values = np.full(t.shape, base)
        horizon = float(t[-1]) if t.size else 0.0
        clock = rng.uniform(*off)
        while clock <= horizon:
            length = rng.uniform(*on)
            values[(t >= clock) & (t < clock + length)] = peak
            clock += length + rng.uniform(*off)
        return values

    return Shape("bursts", max(base, peak), curve)


def _trace(spec: Section, directory: Path) -> Shape:
    name = spec.text("file")
    path = (directory / name).resolve()
    times, values = read_trace(path)
    scale = spec.number("time_scale", 1.0, positive=True)
    times = times * scale
    return Shape("trace", float(values.max()), lambda t, _: values[_held(times, t)])


def _held(times: FloatArray, t: FloatArray) -> np.ndarray:
    return np.clip(np.searchsorted(times, t, side="right") - 1, 0, times.size - 1)


def read_trace(path: Path) -> tuple[FloatArray, FloatArray]:
    """A CSV of `time,demand` rows (seconds, percent), an optional header, times ascending."""
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))
    except OSError as err:
        raise ScenarioError(f"cannot read trace {path}: {err.strerror}") from err
    except (UnicodeDecodeError, csv.Error) as err:
        raise ScenarioError(f"{path}: not a CSV file: {err}") from err
    points: list[tuple[float, float]] = []
    for number, row in enumerate(rows, start=1):
        if not row or (number == 1 and row[0].strip().lower() == "time"):
            continue
        point = _trace_point(row)
        if point is None:
            raise ScenarioError(
                f"{path}:{number}: expected 'seconds,percent' (finite, at least 0), got {row!r}"
            )
        if points and point[0] <= points[-1][0]:
            raise ScenarioError(f"{path}:{number}: time {point[0]:g} does not increase")
        points.append(point)
    if not points:
        raise ScenarioError(f"{path}: the trace has no rows")
    return np.array([p[0] for p in points]), np.array([p[1] for p in points])


def _trace_point(row: list[str]) -> tuple[float, float] | None:
    if len(row) != 2:
        return None
    try:
        time, value = float(row[0]), float(row[1])
    except ValueError:
        return None
    if not (math.isfinite(time) and math.isfinite(value)) or time < 0 or value < 0:
        return None
    return time, value


SHAPES: dict[str, Callable[[Section], Shape]] = {
    "constant": _constant,
    "step": _step,
    "square": _square,
    "ramp": _ramp,
    "sine": _sine,
    "bursts": _bursts,
}


def read_shape(spec: Section, directory: Path) -> Shape:
    """One demand mapping: `shape:` names the curve; `noise:` adds Gaussian noise."""
    kind = spec.text("shape")
    if kind == "trace":
        shape = _trace(spec, directory)
    elif kind in SHAPES:
        shape = SHAPES[kind](spec)
    else:
        spec.fail("shape", f"unknown shape {kind!r} (one of {', '.join([*SHAPES, 'trace'])})")
    noise = spec.number("noise", 0.0)
    spec.done()
    return Shape(shape.kind, shape.peak, shape.curve, noise)
