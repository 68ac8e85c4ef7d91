"""`kuscale`, the default rule: per-pod budgets that catch bursts, a node shared by tokens.

Pod stage: the original objective on a demand estimate, with bounds and an exact budget
(`podstage`). Burst credit raises the budget, not the appetite: the objective's linear term
uses the reservation alone, so a pod with saved credit may spend it on demand but is not
pushed to hold headroom it does not need. Node stage: where the pods' desired limits of a
resource exceed what the node has (times its overcommit), weighted max-min fair sharing
with tokens as weights (`waterfill`), in two passes: first up to each pod's estimated need,
then the headroom above it, so one pod's headroom never starves another's demand. Under
contention, tokens decide who gets what.
"""

from __future__ import annotations

import numpy as np

from kuscale.config import PolicyConfig
from kuscale.model import RESOURCES, Resource
from kuscale.policy.base import (
    BoolArray,
    Decision,
    FloatArray,
    GpuLook,
    IntArray,
    Observation,
    Starving,
)
from kuscale.policy.coupling import CouplingEvidence, in_step, keep_in_step, split_in_proportion
from kuscale.policy.demand import estimate_demand
from kuscale.policy.original import dynamic_weights
from kuscale.policy.podstage import solve_within, spend_curves
from kuscale.policy.waterfill import rebalance_devices, water_fill
from kuscale.rows import row_sum
from kuscale.tokens import advance_queue


class KuscalePolicy:
    name = "kuscale"

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.prices = config.prices()
        self.minimums = config.minimums()
        self.overcommit = np.array([config.resource(r).overcommit for r in RESOURCES])
        self._bounds_for = b""
        self._bounds = np.zeros(len(RESOURCES))
        self.coupling = CouplingEvidence()

    def upper_bounds(self, capacity: FloatArray) -> FloatArray:
        """Per-pod caps: the configured max, never above what the node has. Kept for the
        last capacity asked: a node's capacity changes seldom, and every tick asks."""
        key = capacity.tobytes()
        if key != self._bounds_for:
            caps = [self.config.resource(r).max for r in RESOURCES]
            self._bounds = np.array(
                [
                    capacity[r] if cap is None else min(cap, capacity[r])
                    for r, cap in zip(RESOURCES, caps, strict=True)
                ]
            )
            self._bounds.flags.writeable = False
            self._bounds_for = key
        return self._bounds

    def admit(
        self, tokens: float, uses: BoolArray, capacity: FloatArray, committed: FloatArray
    ) -> str | None:
        """Refuse what the node or the pod's tokens cannot honour, with the reason."""
        for r in RESOURCES:
            if uses[r] and capacity[r] <= 0:
                return f"the pod asks for {r.label} and this node has none"
            if uses[r] and committed[r] + self.minimums[r] > capacity[r] * self.overcommit[r]:
                return (
                    f"the node's {r.label} is full: minimum limits would reach "
                    f"{committed[r] + self.minimums[r]:g} % of {capacity[r]:g} %"
                )
        floor_cost = float((self.prices * self.minimums)[uses].sum())
        if floor_cost > tokens:
            return f"{tokens:g} tokens cannot buy the minimum limits, which cost {floor_cost:g}"
        return None

    def decide(self, obs: Observation) -> Decision:
        cfg = self.config
        prices = np.where(obs.uses, self.prices, 0.0)
        queue = advance_queue(
            obs.queue, obs.tokens, obs.limits, prices, obs.elapsed, obs.tokens * cfg.burst_seconds
        )
        upper = self.upper_bounds(obs.capacity)
        spread = np.zeros_like(obs.usage) if obs.spread is None else obs.spread
        demand = estimate_demand(
            obs.usage,
            obs.limits,
            obs.starved,
            obs.demand,
            upper,
            cfg.growth,
            cfg.damping,
            spread,
            cfg.noise_margin,
            cfg.pin_tolerance,
        )
        weights = dynamic_weights(obs, prices, cfg.static_v)
        budget = self.budget(obs.tokens, queue, obs.period)
        demand = self.leap_within_budget(demand, obs.usage, obs.starved, obs.limits, prices, budget)
        coupled = self.coupling.observe(obs.pod_keys(), obs.usage, obs.starved, obs.uses)
        if coupled.any():
            demand = np.where(coupled[:, None], in_step(demand, obs.usage, obs.starved), demand)
        available = obs.tokens * obs.period * self.credit_left(queue, obs.tokens)
        curves = spend_curves(demand, self.prices, weights, self.minimums, upper, obs.uses)
        desired = solve_within(curves, budget, available)
        free = np.minimum(self.free_spend(queue, obs.tokens, obs.period), budget)
        if (free > 0).any():
            generous = solve_within(curves, free, np.full(free.shape, np.inf))
            desired = np.maximum(desired, generous)
        if coupled.any():
            desired = self.split_pipelines(desired, demand, prices, budget, upper, coupled)
        weighted = np.zeros(len(RESOURCES), dtype=bool) if obs.weighted is None else obs.weighted
        limits = self.share_node(
            desired,
            demand,
            obs.tokens,
            obs.uses,
            obs.capacity,
            weighted,
            obs.device,
            obs.device_capacity,
        )
        if coupled.any():
            lower = np.where(obs.uses, self.minimums, 0.0)
            limits = keep_in_step(limits, desired, coupled, lower)
        return Decision(
            limits=limits,
            weights=np.where(obs.uses, weights, 0.0),
            queue=queue,
            demand=np.where(obs.uses, demand, 0.0),
        )

    def split_pipelines(
        self,
        desired: FloatArray,
        demand: FloatArray,
        prices: FloatArray,
        budget: FloatArray,
        upper: FloatArray,
        coupled: BoolArray,
    ) -> FloatArray:
        """A coupled pod whose budget cannot buy its demand buys every resource the same
        fraction of it, with its whole budget: the one split under which it can use all it
        pays for (docs/policy.md, "A budget that binds")."""
        uses = prices > 0
        split, binding = split_in_proportion(
            demand, self.prices, budget, self.minimums, upper, uses
        )
        return np.where((coupled & binding)[:, None], split, desired)

    def leap_within_budget(
        self,
        demand: FloatArray,
        usage: FloatArray,
        starved: BoolArray,
        limits: FloatArray,
        prices: FloatArray,
        budget: FloatArray,
    ) -> FloatArray:
        """A starved resource's leap takes only the budget its pod's other resources do not
        use (and never less than the limit it holds): otherwise a leap on the dear GPU
        starves the CPU of the same pod, whose leap then starves the GPU, and the pod pays
        for both. What they use, not their estimates: the margins of an estimate are
        headroom, and where the budget binds demand comes first; the pod stage then splits
        the shortfall over both by the objective."""
        needed = np.where(starved, demand, np.minimum(demand, usage))
        spend = prices * needed
        others = row_sum(spend)[:, None] - spend
        room = (budget[:, None] - others) / np.where(prices > 0, prices, 1.0)
        capped = np.minimum(demand, np.maximum(room, limits))
        return np.where(starved, capped, demand)

    def raise_starved(self, obs: Starving) -> FloatArray:
        """The fast path: a pod throttled between ticks gets at once the CPU it was short
        of, within the largest its budget allows now (reservation plus the burst credit of
        the last tick, less what its other resources held this period), up to its cap.

        The step is sized by the evidence: the time the pod spent throttled since the last
        look, summed over CPUs, over the look's wall time, is how far its demand exceeds its
        limit (each thread held back waits for the rest of the period). A burst from an
        idle limit is short by a lot and is covered in one look; a pod pinned by its own
        noise is short by little and pays for a small step, not for its whole budget. The
        step is at least twice the pin tolerance (a throttled pod needs more than it holds)
        and, where the shortfall is not known yet (the pod's first look), `fast_growth`
        times the limit. A raise is charged for the whole period, and the watch looks again
        within a tenth of it. Where the kernel shares the CPU by tokens that is all;
        otherwise only what no other pod holds of the node's capacity × overcommit is given,
        pod by pod. Never below what a pod holds: the next tick re-balances."""
        cpu = Resource.CPU
        held_cpu = obs.limits[:, cpu]
        step = held_cpu * self.config.fast_growth
        if obs.shortfall is not None:
            least = held_cpu * (1.0 + 2.0 * self.config.pin_tolerance)
            sized = np.maximum(held_cpu + obs.shortfall, least)
            step = np.where(np.isfinite(obs.shortfall), sized, step)
        affordable = self.fast_ceiling(
            cpu, obs.tokens, obs.queue, obs.period, obs.limits, obs.uses, obs.capacity, step
        )
        wanted = np.maximum(affordable, obs.limits[:, cpu])
        if not obs.weighted[cpu]:
            spare = max(float(obs.capacity[cpu] * self.overcommit[cpu] - obs.held[cpu]), 0.0)
            extra = np.maximum(wanted - obs.limits[:, cpu], 0.0)
            granted = np.minimum(extra, np.maximum(spare - (np.cumsum(extra) - extra), 0.0))
            wanted = obs.limits[:, cpu] + granted
        limits = obs.limits.copy()
        limits[:, cpu] = np.where(np.isfinite(wanted), wanted, obs.limits[:, cpu])
        return limits

    def raise_pinned_gpu(self, obs: GpuLook) -> FloatArray:
        """The GPU's fast path: a pod pinned at its GPU limit since the last look gets at
        once up to `fast_growth` times it, within what its budget allows now (as
        `raise_starved`), up to its cap, out of what its device leaves unheld and what other
        pods there hold above their use plus a margin (the quiet demand estimate's), never
        below their minimum. Pinned pods share that by tokens. Where the layer shares by
        tokens, the raise is the budget's alone, as on the CPU. The next tick re-balances."""
        gpu = Resource.GPU
        held = obs.limits[:, gpu]
        step = held * self.config.fast_growth
        affordable = self.fast_ceiling(
            gpu, obs.tokens, obs.queue, obs.period, obs.limits, obs.uses, obs.capacity, step
        )
        wanted = np.where(obs.pinned, np.maximum(affordable - held, 0.0), 0.0)
        if obs.weighted:
            return held + wanted
        tolerance = self.config.pin_tolerance
        kept = np.maximum(
            obs.usage * (1.0 + 2.0 * tolerance), obs.usage + self.config.noise_margin * obs.spread
        )
        spare = np.where(
            obs.pinned, 0.0, np.maximum(held - np.maximum(kept, self.minimums[gpu]), 0.0)
        )
        rooms = obs.device_capacity * self.overcommit[gpu]
        return rebalance_devices(held, wanted, spare, obs.tokens, obs.device, rooms)

    def fast_ceiling(
        self,
        resource: Resource,
        tokens: FloatArray,
        queue: FloatArray,
        period: float,
        limits: FloatArray,
        uses: BoolArray,
        capacity: FloatArray,
        step: FloatArray,
    ) -> FloatArray:
        """The most one look of the watch may raise `resource` to, per pod: what the budget
        allows now beside what the pod's other resources are charged for this period (their
        columns of `limits`), up to the pod's cap and the `step` the evidence asks."""
        prices = np.where(uses, self.prices, 0.0)
        budget = self.budget(tokens, queue, period)
        held = limits[:, resource]
        others = row_sum(prices * limits) - prices[:, resource] * held
        cap = float(self.upper_bounds(capacity)[resource])
        affordable = np.minimum((budget - others) / self.prices[resource], cap)
        return np.asarray(np.minimum(affordable, step), np.float64)

    def credit_left(self, queue: FloatArray, tokens: FloatArray) -> FloatArray:
        """The share of its token queue a pod still has, 1 where saved credit can never be
        spent (burst factor 0). The headroom a pod holds above its demand estimate shrinks
        with it: every token held as headroom is one not saved, so a pod whose budget binds
        spends its credit on demand first, not on headroom before its peak (the original's
        objective holds A/2 of it whatever the queue). A pod with a full queue holds the
        original's headroom; a new pod, with none saved yet, holds its estimate."""
        if self.config.burst_factor <= 0:
            return np.ones_like(tokens)
        cap = np.maximum(tokens * self.config.burst_seconds, 1e-9)
        return np.asarray(np.clip(queue / cap, 0.0, 1.0), dtype=np.float64)

    def budget(self, tokens: FloatArray, queue: FloatArray, period: float) -> FloatArray:
        """B = R + k·Q/T: what a pod may spend per second, at a tick and at a fast raise."""
        return np.asarray(tokens + self.config.burst_factor * queue / period, dtype=np.float64)

    def free_spend(self, queue: FloatArray, tokens: FloatArray, period: float) -> FloatArray:
        """Tokens per second a pod can spend at no cost to its future: what would overflow
        its token queue this period if it spent less, or all of its reservation when saved
        credit can never be spent (burst factor 0). Holding limits up to that costs nothing,
        so a pod holds them as headroom: use it or lose it."""
        if self.config.burst_factor <= 0:
            return tokens.copy()
        cap = tokens * self.config.burst_seconds
        return np.asarray(np.maximum(tokens - (cap - queue) / period, 0.0), dtype=np.float64)

    def share_node(
        self,
        desired: FloatArray,
        demand: FloatArray,
        tokens: FloatArray,
        uses: BoolArray,
        capacity: FloatArray,
        weighted: BoolArray,
        device: IntArray | None = None,
        device_capacity: FloatArray | None = None,
    ) -> FloatArray:
        """Water-fill each resource the pods want more of than the node has (each GPU device
        on its own, as a client's share lives on one device): first what
        each pod is estimated to need, then the headroom above it, both by tokens.

        When the needs alone fill the node, they are not trusted: on a saturated node the
        kernel caps usage below the limits, so every estimate reads low and whoever holds
        more would keep it. Then tokens alone decide, over what the pods desire.

        A resource the kernel shares by tokens (`weighted`) is left to the kernel: each pod
        keeps the limit its budget buys, and contended capacity goes by weight inside every
        period, so what one pod leaves idle another can use at once."""
        limits = desired.copy()
        for r in RESOURCES:
            if weighted[r]:
                continue
            for column, room in _shared_units(r, uses, capacity, device, device_capacity):
                if not column.any():
                    continue
                share = float(room * self.overcommit[r])
                wanted = desired[column, r]
                floors = np.full(wanted.shape, self.minimums[r])
                need = np.minimum(np.maximum(demand[column, r], floors), wanted)
                if need.sum() >= share:
                    need = wanted
                first = water_fill(share, tokens[column], need, floors=floors)
                rest = max(share - float(first.sum()), 0.0)
                limits[column, r] = first + water_fill(rest, tokens[column], wanted - first)
        return limits


def _shared_units(
    resource: Resource,
    uses: BoolArray,
    capacity: FloatArray,
    device: IntArray | None,
    device_capacity: FloatArray | None,
) -> list[tuple[BoolArray, float]]:
    """The pods that share one unit of a resource, and its capacity: the node's CPU; each
    GPU device, where the layer places clients on devices."""
    column = uses[:, resource]
    if resource is not Resource.GPU or device is None or device_capacity is None:
        return [(column, float(capacity[resource]))]
    return [(column & (device == d), float(room)) for d, room in enumerate(device_capacity)]
