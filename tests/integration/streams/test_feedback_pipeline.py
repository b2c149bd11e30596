"""Delayed feedback end to end: ``boltstream serve --model tiny`` + the session stack + a stream worker.

A chat completion's ``id`` is all the feedback needs: ``boltstream feedback --completion-id``
(the CLI as typed, a subprocess) and ``POST /v1/feedback`` both turn it into a reward span
under the rollout's key, the trajectory carries it, the same feedback twice counts once, a
feedback after the rollout was trained lands in the DLQ with the reason, and a NaN reward is
refused at the boundary.

What closes the rollouts here (the stream app's current rule): the ``boltstream.rollout``
root span, produced by the test AFTER the feedback was acknowledged (spans of one key share
a partition, in order), so the trajectory is assembled with the feedback in it. Holding a
closed rollout for its reward (``reward_timeout_s``) is another change's; this test does not
rely on it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from boltstream.config import Settings
from boltstream.inference.launch import WorkerProcess
from boltstream.schemas import Codec
from tests.integration.streams.stream_helpers import TopicReader, produce
from tests.unit.streams.factory import root_span


def _chat(client: httpx.Client, rollout: str) -> dict[str, Any]:
    headers = {"X-Boltstream-Rollout-Id": rollout, "X-Boltstream-Attempt-Id": f"{rollout}:0",
               "X-Boltstream-Task-Id": rollout}
    r = client.post("/v1/chat/completions", headers=headers, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.json()


async def _close(settings: Settings, start_ns: int, *rollouts: str) -> None:
    """The root span each rollout's agent would end with (what closes a rollout today), enclosing
    its calls in time as a runner's does (a span of another trace outside it is another run's)."""
    codec, topic, end_ns = Codec(), settings.topic("spans"), time.time_ns()
    await produce(settings, topic, [
        (r.encode(), codec.encode("Span", root_span(f"{i:016x}", start=start_ns, end=end_ns, rollout_id=r,
                                                    attempt_id=f"{r}:0", task_id=r), topic=topic))
        for i, r in enumerate(rollouts, start=1)])


async def test_feedback_by_completion_id_reaches_the_trajectory_once(
    settings: Settings, settings_env: dict[str, str], tmp_path: Path, start_worker: Callable[..., Any],
    app_id: str, run_cli: Callable[..., Any],
) -> None:
    cli_rollout, http_rollout = f"fb-cli-{uuid.uuid4().hex[:6]}", f"fb-http-{uuid.uuid4().hex[:6]}"
    unknown = f"fb-nobody-{uuid.uuid4().hex[:6]}"
    started_ns = time.time_ns()
    worker = WorkerProcess(["--model", "tiny", "--port", "0", "--max-context", "1024"], env=settings_env,
                           log_path=tmp_path / "serve.log")
    try:
        worker.start(90)
        with httpx.Client(base_url=worker.url, timeout=60) as client:
            cid = _chat(client, cli_rollout)["id"]
            for _ in range(2):  # the same feedback twice
                done = run_cli("feedback", "--completion-id", cid, "--reward", "1")
                assert done.returncode == 0, done.stderr[-2000:]
                assert json.loads(done.stdout)["rollout_key"] == cli_rollout
            nan = run_cli("feedback", "--completion-id", cid, "--reward", "nan")
            assert nan.returncode == 2 and "--reward: reward must be a finite number, got nan" in nan.stderr

            http_cid = _chat(client, http_rollout)["id"]
            r = client.post("/v1/feedback", json={"completion_id": http_cid, "reward": 0.5, "name": "thumbs"})
            assert r.status_code == 202 and r.json()["rollout_key"] == http_rollout, r.text
            r = client.post("/v1/feedback", content=json.dumps({"completion_id": http_cid, "reward": float("nan")}))
            assert r.status_code == 400 and r.json()["error"]["param"] == "reward", r.text
    finally:
        worker.stop()
    await _close(settings, started_ns, cli_rollout, http_rollout)
    orphan = run_cli("feedback", "--rollout-id", unknown, "--reward", "1")  # no span of it will ever come
    assert orphan.returncode == 0, orphan.stderr[-2000:]

    # short timeouts: the unknown rollout (feedback alone, no runner: a session) is given up on within seconds
    stream = start_worker(app_id, "--group-size", "1", BOLTSTREAM_STREAM_ROLLOUT_TIMEOUT_S="3",
                          BOLTSTREAM_STREAM_SESSION_IDLE_S="3")
    async with TopicReader(settings, settings.topic("trajectories"), "Trajectory") as out:
        await out.until(lambda: len(out.records) >= 2, 90, "the two trajectories")
        by_rollout = {t["rollout_id"]: t for t in out.records}
        cli, http = by_rollout[cli_rollout], by_rollout[http_rollout]
        assert cli["final_reward"] == 1.0 and len(cli["rewards"]) == 1, cli["rewards"]  # twice, counted once
        assert http["final_reward"] == 0.5 and [r["name"] for r in http["rewards"]] == ["thumbs"]
        for trajectory in (cli, http):  # the worker's call: its token ids and logprobs
            (turn,) = trajectory["turns"]
            assert turn["response_token_ids"] and len(turn["response_logprobs"]) == len(turn["response_token_ids"])

        # the rollout was trained: a feedback now is accepted by the broker, then dead-lettered, said
        late = run_cli("feedback", "--rollout-id", cli_rollout, "--reward", "0")
        assert late.returncode == 0, late.stderr[-2000:]
        async with TopicReader(settings, settings.topic("dlq"), "DeadLetter") as dlq:
            await dlq.until(lambda: {d["key"] for d in dlq.records} >= {cli_rollout.encode(), unknown.encode()}, 60,
                            "the late and the unknown feedback's dead letters")
        letters = {d["key"].decode(): d["reason"] for d in dlq.records}
        assert len(dlq.records) == 2, letters
        assert letters[cli_rollout] == (f"feedback for rollout {cli_rollout} arrived after it was trained: "
                                        "its reward 0.0 was not used")
        assert letters[unknown].startswith(f"rollout {unknown}: unknown rollout: feedback arrived for it")
        await out.quiet(idle=1.0, timeout=5.0)
        assert len(out.records) == 2, "no second trajectory for a late feedback"
    assert stream.alive() and stream.stop() == 0, stream.log_tail()
