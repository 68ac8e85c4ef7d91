"""The Kubernetes manifests: every Kustomize overlay rendered by `kubectl kustomize` and
validated against the Kubernetes schemas; the agent's arguments parse; RBAC stays minimal."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kuscale.cli import build_parser
from kuscale.config import config_from_mapping, load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KUSTOMIZATIONS = [DEPLOY / "base", *sorted((DEPLOY / "overlays").iterdir())]
SCHEMA_VERSION = "1.32.0"


def render(directory: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the overlays cannot be rendered here")
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True
    )
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_every_overlay_renders_to_valid_kubernetes_objects(directory: Path) -> None:
    documents = render(directory)
    assert {d["kind"] for d in documents} >= {"DaemonSet", "ClusterRole", "ServiceAccount"}
    for document in documents:
        kubernetes_validate.validate(document, SCHEMA_VERSION, strict=True)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_the_daemonset_runs_a_command_the_agent_accepts(directory: Path) -> None:
    (daemonset,) = [d for d in render(directory) if d["kind"] == "DaemonSet"]
    agent = daemonset["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace("$(POD_IP)", "10.0.0.1") for a in agent["args"]]
    parsed = build_parser().parse_args(args)
    assert parsed.kubernetes and parsed.metrics_address == "10.0.0.1:9091"
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    assert {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources"} <= mounts


SLOW_START_S = 120
"""How long the agent took from its start to its first tick on the e2e cluster's emulated
v2 node, with room: about a minute there."""


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_a_slow_node_gives_the_agent_time_for_its_first_tick(directory: Path) -> None:
    """The liveness probe asks only once the startup probe saw the loop tick; before that an
    agent still starting would be killed at every start, never Ready."""
    (daemonset,) = [d for d in render(directory) if d["kind"] == "DaemonSet"]
    agent = daemonset["spec"]["template"]["spec"]["containers"][0]
    startup = agent["startupProbe"]
    assert startup["httpGet"]["path"] == agent["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= SLOW_START_S
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert agent[probe].get("timeoutSeconds", 1) >= 5, probe


READ_PODS = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
RESIZE_PODS = {"apiGroups": [""], "resources": ["pods/resize"], "verbs": ["patch"]}


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_rbac_reads_pods_and_patches_resize_only_with_that_actuator(directory: Path) -> None:
    documents = render(directory)
    (role,) = [d for d in documents if d["kind"] == "ClusterRole"]
    (daemonset,) = [d for d in documents if d["kind"] == "DaemonSet"]
    args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    resize = build_parser().parse_args(args).actuator == "resize"
    assert role["rules"] == ([READ_PODS, RESIZE_PODS] if resize else [READ_PODS])
    assert resize == (directory.name == "resize")


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_the_settings_parse_and_the_vgpu_root_is_mounted_where_they_say(directory: Path) -> None:
    documents = render(directory)
    (settings,) = [d for d in documents if d["kind"] == "ConfigMap"]
    layer = config_from_mapping(tomllib.loads(settings["data"]["kuscale.toml"]), "x").gpu_layer
    (daemonset,) = [d for d in documents if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {
        m["mountPath"]: host_paths.get(m["name"]) for m in pod["containers"][0]["volumeMounts"]
    }
    assert layer.kind == {"gpu": "vgpu", "gemini": "gemini"}.get(directory.name, "none")
    if layer.kind == "vgpu":
        assert mounts[layer.root] == layer.root
    if layer.kind == "gemini":
        assert mounts[layer.gemini_dir] == layer.gemini_dir
        assert len(layer.files()) == layer.gpus


def test_the_shipped_settings_and_example_are_valid() -> None:
    assert load_config(DEPLOY / "base" / "kuscale.toml", {}).policy == "kuscale"
    for path in sorted((DEPLOY / "examples").glob("*.yaml")):
        example = yaml.safe_load(path.read_text())
        kubernetes_validate.validate(example, SCHEMA_VERSION, strict=True)
        if example["kind"] == "Job":
            restore = example["spec"]["template"]["spec"]["containers"][0]["args"]
            assert restore[0] == "restore"
            continue
        limits = example["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["kuscale.com/token"]) > 0
