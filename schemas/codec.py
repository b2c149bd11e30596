"""Encode and decode boltstream records: Avro binary in one of two framings.

* Avro single-object encoding (no registry, the embedded stack):
  ``C3 01`` + 8-byte little-endian CRC-64-AVRO fingerprint of the schema's parsing canonical form
  + Avro binary.
* Confluent wire format (with a schema registry, so Redpanda Console and every Kafka tool can read
  the topics): ``00`` + 4-byte big-endian schema id + Avro binary.

The decoder accepts both framings whichever way the codec was built, and always hands back records
in the shape of the NEWEST schema version of their type (schema evolution): a v1 span read by a
consumer that ships v2 comes back with v2's new fields filled from their defaults.

Token payloads (schemas/packed.py): Span v2, Trajectory/Sample/TrainingBatch v3 carry token ids,
logprobs and loss masks as little-endian ``bytes`` (``prompt_token_ids_i32``, ...). Avro cannot
resolve ``array<int>`` into ``bytes``, so the new versions KEEP the old array fields (default ``[]``)
and ADD the packed ones (default ``""``): plain Avro resolution then reads every old record into the
new shape, and the registry's BACKWARD_TRANSITIVE check accepts the new versions on existing subjects
(changing the fields' type in place would be refused there). The codec hides the two wire fields
behind one logical name: ``encode`` packs ``prompt_token_ids`` (a list, an ``array.array``, a numpy
array or packed bytes) into ``prompt_token_ids_i32`` and writes ``[]`` into the old field; ``decode``
puts an ``array.array`` back under ``prompt_token_ids``, from the packed field when it is non-empty,
else from the old array (a v1/v2 record). One rule, no per-version hooks. The cost: an old consumer
reading new records sees empty arrays, so upgrade consumers before producers (docs/architecture.md).

Pure functions of bytes and dicts plus two caches; no Kafka here. Everything that can go wrong
surfaces as ``SchemaError`` naming the topic and the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from io import BytesIO
from typing import Any

from fastavro import schemaless_reader, schemaless_writer

from .avro_values import explain_invalid, union_tagger
from .errors import SchemaError
from .loader import (
    SchemaCatalog,
    SchemaDir,
    SchemaVersion,
    catalog_for,
    crc64_avro_fingerprint,
    parse_schema_text,
    snake_case,
)
from .packed import has_packed_fields, pack_record, unpack_record
from .registry import HttpSchemaRegistry, SchemaRegistry

logger = logging.getLogger(__name__)

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = 0
_SINGLE_HEADER_LEN = 10  # C3 01 + 8-byte fingerprint
_CONFLUENT_HEADER_LEN = 5  # 00 + 4-byte id
_BYTES_TYPES = (bytes, bytearray, memoryview)


@dataclass(frozen=True, slots=True)
class _Writer:
    """Everything ``encode`` needs for one record type, computed once."""

    version: SchemaVersion
    single_header: bytes
    # Rewrites union values into fastavro's tuple notation before writing (None: nothing to do).
    tag_unions: Callable[[Any], Any] | None
    # Whether the newest version carries packed token payloads (schemas/packed.py).
    packed: bool


@dataclass(frozen=True, slots=True)
class _Reader:
    """How to read one writer schema: its record type, the writer and (if different) the reader."""

    record: str
    writer: dict[str, Any]
    reader: dict[str, Any] | None
    label: str
    packed: bool = False


class Codec:
    """Encodes records to framed Avro bytes and decodes either framing back to dicts.

    Build one per process and share it (thread-safe; caches only grow). With ``registry=None`` it
    writes single-object encoding; with a registry it writes the Confluent wire format, registering
    subject ``<topic>-value`` on first use. ``schema_dirs`` layers extra ``<snake_name>/v<N>.avsc``
    folders over the packaged schemas (tests, or reading data from a newer release). ``catalog``
    replaces the schemas altogether: a ``SchemaCatalog(dirs, include_package=False)`` holding only older
    versions makes a codec that writes what an older release wrote (benchmarks, compatibility tests).
    """

    def __init__(
        self,
        registry: SchemaRegistry | None = None,
        *,
        schema_dirs: Iterable[SchemaDir] = (),
        catalog: SchemaCatalog | None = None,
    ) -> None:
        self.registry = registry
        self.catalog: SchemaCatalog = catalog if catalog is not None else catalog_for(schema_dirs)
        self._names: dict[str, str] = {}
        self._writers: dict[str, _Writer] = {}
        self._by_fingerprint: dict[bytes, _Reader] = {}
        self._by_id: dict[int, _Reader] = {}
        self._confluent_headers: dict[tuple[str, str | None], bytes] = {}
        for record in self.catalog.records:
            latest = self.catalog.latest(record)
            writer = _Writer(
                latest,
                SINGLE_OBJECT_MAGIC + latest.fingerprint,
                union_tagger(latest.parsed),
                has_packed_fields(record, latest.parsed),
            )
            for alias in (record, latest.fullname, snake_case(record)):
                self._names[alias] = record
                self._writers[alias] = writer
        for sv in self.catalog:
            latest = self.catalog.latest(sv.record)
            reader = None if sv.fingerprint == latest.fingerprint else latest.parsed
            self._by_fingerprint[sv.fingerprint] = _Reader(
                sv.record, sv.parsed, reader, f"{sv.record} v{sv.version}", self._writers[sv.record].packed
            )

    @classmethod
    def from_registry_url(
        cls, url: str | None, *, timeout: float = 5.0, schema_dirs: Iterable[SchemaDir] = ()
    ) -> Codec:
        """Confluent framing against the registry at ``url``; single-object encoding when ``url`` is
        None or empty (the embedded stack has no registry)."""
        registry = HttpSchemaRegistry(url, timeout=timeout) if url else None
        return cls(registry=registry, schema_dirs=schema_dirs)

    @property
    def framing(self) -> str:
        """``"confluent"`` or ``"single-object"``: what ``encode`` writes."""
        return "single-object" if self.registry is None else "confluent"

    def __repr__(self) -> str:
        return f"Codec(framing={self.framing!r}, registry={self.registry!r})"

    # ------------------------------------------------------------------ encode

    def encode(self, record: str, value: Mapping[str, Any], topic: str | None = None) -> bytes:
        """Serialise ``value`` as the newest version of ``record`` in this codec's framing.

        Missing fields take their schema defaults; an unknown field, a missing required field or a
        value of the wrong type raises ``SchemaError`` naming the field (fastavro would otherwise drop
        unknown keys silently, and a typo in an optional field would lose data without a trace).
        ``topic`` names the registry subject (``<topic>-value``; the record's full name without one)
        and goes into error messages.
        """
        writer = self._writers.get(record)
        if writer is None:
            raise SchemaError(
                f"cannot encode unknown record type {record!r}; known: {_known(self)}", topic=topic
            )
        header = writer.single_header if self.registry is None else self._confluent_header(writer, topic)
        return self._encode(writer, header, value, topic)

    @staticmethod
    def _encode(writer: _Writer, header: bytes, value: Mapping[str, Any], topic: str | None) -> bytes:
        payload: Any = value
        if writer.packed:
            try:
                payload = pack_record(writer.version.record, value)
            except SchemaError as exc:
                raise SchemaError(f"cannot encode {writer.version.record}: {exc.reason}", topic=topic) from None
        if writer.tag_unions is not None:
            payload = writer.tag_unions(payload)
        buf = BytesIO()
        buf.write(header)
        try:
            schemaless_writer(buf, writer.version.parsed, payload, strict_allow_default=True)
        except Exception as exc:  # fastavro raises TypeError/ValueError/KeyError/OverflowError/...
            raise SchemaError(
                f"cannot encode {writer.version.record}: {explain_invalid(payload, writer.version.parsed, exc)}",
                topic=topic,
            ) from exc
        return buf.getvalue()

    def _confluent_header(self, writer: _Writer, topic: str | None) -> bytes:
        key = (writer.version.record, topic)
        header = self._confluent_headers.get(key)
        if header is not None:
            return header
        assert self.registry is not None
        subject = f"{topic}-value" if topic else writer.version.fullname
        try:
            schema_id = self.registry.register(subject, writer.version.schema_json)
        except SchemaError as exc:
            raise exc.with_topic(topic) from exc.__cause__
        if not 0 <= schema_id <= 0xFFFFFFFF:
            raise SchemaError(
                f"schema registry returned id {schema_id}, which does not fit 4 bytes", topic=topic
            )
        v = writer.version
        self._by_id.setdefault(
            schema_id, _Reader(v.record, v.parsed, None, f"{v.record} (schema id {schema_id})", writer.packed)
        )
        header = bytes((CONFLUENT_MAGIC,)) + schema_id.to_bytes(4, "big")
        self._confluent_headers[key] = header
        return header

    # ------------------------------------------------------------------ decode

    def decode(self, data: bytes, topic: str | None = None, expect: str | None = None) -> dict[str, Any]:
        """Parse framed Avro bytes (either framing) into a dict shaped like the newest schema version.

        ``expect`` (a record name) rejects a record of another type, so a consumer never processes a
        Trajectory that landed on the spans topic. Every failure is a ``SchemaError``.
        """
        # Fast path, the stream app's per-record case: single-object bytes of a known schema.
        if data.__class__ is bytes and data[:2] == SINGLE_OBJECT_MAGIC:
            reader = self._by_fingerprint.get(data[2:_SINGLE_HEADER_LEN])
            if reader is not None and (expect is None or reader.record == self._names.get(expect, expect)):
                return self._read(data, _SINGLE_HEADER_LEN, reader, topic)
        if not isinstance(data, _BYTES_TYPES):
            what = "no value (None: a tombstone?)" if data is None else f"{type(data).__name__}, not bytes"
            raise SchemaError(f"cannot decode {what}", topic=topic)
        size = len(data)
        if size == 0:
            raise SchemaError("empty record (0 bytes)", topic=topic)
        first = data[0]
        if first == 0xC3:
            if size >= 2 and data[1] != 0x01:
                raise SchemaError(
                    f"wrong magic bytes 0xc3 0x{data[1]:02x} (single-object encoding is 0xc3 0x01)",
                    topic=topic,
                )
            if size < _SINGLE_HEADER_LEN:
                raise SchemaError(
                    f"truncated record: {size} bytes, shorter than the 10-byte single-object header",
                    topic=topic,
                )
            fingerprint = bytes(data[2:_SINGLE_HEADER_LEN])
            reader = self._by_fingerprint.get(fingerprint)
            if reader is None:
                raise SchemaError(
                    f"unknown schema fingerprint {fingerprint.hex()} (single-object encoding; "
                    "no schema version on disk has it)",
                    topic=topic,
                )
            offset = _SINGLE_HEADER_LEN
        elif first == CONFLUENT_MAGIC:
            if size < _CONFLUENT_HEADER_LEN:
                raise SchemaError(
                    f"truncated record: {size} bytes, shorter than the 5-byte Confluent header", topic=topic
                )
            schema_id = int.from_bytes(data[1:_CONFLUENT_HEADER_LEN], "big")
            reader = self._by_id.get(schema_id) or self._fetch_writer(schema_id, topic)
            offset = _CONFLUENT_HEADER_LEN
        else:
            raise SchemaError(
                f"wrong magic byte 0x{first:02x} (expected 0x00 for the Confluent wire format "
                "or 0xc3 0x01 for Avro single-object encoding)",
                topic=topic,
            )
        if expect is not None and reader.record != self._names.get(expect, expect):
            raise SchemaError(f"expected a {expect} record, got {reader.record}", topic=topic)
        return self._read(data, offset, reader, topic)

    @staticmethod
    def _read(data: bytes | bytearray | memoryview, offset: int, reader: _Reader, topic: str | None) -> dict[str, Any]:
        size = len(data)
        buf = BytesIO(data)
        buf.seek(offset)
        try:
            result = schemaless_reader(buf, reader.writer, reader.reader)
        except Exception as exc:  # EOFError, struct.error, UnicodeDecodeError, MemoryError, ...
            why = f"{type(exc).__name__}: {exc}"[:300]
            raise SchemaError(
                f"truncated or corrupt {reader.label} record ({size} bytes): {why}", topic=topic
            ) from exc
        if buf.tell() != size:
            raise SchemaError(
                f"corrupt {reader.label} record: {size - buf.tell()} bytes left over after the record",
                topic=topic,
            )
        if reader.packed:
            try:
                unpack_record(reader.record, result)  # type: ignore[arg-type]
            except SchemaError as exc:
                raise SchemaError(f"corrupt {reader.label} record: {exc.reason}", topic=topic) from exc
        return result  # type: ignore[return-value]

    def _fetch_writer(self, schema_id: int, topic: str | None) -> _Reader:
        """Writer schema for a Confluent id from the registry (once per id), resolved against the
        newest local version of the record it names."""
        if self.registry is None:
            raise SchemaError(
                f"unknown schema id {schema_id}: the record uses the Confluent wire format "
                "but this codec has no schema registry configured",
                topic=topic,
            )
        try:
            text = self.registry.get(schema_id)
            _, parsed, fullname, canonical = parse_schema_text(text, source=f"schema id {schema_id}")
        except SchemaError as exc:
            raise exc.with_topic(topic) from exc.__cause__
        record = self.catalog.record_for_fullname(fullname)
        if record is None:
            # Someone else's record type: decode it as written; ``expect`` will still reject it.
            logger.warning("schema id %d is %s, a record type this codec does not know", schema_id, fullname)
            reader = _Reader(fullname, parsed, None, f"{fullname} (schema id {schema_id})")
        else:
            latest = self.catalog.latest(record)
            label, packed = f"{record} (schema id {schema_id})", self._writers[record].packed
            if crc64_avro_fingerprint(canonical) == latest.fingerprint:
                reader = _Reader(record, latest.parsed, None, label, packed)
            else:
                reader = _Reader(record, parsed, latest.parsed, label, packed)
        logger.debug("schema id %d -> %s", schema_id, reader.label)
        self._by_id[schema_id] = reader
        return reader


def _known(codec: Codec) -> str:
    return ", ".join(codec.catalog.records)
