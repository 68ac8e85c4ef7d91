"""kuscale as an operator installs it: the agent's image built here (`make image`) and
imported into the node's containerd, the shipped manifests applied with `kubectl apply -k`
through a test overlay that changes what an operator's cluster would give instead:

- the image: the one built here (`images:`), and the agent's prices (its ConfigMap), so that
  the node's two cores cost 1000 tokens and budgets bind;
- `KUBERNETES_SERVICE_HOST` and `_PORT` on the agent's container: the API server's own
  address. No kube-proxy runs on this node, so the service's cluster IP leads nowhere; this
  stands in for it, and nothing else of the manifest changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.e2eagent import AGENT_CONFIG, DEPLOY, Cluster, until
from e2e.e2enode import GATEWAY, REPO, WORK
from e2e.guestnode import GUEST_NODE, SHARED

AGENT_NAMESPACE = "kuscale-system"
IMAGE_NAME = "kuscale.local/kuscale"
HOST_RECORD = Path("/var/lib/kuscale/originals")
"""The DaemonSet's hostPath for the record of originals."""
BUILD = REPO / "deploy" / "image" / "build_image.py"


def build_image() -> tuple[Path, float]:
    """The archive `make image` makes (cached under a hash of its inputs), and the seconds
    this build took."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(BUILD)], capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"make image failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1]), time.monotonic() - started


@dataclass
class Shipped:
    """The DaemonSet applied from a test overlay of a shipped kustomization."""

    cluster: Cluster
    tag: str
    figures: str = ""
    """The image's size and build time, and how long it took to run."""

    @property
    def image(self) -> str:
        return f"{IMAGE_NAME}:{self.tag}"

    def overlay(self, shipped: str = "base", config: str = AGENT_CONFIG) -> Path:
        """A test overlay of `deploy/kubernetes/<shipped>`, written under WORK."""
        directory = WORK / "overlays" / shipped.replace("/", "-")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "kuscale.toml").write_text(config)
        port = self.cluster.node.ports["apiserver"]
        env = [
            {"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": item}
            for item in (
                {"name": "KUBERNETES_SERVICE_HOST", "value": GATEWAY},
                {"name": "KUBERNETES_SERVICE_PORT", "value": str(port)},
            )
        ]
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(DEPLOY / shipped, directory)],
            "images": [
                {"name": "ghcr.io/kuscale/kuscale", "newName": IMAGE_NAME, "newTag": self.tag}
            ],
            "configMapGenerator": [
                {"name": "kuscale-config", "behavior": "replace", "files": ["kuscale.toml"]}
            ],
            "patches": [
                {
                    "target": {"kind": "DaemonSet", "name": "kuscale-agent"},
                    "patch": yaml.safe_dump(env),
                }
            ],
        }
        (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return directory

    def install(self, shipped: str = "base", config: str = AGENT_CONFIG) -> None:
        self.cluster.kubectl(
            "apply", "--server-side", "--force-conflicts", "-k", str(self.overlay(shipped, config))
        )

    def uninstall(self, shipped: str = "base") -> None:
        self.cluster.kubectl(
            "delete",
            "-k",
            str(self.overlay(shipped)),
            "--ignore-not-found",
            "--wait=true",
            "--timeout=120s",
        )

    def agent_pods(self) -> list[dict[str, Any]]:
        listed = self.cluster.get("pods", namespace=AGENT_NAMESPACE)
        return [p for p in listed["items"] if p["metadata"].get("deletionTimestamp") is None]

    def ready_agent(self, deadline: float = 180.0) -> dict[str, Any]:
        """The one agent pod, once it is Ready (its probes pass) and no other is left."""
        try:
            pod = until(self._only_ready, "the agent's pod is Ready", deadline)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.explain()}") from None
        assert isinstance(pod, dict)
        return pod

    def _only_ready(self) -> dict[str, Any] | None:
        listed = self.cluster.get("pods", namespace=AGENT_NAMESPACE)["items"]
        if len(listed) != 1:
            return None
        pod: dict[str, Any] = listed[0]
        conditions = pod["status"].get("conditions", [])
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        return pod if ready else None

    def log(self, pod: dict[str, Any]) -> str:
        """Everything the pod's agent wrote, every restart of it, read from its node (the v2
        node's kubelet writes its pods' logs where the host reads them)."""
        meta = pod["metadata"]
        top = (
            SHARED / "pod-logs" if pod["spec"].get("nodeName") == GUEST_NODE else WORK / "pod-logs"
        )
        logs = top / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / "agent"
        return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")))

    def explain(self) -> str:
        """What an operator would look at: the pods' states and each agent's last lines."""
        lines = []
        for pod in self.cluster.get("pods", namespace=AGENT_NAMESPACE)["items"]:
            statuses = json.dumps(pod["status"].get("containerStatuses", []))[-1500:]
            lines.append(f"{pod['metadata']['name']}: {statuses}\n{self.log(pod)[-3000:]}")
        return "\n".join(lines) or "no agent pod"


def restarts(pod: dict[str, Any]) -> int:
    return sum(int(c.get("restartCount", 0)) for c in pod["status"].get("containerStatuses", []))


PROMETHEUS_PACKAGE = "prometheus"


def prometheus_config(pods: list[dict[str, Any]], interval: str) -> str:
    """A Prometheus scrape of every pod whose annotations ask for it, at the port and path
    they name, as the usual `kubernetes_sd_configs` (role pod) relabelling makes it. Debian's
    Prometheus is built without Kubernetes discovery, so the pods come from the API server
    through the test, and Prometheus gets them as static targets."""
    prefix = "prometheus.io/"
    targets = []
    for pod in pods:
        notes = pod["metadata"].get("annotations", {})
        if notes.get(f"{prefix}scrape") != "true":
            continue
        targets.append(
            {
                "targets": [f"{pod['status']['podIP']}:{notes[f'{prefix}port']}"],
                "labels": {
                    "kubernetes_pod": pod["metadata"]["name"],
                    "__metrics_path__": notes.get(f"{prefix}path", "/metrics"),
                },
            }
        )
    job = {"job_name": "kubernetes-pods", "scrape_interval": interval, "static_configs": targets}
    return yaml.safe_dump({"global": {"scrape_interval": interval}, "scrape_configs": [job]})


def dashboard_queries(node: str) -> list[tuple[str, str]]:
    """(panel, PromQL) of every target of the shipped Grafana dashboard, its variables set
    as a user who picks this node and every pod would."""
    dashboard = json.loads((REPO / "deploy" / "grafana" / "kuscale-dashboard.json").read_text())
    return [
        (panel["title"], target["expr"].replace("$node", node).replace("$pod", ".*"))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
