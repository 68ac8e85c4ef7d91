"""The pieces of `make image` that need no root and no Debian archive: how Debian's
dependencies are followed, the OCI archive it writes, and the bytecode it compiles ahead.
The whole image is built and run by the e2e tests (`tests/e2e/test_e2e_shipped.py`)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest
from build_image import closure, parse_depends
from compile_imported import compile_imported
from ociarchive import write_archive

LISTING = """python3.11-minimal
  PreDepends: libc6
  Depends: libpython3.11-minimal
  Depends: libexpat1
libpython3.11-stdlib
 |Depends: media-types
  Depends: mime-support
  Depends: <debconf-2.0>
    cdebconf
  Depends: tzdata
libc6
  Depends: libgcc-s1
tzdata
  PreDepends: debconf
media-types
mime-support
  Depends: mailcap
libpython3.11-minimal
libexpat1
libgcc-s1
"""


def test_the_closure_follows_the_first_of_each_alternative_and_skips_script_only_packages() -> None:
    graph = parse_depends(LISTING)
    assert graph["libpython3.11-stdlib"] == [
        ["media-types", "mime-support"], ["<debconf-2.0>"], ["tzdata"]
    ]  # fmt: skip
    packages = closure(graph, ("python3.11-minimal", "libpython3.11-stdlib"))
    assert packages == [
        "libc6", "libexpat1", "libgcc-s1", "libpython3.11-minimal", "libpython3.11-stdlib",
        "media-types", "python3.11-minimal", "tzdata",
    ]  # fmt: skip


def test_the_archive_is_an_oci_layout_and_a_docker_archive_of_the_same_image(
    tmp_path: Path,
) -> None:
    layer = tmp_path / "layer.tar"
    with tarfile.open(layer, "w") as tar:
        info = tarfile.TarInfo("hello")
        tar.addfile(info)
    archive = tmp_path / "image.tar"
    write_archive(archive, [layer], {"Entrypoint": ["/hello"]}, ["kuscale.local/x:1", "y:2"])
    with tarfile.open(archive) as opened:
        files = {m.name: opened.extractfile(m).read() for m in opened if m.isfile()}  # type: ignore[union-attr]
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rpartition("/")[2]
    index = json.loads(files["index.json"])
    names = [m["annotations"]["io.containerd.image.name"] for m in index["manifests"]]
    assert names == ["kuscale.local/x:1", "y:2"]
    manifest = json.loads(files[f"blobs/sha256/{index['manifests'][0]['digest'][7:]}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'][7:]}"])
    assert config["config"]["Entrypoint"] == ["/hello"]
    assert config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]]
    (docker,) = json.loads(files["manifest.json"])
    assert docker["RepoTags"] == names and docker["Layers"] == [
        f"blobs/sha256/{manifest['layers'][0]['digest'][7:]}"
    ]


def test_a_module_its_package_imports_only_when_used_is_compiled_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Kubernetes client imports its models as a pod is first read: without their
    bytecode, the agent in its pod compiled 250 modules at every start."""
    package = tmp_path / "lazypkg"
    package.mkdir()
    (package / "__init__.py").write_text("def later():\n    from lazypkg import models\n")
    (package / "models.py").write_text("X = 1\n")
    (package / "unused").mkdir()
    (package / "unused" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazypkg", raising=False)
    compile_imported(("lazypkg",), (str(tmp_path),))
    for module in (package / "__init__.py", package / "models.py"):
        assert Path(importlib.util.cache_from_source(str(module))).exists(), module
    assert not Path(importlib.util.cache_from_source(str(package / "unused/__init__.py"))).exists()
    outside = importlib.util.cache_from_source(compile_imported.__code__.co_filename)
    assert not Path(outside).exists() or Path(outside).read_bytes()[4:8] != b"\x01\x00\x00\x00", (
        "bytecode that is never checked was written outside the roots"
    )
