"""Zero-code setup: metrics/logs defaults next to the boltstream traces exporter, and the rollout ids in baggage."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from opentelemetry import baggage, propagate
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from boltstream.producers.context import rollout
from boltstream.producers.headers import ids_from_headers
from boltstream.producers.otel_distro import BoltstreamDistro, signal_defaults
from boltstream.producers.propagation import RolloutBaggagePropagator, install_rollout_propagator

ENV_IDS = {"boltstream.rollout_id": "ro-env", "boltstream.attempt_id": "q1:0", "boltstream.task_id": "q1"}


@pytest.mark.parametrize(("environ", "expected"), [
    ({"OTEL_TRACES_EXPORTER": "boltstream"},
     {"OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}),
    ({"OTEL_TRACES_EXPORTER": "console, boltstream", "OTEL_METRICS_EXPORTER": "otlp"},
     {"OTEL_LOGS_EXPORTER": "none"}),  # what the user set stays, even otlp
    ({"OTEL_TRACES_EXPORTER": "boltstream", "OTEL_METRICS_EXPORTER": "", "OTEL_LOGS_EXPORTER": "console"}, {}),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, {}),  # not ours: not our business
    ({}, {}),
])
def test_signal_defaults(environ: dict[str, str], expected: dict[str, str]) -> None:
    assert signal_defaults(environ) == expected


def test_distro_defaults_then_behaves_as_opentelemetry_distro(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "boltstream")
    BoltstreamDistro().configure()
    assert (os.environ["OTEL_METRICS_EXPORTER"], os.environ["OTEL_LOGS_EXPORTER"]) == ("none", "none")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    monkeypatch.delenv("OTEL_METRICS_EXPORTER")
    BoltstreamDistro().configure()  # someone else's app: opentelemetry-distro's own defaults
    assert (os.environ["OTEL_TRACES_EXPORTER"], os.environ["OTEL_METRICS_EXPORTER"]) == ("otlp", "otlp")


@pytest.fixture
def provider() -> Iterator[TracerProvider]:
    provider = TracerProvider()
    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()]))
    try:
        yield provider
    finally:
        propagate.set_global_textmap(previous)
        provider.shutdown()


def test_env_ids_ride_in_baggage_next_to_the_callers_traceparent(provider: TracerProvider) -> None:
    install_rollout_propagator(ENV_IDS)
    with provider.get_tracer("t").start_as_current_span("http call") as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # what the httpx instrumentation does for each request
    assert ids_from_headers(carrier) == ENV_IDS
    trace_id, span_id = carrier["traceparent"].split("-")[1:3]
    assert (int(trace_id, 16), int(span_id, 16)) == (span.get_span_context().trace_id,
                                                      span.get_span_context().span_id)


def test_context_baggage_wins_and_foreign_baggage_is_kept(provider: TracerProvider) -> None:
    prop = RolloutBaggagePropagator(ENV_IDS)
    ctx = baggage.set_baggage("boltstream.rollout_id", "ro-ctx", baggage.set_baggage("user", "ann"))
    carrier: dict[str, str] = {}
    prop.inject(carrier, context=ctx)
    assert ids_from_headers(carrier) == {"boltstream.rollout_id": "ro-ctx"}
    carrier = {}
    prop.inject(carrier, context=baggage.set_baggage("user", "ann"))
    assert "user=ann" in carrier["baggage"] and ids_from_headers(carrier) == ENV_IDS


def test_an_open_rollout_beats_the_env_defaults(provider: TracerProvider) -> None:
    prop = RolloutBaggagePropagator(ENV_IDS)
    with rollout(task_id="t-open", tracer_provider=provider) as ctx:
        carrier: dict[str, str] = {}
        token = otel_context.attach(otel_context.Context())  # as in a thread that lost the context
        try:
            prop.inject(carrier)
        finally:
            otel_context.detach(token)
    assert ids_from_headers(carrier)["boltstream.rollout_id"] == ctx.rollout_id


def test_install_is_idempotent(provider: TracerProvider) -> None:
    first = install_rollout_propagator(ENV_IDS)
    assert install_rollout_propagator({}) is first and first.defaults == ENV_IDS
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    assert ids_from_headers(carrier) == ENV_IDS and carrier["baggage"].count("boltstream.rollout_id") == 1
