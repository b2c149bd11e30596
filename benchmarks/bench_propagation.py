"""What trace-context propagation adds on the agent's thread per LLM call, against the same agent without it.

    .venv/bin/python benchmarks/bench_propagation.py [--calls 2000] [--rounds 7]

A zero-code agent (docs/zero-code.md) makes its LLM calls through the ``openai`` SDK; under
``opentelemetry-instrument`` the httpx instrumentation wraps each request in a client span and
injects the global propagator's headers (W3C ``traceparent`` + ``baggage``), and boltstream adds
the rollout ids to that baggage (producers/propagation.py) and to each span
(``RolloutSpanProcessor``). All of it runs on the agent's thread, inside the call. Measured here,
in one process, in alternating rounds (the machine is shared: each round times every
configuration once, medians over rounds):

* ``bare``: the openai SDK call, no OpenTelemetry at all (the baseline);
* ``otel``: the httpx client instrumented, OTel's default propagators, a ``BatchSpanProcessor``;
* ``boltstream``: as ``otel`` plus boltstream's baggage propagator (ids from the env, as a
  runnerless agent has them) and ``RolloutSpanProcessor``.

The server is an in-process ``httpx.MockTransport`` answering a canned chat completion, so the
figure is the client side alone (a real call's network and generation time only add to the
baseline, not to the difference). Added = configuration minus bare, per call, in µs. JSON goes
to benchmarks/results/propagation.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
from opentelemetry.propagate import set_global_textmap
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from boltstream.producers.propagation import RolloutBaggagePropagator
from boltstream.producers.rollout_processor import RolloutSpanProcessor
from boltstream.schemas.records import ATTEMPT_ID, ROLLOUT_ID, TASK_ID

RESULTS = Path(__file__).parent / "results"
IDS = {ROLLOUT_ID: "ro-bench", ATTEMPT_ID: "t1:0", TASK_ID: "t1"}
COMPLETION = {
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "policy",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4"}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
}
MESSAGES = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 2+2?"}]


class NullExporter(SpanExporter):
    """Export happens on the processor's thread; the agent-thread figure must not depend on a sink."""

    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def seen_headers() -> tuple[httpx.MockTransport, list[httpx.Headers]]:
    last: list[httpx.Headers] = []

    def answer(request: httpx.Request) -> httpx.Response:
        last[:] = [request.headers]
        return httpx.Response(200, json=COMPLETION)

    return httpx.MockTransport(answer), last


def client(provider: TracerProvider | None) -> tuple[OpenAI, list[httpx.Headers]]:
    transport, last = seen_headers()
    http = httpx.Client(transport=transport)
    if provider is not None:
        HTTPXClientInstrumentor.instrument_client(http, tracer_provider=provider)
    return OpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused", http_client=http, max_retries=0), last


def per_call_us(api: OpenAI, calls: int) -> float:
    create = api.chat.completions.create
    t0 = time.perf_counter()
    for _ in range(calls):
        create(model="policy", messages=MESSAGES, max_tokens=4)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per configuration per round")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    w3c = [TraceContextTextMapPropagator(), W3CBaggagePropagator()]
    plain, ours = TracerProvider(), TracerProvider()
    plain.add_span_processor(BatchSpanProcessor(NullExporter(), max_queue_size=1_000_000))
    ours.add_span_processor(RolloutSpanProcessor())
    ours.add_span_processor(BatchSpanProcessor(NullExporter(), max_queue_size=1_000_000))
    configs: dict[str, tuple[Callable[[], None], tuple[OpenAI, list[httpx.Headers]]]] = {
        "bare": (lambda: set_global_textmap(CompositePropagator(w3c)), client(None)),
        "otel": (lambda: set_global_textmap(CompositePropagator(w3c)), client(plain)),
        "boltstream": (lambda: set_global_textmap(CompositePropagator([*w3c, RolloutBaggagePropagator(IDS)])),
                       client(ours)),
    }
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for name, (install, (api, last)) in configs.items():  # warm up, and check each does what it says
        install()
        per_call_us(api, 50)
        headers = last[0]
        if name == "bare":
            assert "traceparent" not in headers, headers
        else:
            assert "traceparent" in headers, headers
            assert ("ro-bench" in headers.get("baggage", "")) == (name == "boltstream"), headers
    for _ in range(args.rounds):
        for name, (install, (api, _)) in configs.items():
            install()
            runs[name].append(per_call_us(api, args.calls))
    plain.shutdown()
    ours.shutdown()

    median = {name: statistics.median(v) for name, v in runs.items()}
    added = {name: median[name] - median["bare"] for name in ("otel", "boltstream")}
    for name in configs:
        extra = "" if name == "bare" else f"  added {added[name]:6.1f} µs ({median[name] / median['bare']:.2f}x bare)"
        print(f"{name:>10}: {median[name]:7.1f} µs/call{extra}")
    print(f"boltstream's own share (ids in baggage and spans): {median['boltstream'] - median['otel']:.1f} µs/call")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "propagation.json").write_text(json.dumps({
        "calls": args.calls, "rounds": args.rounds, "us_per_call": median, "added_us_per_call": added,
        "ratio_vs_bare": {name: median[name] / median["bare"] for name in added}, "runs_us_per_call": runs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
