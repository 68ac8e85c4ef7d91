"""`vpa`: the Kubernetes Vertical Pod Autoscaler's recommender, applied in place.

As the VPA documentation and recommender source describe it: every usage sample goes into a
histogram with exponentially growing buckets (the first 0.01 cores wide, each 5 % wider than
the last), weighted by 2^(age / half-life) so that old samples fade (half-life 24 h); every
minute the target is the 90th percentile plus a 15 % safety margin, never below 25
millicores. Here it drives the GPU share the same way, and its target is applied at once
rather than by evicting the pod, which flatters it.
"""

from __future__ import annotations

import math

import numpy as np

from kuscale.config import PolicyConfig
from kuscale.policy.base import Decision, FloatArray, Observation
from kuscale.policy.memory import PodRows
from kuscale.policy.static import TokenBlind

FIRST_BUCKET = 1.0
"""Percent of a core: 0.01 cores."""
BUCKET_RATIO = 1.05
MAX_VALUE = 100_000.0
"""Percent: 1000 cores, the recommender's largest CPU bucket."""
MIN_TARGET = 2.5
"""Percent: 25 millicores."""
RENORMALISE_AT = 1e100


def bucket_starts() -> FloatArray:
    count = math.ceil(math.log(1 + MAX_VALUE * (BUCKET_RATIO - 1) / FIRST_BUCKET, BUCKET_RATIO))
    powers = BUCKET_RATIO ** np.arange(count + 1)
    return np.asarray(FIRST_BUCKET * (powers - 1) / (BUCKET_RATIO - 1), dtype=np.float64)


class VpaPolicy(TokenBlind):
    name = "vpa"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config, np.maximum(config.minimums(), MIN_TARGET))
        self.edges = bucket_starts()
        buckets = self.edges.size - 1
        self.histograms = PodRows((2, buckets))
        self.targets = PodRows((2,))
        self.clock = 0.0
        self.next_recompute = 0.0
        self.scale = 1.0

    def decide(self, obs: Observation) -> Decision:
        keys = obs.pod_keys()
        self._add_samples(keys, obs)
        rows = self.targets.rows(keys)
        targets = self.targets.data[rows]
        if self.clock >= self.next_recompute:
            targets = self._recompute(keys, obs)
            self.next_recompute = self.clock + self.settings.vpa_interval
        self.clock += obs.period
        limits = np.where(targets > 0, targets, obs.limits)
        return self.decision(limits, targets, obs)

    def _add_samples(self, keys: tuple[str, ...], obs: Observation) -> None:
        weight = 2.0 ** (self.clock / self.settings.vpa_half_life) / self.scale
        if weight > RENORMALISE_AT:
            self.histograms.data /= weight
            self.scale *= weight
            weight = 1.0
        rows = self.histograms.rows(keys)
        buckets = np.clip(
            np.searchsorted(self.edges, obs.usage, side="right") - 1, 0, self.edges.size - 2
        )
        pods, resources = np.nonzero(obs.uses)
        np.add.at(self.histograms.data, (rows[pods], resources, buckets[pods, resources]), weight)

    def _recompute(self, keys: tuple[str, ...], obs: Observation) -> FloatArray:
        self.histograms.keep_only(keys)
        self.targets.keep_only(keys)
        rows = self.histograms.rows(keys)
        histograms = self.histograms.data[rows]
        cumulative = np.cumsum(histograms, axis=2)
        total = cumulative[:, :, -1:]
        first_over = (cumulative >= self.settings.vpa_percentile * total).argmax(axis=2)
        percentile = self.edges[first_over + 1]
        targets = np.where(obs.uses, percentile * (1.0 + self.settings.vpa_margin), 0.0)
        self.targets.data[self.targets.rows(keys)] = targets
        return targets
