"""Rollout context: ``with boltstream.rollout(...)``, ``@boltstream.rollout_fn``, ``emit_reward``.

Why this shape: the only change an agent may need is one ``with`` or one
decorator, so these must work whatever else the process does (its own
TracerProvider or ``opentelemetry-instrument``'s, sync or async code, threads).

* :func:`rollout` opens the root span ``boltstream.rollout`` in a NEW trace
  (one trace per rollout; the spans topic is keyed by rollout id), puts the ids
  in OTel baggage and in a context variable, and registers the rollout so
  :class:`~boltstream.producers.rollout_processor.RolloutSpanProcessor` can stamp every
  span started inside, even in a thread that lost the context.
* The root span ends with ``boltstream.status`` = ``ok`` | ``failed`` |
  ``timeout`` and, when not ok, ``boltstream.error`` = ``"Type: message"``.
  A failure never becomes a reward of 0: it simply has no final reward.
* Rewards are zero-length ``boltstream.reward`` spans (children of the root)
  with ``boltstream.reward.name`` / ``.value`` / ``.final`` / ``.primary``.
  Intermediate by default; the decorated function's return value (a number,
  or a dict of named numbers, one primary) becomes the final reward(s),
  emitted before the root span ends.

Ids are deterministic: ``attempt_id = f"{task_id}:{attempt}"`` (prefixed
``f"{run_id}/"`` when a run id is given) and ``rollout_id = uuid5(NAMESPACE,
attempt_id)``, so a task re-run after a crash yields the same ids and
downstream dedupe recognises the attempt.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import numbers
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode

from boltstream.schemas import records

from . import headers as wire
from .rollout_processor import (
    current_rollout,
    enter_rollout,
    exit_rollout,
    install_rollout_processor,
    own_rollout,
)

log = logging.getLogger(__name__)

ROLLOUT_NAMESPACE = uuid.UUID("6f1c3a52-8d4e-5b7a-9c2d-0e1f2a3b4c5d")
TRACER_NAME = "boltstream.producers"

F = TypeVar("F", bound=Callable[..., Any])


class RolloutTimeout(Exception):
    """Raised (or passed to :meth:`RolloutContext.mark`) when a rollout ran past its time limit."""


def attempt_ids(task_id: str | None, attempt: int = 0, run_id: str | None = None) -> tuple[str, str]:
    """(attempt_id, rollout_id) for one attempt of one task; random only when there is no task id."""
    base = str(task_id) if task_id is not None else uuid.uuid4().hex
    attempt_id = f"{base}:{attempt}" if not run_id else f"{run_id}/{base}:{attempt}"
    return attempt_id, str(uuid.uuid5(ROLLOUT_NAMESPACE, attempt_id))


@dataclass
class RolloutContext:
    """What an agent function (and the runner) knows about the rollout it runs in."""

    rollout_id: str
    attempt_id: str
    task_id: str | None
    attempt: int = 0
    task: Mapping[str, Any] | None = None
    base_url: str | None = None
    status: str = "ok"
    error: str | None = None
    rewards: list[tuple[str, float, bool, bool]] = field(default_factory=list)
    span: Any = field(default=None, repr=False)
    tracer: Any = field(default=None, repr=False)
    final_emitted: bool = False
    # False for evaluation: the inference worker serves the calls but writes no spans,
    # so held-out tasks never reach the stream app (or the learner).
    capture: bool = True

    @property
    def ids(self) -> dict[str, str]:
        """The id attributes every span of this rollout carries (cached: read on every span start)."""
        cached = self.__dict__.get("_ids")
        if cached is None or cached[0] != (self.rollout_id, self.attempt_id, self.task_id):
            out = {records.ROLLOUT_ID: self.rollout_id, records.ATTEMPT_ID: self.attempt_id}
            if self.task_id is not None:
                out[records.TASK_ID] = self.task_id
            cached = self.__dict__["_ids"] = ((self.rollout_id, self.attempt_id, self.task_id), out)
        return dict(cached[1])

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers for calls to the inference worker (OpenAI ``default_headers``)."""
        return wire.headers_for(self)

    @property
    def openai_base_url(self) -> str | None:
        """``base_url`` with the ids in the path, for agents that cannot set headers."""
        return wire.base_url_for(self.base_url, self) if self.base_url else None

    def mark(self, status: str, error: BaseException | str | None = None) -> None:
        """Record the outcome (``ok`` | ``failed`` | ``timeout``) before the root span ends."""
        if status not in ("ok", "failed", "timeout"):
            raise ValueError(f"status must be ok, failed or timeout, not {status!r}")
        self.status = status
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {error}"
        self.error = error

    def set_result(self, result: Any, primary: str | None = None) -> None:
        """Turn an agent's return value into final reward span(s), once."""
        if self.final_emitted:
            return
        rewards = final_rewards(result, primary)
        if rewards is None:
            if result is not None:
                log.warning("rollout %s: return value %r is not a reward (number or dict of numbers); "
                            "no final reward recorded", self.attempt_id, type(result).__name__)
            return
        self.final_emitted = True
        for name, value, is_primary in rewards:
            _reward_span(self, name, value, final=True, primary=is_primary)


def _check_value(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward {name!r} must be a number, not {type(value).__name__}")
    f = float(value)
    if not math.isfinite(f):
        raise ValueError(f"reward {name!r} must be finite, not {f}")
    return f


def final_rewards(result: Any, primary: str | None = None) -> list[tuple[str, float, bool]] | None:
    """[(name, value, primary)] for a return value; None when it is not a reward."""
    if isinstance(result, bool) or result is None:
        return None
    if isinstance(result, numbers.Real):
        return [("reward", _check_value("reward", result), True)] if math.isfinite(float(result)) else None
    if isinstance(result, Mapping) and result and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in result.values()):
        names = [str(k) for k in result]
        chosen = primary if primary in names else ("reward" if "reward" in names else names[0])
        return [(n, _check_value(n, v), n == chosen) for n, v in zip(names, result.values(), strict=True)]
    return None


def _reward_span(ctx: RolloutContext | None, name: str, value: float, *, final: bool, primary: bool,
                 attributes: Mapping[str, Any] | None = None) -> None:
    tracer = ctx.tracer if ctx is not None and ctx.tracer is not None else trace.get_tracer(TRACER_NAME)
    attrs: dict[str, Any] = dict(attributes or {})
    attrs.update({records.REWARD_NAME: name, records.REWARD_VALUE: value,
                  records.REWARD_FINAL: final, records.REWARD_PRIMARY: primary})
    parent = None
    if ctx is not None:
        attrs.update(ctx.ids)
        ctx.rewards.append((name, value, final, primary))
        current = trace.get_current_span()
        if ctx.span is not None and current.get_span_context().trace_id != ctx.span.get_span_context().trace_id:
            parent = trace.set_span_in_context(ctx.span)  # e.g. a thread that lost the context
    tracer.start_span(records.REWARD_SPAN, context=parent, attributes=attrs).end()


def emit_reward(value: float | Mapping[str, float], name: str = "reward", *, primary: bool | str | None = None,
                final: bool = False, attributes: Mapping[str, Any] | None = None) -> None:
    """Record reward span(s) in the current rollout.

    ``value`` is a number (then ``primary`` is a bool, default True) or a dict of
    named numbers, a multi-dimensional reward (then ``primary`` names the main
    dimension; default ``"reward"`` if present, else the first key). Rewards are
    intermediate unless ``final=True``. Raises TypeError/ValueError for a value
    that is not a finite number (bools included).
    """
    ctx = current_rollout()
    if ctx is None:
        log.warning("emit_reward(%s) outside a rollout: the reward span carries no rollout id", name)
    if isinstance(value, Mapping):
        chosen = primary if isinstance(primary, str) else None
        rewards = final_rewards(value, chosen)
        if rewards is None:
            raise TypeError("a multi-dimensional reward must be a non-empty dict of numbers")
    else:
        rewards = [(name, _check_value(name, value), True if primary is None else bool(primary))]
    for n, v, is_primary in rewards:
        _reward_span(ctx, n, v, final=final, primary=is_primary, attributes=attributes)
    if final and ctx is not None:
        ctx.final_emitted = True


@contextlib.contextmanager
def rollout(
    task_id: str | None = None,
    attempt: int = 0,
    rollout_id: str | None = None,
    *,
    attempt_id: str | None = None,
    run_id: str | None = None,
    task: Mapping[str, Any] | None = None,
    base_url: str | None = None,
    attributes: Mapping[str, Any] | None = None,
    tracer_provider: Any = None,
    agent_name: str | None = None,
) -> Iterator[RolloutContext]:
    """Run the body as one rollout attempt; yields its :class:`RolloutContext`.

    ``agent_name`` becomes ``boltstream.agent_name`` on the root span; spans below
    that name no agent of their own inherit it (what ``agent_match`` selects on).

    An exception marks the rollout ``failed`` (``timeout`` for
    :class:`RolloutTimeout`) and propagates.
    """
    install_rollout_processor()
    default_attempt, default_rollout = attempt_ids(task_id, attempt, run_id)
    attempt_id = attempt_id or default_attempt
    rollout_id = rollout_id or (default_rollout if attempt_id == default_attempt
                                else str(uuid.uuid5(ROLLOUT_NAMESPACE, attempt_id)))
    provider = tracer_provider or trace.get_tracer_provider()
    tracer = provider.get_tracer(TRACER_NAME)
    ctx = RolloutContext(rollout_id=rollout_id, attempt_id=attempt_id,
                         task_id=str(task_id) if task_id is not None else None, attempt=attempt,
                         task=task, base_url=base_url, tracer=tracer)
    attrs: dict[str, Any] = dict(attributes or {})
    attrs.update(ctx.ids)
    attrs[records.ATTEMPT] = attempt
    if agent_name:
        attrs[records.AGENT_NAME] = agent_name
    span = tracer.start_span(records.ROLLOUT_SPAN, context=otel_context.Context(), attributes=attrs)
    ctx.span = span
    octx = trace.set_span_in_context(span, otel_context.get_current())
    for k, v in ctx.ids.items():
        octx = baggage.set_baggage(k, v, octx)
    token = otel_context.attach(octx)
    trace_id = span.get_span_context().trace_id
    var_token = enter_rollout(ctx, trace_id)
    try:
        yield ctx
    except RolloutTimeout as exc:
        ctx.mark("timeout", str(exc) or "rollout timed out")
        raise
    except BaseException as exc:
        ctx.mark("failed", exc)
        span.record_exception(exc)
        raise
    finally:
        try:
            span.set_attribute(records.STATUS, ctx.status)
            if ctx.error:
                span.set_attribute(records.ERROR, ctx.error)
            span.set_status(Status(StatusCode.OK) if ctx.status == "ok" else Status(StatusCode.ERROR, ctx.error))
            span.end()
        finally:
            exit_rollout(trace_id, var_token)
            otel_context.detach(token)


def _task_id_from_args(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    task = kwargs.get("task", args[0] if args else None)
    if isinstance(task, Mapping):
        for key in ("task_id", "id"):
            if task.get(key) is not None:
                return str(task[key])
    return None


def rollout_fn(fn: F | None = None, *, task_id: str | None = None, attempt: int = 0,
               primary: str | None = None, agent_name: str | None = None) -> Any:
    """Decorator (sync or async): run the function as a rollout; its return value is the final reward.

    Inside a rollout already opened (by ``boltstream runner`` or an outer
    ``with rollout()``) it opens no new one and reports into that one. Otherwise
    the task id is ``task_id``, else the first argument's ``task_id``/``id`` key, and the
    agent name ``agent_name``, else the function's name.
    """

    def decorate(func: F) -> F:
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                outer = own_rollout()
                if outer is not None:
                    result = await func(*args, **kwargs)
                    outer.set_result(result, primary)
                    return result
                with rollout(task_id or _task_id_from_args(args, kwargs), attempt,
                             agent_name=agent_name or func.__name__) as ctx:
                    result = await func(*args, **kwargs)
                    ctx.set_result(result, primary)
                    return result

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outer = own_rollout()
            if outer is not None:
                result = func(*args, **kwargs)
                outer.set_result(result, primary)
                return result
            with rollout(task_id or _task_id_from_args(args, kwargs), attempt,
                         agent_name=agent_name or func.__name__) as ctx:
                result = func(*args, **kwargs)
                ctx.set_result(result, primary)
                return result

        return wrapper  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate


def rollout_headers(ctx: RolloutContext | None = None) -> dict[str, str]:
    """Headers for the current rollout (or ``ctx``); {} outside any rollout."""
    ctx = ctx or current_rollout()
    return wire.headers_for(ctx) if ctx is not None else {}


def rollout_base_url(base_url: str, ctx: RolloutContext | None = None) -> str:
    """The base URL with the current rollout's (or ``ctx``'s) ids in the path; unchanged outside one."""
    ctx = ctx or current_rollout()
    return wire.base_url_for(base_url, ctx) if ctx is not None else base_url
