"""A hand-written Avro binary reader for the ``Span`` record: the stream worker's hot path.

Why not just fastavro: ``schemaless_reader`` interprets the schema for every value it reads, about
34 µs for a small span of ~330 bytes, 17 % of the stream worker's CPU on small spans. Reading the
known layout with a function generated once from the schema costs less.

The mirror of :mod:`boltstream.producers.span_encoder`, with the same safety: the reader is compiled
from the schema the codec actually uses (schemas/avro_compiled.py), the packed token payloads are
unpacked as the codec unpacks them (schemas/packed.py), and on construction both sample spans of the
encoder are read both ways; unless the results are equal, :meth:`FastSpanDecoder.create` returns
``None`` and the codec keeps fastavro. Only single-object records written with the newest Span schema
come here (the codec's fingerprint fast path); older writers need schema resolution and stay with
fastavro, as does the Confluent framing.

Bad bytes raise ``SchemaError`` wherever fastavro would fail (the stream app dead-letters them), and
nowhere else: the readers read odd bytes as fastavro's C reader does (see schemas/avro_readers.py).
"""

from __future__ import annotations

import logging
import math
from array import array
from typing import Any

from .avro_compiled import compile_record
from .avro_readers import Corrupt
from .errors import SchemaError
from .packed import has_packed_fields, unpack_record
from .span_sample import sample_record

log = logging.getLogger(__name__)


class FastSpanDecoder:
    """``decode(data, offset) -> dict``: exactly what ``Codec.decode(data, expect="Span")`` returns for
    a record written with the schema this decoder was built from."""

    def __init__(self, schema: dict[str, Any], label: str, packed: bool) -> None:
        self._read = compile_record(schema)
        self.label = label
        self._packed = packed

    @classmethod
    def create(cls, codec: Any) -> FastSpanDecoder | None:
        """A decoder for the newest Span schema of ``codec``, verified against fastavro; None (keep
        fastavro) if the schema has a shape this module does not read or any result differs."""

        try:
            latest = codec.catalog.latest("Span")
            dec = cls(latest.raw, f"Span v{latest.version}", has_packed_fields("Span", latest.parsed))
            for sample in (sample_record(), sample_record(empty=True)):
                data, offset, reference = codec.reference_roundtrip("Span", sample)
                if not same(dec.decode(data, offset), reference):
                    log.warning("fast Span decoder disagrees with fastavro; using fastavro (slower)")
                    return None
            return dec
        except Exception as exc:  # a schema we do not know how to read: never fatal
            log.warning("fast Span decoder unavailable (%s); using fastavro (slower)", exc)
            return None

    def decode(self, data: bytes, offset: int) -> dict[str, Any]:
        """The record whose Avro body starts at ``offset``; ``SchemaError`` (without a topic) where
        fastavro would fail, with the codec's wording."""
        try:
            record, pos = self._read(data, offset)
        except IndexError:
            reason = f"ran past the end of the record ({len(data)} bytes)"
        except Corrupt as exc:
            reason = str(exc)
        except Exception as exc:  # UnicodeDecodeError, struct.error: whatever the bytes provoke
            reason = f"{type(exc).__name__}: {exc}"[:300]
        else:
            if pos > len(data):
                raise SchemaError(f"truncated {self.label} record: {len(data)} bytes, {pos} read")
            if pos != len(data):
                raise SchemaError(f"corrupt {self.label} record: {len(data) - pos} bytes left over after the record")
            if self._packed:  # as Codec._read does
                try:
                    unpack_record("Span", record)
                except SchemaError as exc:
                    raise SchemaError(f"corrupt {self.label} record: {exc.reason}") from None
            return record
        raise SchemaError(f"truncated or corrupt {self.label} record ({len(data)} bytes): {reason}")


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types, NaN equal to NaN (a decoded record compared with fastavro's)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, array):  # array.array: compared as bytes, so NaN payloads count too
        return a.typecode == b.typecode and a.tobytes() == b.tobytes()
    return a == b
