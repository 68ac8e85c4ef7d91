"""docs/config.md against the code: every key the configuration knows is there with its
default, and every bound it states is the one `load_config` enforces, probed at each end, so
the reference cannot drift from the checks."""

from __future__ import annotations

import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from kuscale.config import (
    GEMINI_REQUESTS,
    GPU_LAYERS,
    GPU_USAGE_SOURCES,
    POLICY_NAMES,
    AgentConfig,
    BaselineConfig,
    ConfigError,
    GpuLayerConfig,
    PolicyConfig,
    config_from_mapping,
)

PAGE = Path(__file__).resolve().parent.parent / "docs" / "config.md"
SECTION = re.compile(r"^## `\[([a-z_.]+)\]`$")
ROW = re.compile(r"^\| `(\w+)` \| (.+?) \| (.+?) \| .+ \|$")
INTERVAL = re.compile(r"^(integer )?([\[(])(\S+), (\S+)([\])])(;.*)?$")

CHOICES = {
    "agent.policy": POLICY_NAMES,
    "gpu_layer.kind": GPU_LAYERS,
    "gpu_layer.gemini_request": GEMINI_REQUESTS,
    "gpu_layer.usage": GPU_USAGE_SOURCES,
}
"""The code's own lists, which a "one of" row must name exactly."""


def documented() -> dict[str, tuple[str, str]]:
    """`section.key` → (default, bounds), as the page's tables give them."""
    rows: dict[str, tuple[str, str]] = {}
    section = None
    for line in PAGE.read_text().splitlines():
        if heading := SECTION.match(line):
            section = heading.group(1)
        elif (row := ROW.match(line)) and section is not None:
            key = f"{section}.{row.group(1)}"
            assert key not in rows, f"{key} is documented twice"
            rows[key] = (row.group(2), row.group(3))
    return rows


def code_defaults() -> dict[str, Any]:
    """`section.key` → default, from the configuration's dataclasses."""
    policy = PolicyConfig()
    tables: dict[str, tuple[Any, tuple[str, ...]]] = {
        "agent": (AgentConfig(), ("policy_config", "gpu_layer")),
        "policy": (policy, ("cpu", "gpu", "baselines")),
        "resources.cpu": (policy.cpu, ()),
        "resources.gpu": (policy.gpu, ()),
        "baselines": (BaselineConfig(), ()),
        "gpu_layer": (GpuLayerConfig(), ()),
    }
    return {
        f"{section}.{f.name}": getattr(instance, f.name)
        for section, (instance, nested) in tables.items()
        for f in fields(instance)
        if f.name not in nested
    }


def load(key: str, value: Any) -> None:
    """The configuration with one key set, its companions out of the way: the watch off (so
    a short period stands alone), and the lowest minimum (so a low cap stands alone)."""
    section, _, name = key.rpartition(".")
    data: dict[str, Any] = {"agent": {"watch_interval": 0}}
    if name == "max":
        data["resources"] = {section.split(".")[1]: {"min": 1e-9}}
    table = data
    for part in section.split("."):
        table = table.setdefault(part, {})
    table[name] = value
    config_from_mapping(data, "docs")


def accepted(key: str, value: Any) -> bool:
    try:
        load(key, value)
    except ConfigError:
        return False
    return True


def parse_default(text: str) -> Any:
    return None if text == "unset" else tomllib.loads(f"v = {text.strip('`')}")["v"]


def end(text: str, defaults: dict[str, Any], section: str) -> float:
    """A bound: a number, ±∞, or another key of the section (its default)."""
    if text.lstrip("-") == "∞":
        return float(text.replace("∞", "inf"))
    if re.fullmatch(r"[a-z_]+", text):
        return float(defaults[f"{section}.{text}"])
    return float(text)


def interval_probes(
    key: str, bounds: re.Match[str], defaults: dict[str, Any]
) -> list[tuple[Any, bool]]:
    """(value, whether the bound says it is taken) at and just past each finite end."""
    integer = bounds.group(1) is not None
    low = end(bounds.group(3), defaults, key.rpartition(".")[0])
    high = end(bounds.group(4), defaults, key.rpartition(".")[0])
    step = 1.0 if integer else 1e-6
    probes = []
    if low != float("-inf"):
        closed = bounds.group(2) == "["
        probes += [(low, closed), (low - step, False), (low + step, True)]
    if high != float("inf"):
        closed = bounds.group(5) == "]"
        probes += [(high, closed), (high + step, False), (high - step, True)]
    else:
        probes.append((1e9, True))
    return [(int(v) if integer else v, taken) for v, taken in probes]


def probes(key: str, bounds: str, defaults: dict[str, Any]) -> list[tuple[Any, bool]]:
    """Values the stated bounds take and refuse."""
    if interval := INTERVAL.match(bounds):
        return [*interval_probes(key, interval, defaults), ("ten", False)]
    if bounds == "any finite number":
        return [(-1e9, True), (0.0, True), (1e9, True), ("ten", False)]
    if bounds == "true or false":
        return [(True, True), (False, True), (1, False)]
    if bounds.startswith("one of "):
        names = tuple(re.findall(r"`([^`]+)`", bounds))
        assert names == CHOICES[key], f"{key}: the page lists {names}, the code {CHOICES[key]}"
        return [*((name, True) for name in names), ("no-such", False)]
    if bounds.startswith("absolute path"):
        optional = bounds.endswith('or ""')
        return [("/a/b", True), ("a/b", False), ("/a/../b", False), ("", optional)]
    if bounds == 'HOST:PORT or ""':
        return [("node:5555", True), ("", True), ("node", False), ("node:0", False)]
    if bounds == "list of file names":
        return [(["a", "GPU-1"], True), ([], True), (["../a"], False), ("a", False)]
    if bounds == "table of variable names to strings":
        return [({"A_1": "x"}, True), ({"1A": "x"}, False), ({"A": 1}, False)]
    raise AssertionError(f"{key}: bounds {bounds!r} are in no form this test knows")


def test_the_page_names_every_key_and_no_other() -> None:
    assert sorted(documented()) == sorted(code_defaults())


@pytest.mark.parametrize("key", sorted(code_defaults()))
def test_the_default_is_the_codes(key: str) -> None:
    default, _ = documented()[key]
    assert parse_default(default) == code_defaults()[key]


@pytest.mark.parametrize("key", sorted(code_defaults()))
def test_the_bounds_are_what_the_code_enforces(key: str) -> None:
    _, bounds = documented()[key]
    wrong = [
        (value, taken)
        for value, taken in probes(key, bounds, code_defaults())
        if accepted(key, value) != taken
    ]
    assert wrong == [], f"{key} = VALUE: the page says (VALUE, taken); the code differs"


def test_a_bound_the_code_does_not_keep_is_caught() -> None:
    """A page that said `growth` may be 1 would be caught at that end."""
    interval = INTERVAL.match("[1, ∞)")
    assert interval is not None
    found = interval_probes("policy.growth", interval, code_defaults())
    assert any(accepted("policy.growth", value) != taken for value, taken in found)
