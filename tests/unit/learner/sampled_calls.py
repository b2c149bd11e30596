"""A GRPO group whose calls were really sampled at a given temperature, built by production code:
the inference worker (transformers engine, seed-0 tiny Llama: ``--model tiny``) samples and captures
the LLM spans, the stream app's pure functions turn spans into a TrainingBatch. Shared by the unit
and the integration acceptance tests of per-sample temperatures."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from boltstream.inference.capture import MemorySpanSink
from boltstream.inference.server import create_app
from boltstream.inference.transformers_backend import TransformersBackend
from boltstream.streams import assemble_trajectory, build_training_batches
from boltstream.weights.models import tiny_model_and_tokenizer
from tests.unit.streams.factory import reward_span, root_span


def sampled_spans(task: str, attempts: int, temperature: float) -> list[dict[str, Any]]:
    """One captured LLM span per attempt of ``task`` (rollout ``r<i>``, attempt ``<task>:<i>``), in order."""
    model, tokenizer = tiny_model_and_tokenizer(0)
    backend = TransformersBackend(model, tokenizer, model_name="tiny", max_context=1024, max_batch_size=8)
    sink = MemorySpanSink()
    app = create_app(backend, sink=sink, served_names=("tiny",), default_max_tokens=16)
    with TestClient(app) as client:
        for a in range(attempts):
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"what is {a} + 1?"}],
                    "max_tokens": 16, "temperature": temperature, "seed": a}  # fmt: skip
            response = client.post(f"/rollout/r{a}/{task}:{a}/{task}/v1/chat/completions", json=body)
            if response.status_code != 200:
                raise AssertionError(f"inference worker answered {response.status_code}: {response.text}")
    if len(sink.spans) != attempts:
        raise AssertionError(f"{attempts} calls captured {len(sink.spans)} spans")
    return sorted(sink.spans, key=lambda s: s["attempt_id"])


def rollout_spans(task: str, a: int, llm_span: dict[str, Any]) -> list[dict[str, Any]]:
    """The captured call plus the runner's root span and a final reward (1 for odd attempts)."""
    ids = {"rollout_id": f"r{a}", "attempt_id": f"{task}:{a}", "task_id": task}
    end = llm_span["end_time_ns"] + 1
    reward = {**reward_span("fin", float(a % 2), at=end, final=True, primary=True), **ids}
    return [root_span(start=0, end=end + 1, **ids), llm_span, reward]


def sampled_batch(task: str, attempts: int, temperature: float) -> dict[str, Any]:
    """The group's TrainingBatch as the stream app emits it (one part)."""
    spans = sampled_spans(task, attempts, temperature)
    trajectories = [assemble_trajectory(rollout_spans(task, a, s)) for a, s in enumerate(spans)]
    (batch,) = build_training_batches(task, trajectories, group_size=attempts)
    return batch
