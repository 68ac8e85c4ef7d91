"""The busybox images of the e2e node, built on this machine from Debian's busybox-static,
since no registry can be reached from it: one layer (busybox and the links a test's commands
use) in an archive written by the agent image's own OCI writer (`deploy/image/ociarchive`)."""

from __future__ import annotations

import tarfile
from pathlib import Path

from ociarchive import write_archive

APPLETS = ("sh", "sleep", "cat", "echo", "true", "nproc")
"""The names busybox answers to inside the image; what the tests' commands call."""
SLEEP_FOREVER = ["/bin/sleep", "2147483647"]
"""The pause image's whole job: hold the pod's namespaces, using no CPU."""


def busybox_layer(busybox: Path, layer: Path) -> None:
    """An uncompressed layer: /bin/busybox, its applets as symlinks, and the empty /proc, /dev,
    /sys and /tmp the runtime mounts over."""
    with tarfile.open(layer, mode="w") as tar:
        for directory in ("bin", "proc", "dev", "sys", "tmp", "etc"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(str(busybox), arcname="bin/busybox")
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)


def write_busybox_archive(busybox: Path, names: list[str], archive: Path) -> None:
    """One archive holding the busybox image under every name in `names`."""
    layer = archive.with_suffix(".layer.tar")
    busybox_layer(busybox, layer)
    write_archive(archive, [layer], {"Cmd": SLEEP_FOREVER, "Env": ["PATH=/bin"]}, names)
    layer.unlink()
