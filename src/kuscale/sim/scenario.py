"""Scenarios: a node, a run length, a seed and pods with tokens and demand over time.

Shipped scenarios live as YAML files next to this module; users write their own in the same
format (docs/simulator.md, "Scenarios"). Every random draw comes from the scenario's seed, one
stream per pod, so the same seed gives the same demand bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    device: int = 0
    """The GPU the pod's client runs on (pods without a GPU: 0, unused)."""
    coupled: bool = False
    """A pipeline: it progresses at the served fraction of its scarcest resource."""


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

    @property
    def gemini(self) -> bool:
        """True where the GPU is shared as Gemini's gem-schd shares it (REQUEST first, then
        work-conserving up to LIMIT); else by limits alone, as the original's module."""
        return self.config.gpu_layer.kind == "gemini"

    def on_gpu_layer(self, kind: str) -> Scenario:
        """The same scenario on another GPU layer: "gemini", or "vgpu" (limits alone)."""
        layer = replace(self.config.gpu_layer, kind=kind).validate()
        return replace(self, config=replace(self.config, gpu_layer=layer))

    def uncoupled(self) -> Scenario:
        """The same scenario with every pod independent: the runs from before pipelines."""
        return replace(self, pods=tuple(replace(p, coupled=False) for p in self.pods))

    def times(self) -> FloatArray:
        return np.arange(self.ticks, dtype=np.float64) * self.period

    def demand(self, seed: int | None = None) -> FloatArray:
        """Demand of every pod at every period: shape (ticks, pods, 2), zero outside a pod's
        lifetime. Pod i draws from the i-th child of the seed, whatever the others do."""
        times = self.times()
        streams = np.random.SeedSequence(self.seed if seed is None else seed).spawn(len(self.pods))
        ceiling = (self.cores * 100.0, 100.0)
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
    capacity = (cores * 100.0, 100.0 if gpus else 0.0)
    pods: list[ScenarioPod] = []
    for spec in top.sections("pods"):
        pods.extend(_pods(spec, directory, duration, capacity, gpus))
    pods = spread_over_gpus(pods, gpus)
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


def spread_over_gpus(pods: list[ScenarioPod], gpus: int) -> list[ScenarioPod]:
    """The stable rule for pods whose `gpu:` names no `device:` (device -1 until here): the
    i-th such GPU pod of the file goes on GPU i mod gpus."""
    spread = 0
    placed = []
    for pod in pods:
        if pod.gpu is not None and pod.device < 0:
            placed.append(replace(pod, device=spread % max(gpus, 1)))
            spread += 1
        else:
            placed.append(pod)
    return placed


def _pods(
    spec: Section, directory: Path, duration: float, capacity: tuple[float, float], gpus: int
) -> list[ScenarioPod]:
    """One entry of `pods:`, expanded to `replicas` pods named NAME-0, NAME-1, ...; the GPU
    demand's `device:` puts them on one GPU (a pod's client runs on one device)."""
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
    gpu, device = None, 0
    if spec.has("gpu"):
        gpu_spec = spec.section("gpu")
        device = gpu_spec.integer("device") if gpu_spec.has("device") else -1
        if device >= gpus:
            spec.fail("gpu", f"device {device} is not one of the node's {gpus} GPUs")
        gpu = _shape(spec, "gpu", gpu_spec, directory, capacity[1])
    coupled = _coupled(spec, gpu is not None)
    spec.done()
    names = [name] if replicas == 1 else [f"{name}-{i}" for i in range(replicas)]
    for pod_name in names:
        try:
            validate_pod_name(pod_name)
        except InvalidSpec as err:
            spec.fail("name", str(err))
    return [ScenarioPod(n, tokens, start, end, cpu, gpu, device, coupled) for n in names]


def _coupled(spec: Section, has_gpu: bool) -> bool:
    """`coupled: true` makes a pod a pipeline between its CPU and its GPU: meaningless, and
    refused, on a pod that has no GPU demand."""
    coupled = spec.raw("coupled", False)
    if not isinstance(coupled, bool):
        spec.fail("coupled", f"must be true or false, got {coupled!r}")
    if coupled and not has_gpu:
        spec.fail("coupled", "a coupled pod pipes its CPU into its GPU: give it a `gpu:` demand")
    return coupled


def _demand(spec: Section, key: str, directory: Path, capacity: float) -> Shape:
    return _shape(spec, key, spec.section(key), directory, capacity)


def _shape(spec: Section, key: str, section: Section, directory: Path, capacity: float) -> Shape:
    shape = read_shape(section, directory)
    if shape.peak > capacity:
        spec.fail(
            key,
            f"peak demand {shape.peak:g} % is more than the node has ({capacity:g} %)",
        )
    return shape
