"""``boltstream serve --model tiny`` against the real broker + S3: capture and hot reload."""

from __future__ import annotations

import io
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiokafka import TopicPartition

from boltstream.broker.kafka import log_end_offsets
from boltstream.stack import run_sync
from boltstream.weights.checkpoints import publish_checkpoint, version_prefix
from boltstream.weights.models import byte_tokenizer, save_model_dir, tiny_model_and_tokenizer

HEADERS = {"X-Boltstream-Rollout-Id": "roll-1", "X-Boltstream-Attempt-Id": "task-1:0", "X-Boltstream-Task-Id": "task-1"}
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_openai_client_answers_are_captured_with_token_ids(settings, start_worker, spans_reader) -> None:
    """Captured calls sample at the worker's --rollout-temperature whatever they ask, evaluation calls at theirs."""
    worker = start_worker("--rollout-temperature", "1.0")
    # evaluation traffic (header or base-URL form) is served but never written to the log, and keeps its own
    # sampling: greedy, it answers the same twice (log-probs up to rounding: the second prefills from the cache)
    for base_url, headers in ((f"{worker.url}/v1", {**HEADERS, "X-Boltstream-Capture": "off"}),
                              (f"{worker.url}/nocapture/v1", {})):
        evaluation = openai.OpenAI(base_url=base_url, api_key="unused", default_headers=headers, max_retries=0)
        greedy = [evaluation.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                     logprobs=True).choices[0] for _ in range(2)]
        assert greedy[0].message.content == greedy[1].message.content
        assert [t.logprob for t in greedy[0].logprobs.content] == pytest.approx(
            [t.logprob for t in greedy[1].logprobs.content], abs=1e-4)
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", default_headers=HEADERS,
                           max_retries=0, timeout=60)
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0.8, seed=7)
    text = resp.choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.8, seed=8, stream=True) if chunk.choices)
    by_url = openai.OpenAI(base_url=f"{worker.url}/rollout/roll-2/roll-2:0/~/v1", api_key="unused", max_retries=0)
    other = by_url.completions.create(model="tiny", prompt="2 + 2 =", max_tokens=5, temperature=0).choices[0].text

    spans = run_sync(spans_reader(settings, 3))
    ends = run_sync(log_end_offsets(settings, [TopicPartition(settings.topic("spans"), p)
                                               for p in range(settings.partitions)]))
    assert sum(ends.values()) == 3  # nothing from the evaluation calls
    tok = byte_tokenizer()
    got = {}
    for key, span in spans:
        llm = span["llm"]
        decoded = tok.decode(llm["response_token_ids"], skip_special_tokens=True)
        assert len(llm["response_logprobs"]) == len(llm["response_token_ids"]) > 0
        assert key == span["rollout_id"].encode() and llm["policy_version"] == 0 and llm["model"] == "tiny"
        assert llm["temperature"] == 1.0  # asked 0.8, 0.8 and 0: sampled, and scored, at the worker's
        got.setdefault(span["rollout_id"], []).append((decoded, span))
    assert sorted(d for d, _ in got["roll-1"]) == sorted([text, streamed])
    assert all(s["attempt_id"] == "task-1:0" and s["task_id"] == "task-1" for _, s in got["roll-1"])
    (decoded, span), = got["roll-2"]
    assert decoded == other and span["attempt_id"] == "roll-2:0" and span["task_id"] is None
    assert span["name"] == "text_completion tiny"


def _ask(http: httpx.Client) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 16,
                                                "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def _publish(settings, s3_client, tmp_path: Path, version: int, seed: int) -> dict[str, Any]:
    model, tok = tiny_model_and_tokenizer(seed)
    local = save_model_dir(model, tok, tmp_path / f"v{version}")
    return publish_checkpoint(s3_client, settings.s3_bucket, f"{settings.namespace}run", version, local,
                              kind="full", base_model="tiny", learner_step=version * 10, model_name="tiny")


def _greedy_ids(seed: int, prompt_ids: list[int]) -> list[int]:
    import torch

    model, _ = tiny_model_and_tokenizer(seed)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(16):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in (256, 258):
                break
    return ids[len(prompt_ids):]


def test_checkpoint_reload_and_corrupt_checkpoint_refused(settings, start_worker, s3_client, announcer,
                                                          spans_reader, tmp_path: Path) -> None:
    worker = start_worker()
    with httpx.Client(base_url=worker.url, timeout=90) as http:
        v0 = _ask(http)
        prompt_ids = v0["prompt_token_ids"]
        assert v0["choices"][0]["token_ids"] == _greedy_ids(0, prompt_ids)

        run_sync(announcer(settings, _publish(settings, s3_client, tmp_path, 2, seed=7)))
        health = http.get("/health", params={"min_version": 2, "timeout": 60}).json()
        assert health["policy_version"] == 2 and health["reloads"] == 1, health
        assert http.get("/v1/models").json()["data"][0]["policy_version"] == 2
        v2 = _ask(http)
        assert v2["choices"][0]["token_ids"] == _greedy_ids(7, prompt_ids) != v0["choices"][0]["token_ids"]
        assert min(len(v0["choices"][0]["token_ids"]), len(v2["choices"][0]["token_ids"])) > 3  # not trivial
        assert v2["system_fingerprint"] == "boltstream-v2"

        event = _publish(settings, s3_client, tmp_path, 3, seed=8)
        key = version_prefix(f"{settings.namespace}run", 3) + "model.safetensors"
        data = bytearray(s3_client.get_object(settings.s3_bucket, key).read())
        data[len(data) // 2] ^= 0x01  # one flipped bit, same size
        s3_client.put_object(settings.s3_bucket, key, io.BytesIO(bytes(data)), length=len(data))
        run_sync(announcer(settings, event))
        health = http.get("/health", params={"min_failures": 1, "timeout": 60}).json()
        assert health["reload_failures"] == 1 and health["policy_version"] == 2, health
        assert "model.safetensors" in health["last_reload_error"] and "sha256" in health["last_reload_error"]
        assert _ask(http)["choices"][0]["token_ids"] == v2["choices"][0]["token_ids"]
        metrics = http.get("/metrics").text
        assert 'boltstream_inference_policy_version{model="tiny"} 2.0' in metrics
        assert "boltstream_inference_reload_failures_total 1.0" in metrics

    versions = [s["llm"]["policy_version"] for _, s in run_sync(spans_reader(settings, 3))]
    assert sorted(versions) == [0, 2, 2]

    # A worker started now catches up from the topic: newest (v3) refused, so it falls back to v2.
    late = start_worker()
    with httpx.Client(base_url=late.url, timeout=90) as http:
        health = http.get("/health", params={"min_version": 2, "timeout": 60}).json()
        assert health["policy_version"] == 2 and health["reload_failures"] == 1, health
        assert _ask(http)["choices"][0]["token_ids"] == v2["choices"][0]["token_ids"]


def test_sigterm_removes_the_downloaded_checkpoints_and_answers_long_polls(settings_env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """uvicorn re-raises SIGTERM after its shutdown; the worker's scratch folder must be gone by then. A
    ``/health`` long poll in flight (a runner waiting for the next policy) is answered at once, not held
    to its timeout: uvicorn's graceful shutdown waits for every request."""
    from boltstream.inference.launch import WorkerProcess

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    worker = WorkerProcess(["--model", "tiny", "--port", "0", "--max-context", "1024"],
                           env={**settings_env, "TMPDIR": str(scratch)}, log_path=tmp_path / "worker.log")
    try:
        worker.start(120)
        assert len(list(scratch.glob("boltstream-serve-*"))) == 1
        host, port = httpx.URL(worker.url).host, httpx.URL(worker.url).port
        with socket.create_connection((host, port), timeout=60) as poll:
            poll.sendall(f"GET /health?min_version=99&timeout=120 HTTP/1.1\r\nHost: {host}\r\n"
                         "Connection: close\r\n\r\n".encode())
            with httpx.Client(base_url=worker.url, timeout=60) as http:  # answered after the poll was read
                assert http.get("/health").json()["condition_met"] is True
            assert worker.stop(timeout=20) != -signal.SIGKILL
            answer = b"".join(iter(lambda: poll.recv(65536), b""))
    finally:
        worker.stop(timeout=20)
    assert answer.startswith(b"HTTP/1.1 200") and b'"condition_met":false' in answer, answer
    assert list(scratch.glob("boltstream-serve-*")) == []


def test_the_worker_spins_its_threads_and_reports_how_many_it_runs(settings_env: dict[str, str],
                                                                   tmp_path: Path) -> None:
    """``boltstream serve`` sets GOMP_SPINCOUNT before torch loads (its log line says so) and exports the
    generation thread's thread count; ``--threads`` pins it."""
    from boltstream.inference.launch import WorkerProcess

    env = {k: v for k, v in settings_env.items() if k != "GOMP_SPINCOUNT"}
    log_path = tmp_path / "worker.log"
    worker = WorkerProcess(["--model", "tiny", "--port", "0", "--no-capture", "--threads", "1"], env=env,
                           log_path=log_path)
    try:
        worker.start(120)
        with httpx.Client(base_url=worker.url, timeout=60) as http:
            _ask(http)
            metrics = http.get("/metrics").text
    finally:
        worker.stop(timeout=20)
    assert "boltstream_inference_threads 1.0" in metrics
    served = [line for line in log_path.read_text().splitlines() if "serving in" in line]
    assert served and "GOMP_SPINCOUNT=30000" in served[0] and "OMP_WAIT_POLICY=PASSIVE" in served[0], served
