"""Log lines: a sentence by default, one JSON object per event with --log-format json."""

from __future__ import annotations

import json
import logging

import pytest

from kuscale.logs import event, setup_logging


def test_json_lines_carry_the_event_fields(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(0, json_format=True, base=1)
    event(
        logging.getLogger("kuscale.monitor"),
        logging.INFO,
        "adopted",
        "pod %s adopted with %d tokens",
        "local/web",
        150,
        pod="web",
        namespace="local",
        tokens=150,
    )
    record = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert record["message"] == "pod local/web adopted with 150 tokens"
    assert record["event"] == "adopted"
    assert record["pod"] == "web"
    assert record["tokens"] == 150
    assert record["level"] == "INFO"


def test_verbosity_steps_like_klog(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(0, base=0)
    logging.getLogger("kuscale").info("hidden")
    setup_logging(1, base=0)
    logging.getLogger("kuscale").info("shown")
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert "INFO kuscale: shown" in err
