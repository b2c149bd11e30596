"""Exported batches read back as the offline learner reads them: records in file order, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from boltstream.export.batches import BatchesFileError, check_batches_file, read_batches
from boltstream.export.rows import Position, layout
from boltstream.export.writers import open_writer
from tests.unit.schemas.record_examples import EXAMPLES


def export(path: Path, records: list[dict], kind: str = "batches") -> Path:
    rows_of = layout(kind)
    writer = open_writer("parquet", path, rows_of.schema, {"boltstream": json.dumps({"kind": kind})},
                         row_group_rows=2, row_group_bytes=1 << 20)
    for offset, record in enumerate(records):
        columns = rows_of.columns()
        rows_of.add(columns, record, Position(0, offset, 0, None))
        writer.write(columns)
    writer.close({})
    return path


def test_records_come_back_in_file_order_from_any_record_on(tmp_path: Path) -> None:
    batch = EXAMPLES["TrainingBatch"]
    records = [{**batch, "batch_id": f"b{i}"} for i in range(3)]
    path = export(tmp_path / "b.parquet", records)
    assert check_batches_file(path) == 3 * len(batch["samples"])  # one row per sample
    assert list(read_batches(path)) == list(enumerate(records))
    assert list(read_batches(path, skip=2)) == [(2, records[2])]


def test_what_is_not_a_batches_export_is_refused_saying_why(tmp_path: Path) -> None:
    (tmp_path / "notes.parquet").write_text("hello")
    with pytest.raises(BatchesFileError, match="notes.parquet is not a readable Parquet file"):
        check_batches_file(tmp_path / "notes.parquet")
    spans = export(tmp_path / "s.parquet", [EXAMPLES["Span"]], kind="spans")
    with pytest.raises(BatchesFileError, match="is an export of spans, not batches"):
        check_batches_file(spans)
    pq.write_table(pa.table({"sample_id": ["a"], "token_ids": [[1, 2]]}), tmp_path / "bare.parquet")
    with pytest.raises(BatchesFileError, match="lacks the columns loss_mask, behaviour_logprobs"):
        check_batches_file(tmp_path / "bare.parquet")
