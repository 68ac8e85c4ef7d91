"""Pod names: what Kubernetes accepts is accepted, and nothing accepted can leave a directory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kuscale.model import InvalidSpec, PodSpec, validate_pod_name


@pytest.mark.parametrize("name", ["web-0", "web-0.cache", "a.b.c", "x", "a" * 63 + ".b", "a" * 253])
def test_kubernetes_pod_names_are_accepted(name: str) -> None:
    assert PodSpec(name=name, tokens=10, cgroup=f"kuscale/{name}").name == name


@pytest.mark.parametrize(
    "name", ["", ".", "..", "a..b", ".a", "a.", "-a", "a-", "A", "a/b", "a_b", "a" * 254, "a\n"]
)
def test_other_names_are_refused_with_the_rule(name: str) -> None:
    with pytest.raises(InvalidSpec, match="DNS-1123 subdomain"):
        validate_pod_name(name)


@given(st.text(alphabet="ab.-/_\n", max_size=12))
def test_an_accepted_name_is_one_safe_path_component(name: str) -> None:
    try:
        validate_pod_name(name)
    except InvalidSpec:
        return
    assert "/" not in name and name not in (".", "..") and ".." not in name
