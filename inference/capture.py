"""Token capture: every completion becomes an LLM span on the ``spans`` topic BEFORE the client sees it.

Why before: the stream app assembles a rollout when its root span arrives.
Spans are keyed by rollout id, so they share a partition; if the worker's LLM
span is acknowledged by the broker before the agent gets its answer, it is
necessarily earlier in the log than the root span the agent ends later. That
is the completeness rule of the design; it costs one broker round trip per
response (the producer lingers at most a few ms).

Rollout ids come from the request (``X-Boltstream-*`` headers, W3C baggage,
or a ``/rollout/<rollout>/<attempt>/<task>/v1`` base URL); requests without
them are still traced, keyed by the session id in their baggage, else by their
trace id (``records.rollout_key``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from boltstream.inference.backend import LOGPROBS_MODE, Completion, SamplingParams
from boltstream.producers.headers import HEADER_CAPTURE, ids_from_headers, session_from_headers
from boltstream.schemas.packed import F32, I32, as_array
from boltstream.schemas.records import ATTEMPT_ID, INFERENCE_SCOPE, ROLLOUT_ID, TASK_ID, span_key

log = logging.getLogger(__name__)

SCOPE = INFERENCE_SCOPE
MAX_TEXT_ATTR = 32 * 1024  # message texts are for humans (Console); token ids are the training record
ADAPTER_ATTRIBUTE = "boltstream.adapter"
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


@dataclass
class CallContext:
    """Who asked: rollout ids, the caller's trace context, and when the request arrived."""

    ids: dict[str, str] = field(default_factory=dict)
    trace_id: str = ""
    parent_span_id: str | None = None
    start_ns: int = 0
    capture: bool = True  # False: X-Boltstream-Capture: off or a /nocapture/v1 base URL (evaluation)

    @classmethod
    def from_request(cls, headers: Mapping[str, str], path_ids: Mapping[str, str] | None,
                     capture: bool = True) -> CallContext:
        """Ids from the base URL win over headers (an explicit per-client setting); then baggage."""
        if capture is False or (headers.get(HEADER_CAPTURE) or headers.get(HEADER_CAPTURE.lower()) or "").strip().lower() == "off":
            return cls(capture=False, trace_id=secrets.token_hex(16), start_ns=time.time_ns())

        ids = {k: v for k, v in ids_from_headers(headers).items() if v and v not in ("-", "~")}
        ids.update({k: v for k, v in (path_ids or {}).items() if v and v not in ("-", "~")})
        if ROLLOUT_ID not in ids:  # no explicit rollout: the caller's session (baggage) keys the span
            ids.update(session_from_headers(headers))
        trace_id, parent = secrets.token_hex(16), None
        m = _TRACEPARENT.match((headers.get("traceparent") or "").strip().lower())
        if m and m.group(1) != "0" * 32 and m.group(2) != "0" * 16:
            trace_id, parent = m.group(1), m.group(2)
        return cls(ids, trace_id, parent, time.time_ns())

    def rollout_key(self) -> str:
        """The ``spans`` key this call's LLM spans get: what its completion id names (producers/feedback.py)."""
        return span_key({"rollout_id": self.ids.get(ROLLOUT_ID), "trace_id": self.trace_id,
                         "attributes": dict(self.ids)}).decode("utf-8")


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT_ATTR else text[:MAX_TEXT_ATTR] + "…[truncated]"


def default_resource(model_name: str) -> dict[str, Any]:
    """One dict per served name and process, shared by its spans and never mutated: the span encoder
    caches a resource's bytes by the dict's identity (a fresh dict per call was re-encoded each time)."""
    return _resource(model_name, os.getpid())


@functools.lru_cache(maxsize=16)
def _resource(model_name: str, pid: int) -> dict[str, Any]:
    return {"service.name": "boltstream-inference", "host.name": socket.gethostname(),
            "process.pid": pid, "boltstream.model": model_name}


def build_llm_span(
    ctx: CallContext,
    *,
    operation: str,
    request_model: str,
    served_model: str,
    response_id: str,
    prompt_ids: list[int],
    completion: Completion,
    choice_index: int,
    params: SamplingParams,
    policy_version: int,
    input_messages: Any = None,
    output_text: str | None = None,
    end_ns: int | None = None,
    resource: Mapping[str, Any] | None = None,
    span_id: str | None = None,
    adapter: str | None = None,
) -> dict[str, Any]:
    """One ``Span`` record (schemas/span/v2.avsc; token ids packed on the wire) for one sampled completion.

    ``span_id``: the one the completion id already names (the first choice's); random otherwise.
    ``adapter``: the named LoRA adapter that answered (``boltstream.adapter``; its version is
    ``policy_version``), so a per-role learner can tell whose policy sampled the tokens.
    """
    attrs = _llm_attributes(ctx, operation=operation, request_model=request_model, served_model=served_model,
                            response_id=response_id, prompt_ids=prompt_ids, completion=completion,
                            choice_index=choice_index, params=params, policy_version=policy_version,
                            input_messages=input_messages, output_text=output_text, adapter=adapter)
    return {
        "trace_id": ctx.trace_id,
        "span_id": span_id or secrets.token_hex(8),
        "parent_span_id": ctx.parent_span_id,
        "name": f"{operation} {request_model}",
        "kind": "SERVER",
        "start_time_ns": ctx.start_ns,
        "end_time_ns": end_ns or time.time_ns(),
        "status": {"code": "OK", "message": None},
        "attributes": attrs,
        "events": [],
        "resource": resource if resource is not None else default_resource(served_model),
        "scope": {"name": SCOPE, "version": None},
        "rollout_id": ctx.ids.get(ROLLOUT_ID),
        "attempt_id": ctx.ids.get(ATTEMPT_ID),
        "task_id": ctx.ids.get(TASK_ID),
        "llm": _llm_block(prompt_ids, completion, params, served_model=served_model,
                          policy_version=policy_version),
    }



def _llm_attributes(ctx: CallContext, *, operation: str, request_model: str, served_model: str, response_id: str,
                    prompt_ids: list[int], completion: Completion, choice_index: int, params: SamplingParams,
                    policy_version: int, input_messages: Any, output_text: str | None,
                    adapter: str | None) -> dict[str, Any]:
    """The LLM span's attributes: GenAI semantic conventions, boltstream's own, the call's ids."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "boltstream",
        "gen_ai.system": "boltstream",
        "gen_ai.request.model": request_model,
        "gen_ai.response.model": served_model,
        "gen_ai.response.id": response_id,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.choice.count": params.n,
        "gen_ai.usage.input_tokens": len(prompt_ids),
        "gen_ai.usage.output_tokens": len(completion.token_ids),
        "gen_ai.response.finish_reasons": {"strings": [completion.finish_reason]},
        "boltstream.policy_version": policy_version,
        "boltstream.choice_index": choice_index,
        "boltstream.logprobs_mode": LOGPROBS_MODE,
        "boltstream.assigned": ROLLOUT_ID in ctx.ids,
    }
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    if params.stop:
        attrs["gen_ai.request.stop_sequences"] = {"strings": list(params.stop)}
    if completion.stop_string is not None:
        attrs["boltstream.stop_string"] = completion.stop_string
    if adapter is not None:
        attrs[ADAPTER_ATTRIBUTE] = adapter
    attrs.update(ctx.ids)
    if input_messages is not None:
        attrs["gen_ai.input.messages"] = _clip(json.dumps(input_messages, ensure_ascii=False, default=str))
    if output_text is not None:
        attrs["gen_ai.output.messages"] = _clip(json.dumps(
            [{"role": "assistant", "content": output_text, "finish_reason": completion.finish_reason}],
            ensure_ascii=False))
    return attrs


def _llm_block(prompt_ids: list[int], completion: Completion, params: SamplingParams, *, served_model: str,
               policy_version: int) -> dict[str, Any]:
    """The span's typed ``llm`` block: token ids and logprobs as the engine produced them, never re-tokenised."""
    return {
        # Packed once here (struct, in C: ~10 ns per id), so encoding the span is a memcpy.
        "prompt_token_ids": as_array(prompt_ids, I32),
        "response_token_ids": as_array(completion.token_ids, I32),
        "response_logprobs": as_array(completion.logprobs, F32),
        "model": served_model,
        "policy_version": policy_version,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "seed": params.seed,
        "finish_reason": completion.finish_reason,
        "input_tokens": len(prompt_ids),
        "output_tokens": len(completion.token_ids),
    }


class SpanSink(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def send(self, spans: list[dict[str, Any]]) -> None:
        """Return only once every span is durably written (raise otherwise)."""
        ...


class MemorySpanSink:
    """Keeps spans in a list (unit tests, ``--no-capture`` dry runs keep the last few)."""

    def __init__(self, keep: int | None = None) -> None:
        self.spans: list[dict[str, Any]] = []
        self.keep = keep

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def send(self, spans: list[dict[str, Any]]) -> None:
        self.spans.extend(spans)
        if self.keep is not None:
            del self.spans[: max(0, len(self.spans) - self.keep)]


class KafkaSpanSink:
    """Produces Avro-encoded spans to ``settings.topic("spans")`` and awaits the broker's acks.

    A span over the broker's message size (a huge prompt) is truncated exactly as the exporter
    does it (``boltstream.truncated`` marker, token ids kept longest), not refused: one oversized
    record would fail the whole response. :attr:`truncated` counts them for the worker's metrics.

    Spool mode (``spool_dir``): the spans of a response are first appended to the exporter's
    on-disk spool (:mod:`boltstream.producers.spool`, fsynced when ``fsync``), then sent from it
    in order by a :class:`~boltstream.producers.sender.KafkaSender` on the worker's loop. While
    the broker answers, :meth:`send` still waits for the ack (ack before answer, up to
    ``ack_timeout``); once it is known to be down, :meth:`send` returns as soon as the spans are
    durable in the spool, and they are delivered, in order, when the broker is back or at the
    worker's next start. The price: during an outage an agent's root span may reach the log
    before the worker's LLM spans of the same rollout.
    """

    def __init__(self, settings: Any, codec: Any = None, timeout: float = 30.0, *,
                 spool_dir: str | os.PathLike[str] | None = None, fsync: bool = False,
                 ack_timeout: float = 2.0) -> None:
        from boltstream.producers.span_encoder import SpanRecordEncoder

        self.settings = settings
        self.encoder = SpanRecordEncoder(settings, codec)
        self.topic = self.encoder.topic
        self.timeout = timeout
        self.truncated = 0
        self.spool_dir, self.fsync, self.ack_timeout = spool_dir, fsync, ack_timeout
        self.answered_from_spool = 0  # responses sent before their spans were acked (broker down)
        self._producer: Any = None
        self._spool: Any = None
        self._sender: Any = None
        self._sender_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from aiokafka import AIOKafkaProducer

        from boltstream.broker.kafka import producer_kwargs, wait_for_broker

        if self.spool_dir is not None:
            self._start_spooled()
            return
        await wait_for_broker(self.settings, timeout=self.timeout)
        self._producer = AIOKafkaProducer(**producer_kwargs(self.settings, linger_ms=1))
        await self._producer.start()

    def _start_spooled(self) -> None:
        """No broker needed to start: the spool takes the spans until it answers."""
        from aiokafka import AIOKafkaProducer

        from boltstream.broker.kafka import producer_kwargs
        from boltstream.producers.sender import Counters, KafkaSender, SpanBuffer
        from boltstream.producers.spool import Spool

        counters = Counters()
        self._spool = Spool(self.spool_dir, counters, max_bytes=1 << 30, segment_bytes=16 << 20,
                            fsync=self.fsync)
        self._sender = KafkaSender(
            SpanBuffer(1, counters), self.topic, lambda spans: [], batch_size=500, backoff_s=0.1,
            backoff_max_s=2.0, spool=self._spool,
            producer_factory=lambda: AIOKafkaProducer(**producer_kwargs(
                self.settings, linger_ms=1, request_timeout_ms=15_000)))
        self._sender_task = asyncio.create_task(self._sender.run(), name="boltstream-capture-spool")
        log.info("capture spools to %s", self._spool.dir)

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
        if self._sender_task is not None:
            self._sender.request_stop()
            try:
                await asyncio.wait_for(self._sender_task, 10.0)
            except (TimeoutError, asyncio.CancelledError):
                log.warning("capture spool sender did not stop within 10 s")
            self._sender_task = None
            if self._spool.pending:
                log.warning("%d LLM spans stay in the spool %s for the next start", self._spool.pending,
                            self._spool.dir)
            self._spool.close()

    def spool_stats(self) -> dict[str, int] | None:
        """Counters for the worker's ``/metrics`` (None without a spool)."""
        if self._spool is None:
            return None
        c = self._sender.counters
        with c.lock:
            return {"spooled": c.spooled, "replayed": c.replayed, "pending": self._spool.pending,
                    "dropped_spool_full": c.dropped_spool_full, "dropped_spool_error": c.dropped_spool_error,
                    "answered_from_spool": self.answered_from_spool}

    def encode(self, span: dict[str, Any]) -> tuple[bytes, bytes]:
        """(key, value) of one span, cut to the broker's message size when it has to be."""
        key, value, removed = self.encoder(span)
        if removed:
            self.truncated += 1
            log.warning("span %s of rollout %s truncated to %d bytes; removed %s", span["span_id"],
                        span.get("rollout_id"), len(value), ", ".join(removed))
        return key, value

    async def send(self, spans: list[dict[str, Any]]) -> None:
        if self._spool is not None:
            return await self._send_spooled(spans)
        if self._producer is None:
            raise RuntimeError("span sink not started")
        futures = []
        for span in spans:
            key, value = self.encode(span)
            futures.append(await self._producer.send(self.topic, value, key=key))
        await asyncio.wait_for(asyncio.gather(*futures), self.timeout)

    async def _send_spooled(self, spans: list[dict[str, Any]]) -> None:
        """Durable in the spool, then acked, or, with the broker known to be down, durable is enough."""
        acked = asyncio.get_running_loop().create_future()
        self._spool.append([self.encode(span) for span in spans], acked)  # OSError: the request fails
        self._sender.wake()
        c = self._sender.counters
        if c.broker_up or not c.send_failures:
            try:
                await asyncio.wait_for(asyncio.shield(acked), self.ack_timeout)
                return
            except TimeoutError:
                pass
        self.answered_from_spool += 1
