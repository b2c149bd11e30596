"""Which rollout a span belongs to: the registry of running rollouts, and the processor that reads it.

Why a processor and not only baggage: baggage is context, and context does
not follow every span into Kafka. The processor copies the ids into the
attributes of every span at start, where the exporter (and every other
exporter the app uses) sees them. Lookup order per span:

1. baggage in the parent context (same thread, asyncio tasks, and a remote
   caller that propagated W3C ``baggage``);
2. the active rollout owning the span's trace (a span whose thread lost the
   baggage but kept the trace, e.g. a remote parent without baggage);
3. the only rollout active in the process (a plain ``threading.Thread`` or
   executor started inside the rollout, which copies no context). With
   several concurrent rollouts and no context, nothing is guessed.

``install_rollout_processor`` is idempotent and is called by ``rollout()``
and by the exporter, so ``opentelemetry-instrument`` setups get it without code.
The registry lives here, below :mod:`.context`, so the rollout API can install the
processor and register its rollouts, and the processor can read the registry, without this
module importing the rollout API: a registered rollout is anything with the ids
(:class:`~boltstream.producers.headers.RolloutIds`).
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any

from opentelemetry import baggage, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from boltstream.schemas import records

from .headers import RolloutIds, session_of
from .otel_internals import set_start_attributes, start_attributes

log = logging.getLogger(__name__)
_MARK = "_boltstream_rollout_processor"
_INSTALL_LOCK = threading.Lock()

_CURRENT: contextvars.ContextVar[RolloutIds | None] = contextvars.ContextVar("boltstream_rollout", default=None)
_ACTIVE: dict[int, RolloutIds] = {}  # trace_id -> rollout, for spans whose context was lost
_ACTIVE_LOCK = threading.Lock()


def enter_rollout(ctx: RolloutIds, trace_id: int) -> contextvars.Token[RolloutIds | None]:
    """Register a rollout that starts running here with root trace ``trace_id``; returns what
    :func:`exit_rollout` needs."""
    token = _CURRENT.set(ctx)
    with _ACTIVE_LOCK:
        _ACTIVE[trace_id] = ctx
    return token


def exit_rollout(trace_id: int, token: contextvars.Token[RolloutIds | None]) -> None:
    """The rollout :func:`enter_rollout` registered has ended."""
    with _ACTIVE_LOCK:
        _ACTIVE.pop(trace_id, None)
    _CURRENT.reset(token)


def own_rollout() -> RolloutIds | None:
    """The rollout this context runs in, and only that (no process-wide guess): None outside one."""
    return _CURRENT.get()


def active_rollouts() -> list[RolloutIds]:
    with _ACTIVE_LOCK:
        return list(_ACTIVE.values())


def rollout_for_trace(trace_id: int) -> RolloutIds | None:
    return _ACTIVE.get(trace_id)


def current_rollout() -> RolloutIds | None:
    """The rollout this code runs in: the context variable, else the only rollout active in the process."""
    ctx = _CURRENT.get()
    if ctx is not None:
        return ctx
    with _ACTIVE_LOCK:
        return next(iter(_ACTIVE.values())) if len(_ACTIVE) == 1 else None


class RolloutSpanProcessor(SpanProcessor):
    """Copies ``boltstream.rollout_id`` / ``attempt_id`` / ``task_id`` onto every span at start."""

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        try:
            attrs = start_attributes(span)
            if records.ROLLOUT_ID in attrs:
                return  # set explicitly by whoever started the span: theirs wins
            ids: dict[str, str] | None = None
            if parent_context is None:  # the current context: our context variable says it all, cheaply
                owner = _CURRENT.get()
                ids = owner.ids if owner is not None else None
            if ids is None:
                bag = baggage.get_all(parent_context)
                if records.ROLLOUT_ID in bag:
                    ids = {k: str(bag[k]) for k in records.ID_ATTRIBUTES if bag.get(k) is not None}
                else:
                    owner = rollout_for_trace(span.get_span_context().trace_id)
                    if owner is None:
                        active = active_rollouts()
                        owner = active[0] if len(active) == 1 else None
                    ids = owner.ids if owner is not None else None
            if not ids:
                ids = self._session(attrs, parent_context)
            if ids:
                set_start_attributes(span, ids)
        except Exception:  # a processor must never break the app's span
            log.debug("RolloutSpanProcessor.on_start failed", exc_info=True)

    @staticmethod
    def _session(attrs: Any, parent_context: Context | None) -> dict[str, str] | None:
        """No rollout: the session the span runs in (records.rollout_key keys it by that)."""
        if any(name in attrs for name in records.SESSION_ATTRIBUTES):
            return None
        session = session_of(parent_context)
        return dict([session]) if session else None

    def on_end(self, span: Any) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def install_rollout_processor(provider: Any = None) -> bool:
    """Add :class:`RolloutSpanProcessor` to ``provider`` (default: the global one) once.

    Returns False when the provider is not an SDK ``TracerProvider`` (no SDK
    configured yet: nothing to install into).
    """
    provider = provider if provider is not None else trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return False
    if getattr(provider, _MARK, False):
        return True
    with _INSTALL_LOCK:
        if not getattr(provider, _MARK, False):
            provider.add_span_processor(RolloutSpanProcessor())
            setattr(provider, _MARK, True)
    return True
