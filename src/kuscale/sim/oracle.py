"""`oracle`: the least unmet demand any policy could leave, as one linear program.

The oracle knows every pod's demand for the whole run. It chooses each pod's limit L and
what it is served s, every period, to maximise what is served, under exactly the rules the
simulator and the metrics hold every policy to:

- s ≤ demand, s ≤ L, and Σ_pods s ≤ the node's capacity, per resource and period (the
  simulated kernel never serves more than the node has, nor a pod above its limit);
- minimum ≤ L ≤ the per-pod cap (the configured max, never above the node);
- the token queue: a pod starts with none; after each period Q' ≤ Q + R·T − Σ_r p_r·L_r·T
  with 0 ≤ Q' ≤ R·burst_seconds, and in each period Σ_r p_r·L_r ≤ R + k·Q/T (the burst
  factor k paces how fast saved credit is spent), so the pod never spends beyond its
  reservation and saved credit;
- pods that kuscale's admission refuses run unlimited, as they do under every policy;
- a coupled pod (a pipeline) is served the same fraction of its CPU and its GPU demand in
  every period where it asks for both: s_cpu·d_gpu = s_gpu·d_cpu, linear since the demands
  are known. The simulator holds every policy's coupled pods to exactly that.

Any policy that keeps these rules is a feasible point of this program, so none can leave less
demand unmet: the optimum is a bound. `kuscale` and `static` keep them by construction;
`Ledger.within_rules` in the metrics checks any trace (`kuscale-2022` raises limits to their
minimum after its budget step, so it may not). A second program weighs each pod's served demand
by its tokens, for the token-weighted figure.

Long runs are cut into windows solved one after another. Each window lets the queue of a pod
already running start anywhere in [0, cap]: that only loosens the program, so the sum of the
windows' optima stays a bound (the window's queue is not carried over, so its limits need
not be one policy's, and its overspend is not reported).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy import sparse
from scipy.optimize import linprog

from kuscale.model import RESOURCES, Resource
from kuscale.policy.base import BoolArray, FloatArray
from kuscale.policy.default import KuscalePolicy
from kuscale.sim.metrics import (
    coupled_pods,
    coupled_progress,
    priced_unmet,
    progress_by_period,
    weighted_unmet,
)
from kuscale.sim.run import Trace
from kuscale.sim.scenario import Scenario

ORACLE = "oracle"
WINDOW_CELLS = 150_000
"""Pod-periods per resource in one linear program: a window of a longer run."""
MAX_CELLS = 1_000_000
"""Pod-periods per resource beyond which the oracle refuses: HiGHS would take too long here."""

IntArray = NDArray[np.intp]


class OracleError(RuntimeError):
    """A scenario the oracle cannot solve; the message says which and what to do."""


@dataclass(frozen=True, slots=True)
class OracleSolution:
    """Limits (NaN where unlimited) and served demand, shaped like a trace: (ticks, pods, 2)."""

    limit: FloatArray
    served: FloatArray
    refused: BoolArray
    windows: int

    @property
    def exact(self) -> bool:
        return self.windows == 1


def admitted(scenario: Scenario) -> BoolArray:
    """Which pods kuscale's admission takes, replayed in the monitor's order: at each tick
    arrivals are admitted first, against the minimums of the pods still running, then the
    pods whose end has come complete."""
    policy = KuscalePolicy(scenario.config.policy_config)
    capacity = reach(scenario)
    minimums = scenario.config.policy_config.minimums()
    pods = scenario.pods
    uses = _uses(scenario)
    devices = np.array([p.device for p in pods])
    result = np.zeros(len(pods), dtype=bool)
    running: list[int] = []
    order = sorted(range(len(pods)), key=lambda i: (pods[i].start, i))
    arrived = 0
    for now in scenario.times().tolist():
        while arrived < len(order) and pods[order[arrived]].start <= now:
            index = order[arrived]
            arrived += 1
            # The node's CPU, and the GPU of the device the pod would join.
            shared = uses[running] & np.array([True, False])
            shared[:, Resource.GPU] = uses[running, Resource.GPU] & (
                devices[running] == devices[index]
            )
            committed = (shared * minimums).sum(axis=0)
            if policy.admit(float(pods[index].tokens), uses[index], capacity, committed) is None:
                result[index] = True
                running.append(index)
        running = [i for i in running if pods[i].end > now]
    return result


def reach(scenario: Scenario) -> FloatArray:
    """The most one pod can hold per resource: the node's CPU, one GPU device."""
    return np.array([scenario.cores * 100.0, 100.0 if scenario.gpus else 0.0])


def solve_oracle(
    scenario: Scenario, demand: FloatArray, gains: FloatArray | None = None
) -> OracleSolution:
    """The limits that serve the most demand, each served percent of pod i's resource r
    counted `gains[i, r]` times (all 1 by default: the least total unmet demand); gains
    shaped like `demand` weigh every period on its own."""
    times = scenario.times()
    pods = scenario.pods
    alive = _alive(scenario)
    uses = _uses(scenario)
    cells = int((alive[:, :, None] & uses[None]).sum())
    if cells > MAX_CELLS:
        raise OracleError(
            f"scenario {scenario.name!r} has {cells} pod-periods to solve, more than the "
            f"oracle's {MAX_CELLS}: shorten it with --duration or run fewer pods"
        )
    refused = ~admitted(scenario)
    weights = np.ones((len(pods), len(RESOURCES))) if gains is None else gains
    per_tick = max(1, int((alive[:, :, None] & uses[None]).sum(axis=(1, 2)).max()))
    window = max(1, WINDOW_CELLS // per_tick)
    limit = np.full(demand.shape, np.nan)
    served = np.zeros(demand.shape)
    bounds = range(0, len(times), window)
    for first in bounds:
        last = min(first + window, len(times))
        program = _Program(scenario, demand[first:last], alive[first:last], uses, refused)
        program.free_start = alive[first] & (np.array([p.start for p in pods]) < times[first])
        window_gains = weights[first:last] if weights.ndim == 3 else weights[None]
        limit[first:last], served[first:last] = program.solve(window_gains)
    return OracleSolution(limit, served, refused, len(bounds))


class _Program:
    """One window's linear program. Variables: served s and limit L per (tick, pod,
    resource) cell, the queue after each period of a managed pod, and a start queue in
    [0, cap] for managed pods already running when the window opens."""

    def __init__(
        self,
        scenario: Scenario,
        demand: FloatArray,
        alive: BoolArray,
        uses: BoolArray,
        refused: BoolArray,
    ) -> None:
        self.scenario = scenario
        self.demand = demand
        self.alive = alive
        self.uses = uses
        self.refused = refused
        self.free_start = np.zeros(alive.shape[1], dtype=bool)
        self._lower: list[FloatArray] = []
        self._upper: list[FloatArray] = []
        self._size = 0

    def _variables(self, mask: BoolArray, lower: FloatArray, upper: FloatArray) -> IntArray:
        """Number a block of variables, one per True of `mask` (−1 elsewhere)."""
        ids = np.full(mask.shape, -1, dtype=np.intp)
        count = int(mask.sum())
        ids[mask] = self._size + np.arange(count)
        self._size += count
        self._lower.append(np.broadcast_to(lower, mask.shape)[mask].astype(np.float64))
        self._upper.append(np.broadcast_to(upper, mask.shape)[mask].astype(np.float64))
        return ids

    def solve(self, gains: FloatArray) -> tuple[FloatArray, FloatArray]:
        """(limits, served) for this window; limits are NaN where unlimited or not alive."""
        scenario = self.scenario
        config = scenario.config.policy_config
        managed = self.alive & ~self.refused[None]
        cells = self.alive[:, :, None] & self.uses[None]
        managed_cells = cells & managed[:, :, None]
        cap = KuscalePolicy(config).upper_bounds(reach(scenario))
        minimum = np.minimum(config.minimums(), cap)
        queue_cap = np.array([p.tokens for p in scenario.pods], dtype=np.float64)
        queue_cap = queue_cap * config.burst_seconds
        served = self._variables(cells, np.zeros(1), self.demand)
        limits = self._variables(managed_cells, minimum, cap)
        queues = self._variables(managed, np.zeros(1), queue_cap)
        starts = self._variables(self.free_start & ~self.refused, np.zeros(1), queue_cap)

        rows = _Rows()
        both = np.flatnonzero(managed_cells.ravel())
        rows.add([served.ravel()[both], limits.ravel()[both]], [1.0, -1.0], np.zeros(both.size))
        rows.sums(served[:, :, Resource.CPU], scenario.cores * 100.0)
        devices = np.array([pod.device for pod in scenario.pods])
        for device in range(scenario.gpus):
            rows.sums(served[:, devices == device, Resource.GPU], 100.0)
        tokens = np.array([p.tokens for p in scenario.pods], dtype=np.float64)
        period = scenario.period
        before = np.full(queues.shape, -1, dtype=np.intp)
        before[1:] = np.where(managed[:-1], queues[:-1], -1)
        before[0] = starts
        spend = config.prices() * period
        pod_ticks = np.flatnonzero(managed.ravel())
        columns = [queues.ravel()[pod_ticks], before.ravel()[pod_ticks]]
        coefficients = [1.0, -1.0]
        for resource in RESOURCES:
            columns.append(limits[:, :, resource].ravel()[pod_ticks])
            coefficients.append(float(spend[resource]))
        earned = np.broadcast_to(tokens * period, managed.shape).ravel()[pod_ticks]
        rows.add(columns, coefficients, earned)
        # T·Σ_r p_r·L_r − k·Q ≤ R·T: saved credit is spent at most k of it per period.
        rows.add(columns[1:], [-config.burst_factor, *coefficients[2:]], earned)

        gain = np.broadcast_to(gains, cells.shape)
        objective = np.zeros(self._size)
        objective[served[cells]] = -gain[cells]
        linked = self._coupling(served)
        result = linprog(
            objective,
            A_ub=rows.matrix(self._size),
            b_ub=rows.bounds(),
            A_eq=linked.matrix(self._size) if linked.count else None,
            b_eq=linked.bounds() if linked.count else None,
            bounds=np.stack([np.concatenate(self._lower), np.concatenate(self._upper)], axis=1),
            method="highs",
        )
        if result.status != 0 or result.x is None:
            raise OracleError(
                f"scenario {scenario.name!r}: the solver gave no optimum ({result.message}); "
                "try a shorter --duration or fewer pods"
            )
        x = np.asarray(result.x, dtype=np.float64)
        served_out = np.where(cells, x[np.maximum(served, 0)], 0.0)
        limit_out = np.where(managed_cells, x[np.maximum(limits, 0)], np.nan)
        return limit_out, np.minimum(served_out, self.demand)

    def _coupling(self, served: IntArray) -> _Rows:
        """s_cpu·d_gpu − s_gpu·d_cpu = 0 for every coupled pod's period that asks for both."""
        coupled = np.array([pod.coupled for pod in self.scenario.pods], dtype=bool)
        cpu, gpu = Resource.CPU, Resource.GPU
        both = (
            self.alive
            & (coupled & self.uses[:, gpu])[None]
            & (self.demand[:, :, cpu] > 0)
            & (self.demand[:, :, gpu] > 0)
        )
        rows = _Rows()
        if both.any():
            first, second = served[:, :, cpu][both], served[:, :, gpu][both]
            rows.add_pairs(
                first, self.demand[:, :, gpu][both], second, -self.demand[:, :, cpu][both]
            )
        return rows


class _Rows:
    """Inequality rows A·x ≤ b, collected as sparse triplets. A column id of −1 means the
    term is absent in that row."""

    def __init__(self) -> None:
        self._rows: list[IntArray] = []
        self._columns: list[IntArray] = []
        self._values: list[FloatArray] = []
        self._bounds: list[FloatArray] = []
        self._count = 0

    def add(self, columns: list[IntArray], coefficients: list[float], bounds: FloatArray) -> None:
        """One row per position: Σ_k coefficients[k]·x[columns[k][j]] ≤ bounds[j]."""
        row = self._count + np.arange(bounds.size)
        for ids, value in zip(columns, coefficients, strict=True):
            present = ids >= 0
            self._rows.append(row[present])
            self._columns.append(ids[present])
            self._values.append(np.full(int(present.sum()), value))
        self._bounds.append(np.asarray(bounds, dtype=np.float64))
        self._count += bounds.size

    def add_pairs(self, first: IntArray, a: FloatArray, second: IntArray, b: FloatArray) -> None:
        """One row per position j with its own coefficients: a_j·x[first_j] + b_j·x[second_j]
        against a bound of 0."""
        row = self._count + np.arange(first.size)
        self._rows.extend([row, row])
        self._columns.extend([first, second])
        self._values.extend([np.asarray(a, np.float64), np.asarray(b, np.float64)])
        self._bounds.append(np.zeros(first.size))
        self._count += first.size

    @property
    def count(self) -> int:
        return self._count

    def sums(self, ids: IntArray, bound: float) -> None:
        """One row per tick: the sum of that tick's variables ≤ bound."""
        tick, _ = np.nonzero(ids >= 0)
        self._rows.append(self._count + tick)
        self._columns.append(ids[ids >= 0])
        self._values.append(np.ones(tick.size))
        self._bounds.append(np.full(ids.shape[0], bound))
        self._count += ids.shape[0]

    def matrix(self, size: int) -> sparse.csr_array:
        return sparse.csr_array(
            (
                np.concatenate(self._values),
                (np.concatenate(self._rows), np.concatenate(self._columns)),
            ),
            shape=(self._count, size),
        )

    def bounds(self) -> FloatArray:
        return np.concatenate(self._bounds)


def oracle_trace(scenario: Scenario, demand: FloatArray) -> Trace:
    """The oracle's run as a trace, so the same metrics judge it as every policy."""
    started = time.perf_counter()
    solution = solve_oracle(scenario, demand)
    pods = scenario.pods
    return Trace(
        scenario=scenario,
        policy=ORACLE,
        names=[p.name for p in pods],
        tokens=np.array([p.tokens for p in pods], dtype=np.float64),
        uses=np.array([[True, p.gpu is not None] for p in pods]),
        alive=_alive(scenario),
        refused=solution.refused,
        demand=demand.astype(np.float32),
        usage=solution.served.astype(np.float32),
        limit=solution.limit,
        decide_seconds_per_tick=(time.perf_counter() - started) / max(scenario.ticks, 1),
        exact=solution.exact,
    )


def bounds(scenario: Scenario, demand: FloatArray) -> dict[str, dict[str, float | None]]:
    """The least unmet demand of each resource, plain and token-weighted, each from a program
    that serves that resource alone: a policy may trade one resource for another, so only a
    bound per resource holds for every policy resource by resource."""
    tokens = np.array([p.tokens for p in scenario.pods], dtype=np.float64)
    result: dict[str, dict[str, float | None]] = {}
    for resource in RESOURCES:
        used = demand[:, :, resource].sum() > 0
        entry: dict[str, float | None] = {}
        for key, weights in (
            ("unmet_demand_fraction", np.ones_like(tokens)),
            ("token_weighted_unmet_fraction", tokens),
        ):
            gains = np.zeros((len(tokens), len(RESOURCES)))
            gains[:, resource] = weights
            served = solve_oracle(scenario, demand, gains).served if used else demand
            entry[key] = weighted_unmet(demand[:, :, resource], served[:, :, resource], weights)
        result[resource.label] = entry
    return result


def binding_bounds(scenario: Scenario, demand: FloatArray) -> dict[str, float | None]:
    """The least priced unmet demand, and the most progress of coupled pods, each from its
    own program: every served point weighed by its price, and every coupled pod's served
    fraction of its largest demand by its tokens over the periods it asks for work (with
    the pod's resources served in the same fraction, that is its progress)."""
    pods = scenario.pods
    uses = _uses(scenario)
    prices = scenario.config.policy_config.prices()
    tokens = np.array([p.tokens for p in pods], dtype=np.float64)
    alive = _alive(scenario)
    priced = solve_oracle(scenario, demand, np.where(uses, prices, 0.0)).served
    coupled = coupled_pods(scenario)
    progress = None
    if coupled.any():
        served = solve_oracle(scenario, demand, progress_gains(demand, alive, coupled, tokens))
        progress = coupled_progress(demand, served.served, alive, coupled, tokens)
    return {
        "priced_unmet_fraction": priced_unmet(demand, priced, uses, prices),
        "coupled_progress": progress,
    }


def progress_gains(
    demand: FloatArray, alive: BoolArray, coupled: BoolArray, tokens: FloatArray
) -> FloatArray:
    """Per period, pod and resource, what a served percent adds to the token-weighted
    progress: tokens / (periods asked · demand) on the coupled pod's largest demand, 0
    elsewhere. Linear because the oracle serves a coupled pod's resources in one fraction."""
    _, working = progress_by_period(demand, demand, alive)
    working &= coupled[None]
    periods = np.maximum(working.sum(axis=0), 1)
    asked = tokens[coupled & (working.sum(axis=0) > 0)].sum()
    largest = demand.argmax(axis=2)
    gains = np.zeros(demand.shape)
    value = np.where(working, tokens / periods / max(float(asked), 1e-9), 0.0)
    tick, pod = np.nonzero(working)
    resource = largest[tick, pod]
    gains[tick, pod, resource] = value[tick, pod] / demand[tick, pod, resource]
    return gains


def _uses(scenario: Scenario) -> BoolArray:
    """Per pod, whether it uses the CPU (always) and a GPU (where the node has one)."""
    return np.array([[True, p.gpu is not None and scenario.gpus > 0] for p in scenario.pods])


def _alive(scenario: Scenario) -> BoolArray:
    times = scenario.times()
    pods = scenario.pods
    return (times[:, None] >= np.array([p.start for p in pods])) & (
        times[:, None] < np.array([p.end for p in pods])
    )
