"""Validated configuration: a TOML file and command-line flags, checked once at start.

A bad value is a `ConfigError` naming the key, never a limit computed from it later.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kuscale.model import INITIAL_LIMIT, RESOURCES, Resource, is_decimal


class ConfigError(ValueError):
    """A configuration value the agent refuses to start with."""


@dataclass(frozen=True, slots=True)
class ResourceConfig:
    """Price in tokens per percent per second, and the bounds of a pod's limit."""

    price: float
    min: float = INITIAL_LIMIT
    max: float | None = None
    """Per-pod cap; None means the node's capacity of the resource."""
    overcommit: float = 1.0
    """The node stage shares `capacity × overcommit` when pods want more."""


@dataclass(frozen=True, slots=True)
class BaselineConfig:
    """Parameters of the rules kuscale is compared with, at their published defaults."""

    static_cpu_share: float = 0.5
    """`static`: the share of a CPU+GPU pod's tokens spent on the CPU."""
    vpa_half_life: float = 24 * 3600.0
    vpa_percentile: float = 0.9
    vpa_margin: float = 0.15
    vpa_interval: float = 60.0
    """Seconds between the recommender's recomputations."""
    autothrottle_target: float = 0.1
    """The throttle ratio each per-pod controller aims at (the paper's Tower picks it)."""
    autothrottle_margin: float = 0.1
    autothrottle_window: float = 60.0
    """Seconds of usage whose maximum the controller scales down towards."""

    def validate(self) -> BaselineConfig:
        for key in ("static_cpu_share", "vpa_percentile", "autothrottle_target"):
            value = getattr(self, key)
            _require_finite(f"baselines.{key}", value, non_negative=True)
            if value > 1.0:
                raise ConfigError(f"baselines.{key} must be in [0, 1], got {value}")
        for key in ("vpa_half_life", "vpa_interval", "autothrottle_window"):
            _require_finite(f"baselines.{key}", getattr(self, key), positive=True)
        for key in ("vpa_margin", "autothrottle_margin"):
            _require_finite(f"baselines.{key}", getattr(self, key), non_negative=True)
        return self


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Parameters of the rules, with the original KuScale's values as defaults."""

    cpu: ResourceConfig = field(default_factory=lambda: ResourceConfig(price=1.0))
    gpu: ResourceConfig = field(default_factory=lambda: ResourceConfig(price=3.0))
    static_v: float = 10.0
    """V > 0: static weights p·V; V <= 0: the original's usage-based weights."""
    burst_factor: float = 0.0
    """k: share of the token queue a pod may spend per period (the original has 0)."""
    burst_seconds: float = 1.0
    """Token queue cap in seconds of reservation (the original caps it at R, i.e. 1 s)."""
    ewma_weight: float = 1.0 / 8.0
    pin_tolerance: float = 0.05
    """Usage within this fraction of the limit counts as starved (pinned at the limit)."""
    growth: float = 16.0
    """Factor the demand estimate of a starved pod grows by per tick (`kuscale` only). A
    starved pod's demand is unknown, and every tick spent finding it is served below it:
    the estimate leaps (from 10 % to a whole core in one tick), and the pod's budget, not the
    step, bounds what it gets. Kernel weights keep the leap from starving anyone else."""
    fast_growth: float = 2.0
    """Factor a limit may grow by at one look of the watch (`kuscale` only): a raise is
    charged for the whole period, so a pod throttled by its own noise pays for one step,
    while a burst from 10 % reaches a whole core within four looks (0.4 s)."""
    damping: float = 0.3
    """Share of the excess of the demand estimate over usage kept per quiet tick. Once a pod
    runs unthrottled its usage is its demand, so the leap's excess is shed within a few
    ticks rather than paid for over tens."""
    noise_margin: float = 2.0
    """Spreads (EWMA of |usage − last usage|) a quiet pod's estimate stays above usage,
    so a noisy pod is not pinned by its own noise (`kuscale` only)."""
    baselines: BaselineConfig = field(default_factory=BaselineConfig)

    def resource(self, resource: Resource) -> ResourceConfig:
        return self.cpu if resource is Resource.CPU else self.gpu

    def prices(self) -> NDArray[np.float64]:
        return np.array([self.resource(r).price for r in RESOURCES], dtype=np.float64)

    def minimums(self) -> NDArray[np.float64]:
        return np.array([self.resource(r).min for r in RESOURCES], dtype=np.float64)

    def validate(self) -> PolicyConfig:
        for resource in RESOURCES:
            rc = self.resource(resource)
            name = resource.label
            _require_finite(f"resources.{name}.price", rc.price, positive=True)
            _require_finite(f"resources.{name}.min", rc.min, positive=True)
            _require_finite(f"resources.{name}.overcommit", rc.overcommit, positive=True)
            if rc.max is not None:
                _require_finite(f"resources.{name}.max", rc.max, positive=True)
                if rc.min > rc.max:
                    raise ConfigError(
                        f"resources.{name}.min ({rc.min}) is above resources.{name}.max ({rc.max})"
                    )
        _require_finite("policy.static_v", self.static_v)
        _require_finite("policy.pin_tolerance", self.pin_tolerance, non_negative=True)
        _require_finite("policy.burst_factor", self.burst_factor, non_negative=True)
        _require_finite("policy.burst_seconds", self.burst_seconds, positive=True)
        _require_finite("policy.growth", self.growth)
        if self.growth <= 1.0:
            raise ConfigError(f"policy.growth must be above 1, got {self.growth}")
        _require_finite("policy.fast_growth", self.fast_growth)
        if self.fast_growth <= 1.0:
            raise ConfigError(f"policy.fast_growth must be above 1, got {self.fast_growth}")
        _require_finite("policy.damping", self.damping, non_negative=True)
        _require_finite("policy.noise_margin", self.noise_margin, non_negative=True)
        if self.damping >= 1.0:
            raise ConfigError(f"policy.damping must be below 1, got {self.damping}")
        if not 0.0 <= self.pin_tolerance < 1.0:
            raise ConfigError(f"policy.pin_tolerance must be in [0, 1), got {self.pin_tolerance}")
        if not 0.0 < self.ewma_weight <= 1.0:
            raise ConfigError(f"policy.ewma_weight must be in (0, 1], got {self.ewma_weight}")
        self.baselines.validate()
        return self


POLICY_NAMES = ("kuscale", "kuscale-2022", "static", "vpa", "autothrottle")
GPU_LAYERS = ("none", "vgpu", "gemini", "hami")
GEMINI_REQUESTS = ("tokens", "minimum", "keep")
GPU_USAGE_SOURCES = ("nvml", "emulator")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.:@+-]+")


@dataclass(frozen=True, slots=True)
class GpuLayerConfig:
    """What a Kubernetes node's device plugin gives each container for the GPU layer.

    With `vgpu`, every container given tokens gets a vGPU directory of its own under `root`
    (a host path, which the agent sees at the same path), mounted at `container_dir`; with
    `hook_library` (Gemini's `libgemhook.so.1` on the host) it is preloaded into the
    container and named to Gemini by its vGPU id; `pod_manager` is Gemini's pod manager.

    With `gemini`, kuscale rewrites Gemini's per-GPU resource files in `gemini_dir` (one
    per GPU, named by `gemini_files`: KubeShare names them by GPU UUID; default `0`, `1`,
    ...), writing REQUEST as the pod's token-weighted share of its GPU (`gemini_request =
    "tokens"`, the default: gem-schd then shares each GPU by tokens, as the kernel shares
    the CPU by cpu.shares, and limits carry budgets alone), as the pod's GPU minimum
    (`"minimum"`) or leaving it (`"keep"`), and reads use from NVML (`usage = "nvml"`,
    the `nvml` extra) or from the local GPU emulator (`"emulator"`).

    With `hami`, each pod's GPU use is read from HAMi-core's per-container regions under
    `hami_root` and charged at the share HAMi fixed; nothing is written.
    """

    kind: str = "none"
    gpus: int = 1
    root: str = "/var/lib/kuscale/vgpu"
    container_dir: str = "/var/run/kuscale/vgpu"
    hook_library: str = ""
    pod_manager: str = ""
    """HOST:PORT, given to the hook as POD_MANAGER_IP and POD_MANAGER_PORT."""
    env: dict[str, str] = field(default_factory=dict)
    """More environment for every container given tokens."""
    gemini_dir: str = "/kubeshare/scheduler/config"
    gemini_files: list[str] = field(default_factory=list)
    gemini_request: str = "tokens"
    gemini_memory: int = 4 << 30
    """GPU_MEM, bytes, for a client the device plugin places (Gemini needs a restart to
    change it, so kuscale never does)."""
    usage: str = "nvml"
    hami_root: str = "/usr/local/vgpu/containers"
    """HAMi's per-container shared regions on the host (`hami`: measured, never resized)."""

    def validate(self) -> GpuLayerConfig:
        if self.kind not in GPU_LAYERS:
            raise ConfigError(f"gpu_layer.kind {self.kind!r} is not one of {', '.join(GPU_LAYERS)}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ConfigError(f"gpu_layer.gpus must be a positive integer, got {self.gpus!r}")
        for key in ("root", "container_dir", "hook_library", "gemini_dir", "hami_root"):
            _require_path(f"gpu_layer.{key}", getattr(self, key), optional=key == "hook_library")
        files = self.gemini_files
        if not isinstance(files, list) or not all(
            _FILE_NAME.fullmatch(str(f)) and str(f) not in (".", "..") for f in files
        ):
            raise ConfigError(f"gpu_layer.gemini_files must be a list of file names, got {files!r}")
        memory = self.gemini_memory
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
            raise ConfigError(f"gpu_layer.gemini_memory must be bytes (>= 0), got {memory!r}")
        if self.gemini_request not in GEMINI_REQUESTS:
            raise ConfigError(
                f"gpu_layer.gemini_request must be one of {', '.join(GEMINI_REQUESTS)}, "
                f"got {self.gemini_request!r}"
            )
        if self.usage not in GPU_USAGE_SOURCES:
            raise ConfigError(
                f"gpu_layer.usage must be one of {', '.join(GPU_USAGE_SOURCES)}, got {self.usage!r}"
            )
        self.pod_manager_address()
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and _ENV_NAME.fullmatch(k) and isinstance(v, str)
            for k, v in self.env.items()
        ):
            raise ConfigError("gpu_layer.env must map variable names to strings")
        return self

    def files(self) -> list[str]:
        """Gemini's file per GPU: as configured, or `0` .. `gpus - 1`."""
        return [str(f) for f in self.gemini_files] or [str(d) for d in range(self.gpus)]

    def pod_manager_address(self) -> tuple[str, int] | None:
        if not self.pod_manager:
            return None
        host, _, port = str(self.pod_manager).rpartition(":")
        if not host or not is_decimal(port) or not 1 <= int(port) <= 65535:
            raise ConfigError(f"gpu_layer.pod_manager must be HOST:PORT, got {self.pod_manager!r}")
        return host, int(port)


def _require_path(key: str, value: object, optional: bool = False) -> None:
    """An absolute path with no `..`: these name host directories mounted into pods."""
    if optional and value == "":
        return
    if not isinstance(value, str) or not value.startswith("/") or ".." in value.split("/"):
        raise ConfigError(f"{key} must be an absolute path without '..', got {value!r}")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    period: float = 1.0
    policy: str = "kuscale"
    monitor_only: bool = False
    window: int = 15
    kernel_shares: bool = True
    """Also set cpu.shares (v2: cpu.weight) in proportion to tokens, so the kernel shares a
    full node by tokens inside every period. Then CPU limits carry only budgets and may add
    up to more than the node has: CPU one pod leaves idle goes to a pod that starves."""
    watch_interval: float = 0.1
    """Seconds between reads of every pod's throttle counter between ticks; a pod seen
    throttled gets at once what its budget allows (the policy's fast path). 0 turns it off."""
    watch_pressure: bool = True
    """On cgroup v2, sleep between ticks on PSI triggers on the pods' cpu.pressure, which the
    kernel fires when a pod stalls for CPU, instead of reading every pod each interval; the
    watch polls where a trigger cannot be registered."""
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    gpu_layer: GpuLayerConfig = field(default_factory=GpuLayerConfig)

    def validate(self) -> AgentConfig:
        _require_finite("agent.period", self.period, positive=True)
        if not 0.01 <= self.period <= 60.0:
            raise ConfigError(
                f"agent.period must be between 0.01 and 60 seconds, got {self.period}"
            )
        _require_finite("agent.watch_interval", self.watch_interval, non_negative=True)
        if self.watch_interval > self.period:
            raise ConfigError(
                f"agent.watch_interval ({self.watch_interval}) must not be longer than "
                f"agent.period ({self.period}); 0 turns the watch off"
            )
        if self.policy not in POLICY_NAMES:
            raise ConfigError(
                f"agent.policy {self.policy!r} is not one of {', '.join(POLICY_NAMES)}"
            )
        for key in ("monitor_only", "kernel_shares", "watch_pressure"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"agent.{key} must be true or false")
        if isinstance(self.window, bool) or not isinstance(self.window, int):
            raise ConfigError(f"agent.window must be an integer, got {self.window!r}")
        if not 1 <= self.window <= 10_000:
            raise ConfigError(f"agent.window must be between 1 and 10000, got {self.window}")
        self.policy_config.validate()
        self.gpu_layer.validate()
        return self


def _require_finite(
    key: str, value: object, *, positive: bool = False, non_negative: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{key} must be above 0, got {value}")
    if non_negative and value < 0:
        raise ConfigError(f"{key} must not be negative, got {value}")


def _take_table(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    table = data.pop(key, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [{key}] must be a table")
    return table


def _apply(target: Any, table: dict[str, Any], section: str, skip: tuple[str, ...] = ()) -> Any:
    """Replace the dataclass fields named in a TOML table; unknown keys are an error."""
    known = {f.name for f in fields(target)} - set(skip)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) in [{section}]: {', '.join(unknown)}")
    return replace(target, **table)


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> AgentConfig:
    """Read a TOML file (if any), apply command-line overrides, and validate the result."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"cannot read config {path}: {err.strerror}") from err
        except ValueError as err:
            raise ConfigError(f"cannot read config {str(path)!r}: {err}") from err
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config {path} is not valid TOML: {err}") from err
    return config_from_mapping(data, str(path) if path else "defaults", overrides)


def config_from_mapping(
    data: dict[str, Any], where: str, overrides: dict[str, Any] | None = None
) -> AgentConfig:
    """The config file's tables ([agent], [policy], [resources.*], [baselines], [gpu_layer])
    from any source, so a scenario can carry the same settings as the agent's TOML."""
    data = dict(data)
    agent_table = _take_table(data, "agent", where)
    policy_table = _take_table(data, "policy", where)
    resources_table = _take_table(data, "resources", where)
    baselines_table = _take_table(data, "baselines", where)
    gpu_layer_table = _take_table(data, "gpu_layer", where)
    if data:
        raise ConfigError(f"{where}: unknown section(s): {', '.join(sorted(data))}")
    policy = _apply(PolicyConfig(), policy_table, "policy", skip=("cpu", "gpu", "baselines"))
    policy = replace(policy, baselines=_apply(BaselineConfig(), baselines_table, "baselines"))
    for name, table in resources_table.items():
        if name not in ("cpu", "gpu") or not isinstance(table, dict):
            raise ConfigError(f"{where}: [resources.{name}] is not a known resource table")
        current = getattr(policy, name)
        policy = replace(policy, **{name: _apply(current, table, f"resources.{name}")})
    agent: AgentConfig = _apply(
        AgentConfig(), agent_table, "agent", skip=("policy_config", "gpu_layer")
    )
    gpu_layer = _apply(GpuLayerConfig(), gpu_layer_table, "gpu_layer")
    agent = replace(agent, policy_config=policy, gpu_layer=gpu_layer)
    if overrides:
        agent = replace(agent, **{k: v for k, v in overrides.items() if v is not None})
    try:
        return agent.validate()
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from err
