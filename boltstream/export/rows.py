"""What one exported row is, per kind, and the way back from batch rows to TrainingBatch records.

* ``spans``: one row per span. Nested records (``status``, ``scope``, ``llm``)
  are flattened one level into ``<field>_<sub>`` columns, so the token ids are
  plain list columns (``llm_prompt_token_ids``, ``llm_response_token_ids``,
  ``llm_response_logprobs``); maps (``attributes``, ``resource``, each event's
  attributes) are JSON strings.
* ``trajectories``: one row per trajectory (one finished rollout attempt), its
  ``turns`` a list of structs in call order: a row is the unit that has a
  reward, and a per-turn table is one ``explode`` away in pandas.
* ``batches``: one row per sample: the Sample's own fields, its position
  ``sample_index`` in the record, and the record's fields as ``batch_*``
  columns (``batch_id`` as is), so a row says which GRPO group, and which part
  of it, the sample came in.

Every row ends with where its record sits in the log: ``partition``,
``offset``, ``timestamp_ms`` (the record's broker timestamp) and ``key``.
:func:`batch_records` inverts the batches layout exactly (a record's rows are
written together, in order), which is how ``learn --offline`` trains from an
exported file with the same grouping as online.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from boltstream.schemas import default_catalog
from boltstream.schemas.packed import wire_fields

from .columns import Column, Names, nested_record, record_fields

# kind (the topic's short name) -> the record type its topic holds
KINDS: dict[str, str] = {"spans": "Span", "trajectories": "Trajectory", "batches": "TrainingBatch"}
META_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("partition", pa.int32()), ("offset", pa.int64()), ("timestamp_ms", pa.int64()), ("key", pa.string()))
BATCH_PREFIX = "batch_"
SAMPLE_INDEX = "sample_index"

Row = dict[str, Any]
Getter = Callable[[Mapping[str, Any]], Any]


@dataclass(frozen=True)
class Position:
    """Where a record sits in the log."""

    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None

    def columns(self) -> Row:
        key = None if self.key is None else self.key.decode("utf-8", "replace")
        return {"partition": self.partition, "offset": self.offset, "timestamp_ms": self.timestamp_ms, "key": key}


Columns = dict[str, list[Any]]


@dataclass(frozen=True)
class Layout:
    """The rows of one kind: their Arrow schema and how a decoded record becomes rows.

    Rows are built column by column (:meth:`add`): one list per column, extended per record,
    is what Arrow converts fastest, and it never makes a dict per row.
    """

    kind: str
    record: str
    schema: pa.Schema
    getters: tuple[tuple[str, Getter], ...]
    samples: tuple[tuple[str, Getter], ...] = ()  # batches: the per-sample columns

    def columns(self) -> Columns:
        """Empty column lists, in schema order."""
        return {name: [] for name in self.schema.names}

    def add(self, columns: Columns, record: Mapping[str, Any], position: Position) -> int:
        """Append ``record``'s rows to ``columns``; returns how many rows it made."""
        meta = position.columns()
        if not self.samples:
            for name, get in self.getters:
                columns[name].append(get(record))
            for name, value in meta.items():
                columns[name].append(value)
            return 1
        samples = record["samples"]
        n = len(samples)
        for name, get in self.samples:
            columns[name].extend([get(s) for s in samples])
        columns[SAMPLE_INDEX].extend(range(n))
        for name, get in self.getters:
            columns[name].extend([get(record)] * n)
        for name, value in meta.items():
            columns[name].extend([value] * n)
        return n

    def rows(self, record: Mapping[str, Any], position: Position) -> list[Row]:
        """``record``'s rows as dicts (tests, JSON lines)."""
        columns = self.columns()
        self.add(columns, record, position)
        return to_rows(columns)


def to_rows(columns: Columns) -> list[Row]:
    names = list(columns)
    return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def batch_column(field: str) -> str:
    """The column of a TrainingBatch field in a batches export (``batch_id`` keeps its name)."""
    return field if field.startswith(BATCH_PREFIX) else BATCH_PREFIX + field


def _getter(name: str, col: Column) -> Getter:
    conv = col.convert
    if conv is None:
        return lambda r: r.get(name)
    return lambda r: conv(r.get(name))


def _nested_getter(name: str, sub: str, col: Column) -> Getter:
    conv = col.convert or (lambda v: v)

    def get(r: Mapping[str, Any]) -> Any:
        inner = r.get(name)
        return None if inner is None else conv(inner.get(sub))

    return get


def _flat(schema: Mapping[str, Any]) -> list[tuple[str, pa.DataType, Getter]]:
    """Top-level fields, records among them flattened one level into ``<field>_<sub>``."""
    names = Names()
    out: list[tuple[str, pa.DataType, Getter]] = []
    for name, avro_type, col in record_fields(schema, names):
        inner = nested_record(avro_type, names)
        if inner is None:
            out.append((name, col.type, _getter(name, col)))
            continue
        for sub, _, sub_col in record_fields(inner, names):
            out.append((f"{name}_{sub}", sub_col.type, _nested_getter(name, sub, sub_col)))
    return out


def layout(kind: str) -> Layout:
    """The row layout of ``kind`` (spans | trajectories | batches), from the newest schema version."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    record = KINDS[kind]
    schema = default_catalog().latest(record).raw
    fields: list[tuple[str, pa.DataType]] = []
    if kind != "batches":
        flat = _flat(schema)
        getters = tuple((name, get) for name, _, get in flat)
        fields = [(name, typ) for name, typ, _ in flat]
        samples: tuple[tuple[str, Getter], ...] = ()
    else:
        names = Names()
        top = record_fields(schema, names)
        sample_schema = next(t["items"] for name, t, _ in top if name == "samples")
        per_sample = [(name, col.type, _getter(name, col)) for name, _, col in record_fields(sample_schema, names)]
        per_batch = [(batch_column(name), col.type, _getter(name, col)) for name, _, col in top if name != "samples"]
        samples = tuple((name, get) for name, _, get in per_sample)
        getters = tuple((name, get) for name, _, get in per_batch)
        fields = [(name, typ) for name, typ, _ in per_sample] + [(SAMPLE_INDEX, pa.int32())]
        fields += [(name, typ) for name, typ, _ in per_batch]
    fields += list(META_COLUMNS)
    names_seen = [name for name, _ in fields]
    clash = {n for n in names_seen if names_seen.count(n) > 1}
    if clash:  # a schema change that would make two columns one: fail loudly, never overwrite
        raise ValueError(f"{kind}: column names {sorted(clash)} appear twice")
    return Layout(kind, record, pa.schema(fields), getters, samples)


# --------------------------------------------------------------------------- the way back


BATCH_REQUIRED = ("sample_id", "token_ids", "loss_mask", "behaviour_logprobs", "prompt_length", "advantage",
                  "batch_id", "batch_part", "batch_num_parts", "partition", "offset")


def batch_records(rows: Iterable[Mapping[str, Any]], sample_fields: Iterable[str],
                  batch_fields: Iterable[str]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(partition, offset, TrainingBatch dict) from batches rows, one per run of rows of one record.

    ``sample_fields`` / ``batch_fields`` name the record fields to rebuild (those the file has);
    a record's rows must be consecutive, as the export writes them.
    """
    sample_fields, batch_fields = tuple(sample_fields), tuple(batch_fields)
    current: tuple[int, int] | None = None
    record: dict[str, Any] = {}
    for row in rows:
        where = (int(row["partition"]), int(row["offset"]))
        if where != current:
            if current is not None:
                yield (*current, record)
            current = where
            record = {name: row[batch_column(name)] for name in batch_fields}
            record["samples"] = []
        record["samples"].append({name: row[name] for name in sample_fields})
    if current is not None:
        yield (*current, record)


def record_field_names(record: str) -> tuple[str, ...]:
    """Top-level field names of the newest version of ``record`` (``Sample``, ``TrainingBatch``), as
    the decoded dicts have them (no packed wire fields)."""
    names = [f["name"] for f in default_catalog().latest(record).raw["fields"]]
    wire = wire_fields(names)
    return tuple(n for n in names if n not in wire)
