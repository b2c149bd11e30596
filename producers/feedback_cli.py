"""``boltstream feedback``: send a reward for a rollout that already ran (a thumbs-up, a ticket's outcome).

Why a command and not a library call: the application that learns the outcome is often not
the agent (a web backend, a batch job, an operator); all it holds is the completion ``id``
the agent got back, or a rollout / session / trace id. The reward span goes to the ``spans``
topic and the command returns once the broker acknowledged it (exit 0), so a script can
trust "sent". Bad input exits 2 naming the field; a broker that does not answer exits 1.
See producers/feedback.py for the id format and the idempotency rule.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from typing import Any, ClassVar

from boltstream.config import Settings, flags_from_dataclass, load, opt
from boltstream.errors import BoltstreamError

from .feedback import TARGETS, Feedback, FeedbackError, feedback_span, parse_feedback

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FeedbackConfig:
    """``BOLTSTREAM_FEEDBACK_*`` knobs plus :class:`Settings`."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_FEEDBACK_"
    settings: Settings = dataclasses.field(default_factory=Settings)
    timeout_s: float = opt(30.0, "seconds to reach the broker and have the reward acknowledged")


class FeedbackNotSent(BoltstreamError):
    """The broker did not acknowledge the reward span (nothing is known to be in the log)."""


async def send_feedback(settings: Settings, feedback: Feedback, timeout: float = 30.0) -> tuple[bytes, int, int]:
    """Produce the feedback's reward span; returns (key, partition, offset) once the broker acked it."""
    from aiokafka import AIOKafkaProducer

    from boltstream.broker.kafka import producer_kwargs, wait_for_broker

    from .span_encoder import SpanRecordEncoder

    encoder = SpanRecordEncoder(settings)
    key, value, _ = encoder(feedback_span(feedback))
    try:
        await wait_for_broker(settings, timeout=timeout)
        producer = AIOKafkaProducer(**producer_kwargs(settings, linger_ms=0))
        await producer.start()
        try:
            meta = await asyncio.wait_for(await producer.send(encoder.topic, value, key=key), timeout)
        finally:
            await producer.stop()
    except (TimeoutError, BoltstreamError, OSError) as exc:
        raise FeedbackNotSent(f"feedback for rollout {feedback.key!r} not acknowledged by the broker at "
                              f"{settings.bootstrap_servers}: {type(exc).__name__}: {exc}") from exc
    return key, meta.partition, meta.offset


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="boltstream feedback",
        description="Send a reward for a rollout that already ran, addressed by the chat completion's id "
                    "or by a rollout, session or trace id. Final and primary: the latest one before the "
                    "rollout is trained is its final reward; the same feedback twice counts once.")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--completion-id", metavar="ID", help="the chat completion's id (the worker's answer)")
    target.add_argument("--rollout-id", metavar="ID", help="the rollout id (BOLTSTREAM_ROLLOUT_ID, the runner's)")
    target.add_argument("--session-id", metavar="ID", help="the conversation / session id")
    target.add_argument("--trace-id", metavar="HEX", help="the W3C trace id (32 hex digits)")
    p.add_argument("--reward", required=True, help="the reward, a finite number")
    p.add_argument("--name", default=None, help="reward name (default: reward)")
    p.add_argument("--idempotency-key", default=None,
                   help="the same key counts once (default: a hash of the target, name and reward)")
    flags_from_dataclass(p, FeedbackConfig)
    return p


def _number(text: str) -> Any:
    """The CLI's ``--reward`` as a number; anything else is handed on as is, for the one error message."""
    try:
        return float(text)
    except ValueError:
        return text


def main(argv: list[str]) -> int:
    args = vars(parser().parse_args(argv))
    body = {name: args.pop(name) for name in (*TARGETS, "name", "idempotency_key")}
    body["reward"] = _number(args.pop("reward"))
    try:
        feedback = parse_feedback(body)
    except FeedbackError as exc:
        flag = "--" + exc.field.replace("_", "-") if exc.field in body else exc.field
        sys.stderr.write(f"boltstream feedback: {flag}: {exc}\n")
        return 2
    config = load(FeedbackConfig, args)
    key, partition, offset = asyncio.run(send_feedback(config.settings, feedback, config.timeout_s))
    log.info("feedback %s -> rollout %s: %s=%g (span %s) at %s[%d]@%d", feedback.target, feedback.key,
             feedback.name, feedback.value, feedback.span_id, config.settings.topic("spans"), partition, offset)
    sys.stdout.write(json.dumps({"status": "accepted", "rollout_key": key.decode("utf-8"),
                                 "span_id": feedback.span_id, "name": feedback.name,
                                 "reward": feedback.value}) + "\n")
    return 0
