"""Delayed feedback: a reward that arrives after the rollout, addressed by what the application already holds.

Why this shape (stateless, durable, idempotent):

* The inference worker makes every chat completion ``id`` name the rollout it belongs to
  (:func:`completion_id`), so whoever holds an id (a thumbs-up button, a support ticket)
  can address its rollout without a lookup table that a worker restart would lose.
* A feedback becomes the same ``boltstream.reward`` span that ``emit_reward`` writes
  (final and primary), produced to the ``spans`` topic under that rollout's key, so the
  stream app needs no second input and the log keeps it (replayable).
* Its span id is derived from an idempotency key (given, or a hash of target + name +
  value): the stream app already drops a second copy of a span id, so the same feedback
  sent twice counts once.

Completion id format, version 1 (``bs1``)::

    {chatcmpl|cmpl}-bs1.{base64url(rollout key), unpadded}.{16 hex: the first LLM span's id}

The rollout key is the ``spans`` topic key of the worker's LLM span
(:func:`boltstream.schemas.records.span_key`); ``.`` is not in the base64url alphabet.
An id that does not match is not ours (another server, an older worker): it is refused,
never guessed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import numbers
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from boltstream.schemas import records

COMPLETION_ID_VERSION = "bs1"
_COMPLETION_ID = re.compile(r"^(chatcmpl|cmpl)-bs1\.([A-Za-z0-9_-]+)\.([0-9a-f]{16})$")
_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
# The addresses a feedback may name, in the order they are tried.
TARGETS = ("completion_id", "rollout_id", "session_id", "trace_id")
_PROBE_TRACE = "0" * 32
FEEDBACK_SCOPE = "boltstream.feedback"
MAX_FIELD_CHARS = 1024


class FeedbackError(ValueError):
    """A feedback that cannot be used; ``field`` names the bad input (the HTTP ``param``, the CLI flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def completion_id(prefix: str, key: str, span_id: str) -> str:
    """The completion ``id`` that names rollout ``key`` and the LLM span ``span_id`` (16 hex)."""
    if not re.fullmatch(r"[0-9a-f]{16}", span_id):
        raise ValueError(f"span id must be 16 lower-case hex digits, got {span_id!r}")
    return f"{prefix}-{COMPLETION_ID_VERSION}.{_b64(key.encode('utf-8'))}.{span_id}"


def decode_completion_id(value: str) -> tuple[str, str]:
    """(rollout key, LLM span id) of a completion id this worker's format wrote."""
    m = _COMPLETION_ID.match(value.strip()) if isinstance(value, str) else None
    if m is None:
        raise FeedbackError("completion_id", f"completion id {str(value)[:200]!r} is not one this worker wrote "
                                             f"(expected chatcmpl-{COMPLETION_ID_VERSION}.<key>.<span id>)")
    raw = m.group(2)
    try:
        key = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise FeedbackError("completion_id", f"completion id {value[:200]!r}: its rollout key does not decode") \
            from None
    if not key:
        raise FeedbackError("completion_id", f"completion id {value[:200]!r} names an empty rollout key")
    return key, m.group(3)


def target_key(target: str, value: str) -> str:
    """The ``spans`` topic key of the rollout ``target`` (rollout_id | session_id | trace_id) names.

    Computed by :func:`records.span_key` on a probe span, so the precedence stays in one place;
    a session id is refused should ``span_key`` stop keying rollouts by session.
    """
    if target == "rollout_id":
        return records.span_key({"rollout_id": value, "trace_id": _PROBE_TRACE}).decode("utf-8")
    if target == "trace_id":
        if not _TRACE_ID.match(value.lower()) or value == _PROBE_TRACE:
            raise FeedbackError("trace_id", f"trace id {value[:200]!r} is not 32 hex digits (W3C trace-id)")
        return records.span_key({"rollout_id": None, "trace_id": value.lower()}).decode("utf-8")
    if target == "session_id":
        probe = {"rollout_id": None, "trace_id": _PROBE_TRACE, "attributes": dict.fromkeys(records.SESSION_ATTRIBUTES, value)}
        key = records.span_key(probe).decode("utf-8")
        if key == _PROBE_TRACE:
            raise FeedbackError("session_id", "this version keys rollouts by rollout id or trace id, not by "
                                              "session id; address the feedback by completion id or rollout id")
        return key
    raise FeedbackError("target", f"unknown target {target!r} (one of {', '.join(TARGETS)})")


@dataclass(frozen=True)
class Feedback:
    """One validated feedback: the rollout key it goes to and the reward it carries."""

    key: str
    value: float
    name: str
    idempotency_key: str
    target: str  # "completion_id=chatcmpl-..." for the record and the logs
    parent_span_id: str | None = None  # the LLM span a completion id names

    @property
    def span_id(self) -> str:
        return feedback_span_id(self.idempotency_key)


def feedback_span_id(idempotency_key: str) -> str:
    """The reward span's id: 16 hex of SHA-256 of the idempotency key (same key, same span, counted once)."""
    return hashlib.sha256(b"boltstream.feedback\0" + idempotency_key.encode("utf-8")).hexdigest()[:16]


def _text(body: Mapping[str, Any], field: str) -> str | None:
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise FeedbackError(field, f"{field} must be a non-empty string, got {value!r}"[:300])
    if len(value) > MAX_FIELD_CHARS:
        raise FeedbackError(field, f"{field} is {len(value)} characters; at most {MAX_FIELD_CHARS}")
    return value.strip()


def reward_value(value: Any) -> float:
    """A finite number (not a bool); strings are refused, so ``"1"`` from a form is a client bug, said."""
    if value is None:
        raise FeedbackError("reward", "reward is required")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FeedbackError("reward", f"reward must be a number, got {type(value).__name__} {value!r}"[:300])
    f = float(value)
    if not math.isfinite(f):
        raise FeedbackError("reward", f"reward must be a finite number, got {f}")
    return f


def parse_feedback(body: Mapping[str, Any]) -> Feedback:
    """Validate a feedback (the HTTP body, or the CLI's flags as a dict); exactly one target."""
    if not isinstance(body, Mapping):
        raise FeedbackError("body", "the feedback must be a JSON object")
    given = [(t, v) for t in TARGETS if (v := _text(body, t)) is not None]
    if not given:
        raise FeedbackError("target", f"name the rollout: one of {', '.join(TARGETS)}")
    if len(given) > 1:
        raise FeedbackError(given[1][0], f"name one target, not {' and '.join(t for t, _ in given)}")
    target, address = given[0]
    value = reward_value(body.get("reward"))
    name = _text(body, "name") or "reward"
    parent = None
    if target == "completion_id":
        key, parent = decode_completion_id(address)
    else:
        key = target_key(target, address)
    idempotency = _text(body, "idempotency_key") or f"{target}={address}|{name}|{value!r}"
    return Feedback(key, value, name, idempotency, f"{target}={address}", parent)


def _trace_id_for(key: str) -> str:
    """A trace-keyed rollout's own trace id; otherwise one derived from the key (the same for every feedback)."""
    if _TRACE_ID.match(key) and key != _PROBE_TRACE:
        return key
    return hashlib.sha256(b"boltstream.feedback.trace\0" + key.encode("utf-8")).hexdigest()[:32]


def feedback_span(feedback: Feedback, now_ns: int | None = None) -> dict[str, Any]:
    """The ``Span`` record of a feedback: a final, primary ``boltstream.reward`` under the rollout's key.

    ``rollout_id`` is the key itself, so :func:`records.span_key` files it with the rollout
    whichever field keyed the rollout; ``boltstream.feedback`` tells the stream app it came late.
    """
    now = time.time_ns() if now_ns is None else int(now_ns)
    attributes: dict[str, Any] = {
        records.REWARD_NAME: feedback.name,
        records.REWARD_VALUE: feedback.value,
        records.REWARD_FINAL: True,
        records.REWARD_PRIMARY: True,
        records.ROLLOUT_ID: feedback.key,
        records.FEEDBACK: True,
        records.FEEDBACK_TARGET: feedback.target,
        records.FEEDBACK_IDEMPOTENCY_KEY: feedback.idempotency_key,
    }
    return {
        "trace_id": _trace_id_for(feedback.key),
        "span_id": feedback.span_id,
        "parent_span_id": feedback.parent_span_id,
        "name": records.REWARD_SPAN,
        "kind": "INTERNAL",
        "start_time_ns": now,
        "end_time_ns": now,
        "status": {"code": "OK", "message": None},
        "attributes": attributes,
        "events": [],
        "resource": {"service.name": "boltstream-feedback"},
        "scope": {"name": FEEDBACK_SCOPE, "version": None},
        "rollout_id": feedback.key,
        "attempt_id": None,
        "task_id": None,
        "llm": None,
    }
