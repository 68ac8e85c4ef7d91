"""How well a policy served a scenario: what users judge an autoscaler by, from one trace.

- unmet demand: Σ max(0, demand − usage) / Σ demand, per resource, over every pod;
- slack: Σ max(0, limit − usage) / Σ limit, over the pods the policy managed;
- budget overspend: tokens spent beyond a pod's reservation and the burst credit it had
  saved (the token queue, capped at `burst_seconds` of reservation), over all reservations;
- reaction time: from a demand increase until the limit covers 95 % of the new demand. An
  increase never covered before demand changes again (or the pod ends) counts the whole
  spell, so a policy that never reacts is not rewarded by being left out;
- limit changes per pod-hour, and the policy's own compute time per tick.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kuscale.model import RESOURCES
from kuscale.policy.base import FloatArray
from kuscale.sim.run import Trace

COVERED = 0.95
INCREASE_POINTS = 10.0
"""A demand increase is at least this many percentage points..."""
INCREASE_RATIO = 1.2
"""...and at least this factor over the demand before it (noise is not an increase)."""
CHANGE_RESOLUTION = 0.01
OVERSPEND_TOLERANCE = 1e-6


def evaluate(trace: Trace) -> dict[str, Any]:
    """The metrics of one run, in the shape `kuscale sim --json` writes."""
    scenario = trace.scenario
    capacity = np.array([scenario.cores * 100.0, scenario.gpus * 100.0])
    limit = np.where(np.isnan(trace.limit), capacity, trace.limit).astype(np.float64)
    demand = trace.demand.astype(np.float64)
    usage = trace.usage.astype(np.float64)
    managed = trace.alive & ~trace.refused
    result: dict[str, Any] = {}
    for resource in RESOURCES:
        uses = trace.uses[:, resource]
        if not uses.any():
            result[resource.label] = {"unmet_demand_fraction": None, "slack_fraction": None}
            continue
        d, u, lim = demand[:, uses, resource], usage[:, uses, resource], limit[:, uses, resource]
        held = managed[:, uses]
        result[resource.label] = {
            "unmet_demand_fraction": _ratio(np.maximum(d - u, 0.0).sum(), d.sum()),
            "slack_fraction": _ratio(
                np.where(held, np.maximum(lim - u, 0.0), 0.0).sum(), np.where(held, lim, 0.0).sum()
            ),
        }
    reactions = reaction_seconds(demand, limit, trace.alive, trace.uses, scenario.period)
    pod_hours = trace.alive.sum() * scenario.period / 3600.0
    result.update(
        {
            "budget_overspend_fraction": overspend_fraction(trace, limit),
            "reaction_seconds_median": _percentile(reactions, 50),
            "reaction_seconds_p95": _percentile(reactions, 95),
            "demand_increases": len(reactions),
            "limit_changes_per_pod_hour": _ratio(
                limit_changes(limit, managed, trace.uses), pod_hours
            ),
            "decide_seconds_per_tick": trace.decide_seconds_per_tick,
            "refused_pods": int(trace.refused.sum()),
        }
    )
    return result


def _ratio(part: float, whole: float) -> float:
    return float(part / whole) if whole > 0 else 0.0


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def overspend_fraction(trace: Trace, limit: FloatArray) -> float:
    """Replay every pod's token queue without the floor at 0: what falls below is overspend."""
    scenario = trace.scenario
    prices = scenario.config.policy_config.prices()
    managed = trace.alive & ~trace.refused
    spend = (np.where(trace.uses[None], limit, 0.0) * prices).sum(axis=2) * scenario.period
    earned = trace.tokens * scenario.period
    cap = trace.tokens * scenario.config.policy_config.burst_seconds
    queue = np.zeros(trace.tokens.shape)
    over = np.zeros(trace.tokens.shape)
    for tick in range(spend.shape[0]):
        held = managed[tick]
        queue = np.where(held, np.minimum(queue + earned - spend[tick], cap), queue)
        short = np.where(queue < -OVERSPEND_TOLERANCE * earned, -queue, 0.0)
        over += short
        queue = np.maximum(queue, 0.0)
    budget = (managed.sum(axis=0) * earned).sum()
    return _ratio(float(over.sum()), float(budget))


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
