"""``boltstream learn --offline SOURCE``: the same steps as online, from a fixed dataset, epoch after epoch.

A dataset is exported batches Parquet (``boltstream export batches``: a file, a
folder of them, a glob) or a range of a batches topic (``topic:<full name>``, e.g.
a replay's ``<replay-ns>batches``; ``--offline-from`` / ``--offline-to``, resolved
once at the run's first start and kept in its checkpoints, so "now" does not move
on a restart). Each epoch reads it in one fixed order: files by name, their records
in file order (an export is written partition by partition); a topic's records in log
time order (timestamp, partition, offset), as ``replay`` reads spans. That order matters
for a recording of a live run: its first groups were sampled by the base policy, its
last by a policy trained for many steps, and a fresh adapter should meet them in that
order (read partition after partition, every version was in the first step: approx.
KL 2.99 at step 1). The ordered records feed the online learner's
:class:`~.groups.GroupAssembler`: groups are rebuilt from batch ids and part numbers
exactly as online (an export's rows are regrouped into their TrainingBatch records first,
:func:`boltstream.export.batches.read_batches`), K of them per step, trained by the same
step code.

What differs from online, on purpose:

* staleness limits do not apply (every sample is off-policy once the first step is
  taken); the importance ratio uses the recorded behaviour log-probs and PPO
  clipping bounds it, as online;
* the end of an epoch: batches still missing parts are dropped (counted), the groups
  left over (fewer than K) make one last, shorter step, and the next epoch starts
  with an empty dedupe window (a sample is trained once per epoch, duplicates
  within the dataset are dropped as online).

Resume is exact within an epoch by the online rule (:mod:`.groups`): a record is
named by (partition, offset), for a file (file index, record index), and each
checkpoint stores the epoch, the epoch's watermarks, the used records above them and
the dedupe window, next to the live topic's offsets.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from boltstream.broker.log_range import (
    LogRange,
    LogRangeError,
    PartitionRange,
    parse_position,
    read_merged,
    resolve,
)
from boltstream.broker.replay_marker import replay_status
from boltstream.config import Settings
from boltstream.export.batches import BatchesFileError, check_batches_file, read_batches
from boltstream.schemas import Codec

from .config import LearnerConfig
from .groups import GroupAssembler, OffsetTracker, StepInput
from .offline_source import TOPIC_PREFIX, OfflineError, parquet_files

logger = logging.getLogger(__name__)

RECORDS_PER_POLL = 256

Item = tuple[int, int, dict[str, Any] | None, str | None]  # partition, offset, batch (or None), problem


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One epoch's input: Parquet files (with their row counts) or a resolved topic range."""

    source: str
    files: tuple[tuple[str, int], ...] = ()  # (path, rows)
    log_range: LogRange | None = None

    def describe(self) -> dict[str, Any]:
        if self.log_range is not None:
            return {"topic": self.log_range.describe()}
        return {"files": [{"path": path, "rows": rows} for path, rows in self.files]}

    def starts(self) -> dict[int, int]:
        """Where each partition's records begin (a file's are numbered from 0)."""
        if self.log_range is not None:
            return {p.partition: p.start for p in self.log_range.partitions if p.size}
        return dict.fromkeys(range(len(self.files)), 0)


def _check_file(path: Path) -> int:
    """Rows of an exported batches file; refused with what is wrong when it is not one."""
    try:
        return check_batches_file(path)
    except BatchesFileError as exc:
        raise OfflineError(f"--offline: {exc}") from exc


async def open_dataset(cfg: LearnerConfig, stored: dict[str, Any] | None) -> Dataset:
    """The dataset ``cfg.offline`` names; for the run's own dataset (``stored``), the one it trained on."""
    source = str(cfg.offline)
    resumed = stored if same_dataset(cfg, stored) else None
    if source.startswith(TOPIC_PREFIX):
        if resumed is not None:  # the range as first resolved: "now" must not move on a restart
            return Dataset(source, log_range=_range_from(resumed["dataset"]["topic"]))
        topic = source[len(TOPIC_PREFIX):]
        done = await replay_status(cfg.settings, topic, Codec.from_registry_url(cfg.settings.schema_registry_url))
        if done is not None:
            logger.info("%s: written by a finished replay of %s (%s to %s): %s", topic, done["source_topic"],
                        done["range_from"], done["range_to"], done["counts"])
        log_range = await resolve(cfg.settings, topic, parse_position(cfg.offline_from, "--offline-from"),
                                  parse_position(cfg.offline_to, "--offline-to"))
        return Dataset(source, log_range=log_range)
    dataset = Dataset(source, files=tuple((str(f), _check_file(f)) for f in parquet_files(source)))
    if resumed is not None and resumed["dataset"] != dataset.describe():
        raise OfflineError(f"--offline {source}: the files differ from those the run's checkpoint trained on "
                           f"({resumed['dataset']}); train them under another --run")
    return dataset


def same_dataset(cfg: LearnerConfig, stored: dict[str, Any] | None) -> bool:
    """Whether the checkpoint's offline state is about the dataset ``cfg`` names (else: a new one, epoch 0)."""
    if not stored or stored.get("source") != cfg.offline:
        return False
    return not str(cfg.offline).startswith(TOPIC_PREFIX) or (
        stored.get("from"), stored.get("to")) == (cfg.offline_from, cfg.offline_to)


def _range_from(described: dict[str, Any]) -> LogRange:
    parts = tuple(PartitionRange(int(p), int(s), int(e)) for p, (s, e) in sorted(described["offsets"].items(),
                                                                                 key=lambda kv: int(kv[0])))
    return LogRange(described["topic"], parts, described["from"], described["to"])


class OfflineData:
    """The offline phase: an epoch's reader, tracker and assembler, and the epoch count.

    Used by the loop like the live source: :meth:`take_step` (None when it needs
    :meth:`poll`), ``assembler.commit`` after the step; :attr:`finished` once every
    epoch is trained.
    """

    def __init__(self, cfg: LearnerConfig, dataset: Dataset, codec: Any, dropped: Counter[str],
                 stored: dict[str, Any] | None, say: Callable[[str], None] = lambda line: None) -> None:
        self.cfg, self.dataset, self.codec, self.dropped, self.say = cfg, dataset, codec, dropped, say
        resume = stored if same_dataset(cfg, stored) else None
        self.epoch = int(resume["epoch"]) if resume else 0
        self.records_read = 0
        self._start_epoch(resume)
        where = f"epoch {self.epoch + 1} of {cfg.epochs}" if not self.finished else "all epochs done"
        logger.info("offline dataset %s (%s): %s, positions %s", cfg.offline, dataset.describe(), where,
                    self.tracker.positions())

    @property
    def finished(self) -> bool:
        return self.epoch >= self.cfg.epochs

    def _start_epoch(self, resume: dict[str, Any] | None = None) -> None:
        resume = resume or {}
        self.tracker = OffsetTracker({int(p): int(o) for p, o in resume.get("offsets", {}).items()},
                                     {int(p): offs for p, offs in resume.get("used_above", {}).items()})
        for partition, start in self.dataset.starts().items():
            self.tracker.start(partition, start)
        self.assembler = GroupAssembler(self.tracker, max_pending=self.cfg.max_pending_batches,
                                        seen=resume.get("seen", ()), window=self.cfg.dedupe_window,
                                        drop_incomplete=self.cfg.drop_incomplete_groups, role=self.cfg.role_spec)
        self.assembler.dropped = self.dropped  # one cumulative count across epochs and the live phase
        self._reader: AsyncIterator[list[Item]] | None = None
        self._exhausted = False
        self._steps = 0  # taken in this epoch by this process
        self._from_start = not resume  # this process reads the whole epoch

    def take_step(self, k: int, version: int, max_staleness: int | None = None,
                  vocab_size: int | None = None) -> StepInput | None:
        """K groups; at the end of the epoch what is left. ``max_staleness`` does not apply offline."""
        if self.finished:
            return None
        inp = self.assembler.take_step(k, version, None, vocab_size)
        if inp is None and self._exhausted:
            self.assembler.drop_partial_batches()
            inp = self.assembler.take_rest(version, None, vocab_size)
            if inp is None:
                self._end_epoch()
        self._steps += inp is not None
        return inp

    def _end_epoch(self) -> None:
        if not self._steps and self._from_start:
            logger.warning("offline epoch %d trained nothing: no usable group in %s (dropped so far: %s)",
                           self.epoch + 1, self.cfg.offline, dict(self.dropped))
        self.epoch += 1
        self.say(f"epoch {self.epoch} of {self.cfg.epochs} done")
        logger.info("offline epoch %d of %d done (%d records read so far, dropped %s)", self.epoch,
                    self.cfg.epochs, self.records_read, dict(self.dropped))
        if not self.finished:
            self._start_epoch()

    async def poll(self, timeout_ms: int = 0) -> int:
        """Feed the next records of the epoch to the assembler; 0 once the epoch's input is over."""
        if self.finished or self._exhausted:
            return 0
        if self._reader is None:
            self._reader = self._records(self.tracker.positions())
        try:
            chunk = await anext(self._reader)
        except StopAsyncIteration:
            self._exhausted = True
            return 0
        for partition, offset, batch, problem in chunk:
            self.assembler.add(partition, offset, batch, problem)
        self.records_read += len(chunk)
        return len(chunk)

    async def _records(self, positions: dict[int, int]) -> AsyncIterator[list[Item]]:
        """The epoch's records from ``positions`` on, in the dataset's fixed order."""
        log_range = self.dataset.log_range
        if log_range is None:
            for index, (path, _) in enumerate(self.dataset.files):
                chunk: list[Item] = []
                for number, record in read_batches(path, positions.get(index, 0)):
                    chunk.append((index, number, record, None))
                    if len(chunk) >= RECORDS_PER_POLL:
                        yield chunk
                        chunk = []
                if chunk:
                    yield chunk
            return
        rest = dataclasses.replace(log_range, partitions=tuple(
            PartitionRange(p.partition, max(p.start, positions.get(p.partition, p.start)), p.end)
            for p in log_range.partitions))
        async for merged in read_merged(self.cfg.settings, rest, max_records=RECORDS_PER_POLL):
            yield [self._decode(record) for record in merged]

    def _decode(self, record: Any) -> Item:
        topic = self.dataset.log_range.topic if self.dataset.log_range else ""
        try:
            return record.partition, record.offset, self.codec.decode(record.value, topic=topic,
                                                                      expect="TrainingBatch"), None
        except Exception as exc:  # counted and dropped by the assembler, never fatal
            logger.warning("undecodable record %s[%d]@%d: %s", topic, record.partition, record.offset, exc)
            return record.partition, record.offset, None, "undecodable"

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the dataset, the epoch and the exact position in it."""
        done = self.finished
        return {"source": self.cfg.offline, "from": self.cfg.offline_from, "to": self.cfg.offline_to,
                "dataset": self.dataset.describe(), "epoch": self.epoch, "epochs": self.cfg.epochs,
                "offsets": {} if done else self.tracker.positions(),
                "used_above": {} if done else self.tracker.used_above(),
                "seen": [] if done else self.assembler.seen.to_list()}

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.aclose()  # type: ignore[attr-defined]
            self._reader = None


async def live_log_end(settings: Settings) -> dict[int, int] | None:
    """The live batches topic's log end per partition (where ``--then-online`` starts), None if no such topic."""
    try:
        live = await resolve(settings, settings.topic("batches"), parse_position("earliest"),
                             parse_position("now", "--to"), allow_empty=True)
    except LogRangeError:
        return None
    return {p.partition: p.end for p in live.partitions}
