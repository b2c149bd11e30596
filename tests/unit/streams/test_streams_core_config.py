"""boltstream.streams.core_config: defaults and validation naming the field."""

from __future__ import annotations

import pytest

from boltstream.streams import DEFAULT_AIR_RULES, AirRule, AssemblyConfig, CreditConfig


def test_defaults() -> None:
    credit = CreditConfig()
    assert (credit.gamma, credit.eps, credit.std_normalize, credit.std_unbiased) == (1.0, 1e-6, False, True)
    assert (credit.loss_weight, credit.trajectory_mode, credit.failure_reward) == ("none", False, 0.0)
    assembly = AssemblyConfig()
    assert (assembly.agent_match, assembly.air_rules, assembly.require_logprobs) == (None, DEFAULT_AIR_RULES, True)


def test_configs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        CreditConfig().gamma = 0.5  # type: ignore[misc]


def test_air_rules_list_becomes_tuple() -> None:
    rule = AirRule(name="e", when="span_error", value=-1.0)
    assert AssemblyConfig(air_rules=[rule]).air_rules == (rule,)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"gamma": 1.5}, "gamma"),
        ({"gamma": -0.1}, "gamma"),
        ({"gamma": float("nan")}, "gamma"),
        ({"gamma": "1"}, "gamma"),
        ({"eps": -1e-3}, "eps"),
        ({"loss_weight": "per_token"}, "loss_weight"),
        ({"failure_reward": float("inf")}, "failure_reward"),
        ({"std_normalize": "yes"}, "std_normalize"),
        ({"trajectory_mode": 1}, "trajectory_mode"),
    ],
)
def test_credit_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}="):
        CreditConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"agent_match": "("}, "agent_match"),
        ({"agent_match": 3}, "agent_match"),
        ({"air_rules": ("tool_error",)}, "air_rules"),
        (
            {"air_rules": (AirRule(name="x", when="span", value=1), AirRule(name="x", when="span", value=2))},
            "air_rules",
        ),
    ],
)
def test_assembly_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        AssemblyConfig(**kwargs)
