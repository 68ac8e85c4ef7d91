"""kuscale on a real node: a real API server, scheduler and kubelet (built from the Kubernetes
modules) over Debian's containerd and runc, each test as an operator would see it."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e.e2eagent import (
    DEPLOY,
    NAMESPACE,
    NODE_TOKENS,
    Cluster,
    budget_cores,
    cgroup_state,
    container_cgroup,
    pod_cgroup,
    quota_cores,
    running_agent,
    until,
    usage_cores,
)
from e2e.e2enode import NODE_NAME

AGENT = "system:serviceaccount:kuscale-system:kuscale"
NODE_MEMORY_BUDGET = 4 << 30
WINDOW = 6.0
"""Seconds of use averaged in each measurement: long enough that a busy machine's noise
averages out, short enough for the warm run's five minutes."""


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, with every pod the test made deleted after it."""
    yield cluster
    cluster.delete_all_pods()


def can(cluster: Cluster, verb: str, resource: str) -> bool:
    answer = cluster.kubectl("auth", "can-i", verb, resource, f"--as={AGENT}", check=False)
    return answer.strip().startswith("yes")


def held(pod: dict[str, Any]) -> float | None:
    """The pod cgroup's quota in cores, once the agent has written one."""
    return quota_cores(pod_cgroup(pod))


def test_every_manifest_is_accepted_by_the_real_api_server(cluster: Cluster) -> None:
    for directory in [DEPLOY / "base", *sorted((DEPLOY / "overlays").iterdir())]:
        applied = cluster.kubectl(
            "apply", "--server-side", "--dry-run=server", "-k", str(directory)
        )
        assert "daemonset.apps/kuscale-agent serverside-applied" in applied, applied
    assert can(cluster, "watch", "pods") and can(cluster, "list", "pods")
    assert not can(cluster, "patch", "pods/resize"), "only the resize overlay may resize"
    assert not can(cluster, "create", "pods") and not can(cluster, "get", "secrets")


def test_the_kubelet_advertises_the_agents_tokens(cluster: Cluster) -> None:
    with running_agent(cluster):
        assert cluster.node_tokens("capacity") == NODE_TOKENS
    until(lambda: cluster.node_tokens("allocatable") == 0, "the tokens go with the plugin")


def test_a_pod_is_placed_by_its_tokens_and_held_to_its_budget(
    pods: Cluster, record_property: Callable[[str, object], None]
) -> None:
    with running_agent(pods) as agent:
        pods.create_pod("budget", 300)
        pod = pods.running("budget")
        assert pod["spec"]["nodeName"] == NODE_NAME, "the scheduler placed it"
        until(lambda: agent.recorded() == [f"{NAMESPACE}_budget.json"], "the agent adopts it")
        budget = budget_cores(300)
        until(lambda: (held(pod) or 99) <= budget * 1.01, "the pod is held to its budget")
        (used,) = usage_cores([pod_cgroup(pod)], WINDOW)
        record_property("cores used / budget", f"{used:.3f} / {budget}")
        assert 0.3 * budget < used <= 1.1 * budget, f"{used:.2f} cores against {budget}"

        pods.create_pod("too-many", NODE_TOKENS - 300 + 1)
        waiting = until(lambda: _unschedulable(pods, "too-many"), "too-many is refused", 60)
        assert "kuscale.com/token" in waiting["message"]
        assert pods.get("pod", "too-many")["status"]["phase"] == "Pending"
    assert "Forbidden" not in agent.output()


def _unschedulable(cluster: Cluster, name: str) -> dict[str, Any] | None:
    conditions = cluster.get("pod", name)["status"].get("conditions", [])
    for condition in conditions:
        if condition["type"] == "PodScheduled" and condition["status"] == "False":
            return dict(condition)
    return None


def test_two_busy_pods_split_a_full_node_by_tokens(
    pods: Cluster, record_property: Callable[[str, object], None]
) -> None:
    with running_agent(pods) as agent:
        pods.create_pod("rich", 600)
        pods.create_pod("poor", 300)
        rich, poor = pods.running("rich"), pods.running("poor")
        until(lambda: len(agent.recorded()) == 2, "the agent adopts both")
        until(lambda: held(poor) is not None and held(rich) is not None, "both are held")
        time.sleep(3)
        rich_used, poor_used = usage_cores([pod_cgroup(rich), pod_cgroup(poor)], WINDOW)
    ratio = rich_used / poor_used
    record_property("cores of 600 and 300 tokens", f"{rich_used:.3f} and {poor_used:.3f}")
    assert 1.5 < ratio < 2.7, f"{rich_used:.2f} and {poor_used:.2f} cores: not about 2 : 1"


def test_a_deleted_pod_is_completed_and_forgotten(pods: Cluster) -> None:
    with running_agent(pods) as agent:
        pods.create_pod("short", 200)
        pods.running("short")
        until(lambda: agent.recorded() == [f"{NAMESPACE}_short.json"], "the agent adopts it")
        pods.delete_pod("short")
        until(lambda: agent.recorded() == [], "the agent forgets it")
        assert agent.alive()


def test_sigterm_gives_back_every_limit(pods: Cluster) -> None:
    pod, before = _placed_untouched(pods, "given-back")
    with running_agent(pods) as agent:
        until(lambda: held(pod) is not None, "the agent holds the pod")
        assert agent.stop(signal.SIGTERM) == 0
    assert cgroup_state(pod) == before
    assert agent.recorded() == []


def test_sigkill_then_a_new_agent_adopts_and_gives_back(pods: Cluster) -> None:
    pod, before = _placed_untouched(pods, "crashed")
    with running_agent(pods) as first:
        until(lambda: held(pod) is not None, "the agent holds the pod")
        first.stop(signal.SIGKILL)
    assert held(pod) is not None, "a killed agent leaves its limit until the next one"
    assert first.recorded() == [f"{NAMESPACE}_crashed.json"]
    with running_agent(pods) as second:
        until(
            lambda: "adopted with the originals it recorded" in second.output(),
            "the new agent adopts what the first held",
        )
        assert second.stop(signal.SIGTERM) == 0
    assert cgroup_state(pod) == before
    assert second.recorded() == []


def _placed_untouched(cluster: Cluster, name: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A running pod and its cgroups as the kubelet made them: an agent that writes nothing
    advertises the tokens it needs to be placed, and is gone before the test's agent."""
    with running_agent(cluster, "--monitor-only") as watching:
        cluster.create_pod(name, 200)
        pod = cluster.running(name)
        before = cgroup_state(pod)
        watching.stop()
    return pod, before


def test_the_resize_actuator_goes_through_the_kubelet(
    pods: Cluster, record_property: Callable[[str, object], None]
) -> None:
    pods.apply_account(DEPLOY / "overlays" / "resize")
    try:
        with running_agent(pods, "--actuator=resize") as agent:
            pods.create_pod("resized", 300, cpu=("100m", "1"))
            until(lambda: _spec_limit(pods, "resized") != "1", "the agent resizes it", 120)
            budget_milli = budget_cores(300) * 1000
            pod = until(lambda: _resized_and_applied(pods, "resized"), "the kubelet applies it")
            limit = _milli(pod["spec"]["containers"][0]["resources"]["limits"]["cpu"])
            assert limit <= budget_milli * 1.01
            assert quota_cores(container_cgroup(pod)) == pytest.approx(limit / 1000, abs=0.01)
            (used,) = usage_cores([container_cgroup(pod)], WINDOW)
            record_property("limit applied / cores used", f"{limit:.0f}m / {used:.3f}")
            assert used <= limit / 1000 * 1.1
            assert "Forbidden" not in agent.output()
            assert "replaced" not in agent.output(), "each resize made the pod a new one"
            assert agent.stop(signal.SIGTERM) == 0
        until(lambda: _spec_limit(pods, "resized") == "1", "the stop gives the limit back")
    finally:
        pods.apply_account(DEPLOY / "base")


def _spec_limit(cluster: Cluster, name: str) -> str:
    pod = cluster.get("pod", name)
    return str(pod["spec"]["containers"][0]["resources"]["limits"]["cpu"])


def _milli(quantity: str) -> float:
    return float(quantity[:-1]) if quantity.endswith("m") else float(quantity) * 1000


def _resized_and_applied(cluster: Cluster, name: str) -> dict[str, Any] | None:
    """The pod once the kubelet reports the limit its spec asks for as applied."""
    pod = cluster.get("pod", name)
    statuses = pod["status"].get("containerStatuses", [])
    resizing = {"PodResizePending", "PodResizeInProgress"}
    if not statuses or resizing & {c["type"] for c in pod["status"].get("conditions", [])}:
        return None
    wanted = _milli(pod["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    reported = statuses[0].get("resources", {}).get("limits", {}).get("cpu")
    if reported is None or _milli(reported) != wanted:
        return None
    return pod


def test_the_plugin_registers_again_after_a_kubelet_restart(pods: Cluster) -> None:
    node = pods.node
    with running_agent(pods) as agent:
        pods.create_pod("before", 200)
        pods.running("before")
        node.components["kubelet"].stop()
        node.launch_kubelet()
        until(node.node_ready, "the node is Ready again", 120)
        until(lambda: pods.node_tokens("allocatable") == NODE_TOKENS, "the tokens are back")
        pods.create_pod("after", 200)
        pods.running("after")
        until(lambda: len(agent.recorded()) == 2, "the agent holds both pods")
        assert agent.alive()


def test_the_kubelet_leaves_a_pods_cgroups_as_kuscale_wrote_them(pods: Cluster) -> None:
    """Two of the kubelet's syncs (5 s each here) and a pod update pass over a pod whose
    cgroups hold a quota and weight the kubelet did not set; they stay as written. An agent
    that writes nothing advertises the tokens the pod needs to be placed."""
    with running_agent(pods, "--monitor-only"):
        pods.create_pod("written", 200, cpu=("100m", "1"))
        pod = pods.running("written")
    written = {"cpu.cfs_quota_us": "30000", "cpu.shares": "777"}
    for cgroup in (container_cgroup(pod), pod_cgroup(pod)):
        for knob in ("cpu.shares", "cpu.cfs_quota_us"):
            (cgroup / knob).write_text(written[knob])
    pods.kubectl("annotate", "pod", "written", "-n", NAMESPACE, "kuscale.test/poke=1")
    time.sleep(12)
    for cgroup in (pod_cgroup(pod), container_cgroup(pod)):
        for knob, value in written.items():
            assert (cgroup / knob).read_text().strip() == value, f"{cgroup.name}/{knob}"


def test_the_whole_node_fits_its_memory_budget(
    pods: Cluster, record_property: Callable[[str, object], None]
) -> None:
    with running_agent(pods):
        pods.create_pod("measured", 200)
        pods.running("measured")
        used = pods.node.memory_bytes()
    record_property("resident MiB of the node's processes", f"{used / 2**20:.0f}")
    assert 0 < used < NODE_MEMORY_BUDGET
