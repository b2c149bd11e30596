"""Agent-side boltstream: the OTel exporter, rollout context and rewards, runners, OTLP ingest.

Light on purpose (no torch, no faust): this is what an agent process imports.
Names are resolved lazily so ``import boltstream.producers`` costs nothing until used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "rollout": "context",
    "rollout_fn": "context",
    "emit_reward": "context",
    "current_rollout": "context",
    "attempt_ids": "context",
    "RolloutContext": "context",
    "RolloutTimeout": "context",
    "rollout_headers": "context",
    "rollout_base_url": "context",
    "parse_rollout_path": "headers",
    "ids_from_headers": "headers",
    "setup_tracing": "tracing",
    "install_rollout_processor": "rollout_processor",
    "RolloutSpanProcessor": "rollout_processor",
    "KafkaSpanExporter": "exporter",
    "ExporterConfig": "exporter",
    "ExporterMetrics": "exporter",
    "normalise_span": "normalise",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
