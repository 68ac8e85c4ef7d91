"""Each tick's decision: the sample and each pod's memory (limits, averages, estimates) as one
Observation, one call of the policy, and its answer kept in the table."""

from __future__ import annotations

import numpy as np

from kuscale.config import AgentConfig
from kuscale.monitor.sampling import Sample
from kuscale.monitor.table import PodTable
from kuscale.policy import Decision, Observation, Policy
from kuscale.policy.base import BoolArray, FloatArray


class Decider:
    def __init__(
        self,
        table: PodTable,
        policy: Policy,
        config: AgentConfig,
        reach: FloatArray,
        weighted: BoolArray,
        device_capacity: FloatArray,
    ) -> None:
        self.table = table
        self.policy = policy
        self.period = config.period
        self.ewma_weight = config.policy_config.ewma_weight
        self.reach = reach
        self.weighted = weighted
        self.device_capacity = device_capacity

    def _moving(self, sample: Sample) -> tuple[FloatArray, FloatArray]:
        """The EWMA average of usage and of its change since the last tick, moved by this
        sample (0 where a pod does not use the resource)."""
        c = self.table.columns
        rows = sample.rows
        uses = c.uses[rows]
        usage, weight = sample.usage, self.ewma_weight
        previous_avg, previous_spread = c.avg_usage[rows], c.spread[rows]
        avg = np.where(uses, previous_avg + weight * (usage - previous_avg), 0.0)
        deviation = np.abs(usage - c.usage[rows])
        spread = np.where(uses, previous_spread + weight * (deviation - previous_spread), 0.0)
        return avg, spread

    def observe(self, sample: Sample, avg: FloatArray, spread: FloatArray) -> Observation:
        """The limits, demand estimates and queue are what the pods held since the last
        tick."""
        c = self.table.columns
        rows = sample.rows
        uses = c.uses[rows]
        return Observation(
            period=self.period,
            elapsed=sample.elapsed,
            tokens=c.tokens[rows],
            queue=c.queue[rows],
            usage=sample.usage,
            avg_usage=avg,
            limits=c.limit[rows],
            starved=sample.starved & uses,
            demand=c.demand[rows],
            uses=uses,
            capacity=self.reach,
            keys=sample.keys,
            throttled=sample.throttled,
            spread=spread,
            weighted=self.weighted,
            device=c.device[rows],
            device_capacity=self.device_capacity,
        )

    def decide(self, sample: Sample) -> Decision:
        """Ask the policy, and remember what this tick measured and estimated for the pods'
        resources; the limits are the actuator's to write."""
        avg, spread = self._moving(sample)
        obs = self.observe(sample, avg, spread)
        decision = self.policy.decide(obs)
        c = self.table.columns
        rows, uses = sample.rows, obs.uses
        c.queue[rows] = decision.queue
        c.updates[rows] += 1
        for column, values in (
            (c.demand, decision.demand),
            (c.usage, sample.usage),
            (c.avg_usage, avg),
            (c.spread, spread),
            (c.starved, obs.starved),
            (c.weight, decision.weights),
        ):
            column[rows] = np.where(uses, values, column[rows])
        self.table.record_history(rows)
        return decision
