"""Plain data: pods, their resources, samples and the registry that holds them.

Amounts are percent of one unit (CPU 100 = one core, GPU 100 = one whole GPU's time), as in
the original KuScale. Nothing here touches a file, a clock or a thread: the monitor is the
only owner of these objects and mutates them from its own thread.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from dataclasses import dataclass, field


class Resource(enum.IntEnum):
    """Resource columns of every policy array, in a fixed order."""

    CPU = 0
    GPU = 1

    @property
    def label(self) -> str:
        return self.name.lower()


RESOURCES: tuple[Resource, ...] = (Resource.CPU, Resource.GPU)

INITIAL_LIMIT = 10.0
"""Limit a new pod starts with for each resource it uses (the original's value)."""

MIN_SHARES = 2
MAX_SHARES = 262_144
"""The kernel's range of cgroup v1 cpu.shares (v2 cpu.weight is mapped onto it)."""

SHARES_PER_100_TOKENS = 1024
"""cpu.shares per 100 tokens: the kubelet's 1024 shares per core at the default CPU price."""


def shares_for_tokens(tokens: int) -> int:
    """cpu.shares in proportion to tokens, inside the kernel's range."""
    return min(max(round(tokens * SHARES_PER_100_TOKENS / 100), MIN_SHARES), MAX_SHARES)


DEFAULT_WINDOW = 15
"""Samples of usage history kept per resource: a bounded window, never a growing list."""


class PodStatus(enum.StrEnum):
    INITIALIZING = "initializing"
    NOT_READY = "not ready"
    RUNNING = "running"
    COMPLETED = "completed"
    REFUSED = "refused"


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
MAX_POD_NAME = 253
_VGPU_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


class InvalidSpec(ValueError):
    """A pod description that cannot be accepted; the message says which field and why."""


def validate_pod_name(name: str) -> str:
    """Pod names are DNS-1123 subdomains, as Kubernetes names pods, and become cgroup
    directory and file names in local mode: every dot sits between two alphanumerics, so no
    name is `.`, `..` or holds a `/`."""
    if len(name) > MAX_POD_NAME or not _DNS_SUBDOMAIN.fullmatch(name):
        raise InvalidSpec(
            f"pod name {name!r} is not a DNS-1123 subdomain (lower-case letters, digits, "
            f"'-' and '.', 1-{MAX_POD_NAME} characters, alphanumeric around every dot and "
            "at both ends)"
        )
    return name


def validate_vgpu_id(vgpu_id: str) -> str:
    """vGPU ids become directory names under the GPU layer's root: no '/', no '..'."""
    if not _VGPU_ID.fullmatch(vgpu_id) or set(vgpu_id) <= {"."}:
        raise InvalidSpec(f"vGPU id {vgpu_id!r} must be letters, digits, '_', '.', '-' only")
    return vgpu_id


def validate_tokens(tokens: object) -> int:
    """Tokens are a count of `kuscale.com/token` units: a positive integer, nothing else."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise InvalidSpec(f"tokens must be a positive integer, got {tokens!r}")
    return tokens


@dataclass(frozen=True, slots=True)
class PodSpec:
    """What a discovery source knows about a pod when it asks the monitor to adopt it.

    `cgroup` is relative to the CPU backend's root; `vgpu_id` names the pod's directory in
    the GPU layer (None when the pod uses no GPU).
    """

    name: str
    tokens: int
    cgroup: str
    namespace: str = "local"
    uid: str = ""
    vgpu_id: str | None = None
    owned: bool = False
    """True when kuscale created the cgroup and must remove it once the pod completes."""
    containers: tuple[str, ...] = ()
    """The leaf cgroups of the pod's containers, under `cgroup` (Kubernetes pods)."""
    declared_cpu: float | None = None
    """The pod's CPU limit as the API server declares it (Kubernetes pods whose every
    container has `limits.cpu`), percent: the kubelet's truth, which wins over a record."""

    def __post_init__(self) -> None:
        validate_pod_name(self.name)
        validate_tokens(self.tokens)
        for leaf in self.containers:
            if not leaf.startswith(self.cgroup + "/"):
                raise InvalidSpec(f"container cgroup {leaf!r} is not under {self.cgroup!r}")
        if self.vgpu_id is not None:
            validate_vgpu_id(self.vgpu_id)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def resources(self) -> tuple[Resource, ...]:
        return RESOURCES if self.vgpu_id is not None else (Resource.CPU,)


@dataclass(frozen=True, slots=True)
class ContainerLimit:
    """One container's CPU limit as kuscale found it (percent; None: unlimited)."""

    name: str
    """Its leaf cgroup for the cgroup actuator, its name in the pod for the resize one."""
    limit: float | None
    request: float = 0.0
    """The floor of any limit the API accepts for it (its `requests.cpu`)."""


@dataclass(frozen=True, slots=True)
class Held:
    """What a pod had before kuscale took it over, to be given back."""

    pod: float | None
    containers: tuple[ContainerLimit, ...] = ()


@dataclass(frozen=True, slots=True)
class Original:
    """What a pod had before kuscale first changed anything of it: one entry of the durable
    record, written before the first change and removed once it is given back."""

    key: str
    uid: str
    cgroup: str
    held: Held
    """The pod's CPU limit and its containers', as the actuator found them."""
    shares: int | None = None
    """cpu.shares before kuscale set them from tokens (None: kuscale does not set them)."""
    vgpu_id: str | None = None
    gpu_limit: float | None = None
    """The GPU share before kuscale (None: unlimited); meaningful only with `vgpu_id`."""
    launched: bool = False
    """Recorded by `kuscale launch` as it made the cgroup, before any agent saw the pod."""


@dataclass(frozen=True, slots=True)
class CpuCounters:
    """Cumulative CPU counters of one cgroup, as the kernel keeps them."""

    usage_ns: int
    nr_periods: int = 0
    nr_throttled: int = 0
    throttled_ns: int = 0


@dataclass(slots=True)
class ResourceState:
    """One resource of one pod: the original's ResourceInfo, plus the demand estimate."""

    price: float
    limit: float = INITIAL_LIMIT
    usage: float = 0.0
    avg_usage: float = 0.0
    weight: float = 0.0
    demand: float = 0.0
    spread: float = 0.0
    """EWMA of |usage − last usage|: how much the pod's usage wanders tick to tick."""
    starved: bool = False
    history: deque[float] = field(default_factory=lambda: deque(maxlen=DEFAULT_WINDOW))
    restore_limit: float | None = None
    """The GPU's limit before kuscale first changed it (None = unlimited); the CPU's is in
    the pod's `held`, with its containers'."""
    changed: bool = False


@dataclass(slots=True)
class PodState:
    """A pod the monitor manages: the original's PodInfo."""

    spec: PodSpec
    resources: dict[Resource, ResourceState]
    status: PodStatus = PodStatus.INITIALIZING
    token_queue: float = 0.0
    updated_count: int = 0
    last_update: float | None = None
    """Monotonic seconds of the sample the next usage is measured from."""
    cpu_baseline: CpuCounters | None = None
    gpu_baseline: int | None = None
    gpu_device: int = 0
    """The GPU its client runs on, as the GPU layer says."""
    held: Held | None = None
    """What the CPU actuator found when it took the pod over, to give back."""
    original: Original | None = None
    """Everything the pod had before kuscale, as recorded before the first change."""
    restore_shares: int | None = None
    """cpu.shares before kuscale set them from tokens (None: not changed)."""
    throttle_mark: int = 0
    """nr_throttled as the last tick or watch pass saw it."""
    raised_mark: int | None = None
    """nr_throttled when the watch last raised the pod's limit: throttling before it was
    answered already, so the next tick does not count it as starvation."""
    reason: str = ""
    key: str = field(init=False)
    """`namespace/name`, kept rather than formatted: every tick reads it for every pod."""

    def __post_init__(self) -> None:
        self.key = self.spec.key

    def uses(self, resource: Resource) -> bool:
        return resource in self.resources


@dataclass(slots=True)
class Registry:
    """Running and completed pods, keyed by namespace/name. Owned by the monitor's thread."""

    running: dict[str, PodState] = field(default_factory=dict)
    completed: dict[str, PodState] = field(default_factory=dict)
    completed_limit: int = 1000

    def complete(self, key: str, status: PodStatus = PodStatus.COMPLETED, reason: str = "") -> None:
        pod = self.running.pop(key, None)
        if pod is None:
            return
        pod.status = status
        pod.reason = reason
        self.completed[key] = pod
        while len(self.completed) > self.completed_limit:
            del self.completed[next(iter(self.completed))]
