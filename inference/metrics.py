"""The inference worker's Prometheus metrics (``GET /metrics``).

A registry per app, so several apps in one process (tests, the demo) never collide.
Its own module because the request path (:mod:`.service`) and the checkpoint follower
(:mod:`.reload`) both record into it and neither should import the other.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RELOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60)


class Metrics:
    """Requests, tokens in/out, latency, spans written, the loaded policy version and reloads."""

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
        self.model_name = model_name

    def set_version(self, version: int) -> None:
        self.policy_version.labels(self.model_name).set(version)

    def render(self) -> bytes:
        return generate_latest(self.registry)
