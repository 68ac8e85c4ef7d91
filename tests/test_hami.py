"""HAMi, read-only: regions laid out by ctypes from HAMi-core's own C declarations (so the
offsets kuscale reads are checked against the C compiler's rules, not against themselves),
measured into busy time and charged at HAMi's fixed share; bad regions are refused."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import pytest
from conftest import wait_for

from kuscale.backends.base import BackendError
from kuscale.backends.hami import (
    READY,
    REGION_BYTES,
    SLOT_BYTES,
    SLOTS_AT,
    SM_LIMITS_AT,
    HamiLayer,
    parse_region,
)

DEVICES = 16
SLOTS = 1024


class DeviceMemory(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("context", "module", "data", "offset", "total")]
    _fields_ += [("unused", ctypes.c_uint64 * 3)]


class DeviceUtil(ctypes.Structure):
    _fields_ = [
        ("dec_util", ctypes.c_uint64),
        ("enc_util", ctypes.c_uint64),
        ("sm_util", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 3),
    ]


class ProcSlot(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_int32),
        ("hostpid", ctypes.c_int32),
        ("used", DeviceMemory * DEVICES),
        ("monitorused", ctypes.c_uint64 * DEVICES),
        ("device_util", DeviceUtil * DEVICES),
        ("status", ctypes.c_int32),
        ("seqlock", ctypes.c_uint64),
        ("unused", ctypes.c_uint64 * 2),
    ]


class SharedRegion(ctypes.Structure):
    _fields_ = [
        ("initialized_flag", ctypes.c_int32),
        ("major_version", ctypes.c_uint32),
        ("minor_version", ctypes.c_uint32),
        ("sm_init_flag", ctypes.c_int32),
        ("owner_pid", ctypes.c_size_t),
        ("sem", ctypes.c_uint64 * 4),  # glibc's sem_t on x86-64: 32 bytes, 8-aligned
        ("device_num", ctypes.c_uint64),
        ("uuids", (ctypes.c_char * 96) * DEVICES),
        ("limit", ctypes.c_uint64 * DEVICES),
        ("sm_limit", ctypes.c_uint64 * DEVICES),
        ("procs", ProcSlot * SLOTS),
        ("proc_num", ctypes.c_int),
        ("utilization_switch", ctypes.c_int),
        ("recent_kernel", ctypes.c_int),
        ("priority", ctypes.c_int),
        ("last_kernel_time", ctypes.c_uint64),
        ("sem_postinit", ctypes.c_uint64 * 4),
    ]


def region(
    sm_limit: int = 30, utils: tuple[int, ...] = (20, 15), devices: int = 1, major: int = 1
) -> SharedRegion:
    shared = SharedRegion()
    shared.initialized_flag, shared.major_version, shared.minor_version = READY, major, 2
    shared.device_num = devices
    shared.sm_limit[0] = sm_limit
    for slot, util in enumerate(utils):
        shared.procs[slot].pid = 100 + slot
        shared.procs[slot].hostpid = 5000 + slot
        shared.procs[slot].device_util[0].sm_util = util
    shared.procs[len(utils)].device_util[0].sm_util = 99  # a freed slot: pid 0
    return shared


def write(root: Path, client: str, shared: SharedRegion | bytes) -> Path:
    directory = root / client
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "3f2a9c1e-uuid.cache"
    path.write_bytes(bytes(shared))
    return path


def test_the_layout_matches_hamis_c_declarations() -> None:
    assert ctypes.sizeof(ProcSlot) == SLOT_BYTES
    assert SharedRegion.sm_limit.offset == SM_LIMITS_AT
    assert SharedRegion.procs.offset == SLOTS_AT
    assert SharedRegion.proc_num.offset == REGION_BYTES
    parsed = parse_region(bytes(region()), "test")
    assert parsed.devices == 1
    assert parsed.sm_limits == (30,)
    assert parsed.sm_util == (35,), "live slots summed, the freed one left out"


def test_use_is_integrated_and_the_fixed_share_is_what_is_charged(tmp_path: Path) -> None:
    client = "0f8e7d6c-1111-2222-3333-444455556666_trainer"
    path = write(tmp_path, client, region())
    layer = HamiLayer(tmp_path, gpus=1)
    assert layer.exists(client)
    assert layer.read_limit(client) == 30.0
    assert layer.quantize(client, 80.0, None) == 30.0
    before, started = layer.read(client), time.monotonic()
    wait_for(lambda: time.monotonic() - started > 0.5, timeout=5, interval=0.05)
    busy = (layer.read(client) - before) / 1e9 / (time.monotonic() - started)
    assert busy == pytest.approx(0.35, rel=0.1)
    layer.write_limit(client, 80.0)
    layer.commit()
    assert path.read_bytes() == bytes(region()), "HAMi is never written"
    write(tmp_path, "unlimited_c", region(sm_limit=0))
    assert layer.read_limit("unlimited_c") is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (bytes(region())[:4096], "bytes, a HAMi region has"),
        (bytes(4) + bytes(region())[4:], "not an initialised"),
        (bytes(region(major=2)), "version 2.2 is not supported"),
        (bytes(region(devices=0)), "0 devices"),
        (bytes(region(devices=17)), "17 devices"),
        (bytes(region(sm_limit=150)), "above 100"),
    ],
)
def test_a_region_not_shaped_like_hamis_is_refused(
    tmp_path: Path, data: bytes, message: str
) -> None:
    write(tmp_path, "pod_c", data)
    with pytest.raises(BackendError, match=message):
        HamiLayer(tmp_path).read("pod_c")


def test_missing_regions_and_escaping_names_are_errors(tmp_path: Path) -> None:
    layer = HamiLayer(tmp_path)
    (tmp_path / "empty_c").mkdir()
    with pytest.raises(BackendError, match="no HAMi region"):
        layer.read("empty_c")
    with pytest.raises(BackendError, match="cannot list"):
        layer.read("gone_c")
    with pytest.raises(BackendError):
        layer.read("../etc")
