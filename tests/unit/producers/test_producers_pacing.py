"""PolicyPacer against a real HTTP /health endpoint with the worker's long-poll semantics."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from boltstream.producers.pacing import PolicyPacer, health_url


class Worker:
    """Serves ``GET /health[?min_version=N&timeout=S]`` like ``boltstream serve`` does."""

    def __init__(self) -> None:
        self.version = 0
        self.cond = threading.Condition()
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                want = int(q["min_version"][0]) if "min_version" in q else None
                with worker.cond:
                    if want is not None:
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
