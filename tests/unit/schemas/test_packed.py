"""Packing token payloads: hand-written little-endian bytes for every accepted input, and the errors."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from boltstream.schemas import SchemaError
from boltstream.schemas.packed import (
    F32,
    I32,
    U8,
    as_array,
    as_lists,
    pack,
    pack_record,
    unpack,
    unpack_record,
)

IDS_BYTES = b"\x01\x00\x00\x00" + b"\xff\xff\xff\xff" + b"\x00\x01\x00\x00"  # 1, -1, 256
HALF_BYTES = b"\x00\x00\x00\xbf" + b"\x00\x00\x80\x3f"  # -0.5, 1.0 (IEEE 754 single, little-endian)


@pytest.mark.parametrize(
    "value",
    [[1, -1, 256], (1, -1, 256), array("i", [1, -1, 256]), np.array([1, -1, 256], dtype=np.int32),
     np.array([1, -1, 256], dtype=np.int64), IDS_BYTES, bytearray(IDS_BYTES), range(-1, 2)],
    ids=["list", "tuple", "array", "np-int32", "np-int64", "bytes", "bytearray", "iterable"],
)
def test_pack_int32_from_every_accepted_input(value: object) -> None:
    want = IDS_BYTES if not isinstance(value, range) else b"\xff\xff\xff\xff" + b"\x00" * 4 + b"\x01\x00\x00\x00"
    assert pack(value, I32) == want


def test_pack_float32_and_mask() -> None:
    assert pack([-0.5, 1.0], F32) == HALF_BYTES
    assert pack(np.array([-0.5, 1.0], dtype=np.float32), F32) == HALF_BYTES
    assert pack(array("f", [-0.5, 1]), F32) == HALF_BYTES
    assert pack([True, False, 1], U8) == b"\x01\x00\x01"
    assert pack(np.array([True, False]), U8) == b"\x01\x00"
    assert pack([], I32) == b""


def test_unpack_hand_written_bytes() -> None:
    ids = unpack(IDS_BYTES, I32)
    assert ids == array("i", [1, -1, 256]) and ids.typecode == "i"
    assert unpack(HALF_BYTES, F32).tolist() == [-0.5, 1.0]
    assert unpack(b"\x00\x01", U8).tolist() == [0, 1]
    assert unpack(b"", I32) == array("i")
    # An array is what the learner wraps without a copy.
    assert np.frombuffer(ids, dtype="<i4").tolist() == [1, -1, 256]


@pytest.mark.parametrize(
    ("value", "kind", "match"),
    [
        ([2**31], I32, "field f: cannot pack as i32"),
        ([1, "two"], I32, "cannot pack as i32"),
        ([1.5], I32, "cannot pack as i32"),
        ([1e39], F32, "cannot pack as f32"),
        (b"\x00\x00\x00", I32, "3 bytes is not a whole number of i32 items"),
        (np.zeros((2, 2), dtype=np.int32), I32, "1-d buffer"),
        (object(), I32, "cannot pack object as i32"),
    ],
)
def test_pack_errors_name_the_field(value: object, kind: str, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        pack(value, kind, "f")


def test_unpack_rejects_a_partial_item() -> None:
    with pytest.raises(SchemaError, match="token_ids: 5 bytes"):
        unpack(b"\x00" * 5, I32, "token_ids")


def test_as_array_keeps_arrays_and_converts_lists() -> None:
    ids = array("i", [1, 2])
    assert as_array(ids, I32) is ids
    assert as_array([1, 2], I32) == ids
    assert as_array(np.array([0.25]), F32) == array("f", [0.25])


def test_pack_record_and_unpack_record_round_trip_without_touching_the_input() -> None:
    span = {"llm": {"prompt_token_ids": [1, -1, 256], "response_token_ids": (7,), "response_logprobs": [-0.5, 1.0]}}
    packed = pack_record("Span", span)
    assert span["llm"]["prompt_token_ids"] == [1, -1, 256]  # the caller's dict is unchanged
    assert packed["llm"] == {
        "prompt_token_ids": [], "prompt_token_ids_i32": IDS_BYTES,
        "response_token_ids": [], "response_token_ids_i32": b"\x07\x00\x00\x00",
        "response_logprobs": [], "response_logprobs_f32": HALF_BYTES,
    }
    assert as_lists(unpack_record("Span", packed)) == {
        "llm": {"prompt_token_ids": [1, -1, 256], "response_token_ids": [7], "response_logprobs": [-0.5, 1.0]}
    }
    assert pack_record("Span", {"llm": None}) == {"llm": None}
    assert pack_record("Task", {"task_id": "t"}) == {"task_id": "t"}


def test_unpack_record_reads_the_legacy_arrays_of_an_old_record() -> None:
    old = {"samples": [{"token_ids": [5, 6], "loss_mask": [False, True], "behaviour_logprobs": [0.0, -0.5],
                        "token_ids_i32": b"", "loss_mask_u8": b"", "behaviour_logprobs_f32": b""}]}
    sample = unpack_record("TrainingBatch", old)["samples"][0]
    assert sample == {"token_ids": array("i", [5, 6]), "loss_mask": array("B", [0, 1]),
                      "behaviour_logprobs": array("f", [0.0, -0.5])}
