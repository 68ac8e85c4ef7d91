"""Each tick's decision: the sample and each pod's memory (limits, averages, estimates) as one
Observation, one call of the policy, and its answer kept in the table."""

from __future__ import annotations

import numpy as np

from kuscale.config import AgentConfig
from kuscale.monitor.sampling import Sample
from kuscale.monitor.table import PodTable, put_rows, take_rows
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

    def _moving(self, sample: Sample, uses: BoolArray) -> tuple[FloatArray, FloatArray]:
        """The EWMA average of usage and of its change since the last tick, moved by this
        sample (0 where a pod does not use the resource)."""
        c = self.table.columns
        rows = sample.rows
        usage, weight = sample.usage, self.ewma_weight
        previous_avg, previous_spread = take_rows(c.avg_usage, rows), take_rows(c.spread, rows)
        avg = np.where(uses, previous_avg + weight * (usage - previous_avg), 0.0)
        deviation = np.abs(usage - take_rows(c.usage, rows))
        spread = np.where(uses, previous_spread + weight * (deviation - previous_spread), 0.0)
        return avg, spread

    def observe(
        self, sample: Sample, uses: BoolArray, avg: FloatArray, spread: FloatArray
    ) -> Observation:
        """The limits, demand estimates and queue are what the pods held since the last
        tick: of each limit the most they held, which is what they are charged for (a GPU
        limit the watch lowered part way through the period was held until then)."""
        c = self.table.columns
        rows = sample.rows
        return Observation(
            period=self.period,
            elapsed=sample.elapsed,
            tokens=c.tokens[rows],
            queue=c.queue[rows],
            usage=sample.usage,
            avg_usage=avg,
            limits=take_rows(c.peak, rows),
            starved=sample.starved & uses,
            demand=take_rows(c.demand, rows),
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
        resources; the limits are the actuator's to write.

        A resource a pod does not use keeps 0 in every column: the sample and the moving
        averages hold 0 there already, and the policy's answers are masked."""
        c = self.table.columns
        rows = sample.rows
        uses = take_rows(c.uses, rows)
        avg, spread = self._moving(sample, uses)
        obs = self.observe(sample, uses, avg, spread)
        decision = self.policy.decide(obs)
        c.queue[rows] = decision.queue
        c.updates[rows] += 1
        put_rows(c.usage, rows, sample.usage)
        put_rows(c.avg_usage, rows, avg)
        put_rows(c.spread, rows, spread)
        put_rows(c.starved, rows, obs.starved)
        put_rows(c.demand, rows, np.where(uses, decision.demand, 0.0))
        put_rows(c.weight, rows, np.where(uses, decision.weights, 0.0))
        self.table.record_history(rows, sample.usage)
        return decision
