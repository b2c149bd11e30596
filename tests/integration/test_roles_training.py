"""Per-role training: one worker serves adapters ``writer``, ``checker`` and ``frozen`` on one tiny
base model; agent traffic of all three roles flows through the real stream app; one ``learn --role`` process per
trained role reads the shared batches topic. Each role's samples train only its adapter (the others' outputs stay
bitwise the same), spans name the adapter and version that answered, and the frozen role is never trained.

Every component is a real process on the session's broker and S3; the learners run one after the other so that
each checkpoint's effect on the three adapters is seen alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from boltstream.config import Settings
from boltstream.inference.launch import WorkerProcess
from boltstream.learner.metrics import read_records, read_steps
from boltstream.producers.context import rollout
from boltstream.producers.exporter import KafkaSpanExporter
from boltstream.producers.rollout_processor import install_rollout_processor
from boltstream.schemas.records import AGENT_NAME
from boltstream.weights.checkpoints import latest_manifest
from tests.integration.conftest import read_topic
from tests.integration.learner.helpers import Learner
from tests.integration.streams.stream_helpers import WORKER_ENV
from tests.integration.streams.stream_helpers import WorkerProcess as StreamWorker

ROLES = ("writer", "checker", "frozen")
TRAINED = ("writer", "checker")
GROUP = 2  # attempts per task: rewards 1 and 0, so every sample has a non-zero advantage
PROBE = [{"role": "user", "content": "Check the query."}]
Answer = tuple[list[int], list[float]]


def _probe(http: httpx.Client, adapter: str) -> Answer:
    """A greedy, uncaptured answer of one adapter: token ids and logprobs (compared with :func:`_same`)."""
    r = http.post("/v1/chat/completions", headers={"X-Boltstream-Capture": "off"},
                  json={"model": adapter, "messages": PROBE, "max_tokens": 12, "temperature": 0, "logprobs": True,
                        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def _same(a: Answer, b: Answer) -> bool:
    """The same answer: equal ids, log-probs within 1e-4 (a repeated probe's prompt is prefilled from the
    worker's prefix cache, whose KV equals a fresh prefill's up to rounding)."""
    return a[0] == b[0] and all(abs(x - y) <= 1e-4 for x, y in zip(a[1], b[1], strict=True))


def _probes(http: httpx.Client) -> dict[str, Answer]:
    return {role: _probe(http, role) for role in ROLES}


def _traffic(http: httpx.Client, provider: TracerProvider, task: str) -> None:
    """One GRPO group: each attempt calls all three roles, each call under a span naming its agent and asking
    for its adapter by the OpenAI ``model`` field, as a multi-agent system with a client per role does."""
    tracer = provider.get_tracer("roles-test")
    for attempt, reward in enumerate((1.0, 0.0)):
        with rollout(task, attempt, tracer_provider=provider) as ctx:
            for role in ROLES:
                with tracer.start_as_current_span(f"{role} turn", attributes={AGENT_NAME: role}):
                    r = http.post("/v1/chat/completions", headers=ctx.headers,
                                  json={"model": role, "messages": [{"role": "user", "content": f"{task} {role}"}],
                                        "max_tokens": 6, "temperature": 1.0, "seed": attempt})
                    assert r.status_code == 200, r.text
            ctx.set_result(reward)
    assert provider.force_flush(30_000)


def _wait_version(http: httpx.Client, adapter: str, version: int) -> None:
    health = http.get("/health", params={"adapter": adapter, "min_version": version, "timeout": 60}).json()
    assert health["condition_met"], health


def _learn(role: str, groups: int, env: dict[str, str], tmp_path: Path) -> Path:
    """``learn --role ROLE`` for one step of ``groups`` groups; returns its metrics file once it exited."""
    metrics = tmp_path / f"{role}-metrics.jsonl"
    learner = Learner(["--model", "tiny", "--lora", "--role", role, "--groups-per-step", str(groups), "--max-steps", "1",
                       "--lr", "1e-2", "--lr-warmup-steps", "0", "--poll-ms", "100", "--metrics-path", str(metrics),
                       "--workdir", str(tmp_path / f"{role}-work")], env, tmp_path / f"{role}-learner.log")
    try:
        learner.wait_for(r"done: step 1 version 1", timeout=120)
        assert learner.wait(30) == 0, learner.tail()
    finally:
        learner.stop()
    return metrics


@contextlib.contextmanager
def _pipeline(settings: Settings, settings_env: dict[str, str], tmp_path: Path,
              boltstream_cmd: list[str]) -> Iterator[tuple[httpx.Client, TracerProvider]]:
    """The stream app (trained roles only) and a worker serving every role's adapter; all stopped at the end."""
    stream = StreamWorker([*boltstream_cmd, "stream", "worker", "--app-id", f"{settings.namespace}roles",
                           "--group-size", str(GROUP), "--agent-match", "^(writer|checker)$"],
                          {**settings_env, **WORKER_ENV}, tmp_path / "stream.log")
    worker = WorkerProcess(["--model", "tiny", "--port", "0", "--max-context", "1024", "--adapters", ",".join(ROLES)],
                           env=settings_env, log_path=tmp_path / "worker.log")
    provider = TracerProvider()
    install_rollout_processor(provider)  # the agent's own spans carry the rollout ids too
    provider.add_span_processor(BatchSpanProcessor(KafkaSpanExporter(settings=settings,
                                                                     install_rollout_processor=False),
                                                   schedule_delay_millis=50))
    try:
        worker.start(90)
        with httpx.Client(base_url=worker.url, timeout=90) as http:
            yield http, provider
    finally:
        provider.shutdown()
        worker.stop()
        assert stream.stop() in (0, -15), stream.log_tail()


def _batches(settings: Settings, tasks: int) -> dict[str, str]:
    """sample id -> agent name of every sample of the first ``tasks`` groups on the batches topic."""
    def complete(records: list[Any]) -> bool:
        return len({r[2]["batch_id"] for r in records}) >= tasks

    records = read_topic(settings, "batches", "TrainingBatch", until=complete, timeout=90)
    assert complete(records), f"only {len(records)} batch records"
    return {s["sample_id"]: s["agent_name"] for _, _, b in records for s in b["samples"]}


def _trained(metrics: Path) -> tuple[list[str], dict[str, int]]:
    (step,) = read_steps(read_records(metrics))
    return step["sample_ids"], step["dropped_total"]


def test_each_role_trains_only_its_adapter_and_the_frozen_role_never(
        settings: Settings, settings_env: dict[str, str], s3_client: Any, tmp_path: Path,
        boltstream_cmd: list[str]) -> None:
    with _pipeline(settings, settings_env, tmp_path, boltstream_cmd) as (http, provider):
        base = _probes(http)
        assert _same(base["writer"], base["checker"]) and _same(base["writer"], base["frozen"]), \
            "every adapter starts at the base weights"
        assert len(base["writer"][0]) > 3
        _traffic(http, provider, "t0")
        _traffic(http, provider, "t1")
        roles_of = _batches(settings, 2)
        assert sorted(roles_of.values()) == ["checker"] * 4 + ["writer"] * 4, "the stream app skips the frozen role"

        # the writer's learner: trains the writer's samples only; its checkpoint moves only the writer adapter
        writer_ids, writer_dropped = _trained(_learn("writer", 2, settings_env, tmp_path))
        assert sorted(writer_ids) == sorted(s for s, r in roles_of.items() if r == "writer")
        assert writer_dropped == {"other_role": 4}
        _wait_version(http, "writer", 1)
        after_writer = _probes(http)
        assert not _same(after_writer["writer"], base["writer"])
        assert _same(after_writer["checker"], base["checker"]) and _same(after_writer["frozen"], base["frozen"])

        _traffic(http, provider, "t2")  # spans now show writer v1 next to checker and frozen v0
        roles_of = _batches(settings, 3)

        # the checker's learner: same shared topic, its own samples of all three groups, its own adapter
        checker_ids, checker_dropped = _trained(_learn("checker", 3, settings_env, tmp_path))
        assert sorted(checker_ids) == sorted(s for s, r in roles_of.items() if r == "checker")
        assert len(checker_ids) == 6 and checker_dropped == {"other_role": 6}
        _wait_version(http, "checker", 1)
        after_checker = _probes(http)
        assert not _same(after_checker["checker"], base["checker"])
        assert not _same(after_checker["checker"], after_writer["writer"])
        assert _same(after_checker["writer"], after_writer["writer"]) and _same(after_checker["frozen"], base["frozen"])
        health = http.get("/health").json()["adapters"]
        assert {r: health[r]["policy_version"] for r in ROLES} == {"writer": 1, "checker": 1, "frozen": 0}
        assert health["frozen"]["reloads"] == 0

    # checkpoints: one event per trained role, under its own run prefix; none ever for the frozen role
    events = read_topic(settings, "checkpoints", "CheckpointEvent", to_end=True)
    assert sorted((key, e["model"], e["version"]) for _, key, e in events) == [
        (b"checker", "checker", 1), (b"writer", "writer", 1)]
    namespace = settings.namespace.rstrip(".")
    manifests = {r: latest_manifest(s3_client, settings.s3_bucket, f"{namespace}/{r}") for r in ROLES}
    assert manifests["frozen"] is None
    assert {r: (m["model"], m["kind"], m["version"]) for r, m in manifests.items() if m} == {
        "writer": ("writer", "lora", 1), "checker": ("checker", "lora", 1)}
    states = {r: manifests[r]["extra"]["learner_state"] for r in TRAINED}  # resume state: per role too
    assert states == {r: f"s3://{settings.s3_bucket}/{namespace}/{r}/learner/v1/manifest.json" for r in TRAINED}

    # spans: every call names the adapter that answered and that adapter's version at the time
    spans = [s for _, _, s in read_topic(settings, "spans", "Span", to_end=True)
             if s["resource"].get("service.name") == "boltstream-inference"]
    tags = sorted({(s["task_id"], s["attributes"]["boltstream.adapter"], s["llm"]["policy_version"],
                    s["attributes"]["boltstream.policy_version"]) for s in spans})
    assert len(spans) == 3 * 3 * GROUP
    assert tags == sorted([(t, r, 0, 0) for t in ("t0", "t1") for r in ROLES]
                          + [("t2", "writer", 1, 1), ("t2", "checker", 0, 0), ("t2", "frozen", 0, 0)])
