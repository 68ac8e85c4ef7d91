"""Allocation rules: pure arithmetic over arrays of pods, selected by name."""

from __future__ import annotations

from collections.abc import Callable

from kuscale.config import PolicyConfig
from kuscale.policy.autothrottle import AutothrottlePolicy
from kuscale.policy.base import Decision, Observation, Policy
from kuscale.policy.default import KuscalePolicy
from kuscale.policy.original import OriginalPolicy
from kuscale.policy.static import StaticPolicy
from kuscale.policy.vpa import VpaPolicy

__all__ = ["Decision", "Observation", "Policy", "make_policy"]


RULES: dict[str, Callable[[PolicyConfig], Policy]] = {
    rule.name: rule
    for rule in (KuscalePolicy, OriginalPolicy, StaticPolicy, VpaPolicy, AutothrottlePolicy)
}


def make_policy(name: str, config: PolicyConfig) -> Policy:
    """Build the rule a configuration names; names are validated in `config`."""
    try:
        rule = RULES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}") from None
    return rule(config)
