"""Which adapter answers a request (pure), and how ``--adapters`` / ``--adapter-agents`` are parsed."""

from __future__ import annotations

import pytest

from boltstream.errors import ConfigError
from boltstream.inference.adapters import (
    HEADER_ADAPTER,
    UnknownAdapter,
    agent_name_from_headers,
    parse_adapters,
    select_adapter,
)

ADAPTERS = parse_adapters(["writer=sql-writer", "checker"], ["checker=^sql_check"])


def _pick(header: str | None = None, model: str | None = None, agent: str | None = None) -> tuple[str, str]:
    return select_adapter(ADAPTERS, header=header, model=model, agent_name=agent)


def test_parse_names_checkpoint_models_and_agent_rules() -> None:
    writer, checker = ADAPTERS
    assert (writer.name, writer.checkpoint_model, writer.agents.pattern) == ("writer", "sql-writer", "^writer$")
    assert (checker.name, checker.checkpoint_model, checker.agents.pattern) == ("checker", "checker", "^sql_check")


def test_header_beats_model_beats_agent_beats_default() -> None:
    assert _pick(header="checker", model="writer", agent="sql_checker") == ("checker", "header")
    assert _pick(header=" writer ", agent="sql_checker") == ("writer", "header")
    assert _pick(model="checker", agent="writer") == ("checker", "model")
    assert _pick(model="tiny", agent="sql_checker_2") == ("checker", "agent")  # re.search of the rule
    assert _pick(model="tiny", agent="writer") == ("writer", "agent")  # default rule: exactly the name
    assert _pick(model="tiny", agent="writer2") == ("writer", "default")  # no rule matches: the first adapter
    assert _pick(model="tiny", agent="checker") == ("writer", "default")  # checker's rule replaced its name
    assert _pick(header="", model="tiny") == ("writer", "default")  # an empty header names nothing


def test_an_unknown_adapter_in_the_header_is_an_error_naming_the_served_ones() -> None:
    with pytest.raises(UnknownAdapter, match=r"X-Boltstream-Adapter: 'planner' is not an adapter .* writer, checker"):
        _pick(header="planner", model="writer")


def test_agent_name_comes_from_baggage() -> None:
    assert agent_name_from_headers({"baggage": "boltstream.rollout_id=r1,boltstream.agent_name=sql_writer"}) \
        == "sql_writer"
    assert agent_name_from_headers({"Baggage": "gen_ai.agent.name=checker"}) == "checker"
    assert agent_name_from_headers({"baggage": "boltstream.agent_name=a,gen_ai.agent.name=b"}) == "a"
    assert agent_name_from_headers({HEADER_ADAPTER: "writer"}) is None


@pytest.mark.parametrize(("specs", "rules", "field", "reason"), [
    (["a.b"], [], "adapters", "adapter names"),
    (["-x"], [], "adapters", "adapter names"),
    (["a", "a=m"], [], "adapters", "named twice"),
    (["a=m", "b=m"], [], "adapters", "same checkpoint model"),
    (["a"], ["b=x"], "adapter_agents", "'b' is not one of --adapters"),
    (["a"], ["a"], "adapter_agents", "ADAPTER=REGEX"),
    (["a"], ["a=("], "adapter_agents", "invalid regex"),
])
def test_bad_adapter_flags_are_refused_naming_the_flag(specs: list[str], rules: list[str], field: str,
                                                        reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as info:
        parse_adapters(specs, rules)
    assert info.value.name == field
