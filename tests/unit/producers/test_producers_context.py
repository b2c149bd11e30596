"""Rollout context, rewards, the id-stamping processor (threads, asyncio) and the header/URL helpers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import boltstream
from boltstream.producers.context import (
    ROLLOUT_NAMESPACE,
    RolloutContext,
    RolloutTimeout,
    attempt_ids,
    current_rollout,
    emit_reward,
    rollout,
    rollout_base_url,
    rollout_fn,
    rollout_headers,
)
from boltstream.producers.headers import (
    decode_segment,
    encode_segment,
    ids_from_headers,
    parse_rollout_path,
)
from boltstream.producers.rollout_processor import install_rollout_processor


@pytest.fixture
def traced() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    install_rollout_processor(tp)
    install_rollout_processor(tp)  # idempotent
    tp.add_span_processor(SimpleSpanProcessor(mem))
    yield tp, mem
    tp.shutdown()


def by_name(mem: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in mem.get_finished_spans() if s.name == name]


def test_ids_are_deterministic() -> None:
    assert attempt_ids("t1", 2) == ("t1:2", str(uuid.uuid5(ROLLOUT_NAMESPACE, "t1:2")))
    assert attempt_ids("t1", 2, run_id="epoch2")[0] == "epoch2/t1:2"
    assert attempt_ids(None, 0)[0] != attempt_ids(None, 0)[0]


def test_rollout_root_span_children_and_rewards(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    tp, mem = traced
    tracer = tp.get_tracer("agent")
    with rollout("task-1", 3, tracer_provider=tp) as ctx:
        assert current_rollout() is ctx
        with tracer.start_as_current_span("llm call"):
            emit_reward(0.5, "step")
        emit_reward({"acc": 1.0, "len": -0.2}, primary="acc", final=True)
    (root,) = by_name(mem, "boltstream.rollout")
    assert root.attributes["boltstream.status"] == "ok"
    assert root.attributes["boltstream.attempt_id"] == "task-1:3"
    assert root.parent is None, "each rollout is its own trace"
    child = by_name(mem, "llm call")[0]
    assert child.attributes["boltstream.rollout_id"] == ctx.rollout_id
    assert child.context.trace_id == root.context.trace_id
    rewards = {s.attributes["boltstream.reward.name"]: s for s in by_name(mem, "boltstream.reward")}
    assert rewards["step"].attributes["boltstream.reward.final"] is False
    assert rewards["acc"].attributes["boltstream.reward.primary"] is True
    assert rewards["len"].attributes["boltstream.reward.primary"] is False
    assert all(r.attributes["boltstream.task_id"] == "task-1" for r in rewards.values())
    assert current_rollout() is None


def test_failure_is_recorded_not_rewarded(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    tp, mem = traced
    with pytest.raises(ZeroDivisionError), rollout("t", tracer_provider=tp):
        1 / 0  # noqa: B018
    with pytest.raises(RolloutTimeout), rollout("t", 1, tracer_provider=tp):
        raise RolloutTimeout("too slow")
    roots = {s.attributes["boltstream.attempt_id"]: s for s in by_name(mem, "boltstream.rollout")}
    assert roots["t:0"].attributes["boltstream.status"] == "failed"
    assert roots["t:0"].attributes["boltstream.error"] == "ZeroDivisionError: division by zero"
    assert roots["t:1"].attributes["boltstream.status"] == "timeout"
    assert not by_name(mem, "boltstream.reward")


def test_rollout_fn_sync_and_async_return_values_are_final_rewards(
        traced: tuple[TracerProvider, InMemorySpanExporter], monkeypatch: pytest.MonkeyPatch) -> None:
    tp, mem = traced
    monkeypatch.setattr("opentelemetry.trace.get_tracer_provider", lambda: tp)

    @rollout_fn
    def agent(task: dict[str, Any]) -> float:
        return 0.75

    @boltstream.rollout_fn(primary="b")
    async def agent_async(task: dict[str, Any]) -> dict[str, float]:
        await asyncio.sleep(0)
        return {"a": 1.0, "b": 2.0}

    @rollout_fn
    def not_a_reward(task: dict[str, Any]) -> str:
        return "an answer"

    assert agent({"id": "q1"}) == 0.75
    assert asyncio.run(agent_async({"task_id": "q2"})) == {"a": 1.0, "b": 2.0}
    not_a_reward({"id": "q3"})
    rewards = [(s.attributes["boltstream.task_id"], s.attributes["boltstream.reward.name"],
                s.attributes["boltstream.reward.value"], s.attributes["boltstream.reward.primary"],
                s.attributes["boltstream.reward.final"]) for s in by_name(mem, "boltstream.reward")]
    assert sorted(rewards) == [("q1", "reward", 0.75, True, True), ("q2", "a", 1.0, False, True),
                               ("q2", "b", 2.0, True, True)]
    assert len(by_name(mem, "boltstream.rollout")) == 3


def test_decorator_inside_an_open_rollout_reports_into_it(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    tp, mem = traced

    @rollout_fn
    def agent(task: dict[str, Any]) -> int:
        return 1

    with rollout("outer", tracer_provider=tp) as ctx:
        agent({"id": "ignored"})
        ctx.set_result(5)  # already final: ignored
    assert len(by_name(mem, "boltstream.rollout")) == 1
    assert [s.attributes["boltstream.reward.value"] for s in by_name(mem, "boltstream.reward")] == [1.0]


@pytest.mark.parametrize("bad", [True, float("nan"), "1", None])
def test_emit_reward_rejects_non_numbers(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        emit_reward(bad)


def test_ids_reach_spans_in_threads_and_tasks(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    tp, mem = traced
    tracer = tp.get_tracer("agent")

    def work(name: str) -> None:
        with tracer.start_as_current_span(name):
            pass

    async def main() -> None:
        await asyncio.gather(asyncio.create_task(asyncio.to_thread(work, "to_thread")),
                             asyncio.create_task(_coro(work)))

    async def _coro(fn: Any) -> None:
        fn("task")

    with rollout("th", tracer_provider=tp) as ctx:
        t = threading.Thread(target=work, args=("plain thread",))  # copies no context at all
        t.start()
        t.join(5)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(work, "pool").result(5)
        asyncio.run(main())
    for name in ("plain thread", "pool", "to_thread", "task"):
        (span,) = by_name(mem, name)
        assert span.attributes["boltstream.rollout_id"] == ctx.rollout_id, name


def test_concurrent_rollouts_do_not_mix(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    tp, mem = traced
    tracer = tp.get_tracer("agent")

    async def one(i: int) -> None:
        with rollout(f"c{i}", tracer_provider=tp):
            await asyncio.sleep(0.01)
            with tracer.start_as_current_span(f"work{i}"):
                await asyncio.sleep(0.01)

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(5)))

    asyncio.run(main())
    for i in range(5):
        (span,) = by_name(mem, f"work{i}")
        assert span.attributes["boltstream.task_id"] == f"c{i}"


def test_headers_and_base_url(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    tp, _ = traced
    assert rollout_headers() == {}
    assert rollout_base_url("http://h:1/v1") == "http://h:1/v1"
    with rollout("math/q 7", 1, tracer_provider=tp) as ctx:
        h = rollout_headers()
        assert h["X-Boltstream-Rollout-Id"] == ctx.rollout_id
        assert h["X-Boltstream-Attempt-Id"] == "math/q 7:1"
        assert h["X-Boltstream-Task-Id"] == "math/q 7"
        assert h["traceparent"].split("-")[1] == format(ctx.span.get_span_context().trace_id, "032x")
        assert "boltstream.rollout_id=" in h["baggage"]
        assert ctx.headers == h
        url = rollout_base_url("http://h:1/v1/")
        assert ctx.openai_base_url is None
    assert url.startswith(f"http://h:1/rollout/{ctx.rollout_id}/~") and url.endswith("/v1")
    ids, rest = parse_rollout_path(url.split("h:1", 1)[1] + "/chat/completions")
    assert rest == "/v1/chat/completions"
    assert ids == {"boltstream.rollout_id": ctx.rollout_id, "boltstream.attempt_id": "math/q 7:1",
                   "boltstream.task_id": "math/q 7"}
    assert ids_from_headers(h) == ids
    assert ids_from_headers({"baggage": h["baggage"]}) == ids
    assert parse_rollout_path("/v1/chat/completions") is None


def test_evaluation_context_asks_the_worker_not_to_capture() -> None:
    ctx = RolloutContext(rollout_id="r", attempt_id="t:0", task_id="t", base_url="http://h:1/v1", capture=False)
    assert ctx.headers == {"X-Boltstream-Capture": "off"}  # and no ids: nothing to attribute
    assert ctx.openai_base_url == "http://h:1/nocapture/v1"


@pytest.mark.parametrize("value", ["plain-id_1.2:3", "with/slash", "~tilde", "ü", "a b", ""])
def test_segments_round_trip(value: str) -> None:
    seg = encode_segment(value)
    assert "/" not in seg and "%" not in seg
    assert decode_segment(seg) == (value or None)


def test_explicit_ids_on_a_span_win(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    tp, mem = traced
    with rollout("mine", tracer_provider=tp):
        tp.get_tracer("x").start_span("foreign", attributes={"boltstream.rollout_id": "theirs"}).end()
    (span,) = by_name(mem, "foreign")
    assert span.attributes["boltstream.rollout_id"] == "theirs"


def test_agent_name_on_the_root(traced: tuple[TracerProvider, InMemorySpanExporter],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    tp, mem = traced
    monkeypatch.setattr("opentelemetry.trace.get_tracer_provider", lambda: tp)
    with rollout("a", tracer_provider=tp, agent_name="planner"):
        pass

    @rollout_fn
    def solver(task: dict[str, Any]) -> None:
        return None

    solver({"id": "b"})
    names = sorted(s.attributes["boltstream.agent_name"] for s in by_name(mem, "boltstream.rollout"))
    assert names == ["planner", "solver"]


def test_setup_tracing_installs_or_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry import trace

    from boltstream.producers import tracing

    existing = TracerProvider()
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: existing)
    assert tracing.setup_tracing() is existing
    assert getattr(existing, "_boltstream_rollout_processor", False)

    installed: list[Any] = []
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: installed[-1] if installed else trace.ProxyTracerProvider())
    monkeypatch.setattr(trace, "set_tracer_provider", installed.append)
    mem = InMemorySpanExporter()
    provider = tracing.setup_tracing(exporter=mem, service_name="svc", schedule_delay_ms=10)
    assert installed == [provider] and provider.resource.attributes["service.name"] == "svc"
    with rollout("s", tracer_provider=provider):
        provider.get_tracer("x").start_span("inner").end()
    provider.force_flush()
    assert {s.name for s in mem.get_finished_spans()} == {"inner", "boltstream.rollout"}
    assert all(s.attributes["boltstream.task_id"] == "s" for s in mem.get_finished_spans())
    provider.shutdown()
