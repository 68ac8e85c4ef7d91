"""The fuzz targets' short profile: `make fuzz` runs a million inputs, `make test` these."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

from targets import run

SHORT_PROFILE = 2000


def test_no_input_crashes_kuscale_or_makes_it_write_an_invalid_value() -> None:
    tally = run(SHORT_PROFILE)
    assert tally.inputs >= SHORT_PROFILE * 0.9
    assert tally.crashes == 0, tally.examples
    assert tally.invalid_writes == 0, tally.examples
