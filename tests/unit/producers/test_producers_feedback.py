"""Delayed feedback, pure parts: completion id format, deterministic span ids, validation, the CLI's bad input."""

from __future__ import annotations

import hashlib

import pytest

from boltstream.producers import feedback_cli
from boltstream.producers.feedback import (
    FeedbackError,
    completion_id,
    decode_completion_id,
    feedback_span,
    feedback_span_id,
    parse_feedback,
)
from boltstream.schemas import Codec, records
from boltstream.streams.spans import reward_of

SPAN = "0123456789abcdef"


@pytest.mark.parametrize("key", ["ro-1", "a/b:c d", "ünïcødé-🙂", "x" * 500, "=", "-_.", "ab" * 16])
def test_completion_id_round_trips_any_key(key: str) -> None:
    cid = completion_id("chatcmpl", key, SPAN)
    assert cid.startswith("chatcmpl-bs1.") and cid.endswith("." + SPAN)
    assert "=" not in cid and "/" not in cid and " " not in cid
    assert decode_completion_id(cid) == (key, SPAN)
    assert decode_completion_id(completion_id("cmpl", key, SPAN)) == (key, SPAN)


def test_completion_id_format_is_the_documented_one() -> None:
    # base64url("ro-1") = "cm8tMQ" (unpadded), by hand
    assert completion_id("chatcmpl", "ro-1", SPAN) == "chatcmpl-bs1.cm8tMQ.0123456789abcdef"


@pytest.mark.parametrize("bad", [
    "chatcmpl-0123456789abcdef0123",          # a plain OpenAI-style id (another server, an older worker)
    "chatcmpl-bs2.cm8tMQ.0123456789abcdef",   # an unknown version
    "chatcmpl-bs1.cm8tMQ.0123456789ABCDEF",   # span id not lower-case hex
    "chatcmpl-bs1.cm8tMQ.0123",               # span id too short
    "chatcmpl-bs1..0123456789abcdef",         # no key
    "chatcmpl-bs1.cm8tM.0123456789abcdef",    # 5 base64 chars: not a whole byte
    "chatcmpl-bs1._w.0123456789abcdef",       # decodes to 0xff: not UTF-8
    "",
])
def test_completion_ids_not_ours_are_refused_naming_the_field(bad: str) -> None:
    with pytest.raises(FeedbackError) as err:
        decode_completion_id(bad)
    assert err.value.field == "completion_id"


def test_span_id_is_deterministic_from_the_idempotency_key() -> None:
    expected = hashlib.sha256(b"boltstream.feedback\0k-1").hexdigest()[:16]
    assert feedback_span_id("k-1") == expected
    assert feedback_span_id("k-2") != expected
    a = parse_feedback({"rollout_id": "ro-1", "reward": 1})
    b = parse_feedback({"rollout_id": "ro-1", "reward": 1.0})
    assert a.span_id == b.span_id  # same target, name and value: the same feedback
    assert parse_feedback({"rollout_id": "ro-1", "reward": 0.5}).span_id != a.span_id
    assert parse_feedback({"rollout_id": "ro-1", "reward": 1, "name": "thumbs"}).span_id != a.span_id
    assert parse_feedback({"rollout_id": "ro-1", "reward": 0, "idempotency_key": "k-1"}).span_id == expected


def test_feedback_by_completion_id_is_a_final_primary_reward_under_the_rollout_key() -> None:
    fb = parse_feedback({"completion_id": completion_id("chatcmpl", "ro-9", SPAN), "reward": 1, "name": "thumb"})
    span = feedback_span(fb, now_ns=1_000)
    assert records.span_key(span) == b"ro-9"
    assert span["parent_span_id"] == SPAN and span["start_time_ns"] == span["end_time_ns"] == 1_000
    assert span["attributes"][records.FEEDBACK] is True
    info = reward_of(span)
    assert info is not None and (info.name, info.value, info.final, info.primary) == ("thumb", 1.0, True, True)
    codec = Codec()
    assert codec.decode(codec.encode("Span", span), expect="Span")["span_id"] == fb.span_id  # a valid record


def test_feedback_by_trace_id_keeps_the_trace_and_its_key() -> None:
    fb = parse_feedback({"trace_id": "AB" * 16, "reward": -1})
    span = feedback_span(fb)
    assert span["trace_id"] == "ab" * 16 and records.span_key(span) == ("ab" * 16).encode()


@pytest.mark.parametrize(("body", "field"), [
    ({"reward": 1}, "target"),
    ({"rollout_id": "r", "trace_id": "ab" * 16, "reward": 1}, "trace_id"),
    ({"rollout_id": "r"}, "reward"),
    ({"rollout_id": "r", "reward": float("nan")}, "reward"),
    ({"rollout_id": "r", "reward": float("inf")}, "reward"),
    ({"rollout_id": "r", "reward": "1"}, "reward"),
    ({"rollout_id": "r", "reward": True}, "reward"),
    ({"rollout_id": "", "reward": 1}, "rollout_id"),
    ({"rollout_id": 7, "reward": 1}, "rollout_id"),
    ({"trace_id": "not-hex", "reward": 1}, "trace_id"),
    ({"trace_id": "0" * 32, "reward": 1}, "trace_id"),
    ({"completion_id": "chatcmpl-abc", "reward": 1}, "completion_id"),
    ({"rollout_id": "r", "reward": 1, "name": ""}, "name"),
])
def test_bad_feedback_names_the_field(body: dict, field: str) -> None:
    with pytest.raises(FeedbackError) as err:
        parse_feedback(body)
    assert err.value.field == field, str(err.value)


def test_session_id_feedback_follows_span_key() -> None:
    """Keyed as span_key keys a span of that session; refused, saying why, while span_key has no session rule."""
    probe = {"rollout_id": None, "trace_id": "ab" * 16, "attributes": {"gen_ai.conversation.id": "s-1"}}
    session_key = records.span_key(probe)
    if session_key != b"ab" * 16:  # span_key keys rollouts by session id
        assert parse_feedback({"session_id": "s-1", "reward": 1}).key.encode() == session_key
        return
    with pytest.raises(FeedbackError) as err:
        parse_feedback({"session_id": "s-1", "reward": 1})
    assert err.value.field == "session_id" and "not by session id" in str(err.value)


@pytest.mark.parametrize(("argv", "message"), [
    (["--rollout-id", "r", "--reward", "nan"], "--reward: reward must be a finite number, got nan"),
    (["--rollout-id", "r", "--reward=-inf"], "--reward: reward must be a finite number, got -inf"),
    (["--rollout-id", "r", "--reward", "good"], "--reward: reward must be a number, got str 'good'"),
    (["--completion-id", "chatcmpl-xyz", "--reward", "1"], "--completion-id: completion id 'chatcmpl-xyz' is not"),
])
def test_cli_bad_input_exits_2_naming_the_flag(argv: list[str], message: str, capsys) -> None:
    assert feedback_cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_takes_a_negative_reward() -> None:
    assert feedback_cli.parser().parse_args(["--rollout-id", "r", "--reward", "-1"]).reward == "-1"


def test_cli_needs_exactly_one_target(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        feedback_cli.main(["--rollout-id", "r", "--trace-id", "ab" * 16, "--reward", "1"])
    assert exit_.value.code == 2 and "not allowed with" in capsys.readouterr().err
