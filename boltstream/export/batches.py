"""Exported batches files read back: what ``boltstream learn --offline`` trains on.

The offline learner needs two things of an export and none of its layout: whether a
file is a batches export it can train on (:func:`check_batches_file`), and the file's
TrainingBatch records in file order (:func:`read_batches`). Both live here, next to the
row layout (:mod:`.rows`) and the file metadata (:mod:`.writers`) they depend on, so a
change to how batches are exported changes one package.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pyarrow.parquet as pq

from boltstream.errors import BoltstreamError

from .rows import BATCH_REQUIRED, batch_column, batch_records, record_field_names
from .writers import METADATA_KEY, read_metadata

ROWS_PER_READ = 1024  # Parquet rows decoded at a time: a few MiB of samples, whatever the file's size


class BatchesFileError(BoltstreamError):
    """A file is not an exported batches file; the message names the file and what is wrong."""


def check_batches_file(path: str | os.PathLike[str]) -> int:
    """Rows of an exported batches file (``boltstream export batches``).

    Raises :class:`BatchesFileError` for a file that is not Parquet, an export of another
    kind, or one without the columns a TrainingBatch needs. A Parquet file without the
    export's metadata is accepted when it has those columns.
    """
    try:
        parquet = pq.ParquetFile(path)
        rows, columns = parquet.metadata.num_rows, set(parquet.schema_arrow.names)
        about = read_metadata(path).get(METADATA_KEY)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not Parquet
        raise BatchesFileError(f"{path} is not a readable Parquet file ({exc})") from exc
    if about is not None and about.get("kind") != "batches":
        raise BatchesFileError(f"{path} is an export of {about.get('kind')}, not batches "
                               "(boltstream export batches ...)")
    missing = [c for c in BATCH_REQUIRED if c not in columns]
    if missing:
        raise BatchesFileError(f"{path} lacks the columns {', '.join(missing)} of an exported batches file")
    return rows


def read_batches(path: str | os.PathLike[str], skip: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """(record index, TrainingBatch) of an exported batches file, in file order, from record ``skip`` on.

    The export writes one row per sample; a record's rows are regrouped into the
    TrainingBatch they came from, with the fields the file has. Rows are read
    :data:`ROWS_PER_READ` at a time, so memory does not grow with the file.
    """
    parquet = pq.ParquetFile(path)
    columns = set(parquet.schema_arrow.names)
    sample_fields = [f for f in record_field_names("Sample") if f in columns]
    batch_fields = [f for f in record_field_names("TrainingBatch") if f != "samples" and batch_column(f) in columns]
    wanted = [*sample_fields, *(batch_column(f) for f in batch_fields), "partition", "offset"]
    rows = (row for batch in parquet.iter_batches(batch_size=ROWS_PER_READ, columns=wanted)
            for row in batch.to_pylist())
    for index, (_, _, record) in enumerate(batch_records(rows, sample_fields, batch_fields)):
        if index >= skip:
            yield index, record
