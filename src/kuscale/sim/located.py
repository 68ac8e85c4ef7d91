"""YAML read with the line of every value, so a bad scenario is an error naming its file,
line and field rather than a traceback from deep inside the simulator."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml


class ScenarioError(ValueError):
    """A scenario (or its CSV trace) that cannot be simulated, with where the fault is."""


@dataclass(frozen=True, slots=True)
class Source:
    """Where a document came from, and the line of every value by its field path."""

    file: str
    lines: dict[str, int]

    def fail(self, path: str, message: str) -> NoReturn:
        line = self.lines.get(path)
        where = f"{self.file}:{line}" if line else self.file
        raise ScenarioError(f"{where}: {path or 'document'}: {message}")


def read_yaml(path: Path) -> tuple[Any, Source]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ScenarioError(f"cannot read scenario {path}: {err.strerror}") from err
    return parse_yaml(text, str(path))


def parse_yaml(text: str, name: str) -> tuple[Any, Source]:
    """Plain Python values plus a Source mapping each field path to its 1-based line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{name}:{mark.line + 1}" if mark else name
        raise ScenarioError(f"{where}: not valid YAML: {getattr(err, 'problem', err)}") from err
    source = Source(name, {})
    if node is None:
        source.fail("", "the scenario is empty")
    return _plain(node, "", source), source


def _plain(node: yaml.Node, path: str, source: Source) -> Any:
    source.lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        result: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child = f"{path}.{key}" if path else key
            if key in result:
                source.lines[child] = key_node.start_mark.line + 1
                source.fail(child, "appears twice")
            result[key] = _plain(value_node, child, source)
        return result
    if isinstance(node, yaml.SequenceNode):
        return [_plain(item, f"{path}[{i}]", source) for i, item in enumerate(node.value)]
    return yaml.SafeLoader("").construct_object(node)


MISSING: Any = object()


class Section:
    """One YAML mapping being read: typed getters, and unknown keys as an error."""

    def __init__(self, data: Any, path: str, source: Source) -> None:
        if not isinstance(data, dict):
            source.fail(path, "must be a mapping of keys to values")
        self.data: dict[str, Any] = data
        self.path = path
        self.source = source
        self._read: set[str] = set()

    def field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str | None, message: str) -> NoReturn:
        self.source.fail(self.field(key) if key else self.path, message)

    def has(self, key: str) -> bool:
        """Whether an optional key is given; asking counts as knowing it."""
        self._read.add(key)
        return key in self.data

    def raw(self, key: str, default: Any = MISSING) -> Any:
        self._read.add(key)
        if key not in self.data:
            if default is MISSING:
                self.fail(None, f"the key '{key}' is required")
            return default
        return self.data[key]

    def number(
        self,
        key: str,
        default: Any = MISSING,
        *,
        positive: bool = False,
        maximum: float | None = None,
    ) -> float:
        """A finite number, never negative; `positive` also refuses 0."""
        value = self.raw(key, default)
        return self.check_number(key, value, positive=positive, maximum=maximum)

    def check_number(
        self, key: str, value: Any, *, positive: bool = False, maximum: float | None = None
    ) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(key, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            self.fail(key, f"must be finite, got {value!r}")
        if value < 0 or (positive and value == 0):
            self.fail(key, f"must be {'above 0' if positive else 'at least 0'}, got {value!r}")
        if maximum is not None and value > maximum:
            self.fail(key, f"must be at most {maximum:g}, got {value!r}")
        return float(value)

    def integer(self, key: str, default: Any = MISSING, *, minimum: int = 0) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(key, f"must be an integer of at least {minimum}, got {value!r}")
        return value

    def text(self, key: str, default: Any = MISSING) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            self.fail(key, f"must be text, got {value!r}")
        return value

    def section(self, key: str) -> Section:
        return Section(self.raw(key), self.field(key), self.source)

    def sections(self, key: str) -> list[Section]:
        items = self.raw(key)
        if not isinstance(items, list) or not items:
            self.fail(key, "must be a non-empty list")
        return [
            Section(item, f"{self.field(key)}[{i}]", self.source) for i, item in enumerate(items)
        ]

    def done(self) -> None:
        """Refuse keys nobody read: a typo must not silently fall back to a default."""
        unknown = sorted(set(self.data) - self._read)
        if unknown:
            self.fail(unknown[0], f"unknown key (known here: {', '.join(sorted(self._read))})")
