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
