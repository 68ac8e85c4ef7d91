"""What the coverage-guided fuzzer found, each kept as a regression test: digits that
`str.isdigit` takes and `int` refuses ("²", "①"), and status files the views could not show."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import V2_FILES, write_files

from kuscale import faults
from kuscale.backends.base import BackendError
from kuscale.backends.cgroup import CgroupV2
from kuscale.backends.files import parse_int, parse_keyed
from kuscale.backends.pressure import parse_pressure
from kuscale.cli import main

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
