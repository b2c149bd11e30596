"""The inference worker's Prometheus metrics (``GET /metrics``).

A registry per app, so several apps in one process (tests, the demo) never collide.
Its own module because the request path (:mod:`.service`) and the checkpoint follower
(:mod:`.reload`) both record into it and neither should import the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RELOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60)


class Metrics:
    """Requests, tokens in/out, latency, spans written, the loaded policy version, reloads, prefix cache."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("boltstream_inference_requests", "HTTP completion requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("boltstream_inference_prompt_tokens", "prompt tokens processed",
                                     registry=r)
        self.completion_tokens = Counter("boltstream_inference_completion_tokens", "tokens generated",
                                         registry=r)
        self.latency = Histogram("boltstream_inference_request_seconds",
                                 "request latency, arrival to answer (spans acknowledged)", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.policy_version = Gauge("boltstream_inference_policy_version", "policy version being served",
                                    ["model"], registry=r)
        self.reloads = Counter("boltstream_inference_reloads", "checkpoint reloads by kind", ["kind"],
                               registry=r)
        self.reload_failures = Counter("boltstream_inference_reload_failures",
                                       "checkpoints refused (corrupt, partial, incompatible)", registry=r)
        self.reload_seconds = Histogram("boltstream_inference_reload_seconds",
                                        "event received to new version serving (download + verify + load)",
                                        ["kind"], buckets=RELOAD_BUCKETS, registry=r)
        self.capture_failures = Counter("boltstream_inference_capture_failures",
                                        "responses refused because their spans could not be written", registry=r)
        self.spans = Counter("boltstream_inference_spans", "LLM spans written", registry=r)
        self.feedback = Counter("boltstream_inference_feedback", "POST /v1/feedback answers by status",
                                ["status"], registry=r)
        self.model_name = model_name

    def watch_spool(self, stats: Callable[[], Mapping[str, int] | None]) -> None:
        """Report the capture spool's counters (read at each scrape: the sink owns them)."""
        self.registry.register(_SpoolCollector(stats))

    def watch_prefix_cache(self, stats: Callable[[], Mapping[str, int]]) -> None:
        """Report the prefix cache's counters and size (read at each scrape: the engine owns them)."""
        self.registry.register(_PrefixCacheCollector(stats))

    def watch_engine(self, stats: Callable[[], Mapping[str, float]]) -> None:
        """Report the generation thread's busy time and decode steps (read at each scrape: the engine owns them)."""
        self.registry.register(_EngineCollector(stats))

    def set_version(self, version: int, adapter: str | None = None) -> None:
        """The served version, labelled with the adapter's name on a worker serving several."""
        self.policy_version.labels(adapter or self.model_name).set(version)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.stats()
        yield CounterMetricFamily("boltstream_inference_busy_seconds",
                                  "seconds the generation thread spent running batches", value=s["busy_seconds"])
        yield CounterMetricFamily("boltstream_inference_decode_steps", "decode steps run", value=s["decode_steps"])
        yield CounterMetricFamily("boltstream_inference_decode_rows",
                                  "rows decoded, summed over decode steps (/ steps: the mean decode batch)",
                                  value=s["decode_rows"])
        if "threads" in s:
            yield GaugeMetricFamily("boltstream_inference_threads",
                                    "torch threads the generation thread runs with now", value=s["threads"])


class _PrefixCacheCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, int]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.stats()
        yield CounterMetricFamily("boltstream_inference_prefix_cache_hits",
                                  "prompts prefilled after a stored prefix of their KV", value=s["hits"])
        yield CounterMetricFamily("boltstream_inference_prefix_cache_misses",
                                  "prompts that found no stored prefix of their KV", value=s["misses"])
        yield CounterMetricFamily("boltstream_inference_prefill_tokens_computed",
                                  "prompt tokens run through the model in prefills", value=s["tokens_computed"])
        yield CounterMetricFamily("boltstream_inference_prefill_tokens_saved",
                                  "prompt tokens whose KV was reused instead of computed (prefix cache, or "
                                  "another choice of the same request)", value=s["tokens_saved"])
        yield CounterMetricFamily("boltstream_inference_prefix_cache_evictions",
                                  "prefix cache entries evicted to stay within its budget", value=s["evictions"])
        yield GaugeMetricFamily("boltstream_inference_prefix_cache_bytes", "bytes of KV in the prefix cache",
                                value=s["bytes"])
        yield GaugeMetricFamily("boltstream_inference_prefix_cache_tokens", "tokens whose KV the prefix cache holds",
                                value=s["tokens"])
        yield GaugeMetricFamily("boltstream_inference_prefix_cache_budget_bytes",
                                "the prefix cache's budget (0: off)", value=s["budget_bytes"])


class _SpoolCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, int] | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.stats()
        if s is None:
            return
        yield CounterMetricFamily("boltstream_inference_spans_spooled", "LLM spans written to the spool",
                                  value=s["spooled"])
        yield CounterMetricFamily("boltstream_inference_spans_replayed",
                                  "spooled LLM spans read back from disk and sent (after an outage or a restart)",
                                  value=s["replayed"])
        dropped = CounterMetricFamily("boltstream_inference_spans_dropped", "LLM spans lost, by reason",
                                      labels=["reason"])
        dropped.add_metric(["spool_full"], s["dropped_spool_full"])
        dropped.add_metric(["spool_error"], s["dropped_spool_error"])
        yield dropped
        yield CounterMetricFamily("boltstream_inference_answered_from_spool",
                                  "responses answered once their spans were in the spool, before the ack "
                                  "(broker down)", value=s["answered_from_spool"])
        yield GaugeMetricFamily("boltstream_inference_spool_pending", "LLM spans in the spool not yet acked",
                                value=s["pending"])
