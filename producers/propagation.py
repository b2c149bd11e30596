"""Put the rollout ids in the W3C ``baggage`` header of every outgoing request the app's OTel propagates.

Why: the inference worker writes the LLM span (with token ids) and reads the
rollout it belongs to from the request's ``traceparent`` and ``baggage``
(:func:`~boltstream.producers.headers.ids_from_headers`). OTel's HTTP client
instrumentations (``opentelemetry-instrumentation-httpx`` under the openai
SDK and LangChain's OpenAI client, ``-requests``, ``-aiohttp-client``...)
inject whatever the global propagator gives them. Ids that live only in the
exporter's defaults (``BOLTSTREAM_ROLLOUT_ID`` / ``_ATTEMPT_ID`` / ``_TASK_ID``)
or in the rollout registry (a thread that lost its context) are not in the
context's baggage, so nothing carried them and the worker's spans had no
rollout. :class:`RolloutBaggagePropagator` adds them, by the same precedence
as :class:`~boltstream.producers.rollout_processor.RolloutSpanProcessor`:
baggage already in the context > the current rollout > the env defaults; with
none of them, the session the context is in (``headers.session_of``: baggage or
OpenInference's ``using_session``), so the worker's span is keyed like the agent's.

:func:`install_rollout_propagator` wraps the global propagator once; the
exporter calls it, so ``opentelemetry-instrument`` setups get it without code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry import baggage, propagate
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import (
    CarrierT,
    DefaultGetter,
    DefaultSetter,
    Getter,
    Setter,
    TextMapPropagator,
)

from boltstream.schemas.records import ID_ATTRIBUTES, ROLLOUT_ID

from .headers import session_of
from .otel_internals import propagator_members
from .rollout_processor import current_rollout

log = logging.getLogger(__name__)
_BAGGAGE = W3CBaggagePropagator()
_INSTALL_LOCK = threading.Lock()


class RolloutBaggagePropagator(TextMapPropagator):
    """Injects the rollout ids as W3C baggage (merged with the context's own baggage); extracts nothing."""

    def __init__(self, defaults: Mapping[str, str] | None = None) -> None:
        self.defaults = {k: v for k, v in (defaults or {}).items() if k in ID_ATTRIBUTES and v}

    def ids(self, context: Context | None = None) -> dict[str, str]:
        """The ids for a request made in ``context``: its baggage, else the current rollout, else the defaults."""
        bag = baggage.get_all(context)
        if bag.get(ROLLOUT_ID):
            return {}  # the context says it all (and its baggage is injected below as is)
        owner = current_rollout()
        if owner is not None:
            return owner.ids
        if self.defaults:
            return dict(self.defaults)
        session = session_of(context)  # no rollout: the session keys the worker's span (records.rollout_key)
        return dict([session]) if session else {}

    def inject(self, carrier: CarrierT, context: Context | None = None,
               setter: Setter[CarrierT] = DefaultSetter()) -> None:  # noqa: B008 (OTel's own signature)
        try:
            ctx = context if context is not None else otel_context.get_current()
            for key, value in self.ids(ctx).items():
                ctx = baggage.set_baggage(key, value, ctx)
            _BAGGAGE.inject(carrier, context=ctx, setter=setter)  # the whole baggage: a superset of W3C's own
        except Exception:  # a propagator must never break the app's request
            log.debug("RolloutBaggagePropagator.inject failed", exc_info=True)

    def extract(self, carrier: CarrierT, context: Context | None = None,
                getter: Getter[CarrierT] = DefaultGetter()) -> Context:  # noqa: B008
        return context if context is not None else otel_context.get_current()

    @property
    def fields(self) -> set[str]:
        return _BAGGAGE.fields


def install_rollout_propagator(defaults: Mapping[str, str] | None = None) -> RolloutBaggagePropagator:
    """Append a :class:`RolloutBaggagePropagator` to the global propagator once; returns the one in place."""
    with _INSTALL_LOCK:
        current: Any = propagate.get_global_textmap()
        for p in propagator_members(current):
            if isinstance(p, RolloutBaggagePropagator):
                if defaults:  # the latest exporter's env ids; none given keeps the ones in place
                    p.defaults = RolloutBaggagePropagator(defaults).defaults
                return p
        ours = RolloutBaggagePropagator(defaults)
        propagate.set_global_textmap(CompositePropagator([current, ours]))
        return ours
