"""Real workloads on this machine's real cgroups: a web server's burst after idle, the same
with burst credit to spend, and a web server beside a CPU-bound neighbour, under kuscale,
kuscale-2022 and a static quota.

nginx (Debian's) serves a 448 KiB text page gzipped at level 9, about 10 ms of CPU a
request, from two workers that each listen on their own socket (`reuseport`): the kernel
spreads wrk's connections over both, where one worker otherwise often accepts them all and
the server cannot use more than one core, whatever its limit; wrk drives it.

Case 1: nginx with 150 tokens idles, then wrk runs 8 connections for the burst; we
measure requests served, p50 and p99 latency, the limit held while idle, and how long after
the burst began the limit first covered what the burst used under the static quota. Case 2,
burst credit: nginx with 120 tokens and credit worth spending (burst_factor 0.2,
burst_seconds 30) idles 10 s, then serves a 12 s burst; against a static 120 % quota. Case
3: the same nginx (150 tokens) and stress-ng with two CPU workers (300 tokens) share the
node while wrk runs; we measure both pods' work and each pod's share of the CPU they got
against its share of the tokens. Case 4, pipelines whose budgets bind: `kuscale workload
--pipeline` (zlib in two threads feeding GPU kernels on the GPU emulator through a bounded
queue) in two pods of 120 tokens, then one such pod beside the CPU-bound neighbour, under
kuscale, kuscale-2022 and static limits at the same tokens (the agent's `static` policy:
half the tokens on each resource); we measure items per second.

wrk runs as a client on another machine would: in a cgroup of its own, outside the pods',
with the largest CPU weight the kernel takes, which no pod has. On the same two cores as
the server, a server that takes the node would otherwise starve its own load generator,
which would then measure its own starvation.

Run with `make bench-real` (root: it installs nginx, wrk and stress-ng from Debian when they
are missing, and writes cgroups). Prints a table; `--json FILE` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kuscale.backends.base import BackendError
from kuscale.backends.cgroup import CgroupV1, CgroupV2, detect
from kuscale.demo import gpu_emulator
from kuscale.local.statedir import StateDir

TOOLS = {"nginx": "nginx-light", "wrk": "wrk", "stress-ng": "stress-ng"}
KUSCALE = [sys.executable, "-m", "kuscale"]
RESERVATION = 150
NEIGHBOUR_TOKENS = 300
PIPELINE_TOKENS = 120
"""A pipeline of 20 ms of CPU and 10 ms of GPU an item, as fast as it can go, wants 2 % of
a core and 1 % of the GPU per item a second: 5 tokens an item a second at the default prices
(1 and 3). 120 tokens buy 24 items a second split in that proportion, 20 split in halves,
where the pipeline could do 100: its budget binds all the time."""
PAGE_BYTES = 448 * 1024
SAMPLE_SECONDS = 0.02
CLIENT_SHARES = 262144
"""cgroup v1's largest cpu.shares (v2: cpu.weight 10000): the load generator's weight."""
CONFIG = """\
[agent]
period = 1.0
watch_interval = {watch}

[policy]
burst_factor = {burst_factor:g}
burst_seconds = {burst_seconds:g}
"""
"""The agent's settings: the default period, and burst credit so that an idle pod saves
what it does not hold (at burst_factor 0 a pod holds its whole reservation, since credit it
cannot spend is worth nothing, and there is no burst after idle to catch)."""


@dataclass(frozen=True)
class Burst:
    """A burst after idle: the server's tokens, the credit settings, the phases' lengths."""

    name: str
    tokens: int
    idle: float
    seconds: float
    burst_factor: float = 0.05
    burst_seconds: float = 60.0

    def config(self, watch: float) -> str:
        return CONFIG.format(
            watch=watch, burst_factor=self.burst_factor, burst_seconds=self.burst_seconds
        )


NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 2;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/tmp;
    proxy_temp_path {prefix}/tmp;
    fastcgi_temp_path {prefix}/tmp;
    uwsgi_temp_path {prefix}/tmp;
    scgi_temp_path {prefix}/tmp;
    gzip on;
    gzip_comp_level 9;
    gzip_min_length 0;
    gzip_types text/plain;
    server {{
        listen 127.0.0.1:{port} reuseport;
        root {prefix}/www;
        location / {{ default_type text/plain; }}
    }}
}}
"""


ATTACH = (
    "import os, sys; n = int(sys.argv[1]); "
    "[open(p, 'w').write(str(os.getpid())) for p in sys.argv[2:2 + n]]; "
    "os.execvp(sys.argv[2 + n], sys.argv[2 + n:])"
)
"""Move this process into the static case's cgroup, then exec the workload: its children are
born inside, as under `kuscale launch`."""


class Unavailable(RuntimeError):
    """What this machine lacks to run the benchmark, and how to get it."""


def ensure_tools() -> None:
    missing = [name for name in TOOLS if shutil.which(name) is None]
    if not missing:
        return
    packages = " ".join(TOOLS[name] for name in missing)
    if os.geteuid() != 0:
        raise Unavailable(f"missing {', '.join(missing)}: run `apt-get install {packages}` as root")
    print(f"installing {packages} from Debian ...", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", *packages.split()],
    ):
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_site(prefix: Path, port: int) -> Path:
    """The nginx prefix: its config, and a page of random words that compresses like text."""
    rng = random.Random(1)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)
    ]
    page = " ".join(rng.choices(words, k=PAGE_BYTES // 5))[:PAGE_BYTES]
    prefix.chmod(0o755)
    (prefix / "www").mkdir(parents=True)
    (prefix / "tmp").mkdir()
    (prefix / "www" / "page.txt").write_text(page)
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.format(prefix=prefix, port=port))
    return conf


@dataclass
class LimitLog:
    """The limit and usage of one cgroup sampled every SAMPLE_SECONDS in a thread."""

    cgroups: CgroupV1 | CgroupV2
    cgroup: str
    samples: list[tuple[float, float | None, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            try:
                limit = self.cgroups.read_limit(self.cgroup)
                usage = self.cgroups.read(self.cgroup).usage_ns
            except BackendError:
                continue
            self.samples.append((time.monotonic(), limit, usage))

    def stop(self) -> None:
        self._stop.set()

    def mean_limit(self, start: float, end: float) -> float | None:
        held = [lim for t, lim, _ in self.samples if start <= t <= end and lim is not None]
        return statistics.fmean(held) if held else None

    def usage(self, start: float, end: float) -> float:
        """Percent of a core used between two times."""
        inside = [(t, u) for t, _, u in self.samples if start <= t <= end]
        if len(inside) < 2:
            return 0.0
        (t0, u0), (t1, u1) = inside[0], inside[-1]
        return (u1 - u0) / 1e7 / (t1 - t0) if t1 > t0 else 0.0

    def covered_after(self, start: float, needed: float) -> float | None:
        """Seconds from `start` until the limit first reached `needed` (None: unlimited)."""
        for t, limit, _ in self.samples:
            if t >= start and (limit is None or limit >= needed):
                return t - start
        return None


@dataclass
class WrkResult:
    requests: int
    p50_ms: float
    p99_ms: float


def run_wrk(port: int, seconds: float, client: list[str]) -> WrkResult:
    """wrk against the server, started through `client` (which puts it in its cgroup)."""
    out = subprocess.run(
        [
            *client,
            "wrk",
            "-t1",
            "-c8",
            f"-d{seconds:g}s",
            "--latency",
            "-H",
            "Accept-Encoding: gzip",
            f"http://127.0.0.1:{port}/page.txt",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"nginx did not serve the page cleanly:\n{out}")
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    return WrkResult(requests, _latency(out, "50%"), _latency(out, "99%"))


def _latency(out: str, percentile: str) -> float:
    match = re.search(rf"^\s*{percentile}\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"wrk printed no {percentile} latency:\n{out}")
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[match.group(2)]
    return float(match.group(1)) * scale


@dataclass
class Node:
    """This machine's cgroups, a state dir, and (for a policy) a running local agent."""

    cgroups: CgroupV1 | CgroupV2
    state: Path
    parent: str
    policy: str | None
    gpus: int = 0
    agent: subprocess.Popen[bytes] | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, config_text: str) -> None:
        self.cgroups.create(self.client)
        self.cgroups.write_shares(self.client, CLIENT_SHARES)
        if self.policy is None:
            self.cgroups.create(self.parent)
            return
        config = self.state / "agent.toml"
        config.write_text(config_text)
        self.agent = subprocess.Popen(
            [
                *KUSCALE,
                "agent",
                "--local",
                "--state-dir",
                str(self.state),
                "--gpus",
                str(self.gpus),
                "--policy",
                self.policy,
                "--config",
                str(config),
                "--metrics-address",
                "",
            ],
            stderr=subprocess.DEVNULL,
        )

    @property
    def client(self) -> str:
        """The load generator's cgroup, beside the pods' parent, never under it."""
        return f"{self.parent}-client"

    def attach(self, cgroup: str) -> list[str]:
        """A command prefix that moves the process into `cgroup`, then execs the rest."""
        procs = [str(root / cgroup / "cgroup.procs") for root in self._roots()]
        return [sys.executable, "-c", ATTACH, str(len(procs)), *procs]

    def launch(self, name: str, tokens: int, command: list[str], gpu: bool = False) -> str:
        cgroup = f"{self.parent}/{name}"
        if self.policy is None:
            self.cgroups.create(cgroup)
            self.cgroups.write_limit(cgroup, float(tokens))
            process = subprocess.Popen(
                [*self.attach(cgroup), *command],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            process = subprocess.Popen(
                [
                    *KUSCALE,
                    "launch",
                    "--state-dir",
                    str(self.state),
                    "--tokens",
                    str(tokens),
                    "--name",
                    name,
                    "--cgroup-parent",
                    self.parent,
                    *(["--gpu"] if gpu else []),
                    "--",
                    *command,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_for(lambda: self.adopted(name), 20.0)
        self.processes.append(process)
        return cgroup

    def _roots(self) -> set[Path]:
        return {self.cgroups.cpu_root, self.cgroups.usage_root}

    def adopted(self, name: str) -> bool:
        try:
            status = json.loads((self.state / "status.json").read_text())
        except (OSError, ValueError):
            return False
        return any(p["name"] == name and p["status"] == "running" for p in status["pods"])

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.agent is not None:
            self.agent.send_signal(signal.SIGTERM)
            self.agent.wait(timeout=30)
        remove_tree(self.cgroups, self.parent)
        remove_tree(self.cgroups, self.client)


def remove_tree(cgroups: CgroupV1 | CgroupV2, parent: str) -> None:
    for root in {cgroups.cpu_root, cgroups.usage_root}:
        top = root / parent
        if not top.exists():
            continue
        for child in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            wait_for(lambda child=child: not (child / "cgroup.procs").read_text().strip(), 10.0)
            child.rmdir()
        top.rmdir()


def wait_for(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting for the workload")
        time.sleep(0.05)


@contextmanager
def node(policy: str | None, config: str, gpus: int = 0) -> Iterator[Node]:
    state = Path(tempfile.mkdtemp(prefix="kuscale-bench-real-"))
    here = Node(detect(), state, f"kuscale-bench-{os.getpid()}", policy, gpus)
    try:
        if gpus:
            with gpu_emulator(StateDir(state).ensure(), enforce=True):
                here.start(config)
                yield here
        else:
            here.start(config)
            yield here
    finally:
        here.stop()
        shutil.rmtree(state, ignore_errors=True)


def nginx_command(prefix: Path) -> tuple[list[str], int]:
    port = free_port()
    conf = write_site(prefix, port)
    return ["nginx", "-p", str(prefix), "-c", str(conf)], port


@contextmanager
def scratch() -> Iterator[Path]:
    """A directory for nginx's prefix and stress-ng's figures, removed afterwards."""
    prefix = Path(tempfile.mkdtemp(prefix="kuscale-nginx-"))
    try:
        yield prefix
    finally:
        shutil.rmtree(prefix, ignore_errors=True)


def burst_after_idle(
    policy: str | None, case: Burst, watch: float, needed: float | None
) -> dict[str, Any]:
    idle = case.idle
    with scratch() as prefix:
        with node(policy, case.config(watch)) as here:
            command, port = nginx_command(prefix)
            cgroup = here.launch("web", case.tokens, command)
            wait_for(lambda: _answers(port), 20.0)
            log = LimitLog(here.cgroups, cgroup)
            sampler = threading.Thread(target=log.run, daemon=True)
            sampler.start()
            idle_from = time.monotonic()
            time.sleep(idle)
            started = time.monotonic()
            result = run_wrk(port, case.seconds, here.attach(here.client))
            ended = time.monotonic()
            log.stop()
            sampler.join()
        used = log.usage(started, ended)
        return {
            "case": case.name,
            "tokens": case.tokens,
            "policy": policy or "static",
            "requests": result.requests,
            "p50_ms": result.p50_ms,
            "p99_ms": result.p99_ms,
            "idle_limit_percent": log.mean_limit(idle_from + idle / 2, started),
            "burst_usage_percent": used,
            "covered_after_seconds": log.covered_after(started, 0.95 * (needed or used)),
        }


def with_neighbour(policy: str | None, burst: float, watch: float) -> dict[str, Any]:
    with scratch() as prefix:
        with node(policy, Burst("neighbour", RESERVATION, 0.0, burst).config(watch)) as here:
            command, port = nginx_command(prefix)
            web = here.launch("web", RESERVATION, command)
            wait_for(lambda: _answers(port), 20.0)
            metrics = prefix / "stress.yaml"
            stress = here.launch(
                "neighbour",
                NEIGHBOUR_TOKENS,
                [
                    "stress-ng",
                    "--cpu",
                    "2",
                    "--timeout",
                    f"{burst + 30:g}",
                    "--metrics-brief",
                    "--yaml",
                    str(metrics),
                ],
            )
            logs = {
                name: LimitLog(here.cgroups, cgroup)
                for name, cgroup in (("web", web), ("neighbour", stress))
            }
            threads = [threading.Thread(target=log.run, daemon=True) for log in logs.values()]
            for thread in threads:
                thread.start()
            time.sleep(3.0)
            started = time.monotonic()
            result = run_wrk(port, burst, here.attach(here.client))
            ended = time.monotonic()
            for log in logs.values():
                log.stop()
            before = here.cgroups.read(stress).usage_ns
        usage = {name: log.usage(started, ended) for name, log in logs.items()}
        total = sum(usage.values()) or 1.0
        tokens = RESERVATION + NEIGHBOUR_TOKENS
        return {
            "policy": policy or "static",
            "web_requests": result.requests,
            "web_p99_ms": result.p99_ms,
            "web_cpu_percent": usage["web"],
            "neighbour_cpu_percent": usage["neighbour"],
            "neighbour_cpu_seconds": before / 1e9,
            "web_share_of_cpu": usage["web"] / total,
            "web_share_of_tokens": RESERVATION / tokens,
        }


def steady_noise(watch: float, seconds: float) -> dict[str, Any]:
    """A pod pinned by its own noise: stress-ng at 60 % of one CPU (duty-cycled, so its use
    jitters) with 120 tokens and the burst credit of case 2. The limit it holds over its use,
    and how often the watch raised it: what each raise costs is what the step's size
    decides."""
    case = Burst("noise", 120, 0.0, seconds, 0.2, 30.0)
    with node("kuscale", case.config(watch)) as here:
        cgroup = here.launch(
            "steady",
            case.tokens,
            ["stress-ng", "--cpu", "1", "--cpu-load", "60", "--timeout", f"{seconds + 30:g}"],
        )
        log = LimitLog(here.cgroups, cgroup)
        sampler = threading.Thread(target=log.run, daemon=True)
        sampler.start()
        time.sleep(5.0)
        raised_before = _fast_raises(here)
        started = time.monotonic()
        time.sleep(seconds)
        ended = time.monotonic()
        raised = _fast_raises(here) - raised_before
        log.stop()
        sampler.join()
    used = log.usage(started, ended)
    held = log.mean_limit(started, ended)
    return {
        "usage_percent": used,
        "limit_percent": held,
        "limit_over_usage": None if held is None or used <= 0 else held / used,
        "fast_raises_per_second": raised / (ended - started),
    }


def _fast_raises(here: Node) -> int:
    status = json.loads((here.state / "status.json").read_text())
    return int(status.get("fast_raises", 0))


def pipelines(policy: str, neighbour: bool, seconds: float, watch: float) -> dict[str, Any]:
    """Two pipelines, or one beside the CPU-bound neighbour, on the emulated GPU: each
    pipeline's items per second over the same `seconds`."""
    config = Burst("pipelines", PIPELINE_TOKENS, 0.0, seconds).config(watch)
    names = ["pipe-a"] if neighbour else ["pipe-a", "pipe-b"]
    with scratch() as prefix, node(policy, config, gpus=1) as here:
        start_at = time.monotonic() + 5.0 + 2.0 * len(names)
        for name in names:
            command = [
                *KUSCALE,
                "workload",
                "--pipeline",
                "--duration",
                f"{seconds:g}",
                "--start-at",
                f"{start_at:.3f}",
                "--report",
                str(prefix / f"{name}.rate"),
            ]
            here.launch(name, PIPELINE_TOKENS, command, gpu=True)
        if neighbour:
            here.launch(
                "neighbour",
                NEIGHBOUR_TOKENS,
                ["stress-ng", "--cpu", "2", "--timeout", f"{seconds + 30:g}"],
            )
        reports = [prefix / f"{name}.rate" for name in names]
        time.sleep(max(0.0, start_at + seconds * 0.75 - time.monotonic()))
        held = json.loads((here.state / "status.json").read_text())["pods"]
        wait_for(lambda: all(report.exists() for report in reports), seconds + 60.0)
        rates = {
            name: float(report.read_text()) for name, report in zip(names, reports, strict=True)
        }
    return {"policy": policy, "neighbour": neighbour, "items_per_second": rates, "pods": held}


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def burst_table(case: Burst, rows: list[dict[str, Any]]) -> list[str]:
    static = next(row for row in rows if row["policy"] == "static")
    lines = [
        f"{case.name} (nginx, {case.tokens} tokens, {case.idle:g} s idle, {case.seconds:g} s "
        f"burst; burst_factor {case.burst_factor:g}, burst_seconds {case.burst_seconds:g}; "
        f"static: a {case.tokens} % quota)",
        f"{'policy':<14}{'requests':>10}{'vs static':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'p99 / static':>13}{'idle limit %':>14}{'covered after s':>17}",
    ]
    for row in rows:
        covered = row["covered_after_seconds"]
        idle = row["idle_limit_percent"]
        lines.append(
            f"{row['policy']:<14}{row['requests']:>10}{row['requests'] / static['requests']:>10.2f}"
            f"{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}{row['p99_ms'] / static['p99_ms']:>13.2f}"
            f"{'unlimited' if idle is None else f'{idle:.1f}':>14}"
            f"{'—' if covered is None else f'{covered:.2f}':>17}"
        )
    return lines


def pipeline_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"pipelines (20 ms CPU + 10 ms GPU an item, {PIPELINE_TOKENS} tokens each; "
        f"the neighbour: stress-ng --cpu 2, {NEIGHBOUR_TOKENS} tokens), items per second",
        f"{'policy':<14}{'pipe-a':>9}{'pipe-b':>9}{'beside the neighbour':>22}",
    ]
    for policy in dict.fromkeys(row["policy"] for row in rows):
        pair = next(r for r in rows if r["policy"] == policy and not r["neighbour"])
        alone = next(r for r in rows if r["policy"] == policy and r["neighbour"])
        rates = pair["items_per_second"]
        lines.append(
            f"{policy:<14}{rates['pipe-a']:>9.1f}{rates['pipe-b']:>9.1f}"
            f"{alone['items_per_second']['pipe-a']:>22.1f}"
        )
    return lines


CASES = ("burst-after-idle", "burst-credit", "noise", "neighbour", "pipelines")


def noise_table(noise: dict[str, Any]) -> list[str]:
    return [
        "steady noise (stress-ng --cpu 1 --cpu-load 60, 120 tokens, burst credit as above)",
        f"{'usage %':>9}{'limit %':>9}{'limit / usage':>15}{'fast raises / s':>17}",
        f"{noise['usage_percent']:>9.1f}{noise['limit_percent'] or 0.0:>9.1f}"
        f"{noise['limit_over_usage'] or 0.0:>15.2f}{noise['fast_raises_per_second']:>17.2f}",
    ]


def neighbour_table(shared: list[dict[str, Any]]) -> list[str]:
    lines = [
        "beside a CPU-bound neighbour (stress-ng --cpu 2, 300 tokens)",
        f"{'policy':<14}{'web requests':>13}{'web p99 ms':>11}{'web cpu %':>10}"
        f"{'neighbour cpu %':>16}{'web share':>10}{'of tokens':>10}",
    ]
    for row in shared:
        lines.append(
            f"{row['policy']:<14}{row['web_requests']:>13}{row['web_p99_ms']:>11.1f}"
            f"{row['web_cpu_percent']:>10.1f}{row['neighbour_cpu_percent']:>16.1f}"
            f"{row['web_share_of_cpu']:>10.2f}{row['web_share_of_tokens']:>10.2f}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--idle", type=float, default=8.0, help="seconds idle before the burst")
    parser.add_argument("--burst", type=float, default=15.0, help="seconds of wrk load")
    parser.add_argument("--watch", type=float, default=0.1, help="the agent's watch_interval")
    parser.add_argument("--json", type=Path, help="write the figures as JSON")
    parser.add_argument("--only", help=f"run only these cases: {','.join(CASES)} (default: all)")
    args = parser.parse_args()
    try:
        ensure_tools()
        if os.geteuid() != 0:
            raise Unavailable("real cgroups need root")
        detect()
    except (Unavailable, BackendError, subprocess.CalledProcessError) as err:
        print(f"bench-real: cannot run here: {err}", file=sys.stderr)
        return 2
    print(f"machine: {os.cpu_count()} CPUs; period 1 s; watch {args.watch} s", flush=True)
    cases = {
        Burst("burst after idle", RESERVATION, args.idle, args.burst): ("kuscale", "kuscale-2022"),
        Burst("burst credit", 120, 10.0, 12.0, 0.2, 30.0): ("kuscale",),
    }
    only = set(args.only.split(",")) if args.only else set(CASES)
    figures: dict[str, Any] = {}
    lines: list[str] = []
    for case, policies in cases.items():
        key = case.name.replace(" ", "_")
        if key.replace("_", "-") not in only:
            continue
        static = burst_after_idle(None, case, args.watch, None)
        needed = static["burst_usage_percent"]
        rows = [static] + [burst_after_idle(p, case, args.watch, needed) for p in policies]
        figures[key] = rows
        lines += [*burst_table(case, rows), ""]
    if "noise" in only:
        figures["steady_noise"] = noise = steady_noise(args.watch, args.burst)
        lines += [*noise_table(noise), ""]
    if "neighbour" in only:
        figures["with_neighbour"] = shared = [
            with_neighbour(policy, args.burst, args.watch) for policy in ("kuscale", None)
        ]
        lines += [*neighbour_table(shared), ""]
    if "pipelines" in only:
        figures["pipelines"] = rows = [
            pipelines(policy, neighbour, args.burst, args.watch)
            for policy in ("kuscale", "kuscale-2022", "static")
            for neighbour in (False, True)
        ]
        lines += pipeline_table(rows)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
