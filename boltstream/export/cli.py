"""``boltstream export spans|trajectories|batches --out PATH``: a range of a topic as Parquet or JSON lines.

The log is the dataset; this is how it leaves boltstream (SFT, DPO, analysis
elsewhere). ``--from`` / ``--to`` take the positions every range command
takes (:mod:`boltstream.broker.log_range`: earliest, now, an ISO time, partition:offset).
``--namespace`` picks whose topics: the live pipeline's (the default) or a
replay's. Partitions are read one after the other, each in offset order, by
assignment (no consumer group, nothing committed), so rows come out in
(partition, offset) order, the same file for the same range, in memory bounded
by one row group whatever the range's length. A record that cannot be decoded
is counted, logged and skipped; the count is printed and kept in the file's
metadata. Row layouts: :mod:`boltstream.export.rows`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from boltstream import __version__
from boltstream.broker.log_range import LogRange, parse_position, read_range, resolve
from boltstream.config import Settings, flags_from_dataclass, load, opt
from boltstream.errors import BoltstreamError, ConfigError
from boltstream.schemas import Codec, default_catalog

from .rows import KINDS, Position, layout
from .writers import AVRO_SCHEMA_KEY, FORMATS, METADATA_KEY, open_writer

log = logging.getLogger(__name__)

MAX_LOGGED_UNDECODABLE = 10  # one warning line each; the rest are counted
# Rows go to Arrow after this many bytes of records: 1,000 training batches of 4 x 275 tokens held as
# Python lists took ~100 MiB before they became Arrow (batches export peak 290 MiB; 1 MiB chunks: see
# docs/replay.md).
ARROW_EVERY_BYTES = 1 << 20


class ExportError(BoltstreamError):
    """The export cannot be written where asked."""


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What ``boltstream export`` reads and writes (``boltstream export --help``)."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_EXPORT_"

    settings: Settings = dataclasses.field(default_factory=Settings)
    kind: str = opt("batches", cli=False)
    out: str = opt("", cli=False)
    start: str = opt("earliest", cli=False)  # --from
    end: str = opt("now", cli=False)  # --to
    format: str = opt("parquet", "file format", choices=FORMATS)
    overwrite: bool = opt(False, "replace an existing file at --out")
    row_group_rows: int = opt(50_000, "Parquet: most rows in one row group")
    # What the export holds in memory is about one row group: 32 MiB keeps a long export's peak low and
    # is well inside the row-group sizes readers handle best.
    row_group_bytes: int = opt(32 * 1024 * 1024, "Parquet: a row group is written once this many bytes are held")
    fetch_records: int = opt(1000, "records per fetch from the broker")

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("kind", self.kind, f"one of {', '.join(KINDS)}")
        if self.format not in FORMATS:
            raise ConfigError("format", self.format, f"one of {', '.join(FORMATS)}")
        if not self.out:
            raise ConfigError("out", self.out, "an output path is required (--out)")
        for name in ("row_group_rows", "row_group_bytes", "fetch_records"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1")

    @property
    def topic(self) -> str:
        return self.settings.topic(self.kind)


@dataclasses.dataclass
class ExportResult:
    path: Path
    topic: str
    records: int = 0
    rows: int = 0
    undecodable: int = 0
    seconds: float = 0.0

    def stats(self) -> dict[str, Any]:
        return {"records": self.records, "rows": self.rows, "undecodable": self.undecodable}


def check_output(cfg: ExportConfig) -> Path:
    """The output path, refused before the broker is asked anything when it cannot be written."""
    path = Path(cfg.out)
    if path.is_dir():
        raise ExportError(f"--out {cfg.out}: is a directory; give a file path, e.g. {path / (cfg.kind + '.' + cfg.format)}")
    if path.exists() and not cfg.overwrite:
        raise ExportError(f"--out {cfg.out}: the file exists (pass --overwrite to replace it)")
    if not path.parent.is_dir():
        raise ExportError(f"--out {cfg.out}: the folder {path.parent} does not exist")
    return path


def file_metadata(cfg: ExportConfig, log_range: LogRange) -> dict[str, str]:
    """What a reader needs to know where the rows came from and how to read them (JSON strings)."""
    schema = default_catalog().latest(KINDS[cfg.kind])
    about = {"kind": cfg.kind, "record": schema.record, "schema_version": schema.version,
             "namespace": cfg.settings.namespace, "topic": cfg.topic, "format": cfg.format,
             "range": log_range.describe(), "boltstream_version": __version__,
             "layout": "one row per sample" if cfg.kind == "batches" else f"one row per {schema.record}"}
    return {METADATA_KEY: json.dumps(about), AVRO_SCHEMA_KEY: schema.schema_json}


async def export(cfg: ExportConfig) -> ExportResult:
    """Write the range to ``cfg.out``; the file appears complete or not at all."""
    path = check_output(cfg)
    settings, topic = cfg.settings, cfg.topic
    log_range = await resolve(settings, topic, parse_position(cfg.start, "--from"), parse_position(cfg.end, "--to"))
    rows_of = layout(cfg.kind)
    codec = Codec.from_registry_url(settings.schema_registry_url)
    result = ExportResult(path, topic)
    writer = open_writer(cfg.format, path, rows_of.schema, file_metadata(cfg, log_range),
                         row_group_rows=cfg.row_group_rows, row_group_bytes=cfg.row_group_bytes)
    started = last_log = time.monotonic()
    try:
        for part in log_range.partitions:  # one partition at a time: (partition, offset) order, one buffer
            if not part.size:
                continue
            one = dataclasses.replace(log_range, partitions=(part,))
            async for fetched in read_range(settings, one, max_records=cfg.fetch_records):
                columns, held = rows_of.columns(), 0
                for record in fetched:
                    result.records += 1
                    try:
                        value = codec.decode(record.value, topic=topic, expect=rows_of.record)
                    except Exception as exc:  # any undecodable record is counted and skipped, never fatal
                        result.undecodable += 1
                        if result.undecodable <= MAX_LOGGED_UNDECODABLE:
                            log.warning("skipped undecodable record %s[%d]@%d: %s", topic, record.partition,
                                        record.offset, exc)
                        continue
                    rows_of.add(columns, value, Position(record.partition, record.offset, record.timestamp,
                                                         record.key))
                    held += len(record.value)
                    if held >= ARROW_EVERY_BYTES:  # decoded rows are Python objects: ~10x their Avro bytes
                        writer.write(columns)
                        columns, held = rows_of.columns(), 0
                writer.write(columns)
                if time.monotonic() - last_log > 10:
                    last_log = time.monotonic()
                    log.info("%d of %d records exported", result.records, log_range.size)
        result.rows = writer.rows
        writer.close(result.stats())
    except BaseException:
        writer.abort()
        raise
    result.seconds = time.monotonic() - started
    if result.undecodable:
        log.warning("%d undecodable record(s) of %s skipped", result.undecodable, topic)
    return result


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream export", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=tuple(KINDS), help="which topic of the namespace to export")
    p.add_argument("--out", required=True, help="the file to write (refused if it exists, unless --overwrite)")
    p.add_argument("--from", dest="start", default=None,
                   help="earliest (default) | ISO time (2026-11-24T10:00:00Z) | partition:offset[,...]")
    p.add_argument("--to", dest="end", default=None, help="now (default: the log end when the export starts) | "
                                                          "ISO time | partition:offset[,...] (exclusive)")
    flags_from_dataclass(p, ExportConfig)
    return p


def main(argv: list[str]) -> int:
    cfg = load(ExportConfig, vars(parser().parse_args(argv)))
    result = asyncio.run(export(cfg))
    skipped = f", {result.undecodable} undecodable skipped" if result.undecodable else ""
    rate = result.rows / result.seconds if result.seconds > 0 else 0.0
    sys.stdout.write(f"boltstream export: {result.rows} rows from {result.records} records of {result.topic}"
                     f"{skipped} -> {result.path} ({result.seconds:.1f} s, {rate:,.0f} rows/s, "
                     f"peak RSS {peak_rss_mib():.0f} MiB)\n")
    return 0
