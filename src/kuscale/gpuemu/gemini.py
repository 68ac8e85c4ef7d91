"""A Gemini client for the emulated GPU: before each kernel it asks Gemini's pod manager for
time, as Gemini's CUDA hook does before each launch, and runs only within what is granted.

The wire format, from Gemini's `src/comm.h` and `src/comm.cpp` (little-endian, fields packed
back to back, no padding): a request is 80 bytes — `size_t` name length, the name, one NUL,
`int32` request id, `int32` type (REQ_QUOTA = 0), then for REQ_QUOTA two doubles, the
client's overuse and its last kernel burst in ms; a response is 40 bytes — `int32` request id
and, for REQ_QUOTA, a double: the ms of quota left. The pod manager asks the scheduler for a
new quota itself when the one it holds would not cover the next burst, so a request may
block until the scheduler grants one.
"""

from __future__ import annotations

import os
import socket
import struct

from kuscale.model import is_decimal

REQ_QUOTA = 0
REQUEST_BYTES = 80
RESPONSE_BYTES = 40
_HEAD = struct.Struct("<Q")
_TAIL = struct.Struct("<iidd")
_RESPONSE = struct.Struct("<id")
MAX_NAME_BYTES = REQUEST_BYTES - _HEAD.size - 1 - _TAIL.size
"""47: what a quota request has room for; Gemini does not check, so a longer name would
overrun its buffer."""

POD_NAME_ENV = "POD_NAME"
POD_MANAGER_IP_ENV = "POD_MANAGER_IP"
POD_MANAGER_PORT_ENV = "POD_MANAGER_PORT"


class GeminiError(Exception):
    pass


def encode_quota_request(name: str, request_id: int, overuse_ms: float, burst_ms: float) -> bytes:
    raw = name.encode("ascii", errors="replace")
    if not name.isascii() or not 0 < len(raw) <= MAX_NAME_BYTES:
        raise GeminiError(f"Gemini client name {name!r} must be 1-{MAX_NAME_BYTES} ASCII bytes")
    body = (
        _HEAD.pack(len(raw)) + raw + b"\0" + _TAIL.pack(request_id, REQ_QUOTA, overuse_ms, burst_ms)
    )
    return body.ljust(REQUEST_BYTES, b"\0")


def decode_quota_response(data: bytes) -> tuple[int, float]:
    if len(data) != RESPONSE_BYTES:
        raise GeminiError(f"a Gemini response is {RESPONSE_BYTES} bytes, got {len(data)}")
    request_id, quota_ms = _RESPONSE.unpack_from(data)
    return int(request_id), float(quota_ms)


class GeminiGate:
    """One client's connection to its pod manager."""

    def __init__(self, host: str, port: int, name: str, timeout: float = 60.0) -> None:
        self.name = name
        self._next_id = 0
        encode_quota_request(name, 0, 0.0, 0.0)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as err:
            raise GeminiError(f"cannot reach Gemini's pod manager at {host}:{port}: {err}") from err

    def quota_ms(self, burst_ms: float) -> float:
        """The ms this client may still launch kernels for; blocks while the scheduler
        serves others."""
        request_id = self._next_id
        self._next_id += 1
        try:
            self._sock.sendall(encode_quota_request(self.name, request_id, 0.0, burst_ms))
            data = b""
            while len(data) < RESPONSE_BYTES:
                chunk = self._sock.recv(RESPONSE_BYTES - len(data))
                if not chunk:
                    raise GeminiError("Gemini's pod manager closed the connection")
                data += chunk
        except OSError as err:
            raise GeminiError(f"Gemini's pod manager: {err}") from err
        answered, quota = decode_quota_response(data)
        if answered != request_id:
            raise GeminiError(f"Gemini answered request {answered}, not {request_id}")
        return quota

    def close(self) -> None:
        self._sock.close()


def gate_from_environment() -> GeminiGate | None:
    """The pod manager the hook's variables name (POD_MANAGER_IP, default 127.0.0.1, and
    POD_MANAGER_PORT; the client is POD_NAME), or None where no port is set."""
    port = os.environ.get(POD_MANAGER_PORT_ENV)
    if not port:
        return None
    if not is_decimal(port) or not 1 <= int(port) <= 65535:
        raise GeminiError(f"{POD_MANAGER_PORT_ENV}={port!r} is not a TCP port")
    name = os.environ.get(POD_NAME_ENV) or socket.gethostname()
    return GeminiGate(os.environ.get(POD_MANAGER_IP_ENV, "127.0.0.1"), int(port), name)
