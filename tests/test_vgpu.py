"""The vGPU layer layout: per-id directories, per-mille limits, one Gemini reload per tick."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuscale.backends.base import BackendError, CounterError, RangeError
from kuscale.backends.vgpu import RELOAD_FILE, VgpuLayer


@pytest.fixture
def layer(tmp_path: Path) -> VgpuLayer:
    layer = VgpuLayer(tmp_path / "vgpu")
    layer.create("pod-1")
    return layer


def test_create_allows_the_whole_gpu(layer: VgpuLayer) -> None:
    assert layer.read("pod-1") == 0
    assert layer.read_limit("pod-1") is None


def test_limit_is_written_as_per_mille_to_limit_and_request(layer: VgpuLayer) -> None:
    layer.write_limit("pod-1", 42.5)
    directory = layer.root / "pod-1"
    assert (directory / "gpu_limit").read_text() == "425"
    assert (directory / "gpu_request").read_text() == "425"
    assert layer.read_limit("pod-1") == pytest.approx(42.5)


def test_commit_pokes_the_reload_file_once_and_only_after_a_write(layer: VgpuLayer) -> None:
    reload_file = layer.root / RELOAD_FILE
    layer.commit()
    assert not reload_file.exists()
    layer.write_limit("pod-1", 30.0)
    layer.commit()
    assert reload_file.read_text() == "0"
    reload_file.unlink()
    layer.commit()
    assert not reload_file.exists()


@pytest.mark.parametrize("limit", [0.0, -1.0, 100.5, float("nan")])
def test_out_of_range_gpu_limits_are_refused(layer: VgpuLayer, limit: float) -> None:
    with pytest.raises(RangeError):
        layer.write_limit("pod-1", limit)


@pytest.mark.parametrize("vgpu_id", ["../x", "a/b", "..", ".", "", "a b"])
def test_bad_vgpu_ids_never_reach_the_filesystem(layer: VgpuLayer, vgpu_id: str) -> None:
    with pytest.raises(BackendError):
        layer.write_limit(vgpu_id, 10.0)
    with pytest.raises(BackendError):
        layer.create(vgpu_id)


def test_garbage_runtime_is_a_counter_error(layer: VgpuLayer) -> None:
    (layer.root / "pod-1" / "total_runtime").write_text("n/a")
    with pytest.raises(CounterError):
        layer.read("pod-1")


def test_remove_deletes_the_directory(layer: VgpuLayer) -> None:
    layer.remove("pod-1")
    assert not layer.exists("pod-1")
    layer.remove("pod-1")


def test_remove_tries_again_when_the_layer_publishes_busy_time_meanwhile(
    layer: VgpuLayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer's flush lands between kuscale's unlinks and its rmdir, once: the real rmdir
    then fails with ENOTEMPTY, and the next try removes what the flush wrote."""
    real_rmdir = Path.rmdir
    flushes: list[Path] = []

    def flush_first(directory: Path) -> None:
        if not flushes:
            flushes.append(directory / "total_runtime")
            flushes[0].write_text("5")
        real_rmdir(directory)

    monkeypatch.setattr(Path, "rmdir", flush_first)
    layer.remove("pod-1")
    assert flushes
    assert not layer.exists("pod-1")


def test_remove_leaves_a_file_it_did_not_make_and_says_so(layer: VgpuLayer) -> None:
    foreign = layer.root / "pod-1" / "notes"
    foreign.write_text("kept")
    with pytest.raises(BackendError, match="cannot remove vGPU pod-1"):
        layer.remove("pod-1")
    assert foreign.read_text() == "kept"
    assert not (layer.root / "pod-1" / "gpu_limit").exists()
