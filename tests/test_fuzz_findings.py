"""What the coverage-guided fuzzer found, each kept as a regression test: digits that
`str.isdigit` takes and `int` refuses ("²", "①"), status files the views could not show,
descriptors a dropped backend kept, config paths and texts read without a clear error, and a
Gemini share too small for the file's four places."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
from conftest import V2_FILES, write_files

from kuscale import faults
from kuscale.backends.base import BackendError
from kuscale.backends.cgroup import CgroupV1, CgroupV2
from kuscale.backends.files import parse_int, parse_keyed
from kuscale.backends.gemini import GeminiLayer
from kuscale.backends.pressure import parse_pressure
from kuscale.cli import main
from kuscale.config import ConfigError, load_config

ODD_DIGITS = ["²", "①", "١", "１"]
"""Superscript two, circled one, Arabic-Indic one, fullwidth one."""


@pytest.mark.parametrize("digit", ODD_DIGITS)
def test_a_pressure_total_of_odd_digits_is_no_total(digit: str) -> None:
    with pytest.raises(BackendError, match=r"no 'some \.\.\. total=N' line"):
        parse_pressure(f"some avg10=0.00 total={digit}\n", "cpu.pressure")
    assert parse_pressure(f"some total=7\nfull total={digit}\n", "p").some_total_us == 7


@pytest.mark.parametrize("digit", ODD_DIGITS)
def test_counters_of_odd_digits_are_refused_by_name(digit: str) -> None:
    with pytest.raises(BackendError, match=r"cpuacct\.usage"):
        parse_int(f"{digit}\n", "cpuacct.usage")
    with pytest.raises(BackendError, match=r"cpu\.stat"):
        parse_keyed(f"usage_usec {digit}\n", "cpu.stat")


@pytest.mark.parametrize("cpu_max", ["max ²", "² 100000", "１０００ 100000"])
def test_a_cpu_max_of_odd_digits_is_refused_by_name(tmp_path: Path, cpu_max: str) -> None:
    write_files(tmp_path, {"cgroup.subtree_control": "", "cgroup.controllers": "cpu"})
    write_files(tmp_path / "pods" / "a", {**V2_FILES, "cpu.max": cpu_max})
    with pytest.raises(BackendError, match=r"cpu\.max"):
        CgroupV2(tmp_path, tmp_path).read_limit("pods/a")


def test_a_fault_pass_of_odd_digits_is_refused() -> None:
    with pytest.raises(faults.FaultError, match="a number >= 1"):
        faults.parse("tick.sampled:²")


@pytest.mark.parametrize(
    "status", ["[]", '{"time": null, "pods": []}', '{"pods": [{"name": 1}]}', "\xad"]
)
@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["top", "--once"]])
def test_a_status_kuscale_cannot_show_is_said_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], status: str, command: list[str]
) -> None:
    (tmp_path / "status.json").write_text(status)
    assert main([command[0], "--state-dir", str(tmp_path), *command[1:]]) == 2
    error = capsys.readouterr().err
    assert "status" in error and "Traceback" not in error


def test_a_backend_dropped_closes_the_descriptors_it_kept(v1_tree: CgroupV1) -> None:
    """The fuzzer ran out of descriptors after 14,000 monitors over fixture trees."""
    opened = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        CgroupV1(v1_tree.cpu_root, v1_tree.usage_root).read("pods/a")
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= opened + 2


@pytest.mark.parametrize("path", ["\x00", "config\x00.toml"])
def test_a_config_path_the_system_cannot_open_is_a_config_error(path: str) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(Path(path))


def test_a_config_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "agent.toml").write_bytes(b"[agent]\nperiod = \xff\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "agent.toml")


@pytest.mark.parametrize("limit", [4.7e-290, 0.004])
def test_a_gemini_share_below_the_files_resolution_is_refused(tmp_path: Path, limit: float) -> None:
    """Written, it would read LIMIT 0, which stops the client altogether."""
    (tmp_path / "0").write_text("1\nweb 0.5 0.5 1024\n")
    layer = GeminiLayer(tmp_path, ["0"], None)
    with pytest.raises(BackendError, match="Gemini's LIMIT"):
        layer.write_limit("web", limit)
    layer.commit()
    assert (tmp_path / "0").read_text() == "1\nweb 0.5 0.5 1024\n"
