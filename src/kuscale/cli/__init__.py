"""The `kuscale` command, one module per command or close group: each holds its parser and
its handler; `entry` puts them together."""

from kuscale.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
