"""OCI images built on this machine from Debian's busybox-static, since no registry can be
reached from it: one layer (busybox and the links a test's commands use), a config, a manifest
and an index whose annotations name each tag, as `ctr images import` reads an OCI layout."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

APPLETS = ("sh", "sleep", "cat", "echo", "true", "nproc")
"""The names busybox answers to inside the image; what the tests' commands call."""
SLEEP_FOREVER = ["/bin/sleep", "2147483647"]
"""The pause image's whole job: hold the pod's namespaces, using no CPU."""


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def _descriptor(media_type: str, digest: str, data: bytes, **extra: Any) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": digest, "size": len(data), **extra}


def busybox_layer(busybox: Path) -> bytes:
    """An uncompressed layer: /bin/busybox, its applets as symlinks, and the empty /proc, /dev,
    /sys and /tmp the runtime mounts over."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as layer:
        for directory in ("bin", "proc", "dev", "sys", "tmp", "etc"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            layer.addfile(info)
        layer.add(str(busybox), arcname="bin/busybox")
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            layer.addfile(link)
    return out.getvalue()


def image_archive(busybox: Path, names: list[str]) -> bytes:
    """One OCI layout archive holding the busybox image under every name in `names`."""
    layer_digest, layer = _blob(busybox_layer(busybox))
    config_digest, config = _blob(
        json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Cmd": SLEEP_FOREVER, "Env": ["PATH=/bin"]},
                "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            }
        ).encode()
    )
    manifest_digest, manifest = _blob(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": _descriptor(
                    "application/vnd.oci.image.config.v1+json", config_digest, config
                ),
                "layers": [
                    _descriptor("application/vnd.oci.image.layer.v1.tar", layer_digest, layer)
                ],
            }
        ).encode()
    )
    index = {
        "schemaVersion": 2,
        "manifests": [
            _descriptor(
                "application/vnd.oci.image.manifest.v1+json",
                manifest_digest,
                manifest,
                annotations={
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rpartition(":")[2],
                },
            )
            for name in names
        ],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index).encode(),
        **{
            f"blobs/sha256/{digest.partition(':')[2]}": data
            for digest, data in (
                (layer_digest, layer),
                (config_digest, config),
                (manifest_digest, manifest),
            )
        },
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()
