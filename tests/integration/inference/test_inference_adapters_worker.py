"""``boltstream serve --adapters writer,checker=...`` against the real broker + S3: per-adapter reloads and spans."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from boltstream.stack import run_sync
from boltstream.weights.checkpoints import publish_checkpoint
from tests.unit.inference.test_inference_backend import _adapter

MESSAGES = [{"role": "user", "content": "Write the query."}]


def _publish(settings, s3_client, tmp_path: Path, model_name: str, version: int, seed: int) -> dict[str, Any]:
    local = _adapter(0, seed, tmp_path / f"{model_name}-v{version}")
    return publish_checkpoint(s3_client, settings.s3_bucket, f"{settings.namespace}{model_name}", version, local,
                              kind="lora", base_model="tiny", learner_step=version, model_name=model_name)


def _ask(http: httpx.Client, adapter: str, rollout: str) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", headers={"X-Boltstream-Adapter": adapter,
                                                   "X-Boltstream-Rollout-Id": rollout,
                                                   "X-Boltstream-Attempt-Id": f"{rollout}:0"},
                  json={"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
                        "logprobs": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def _answer(resp: dict[str, Any]) -> tuple[list[int], list[float]]:
    choice = resp["choices"][0]
    return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def _wait(http: httpx.Client, adapter: str, version: int) -> dict[str, Any]:
    health = http.get("/health", params={"adapter": adapter, "min_version": version, "timeout": 60}).json()
    assert health["condition_met"], health
    return health


def test_one_adapters_checkpoint_moves_only_that_adapter(settings, start_worker, s3_client, announcer,
                                                         spans_reader, tmp_path: Path) -> None:
    worker = start_worker("--adapters", "writer,checker=sql-checker")
    with httpx.Client(base_url=worker.url, timeout=90) as http:
        run_sync(announcer(settings, _publish(settings, s3_client, tmp_path, "writer", 1, seed=1)))
        run_sync(announcer(settings, _publish(settings, s3_client, tmp_path, "sql-checker", 1, seed=2)))
        _wait(http, "writer", 1)
        _wait(http, "checker", 1)
        writer_v1, checker_v1 = _ask(http, "writer", "r1"), _ask(http, "checker", "r2")
        assert _answer(writer_v1)[0] != _answer(checker_v1)[0]
        assert (writer_v1["system_fingerprint"], checker_v1["system_fingerprint"]) == ("boltstream-v1",) * 2

        run_sync(announcer(settings, _publish(settings, s3_client, tmp_path, "writer", 2, seed=3)))
        health = _wait(http, "writer", 2)
        assert health["adapters"]["writer"]["policy_version"] == 2 and health["adapters"]["writer"]["reloads"] == 2
        assert health["adapters"]["checker"] == {"policy_version": 1, "checkpoint_model": "sql-checker",
                                                 "reloads": 1, "reload_failures": 0, "last_reload_error": None}
        writer_v2, checker_again = _ask(http, "writer", "r3"), _ask(http, "checker", "r4")
        assert _answer(writer_v2)[0] != _answer(writer_v1)[0] and writer_v2["system_fingerprint"] == "boltstream-v2"
        # the same tokens, and logprobs up to float rounding: the 2nd call is prefilled from the prefix cache
        assert _answer(checker_again)[0] == _answer(checker_v1)[0]
        assert _answer(checker_again)[1] == pytest.approx(_answer(checker_v1)[1], abs=1e-4)
        assert checker_again["system_fingerprint"] == "boltstream-v1"
        assert min(len(_answer(r)[0]) for r in (writer_v1, writer_v2, checker_v1)) > 3  # not trivially equal
        metrics = http.get("/metrics").text
        assert 'boltstream_inference_policy_version{model="writer"} 2.0' in metrics
        assert 'boltstream_inference_policy_version{model="checker"} 1.0' in metrics
        # only the checker's 2nd call found stored KV: the writer's reload dropped only the writer's,
        # and no adapter ever read another's
        assert "boltstream_inference_prefix_cache_hits_total 1.0" in metrics

    spans = {s["rollout_id"]: s for _, s in run_sync(spans_reader(settings, 4))}
    tagged = {r: (s["attributes"]["boltstream.adapter"], s["llm"]["policy_version"],
                  s["attributes"]["boltstream.policy_version"]) for r, s in spans.items()}
    assert tagged == {"r1": ("writer", 1, 1), "r2": ("checker", 1, 1), "r3": ("writer", 2, 2),
                      "r4": ("checker", 1, 1)}
    assert spans["r4"]["llm"]["response_token_ids"] == _answer(checker_v1)[0]
