"""The guest's launcher itself, without booting anything."""

from __future__ import annotations

from pathlib import Path

import v2guest


def test_the_kernel_command_line_stays_short_however_many_and_long_the_tests() -> None:
    """virtme-ng puts `--exec` on the kernel's command line, which Debian's kernel cannot
    take past 2048 bytes: the tests go in a script in the shared directory instead."""
    rootdir = Path("/a/checkout/under/a/long/path/such/as/ci/uses") / ("x" * 120)
    nodeids = [f"tests/test_{i}.py::test_{'long_name_' * 8}[v2-guest]" for i in range(40)]
    shared = Path("/tmp/kuscale-v2-guest-abcdefgh")
    script = shared / "run.sh"
    command = v2guest.guest_command(
        Path("/venv/bin/vng"), Path("/boot/vmlinuz-6.1"), shared, script
    )
    text = v2guest.guest_script(nodeids, rootdir, shared / "report.json")
    assert command[command.index("--exec") + 1] == f"sh {script}"
    assert sum(len(argument) for argument in command) < 400
    assert all(nodeid in text for nodeid in nodeids)
    assert text.startswith(f"echo '{v2guest.BOOTED}'")
    assert f"cd {rootdir}" in text
