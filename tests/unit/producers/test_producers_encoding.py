"""The hand-written Span encoder must write exactly what the codec writes; oversized spans are truncated."""

from __future__ import annotations

import copy
import random
import struct
from array import array
from typing import Any

import numpy as np
import pytest

from boltstream.producers.span_encoder import FastSpanEncoder, _long, _varint, sample_record
from boltstream.producers.truncate import TRUNCATED, TRUNCATED_FIELDS, fit
from boltstream.schemas import Codec, InMemorySchemaRegistry

CODEC = Codec()


def _random_value(rng: random.Random) -> Any:
    kind = rng.randrange(9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randrange(-(2**63), 2**63)
    if kind == 3:
        return rng.uniform(-1e6, 1e6)
    if kind == 4:
        return "".join(rng.choice("abcü✓ \n\"") for _ in range(rng.randrange(40)))
    if kind == 5:
        return {"bools": [rng.random() < 0.5 for _ in range(rng.randrange(4))]}
    if kind == 6:
        return {"longs": [rng.randrange(-(2**40), 2**40) for _ in range(rng.randrange(4))]}
    if kind == 7:
        return {"doubles": [rng.random() for _ in range(rng.randrange(4))]}
    return {"strings": [str(rng.random()) for _ in range(rng.randrange(4))]}


def _random_record(rng: random.Random) -> dict[str, Any]:
    rec = sample_record()
    rec["attributes"] = {f"k{i}": _random_value(rng) for i in range(rng.randrange(30))}
    rec["events"] = [{"name": f"e{i}", "time_ns": rng.randrange(2**62), "attributes": {"x": _random_value(rng)}}
                     for i in range(rng.randrange(3))]
    rec["resource"] = {f"r{i}": _random_value(rng) for i in range(rng.randrange(5))}
    rec["parent_span_id"] = None if rng.random() < 0.3 else "ab" * 8
    rec["scope"] = None if rng.random() < 0.3 else {"name": "s", "version": rng.choice([None, "1"])}
    rec["status"] = {"code": "OK", "message": rng.choice([None, "m"])}
    for fld in ("rollout_id", "attempt_id", "task_id"):
        rec[fld] = rng.choice([None, "x", "ü" * 3])
    if rng.random() < 0.3:
        rec["llm"] = None
    else:
        llm = rec["llm"]
        llm["prompt_token_ids"] = [rng.randrange(0, 2**31) for _ in range(rng.randrange(300))]
        llm["response_token_ids"] = [rng.randrange(0, 200_000) for _ in range(rng.randrange(50))]
        llm["response_logprobs"] = [-rng.random() for _ in range(len(llm["response_token_ids"]))]
        llm["temperature"] = rng.choice([None, 0.5])
        llm["seed"] = rng.choice([None, -(2**62)])
        llm["policy_version"] = rng.randrange(-1, 10**12)
    return rec


@pytest.mark.parametrize("codec", [CODEC, Codec(registry=InMemorySchemaRegistry())], ids=["single-object", "confluent"])
def test_fast_encoder_is_byte_identical_to_the_codec(codec: Codec) -> None:
    enc = FastSpanEncoder.create(codec, topic="ns.spans")
    assert enc is not None, "the fast encoder refused the current Span schema: update span_encoder.py"
    rng = random.Random(7)
    for _ in range(300):
        rec = _random_record(rng)
        assert enc.encode(rec) == codec.encode("Span", rec, topic="ns.spans")


def test_fast_encoder_takes_any_int32_buffer_for_token_ids() -> None:
    """A list, an array('i'), a numpy array or packed bytes: the same bytes on the wire, as the codec's."""
    enc = FastSpanEncoder.create(CODEC, topic="ns.spans")
    assert enc is not None
    ids = [1, 2, 150_000]
    want = enc.encode(sample_record())
    for value in (array("i", ids), np.array(ids, dtype=np.int32), np.array(ids), struct.pack("<3i", *ids)):
        rec = sample_record()
        rec["llm"]["prompt_token_ids"] = value
        assert enc.encode(rec) == want == CODEC.encode("Span", rec)


def test_fast_encoder_caches_resource_maps_by_identity() -> None:
    enc = FastSpanEncoder.create(CODEC)
    assert enc is not None
    rec = sample_record()
    first = enc.encode(rec)
    rec["resource"]["service.name"] = "changed"  # same dict object mutated: the cache is by identity
    rec2 = copy.deepcopy(rec)                     # a new dict is re-encoded
    assert enc.encode(rec2) == CODEC.encode("Span", rec2)
    assert first == CODEC.encode("Span", sample_record())


def test_long_fast_path_matches_the_plain_varint() -> None:
    rng = random.Random(5)
    edges = [0, 1, -1, 2**13, 2**14, 2**27 - 1, 2**27, -(2**27), -(2**27) - 1, 2**28, 2**62, 2**63 - 1, -(2**63)]
    stamps = [1_700_000_000_000_000_000 + rng.randrange(10**12) for _ in range(2000)]
    for n in edges + stamps + [rng.randrange(-(2**63), 2**63) for _ in range(2000)]:
        assert _long(n) == _varint(n), n


def test_cached_tails_follow_ids_scope_and_resource() -> None:
    """Spans sharing one resource dict but not their ids or scope must not share cached bytes."""
    enc = FastSpanEncoder.create(CODEC)
    assert enc is not None
    shared = {"service.name": "svc"}
    for i in range(300):
        rec = sample_record()
        rec["resource"] = shared if i % 3 else {"service.name": f"other{i % 2}"}
        rec["rollout_id"], rec["attempt_id"] = f"r{i % 7}", (None if i % 5 == 0 else f"a{i % 4}")
        rec["scope"] = None if i % 11 == 0 else {"name": f"s{i % 2}", "version": None if i % 2 else "1"}
        rec["status"] = {"code": "OK" if i % 2 else "ERROR", "message": None if i % 3 else "m"}
        assert enc.encode(rec) == CODEC.encode("Span", rec), i


def test_fast_encoder_refuses_a_schema_it_does_not_know() -> None:
    class Lying:
        catalog = CODEC.catalog

        def encode(self, record: str, value: Any, topic: str | None = None) -> bytes:
            return b"something else entirely"

    assert FastSpanEncoder.create(Lying()) is None


def _encode(rec: dict[str, Any]) -> bytes:
    return CODEC.encode("Span", rec)


def test_fit_leaves_small_spans_alone() -> None:
    rec = sample_record()
    data, removed = fit(rec, _encode, 100_000)
    assert removed == [] and data == _encode(rec)


def test_fit_drops_big_attributes_and_events_first_then_token_arrays() -> None:
    rec = sample_record()
    rec["attributes"]["input.value"] = "x" * 50_000
    rec["attributes"]["boltstream.rollout_id"] = "keep-me"
    rec["events"].append({"name": "exception", "time_ns": 1, "attributes": {"stack": "y" * 30_000}})
    rec["llm"]["prompt_token_ids"] = list(range(2000))
    original = copy.deepcopy(rec)
    data, removed = fit(rec, _encode, 20_000)
    assert len(data) <= 20_000
    assert rec == original, "fit must not modify the caller's record"
    back = CODEC.decode(data, expect="Span")
    assert back["attributes"][TRUNCATED] is True
    assert "attribute:input.value" in back["attributes"][TRUNCATED_FIELDS]["strings"]
    assert "event:exception" in removed
    assert back["attributes"]["boltstream.rollout_id"] == "keep-me"
    assert back["llm"]["prompt_token_ids"].tolist() == list(range(2000)), "token ids go only if still needed"
    data, removed = fit(rec, _encode, 4_000)  # now the token arrays must go too
    back = CODEC.decode(data, expect="Span")
    assert len(data) <= 4_000 and len(back["llm"]["prompt_token_ids"]) == 0
    assert "llm.prompt_token_ids" in removed and back["span_id"] == rec["span_id"]


def test_fit_last_resort_cuts_long_names() -> None:
    rec = sample_record(empty=True)
    rec["name"] = "n" * 10_000
    rec["attributes"]["boltstream.error"] = "e" * 10_000
    data, removed = fit(rec, _encode, 3_000)
    back = CODEC.decode(data, expect="Span")
    assert len(data) <= 3_000 and len(back["name"]) == 256 and back["attributes"][TRUNCATED] is True
