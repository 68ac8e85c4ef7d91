"""The fuzz targets' short profile: `make fuzz` runs a million inputs, `make test` these."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

from targets import Tally, replay, run

CORPUS = Path(__file__).resolve().parent.parent / "fuzz" / "corpus"

SHORT_PROFILE = 2000


def test_no_input_crashes_kuscale_or_makes_it_write_an_invalid_value() -> None:
    tally = run(SHORT_PROFILE)
    assert tally.inputs >= SHORT_PROFILE * 0.9, (tally.inputs, tally.examples)
    assert tally.crashes == 0, tally.examples
    assert tally.invalid_writes == 0, tally.examples


def test_every_input_the_guided_fuzzer_kept_replays_without_a_finding() -> None:
    tally = Tally()
    played = replay(CORPUS, tally)
    assert played >= len([p for p in CORPUS.iterdir() if p.is_dir()])
    assert tally.crashes == 0, tally.examples
    assert tally.invalid_writes == 0, tally.examples


def test_a_corpus_file_that_cannot_be_read_is_skipped_with_its_name(tmp_path: Path) -> None:
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "kept").write_bytes(b"some total=12")
    (tmp_path / "pressure" / "gone").symlink_to(tmp_path / "nowhere")
    tally = Tally()
    with pytest.warns(UserWarning, match="skipping corpus file .*gone"):
        assert replay(tmp_path, tally) == 1
    assert tally.crashes == 0


def test_a_corpus_folder_no_target_has_is_reported(tmp_path: Path) -> None:
    (tmp_path / "retired").mkdir()
    tally = Tally()
    assert replay(tmp_path, tally) == 0
    assert tally.crashes == 1
    assert "retired" in tally.examples[0]
