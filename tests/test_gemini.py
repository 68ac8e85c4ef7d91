"""Gemini as kuscale's GPU layer: its configuration rewritten in place, its wire protocol, and
the real `gem-schd`/`gem-pmgr` (outside programs, from the folder `KUSCALE_GEMINI_BIN` names)
holding an emulated client to the share kuscale writes, measured through NVML."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import wait_for
from hypothesis import example, given
from hypothesis import strategies as st

from kuscale.backends.base import BackendError, RangeError
from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.backends.gemini import (
    ClientLine,
    GeminiLayer,
    parse_config,
    render_config,
    token_requests,
    validate_client_name,
)
from kuscale.backends.layers import gpu_backend
from kuscale.backends.nvml import NvmlUsage
from kuscale.config import AgentConfig, GpuLayerConfig
from kuscale.deviceplugin.gpulayer import GeminiAllocator, allocator_for
from kuscale.gpuemu.gemini import (
    MAX_NAME_BYTES,
    REQUEST_BYTES,
    GeminiError,
    decode_quota_response,
    encode_quota_request,
)
from kuscale.gpuemu.nvml import EmulatedNvml
from kuscale.local.gemini import GeminiRuntime

CONFIG = "3\nweb 0.1 0.5 1000\nsome garbage line\nother 0 1 2048\n"


def config_dir(tmp_path: Path, text: str = CONFIG, devices: int = 1) -> Path:
    directory = tmp_path / "config"
    directory.mkdir()
    for device in range(devices):
        (directory / str(device)).write_text(text if device == 0 else "0\n")
    return directory


def test_lines_kuscale_cannot_read_are_kept_verbatim_and_counted() -> None:
    entries = parse_config(CONFIG)
    assert entries == [
        ClientLine("web", 0.1, 0.5, 1000),
        "some garbage line",
        ClientLine("other", 0.0, 1.0, 2048),
    ]
    assert render_config(entries) == CONFIG


def test_a_commit_rewrites_only_its_clients_limit_in_place(tmp_path: Path) -> None:
    directory = config_dir(tmp_path, devices=2)
    path = directory / "0"
    inode = path.stat().st_ino
    layer = GeminiLayer(directory, ["0", "1"], None, request="minimum", minimum=10.0)
    assert layer.devices() == (100.0, 100.0)
    assert layer.device_of("web") == 0
    assert layer.read_limit("web") == pytest.approx(50.0)
    layer.write_limit("web", 25.0)
    untouched = (directory / "1").stat().st_mtime_ns
    layer.commit()
    assert path.read_text() == "3\nweb 0.1 0.25 1000\nsome garbage line\nother 0 1 2048\n"
    assert path.stat().st_ino == inode, "rewritten in place: gem-schd misses a rename"
    assert (directory / "1").stat().st_mtime_ns == untouched
    layer.write_limit("web", 5.0)
    layer.commit()
    assert "web 0.05 0.05 1000" in path.read_text(), "REQUEST never above LIMIT"
    layer.remove("web")
    layer.commit()
    assert path.read_text() == "2\nsome garbage line\nother 0 1 2048\n"
    assert not layer.exists("web")


def test_requests_share_each_device_by_tokens_beside_what_others_reserve(
    tmp_path: Path,
) -> None:
    """REQUEST is each weighted client's token share of what unmanaged clients leave, never
    above its LIMIT; a weight that goes or a client that leaves reshares the device."""
    directory = config_dir(tmp_path, "2\nweb 0 0.9 1000\nother 0.1 1 2048\n", devices=2)
    layer = GeminiLayer(directory, ["0", "1"], None)
    assert layer.weighted
    layer.place("batch", 1000, device=0, limit=30.0)
    layer.place("alone", 1000, device=1)
    for client, tokens in (("web", 200.0), ("batch", 100.0), ("alone", 50.0)):
        layer.weigh(client, tokens)
    layer.commit()
    assert parse_config((directory / "0").read_text()) == [
        ClientLine("web", 0.6, 0.9, 1000),
        ClientLine("other", 0.1, 1.0, 2048),
        ClientLine("batch", 0.3, 0.3, 1000),
    ]
    assert (directory / "1").read_text() == "1\nalone 1 1 1000\n"
    layer.write_limit("batch", 20.0)
    layer.commit()
    assert "batch 0.2 0.2 1000" in (directory / "0").read_text(), "REQUEST never above LIMIT"
    layer.weigh("batch", 0.0)
    layer.commit()
    assert "web 0.7 0.9 1000" in (directory / "0").read_text(), "batch's REQUEST is reserved"
    layer.weigh("batch", 100.0)
    layer.remove("web")
    layer.commit()
    assert (directory / "0").read_text() == "2\nother 0.1 1 2048\nbatch 0.2 0.2 1000\n"


def test_a_device_reserved_by_others_gives_weighted_clients_request_0(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = config_dir(tmp_path, "2\nweb 0 0.9 1000\nother 1 1 2048\n")
    layer = GeminiLayer(directory, ["0"], None)
    layer.weigh("web", 100.0)
    layer.commit()
    assert "web 0 0.9 1000" in (directory / "0").read_text()
    assert "reserve 1 of a GPU with web" in caplog.text


def test_layers_that_keep_or_set_the_minimum_ignore_weights(tmp_path: Path) -> None:
    directory = config_dir(tmp_path)
    for rule in ("keep", "minimum"):
        layer = GeminiLayer(directory, ["0"], None, request=rule, minimum=10.0)
        assert not layer.weighted
        layer.weigh("web", 500.0)
        layer.commit()
        assert (directory / "0").read_text() == CONFIG
    with pytest.raises(BackendError, match="REQUEST rule"):
        GeminiLayer(directory, ["0"], None, request="all")


@given(
    st.dictionaries(
        st.text("abc", min_size=1, max_size=3),
        st.floats(0.0, 1e6, allow_nan=False),
        max_size=6,
    ),
    st.floats(-1.0, 2.0, allow_nan=False),
)
@example({"a": 5e-324}, 0.25)  # room × w underflowed, and w / total then gave the whole device
def test_token_requests_never_promise_more_than_the_device_has(
    weights: dict[str, float], reserved: float
) -> None:
    requests = token_requests(weights, reserved)
    assert all(0.0 <= r <= 1.0 for r in requests.values())
    assert sum(requests.values()) <= min(max(1.0 - reserved, 0.0), 1.0) + 1e-9
    heavy = [n for n, w in weights.items() if w > 0]
    for a in heavy:
        for b in heavy:
            if weights[a] >= weights[b]:
                assert requests[a] >= requests[b]


def test_an_unchanged_file_is_not_written(tmp_path: Path) -> None:
    directory = config_dir(tmp_path)
    layer = GeminiLayer(directory, ["0"], None)
    before = (directory / "0").stat().st_mtime_ns
    layer.write_limit("web", 50.0)
    layer.commit()
    assert (directory / "0").stat().st_mtime_ns == before


@pytest.mark.parametrize("limit", [0.0, -5.0, 100.5, float("nan"), float("inf")])
def test_a_limit_outside_gemini_range_is_refused_before_staging(
    tmp_path: Path, limit: float
) -> None:
    layer = GeminiLayer(config_dir(tmp_path), ["0"], None)
    with pytest.raises(RangeError):
        layer.write_limit("web", limit)
    layer.commit()
    assert (tmp_path / "config" / "0").read_text() == CONFIG


@pytest.mark.parametrize("name", ["two words", "x" * 63, "", "tab\there", "naïve"])
def test_client_names_gemini_cannot_hold_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(BackendError, match="Gemini client name"):
        validate_client_name(name)
    layer = GeminiLayer(config_dir(tmp_path), ["0"], None)
    with pytest.raises(BackendError):
        layer.write_limit(name, 50.0)


def test_missing_clients_files_and_escaping_names_are_errors(tmp_path: Path) -> None:
    directory = config_dir(tmp_path)
    with pytest.raises(BackendError, match="not allowed"):
        GeminiLayer(directory, ["../etc"], None)
    layer = GeminiLayer(directory, ["0", "7"], None)
    with pytest.raises(BackendError, match="in no GPU configuration"):
        layer.device_of("nobody")
    with pytest.raises(BackendError, match="no GPU usage source"):
        layer.read("web")
    (directory / "0").chmod(0o444)
    layer.write_limit("web", 30.0)
    if os.geteuid() != 0:
        with pytest.raises(BackendError, match="cannot open"):
            layer.commit()


def test_the_quota_request_has_geminis_exact_layout() -> None:
    message = encode_quota_request("ns/pod", 7, 1.5, 12.25)
    assert len(message) == REQUEST_BYTES
    (length,) = struct.unpack_from("<Q", message)
    assert length == 6 and message[8:14] == b"ns/pod" and message[14] == 0
    assert struct.unpack_from("<iidd", message, 15) == (7, 0, 1.5, 12.25)
    response = struct.pack("<id", 7, 33.5).ljust(40, b"\0")
    assert decode_quota_response(response) == (7, 33.5)
    with pytest.raises(GeminiError, match="40 bytes"):
        decode_quota_response(response[:39])
    with pytest.raises(GeminiError, match="ASCII"):
        encode_quota_request("x" * (MAX_NAME_BYTES + 1), 0, 0.0, 0.0)


def test_the_emulated_nvml_has_pynvmls_names_and_shapes() -> None:
    pynvml = pytest.importorskip("pynvml")
    for name in (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetProcessUtilization",
        "nvmlDeviceGetProcessesUtilizationInfo",
    ):
        assert callable(getattr(pynvml, name)) and callable(getattr(EmulatedNvml, name))
    for name in ("NVML_ERROR_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED"):
        assert getattr(pynvml, name) == getattr(EmulatedNvml, name)
    assert pynvml.NVML_ERROR_FUNCTION_NOT_FOUND == EmulatedNvml.NVML_ERROR_FUNCTION_NOT_FOUND
    fields = {name for name, _ in pynvml.c_nvmlProcessUtilizationSample_t._fields_}
    assert fields == {"pid", "timeStamp", "smUtil", "memUtil", "encUtil", "decUtil"}
    newer = {name for name, _ in pynvml.c_nvmlProcessUtilizationInfo_v1_t._fields_}
    assert {"pid", "timeStamp", "smUtil"} <= newer


@dataclass
class EmulatedGpu:
    socket: Path
    state: Path


@pytest.fixture
def emulated_gpu(tmp_path: Path) -> Iterator[EmulatedGpu]:
    """The GPU emulator as the GPU behind Gemini: no shares of its own, two devices."""
    state = tmp_path / "state"
    process = subprocess.Popen(
        [*_kuscale(), "gpu-emulator", "--state-dir", str(state), "--devices", "2", "--no-enforce"]
    )
    socket = state / "gpu.sock"
    try:
        wait_for(lambda: socket.exists() or process.poll() is not None, timeout=20, interval=0.05)
        assert process.poll() is None, "the emulator exited"
        yield EmulatedGpu(socket, state)
    finally:
        process.terminate()
        process.wait(timeout=10)


def _kuscale() -> list[str]:
    return [sys.executable, "-m", "kuscale"]


def _start_client(
    gpu: EmulatedGpu,
    name: str,
    device: int,
    cgroups: CgroupV1 | CgroupV2,
    cgroup: str,
    gemini_port: int | None = None,
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "KUSCALE_GPU_SOCKET": str(gpu.socket),
        "KUSCALE_VGPU_ID": name,
        "KUSCALE_GPU_DEVICE": str(device),
        "POD_NAME": name,
    }
    if gemini_port is not None:
        env["POD_MANAGER_PORT"] = str(gemini_port)
    cgroups.create(cgroup)
    command = [*_kuscale(), "workload", "--cpu", "0:0", "--gpu", "0:100", "--duration", "60"]
    process = subprocess.Popen(command, env=env)
    cgroups.attach(cgroup, process.pid)
    return process


def _share(read: Callable[[], int], seconds: float) -> float:
    """Busy seconds per second of the client over a window, read through `read()`."""
    return _shares(lambda: {"client": read()}, seconds)["client"]


def _sampled(usage: NvmlUsage) -> bool:
    """Polls once; True once a poll found samples (however it attributed them)."""
    before = list(usage.last_seen)
    usage.poll()
    return usage.last_seen != before


def test_nvml_over_the_emulator_measures_each_process_on_its_device(
    tmp_path: Path,
    emulated_gpu: EmulatedGpu,
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    cgroups, parent = real_cgroups
    client = _start_client(emulated_gpu, "solo", 1, cgroups, f"{parent}/solo")
    try:
        usage = NvmlUsage(EmulatedNvml(emulated_gpu.socket), cgroups.mode)
        assert usage.devices == 2

        def busy(device: int) -> int:
            usage.poll()
            return usage.busy_ns(f"{parent}/solo", device)

        wait_for(lambda: busy(1) > 0, timeout=20)
        share = _share(lambda: busy(1), 3.0)
        assert 0.6 < share < 1.15, f"a client alone on GPU 1 measured {share:.2f}"
        assert busy(0) == 0
        assert usage.busy_ns(f"{parent}/other", 1) == 0
        gone = NvmlUsage(EmulatedNvml(emulated_gpu.socket), cgroups.mode, tmp_path / "no-proc")
        wait_for(lambda: _sampled(gone), timeout=10)
        assert gone.busy_ns(f"{parent}/solo", 1) == 0, "a pid without /proc entry is skipped"
    finally:
        client.kill()
        client.wait()


def test_an_unreachable_nvml_is_a_clear_error(tmp_path: Path) -> None:
    nvml = EmulatedNvml(tmp_path / "no-such.sock")
    with pytest.raises(BackendError, match="NVML"):
        NvmlUsage(nvml, "cgroup-v1")


def test_real_gemini_holds_a_client_to_the_share_kuscale_writes(
    gemini_bin: Path,
    emulated_gpu: EmulatedGpu,
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
) -> None:
    """kuscale changes a live client's LIMIT in the file and gem-schd holds the client to
    it, measured through NVML. The client asks gem-schd itself (see
    `GeminiRuntime.add_client` for why no pod manager stands between them)."""
    cgroups, parent = real_cgroups
    cgroup = f"{parent}/trainer"
    runtime = GeminiRuntime(gemini_bin, emulated_gpu.state / "gemini" / "config", devices=2)
    runtime.start()
    client = None
    try:
        port = runtime.add_client("trainer", device=1, limit=50.0)
        client = _start_client(emulated_gpu, "trainer", 1, cgroups, cgroup, port)
        usage = NvmlUsage(EmulatedNvml(emulated_gpu.socket), cgroups.mode)
        layer = GeminiLayer(runtime.config_dir, runtime.files(), usage)
        layer.track("trainer", cgroup)
        assert layer.device_of("trainer") == 1

        def busy() -> int:
            layer.commit()
            return layer.read("trainer")

        wait_for(lambda: busy() > 0, timeout=30)
        shares = {}
        for limit in (50.0, 20.0, 80.0):
            layer.write_limit("trainer", limit)
            layer.commit()
            _share(busy, 2.0)  # Gemini's window is one second: let it pass
            shares[limit] = _share(busy, 4.0)
        assert shares[50.0] == pytest.approx(0.5, abs=0.12), shares
        assert shares[20.0] == pytest.approx(0.2, abs=0.08), shares
        assert shares[80.0] == pytest.approx(0.8, abs=0.15), shares
        assert shares[20.0] < shares[50.0] < shares[80.0]
    finally:
        if client is not None:
            client.kill()
            client.wait()
        runtime.stop()
    assert runtime.processes and all(p.poll() is not None for p in runtime.processes)


def test_real_gemini_shares_a_gpu_by_the_tokens_kuscale_writes(
    gemini_bin: Path,
    emulated_gpu: EmulatedGpu,
    real_cgroups: tuple[CgroupV1 | CgroupV2, str],
    record_property: Callable[[str, object], None],
) -> None:
    """REQUEST from tokens makes gem-schd the GPU's cpu.shares: two busy clients whose
    tokens are 2:1, each with a LIMIT of 90 %, receive about 2:1; when one stops, the other
    receives the device up to its LIMIT."""
    cgroups, parent = real_cgroups
    runtime = GeminiRuntime(gemini_bin, emulated_gpu.state / "gemini" / "config", devices=1)
    runtime.start()
    tokens = {"big": 200.0, "small": 100.0}
    clients: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in tokens:
            port = runtime.add_client(name, device=0, limit=100.0)
            clients[name] = _start_client(emulated_gpu, name, 0, cgroups, f"{parent}/{name}", port)
        usage = NvmlUsage(EmulatedNvml(emulated_gpu.socket), cgroups.mode)
        layer = GeminiLayer(runtime.config_dir, runtime.files(), usage)
        for name, pod_tokens in tokens.items():
            layer.track(name, f"{parent}/{name}")
            layer.weigh(name, pod_tokens)
            layer.write_limit(name, 90.0)
        layer.commit()
        assert "big 0.6666 0.9" in (runtime.config_dir / "0").read_text()

        def busy() -> dict[str, int]:
            layer.commit()
            return {name: layer.read(name) for name in tokens}

        wait_for(lambda: all(busy().values()), timeout=30)
        _shares(busy, 2.0)  # Gemini's window is one second: let it pass
        both = _shares(busy, 6.0)
        clients.pop("small").kill()
        _shares(busy, 2.0)
        alone = _shares(busy, 4.0)["big"]
        record_property("measured", f"gem-schd 2:1 tokens: {both}, alone {alone:.2f}")
        assert both["big"] / both["small"] == pytest.approx(2.0, rel=0.3), both
        assert alone == pytest.approx(0.9, abs=0.15), alone
        assert alone > both["big"] + 0.1, "what the stopped client leaves goes to the other"
    finally:
        for client in clients.values():
            client.kill()
            client.wait()
        runtime.stop()


def _shares(read: Callable[[], dict[str, int]], seconds: float) -> dict[str, float]:
    """Busy seconds per second of each client over a window."""
    before, started = read(), time.monotonic()
    wait_for(lambda: time.monotonic() - started >= seconds, timeout=seconds + 5, interval=0.1)
    after, elapsed = read(), time.monotonic() - started
    return {name: (after[name] - before[name]) / 1e9 / elapsed for name in before}


def test_a_share_changes_in_whole_points_and_rises_only_by_a_step(tmp_path: Path) -> None:
    """Every rewrite makes gem-schd reload; the held share never exceeds what was asked."""
    layer = GeminiLayer(config_dir(tmp_path), ["0"], None, step=5.0)
    assert layer.quantize("web", 33.7, None) == 33.0
    assert layer.quantize("web", 36.9, 33.0) == 33.0
    assert layer.quantize("web", 38.2, 33.0) == 38.0
    assert layer.quantize("web", 20.5, 33.0) == 20.0
    assert layer.quantize("web", 0.4, None) == pytest.approx(0.4)


def test_allocate_places_a_client_on_the_emptiest_gpu_and_names_it_to_the_hook(
    tmp_path: Path,
) -> None:
    directory = config_dir(tmp_path, devices=2)
    config = GpuLayerConfig(
        kind="gemini",
        gpus=2,
        gemini_dir=str(directory),
        pod_manager="127.0.0.1:50052",
        hook_library="/usr/local/lib/libgemhook.so.1",
    ).validate()
    layer = GeminiLayer(directory, config.files(), None)
    allocator = allocator_for(config, layer)
    assert isinstance(allocator, GeminiAllocator)
    answer = allocator.allocate(["token-3", "token-4"])
    assert answer.envs["POD_NAME"] == "kuscale-3"
    assert answer.envs["KUSCALE_GPU_DEVICE"] == "1"
    assert answer.envs["LD_PRELOAD"] == "/usr/local/lib/libgemhook.so.1"
    assert answer.envs["POD_MANAGER_PORT"] == "50052"
    assert (directory / "1").read_text() == f"1\nkuscale-3 0 1 {config.gemini_memory}\n"
    allocator.allocate(["token-3"])
    assert layer.device_of("kuscale-3") == 1
    assert (directory / "1").read_text().count("kuscale-3") == 1, "a stale line is replaced"


def test_the_configured_gemini_layer_says_what_is_missing(tmp_path: Path) -> None:
    config = AgentConfig(
        gpu_layer=GpuLayerConfig(kind="gemini", gemini_dir=str(tmp_path), usage="emulator")
    )
    with pytest.raises(BackendError, match="emulator's socket"):
        gpu_backend(config, "cgroup-v1")
    with pytest.raises(BackendError, match="NVML"):
        gpu_backend(config, "cgroup-v1", tmp_path / "no-emulator.sock")
    nvml = AgentConfig(gpu_layer=GpuLayerConfig(kind="gemini", gemini_dir=str(tmp_path)))
    with pytest.raises(BackendError, match="NVML"):
        gpu_backend(nvml, "cgroup-v1")
