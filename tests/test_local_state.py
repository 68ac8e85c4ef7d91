"""The state dir: registrations that are broken are skipped, never fatal."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kuscale.local.statedir import StateDir
from kuscale.model import PodSpec


def test_broken_registrations_are_skipped_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = StateDir(tmp_path).ensure()
    state.register(PodSpec(name="good", tokens=10, cgroup="kuscale/good", owned=True), pid=1)
    (state.pods / "torn.json").write_text('{"name": "torn", "tok')
    (state.pods / "sneaky.json").write_text(
        '{"name": "sneaky", "tokens": 10, "cgroup": "kuscale/sneaky", "vgpu_id": "../../etc"}'
    )
    (state.pods / "negative.json").write_text(
        '{"name": "negative", "tokens": -3, "cgroup": "kuscale/negative"}'
    )
    (state.pods / "mismatch.json").write_text(
        '{"name": "other", "tokens": 3, "cgroup": "kuscale/other"}'
    )
    with caplog.at_level(logging.WARNING):
        specs = state.registrations()
    assert list(specs) == ["good"]
    assert specs["good"].owned
    assert len([r for r in caplog.records if "skipping registration" in r.message]) == 4
