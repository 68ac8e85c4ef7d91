"""docs/commands.md against the parser: every command has a row, and every long option of a
command is named in its rows, so the reference cannot fall behind the CLI."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kuscale.cli import build_parser

PAGE = Path(__file__).resolve().parent.parent / "docs" / "commands.md"


def commands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def usage_rows(command: str) -> str:
    """The first cells of the page's rows for one command (`kuscale COMMAND ...`), where a
    `\\|` inside the cell is a pipe, not its end."""
    cell = rf"^\| (`kuscale {re.escape(command)}\b(?:[^|\\]|\\.)*)\|"
    cells = re.findall(cell, PAGE.read_text(), re.MULTILINE)
    return "\n".join(cells)


def undocumented(command: str, parser: argparse.ArgumentParser) -> list[str]:
    rows = usage_rows(command)
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    return [o for o in options if o != "--help" and not re.search(rf"{o}(?![\w-])", rows)]


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_command_and_option_is_on_the_page(command: str) -> None:
    assert usage_rows(command), f"docs/commands.md has no row for `kuscale {command}`"
    assert undocumented(command, commands()[command]) == []


def test_an_option_named_only_as_part_of_another_is_missing() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record")
    parser.add_argument("--record-dir")
    assert undocumented("agent", parser) == []
    parser.add_argument("--no-such-option")
    assert undocumented("agent", parser) == ["--no-such-option"]
