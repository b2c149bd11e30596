"""boltstream: reinforcement learning for the LLM inside any agent, from its own traces.

The names an agent author uses (``rollout``, ``rollout_fn``, ``emit_reward`` and
the header helpers) are imported lazily so ``import boltstream`` stays cheap in
an agent process and never pulls the learner's or the stream app's
dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "rollout": "boltstream.producers.context",
    "rollout_fn": "boltstream.producers.context",
    "emit_reward": "boltstream.producers.context",
    "current_rollout": "boltstream.producers.context",
    "rollout_headers": "boltstream.producers.context",
    "rollout_base_url": "boltstream.producers.context",
    "setup_tracing": "boltstream.producers.tracing",
    "KafkaSpanExporter": "boltstream.producers.exporter",
    "Settings": "boltstream.config",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'boltstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
