"""Logging: one line per event that matters, human-readable or JSON.

Events carry their fields as `extra` (event, pod, namespace and values), so the JSON form
has them as keys while the human form reads as a sentence.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter

HUMAN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = (logging.WARNING, logging.INFO, logging.DEBUG)


def setup_logging(verbosity: int, json_format: bool = False, base: int = 0) -> None:
    """`base` is the command's default step in LEVELS; each -v goes one step further."""
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"levelname": "level"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter(HUMAN_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[min(base + verbosity, len(LEVELS) - 1)])


def event(
    logger: logging.Logger, level: int, name: str, message: str, *args: Any, **fields: Any
) -> None:
    """Log one event with its fields attached for the JSON form."""
    logger.log(level, message, *args, extra={"event": name, **fields})
