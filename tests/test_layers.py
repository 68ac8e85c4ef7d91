"""No import runs back up the layers: the backends know no Kubernetes, the device plugin no
emulator. Read from the source, so a new import that breaks it fails here, by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kuscale

PACKAGE = Path(kuscale.__file__).parent
FORBIDDEN = {
    "backends": ("kuscale.kubernetes", "kuscale.deviceplugin", "kuscale.monitor"),
    "deviceplugin": ("kuscale.gpuemu",),
    "policy": ("kuscale.backends", "kuscale.monitor", "kuscale.kubernetes"),
}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_import_runs_back_up(layer: str) -> None:
    wrong = [
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted((PACKAGE / layer).glob("*.py"))
        for name in sorted(imported(path))
        if name.startswith(FORBIDDEN[layer])
    ]
    assert wrong == []
