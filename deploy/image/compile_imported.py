"""Compile to bytecode every module the agent's commands import, run by the image's own
Python inside the image (by `make image` in a chroot, by the Dockerfile in its build): a
restarted agent then starts without compiling, and the modules nothing imports (the
Kubernetes client's asyncio half alone is 27 MB of bytecode) cost no space."""

import compileall
import importlib
import os
import py_compile
import sys
import sysconfig

AGENT_MODULES = (
    "kuscale.cli.entry", "kuscale.cli.agent", "kuscale.cli.restore", "kuscale.cli.status",
    "kuscale.cli.top", "kuscale.cli.helpers", "kuscale.kubernetes.agent",
    "kuscale.kubernetes.apiserver", "kuscale.actuators.resize", "kuscale.local.agent",
    "kuscale.exporter", "kuscale.record", "kuscale.top", "kuscale.deviceplugin.plugin",
    "kuscale.backends.nvml", "kubernetes.config", "kubernetes.client", "kubernetes.watch",
)  # fmt: skip
"""What `agent`, `restore`, `status`, `top` and the device plugin import, lazily or not."""


def compile_imported(names: tuple[str, ...], roots: tuple[str, ...]) -> None:
    """Every module under `roots` that importing `names` imports, and every module beside
    it in the packages imported: some import their modules only when first used (the
    Kubernetes client's models, as a pod is read: 250 of them compiled at every start of the
    agent in its pod). Nothing outside `roots` is touched: bytecode that is never checked
    against its source belongs in an image only."""
    for name in names:
        importlib.import_module(name)
    hashed = py_compile.PycInvalidationMode.UNCHECKED_HASH
    inside = tuple(os.path.join(os.path.realpath(r), "") for r in roots)
    for module in list(sys.modules.values()):
        path = os.path.realpath(getattr(module, "__file__", None) or "/")
        if not path.startswith(inside):
            continue
        if path.endswith(".py"):
            py_compile.compile(path, doraise=True, invalidation_mode=hashed)
        for directory in getattr(module, "__path__", None) or ():
            compileall.compile_dir(directory, maxlevels=0, quiet=1, invalidation_mode=hashed)


if __name__ == "__main__":
    compile_imported(
        AGENT_MODULES, (sysconfig.get_paths()["stdlib"], *os.environ["PYTHONPATH"].split(":"))
    )
