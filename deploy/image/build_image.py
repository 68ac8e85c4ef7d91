"""`make image`: the agent's image, built on this machine from Debian's packages and kuscale's
pinned dependencies, with no image registry and no container engine.

The root filesystem is Debian's own: Python (python3.11-minimal, libpython3.11-stdlib) and
libstdc++6 for the compiled wheels, each package with every package it depends on, unpacked
with `dpkg-deb` (as distroless images are made: no shell, no apt, no dpkg; the maintainer
scripts never run, so the packages only they need are left out). kuscale goes in with pip, as
the agent needs it (no `[sim]`: no scipy, no matplotlib), and everything is compiled to
bytecode ahead, so a restarted agent starts at once. The image is one layer in an OCI archive
(`ociarchive`), named `kuscale.local/kuscale:<version>`, kept in the user's cache under a hash
of every input, so a second build costs a hash. Prints the archive's path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

from ociarchive import write_archive

REPO = Path(__file__).resolve().parents[2]
COMPILER = Path(__file__).with_name("compile_imported.py")
LAUNCHER = Path(__file__).with_name("kuscale")
"""The image's `kuscale` command: Debian's Python running kuscale's entry point."""
ROOT_PACKAGES = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6")
PYTHON = "/usr/bin/python3.11"
SCRIPT_ONLY = frozenset({"dpkg", "debconf", "install-info", "perl-base", "tar"})
"""Packages that Debian's dependencies name for maintainer scripts, which never run here."""
PRUNED = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/lintian",
          "usr/share/locale", "usr/share/bug")  # fmt: skip
LIB = "opt/kuscale/lib"
NAME = "kuscale.local/kuscale"
APT_LOCK = ("-o", "DPkg::Lock::Timeout=600")
"""Wait for another apt-get (a machine's own upgrades) instead of failing at once."""
IMAGE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "PYTHONPATH": f"/{LIB}",
    "PYTHONDONTWRITEBYTECODE": "1",
    # glibc makes a malloc arena per thread that allocates (the gRPC servers', the watch's,
    # the metrics'): two are enough for an agent whose work is one loop.
    "MALLOC_ARENA_MAX": "2",
}
INPUTS = ("pyproject.toml", "README.md", "src", "deploy/image")
EPOCH = 0
"""Every file's time in the layer: the same inputs make the same layer."""


class ImageError(Exception):
    """The image cannot be built here; the message says why."""


def version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def inputs_digest() -> str:
    """A hash of every file the image is made from (the Debian packages are named in
    ROOT_PACKAGES, inside deploy/image)."""
    digest = hashlib.sha256()
    for top in INPUTS:
        path = REPO / top
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts:
                continue
            digest.update(str(file.relative_to(REPO)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def _run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ImageError(
            f"{' '.join(argv[:4])} ... failed:\n{(done.stderr or done.stdout)[-3000:]}"
        )
    return done.stdout


def debian_closure(roots: tuple[str, ...]) -> list[str]:
    flags = ["--recurse", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks",
             "--no-replaces", "--no-enhances"]  # fmt: skip
    return closure(parse_depends(_run(["apt-cache", "depends", *flags, *roots])), roots)


def parse_depends(listing: str) -> dict[str, list[list[str]]]:
    """`apt-cache depends` as a graph: each package's dependencies, each a list of
    alternatives (a line marked `|` is or'ed with the next); virtual ones stay `<name>`."""
    graph: dict[str, list[list[str]]] = {}
    current, group = "", list[str]()
    for line in listing.splitlines():
        if not line.startswith(" "):
            current, group = line.strip(), []
            graph.setdefault(current, [])
            continue
        found = re.match(r"^ (\|)?\s*(?:Pre)?Depends: (\S+)$", line)
        if found is None:
            continue
        group.append(found.group(2))
        if not found.group(1):
            graph[current].append(group)
            group = []
    return graph


def closure(graph: dict[str, list[list[str]]], roots: tuple[str, ...]) -> list[str]:
    """`roots` and every package they depend on, through the first real package of each set
    of alternatives, leaving out what only maintainer scripts need."""
    chosen: set[str] = set()
    pending = list(roots)
    while pending:
        package = pending.pop()
        if package in chosen or package in SCRIPT_ONLY:
            continue
        chosen.add(package)
        for alternatives in graph.get(package, []):
            real = [a for a in alternatives if not a.startswith("<") and a not in SCRIPT_ONLY]
            pending.extend(real[:1])
    return sorted(chosen)


def download(packages: list[str], into: Path) -> list[Path]:
    """The packages' .deb files from Debian's archive, as apt-get finds them; the package
    lists are fetched once where this machine has none yet."""
    into.mkdir(parents=True, exist_ok=True)
    try:
        _run(["apt-get", "download", *APT_LOCK, *packages], cwd=into)
    except ImageError:
        _run(["apt-get", "update", "-q", *APT_LOCK])
        _run(["apt-get", "download", *APT_LOCK, *packages], cwd=into)
    debs = {deb.name.partition("_")[0]: deb for deb in sorted(into.glob("*.deb"))}
    missing = sorted(set(packages) - set(debs))
    if missing:
        raise ImageError(f"apt-get download gave no .deb for {', '.join(missing)}")
    return [debs[p] for p in packages]


def root_filesystem(root: Path, debs: list[Path]) -> None:
    for deb in debs:
        _run(["dpkg-deb", "-x", str(deb), str(root)])
    for pruned in PRUNED:
        shutil.rmtree(root / pruned, ignore_errors=True)
    for directory in ("proc", "sys", "dev", "etc", "var/lib/kuscale", "usr/local/bin"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(mode=0o1777, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/usr/sbin/nologin\n")
    (root / "etc/group").write_text("root:x:0:\n")
    shutil.copy(LAUNCHER, root / "usr/local/bin/kuscale")


def install_kuscale(root: Path) -> None:
    """kuscale with the agent's dependencies and the NVML extra, for Debian's Python (the
    same 3.11 as the wheels pip picks here); then the modules the agent's commands import
    compiled to bytecode by that Python (`compile_imported`)."""
    target = root / LIB
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          "--no-compile", "--no-cache-dir", "--target", str(target), f"{REPO}[nvml]"])  # fmt: skip
    shutil.rmtree(target / "bin", ignore_errors=True)
    compiler = root / "tmp" / COMPILER.name
    shutil.copy(COMPILER, compiler)
    _run([_chroot(), str(root), PYTHON, f"/tmp/{COMPILER.name}"], env=IMAGE_ENV)
    compiler.unlink()
    _run([_chroot(), str(root), "/usr/local/bin/kuscale", "--help"], env=IMAGE_ENV)


def _chroot() -> str:
    found = shutil.which("chroot") or shutil.which("chroot", path="/usr/sbin:/sbin")
    if found is None:
        raise ImageError("chroot is missing: the image's Python compiles its bytecode in it")
    return found


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = EPOCH
    return info


def write_layer(root: Path, layer: Path) -> None:
    with tarfile.open(layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(root)), recursive=False, filter=_normalized)


def build(cache: Path) -> Path:
    tag = version()
    archive = cache / f"kuscale-{tag}-{inputs_digest()}.tar"
    if archive.exists():
        return archive
    if os.geteuid() != 0 or shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise ImageError(
            "the image is built from Debian's packages: it needs root, apt-get and dpkg-deb "
            "(elsewhere, build the Dockerfile with a container engine)"
        )
    packages = debian_closure(ROOT_PACKAGES)
    debs = download(packages, cache / "debs")
    with tempfile.TemporaryDirectory(dir=cache, prefix="build-") as work:
        root, layer = Path(work) / "root", Path(work) / "layer.tar"
        root.mkdir()
        root_filesystem(root, debs)
        install_kuscale(root)
        write_layer(root, layer)
        config = {
            "Entrypoint": ["/usr/local/bin/kuscale"],
            "Env": [f"{key}={value}" for key, value in IMAGE_ENV.items()],
            "Labels": {"org.opencontainers.image.version": tag},
        }
        write_archive(archive, [layer], config, [f"{NAME}:{tag}"])
    for old in cache.glob("kuscale-*.tar"):
        if old != archive:
            old.unlink()
    return archive


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kuscale-image"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=default_cache())
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    try:
        print(build(args.cache))
    except ImageError as err:
        print(f"make image: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
