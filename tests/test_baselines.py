"""The baselines, each against its published rule worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import observation

from kuscale.config import PolicyConfig
from kuscale.policy.autothrottle import AutothrottlePolicy
from kuscale.policy.base import Observation
from kuscale.policy.static import StaticPolicy
from kuscale.policy.vpa import VpaPolicy

CONFIG = PolicyConfig()
BOTH = [[True, True]]


def with_throttle(obs: Observation, ratio: float) -> Observation:
    return replace(obs, throttled=np.array([[ratio, 0.0]]), keys=("a",))


def test_static_limits_are_what_the_tokens_buy_split_by_the_configured_share() -> None:
    policy = StaticPolicy(CONFIG)
    both = policy.decide(observation(usage=[[5.0, 5.0]], tokens=[300.0], uses=BOTH))
    assert both.limits[0] == pytest.approx([150.0, 50.0])
    cpu_only = policy.decide(observation(usage=[[5.0, 0.0]], tokens=[120.0]))
    assert cpu_only.limits[0] == pytest.approx([120.0, 0.0])
    rich = policy.decide(observation(usage=[[5.0, 0.0]], tokens=[900.0]))
    assert rich.limits[0, 0] == 200.0


def test_baselines_admit_every_pod_and_are_charged_for_what_they_hold() -> None:
    for policy in (StaticPolicy(CONFIG), VpaPolicy(CONFIG), AutothrottlePolicy(CONFIG)):
        assert policy.admit(1.0, np.array([True, True]), np.zeros(2), np.zeros(2)) is None
        held = observation(usage=[[50.0, 0.0]], tokens=[40.0], limits=[[100.0, 0.0]])
        assert policy.decide(replace(held, queue=np.array([100.0]))).queue[0] == 40.0


def test_vpa_recommends_the_90th_percentile_plus_15_percent_every_minute() -> None:
    policy = VpaPolicy(CONFIG)
    usage = [40.0] * 9 + [80.0]
    for tick, value in enumerate(usage * 6):
        decision = policy.decide(replace(observation([[value, 0.0]], [300.0]), keys=("a",)))
        if tick == 0:
            first = decision.limits[0, 0]
    assert first == pytest.approx(40.0 * 1.15, rel=0.05)
    assert decision.limits[0, 0] == pytest.approx(first)
    recomputed = policy.decide(replace(observation([[80.0, 0.0]], [300.0]), keys=("a",)))
    assert recomputed.limits[0, 0] == pytest.approx(80.0 * 1.15, rel=0.05)


def test_vpa_never_recommends_below_25_millicores() -> None:
    policy = VpaPolicy(replace(CONFIG, cpu=replace(CONFIG.cpu, min=0.1)))
    decision = policy.decide(replace(observation([[0.0, 0.0]], [300.0]), keys=("a",)))
    assert decision.limits[0, 0] == pytest.approx(2.5)


def test_autothrottle_scales_up_by_the_excess_throttle_ratio() -> None:
    policy = AutothrottlePolicy(CONFIG)
    obs = with_throttle(observation([[50.0, 0.0]], [300.0], limits=[[50.0, 0.0]]), 0.5)
    assert policy.decide(obs).limits[0, 0] == pytest.approx(50.0 * (1 + 0.5 - 0.3))


def test_autothrottle_otherwise_follows_the_recent_maximum_plus_a_margin() -> None:
    policy = AutothrottlePolicy(CONFIG)
    for value in (30.0, 70.0, 20.0):
        obs = with_throttle(observation([[value, 0.0]], [300.0], limits=[[90.0, 0.0]]), 0.2)
        decision = policy.decide(obs)
    assert decision.limits[0, 0] == pytest.approx(70.0 * 1.1)
