"""One learner per role: which samples of the shared ``batches`` topic a ``learn --role`` process trains.

A multi-agent system calls one base model from several roles, each with its own LoRA
adapter (docs/multi-agent.md). Each trained role gets a learner process of its own, all
reading the same ``batches`` topic: exact resume, staleness and checkpoints then stay
per adapter with the learner unchanged inside, at the cost of one base-model copy per
process. A role learner trains the samples whose ``agent_name`` (resolved by the stream
app from the span tree) its regex matches; the other roles' samples are another
learner's work, so they are skipped (counted as ``other_role``), never dead-lettered.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from boltstream.errors import ConfigError
from boltstream.inference.adapters import ADAPTER_NAME

OTHER_ROLE = "other_role"  # the drop reason of a sample some other role's learner trains


@dataclass(frozen=True)
class Role:
    """A role's name (its adapter and checkpoint model name) and the agent names it trains."""

    name: str
    agents: re.Pattern[str]

    def trains(self, sample: Mapping[str, Any]) -> bool:
        """True for a sample of this role. A sample without an agent name is matched as ``""``."""
        return self.agents.search(sample.get("agent_name") or "") is not None


def parse_role(spec: str) -> Role:
    """``NAME[=REGEX]`` -> Role; REGEX defaults to exactly NAME. Mistakes raise ConfigError("role", ...)."""
    name, sep, regex = (s.strip() for s in spec.partition("="))
    if not ADAPTER_NAME.match(name):
        raise ConfigError("role", spec, "expected NAME[=REGEX] with NAME 1-64 of A-Z a-z 0-9 _ - "
                                        "(not starting with _ -), as the worker's --adapters")
    if sep and not regex:
        raise ConfigError("role", spec, "the regex after '=' is empty (leave out '=' to match exactly NAME)")
    try:
        agents = re.compile(regex if sep else f"^{re.escape(name)}$")
    except re.error as exc:
        raise ConfigError("role", spec, f"invalid regex: {exc}") from None
    return Role(name, agents)
