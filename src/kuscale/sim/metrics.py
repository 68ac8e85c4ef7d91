"""How well a policy served a scenario: what users judge an autoscaler by, from one trace.

- unmet demand: Σ max(0, demand − usage) / Σ demand, per resource, over every pod; and the
  same with each pod weighted by its tokens (tokens are money: a rich pod's unmet counts more);
- idle while starved: node capacity left unused while pods were short of their demand by
  more than a point though their budgets (reservation and the burst credit the rules let
  them spend in that period) could have paid for it — at most the shortfalls' sum — over
  capacity × periods: what a work-conserving node never does. A pod its budget holds back is
  not counted: no policy within budgets could serve it. Nor is a coupled pod: what it is
  short of one resource depends on the other (a pipeline held back by its GPU leaves the
  CPU it would use idle), and its progress is the figure that judges it;
- slack: Σ max(0, limit − usage) / Σ limit, over the pods the policy managed;
- budget overspend: tokens spent beyond a pod's reservation and the burst credit it had
  saved (the token queue, capped at `burst_seconds` of reservation), over all reservations;
- reaction time: from a demand increase until the limit covers 95 % of the new demand. An
  increase never covered before demand changes again (or the pod ends) counts the whole
  spell, so a policy that never reacts is not rewarded by being left out;
- limit changes per pod-hour, and the policy's own compute time per tick;
- priced unmet: the token value of the demand left unmet over both resources,
  Σ price·unmet / Σ price·demand, a point of GPU at the GPU's price: what a budget that binds
  is judged by when it must choose what to cut;
- progress: each coupled pod's work done, the served fraction of its scarcest resource
  (of those it asks at least `PROGRESS_FLOOR` of), averaged over the periods it asks for
  work and weighted by tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kuscale.model import RESOURCES, Resource
from kuscale.policy.base import BoolArray, FloatArray
from kuscale.sim.run import Trace
from kuscale.sim.scenario import Scenario

COVERED = 0.95
INCREASE_POINTS = 10.0
"""A demand increase is at least this many percentage points..."""
INCREASE_RATIO = 1.2
"""...and at least this factor over the demand before it (noise is not an increase)."""
CHANGE_RESOLUTION = 0.01
OVERSPEND_TOLERANCE = 1e-6
RULE_TOLERANCE = 1e-6
PROGRESS_FLOOR = 1.0
"""Percent: a demand below this asks for no work; it neither limits nor counts progress."""
STARVED_POINTS = 1.0
"""A pod served this many percentage points below its demand, that could pay for them, is
starved."""


def evaluate(trace: Trace) -> dict[str, Any]:
    """The metrics of one run, in the shape `kuscale sim --json` writes."""
    scenario = trace.scenario
    reach = np.array([scenario.cores * 100.0, 100.0])
    limit = np.where(np.isnan(trace.limit), reach, trace.limit).astype(np.float64)
    demand = trace.demand.astype(np.float64)
    usage = trace.usage.astype(np.float64)
    managed = trace.alive & ~trace.refused
    ledger = replay_queues(trace, limit)
    headroom = np.maximum(ledger.allowance - ledger.spend, 0.0)
    headroom[:, coupled_pods(scenario)] = 0.0
    prices = scenario.config.policy_config.prices()
    result: dict[str, Any] = {}
    for resource in RESOURCES:
        uses = trace.uses[:, resource]
        if not uses.any():
            result[resource.label] = dict.fromkeys(RESOURCE_METRICS)
            continue
        d, u, lim = demand[:, uses, resource], usage[:, uses, resource], limit[:, uses, resource]
        held = managed[:, uses]
        result[resource.label] = {
            "unmet_demand_fraction": _ratio(np.maximum(d - u, 0.0).sum(), d.sum()),
            "token_weighted_unmet_fraction": _ratio(
                (np.maximum(d - u, 0.0) * trace.tokens[uses]).sum(),
                (d * trace.tokens[uses]).sum(),
            ),
            "idle_while_starved_fraction": _idle_while_starved_by_unit(
                trace, resource, d, u, headroom[:, uses] / prices[resource]
            ),
            "slack_fraction": _ratio(
                np.where(held, np.maximum(lim - u, 0.0), 0.0).sum(), np.where(held, lim, 0.0).sum()
            ),
        }
    reactions = reaction_seconds(demand, limit, trace.alive, trace.uses, scenario.period)
    pod_hours = trace.alive.sum() * scenario.period / 3600.0
    result.update(
        {
            "budget_overspend_fraction": ledger.overspend if trace.exact else None,
            "within_rules": ledger.within_rules() if trace.exact else None,
            "reaction_seconds_median": _percentile(reactions, 50),
            "reaction_seconds_p95": _percentile(reactions, 95),
            "demand_increases": len(reactions),
            "limit_changes_per_pod_hour": _ratio(
                limit_changes(limit, managed, trace.uses), pod_hours
            ),
            "decide_seconds_per_tick": trace.decide_seconds_per_tick,
            "refused_pods": int(trace.refused.sum()),
            "priced_unmet_fraction": priced_unmet(demand, usage, trace.uses, prices),
            "coupled_progress": coupled_progress(
                demand, usage, trace.alive, coupled_pods(scenario), trace.tokens
            ),
            "gpu_device_peak_percent": device_peaks(trace),
        }
    )
    return result


def coupled_pods(scenario: Scenario) -> BoolArray:
    return np.array([pod.coupled for pod in scenario.pods], dtype=bool)


def priced_unmet(
    demand: FloatArray, usage: FloatArray, uses: BoolArray, prices: FloatArray
) -> float | None:
    """Σ price·(demand − usage)⁺ / Σ price·demand over every pod, resource and period."""
    return weighted_unmet(demand, usage, np.where(uses[None], prices, 0.0))


def weighted_unmet(demand: FloatArray, served: FloatArray, weights: FloatArray) -> float | None:
    """Σ w·(demand − served)⁺ / Σ w·demand over a run; None without demand."""
    whole = float((demand * weights).sum())
    if whole <= 0:
        return None
    return float((np.maximum(demand - served, 0.0) * weights).sum() / whole)


def coupled_progress(
    demand: FloatArray, usage: FloatArray, alive: BoolArray, coupled: BoolArray, tokens: FloatArray
) -> float | None:
    """The token-weighted mean over coupled pods of each one's mean progress per period;
    None where no coupled pod asked for work."""
    step, working = progress_by_period(demand[:, coupled], usage[:, coupled], alive[:, coupled])
    periods = working.sum(axis=0)
    asked = periods > 0
    if not asked.any():
        return None
    means = np.where(working, step, 0.0).sum(axis=0)[asked] / periods[asked]
    weights = tokens[coupled][asked]
    return float((means * weights).sum() / weights.sum())


def progress_by_period(
    demand: FloatArray, usage: FloatArray, alive: BoolArray
) -> tuple[FloatArray, BoolArray]:
    """Per period and pod, the served fraction of its scarcest resource, and whether the
    pod asked for work then (alive, at least `PROGRESS_FLOOR` of some resource)."""
    asked = demand >= PROGRESS_FLOOR
    fraction = np.minimum(usage / np.where(asked, demand, 1.0), 1.0)
    step = np.where(asked, fraction, 1.0).min(axis=2)
    return step, alive & asked.any(axis=2)


def _idle_while_starved_by_unit(
    trace: Trace, resource: Resource, demand: FloatArray, usage: FloatArray, affordable: FloatArray
) -> float:
    """Over the node's CPU; over each GPU device on its own (a pod starving on one GPU
    cannot use another's idle time), averaged over the devices."""
    scenario = trace.scenario
    if resource is Resource.CPU:
        return idle_while_starved(demand, usage, affordable, scenario.cores * 100.0)
    devices = np.array([pod.device for pod in scenario.pods])[trace.uses[:, resource]]
    per_device = [
        idle_while_starved(
            demand[:, devices == d], usage[:, devices == d], affordable[:, devices == d], 100.0
        )
        for d in range(scenario.gpus)
    ]
    return float(np.mean(per_device))


def device_peaks(trace: Trace) -> list[float]:
    """The most any tick's pods used of each GPU device together: never above 100 where
    the node shares each device on its own."""
    devices = np.array([pod.device for pod in trace.scenario.pods])
    gpu = trace.usage[:, :, RESOURCES[1]].astype(np.float64)
    return [
        float(gpu[:, devices == device].sum(axis=1).max(initial=0.0))
        for device in range(trace.scenario.gpus)
    ]


RESOURCE_METRICS = (
    "unmet_demand_fraction",
    "token_weighted_unmet_fraction",
    "idle_while_starved_fraction",
    "slack_fraction",
)


def idle_while_starved(
    demand: FloatArray, usage: FloatArray, affordable: FloatArray, capacity: float
) -> float:
    """Σ over periods of the node's unused capacity that starved pods could have used (no
    more than their shortfalls add up to), over capacity × periods.

    `affordable` is how many more percent each pod's budget could have bought in the period
    (inf for unmanaged pods)."""
    short = demand - usage
    starved = (short > STARVED_POINTS) & (affordable >= short)
    wanted = np.where(starved, short, 0.0).sum(axis=1)
    idle = np.maximum(capacity - usage.sum(axis=1), 0.0)
    return _ratio(float(np.minimum(idle, wanted).sum()), capacity * demand.shape[0])


def _ratio(part: float, whole: float) -> float:
    return float(part / whole) if whole > 0 else 0.0


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


@dataclass(frozen=True, slots=True)
class Ledger:
    """Every managed pod's tokens, replayed from the limits it held (per period and pod)."""

    spend: FloatArray
    """Tokens per second the limits held in the period cost: Σ_r p_r·L_r."""
    allowance: FloatArray
    """Tokens per second the rules allowed in the period: R + k·Q/T, Q the queue before it."""
    overspend: float
    """Tokens spent beyond reservations and saved credit, over all reservations."""

    def within_rules(self) -> bool:
        """True when no period spent beyond its allowance: the oracle's rules were kept."""
        return bool((self.spend <= self.allowance * (1.0 + RULE_TOLERANCE) + RULE_TOLERANCE).all())


def replay_queues(trace: Trace, limit: FloatArray) -> Ledger:
    """Replay every pod's token queue without the floor at 0: what falls below is overspend."""
    scenario = trace.scenario
    config = scenario.config.policy_config
    managed = trace.alive & ~trace.refused
    rate = np.where(
        managed, (np.where(trace.uses[None], limit, 0.0) * config.prices()).sum(axis=2), 0.0
    )
    earned = trace.tokens * scenario.period
    cap = trace.tokens * config.burst_seconds
    queue = np.zeros(trace.tokens.shape)
    over = np.zeros(trace.tokens.shape)
    allowance = np.zeros(rate.shape)
    for tick in range(rate.shape[0]):
        held = managed[tick]
        allowance[tick] = np.where(
            held, trace.tokens + config.burst_factor * queue / scenario.period, np.inf
        )
        queue = np.where(held, np.minimum(queue + earned - rate[tick] * scenario.period, cap), 0.0)
        short = np.where(queue < -OVERSPEND_TOLERANCE * earned, -queue, 0.0)
        over += short
        queue = np.maximum(queue, 0.0)
    budget = (managed.sum(axis=0) * earned).sum()
    return Ledger(rate, allowance, _ratio(float(over.sum()), float(budget)))


def limit_changes(limit: FloatArray, managed: np.ndarray, uses: np.ndarray) -> int:
    moved = np.abs(np.diff(limit, axis=0)) > CHANGE_RESOLUTION
    counted = moved & managed[1:, :, None] & managed[:-1, :, None] & uses[None]
    return int(counted.sum())


def reaction_seconds(
    demand: FloatArray, limit: FloatArray, alive: np.ndarray, uses: np.ndarray, period: float
) -> list[float]:
    """Seconds from each demand increase until the limit covers 95 % of it."""
    rise = demand[1:] - demand[:-1]
    increases = (
        (rise >= INCREASE_POINTS)
        & (demand[1:] >= INCREASE_RATIO * demand[:-1])
        & alive[1:, :, None]
        & uses[None]
    )
    changed = np.abs(rise) > 1e-9
    seconds: list[float] = []
    for step, pod, resource in zip(*np.nonzero(increases), strict=True):
        start = step + 1
        column_changes = np.flatnonzero(changed[start:, pod, resource])
        end = start + int(column_changes[0]) + 1 if column_changes.size else demand.shape[0]
        lifetime = np.flatnonzero(~alive[start:end, pod])
        end = start + int(lifetime[0]) if lifetime.size else end
        target = COVERED * demand[start, pod, resource]
        covered = np.flatnonzero(limit[start:end, pod, resource] >= target)
        ticks = int(covered[0]) if covered.size else end - start
        seconds.append(ticks * period)
    return seconds
