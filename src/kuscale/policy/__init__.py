"""Allocation rules: pure arithmetic over arrays of pods, selected by name."""

from __future__ import annotations

from kuscale.config import PolicyConfig
from kuscale.policy.base import Decision, Observation, Policy
from kuscale.policy.default import KuscalePolicy
from kuscale.policy.original import OriginalPolicy

__all__ = ["Decision", "Observation", "Policy", "make_policy"]


def make_policy(name: str, config: PolicyConfig) -> Policy:
    """Build the rule a configuration names; names are validated in `config`."""
    if name == KuscalePolicy.name:
        return KuscalePolicy(config)
    if name == OriginalPolicy.name:
        return OriginalPolicy(config)
    raise ValueError(f"unknown policy {name!r}")
