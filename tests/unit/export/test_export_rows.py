"""Row layouts per kind, on the golden records, and the way back from batch rows to records."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from boltstream.export.rows import KINDS, Position, batch_records, layout, record_field_names
from boltstream.export.writers import STATS_KEY, open_writer, partial_path, read_metadata
from boltstream.schemas import Codec
from tests.unit.schemas.record_examples import EXAMPLES

WHERE = Position(partition=2, offset=17, timestamp_ms=1_700_000_000_000, key=b"task-\xff")


def test_a_span_is_one_row_with_flat_llm_columns() -> None:
    span = EXAMPLES["Span"]
    (row,) = layout("spans").rows(span, WHERE)
    assert row["llm_prompt_token_ids"] == span["llm"]["prompt_token_ids"]
    assert row["llm_response_logprobs"] == span["llm"]["response_logprobs"]
    assert row["llm_policy_version"] == 3 and row["status_code"] == "OK" and row["scope_version"] == "0.1.0"
    assert json.loads(row["attributes"])["gen_ai.response.finish_reasons"] == ["stop"]
    assert json.loads(row["events"][0]["attributes"]) == {"gen_ai.completion": "x = 3", "index": 0}
    assert (row["partition"], row["offset"], row["timestamp_ms"], row["key"]) == (2, 17, 1_700_000_000_000,
                                                                                   "task-\ufffd")
    (row,) = layout("spans").rows({**span, "llm": None}, WHERE)
    assert row["llm_prompt_token_ids"] is None and row["llm_model"] is None


def test_a_trajectory_is_one_row_with_its_turns() -> None:
    (row,) = layout("trajectories").rows(EXAMPLES["Trajectory"], WHERE)
    assert row["turns"] == EXAMPLES["Trajectory"]["turns"] and row["final_reward"] == 1.0


def test_a_batch_is_one_row_per_sample_and_the_rows_give_it_back() -> None:
    batch = EXAMPLES["TrainingBatch"]
    rows = layout("batches").rows(batch, WHERE)
    assert len(rows) == len(batch["samples"]) and [r["sample_index"] for r in rows] == list(range(len(rows)))
    assert all(r["batch_id"] == batch["batch_id"] and r["batch_task_id"] == batch["task_id"] for r in rows)
    assert rows[0]["token_ids"] == batch["samples"][0]["token_ids"]
    two = rows + layout("batches").rows({**batch, "batch_id": "other"}, Position(2, 18, 0, None))
    back = list(batch_records(two, record_field_names("Sample"),
                              [f for f in record_field_names("TrainingBatch") if f != "samples"]))
    assert [(p, o) for p, o, _ in back] == [(2, 17), (2, 18)]
    assert back[0][2] == batch and back[1][2] == {**batch, "batch_id": "other"}


def test_every_layout_matches_its_arrow_schema(tmp_path: Path) -> None:
    records = {"spans": EXAMPLES["Span"], "trajectories": EXAMPLES["Trajectory"],
               "batches": EXAMPLES["TrainingBatch"]}
    for kind in KINDS:
        rows_of = layout(kind)
        path = tmp_path / f"{kind}.parquet"
        writer = open_writer("parquet", path, rows_of.schema, {"boltstream": json.dumps({"kind": kind})},
                             row_group_rows=2, row_group_bytes=1 << 20)
        for i in range(3):
            columns = rows_of.columns()
            rows_of.add(columns, records[kind], Position(0, i, 0, None))
            writer.write(columns)
        assert not path.exists() and partial_path(path).exists(), "written under a temporary name"
        writer.close({"rows": writer.rows})
        rows = pq.read_table(path).to_pylist()
        assert rows == [r for i in range(3) for r in rows_of.rows(records[kind], Position(0, i, 0, None))]
        assert read_metadata(path)[STATS_KEY] == {"rows": len(rows)}
        assert pq.read_metadata(path).num_row_groups == (2 if kind != "batches" else 3)


def test_an_aborted_export_leaves_nothing(tmp_path: Path) -> None:
    rows_of = layout("spans")
    writer = open_writer("jsonl", tmp_path / "x.jsonl", rows_of.schema, {}, row_group_rows=1, row_group_bytes=1)
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unknown kind 'logs'"):
        layout("logs")


def test_decoded_records_with_packed_payloads_give_the_same_rows() -> None:
    """The codec hands back array.array payloads; the export's columns stay plain lists (bools for masks)."""
    codec = Codec()
    for kind, record in (("spans", "Span"), ("trajectories", "Trajectory"), ("batches", "TrainingBatch")):
        decoded = codec.decode(codec.encode(record, EXAMPLES[record]))
        rows_of = layout(kind)
        want, got = rows_of.rows(EXAMPLES[record], WHERE), rows_of.rows(decoded, WHERE)
        assert got == want, kind  # plain lists, not arrays: JSON lines can write them
        columns = rows_of.columns()
        rows_of.add(columns, decoded, WHERE)
        table = pa.table({n: pa.array(v, type=rows_of.schema.field(n).type) for n, v in columns.items()})
        assert table.to_pylist() == want, kind  # Arrow took the arrays as they are
