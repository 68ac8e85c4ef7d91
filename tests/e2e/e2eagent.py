"""kuscale on the real node, as an operator runs it: the manifests applied, the agent started
with the credentials the manifests give it, pods made through the API server, and their use
read from the kubelet's own cgroups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes.utils import parse_quantity

from e2e.e2enode import IMAGE, NODE_NAME, REPO, WORK, Component, Node, free_port, kubeconfig

DEPLOY = REPO / "deploy" / "kubernetes"
NAMESPACE = "e2e"
NODE_TOKENS = 1000
CPU_PRICE = 5.0
"""Tokens per percent of a core per second on this node: 300 tokens buy 0.6 of a core, so
budgets bind on two cores, whose capacity then costs the 1000 tokens the DaemonSet's agent
advertises (the process agent is told them)."""
BUSY = ["sh", "-c", "while :; do :; done & while :; do :; done"]
"""Two busy loops: a pod that would take both cores if nothing held it."""
REGISTERED = "registered kuscale.com/token"
AGENT_CONFIG = f"""[agent]
period = 1.0
policy = "kuscale"

[resources.cpu]
price = {CPU_PRICE}
# 2 % of a core: 10 tokens pay for it, so 50 small pods fit the node's 1000 tokens.
min = 2.0
"""


def budget_cores(tokens: int) -> float:
    return tokens / CPU_PRICE / 100


def until(condition: Callable[[], Any], what: str, deadline: float = 90.0) -> Any:
    """The first truthy answer of `condition`, polled; a missed deadline fails saying what."""
    end = time.monotonic() + deadline
    while True:
        answer = condition()
        if answer:
            return answer
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline:.0f} s")
        time.sleep(0.5)


@dataclass
class Cluster:
    node: Node
    agent_kubeconfig: Path
    agent_config: Path

    @classmethod
    def prepare(cls, node: Node) -> Cluster:
        """The base manifests' account and its rights applied for real (not the DaemonSet:
        these tests run the agent as a process; `test_e2e_shipped` runs it as the DaemonSet),
        a namespace for the tests' pods, and a token of the agent's service account from the
        TokenRequest API."""
        cluster = cls(node, WORK / "agent.kubeconfig", WORK / "agent.toml")
        cluster.apply_account(DEPLOY / "base")
        cluster.kubectl("create", "namespace", NAMESPACE)
        account = ("get", "serviceaccount", "default", "-n", NAMESPACE)
        until(
            lambda: cluster.kubectl(*account, check=False).startswith("NAME"),
            "the service account controller makes the namespace's default account",
        )
        token = cluster.kubectl(
            "create", "token", "kuscale", "-n", "kuscale-system", "--duration=4h"
        ).strip()
        cluster.agent_kubeconfig.write_text(
            kubeconfig(node.server, node.certs.path("ca.crt"), {"token": token})
        )
        cluster.agent_config.write_text(AGENT_CONFIG)
        return cluster

    def apply_account(self, directory: Path) -> None:
        """Everything a kustomization makes but its DaemonSet: the agent's account, its
        rights, its config."""
        rendered = yaml.safe_load_all(self.kubectl("kustomize", str(directory)))
        kept = [item for item in rendered if item and item["kind"] != "DaemonSet"]
        self.kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(kept))

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        done = subprocess.run(
            self.node.kubectl_argv(*args),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done.stdout + (done.stderr if not check else "")

    def get(self, kind: str, name: str = "", namespace: str = NAMESPACE) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(
            self.kubectl("get", kind, *([name] if name else []), "-n", namespace, "-o", "json")
        )
        return answer

    def node_tokens(self, field: str, name: str = NODE_NAME) -> int:
        node = self.get("node", name)
        return int(parse_quantity(node["status"].get(field, {}).get("kuscale.com/token", "0")))

    def create_pod(
        self,
        name: str,
        tokens: int,
        cpu: tuple[str, str] | None = None,
        command: list[str] = BUSY,
    ) -> dict[str, Any]:
        """A busy pod asking `tokens` (or one running `command`); with `cpu` (request,
        limit) a Burstable pod whose container declares them."""
        pod = pod_manifest(name, tokens, cpu, command)
        self.kubectl("apply", "-f", "-", stdin=json.dumps(pod))
        return pod

    def create_pods(self, pods: list[dict[str, Any]]) -> None:
        """Many pods at once, in one request's list."""
        self.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                           "items": pods}))  # fmt: skip

    def running(self, name: str) -> dict[str, Any]:
        try:
            pod = until(lambda: self._running(name), f"pod {name} runs", 120)
        except AssertionError as err:
            described = self.kubectl("describe", "pod", name, "-n", NAMESPACE, check=False)
            raise AssertionError(f"{err}:\n{described[-2500:]}") from None
        assert isinstance(pod, dict)
        return pod

    def _running(self, name: str) -> dict[str, Any] | None:
        pod = self.get("pod", name)
        return pod if pod["status"].get("phase") == "Running" else None

    def delete_pod(self, name: str) -> None:
        self.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=true", "--timeout=90s")

    def delete_all_pods(self) -> None:
        self.kubectl("delete", "pods", "--all", "-n", NAMESPACE, "--wait=true", "--timeout=90s")


def pod_manifest(
    name: str, tokens: int, cpu: tuple[str, str] | None = None, command: list[str] = BUSY
) -> dict[str, Any]:
    limits: dict[str, str] = {"kuscale.com/token": str(tokens)}
    requests: dict[str, str] = {}
    if cpu is not None:
        requests["cpu"], limits["cpu"] = cpu
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "busy",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": command,
                    "resources": {"limits": limits, "requests": requests},
                }
            ],
        },
    }


def pod_cgroup(pod: dict[str, Any]) -> Path:
    """The pod's cgroup in the CPU hierarchy, where the kubelet's cgroupfs driver put it."""
    qos = {"Burstable": "burstable/", "BestEffort": "besteffort/", "Guaranteed": ""}
    leaf = f"{qos[str(pod['status']['qosClass'])]}pod{pod['metadata']['uid']}"
    return Path("/sys/fs/cgroup/cpu/kubepods") / leaf


def container_cgroup(pod: dict[str, Any]) -> Path:
    container_id = str(pod["status"]["containerStatuses"][0]["containerID"]).partition("://")[2]
    return pod_cgroup(pod) / container_id


def cgroup_state(pod: dict[str, Any]) -> dict[str, str]:
    """What a give-back must restore: quotas and weights of the pod and its container."""
    state = {}
    for cgroup in (pod_cgroup(pod), container_cgroup(pod)):
        for knob in ("cpu.cfs_quota_us", "cpu.shares"):
            state[f"{cgroup.name}/{knob}"] = (cgroup / knob).read_text().strip()
    return state


def quota_cores(cgroup: Path) -> float | None:
    """The cgroup's CFS quota in cores; None where it has none."""
    quota = int((cgroup / "cpu.cfs_quota_us").read_text())
    period = int((cgroup / "cpu.cfs_period_us").read_text())
    return None if quota < 0 else quota / period


def usage_cores(cgroups: list[Path], window: float) -> list[float]:
    """Cores each cgroup used on average over the same `window` seconds, from its counter."""
    counters = [
        Path(str(cgroup).replace("/cpu/", "/cpuacct/", 1)) / "cpuacct.usage" for cgroup in cgroups
    ]
    before, start = [int(c.read_text()) for c in counters], time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - start
    return [(int(c.read_text()) - b) / 1e9 / elapsed for c, b in zip(counters, before, strict=True)]


class Agent:
    """`kuscale agent --kubernetes` as a process beside the node's kubelet."""

    def __init__(self, cluster: Cluster, *extra: str) -> None:
        self.cluster = cluster
        self.metrics = f"127.0.0.1:{free_port()}"
        self.log = WORK / "logs" / f"agent-{time.monotonic_ns()}.log"
        self.record = WORK / "agent-record"
        node = cluster.node
        self.argv = [
            sys.executable, "-m", "kuscale", "agent", "--kubernetes",
            f"--kubeconfig={cluster.agent_kubeconfig}",
            f"--config={cluster.agent_config}",
            f"--kubelet-dir={node.device_plugins}",
            f"--pod-resources-socket={node.pod_resources}",
            f"--node-name={NODE_NAME}",
            f"--tokens={NODE_TOKENS}",
            f"--record-dir={self.record}",
            f"--metrics-address={self.metrics}",
            *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.component = Component("agent", self.argv, self.log, env=env)

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.component.process

    def start(self) -> Agent:
        self.component.start()
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, how: signal.Signals = signal.SIGTERM) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(how)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)

    def recorded(self) -> list[str]:
        """The pods whose originals the agent keeps: what it still owes back."""
        if not self.record.exists():
            return []
        return sorted(p.name for p in self.record.glob("*.json"))


@contextmanager
def running_agent(cluster: Cluster, *extra: str) -> Iterator[Agent]:
    """The agent, once the kubelet has its plugin: the node's status can still show the
    tokens a stopped agent advertised, and a pod placed by them before the new agent registers
    is rejected by the kubelet (UnexpectedAdmissionError: no healthy devices)."""
    agent = Agent(cluster, *extra).start()
    try:
        until(lambda: REGISTERED in agent.output() or not agent.alive(), "the plugin registers")
        until(lambda: cluster.node_tokens("allocatable") == NODE_TOKENS or not agent.alive(),
              "the node advertises kuscale.com/token", 60)  # fmt: skip
        assert agent.alive(), agent.output()[-3000:]
        yield agent
    finally:
        agent.stop()
