"""Several named LoRA adapters on one base model: their configuration and which one answers a request.

Why one worker serves several: in a multi-agent system each role (a SQL writer,
a checker) gets its own adapter on ONE shared base model, so the base weights
are in memory once and each role's policy is reloaded independently.

A request picks its adapter, first match wins:

1. the ``X-Boltstream-Adapter`` header (an explicit per-client choice; an
   unknown name is an error, never a silent fallback);
2. the OpenAI ``model`` field naming an adapter (what an agent framework can
   always set, e.g. ``ChatOpenAI(model="writer")``);
3. the agent name in the request's W3C ``baggage`` (``boltstream.agent_name``,
   else ``gen_ai.agent.name``), matched against each adapter's agent regex
   (``re.search``, as the stream app's ``agent_match``; default: exactly the
   adapter's name);
4. the default adapter (the first one configured).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import baggage
from opentelemetry.baggage.propagation import W3CBaggagePropagator

from boltstream.errors import ConfigError
from boltstream.schemas.records import AGENT_NAME

HEADER_ADAPTER = "X-Boltstream-Adapter"
AGENT_NAME_KEYS = (AGENT_NAME, "gen_ai.agent.name")  # baggage entries naming the calling agent
# Adapter (and learner role) names: also a valid torch module key (no dots).
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_BAGGAGE = W3CBaggagePropagator()


@dataclass(frozen=True)
class AdapterSpec:
    """One served adapter: its name, the checkpoint model name it follows, the agent names it answers."""

    name: str
    checkpoint_model: str
    agents: re.Pattern[str]


class UnknownAdapter(ValueError):
    """A request named an adapter this worker does not serve."""


def parse_adapters(specs: Sequence[str], agent_rules: Sequence[str] = ()) -> tuple[AdapterSpec, ...]:
    """``NAME[=CHECKPOINT_MODEL]`` items and ``NAME=REGEX`` agent rules -> specs (``--adapters``,
    ``--adapter-agents``); every mistake is a ConfigError naming the flag and the item."""
    out: dict[str, tuple[str, str]] = {}
    for item in specs:
        name, _, model = (s.strip() for s in item.partition("="))
        if not ADAPTER_NAME.match(name):
            raise ConfigError("adapters", item, "adapter names are 1-64 of A-Z a-z 0-9 _ - (not starting with _ -)")
        if name in out:
            raise ConfigError("adapters", item, f"adapter {name!r} is named twice")
        out[name] = (model or name, f"^{re.escape(name)}$")
    for rule in agent_rules:
        name, sep, regex = (s.strip() for s in rule.partition("="))
        if not sep or not regex:
            raise ConfigError("adapter_agents", rule, "expected ADAPTER=REGEX")
        if name not in out:
            raise ConfigError("adapter_agents", rule, f"{name!r} is not one of --adapters "
                                                      f"({', '.join(out) or 'none given'})")
        try:
            re.compile(regex)
        except re.error as exc:
            raise ConfigError("adapter_agents", rule, f"invalid regex: {exc}") from None
        out[name] = (out[name][0], regex)
    models = [m for m, _ in out.values()]
    if len(set(models)) != len(models):
        raise ConfigError("adapters", ",".join(specs), "two adapters follow the same checkpoint model name")
    return tuple(AdapterSpec(n, m, re.compile(r)) for n, (m, r) in out.items())


def agent_name_from_headers(headers: Mapping[str, str]) -> str | None:
    """The calling agent's name from the request's W3C ``baggage``, or None."""
    bag = _BAGGAGE.extract({k.lower(): v for k, v in dict(headers).items()})
    for key in AGENT_NAME_KEYS:
        value = baggage.get_baggage(key, bag)
        if value:
            return str(value)
    return None


def select_adapter(adapters: Sequence[AdapterSpec], *, header: str | None, model: str | None,
                   agent_name: str | None) -> tuple[str, str]:
    """(adapter name, which rule chose it: header | model | agent | default); see the module docstring.

    Raises UnknownAdapter for a header naming no served adapter.
    """
    if not adapters:
        raise ValueError("select_adapter needs at least one adapter")
    names = [a.name for a in adapters]
    if header is not None and header.strip():
        name = header.strip()
        if name not in names:
            raise UnknownAdapter(f"{HEADER_ADAPTER}: {name!r} is not an adapter of this worker; it serves "
                                 f"{', '.join(names)}")
        return name, "header"
    if model in names:
        return str(model), "model"
    if agent_name:
        for a in adapters:
            if a.agents.search(agent_name):
                return a.name, "agent"
    return names[0], "default"
