"""kuscale as it ships, on the real node: the agent's image built here and imported, the
DaemonSet applied with `kubectl apply -k`, and an operator's whole lifecycle: install, pods
held by the agent in its pod, its probes and its own use, a rolling update, a bad config, a
killed container, a damaged record, the resize overlay, and an uninstall.

This module runs after `test_e2e_node` (pytest takes a folder's files in name order): its
uninstall removes the agent's namespace and account, which the process agent there uses."""

from __future__ import annotations

import functools
import json
import threading
import time
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.e2eagent import (
    AGENT_CONFIG,
    NAMESPACE,
    Cluster,
    budget_cores,
    cgroup_state,
    container_cgroup,
    pod_cgroup,
    pod_manifest,
    quota_cores,
    until,
    usage_cores,
)
from e2e.e2enode import (
    NODE_NAME,
    REPO,
    WORK,
    Component,
    free_port,
    http_ok,
    install_debian_packages,
    wait_for,
)
from e2e.shipped import (
    AGENT_NAMESPACE,
    HOST_RECORD,
    PROMETHEUS_PACKAGE,
    Shipped,
    build_image,
    dashboard_queries,
    prometheus_config,
    restarts,
)

IMAGE_BUDGET_MB = 300
NODE_TOKENS = 1000
WINDOW = 6.0
HANDOVER_BUDGET_S = 5.0
IDLE = ["sleep", "2147483647"]


def version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


@pytest.fixture(scope="module")
def shipped(cluster: Cluster) -> Shipped:
    archive, seconds = build_image()
    size_mb = archive.stat().st_size / 1e6
    assert size_mb <= IMAGE_BUDGET_MB, f"the image is {size_mb:.0f} MB"
    started = time.monotonic()
    cluster.node.ctr("images", "import", str(archive), timeout=600)
    made = Shipped(cluster, version())
    cluster.node.ctr("images", "tag", "--force", made.image, f"{made.image}-next")
    made.install()
    made.ready_agent()
    made.figures = (
        f"{size_mb:.0f} MB uncompressed, built in {seconds:.0f} s; imported and Ready in "
        f"{time.monotonic() - started:.0f} s"
    )
    return made


@pytest.fixture
def pods(shipped: Shipped) -> Iterator[Shipped]:
    yield shipped
    shipped.cluster.delete_all_pods()


def held(pod: dict[str, Any]) -> float | None:
    return quota_cores(pod_cgroup(pod))


def adopted(shipped: Shipped, *names: str) -> Callable[[], bool]:
    """Each pod named has an entry in the record on the node's hostPath."""
    wanted = {f"{NAMESPACE}_{n}.json" for n in names}
    return lambda: wanted <= {p.name for p in HOST_RECORD.glob("*.json")}


def test_the_agents_pod_is_ready_and_the_node_offers_its_tokens(
    pods: Shipped, record_property: Callable[[str, object], None]
) -> None:
    record_property("the image", pods.figures)
    agent = pods.ready_agent()
    assert agent["spec"]["nodeName"] == NODE_NAME
    assert agent["spec"]["containers"][0]["image"] == pods.image
    until(lambda: pods.cluster.node_tokens("allocatable") == NODE_TOKENS, "the node offers tokens")
    assert "registered kuscale.com/token" in pods.log(agent)


def test_a_pod_is_held_to_its_budget_by_the_agent_in_its_pod(
    pods: Shipped, record_property: Callable[[str, object], None]
) -> None:
    pods.cluster.create_pod("budget", 300)
    pod = pods.cluster.running("budget")
    until(adopted(pods, "budget"), "the agent adopts it")
    budget = budget_cores(300)
    until(lambda: (held(pod) or 99) <= budget * 1.01, "the pod is held to its budget")
    (used,) = usage_cores([pod_cgroup(pod)], WINDOW)
    record_property("cores used / budget", f"{used:.3f} / {budget}")
    assert 0.3 * budget < used <= 1.1 * budget


def test_two_busy_pods_split_the_node_by_their_tokens(
    pods: Shipped, record_property: Callable[[str, object], None]
) -> None:
    pods.cluster.create_pod("rich", 600)
    pods.cluster.create_pod("poor", 300)
    rich, poor = pods.cluster.running("rich"), pods.cluster.running("poor")
    until(adopted(pods, "rich", "poor"), "the agent adopts both")
    until(lambda: held(rich) is not None and held(poor) is not None, "both are held")
    rich_used, poor_used = usage_cores([pod_cgroup(rich), pod_cgroup(poor)], WINDOW)
    record_property("cores of 600 and 300 tokens", f"{rich_used:.3f} and {poor_used:.3f}")
    assert 1.5 < rich_used / poor_used < 2.7


def idle_held_are(count: int) -> bool:
    return len(list(HOST_RECORD.glob(f"{NAMESPACE}_idle-*.json"))) == count


def agent_use(pods: Shipped, window: float) -> tuple[float, dict[str, float]]:
    """The agent container's CPU (share of one core, over `window` seconds) and resident
    memory (MiB: all of it, anonymous, file-backed), read from its cgroup on the node."""
    agent = pods.ready_agent()
    cgroup = container_cgroup(agent)
    (cores,) = usage_cores([cgroup], window)
    memory = dict.fromkeys(("VmRSS", "RssAnon", "RssFile"), 0.0)
    for pid in (cgroup / "cgroup.procs").read_text().split():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in memory:
                memory[key] += int(value.split()[0]) / 1024
    return cores, memory


def test_the_agent_pod_uses_what_its_manifest_requests(
    pods: Shipped, record_property: Callable[[str, object], None]
) -> None:
    """At 10 and 50 idle token pods (period 1 s, the watch every 100 ms): CPU and memory
    within the manifest's requests (so the scheduler counts what the agent takes), memory
    well under its limit. The CPU at 50 pods was 1.30–1.55 % of a core under kubelet 1.34.4
    and is 1.97–2.80 % under 1.37.2 on the same machine, for a reason not yet found."""
    spec = pods.ready_agent()["spec"]["containers"][0]["resources"]
    request_mib = int(spec["requests"]["memory"].removesuffix("Mi"))
    limit_mib = int(spec["limits"]["memory"].removesuffix("Mi"))
    request_cores = int(spec["requests"]["cpu"].removesuffix("m")) / 1000
    figures: list[str] = []
    made = 0
    for count in (10, 50):
        pods.cluster.create_pods(
            [pod_manifest(f"idle-{i}", 10, command=IDLE) for i in range(made, count)]
        )
        made = count
        until(functools.partial(idle_held_are, count), f"the agent holds {count} pods", 240)
        cores, memory = agent_use(pods, WINDOW)
        figures.append(
            f"{count} pods: {100 * cores:.2f} % of a core, {memory['VmRSS']:.0f} MiB resident "
            f"({memory['RssAnon']:.0f} anonymous, {memory['RssFile']:.0f} file-backed)"
        )
        assert cores <= request_cores, figures[-1]
        assert memory["VmRSS"] <= request_mib <= limit_mib * 0.8, figures[-1]
    record_property("the agent's own use", "; ".join(figures))


@pytest.fixture
def prometheus(shipped: Shipped) -> Iterator[str]:
    """Debian's Prometheus (installed where missing), scraping the pods whose annotations ask
    for it; its HTTP API's address."""
    install_debian_packages((PROMETHEUS_PACKAGE,))
    directory = WORK / "prometheus"
    directory.mkdir(exist_ok=True)
    config = prometheus_config([shipped.ready_agent()], "2s")
    (directory / "prometheus.yml").write_text(config)
    address = f"127.0.0.1:{free_port()}"
    server = Component(
        "prometheus",
        ["prometheus", f"--config.file={directory / 'prometheus.yml'}",
         f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address={address}"],
        WORK / "logs" / "prometheus.log",
    )  # fmt: skip
    server.start()
    try:
        wait_for(lambda: http_ok(f"http://{address}/-/ready", None), "Prometheus is ready", server)
        yield address
    finally:
        server.stop()


def query(address: str, promql: str) -> list[dict[str, Any]]:
    url = f"http://{address}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as reply:
        answer = json.load(reply)
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def scraped_times(address: str, count: int) -> bool:
    """Prometheus holds `count` scrapes of the agent within the last 30 s (a rate needs two)."""
    series = query(address, "kuscale_ticks_total[30s]")
    return bool(series) and len(series[0]["values"]) >= count


NO_DATA_HERE = ("gpu", "actuation_errors")
"""Dashboard queries that rightly return nothing on this node: it has no GPU, and the agent
has had no actuation error."""


def test_prometheus_scrapes_the_agent_and_the_dashboards_queries_return_data(
    pods: Shipped, prometheus: str, record_property: Callable[[str, object], None]
) -> None:
    pods.cluster.create_pod("watched", 300)
    pods.cluster.running("watched")
    until(adopted(pods, "watched"), "the agent adopts it")
    up = until(
        lambda: [r for r in query(prometheus, 'up{job="kubernetes-pods"}') if r["value"][1] == "1"],
        "Prometheus scrapes the agent's pod where its annotations say",
        120,
    )
    assert up[0]["metric"]["kubernetes_pod"] == pods.ready_agent()["metadata"]["name"]
    until(functools.partial(scraped_times, prometheus, 5), "five scrapes", 60)
    answered = []
    for panel, promql in dashboard_queries(NODE_NAME):
        if any(word in promql for word in NO_DATA_HERE):
            continue
        returns = functools.partial(query, prometheus, promql)
        until(returns, f"{panel}: {promql} returns data", 60)
        answered.append(promql)
    record_property("dashboard queries answered", len(answered))
    assert len(answered) >= 8


class Sampler:
    """Looks at something every `interval` seconds, in a thread of its own, until `stop`."""

    def __init__(self, interval: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.look()

    def look(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Unheld(Sampler):
    """Pods' quotas every 50 ms: the longest stretch each spent unlimited."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.longest = {p["metadata"]["name"]: 0.0 for p in pods}
        self._since: dict[str, float] = {}
        super().__init__(0.05)

    def look(self) -> None:
        now = time.monotonic()
        for pod in self.pods:
            name = pod["metadata"]["name"]
            if held(pod) is None:
                self._since.setdefault(name, now)
                self.longest[name] = max(self.longest[name], now - self._since[name])
            else:
                self._since.pop(name, None)


def test_a_rolling_update_hands_every_pod_to_the_new_agent(
    pods: Shipped, record_property: Callable[[str, object], None]
) -> None:
    for name, tokens in (("kept-a", 300), ("kept-b", 200)):
        pods.cluster.create_pod(name, tokens)
    held_pods = [pods.cluster.running("kept-a"), pods.cluster.running("kept-b")]
    until(lambda: all(held(p) is not None for p in held_pods), "the old agent holds both")
    old = pods.ready_agent()
    watch = Unheld(held_pods)
    pods.cluster.kubectl(
        "set", "image", "daemonset/kuscale-agent", f"agent={pods.image}-next", "-n",
        AGENT_NAMESPACE,
    )  # fmt: skip
    new = until(
        lambda: (p := pods._only_ready()) and p["metadata"]["uid"] != old["metadata"]["uid"] and p,
        "the new agent replaces the old one",
        180,
    )
    until(lambda: "took the record over" in pods.log(new), "the new agent takes the record")
    until(lambda: all(held(p) is not None for p in held_pods), "the new agent holds both")
    time.sleep(2)
    watch.stop()
    gaps = watch.longest
    record_property("seconds each pod was unheld", ", ".join(f"{g:.2f}" for g in gaps.values()))
    assert max(gaps.values()) <= HANDOVER_BUDGET_S, gaps
    assert new["spec"]["containers"][0]["image"] == f"{pods.image}-next"
    for pod, tokens in zip(held_pods, (300, 200), strict=True):
        assert (held(pod) or 99) <= budget_cores(tokens) * 1.01
    assert "adopted" in pods.log(new)
    until(
        lambda: pods.cluster.node_tokens("allocatable") == NODE_TOKENS,
        "the node offers its tokens through the new agent",
        30,
    )


def test_an_invalid_config_stalls_the_rollout_and_the_old_agent_stays(pods: Shipped) -> None:
    pods.cluster.create_pod("steady", 300)
    pod = pods.cluster.running("steady")
    until(lambda: held(pod) is not None, "the agent holds it")
    old = pods.ready_agent()
    pods.install(config=AGENT_CONFIG + "\n[agent.nonsense]\nkey = 1\n")
    try:
        failing = until(
            lambda: next((p for p in pods.agent_pods() if restarts(p) >= 1), None),
            "the new pod fails to start",
            120,
        )
        assert "nonsense" in pods.log(failing), pods.log(failing)[-2000:]
        alive = {p["metadata"]["uid"] for p in pods.agent_pods()}
        assert old["metadata"]["uid"] in alive, "the rollout must stall with the old agent"
        assert held(pod) is not None, "the old agent still holds the pod"
    finally:
        pods.install()
    pods.ready_agent()


def test_a_killed_agent_container_is_restarted_and_adopts_from_the_record(pods: Shipped) -> None:
    pods.cluster.create_pod("survivor", 300)
    pod = pods.cluster.running("survivor")
    until(adopted(pods, "survivor"), "the agent adopts it")
    agent = pods.ready_agent()
    container = agent["status"]["containerStatuses"][0]["containerID"].partition("://")[2]
    pods.cluster.node.ctr("tasks", "kill", "--signal", "SIGKILL", container)
    restarted = until(
        lambda: (p := pods._only_ready()) and restarts(p) > restarts(agent) and p,
        "the kubelet restarts the agent",
        120,
    )
    until(
        lambda: "adopted with the originals it recorded" in pods.log(restarted),
        "the restarted agent adopts what the killed one held",
    )
    assert (held(pod) or 99) <= budget_cores(300) * 1.01


def test_a_damaged_record_entry_is_kept_for_restore_and_the_rest_managed(pods: Shipped) -> None:
    damaged = HOST_RECORD / f"{NAMESPACE}_damaged.json"
    damaged.write_text("{not json")
    try:
        pods.cluster.create_pod("beside", 300)
        pod = pods.cluster.running("beside")
        agent = pods.ready_agent()
        pods.cluster.kubectl("delete", "pod", agent["metadata"]["name"], "-n", AGENT_NAMESPACE)
        fresh = pods.ready_agent()
        until(lambda: held(pod) is not None, "the new agent manages the rest")
        until(lambda: "skipping record" in pods.log(fresh), "the damaged entry is logged")
        assert damaged.read_text() == "{not json", "kept for the operator and `kuscale restore`"
    finally:
        damaged.unlink(missing_ok=True)


class LastWords(Sampler):
    """An agent's log, read while its pod goes: the kubelet removes it with the pod."""

    def __init__(self, pods: Shipped, agent: dict[str, Any]) -> None:
        self.pods, self.agent, self.seen = pods, agent, ""
        super().__init__(0.1)

    def look(self) -> None:
        self.seen = self.pods.log(self.agent) or self.seen


def test_uninstall_gives_every_limit_back_within_the_grace_period(
    pods: Shipped, record_property: Callable[[str, object], None]
) -> None:
    pods.cluster.create_pod("returned", 300)
    pod = pods.cluster.running("returned")
    until(lambda: held(pod) is not None, "the agent holds it")
    agent = pods.ready_agent()
    grace = int(agent["spec"]["terminationGracePeriodSeconds"])
    last_words = LastWords(pods, agent)
    started = time.monotonic()
    pods.uninstall()
    until(lambda: not pods.agent_pods(), "the agent's pod is gone", 120)
    took = time.monotonic() - started
    record_property("uninstall to every limit back, s", f"{took:.1f}")
    state = cgroup_state(pod)
    assert all(v == "-1" for k, v in state.items() if k.endswith("cfs_quota_us")), state
    assert list(HOST_RECORD.glob("*.json")) == [], "the record is empty"
    last_words.stop()
    assert "restored the limits of 1 pods" in last_words.seen
    assert took <= grace


def test_the_resize_overlay_resizes_through_the_api_server_and_gives_back(pods: Shipped) -> None:
    """A resize agent gives back through the API server, so its account must outlive it: the
    uninstall stops the DaemonSet first (`kubectl delete -k` alone takes the account and its
    rights away at once, and the agent's give-back is refused)."""
    pods.install("overlays/resize")
    try:
        pods.ready_agent()
        pods.cluster.create_pod("resized", 300, cpu=("100m", "1"))
        pods.cluster.running("resized")
        until(lambda: spec_limit(pods, "resized") != "1", "the agent resizes it", 120)
        pods.cluster.kubectl(
            "delete", "daemonset", "kuscale-agent", "-n", AGENT_NAMESPACE, "--wait=true",
            "--cascade=foreground", "--timeout=120s",
        )  # fmt: skip
        until(lambda: spec_limit(pods, "resized") == "1", "the agent's stop gives it back")
    finally:
        pods.uninstall("overlays/resize")


def spec_limit(pods: Shipped, name: str) -> str:
    pod = pods.cluster.get("pod", name)
    return str(pod["spec"]["containers"][0]["resources"]["limits"]["cpu"])
