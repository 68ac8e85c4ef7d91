"""Scenarios: a node, a run length, a seed and pods with tokens and demand over time.

Shipped scenarios live as YAML files next to this module; users write their own in the same
format (README, "Simulator"). Every random draw comes from the scenario's seed, one stream
per pod, so the same seed gives the same demand bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kuscale.config import AgentConfig, ConfigError, config_from_mapping
from kuscale.model import InvalidSpec, validate_pod_name, validate_tokens
from kuscale.policy.base import FloatArray
from kuscale.sim.located import ScenarioError, Section, parse_yaml, read_yaml
from kuscale.sim.shapes import Shape, read_shape

SHIPPED = "scenarios"


@dataclass(frozen=True, slots=True)
class ScenarioPod:
    name: str
    tokens: int
    start: float
    end: float
    cpu: Shape
    gpu: Shape | None


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    cores: int
    gpus: int
    period: float
    duration: float
    seed: int
    pods: tuple[ScenarioPod, ...]
    config: AgentConfig

    @property
    def ticks(self) -> int:
        return round(self.duration / self.period)

    def times(self) -> FloatArray:
        return np.arange(self.ticks, dtype=np.float64) * self.period

    def demand(self, seed: int | None = None) -> FloatArray:
        """Demand of every pod at every period: shape (ticks, pods, 2), zero outside a pod's
        lifetime. Pod i draws from the i-th child of the seed, whatever the others do."""
        times = self.times()
        streams = np.random.SeedSequence(self.seed if seed is None else seed).spawn(len(self.pods))
        ceiling = (self.cores * 100.0, self.gpus * 100.0)
        matrix = np.zeros((times.size, len(self.pods), 2))
        for column, (pod, stream) in enumerate(zip(self.pods, streams, strict=True)):
            rng = np.random.default_rng(stream)
            alive = (times >= pod.start) & (times < pod.end)
            matrix[:, column, 0] = np.where(alive, pod.cpu.sample(times, rng, ceiling[0]), 0.0)
            if pod.gpu is not None:
                matrix[:, column, 1] = np.where(alive, pod.gpu.sample(times, rng, ceiling[1]), 0.0)
        return matrix


def shipped_names() -> list[str]:
    folder = resources.files(__package__).joinpath(SHIPPED)
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def shipped_path(name: str) -> Path:
    path = Path(str(resources.files(__package__).joinpath(SHIPPED, f"{name}.yaml")))
    if name not in shipped_names():
        raise ScenarioError(f"no shipped scenario named {name!r}; `kuscale sim --list` shows them")
    return path


def load_scenario(path: Path) -> Scenario:
    data, source = read_yaml(path)
    return _scenario(Section(data, "", source), path.parent, path.stem)


def parse_scenario(text: str, name: str, directory: Path) -> Scenario:
    data, source = parse_yaml(text, name)
    return _scenario(Section(data, "", source), directory, name)


def _scenario(top: Section, directory: Path, default_name: str) -> Scenario:
    name = top.text("name", default_name)
    description = top.text("description", "")
    node = top.section("node")
    cores = node.integer("cores", minimum=1)
    gpus = node.integer("gpus", 0)
    node.done()
    period = top.number("period", 1.0, positive=True)
    duration = top.number("duration", positive=True)
    if duration < period:
        top.fail("duration", f"must be at least one period ({period:g} s)")
    seed = top.integer("seed", 0)
    config = _config(top, period)
    capacity = (cores * 100.0, gpus * 100.0)
    pods: list[ScenarioPod] = []
    for spec in top.sections("pods"):
        pods.extend(_pods(spec, directory, duration, capacity))
    names = [pod.name for pod in pods]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        top.fail("pods", f"two pods are named {duplicate!r}")
    top.done()
    return Scenario(name, description, cores, gpus, period, duration, seed, tuple(pods), config)


def _config(top: Section, period: float) -> AgentConfig:
    settings: Any = top.raw("config", {})
    if not isinstance(settings, dict):
        top.fail("config", "must be a mapping with the agent config file's tables")
    try:
        return config_from_mapping(settings, "config", {"period": period})
    except ConfigError as err:
        top.fail("config", str(err))


def _pods(
    spec: Section, directory: Path, duration: float, capacity: tuple[float, float]
) -> list[ScenarioPod]:
    """One entry of `pods:`, expanded to `replicas` pods named NAME-0, NAME-1, ..."""
    name = spec.text("name")
    try:
        tokens = validate_tokens(spec.raw("tokens"))
    except InvalidSpec as err:
        spec.fail("tokens", str(err))
    replicas = spec.integer("replicas", 1, minimum=1)
    start = spec.number("start", 0.0)
    end = spec.number("end", duration)
    if end <= start:
        spec.fail("end", f"must be after start ({start:g}), got {end:g}")
    cpu = _demand(spec, "cpu", directory, capacity[0])
    gpu = _demand(spec, "gpu", directory, capacity[1]) if spec.has("gpu") else None
    spec.done()
    names = [name] if replicas == 1 else [f"{name}-{i}" for i in range(replicas)]
    for pod_name in names:
        try:
            validate_pod_name(pod_name)
        except InvalidSpec as err:
            spec.fail("name", str(err))
    return [ScenarioPod(n, tokens, start, end, cpu, gpu) for n in names]


def _demand(spec: Section, key: str, directory: Path, capacity: float) -> Shape:
    shape = read_shape(spec.section(key), directory)
    if shape.peak > capacity:
        spec.fail(
            key,
            f"peak demand {shape.peak:g} % is more than the node has ({capacity:g} %)",
        )
    return shape
