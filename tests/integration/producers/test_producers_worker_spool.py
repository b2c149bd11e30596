"""Acceptance (spool mode of the inference worker's capture): with the broker down the worker keeps
answering, each answer once its LLM span is in the spool; after the broker returns every LLM span
reaches ``spans``, keyed by its rollout. A real ``boltstream serve --model tiny`` and a private Tansu."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import httpx

from boltstream.inference.launch import WorkerProcess
from boltstream.stack import settings_env

DOWN = 4


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_worker_answers_through_an_outage(private_broker: Any, helpers: Any, tmp_path: Path) -> None:
    private_broker.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
    env.update(settings_env(private_broker.settings), BOLTSTREAM_STATE_FILE=str(tmp_path / "no-stack.json"))
    worker = WorkerProcess(["--model", "tiny", "--port", "0", "--max-context", "1024", "--no-reload",
                            "--spool-dir", str(tmp_path / "spool")], env=env, log_path=tmp_path / "worker.log")
    ids: list[tuple[str, str]] = []  # (rollout, response id)

    def ask(http: httpx.Client, rollout: str) -> None:
        r = http.post("/v1/chat/completions", headers={"X-Boltstream-Rollout-Id": rollout},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "2 + 2?"}],
                            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        ids.append((rollout, r.json()["id"]))

    with worker, httpx.Client(base_url=worker.url, timeout=60) as http:
        ask(http, "up")
        private_broker.kill()
        for i in range(DOWN):
            ask(http, f"down-{i % 2}")
        metrics = http.get("/metrics").text
        assert _metric(metrics, "boltstream_inference_answered_from_spool_total") >= DOWN - 1
        assert _metric(metrics, "boltstream_inference_capture_failures_total") == 0

        private_broker.start()
        recs = helpers.read_topic(private_broker.settings, "spans", "Span", count=len(ids), timeout=60)
        got = [(rec["rollout_id"], rec["attributes"]["gen_ai.response.id"], key) for _, key, rec in recs]
        assert sorted((r, rid) for r, rid, _ in got) == sorted(ids)
        assert all(key == r.encode() for r, _, key in got)
        down = [rid for r, rid, _ in got if r == "down-0"]
        assert down == [rid for r, rid in ids if r == "down-0"], "per-rollout order kept"
        helpers.poll(lambda: _metric(http.get("/metrics").text, "boltstream_inference_spool_pending") == 0,
                     30, "the spool to be empty")
        metrics = http.get("/metrics").text
        assert _metric(metrics, "boltstream_inference_spans_spooled_total") == len(ids)
