"""The demo's small helpers: the worker counter read for the live table, SIGTERM handling, a short training
file taken several times."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from boltstream.producers.tasks import validate
from boltstream.runs.pipeline import enough_tasks, load_tasks, repeat_tasks
from boltstream.runs.progress import worker_counter
from boltstream.runs.train import stop_on_sigterm

METRICS = b"""# HELP boltstream_inference_spans_total LLM spans written
# TYPE boltstream_inference_spans_total counter
boltstream_inference_spans_total 42.0
boltstream_inference_spans_created 1.7e+09
boltstream_inference_requests_total{endpoint="chat",status="200"} 40.0
boltstream_inference_requests_total{endpoint="completions",status="200"} 2.0
"""


@pytest.fixture
def metrics_port() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(METRICS)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_worker_counter_reads_one_counter_and_sums_its_labels(metrics_port: int) -> None:
    assert worker_counter(metrics_port, "boltstream_inference_spans_total") == 42.0
    assert worker_counter(metrics_port, "boltstream_inference_requests_total") == 42.0


def test_worker_counter_is_zero_when_the_worker_is_gone(metrics_port: int) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert worker_counter(closed, "boltstream_inference_spans_total") == 0.0


def test_sigterm_ends_a_run_like_ctrl_c_and_says_what_it_waits_for(caplog) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop_on_sigterm()
        with caplog.at_level("WARNING", logger="boltstream.runs.train"), pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler at its next bytecode
        assert "up to 300 s" in caplog.text and "a second signal" in caplog.text
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_short_task_file_is_taken_again_with_ids_of_their_own(tmp_path: Path) -> None:
    tasks = [{"id": "a", "task_id": "a", "q": 1}, {"id": "b", "q": 2}, {"q": 3}]
    assert repeat_tasks(tasks, 7) == [  # 3 passes: the fewest that hold 7
        *tasks,
        {"id": "a~1", "task_id": "a~1", "q": 1}, {"id": "b~1", "q": 2}, {"id": "2~1", "q": 3},
        {"id": "a~2", "task_id": "a~2", "q": 1}, {"id": "b~2", "q": 2}, {"id": "2~2", "q": 3}]
    assert repeat_tasks(tasks, 3) == tasks and repeat_tasks(tasks, 0) == tasks
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    assert enough_tasks(path, 3, tmp_path / "more.jsonl") == path and not (tmp_path / "more.jsonl").exists()
    more = enough_tasks(path, 4, tmp_path / "more.jsonl")
    assert more == tmp_path / "more.jsonl" and load_tasks(more) == repeat_tasks(tasks, 4)
    # what the task publisher checks: every id (or, without one, every payload) appears once
    good, bad = validate(enumerate(load_tasks(more), start=1))
    assert bad == [] and len(good) == 6
    # read as the publisher reads: a line it would skip is not repeated, a Parquet file is read too
    path.write_text(path.read_text() + "{not json\n")
    assert load_tasks(enough_tasks(path, 4, tmp_path / "more.jsonl")) == repeat_tasks(tasks, 4)
    pq.write_table(pa.Table.from_pylist([{"id": "p", "q": 1}]), tmp_path / "train.parquet")
    assert load_tasks(enough_tasks(tmp_path / "train.parquet", 2, tmp_path / "pq.jsonl")) == [
        {"id": "p", "q": 1}, {"id": "p~1", "q": 1}]
