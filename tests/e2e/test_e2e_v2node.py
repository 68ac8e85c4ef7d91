"""Two nodes: the cgroup v1 host and the cgroup v2 guest (`guestnode`), one cluster, kuscale
installed as it ships (its image in each node's containerd, the DaemonSet from a test
overlay), and what an operator of a v2 node would check: both nodes offer their tokens, the
scheduler places a pod that does not fit one node on the other, and on the v2 node the agent
in its pod holds budgets through `cpu.max` and `cpu.weight` under the kubelet, from a private
cgroup namespace, with a PSI trigger on each pod, survives a SIGKILL, and gives every limit
back on uninstall.

This module runs last of the folder (pytest takes its files in name order): the guest joins
after the host's own tests, whose timings a VM in software emulation beside them would
disturb, and the shipped tests' uninstall has left the cluster without kuscale."""

from __future__ import annotations

import functools
import json
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e.e2eagent import (
    AGENT_CONFIG,
    BUSY,
    NAMESPACE,
    NODE_TOKENS,
    Cluster,
    budget_cores,
    pod_manifest,
    until,
)
from e2e.e2enode import NODE_NAME
from e2e.guestnode import GUEST_CGROUP, GUEST_NODE, GuestNode, node_info
from e2e.shipped import AGENT_NAMESPACE, Shipped, restarts
from e2e.test_e2e_node import _milli, _unschedulable
from e2e.test_e2e_shipped import spec_limit, version

GUEST_RECORD = "/var/lib/kuscale/originals"
"""The DaemonSet's hostPath for the record, in the guest."""
WINDOW = 8.0
"""Seconds of use measured at once: twice the host's window, as the guest's clock ticks are
coarser under emulation."""
AGENT_READY_S = 600.0
"""An agent's Python starts about 20 times slower in the guest than on the host."""
HOSTNAME = "kubernetes.io/hostname"
IDLE = ["sleep", "3600"]
CONFIG = AGENT_CONFIG + "\n[policy]\nburst_factor = 0.5\nburst_seconds = 10.0\n"
"""Saved credit that a burst may spend, as an operator who wants bursts covered sets it: an
idle pod then holds its estimate rather than its whole budget, so a burst needs the watch."""


@pytest.fixture(scope="module")
def two_nodes(cluster: Cluster, guest: GuestNode) -> Iterator[TwoNodes]:
    """The agent's image the guest imported as it booted, in the host's containerd too, and
    the DaemonSet applied: one agent pod on each node, both Ready."""
    (archive,) = guest.archives
    cluster.node.ctr("images", "import", str(archive), timeout=600)
    started = time.monotonic()
    until(lambda: guest.imported(archive), "the guest imports the agent's image", 600)
    waited = time.monotonic() - started
    made = TwoNodes(Shipped(cluster, version()), guest)
    made.shipped.install(config=CONFIG)
    made.agent(NODE_NAME)
    made.agent(GUEST_NODE)
    made.figures = (
        f"guest Ready {guest.ready_seconds:.0f} s after the VM started; its boot steps, s: "
        f"{guest.boot_steps()}; waited {waited:.0f} s more for the image; the agent's pod "
        f"Ready {time.monotonic() - started - waited:.0f} s after the install"
    )
    yield made
    made.shipped.uninstall()


@pytest.fixture
def pods(two_nodes: TwoNodes) -> Iterator[TwoNodes]:
    yield two_nodes
    two_nodes.shipped.cluster.delete_all_pods()


class TwoNodes:
    def __init__(self, shipped: Shipped, guest: GuestNode) -> None:
        self.shipped = shipped
        self.cluster = shipped.cluster
        self.guest = guest
        self.figures = ""

    def agent(self, node: str) -> dict[str, Any]:
        """The Ready agent pod on `node`, once it is the only one there."""
        try:
            pod = until(
                lambda: self._ready_agent(node), f"the agent on {node} is Ready", AGENT_READY_S
            )
        except AssertionError as err:
            raise AssertionError(
                f"{err}\n{self.shipped.explain()}\n{self.guest.explain()}"
            ) from None
        assert isinstance(pod, dict)
        return pod

    def _ready_agent(self, node: str) -> dict[str, Any] | None:
        mine = [p for p in self.shipped.agent_pods() if p["spec"].get("nodeName") == node]
        if len(mine) != 1:
            return None
        conditions = mine[0]["status"].get("conditions", [])
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        return mine[0] if ready else None

    def until(self, condition: Callable[[], Any], what: str, deadline: float = 120.0) -> Any:
        """`until`, failing with each agent's last lines."""
        try:
            return until(condition, what, deadline)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.shipped.explain()}") from None

    def create_pod(
        self, name: str, tokens: int, node: str | None = GUEST_NODE, **extra: Any
    ) -> dict[str, Any]:
        """A busy pod asking `tokens` (0: none at all, a pod kuscale leaves alone), on `node`
        (None: where the scheduler likes)."""
        pod = pod_manifest(name, tokens, **extra)
        if not tokens:
            del pod["spec"]["containers"][0]["resources"]["limits"]["kuscale.com/token"]
        if node is not None:
            pod["spec"]["nodeSelector"] = {HOSTNAME: node}
        self.cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pod))
        return self.cluster.running(name)

    def recorded(self) -> set[str]:
        """The pods the guest's agent keeps originals of, in its hostPath."""
        listing = self.guest.sh(f"ls {GUEST_RECORD} 2> /dev/null || true")
        return {name for name in listing.split() if name.endswith(".json")}

    def adopted(self, *names: str) -> Callable[[], bool]:
        wanted = {f"{NAMESPACE}_{n}.json" for n in names}
        return lambda: wanted <= self.recorded()

    def cgroups(self, pod: dict[str, Any]) -> tuple[str, str]:
        """The pod's cgroup and its container's in the guest, where the kubelet's cgroupfs
        driver puts them on v2."""
        qos = {"Burstable": "burstable/", "BestEffort": "besteffort/", "Guaranteed": ""}
        leaf = f"{qos[str(pod['status']['qosClass'])]}pod{pod['metadata']['uid']}"
        cgroup = f"{GUEST_CGROUP}/kubepods/{leaf}"
        container = str(pod["status"]["containerStatuses"][0]["containerID"]).partition("://")[2]
        return cgroup, f"{cgroup}/{container}"

    def state(self, pod: dict[str, Any]) -> dict[str, str]:
        """cpu.max and cpu.weight of the pod and its container."""
        names = [f"{c}/{knob}" for c in self.cgroups(pod) for knob in ("cpu.max", "cpu.weight")]
        output = self.guest.sh("".join(f"echo $(cat {shlex.quote(n)})\n" for n in names))
        return dict(zip(["pod/cpu.max", "pod/cpu.weight", "container/cpu.max",
                         "container/cpu.weight"], output.splitlines(), strict=True))  # fmt: skip

    def held(self, pod: dict[str, Any]) -> float | None:
        """The pod's cpu.max in cores; None where it has none."""
        quota, period = self.state(pod)["pod/cpu.max"].split()
        return None if quota == "max" else int(quota) / int(period)

    def used(self, pods: list[dict[str, Any]], window: float = WINDOW) -> list[float]:
        """Cores each pod used over the same window, from `usage_usec` in its cpu.stat, timed
        by the guest's own clock."""
        stats = " ".join(shlex.quote(f"{self.cgroups(p)[0]}/cpu.stat") for p in pods)
        look = f"cat /proc/uptime; for f in {stats}; do grep usage_usec $f; done\n"
        output = self.guest.sh(f"{look}sleep {window}\n{look}").split()
        numbers = [float(n) for n in output if re.fullmatch(r"[\d.]+", n)]
        half = len(numbers) // 2
        before, after = numbers[:half], numbers[half:]
        elapsed = after[0] - before[0]
        return [(a - b) / 1e6 / elapsed for a, b in zip(after[2:], before[2:], strict=True)]

    def fast_raises(self) -> float:
        """The guest's agent's count of CPU limits its watch raised between ticks, from its
        metrics, read in the guest (nothing outside reaches the pod's address)."""
        address = self._ready_agent(GUEST_NODE)
        assert address is not None
        url = f"http://{address['status']['podIP']}:9091/metrics"
        metrics = self.guest.sh(f"busybox wget -q -O - {url}")
        found = re.search(r'^kuscale_fast_raises_total\{[^}]*resource="cpu"[^}]*\} (\S+)$',
                          metrics, re.M)  # fmt: skip
        assert found, metrics[-2000:]
        return float(found.group(1))

    def agent_pid(self) -> int:
        """The guest's agent process, as the guest sees it."""
        return int(self.guest.sh("pgrep -f 'kuscale agent' | head -n 1").strip())


def test_both_nodes_are_ready_and_offer_their_tokens(
    pods: TwoNodes, record_property: Callable[[str, object], None]
) -> None:
    record_property("the v2 node", pods.figures)
    for name in (NODE_NAME, GUEST_NODE):
        info = node_info(pods.cluster.node, name)
        record_property(name, f"{info['kubeletVersion']}, kernel {info['kernelVersion']}")
        until(functools.partial(_offers, pods, name), f"{name} offers its tokens", 120)
    assert pods.guest.sh(f"stat -fc %T {GUEST_CGROUP}").strip() == "cgroup2fs"
    memory = pods.guest.memory_mib()
    record_property("the guest's memory, MiB", json.dumps(memory))
    assert memory["available"] >= 200, memory


def _offers(pods: TwoNodes, node: str) -> bool:
    return pods.cluster.node_tokens("allocatable", node) == NODE_TOKENS


def test_a_pod_that_does_not_fit_one_node_is_placed_on_the_other(pods: TwoNodes) -> None:
    first = pods.create_pod("big-host", 700, node=NODE_NAME, command=["sleep", "3600"])
    assert first["spec"]["nodeName"] == NODE_NAME
    second = pods.create_pod("big-anywhere", 700, node=None, command=["sleep", "3600"])
    assert second["spec"]["nodeName"] == GUEST_NODE, "only the v2 node has 700 tokens left"
    third = pod_manifest("big-third", 700, command=["sleep", "3600"])
    pods.cluster.kubectl("apply", "-f", "-", stdin=json.dumps(third))
    refused = until(lambda: _unschedulable(pods.cluster, "big-third"), "a third finds no node", 60)
    assert "kuscale.com/token" in refused["message"]


def test_on_v2_a_pod_is_held_to_its_budget_through_cpu_max(
    pods: TwoNodes, record_property: Callable[[str, object], None]
) -> None:
    pod = pods.create_pod("budget", 300)
    pods.until(pods.adopted("budget"), "the guest's agent adopts it", 120)
    budget = budget_cores(300)
    until(lambda: (pods.held(pod) or 99) <= budget * 1.01, "the pod is held to its budget", 120)
    (used,) = pods.used([pod])
    record_property("cores used / budget", f"{used:.3f} / {budget}")
    assert 0.3 * budget < used <= 1.1 * budget


def test_on_v2_two_busy_pods_split_the_node_by_cpu_weight(
    pods: TwoNodes, record_property: Callable[[str, object], None]
) -> None:
    rich, poor = pods.create_pod("rich", 600), pods.create_pod("poor", 300)
    pods.until(pods.adopted("rich", "poor"), "the guest's agent adopts both", 120)
    until(lambda: pods.held(rich) is not None and pods.held(poor) is not None, "both held", 120)
    weights = {
        name: pods.state(p)["pod/cpu.weight"] for name, p in (("rich", rich), ("poor", poor))
    }
    rich_used, poor_used = pods.used([rich, poor])
    record_property(
        "cores of 600 and 300 tokens (cpu.weight)",
        f"{rich_used:.3f} and {poor_used:.3f} ({weights['rich']} and {weights['poor']})",
    )
    assert int(weights["rich"]) > int(weights["poor"])
    assert 1.5 < rich_used / poor_used < 2.7


def test_the_v2_kubelet_leaves_cpu_max_and_weight_as_written(pods: TwoNodes) -> None:
    """Two syncs (5 s each here) and a pod update pass over a pod whose cgroups hold a
    cpu.max and cpu.weight the kubelet did not set; a pod without tokens, so no agent writes
    them."""
    pod = pods.create_pod("written", 0, cpu=("100m", "1"), command=["sleep", "3600"])
    written = {"cpu.max": "30000 100000", "cpu.weight": "77"}
    pods.guest.sh(
        "".join(f"echo {shlex.quote(v)} > {c}/{k}\n" for c in pods.cgroups(pod)
                for k, v in written.items())
    )  # fmt: skip
    pods.cluster.kubectl("annotate", "pod", "written", "-n", NAMESPACE, "kuscale.test/poke=1")
    time.sleep(12)
    state = pods.state(pod)
    assert set(state.values()) == set(written.values()), state


def test_the_v2_agent_sleeps_on_a_psi_trigger_for_each_pod(
    pods: TwoNodes, record_property: Callable[[str, object], None]
) -> None:
    """Between ticks the watch waits on one trigger per pod: an open cpu.pressure."""
    pods.create_pod("watched-a", 200, command=IDLE)
    pods.create_pod("watched-b", 200, command=IDLE)
    pods.until(pods.adopted("watched-a", "watched-b"), "the guest's agent adopts both")
    pid = pods.agent_pid()
    until(lambda: _pressure_files(pods, pid) >= 2, "a trigger on each pod", 60)
    record_property("cpu.pressure files the agent holds open", _pressure_files(pods, pid))


def test_from_a_private_cgroup_namespace_a_pods_process_resolves_to_the_kubelets_cgroup(
    pods: TwoNodes, record_property: Callable[[str, object], None]
) -> None:
    """containerd 1.6 gives a privileged container, as the DaemonSet's agent is, the node's
    cgroup namespace, and an unprivileged one its own. A process of the guest in a cgroup
    namespace of its own (`unshare --cgroup`, as an unprivileged container is) reads another
    pod's process as climbing out of it, and `kuscale pod-cgroups --pid` still names that
    pod's cgroup on the node."""
    agent = pods.agent_pid()
    shared = pods.guest.sh(f"readlink /proc/1/ns/cgroup /proc/{agent}/ns/cgroup").split()
    record_property("the shipped agent's cgroup namespace is the node's", shared[0] == shared[1])
    pod = pods.create_pod("resolved", 200, command=IDLE)
    target = pods.guest.read(f"{pods.cgroups(pod)[1]}/cgroup.procs").split()[0]
    probe = f"{GUEST_CGROUP}/kuscale-e2e-probe/namespace"
    kuscale = shlex.join([sys.executable, "-m", "kuscale", "pod-cgroups", f"--pid={target}"])
    inside = pods.guest.sh(
        f"mkdir -p {probe} && echo $$ > {probe}/cgroup.procs && exec unshare --cgroup "
        f"sh -c {shlex.quote(f'cat /proc/{target}/cgroup; {kuscale}')}",
        timeout=600,
    )
    pods.guest.sh(f"rmdir {probe} {probe.rpartition('/')[0]}")
    seen = inside.splitlines()[0]
    assert seen.startswith("0::/../../kubepods/"), inside
    assert f"pod        {pods.cgroups(pod)[0]}" in inside, inside


def _pressure_files(pods: TwoNodes, pid: int) -> int:
    links = pods.guest.sh(f"for f in /proc/{pid}/fd/*; do readlink $f; done")
    return sum(1 for line in links.splitlines() if line.endswith("/cpu.pressure"))


WAITING = ["sh", "-c", "until [ -e /go ]; do sleep 0.1; done; " + BUSY[2]]
"""Idle until the test drops /go into the container, then two busy loops: more than the
limit an idle pod holds, whatever credit it saved."""


def test_on_v2_a_burst_is_raised_between_ticks_by_its_psi_trigger(
    pods: TwoNodes, record_property: Callable[[str, object], None]
) -> None:
    """An idle pod begins to spin; the guest samples its cpu.max every few tens of ms from
    the moment it is told to, until the limit rises; the agent counts a fast raise."""
    pod = pods.create_pod("burst", 300, command=WAITING)
    pods.until(pods.adopted("burst"), "the guest's agent adopts it")
    until(lambda: pods.held(pod) is not None, "held while idle", 120)
    cgroup, container = pods.cgroups(pod)
    raises = pods.fast_raises()
    samples = pods.guest.sh(
        f"pid=$(head -n 1 {container}/cgroup.procs)\n"
        f"before=$(cat {cgroup}/cpu.max)\n"
        'echo "$(date +%s.%N) $before"\n'
        "touch /proc/$pid/root/go\n"
        "end=$(( $(date +%s) + 30 ))\n"
        "while [ $(date +%s) -lt $end ]; do\n"
        f'  now=$(cat {cgroup}/cpu.max); echo "$(date +%s.%N) $now"\n'
        "  quota=${now%% *}\n"
        '  if [ "$quota" = max ] || [ "$quota" -gt "${before%% *}" ]; then break; fi\n'
        "  sleep 0.02\n"
        "done\n"
    ).splitlines()
    start, before_quota, _ = samples[0].split()
    raised_at, after_quota, _ = samples[-1].split()
    assert after_quota == "max" or int(after_quota) > int(before_quota), samples[-3:]
    reaction = float(raised_at) - float(start)
    record_property(
        "burst to raise, s (period 1 s; samples; cpu.max before and after)",
        f"{reaction:.3f} ({len(samples)}; {before_quota} and {after_quota})",
    )
    until(lambda: pods.fast_raises() > raises, "the watch, not a tick, raised it", 30)


def test_on_v2_a_killed_agent_container_is_restarted_and_adopts(pods: TwoNodes) -> None:
    pod = pods.create_pod("survivor", 300)
    pods.until(pods.adopted("survivor"), "the guest's agent adopts it", 120)
    agent = pods.agent(GUEST_NODE)
    container = agent["status"]["containerStatuses"][0]["containerID"].partition("://")[2]
    pods.guest.ctr("tasks", "kill", "--signal", "SIGKILL", container)
    restarted = until(
        lambda: (p := pods._ready_agent(GUEST_NODE)) and restarts(p) > restarts(agent) and p,
        "the v2 kubelet restarts the agent",
        AGENT_READY_S,
    )
    assert pods.held(pod) is not None, "a killed agent leaves its limit to the next one"
    until(
        lambda: "adopted with the originals it recorded" in pods.shipped.log(restarted),
        "the restarted agent adopts what the killed one held",
        120,
    )
    assert pods.held(pod) is not None, "the restarted agent holds it"


def test_on_v2_a_deleted_pod_is_forgotten(pods: TwoNodes) -> None:
    pods.create_pod("short", 200)
    pods.until(pods.adopted("short"), "the guest's agent adopts it", 120)
    pods.cluster.delete_pod("short")
    until(lambda: not pods.recorded(), "the agent forgets it", 120)


def test_on_v2_uninstall_gives_cpu_max_and_weight_back_exactly(
    two_nodes: TwoNodes, record_property: Callable[[str, object], None]
) -> None:
    """The pod the agent holds and a twin of the same spec without tokens, which the kubelet
    alone wrote: once the agent's pod is stopped (SIGTERM, then its grace period), the held
    pod's cgroups read as the twin's."""
    pods = two_nodes
    twin = pods.create_pod("twin", 0, cpu=("100m", "1"), command=["sleep", "3600"])
    held = pods.create_pod("returned", 300, cpu=("100m", "1"))
    until(lambda: (pods.held(held) or 99) <= budget_cores(300) * 1.01, "the agent holds it", 120)
    assert pods.state(held) != pods.state(twin)
    started = time.monotonic()
    pods.shipped.uninstall()
    until(lambda: not pods.shipped.agent_pods(), "the agents' pods are gone", 180)
    record_property("uninstall to every limit back, s", f"{time.monotonic() - started:.1f}")
    assert pods.state(held) == pods.state(twin)
    assert not pods.recorded(), "the record is empty"
    pods.cluster.delete_all_pods()


def test_on_v2_the_resize_overlay_resizes_through_the_kubelet(
    pods: TwoNodes, record_property: Callable[[str, object], None]
) -> None:
    """After the uninstall, the resize overlay's agent on the v2 node: the pod's declared
    limit changes through `pods/resize`, the v2 kubelet writes it to the container's
    cpu.max, and the DaemonSet's deletion gives the declared limit back."""
    pods.shipped.install("overlays/resize", CONFIG)
    try:
        pods.agent(GUEST_NODE)
        pod = pods.create_pod("resized", 300, cpu=("100m", "1"))
        pods.until(lambda: spec_limit(pods.shipped, "resized") != "1", "the agent resizes it")
        _, container = pods.cgroups(pod)

        def applied() -> tuple[float, float] | None:
            """(declared, written) once the container's cpu.max is what its spec declares."""
            declared = _milli(spec_limit(pods.shipped, "resized"))
            quota, period = pods.guest.read(f"{container}/cpu.max").split()
            written = int(quota) * 1000 / int(period)
            return (declared, written) if abs(declared - written) < 10 else None

        declared, written = until(applied, "the v2 kubelet writes the declared limit to cpu.max")
        record_property("declared limit / container cpu.max", f"{declared:.0f}m / {written:.0f}m")
        assert declared < 1000
        pods.cluster.kubectl(
            "delete", "daemonset", "kuscale-agent", "-n", AGENT_NAMESPACE, "--wait=true",
            "--cascade=foreground", "--timeout=300s",
        )  # fmt: skip
        until(lambda: spec_limit(pods.shipped, "resized") == "1", "the stop gives it back")
    finally:
        pods.shipped.uninstall("overlays/resize")
