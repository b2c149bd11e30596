"""Completion requests end to end: validate, generate, capture the spans, answer (JSON or SSE).

The order is the point: the LLM spans of a request are acknowledged by the
broker before the answer (or, when streaming, the final ``[DONE]``) is sent,
so nothing an agent does after seeing the answer can overtake them in the log.
A response whose spans cannot be written is refused (503, ``capture_failed``)
rather than delivered untraced: an untraced call would silently drop a step
from the trajectory the learner trains on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from boltstream.inference import protocol as P
from boltstream.inference.adapters import (
    HEADER_ADAPTER,
    AdapterSpec,
    UnknownAdapter,
    agent_name_from_headers,
    select_adapter,
)
from boltstream.inference.backend import Backend, Completion, Generation
from boltstream.inference.capture import CallContext, SpanSink, build_llm_span
from boltstream.inference.chat import parse_tool_calls, render_prompt, validate_tools
from boltstream.inference.metrics import Metrics
from boltstream.inference.protocol import ApiError
from boltstream.producers.feedback import completion_id

log = logging.getLogger(__name__)
# Model names served as aliases are each logged once; past this many the rest are served unlogged
# (a client that puts a request id in `model` must not grow the worker's memory).
MAX_ALIASES_LOGGED = 1000


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class CompletionService:
    """Turns parsed OpenAI requests into generations, spans and responses."""

    def __init__(self, backend: Backend, sink: SpanSink, metrics: Metrics, *, served_names: tuple[str, ...],
                 default_max_tokens: int = 256, adapters: tuple[AdapterSpec, ...] = (),
                 strict_model_names: bool = False, rollout_temperature: float | None = None) -> None:
        self.backend = backend
        self.rollout_temperature = rollout_temperature
        self.strict_model_names = strict_model_names
        self._aliases_seen: set[str] = set()
        self.adapters = adapters
        self.sink = sink
        self.metrics = metrics
        self.served_names = served_names
        self.default_max_tokens = default_max_tokens

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    # ---------------------------------------------------------------- parsing

    def _model(self, body: dict[str, Any]) -> str:
        """The request's model name: a served one, or (unless strict) any other, served as an alias."""
        model = P.check_model(body, self.served_names, self.strict_model_names)
        if model not in self.served_names and model not in self._aliases_seen:
            if len(self._aliases_seen) < MAX_ALIASES_LOGGED:
                self._aliases_seen.add(model)
                log.info("serving model name %r as an alias of %s (serve --strict-model-names refuses names "
                         "it does not serve)", model, self.served_names[0])
        return model

    def parse_chat(self, body: dict[str, Any]) -> P.ParsedRequest:
        model = self._model(body)
        tools = validate_tools(body.get("tools"))
        tool_choice = body.get("tool_choice")
        if tool_choice == "none":
            tools = None
        prompt = render_prompt(self.tokenizer, body.get("messages"), tools)
        params = P.parse_sampling(body, [len(prompt)], self.backend.max_context, self.default_max_tokens)
        stream, include_usage = P.parse_stream(body)
        return P.ParsedRequest("chat", model, [prompt], params, stream, include_usage,
                               P.parse_logprobs(body, "chat"), bool(body.get("return_token_ids")), tools,
                               tool_choice, messages=body.get("messages"))

    def parse_completion(self, body: dict[str, Any]) -> P.ParsedRequest:
        model = self._model(body)
        prompts, texts = P.parse_prompts(body, self.tokenizer)
        params = P.parse_sampling(body, [len(p) for p in prompts], self.backend.max_context,
                                  self.default_max_tokens)
        stream, include_usage = P.parse_stream(body)
        return P.ParsedRequest("completion", model, prompts, params, stream, include_usage,
                               P.parse_logprobs(body, "completion"), bool(body.get("return_token_ids")),
                               prompt_text=texts)

    def explore(self, req: P.ParsedRequest, ctx: CallContext) -> None:
        """A captured call samples at ``rollout_temperature`` when one is set, whatever the request asked.

        A training run explores at the trainer's temperature (1.0, as TRL's and verl's rollouts do), not at
        the one an agent uses in production: at 0.7 most of the calculator's groups scored alike and gave the
        learner nothing. Calls that are not captured (an evaluation's) keep the request's own; the span
        records the temperature sampled at, which the learner scores with.
        """
        if self.rollout_temperature is not None and ctx.capture:
            req.params = dataclasses.replace(req.params, temperature=self.rollout_temperature)

    def route(self, req: P.ParsedRequest, headers: Any) -> None:
        """Pick the adapter that answers ``req`` (:func:`~boltstream.inference.adapters.select_adapter`)."""
        header = headers.get(HEADER_ADAPTER)
        if not self.adapters:
            if header:
                raise ApiError(404, f"{HEADER_ADAPTER}: this worker serves no named adapters (start it with "
                                    "--adapters)", param=HEADER_ADAPTER, code="adapter_not_found")
            return
        try:
            req.adapter, _ = select_adapter(self.adapters, header=header, model=req.model,
                                            agent_name=agent_name_from_headers(headers))
        except UnknownAdapter as exc:
            raise ApiError(404, str(exc), param=HEADER_ADAPTER, code="adapter_not_found") from None

    # ---------------------------------------------------------------- capture

    @staticmethod
    def _response_id(req: P.ParsedRequest, ctx: CallContext) -> tuple[str, str | None]:
        """(completion id, the first LLM span's id): a captured call's id names its rollout (feedback)."""
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        if not ctx.capture:  # evaluation traffic is never trained: nothing for feedback to address
            return P.new_id(prefix), None
        span_id = secrets.token_hex(8)
        return completion_id(prefix, ctx.rollout_key(), span_id), span_id

    def _spans(self, req: P.ParsedRequest, ctx: CallContext, rid: str, gens: list[Generation],
               texts: list[str], first_span_id: str | None) -> list[dict[str, Any]]:
        if not ctx.capture:  # evaluation traffic: served, never written
            return []
        spans, end = [], time.time_ns()
        n = req.params.n
        for p, gen in enumerate(gens):
            for i, c in enumerate(gen.completions):
                k = p * n + i
                spans.append(build_llm_span(
                    ctx, operation="chat" if req.kind == "chat" else "text_completion",
                    request_model=req.model, served_model=self.served_names[0], response_id=rid,
                    prompt_ids=gen.prompt_token_ids, completion=c, choice_index=k, params=req.params,
                    policy_version=gen.policy_version,
                    input_messages=req.messages if req.kind == "chat" else req.prompt_text[p],
                    output_text=texts[k], end_ns=end, span_id=first_span_id if k == 0 else None,
                    adapter=gen.adapter))
        return spans

    async def _capture(self, spans: list[dict[str, Any]]) -> None:
        if not spans:
            return
        try:
            await self.sink.send(spans)
        except Exception as exc:
            self.metrics.capture_failures.inc()
            log.error("could not write %d LLM span(s): %s", len(spans), exc)
            raise ApiError(503, f"the LLM span could not be written to the log ({exc}); retry the request",
                           type="server_error", code="capture_failed") from exc
        self.metrics.spans.inc(len(spans))

    def _account(self, req: P.ParsedRequest, gens: list[Generation], t0: float, status: str = "200") -> None:
        endpoint = "chat" if req.kind == "chat" else "completions"
        self.metrics.requests.labels(endpoint, status).inc()
        self.metrics.prompt_tokens.inc(sum(len(g.prompt_token_ids) for g in gens))
        self.metrics.completion_tokens.inc(sum(len(c.token_ids) for g in gens for c in g.completions))
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)

    # --------------------------------------------------------------- answers

    def _chat_message(self, req: P.ParsedRequest, c: Completion) -> tuple[dict[str, Any], str]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if req.tools:
            content, calls = parse_tool_calls(c.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls"
        return message, finish

    def _choice(self, req: P.ParsedRequest, k: int, c: Completion) -> dict[str, Any]:
        if req.kind == "chat":
            message, finish = self._chat_message(req, c)
            choice: dict[str, Any] = {"index": k, "message": message, "finish_reason": finish,
                                      "logprobs": P.chat_logprobs(self.tokenizer, c.token_ids, c.logprobs)
                                      if req.logprobs else None}
        else:
            choice = {"index": k, "text": c.text, "finish_reason": c.finish_reason,
                      "logprobs": P.completion_logprobs(self.tokenizer, c.token_ids, c.logprobs)
                      if req.logprobs else None}
        if req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    async def complete(self, req: P.ParsedRequest, ctx: CallContext) -> dict[str, Any]:
        """Non-streaming: every prompt generated concurrently (they batch together)."""
        t0 = time.perf_counter()
        gens = list(await asyncio.gather(*(self.backend.generate(p, req.params, adapter=req.adapter)
                                           for p in req.prompts)))
        completions = [c for g in gens for c in g.completions]
        rid, first_span_id = self._response_id(req, ctx)
        await self._capture(self._spans(req, ctx, rid, gens, [c.text for c in completions], first_span_id))
        out = P.envelope(req.kind, rid, req.model, min(g.policy_version for g in gens))
        out["choices"] = [self._choice(req, k, c) for k, c in enumerate(completions)]
        out["usage"] = P.usage(sum(len(g.prompt_token_ids) for g in gens), sum(len(c.token_ids) for c in completions))
        if req.return_token_ids:
            out["prompt_token_ids"] = (list(gens[0].prompt_token_ids) if len(gens) == 1
                                      else [list(g.prompt_token_ids) for g in gens])
        self._account(req, gens, t0)
        return out

    def _chunk(self, req: P.ParsedRequest, rid: str, version: int, k: int, text: str | None,
               finish: str | None = None, lp: list[tuple[int, float]] | None = None,
               extra_delta: dict[str, Any] | None = None) -> str:
        out = P.envelope(req.kind, rid, req.model, version, chunk=True)
        logprobs = None
        if req.logprobs and lp:
            ids, lps = [t for t, _ in lp], [v for _, v in lp]
            logprobs = (P.chat_logprobs if req.kind == "chat" else P.completion_logprobs)(self.tokenizer, ids, lps)
        if req.kind == "chat":
            delta: dict[str, Any] = dict(extra_delta or {})
            if text is not None:
                delta["content"] = text
            out["choices"] = [{"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        else:
            out["choices"] = [{"index": k, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
        return _sse(out)

    async def stream(self, req: P.ParsedRequest, ctx: CallContext) -> AsyncIterator[str]:
        """SSE: deltas as tokens are sampled; spans acknowledged after the last chunk, before ``[DONE]``."""
        t0 = time.perf_counter()
        n = req.params.n
        rid, first_span_id = self._response_id(req, ctx)
        version = self.backend.version_of(req.adapter)
        events: asyncio.Queue[tuple[int, int, float]] = asyncio.Queue()
        streams = {k: P.TextStream(self.tokenizer, req.params.stop) for k in range(len(req.prompts) * n)}
        pending_lp: dict[int, list[tuple[int, float]]] = {k: [] for k in streams}
        buffer_text = req.kind == "chat" and bool(req.tools)  # tool calls are only known at the end

        def callback(p: int) -> Any:
            return lambda choice, tok, lp: events.put_nowait((p * n + choice, tok, lp))

        tasks = [asyncio.create_task(self.backend.generate(prompt, req.params, callback(p), req.adapter))
                 for p, prompt in enumerate(req.prompts)]
        done = asyncio.gather(*tasks)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception not retrieved"
        try:
            if req.kind == "chat":
                for k in streams:
                    yield self._chunk(req, rid, version, k, "", extra_delta={"role": "assistant"})
            while True:
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                k, tok, lp = getter.result()
                pending_lp[k].append((tok, lp))
                delta = streams[k].push(tok)
                if delta and not buffer_text:
                    yield self._chunk(req, rid, version, k, delta, lp=pending_lp[k])
                    pending_lp[k] = []
            while not events.empty():  # tokens sampled just before the generation finished
                k, tok, lp = events.get_nowait()
                pending_lp[k].append((tok, lp))
                streams[k].push(tok)
            try:
                gens: list[Generation] = list(done.result())
            except Exception as exc:  # headers are sent: report in-band, like OpenAI does
                log.exception("generation failed mid-stream")
                yield _sse(P.error_body(f"generation failed: {exc}", "server_error", None, "internal_error"))
                return
            completions = [c for g in gens for c in g.completions]
            for k, c in enumerate(completions):
                if buffer_text:
                    message, finish = self._chat_message(req, c)
                    extra = {"tool_calls": [dict(tc, index=j) for j, tc in enumerate(message["tool_calls"])]} \
                        if "tool_calls" in message else None
                    yield self._chunk(req, rid, version, k, message["content"], lp=pending_lp[k], extra_delta=extra)
                    yield self._chunk(req, rid, version, k, None, finish=finish)
                    continue
                rest = streams[k].finish(c.text)
                if rest or pending_lp[k]:
                    yield self._chunk(req, rid, version, k, rest, lp=pending_lp[k])
                yield self._chunk(req, rid, version, k, None if req.kind == "chat" else "", finish=c.finish_reason)
            if req.include_usage:
                out = P.envelope(req.kind, rid, req.model, version, chunk=True)
                out["choices"] = []
                out["usage"] = P.usage(sum(len(g.prompt_token_ids) for g in gens),
                                       sum(len(c.token_ids) for c in completions))
                yield _sse(out)
            try:
                await self._capture(self._spans(req, ctx, rid, gens, [c.text for c in completions],
                                                first_span_id))
            except ApiError as exc:
                self._account(req, gens, t0, status=str(exc.status))
                yield _sse(exc.body())
                return
            self._account(req, gens, t0)
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:  # the client went away: stop generating for it
                t.cancel()
