"""Finds, parses and fingerprints every schema version on disk, once.

Layout: ``<dir>/<snake_name>/v<N>.avsc``, one Avro record schema per file, where ``snake_name`` is the
record's name in snake case (``TrainingBatch`` -> ``training_batch``). The package folder is always
the first directory; extra directories (tests, a newer release's schemas) can be layered on top.
Parsing and fingerprinting happen here and only here, so the codec's hot path never parses a schema.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint as _fastavro_fingerprint
from fastavro.schema import to_parsing_canonical_form

from .errors import SchemaError

logger = logging.getLogger(__name__)

#: Every record type boltstream puts on a topic, in the order of the design document.
RECORDS: tuple[str, ...] = (
    "Task",
    "Span",
    "Trajectory",
    "Sample",
    "TrainingBatch",
    "CheckpointEvent",
    "DeadLetter",
    "ReplayDone",
)

_VERSION_FILE = re.compile(r"^v([1-9][0-9]*)\.avsc$")
_CAMEL_BOUNDARY = re.compile(r"(?<!^)(?=[A-Z])")

SchemaDir = Traversable | Path | str


def snake_case(record: str) -> str:
    """``TrainingBatch`` -> ``training_batch``: the folder name a record's versions live in."""
    return _CAMEL_BOUNDARY.sub("_", record).lower()


def crc64_avro_fingerprint(canonical_form: str) -> bytes:
    """CRC-64-AVRO (Rabin) fingerprint of a parsing canonical form, as the 8 little-endian bytes
    that Avro single-object encoding puts after ``C3 01`` (the Avro spec's byte order)."""
    return bytes.fromhex(_fastavro_fingerprint(canonical_form, "CRC-64-AVRO"))


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """One ``v<N>.avsc`` file, parsed once, with everything the codec needs precomputed."""

    record: str
    """Short record name, e.g. ``Span``."""
    version: int
    fullname: str
    """Namespaced name, e.g. ``boltstream.v1.Span``."""
    raw: dict[str, Any] = field(repr=False, compare=False)
    parsed: dict[str, Any] = field(repr=False, compare=False)
    """fastavro's parsed schema (carries its own named types)."""
    canonical_form: str = field(repr=False)
    fingerprint: bytes = field(repr=False)
    """8-byte little-endian CRC-64-AVRO of ``canonical_form``."""
    schema_json: str = field(repr=False, compare=False)
    """Compact JSON with docs and defaults, what gets registered with a schema registry
    (defaults matter to the registry's compatibility checks, so not the canonical form)."""
    source: str = field(default="", compare=False)


def parse_schema_text(text: str, *, source: str) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    """Parse one Avro record schema given as JSON text.

    Returns ``(raw, parsed, fullname, canonical_form)``. Each schema gets its own named-type table so
    two versions of the same record (both defining ``boltstream.v1.Span``) never collide.
    Raises ``SchemaError`` naming ``source`` for invalid JSON or an invalid schema.
    """
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise SchemaError(f"{source} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("type") != "record":
        raise SchemaError(f"{source} is not an Avro record schema (top-level type must be 'record')")
    try:
        parsed = fastavro.parse_schema(raw, named_schemas={})
        canonical = to_parsing_canonical_form(raw)
    except Exception as exc:  # fastavro raises several unrelated types for bad schemas
        raise SchemaError(f"{source} is not a valid Avro schema: {exc}") from exc
    return raw, parsed, parsed["name"], canonical


def _as_traversable(directory: SchemaDir) -> Traversable:
    return Path(directory) if isinstance(directory, str) else directory


def _package_dir() -> Traversable:
    return importlib.resources.files(__package__ or "boltstream.schemas")


class SchemaCatalog:
    """All schema versions found in a list of directories, indexed by record and version.

    Built once per process (see ``default_catalog``) because parsing and fingerprinting every version
    costs milliseconds; lookups afterwards are dict hits. Read-only after construction, so it is safe
    to share between threads.
    """

    def __init__(self, dirs: Sequence[SchemaDir] | None = None, *, include_package: bool = True) -> None:
        roots: list[Traversable] = [_package_dir()] if include_package else []
        roots.extend(_as_traversable(d) for d in dirs or ())
        self._versions: dict[str, dict[int, SchemaVersion]] = {}
        self._by_fullname: dict[str, str] = {}
        self._aliases: dict[str, str] = {}
        for root in roots:
            for sv in self._scan(root):
                self._add(sv)
        for record, versions in self._versions.items():
            for version in sorted(versions):
                sv = versions[version]
                self._by_fullname[sv.fullname] = record
                self._aliases.update({record: record, snake_case(record): record, sv.fullname: record})
        self._latest = {record: versions[max(versions)] for record, versions in self._versions.items()}
        logger.debug(
            "schema catalog: %s",
            ", ".join(f"{r} v{sorted(v)}" for r, v in sorted(self._versions.items())),
        )

    @staticmethod
    def _scan(root: Traversable) -> Iterator[SchemaVersion]:
        if not root.is_dir():
            raise SchemaError(f"schema directory {root} does not exist")
        for folder in sorted(root.iterdir(), key=lambda t: t.name):
            if not folder.is_dir() or folder.name.startswith(("_", ".")):
                continue
            for file in sorted(folder.iterdir(), key=lambda t: t.name):
                match = _VERSION_FILE.match(file.name)
                if match is None or not file.is_file():
                    continue
                source = f"{folder.name}/{file.name} in {root}"
                raw, parsed, fullname, canonical = parse_schema_text(file.read_text("utf-8"), source=source)
                record = fullname.rsplit(".", 1)[-1]
                if snake_case(record) != folder.name:
                    raise SchemaError(
                        f"{source} defines record {record!r}; it belongs in folder {snake_case(record)!r}"
                    )
                yield SchemaVersion(
                    record=record,
                    version=int(match.group(1)),
                    fullname=fullname,
                    raw=raw,
                    parsed=parsed,
                    canonical_form=canonical,
                    fingerprint=crc64_avro_fingerprint(canonical),
                    schema_json=json.dumps(raw, separators=(",", ":"), ensure_ascii=False),
                    source=source,
                )

    def _add(self, sv: SchemaVersion) -> None:
        versions = self._versions.setdefault(sv.record, {})
        existing = versions.get(sv.version)
        if existing is not None and existing.raw != sv.raw:
            raise SchemaError(
                f"{sv.record} v{sv.version} is defined twice with different content: "
                f"{existing.source} and {sv.source}"
            )
        if existing is None:
            versions[sv.version] = sv

    @property
    def records(self) -> tuple[str, ...]:
        """Record names found on disk, sorted."""
        return tuple(sorted(self._versions))

    def resolve_name(self, name: str) -> str:
        """Accept ``Span``, ``span`` or ``boltstream.v1.Span``; return ``Span`` or raise ``SchemaError``."""
        try:
            return self._aliases[name]
        except KeyError:
            raise SchemaError(f"unknown record type {name!r}; known: {', '.join(self.records)}") from None

    def versions(self, name: str) -> tuple[SchemaVersion, ...]:
        """Every version of a record on disk, oldest first."""
        versions = self._versions[self.resolve_name(name)]
        return tuple(versions[v] for v in sorted(versions))

    def get(self, name: str, version: int | None = None) -> SchemaVersion:
        """One version of a record; the newest when ``version`` is None."""
        record = self.resolve_name(name)
        if version is None:
            return self._latest[record]
        try:
            return self._versions[record][version]
        except KeyError:
            known = ", ".join(f"v{v}" for v in sorted(self._versions[record]))
            raise SchemaError(f"{record} has no schema version {version}; known: {known}") from None

    def latest(self, name: str) -> SchemaVersion:
        """The newest version: what the codec writes with and reads into."""
        return self.get(name)

    def record_for_fullname(self, fullname: str) -> str | None:
        """``boltstream.v1.Span`` -> ``Span``; None for a record this catalog does not know."""
        return self._by_fullname.get(fullname)

    def __iter__(self) -> Iterator[SchemaVersion]:
        for record in self.records:
            yield from self.versions(record)


@functools.cache
def default_catalog() -> SchemaCatalog:
    """The package's own schemas, loaded on first use and shared by every codec in the process."""
    return SchemaCatalog()


def catalog_for(extra_dirs: Iterable[SchemaDir] = ()) -> SchemaCatalog:
    """The shared default catalog, or a new one layering ``extra_dirs`` over the package schemas."""
    extra = tuple(extra_dirs)
    return SchemaCatalog(extra) if extra else default_catalog()


def load_schema(name: str, version: int | None = None) -> dict[str, Any]:
    """Parsed fastavro schema of a record (newest version by default), parsed once per process."""
    return default_catalog().get(name, version).parsed
