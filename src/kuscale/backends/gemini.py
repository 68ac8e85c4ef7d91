"""Gemini's scheduler as kuscale's GPU layer: one resource configuration per GPU, rewritten in
place, and busy time from NVML.

Gemini's `gem-schd` (one per GPU) reads a file of `N` then `N` lines `ID REQUEST LIMIT
GPU_MEM` — REQUEST and LIMIT fractions of GPU time in the scheduler's sliding window, GPU_MEM
bytes — and reloads it on inotify's IN_CLOSE_WRITE for that file name, so the file is
rewritten where it is (open, truncate, write, close), never renamed over (facts from
Gemini's README and `src/scheduler.cpp`; KubeShare keeps the files at
`/kubeshare/scheduler/config/<GPU-UUID>`). kuscale changes only the LIMIT and REQUEST of the
clients it manages; every other line, unparseable ones included, is kept verbatim. Gemini
reports no use per client, so use comes from NVML, per process, mapped to the pod's cgroup.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kuscale.backends.base import BackendError, RangeError
from kuscale.backends.files import confine
from kuscale.config import GEMINI_REQUESTS
from kuscale.model import is_decimal

log = logging.getLogger("kuscale.gemini")

MAX_CLIENT_NAME = 62
"""Gemini's IDs are ASCII names under 63 characters (its README)."""
POLL_SECONDS = 0.05
"""Reads this close together share one NVML poll: one round of the tick's or the watch's."""
DEFAULT_STEP = 5.0
"""Points a share must rise by before Gemini's file is rewritten for it."""


class GpuUsage(Protocol):
    """Busy time per cgroup and device: what NVML (or the emulator behind it) measures."""

    def poll(self) -> None: ...

    def busy_ns(self, cgroup: str, device: int) -> int: ...


@dataclass(slots=True)
class ClientLine:
    name: str
    request: float
    limit: float
    memory: int
    text: str | None = field(default=None, compare=False)
    """The line as it was read: written back as it was unless kuscale changed the client."""

    def render(self) -> str:
        if self.text is not None:
            return self.text
        return f"{self.name} {_fraction(self.request)} {_fraction(self.limit)} {self.memory}"


Entry = ClientLine | str
"""A client's line, or a line kuscale could not read, kept as it was."""


def _fraction(value: float) -> str:
    return f"{value:.4f}".rstrip("0").rstrip(".") if value else "0"


def validate_client_name(name: str) -> str:
    if (
        not name
        or len(name) > MAX_CLIENT_NAME
        or not name.isascii()
        or any(c.isspace() for c in name)
    ):
        raise BackendError(
            f"Gemini client name {name[:80]!r} must be 1-{MAX_CLIENT_NAME} ASCII characters "
            "without whitespace"
        )
    return name


def parse_client(line: str) -> ClientLine | None:
    fields = line.split()
    if len(fields) != 4 or len(fields[0]) > MAX_CLIENT_NAME or not is_decimal(fields[3]):
        return None
    try:
        request, limit = float(fields[1]), float(fields[2])
    except ValueError:
        return None
    if not (0.0 <= request <= 1.0 and 0.0 <= limit <= 1.0):
        return None
    return ClientLine(fields[0], request, limit, int(fields[3]), line)


def parse_config(text: str) -> list[Entry]:
    """Every line after the count, read where it can be and kept verbatim where not (split
    on newlines alone, as gem-schd's stream reads it)."""
    lines = [line for line in text.split("\n") if line.strip()]
    if lines and is_decimal(lines[0].strip()):
        lines = lines[1:]
    return [parse_client(line) or line for line in lines]


def render_config(entries: Sequence[Entry]) -> str:
    body = [entry.render() if isinstance(entry, ClientLine) else entry for entry in entries]
    return "\n".join([str(len(entries)), *body]) + "\n"


def rewrite_in_place(path: str, text: str) -> None:
    """Open, truncate, write, close on the same file: gem-schd's inotify sees the close, and
    a rename would go unseen. One write of the whole text, so the file is never empty for
    longer than the write; a failed write is reported, never retried half done."""
    data = text.encode("latin-1")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    except OSError as err:
        raise BackendError(f"cannot open {path}: {err.strerror}") from err
    try:
        if os.write(fd, data) != len(data):
            raise BackendError(f"short write to {path}")
    except OSError as err:
        raise BackendError(f"cannot write {path}: {err.strerror}") from err
    finally:
        os.close(fd)


class GeminiLayer:
    """A `GpuBackend` over Gemini's per-GPU configuration files in `config_dir`.

    `files[d]` names device d's file (a GPU UUID under KubeShare). A client's device is the
    file that lists it: whoever placed the client on a GPU (KubeShare, kuscale's device
    plugin, the demo) wrote its line; kuscale only changes it. `request` is one of
    GEMINI_REQUESTS: with "tokens" the layer is `weighted`, each managed client's REQUEST its
    pod's token-weighted share of what the device's other clients do not reserve, so
    gem-schd serves clients below their share first and shares the rest up to each LIMIT;
    with "minimum" REQUEST is `minimum` percent. REQUEST is never above LIMIT.
    """

    mode = "gemini"

    def __init__(
        self,
        config_dir: Path,
        files: Sequence[str],
        usage: GpuUsage | None,
        request: str = "tokens",
        minimum: float = 0.0,
        step: float = DEFAULT_STEP,
    ) -> None:
        if not files:
            raise BackendError("Gemini needs at least one GPU configuration file")
        if request not in GEMINI_REQUESTS:
            raise BackendError(f"Gemini's REQUEST rule {request!r} is not one of {GEMINI_REQUESTS}")
        self.paths = [confine(config_dir, name) for name in files]
        self.usage = usage
        self.request = request
        self.minimum = minimum
        self.step = step
        self.weighted = request == "tokens"
        self._cgroups: dict[str, str] = {}
        self._devices: dict[str, int] = {}
        self._weights = ClientWeights()
        self._staged: dict[str, float | None] = {}
        self._removed: set[str] = set()
        self._polled_at = -math.inf

    def capacity(self) -> float:
        return 100.0 * len(self.paths)

    def devices(self) -> tuple[float, ...]:
        return (100.0,) * len(self.paths)

    def _entries(self, device: int) -> list[Entry]:
        """The device's file, bytes kept as they are (latin-1 maps each byte to itself)."""
        path = self.paths[device]
        try:
            with open(path, "rb") as config:
                return parse_config(config.read().decode("latin-1"))
        except FileNotFoundError:
            return []
        except OSError as err:
            raise BackendError(f"cannot read {path}: {err.strerror}") from err

    def _find(self, client: str) -> tuple[int, ClientLine]:
        validate_client_name(client)
        for device in range(len(self.paths)):
            for entry in self._entries(device):
                if isinstance(entry, ClientLine) and entry.name == client:
                    return device, entry
        raise BackendError(f"Gemini client {client!r} is in no GPU configuration")

    def device_of(self, vgpu_id: str) -> int:
        return self._find(vgpu_id)[0]

    def exists(self, vgpu_id: str) -> bool:
        try:
            self._find(vgpu_id)
        except BackendError:
            return False
        return True

    def track(self, vgpu_id: str, cgroup: str) -> None:
        """Remember the client's cgroup and device, so a tick's reads parse no file."""
        self._cgroups[vgpu_id] = cgroup
        self._devices[vgpu_id] = self.device_of(vgpu_id)

    def weigh(self, vgpu_id: str, tokens: float) -> None:
        """The client's tokens, from which the next commit writes every REQUEST on its
        device (none, or 0: kuscale no longer weighs it); ignored unless REQUEST comes from
        tokens."""
        validate_client_name(vgpu_id)
        if self.weighted:
            self._weights.set(vgpu_id, tokens)

    def read(self, vgpu_id: str) -> int:
        """Busy ns from NVML, polled once per round of reads: the first read after a commit
        or after POLL_SECONDS, so a tick's reads poll once and the watch's looks see new
        samples."""
        if self.usage is None:
            raise BackendError("no GPU usage source (NVML) for Gemini")
        cgroup, device = self._cgroups.get(vgpu_id), self._devices.get(vgpu_id)
        if cgroup is None or device is None:
            raise BackendError(f"Gemini client {vgpu_id!r} has no cgroup to measure")
        now = time.monotonic()
        if now - self._polled_at >= POLL_SECONDS:
            self.usage.poll()
            self._polled_at = now
        return self.usage.busy_ns(cgroup, device)

    def quantize(self, vgpu_id: str, limit: float, held: float | None) -> float:
        """Whole percents, and a rise under `step` points leaves what the client holds.

        Every rewrite makes gem-schd reload the file and remake every client's state, and a
        client's grants stall while it does (seen here: a rewrite each half-second tick
        left a client wanting 65 % of the GPU with 1 %). So a LIMIT changes only when the
        share falls (at once: the budget pays for no more) or rises by `step` or more."""
        _check_share(limit)
        if held is not None and held <= limit < held + self.step:
            return held
        return max(math.floor(limit), min(limit, 1.0))

    def read_limit(self, vgpu_id: str) -> float | None:
        return self._find(vgpu_id)[1].limit * 100.0

    def write_limit(self, vgpu_id: str, limit: float | None) -> None:
        """Staged until commit; None (no limit) is the whole GPU: LIMIT 1."""
        validate_client_name(vgpu_id)
        if limit is not None:
            _check_share(limit)
        self._staged[vgpu_id] = limit
        self._removed.discard(vgpu_id)

    def remove(self, vgpu_id: str) -> None:
        """The client left: its line goes at the next commit (gem-schd keeps clients it once
        read, so a departed client would otherwise keep a share in the file)."""
        self._staged.pop(vgpu_id, None)
        self._cgroups.pop(vgpu_id, None)
        self._devices.pop(vgpu_id, None)
        self._weights.drop(vgpu_id)
        self._removed.add(vgpu_id)

    def commit(self) -> None:
        """Rewrite each device's file whose text changed, once."""
        self._polled_at = -math.inf
        if not self._weights.taken() and not self._staged and not self._removed:
            return
        failures = []
        for device, path in enumerate(self.paths):
            try:
                self._commit_device(device, path)
            except BackendError as err:
                failures.append(str(err))
        self._staged.clear()
        self._removed.clear()
        if failures:
            raise BackendError("; ".join(failures))

    def _commit_device(self, device: int, path: str) -> None:
        entries = self._entries(device)
        kept = [e for e in entries if not (isinstance(e, ClientLine) and e.name in self._removed)]
        requests = self._token_requests(kept)
        changed: list[Entry] = []
        for entry in kept:
            if isinstance(entry, ClientLine) and (
                entry.name in self._staged or entry.name in requests
            ):
                changed.append(self._updated(entry, requests.get(entry.name)))
            else:
                changed.append(entry)
        text = render_config(changed)
        if entries and text != render_config(entries):
            rewrite_in_place(path, text)

    def place(
        self, client: str, memory: int, device: int | None = None, limit: float = 100.0
    ) -> int:
        """Put a new client on `device`, or on the device with the fewest clients, with
        `limit` percent (the whole GPU until the agent adopts it); a stale line of the same
        name goes first. Its device."""
        validate_client_name(client)
        _check_share(limit)
        if device is not None and not 0 <= device < len(self.paths):
            raise BackendError(f"no GPU {device}: Gemini has {len(self.paths)} files here")
        listed = [self._entries(d) for d in range(len(self.paths))]
        for d, entries in enumerate(listed):
            kept = [e for e in entries if not (isinstance(e, ClientLine) and e.name == client)]
            if len(kept) != len(entries):
                rewrite_in_place(self.paths[d], render_config(kept))
                listed[d] = kept
        if device is None:
            device = min(range(len(listed)), key=lambda d: (_clients(listed[d]), d))
        line = ClientLine(client, 0.0, limit / 100.0, memory)
        rewrite_in_place(self.paths[device], render_config([*listed[device], line]))
        return device

    def _token_requests(self, entries: Sequence[Entry]) -> dict[str, float]:
        """REQUEST of the weighted clients among one device's lines: their share, by
        tokens, of what the device's other clients do not reserve."""
        if not self.weighted:
            return {}
        clients = [e for e in entries if isinstance(e, ClientLine)]
        tokens = self._weights.tokens
        weights = {c.name: tokens[c.name] for c in clients if c.name in tokens}
        reserved = sum(c.request for c in clients if c.name not in weights)
        if weights and reserved >= 1.0:
            log.warning(
                "Gemini clients kuscale does not manage reserve %.4g of a GPU with %s: "
                "its clients get REQUEST 0 (served after every REQUEST is met, up to LIMIT)",
                reserved,
                ", ".join(sorted(weights)),
            )
        return token_requests(weights, reserved)

    def _updated(self, entry: ClientLine, weighted: float | None) -> ClientLine:
        """The client's line with the LIMIT staged for it (or the one it has) and its
        REQUEST by the rule (`weighted`: its share by tokens)."""
        fraction = entry.limit
        if entry.name in self._staged:
            limit = self._staged[entry.name]
            fraction = 1.0 if limit is None else limit / 100.0
        request = entry.request
        if weighted is not None:
            request = weighted
        elif self.request == "minimum":
            request = self.minimum / 100.0
        return ClientLine(entry.name, min(request, fraction), fraction, entry.memory)


class ClientWeights:
    """The tokens of the clients a layer weighs, and whether they changed since the layer
    last wrote REQUESTs from them: Gemini's files and the simulated Gemini node keep the
    same book."""

    def __init__(self) -> None:
        self.tokens: dict[str, float] = {}
        self.changed = False

    def set(self, client: str, tokens: float) -> None:
        """A client's tokens; none, or 0, and it is no longer weighed."""
        before = self.tokens.pop(client, None)
        if math.isfinite(tokens) and tokens > 0:
            self.tokens[client] = float(tokens)
        self.changed |= self.tokens.get(client) != before

    def drop(self, client: str) -> None:
        self.changed |= self.tokens.pop(client, None) is not None

    def taken(self) -> bool:
        """Whether they changed since the last call: the writer's cue to write them."""
        changed, self.changed = self.changed, False
        return changed


REQUEST_PLACES = 4
"""Gemini's file holds fractions to four places (see `_fraction`)."""


def token_requests(weights: Mapping[str, float], reserved: float) -> dict[str, float]:
    """Each client's share of one device by weight, of 1 less what others `reserved`:
    rounded down to the file's places, so the REQUESTs on a device never add up to more than
    1 and gem-schd can honour every one of them."""
    total = sum(weights.values())
    room = min(max(1.0 - reserved, 0.0), 1.0)
    if total <= 0:
        return {}
    scale = 10.0**REQUEST_PLACES
    return {name: math.floor(room * (w / total) * scale) / scale for name, w in weights.items()}


MIN_SHARE_PERCENT = 0.01
"""The file holds a fraction to four places: a smaller share would be written as LIMIT 0,
which stops the client altogether."""


def _check_share(limit: float) -> None:
    if not (math.isfinite(limit) and MIN_SHARE_PERCENT <= limit <= 100.0):
        raise RangeError(
            f"GPU limit {limit} is outside [{MIN_SHARE_PERCENT}, 100] for Gemini's LIMIT"
        )


def _clients(entries: Sequence[Entry]) -> int:
    return sum(isinstance(entry, ClientLine) for entry in entries)
