"""OCI image archives written on this machine, with no registry and no container engine: each
layer an uncompressed tar, a config, a manifest, and an index whose annotations name each
tag, as `ctr images import` and `podman load` read an OCI layout; beside it the
`manifest.json` that `docker load` reads. Layers are streamed from files, never held whole
in memory."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"
CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def _descriptor(media_type: str, digest: str, size: int, **extra: Any) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": digest, "size": size, **extra}


def _json_blob(data: dict[str, Any]) -> tuple[str, bytes]:
    raw = json.dumps(data, sort_keys=True).encode()
    return f"sha256:{hashlib.sha256(raw).hexdigest()}", raw


def _blob_name(digest: str) -> str:
    return f"blobs/sha256/{digest.partition(':')[2]}"


def write_archive(out: Path, layers: list[Path], config: dict[str, Any], names: list[str]) -> None:
    """One archive at `out` holding the image of `layers` (bottom first) and `config` (the
    image's `config` section: Entrypoint, Env, ...) under every name in `names`."""
    layer_digests = [file_digest(layer) for layer in layers]
    config_digest, config_raw = _json_blob(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": layer_digests},
        }
    )
    manifest_digest, manifest_raw = _json_blob(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": _descriptor(CONFIG, config_digest, len(config_raw)),
            "layers": [
                _descriptor(LAYER, digest, layer.stat().st_size)
                for digest, layer in zip(layer_digests, layers, strict=True)
            ],
        }
    )
    index = {
        "schemaVersion": 2,
        "manifests": [
            _descriptor(
                MANIFEST,
                manifest_digest,
                len(manifest_raw),
                annotations={
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rpartition(":")[2],
                },
            )
            for name in names
        ],
    }
    docker = [
        {
            "Config": _blob_name(config_digest),
            "RepoTags": names,
            "Layers": [_blob_name(d) for d in layer_digests],
        }
    ]
    small = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index).encode(),
        "manifest.json": json.dumps(docker).encode(),
        _blob_name(config_digest): config_raw,
        _blob_name(manifest_digest): manifest_raw,
    }
    partial = out.with_name(f".{out.name}.partial")
    with tarfile.open(partial, mode="w") as archive:
        for name, data in small.items():
            archive.addfile(_entry(name, len(data)), io.BytesIO(data))
        for digest, layer in zip(layer_digests, layers, strict=True):
            with layer.open("rb") as handle:
                archive.addfile(_entry(_blob_name(digest), layer.stat().st_size), handle)
    partial.replace(out)


def _entry(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    return info
