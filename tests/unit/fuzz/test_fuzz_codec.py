"""Fuzz the Avro decoder: any bytes, and damaged valid records of every type, either decode or raise
``SchemaError`` (what consumers dead-letter), never another exception, never a hang."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from boltstream.schemas import Codec, InMemorySchemaRegistry, SchemaError
from tests.unit.fuzz.fuzzing import fuzz_settings, mutated
from tests.unit.schemas.record_examples import EXAMPLES

SLOW_S = 2.0  # CPU seconds of this thread (a stalled, loaded machine does not count): a pathological loop
CODEC = Codec()
CONFLUENT = Codec(registry=InMemorySchemaRegistry())
SEEDS = [CODEC.encode(name, value, topic="t") for name, value in EXAMPLES.items()] + [
    CONFLUENT.encode(name, value, topic="t") for name, value in EXAMPLES.items()]
HEADERS = [s[:10] for s in SEEDS if s[:1] == b"\xc3"] + [s[:5] for s in SEEDS if s[:1] == b"\x00"]


def _decode_or_schema_error(codec: Codec, data: bytes, expect: str | None = None) -> None:
    t0 = time.thread_time()
    try:
        record = codec.decode(data, topic="fuzz", expect=expect)
    except SchemaError as exc:
        assert str(exc).startswith("topic 'fuzz': "), exc
    else:
        assert isinstance(record, dict)
    assert time.thread_time() - t0 < SLOW_S, f"decoding {len(data)} bytes took {time.thread_time() - t0:.1f}s"


@fuzz_settings()
@given(st.binary(max_size=4096))
def test_arbitrary_bytes(data: bytes) -> None:
    _decode_or_schema_error(CODEC, data)


@fuzz_settings()
@given(st.sampled_from(HEADERS), st.binary(max_size=2048))
def test_valid_header_random_body(header: bytes, body: bytes) -> None:
    """Past the framing: the Avro reader itself gets garbage with a schema it knows."""
    _decode_or_schema_error(CONFLUENT if header[:1] == b"\x00" else CODEC, header + body)


@fuzz_settings()
@given(mutated(SEEDS), st.sampled_from([None, *EXAMPLES]))
def test_mutated_valid_records(data: bytes, expect: str | None) -> None:
    _decode_or_schema_error(CONFLUENT if data[:1] == b"\x00" else CODEC, data, expect)


_DEAD_LETTER = CODEC.encode("DeadLetter", EXAMPLES["DeadLetter"], topic="t")


@pytest.mark.parametrize("data", [
    # The first string's length rewritten to 2^62-1 and to a negative length.
    _DEAD_LETTER[:10] + b"\xfe\xff\xff\xff\xff\xff\xff\xff\x7f" + _DEAD_LETTER[11:],
    _DEAD_LETTER[:10] + b"\x10" + _DEAD_LETTER[11:],
    b"\x00\xff\xff\xff\xff",  # an unknown Confluent id, no registry
])
def test_known_nasty_inputs(data: bytes) -> None:
    with pytest.raises(SchemaError, match="topic 'fuzz': (truncated or corrupt|unknown schema id)"):
        CODEC.decode(data, topic="fuzz")
