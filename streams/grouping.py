"""One GRPO group (all attempts of one task) -> TrainingBatch dict(s) for the ``batches`` topic.

Why: the learner consumes whole groups (advantages are only meaningful
relative to the group), but a broker rejects messages above its max size. So a
group is emitted as parts ``i of n`` sharing one ``batch_id``, each estimated to
fit the byte budget; the learner reassembles them by ``batch_id``.

Size estimate (cheap upper bound of the Avro binary encoding): per token 5 bytes
(token id, zig-zag varint of an int32) + 1 (loss-mask boolean) + 4 (float
logprob); per string its UTF-8 length + 5; a fixed overhead per sample and per
batch. A sample alone above the budget is still emitted, alone in its part, and
logged: the broker then decides.

``batch_id`` defaults to ``"<task_id>:<16 hex of sha1 of the sorted attempt ids>"``,
so a replay of the same group yields the same id (consumers dedupe on it).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .core_config import CreditConfig
from .credit import Sample, group_credit

logger = logging.getLogger(__name__)

TrainingBatch = dict[str, Any]

DEFAULT_MAX_BATCH_BYTES = 1_000_000
BYTES_PER_TOKEN = 10
SAMPLE_OVERHEAD_BYTES = 73  # the fixed-size fields and array framing; +9 for v2's temperature (union + double)
BATCH_OVERHEAD_BYTES = 96


def _str_bytes(value: str | None) -> int:
    return 5 + (len(value.encode("utf-8")) if value else 0)


def estimate_sample_bytes(sample: Mapping[str, Any]) -> int:
    """Upper-bound estimate of one Sample's Avro-encoded size in bytes."""
    return (
        SAMPLE_OVERHEAD_BYTES
        + BYTES_PER_TOKEN * len(sample["token_ids"])
        + sum(_str_bytes(sample.get(k)) for k in ("sample_id", "rollout_id", "attempt_id", "task_id", "agent_name"))
    )


def estimate_batch_overhead(batch_id: str, task_id: str, rollout_ids: Sequence[str]) -> int:
    """Estimated bytes of a TrainingBatch without its samples (repeated in every part)."""
    return BATCH_OVERHEAD_BYTES + _str_bytes(batch_id) + _str_bytes(task_id) + sum(map(_str_bytes, rollout_ids))


def split_samples(samples: Sequence[Sample], max_bytes: int, overhead: int = 0) -> list[list[Sample]]:
    """Pack ``samples`` in order into parts whose estimated size (``overhead`` + samples) is <= ``max_bytes``.

    Always returns at least one part (possibly empty). A sample that alone exceeds
    the budget gets a part of its own, with a warning.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes: must be > 0, got {max_bytes}")
    parts: list[list[Sample]] = [[]]
    used = overhead
    for sample in samples:
        size = estimate_sample_bytes(sample)
        if overhead + size > max_bytes:
            logger.warning(
                "sample %s alone is ~%d bytes, above the %d-byte budget; emitted in its own part",
                sample.get("sample_id"),
                overhead + size,
                max_bytes,
            )
            if parts[-1]:
                parts.append([])
            parts[-1].append(sample)
            parts.append([])
            used = overhead
            continue
        if parts[-1] and used + size > max_bytes:
            parts.append([])
            used = overhead
        parts[-1].append(sample)
        used += size
    if len(parts) > 1 and not parts[-1]:
        parts.pop()
    return parts


def run_id_of(task_id: str, attempt_id: str) -> str | None:
    """The run id in an attempt id of the form ``"{run_id}/{task_id}:{n}"`` (``attempt_ids(..., run_id=)``), else None.

    Why: ``boltstream runner --run-id p2`` is a deliberate second pass over the
    same tasks; its attempts must form their own groups, not arrive late to the
    first pass's. Parsed against the task id, so a task id holding ``/`` or
    ``:`` is never mistaken for a run.
    """
    head, sep, _ = attempt_id.rpartition(":")
    suffix = f"/{task_id}"
    if not sep or not head.endswith(suffix) or len(head) == len(suffix):
        return None
    return head[: -len(suffix)]


def group_key(task_id: str, attempt_id: str) -> str:
    """What a GRPO group is keyed by: ``"{run_id}/{task_id}"`` when the attempt names a run, else the task id."""
    run_id = run_id_of(task_id, attempt_id)
    return task_id if run_id is None else f"{run_id}/{task_id}"


def batch_id_for(task_id: str, attempt_ids: Iterable[str]) -> str:
    """Deterministic id of a group: the task id and a digest of its sorted attempt ids."""
    digest = hashlib.sha1("\n".join(sorted(attempt_ids)).encode("utf-8")).hexdigest()[:16]
    return f"{task_id}:{digest}"


def build_training_batches(
    task_id: str,
    trajectories: Iterable[Mapping[str, Any]],
    config: CreditConfig | None = None,
    *,
    group_size: int,
    complete: bool | None = None,
    max_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    batch_id: str | None = None,
    created_ns: int = 0,
    baseline: tuple[float, float] | None = None,
) -> list[TrainingBatch]:
    """The TrainingBatch part(s) of one GRPO group.

    ``group_size`` is the number of attempts the runner started for the task;
    ``complete`` defaults to "at least ``group_size`` distinct attempts arrived"
    (pass False when the group timed out). Trajectories repeated with the same
    attempt id count once. ``reward_mean``/``reward_std`` are the baseline used
    for the advantages (over episode returns G_0, which equal the final rewards
    when gamma = 1 and there are no intermediate rewards); ``baseline`` replaces the
    group's own (:func:`~boltstream.streams.credit.group_credit`).
    """
    if group_size < 1:
        raise ValueError(f"group_size: must be >= 1, got {group_size}")
    unique: dict[str, Mapping[str, Any]] = {}
    for trajectory in trajectories:
        if trajectory["task_id"] != task_id:
            raise ValueError(f"trajectory {trajectory['attempt_id']} belongs to task {trajectory['task_id']!r}")
        unique.setdefault(trajectory["attempt_id"], trajectory)
    if not unique:
        raise ValueError(f"task {task_id!r}: no trajectories")
    credit = group_credit(unique.values(), config, baseline)
    rollout_ids = list(dict.fromkeys(t["rollout_id"] for t in unique.values()))
    batch_id = batch_id or batch_id_for(task_id, unique)
    if complete is None:
        complete = len(unique) >= group_size
    parts = split_samples(credit.samples, max_bytes, estimate_batch_overhead(batch_id, task_id, rollout_ids))
    if len(parts) > 1:
        logger.info("batch %s split into %d parts (%d samples)", batch_id, len(parts), len(credit.samples))
    return [
        {
            "batch_id": batch_id,
            "task_id": task_id,
            "part": index,
            "num_parts": len(parts),
            "samples": part,
            "group_size": group_size,
            "num_rollouts": len(unique),
            "reward_mean": credit.mean,
            "reward_std": credit.std,
            "rollout_ids": rollout_ids,
            "complete": bool(complete),
            "created_ns": created_ns,
        }
        for index, part in enumerate(parts)
    ]
