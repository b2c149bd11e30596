"""The extraction, choice and lookup example agents: seeded, disjoint task splits and rewards on
hand-made replies (examples/extract, examples/choose, examples/lookup)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from boltstream.examples.choose import agent as choose
from boltstream.examples.choose import tasks as choose_tasks
from boltstream.examples.extract import agent as extract
from boltstream.examples.extract import tasks as extract_tasks
from boltstream.examples.lookup import agent as lookup
from boltstream.examples.lookup import corpus
from boltstream.examples.lookup import tasks as lookup_tasks


@pytest.mark.parametrize("tasks", [extract_tasks, choose_tasks, lookup_tasks])
def test_splits_are_seeded_and_the_test_split_is_unseen(tasks) -> None:
    train, test = tasks.train_test(seed=3)
    assert (train, test) == tasks.train_test(seed=3) and train != tasks.train_test(seed=4)[0]
    assert (len(train), len(test)) == (256, 32)
    key = next(k for k in ("sentence", "question") if k in train[0])
    if tasks is lookup_tasks:  # questions repeat within a split; the islands asked about never cross it
        islands = [{t[key].rsplit(" ", 1)[1] for t in split} for split in (train, test)]
        assert not islands[0] & islands[1]
    else:
        assert not {t[key] for t in train} & {t[key] for t in test}


TASK = {"sentence": "Living in Lima, Ana Kim (44) works as a chef.",
        "expected": {"name": "Ana Kim", "age": 44, "city": "Lima", "job": "chef"}}


@pytest.mark.parametrize(("reply", "expected"), [
    ('{"name": "Ana Kim", "age": 44, "city": "Lima", "job": "chef"}', 1.0),
    ('Here: {"name": "ana kim", "age": "44", "city": "Lima", "job": "cook"}', 0.75),  # case-blind, age as text
    ('{"name": "Ana", "age": 45}', 0.0),
    ('{"name": "Ana Kim", "age": 44', 0.0),  # not JSON
    ("Ana Kim, 44, Lima, chef", 0.0),
])
def test_extraction_reward_is_the_share_of_fields_right(reply: str, expected: float) -> None:
    assert extract.reward(TASK, reply) == expected


def test_choice_tasks_ask_both_sides_and_offer_a_name_not_in_the_question() -> None:
    train, _ = choose_tasks.train_test()
    assert {t["answer"] == t["question"].split()[0] for t in train} == {True, False}
    for t in train[:20]:
        assert t["answer"] in t["options"] and len(set(t["options"])) == 3
        assert sum(name in t["question"] for name in t["options"]) == 2


@pytest.mark.parametrize(("reply", "expected"), [
    ('{"answer": "Ben"}', 1.0), ('{"answer": "Anna"}', 0.0), ("Ben", 0.0), ('{"answer": "Ben"', 0.0),
])
def test_choice_reward_needs_the_right_name_in_json(reply: str, expected: float) -> None:
    task = {"question": "Anna is taller than Ben. Who is shorter?", "options": ["Ben", "Cy", "Anna"], "answer": "Ben"}
    assert choose.reward(task, reply) == expected
    assert "Options: Ben, Cy, Anna." in choose.messages(task)[-1]["content"]


def test_the_lookup_tool_reads_the_corpus_and_its_span_says_when_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    monkeypatch.setattr(lookup, "tracer", provider.get_tracer("test"))
    island, facts = next(iter(corpus.CORPUS.items()))
    assert facts["capital"] in lookup.lookup(island.upper()) and facts["export"] in lookup.lookup(island)
    assert lookup.lookup("Atlantis").startswith("ERROR")
    statuses = [s.status.status_code for s in spans.get_finished_spans()]
    assert statuses == [StatusCode.UNSET, StatusCode.UNSET, StatusCode.ERROR]
    assert lookup.reward({"answer": "Copper"}, "copper") == 1.0 and lookup.reward({"answer": "tin"}, None) == 0.0


def test_rollouts_share_one_client_pool_and_each_sends_its_own_headers() -> None:
    """Concurrent rollouts (the runner's threads) call through one shared client; every request carries
    the headers of the rollout that made it, never another's."""
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from boltstream.examples import endpoint
    from boltstream.examples.calc import agent as calc

    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                seen.append((self.headers["X-Boltstream-Rollout-Id"], body["messages"][-1]["content"]))
            out = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "policy",
                              "choices": [{"index": 0, "finish_reason": "stop",
                                           "message": {"role": "assistant", "content": "ok"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        def rollout(i: int) -> str:
            ctx = SimpleNamespace(base_url=base_url, headers={"X-Boltstream-Rollout-Id": f"r{i}"})
            client = endpoint.client(ctx)
            assert client._client is endpoint.client(ctx)._client  # one httpx pool for every rollout
            return endpoint.reply(client, [{"role": "user", "content": f"r{i}"}], "policy", 1.0, 4)

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(rollout, range(32))) == ["ok"] * 32
    finally:
        server.shutdown()
        server.server_close()
    assert sorted(seen) == sorted((f"r{i}", f"r{i}") for i in range(32))
    assert calc.endpoint is endpoint  # the calculator agent's rollouts share it too
