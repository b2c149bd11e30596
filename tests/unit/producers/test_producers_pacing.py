"""PolicyPacer against a real HTTP /health endpoint with the worker's long-poll semantics."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from boltstream.producers.pacing import PolicyPacer, health_url, in_daemon_thread


class Worker:
    """Serves ``GET /health[?min_version=N&timeout=S]`` like ``boltstream serve`` does."""

    def __init__(self) -> None:
        self.version = 0
        self.cond = threading.Condition()
        self.long_poll = threading.Event()  # set when a request waits for a newer version
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                want = int(q["min_version"][0]) if "min_version" in q else None
                with worker.cond:
                    if want is not None:
                        worker.long_poll.set()
                        worker.cond.wait_for(lambda: worker.version >= want, float(q["timeout"][0]))
                    body = json.dumps({"policy_version": worker.version}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def publish(self, version: int) -> None:
        with self.cond:
            self.version = version
            self.cond.notify_all()


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    w.thread.start()
    yield w
    w.publish(10**9)  # release long-polls
    w.server.shutdown()
    w.server.server_close()
    w.thread.join(timeout=10)


def test_health_url() -> None:
    assert health_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/health"
    assert health_url("http://h:1/rollout/a/b/c/v1/") == "http://h:1/health"


async def test_admits_k_tasks_per_policy_version(worker: Worker) -> None:
    changed = asyncio.Event()
    pacer = PolicyPacer(f"http://127.0.0.1:{worker.server.server_address[1]}/v1", 2, changed.set)
    assert pacer.room() == 0  # version unknown yet
    stop = asyncio.Event()
    task = asyncio.create_task(pacer.run(stop))
    try:
        await asyncio.wait_for(changed.wait(), 10)
        assert (pacer.version, pacer.room()) == (0, 2)
        pacer.started_one()
        pacer.started_one()
        assert pacer.room() == 0
        changed.clear()
        worker.publish(1)
        await asyncio.wait_for(changed.wait(), 10)
        assert (pacer.version, pacer.room()) == (1, 2)
    finally:
        stop.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    with pytest.raises(ValueError):
        PolicyPacer("http://127.0.0.1:1/v1", 0, changed.set)


def test_a_runner_stopped_mid_long_poll_exits_without_waiting_for_the_poll(worker: Worker) -> None:
    # the pacer waits (a 30 s long poll) for a newer version that never comes; the runner's loop then ends.
    # asyncio.run returns while the poll is still open: it did not join the thread that holds it.
    async def run_and_stop() -> None:
        changed = asyncio.Event()
        pacer = PolicyPacer(f"http://127.0.0.1:{worker.server.server_address[1]}/v1", 1, changed.set)
        stop = asyncio.Event()
        task = asyncio.create_task(pacer.run(stop))
        await asyncio.wait_for(changed.wait(), 10)
        pacer.started_one()  # the one task of version 0: the pacer now waits for version 1
        assert await asyncio.to_thread(worker.long_poll.wait, 10)
        stop.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    worker.long_poll.clear()
    asyncio.run(run_and_stop())
    polls = [t for t in threading.enumerate() if t.name == "boltstream-policy-long-poll"]
    assert polls and all(t.daemon and t.is_alive() for t in polls)
    worker.publish(1)
    for t in polls:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in polls)


async def test_in_daemon_thread_returns_and_raises_what_the_function_does() -> None:
    assert await in_daemon_thread(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ConnectionError, match="refused"):
        await in_daemon_thread(_refused)


def _refused() -> None:
    raise ConnectionError("refused")
