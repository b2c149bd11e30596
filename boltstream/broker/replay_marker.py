"""A replay's "done" record: how a reader tells a finished replay from a running or killed one.

``boltstream replay`` creates ``<namespace>replay`` empty with its other output topics and
writes the ``ReplayDone`` record of :func:`done_record` to it last (partition 0), after the broker acknowledged every trajectory,
batch and dead letter. ``--overwrite`` recreates the topic, so a re-run's namespace holds no
marker until the re-run finishes. A killed replay leaves output with no marker, which a reader
could not otherwise tell from a complete one.

Readers (``learn --offline topic:<ns>batches``) call :func:`replay_status`: a namespace with no
``replay`` topic is not a replay's (a live pipeline's batches, say) and is read as it is.
Kept out of ``streams`` so that the learner can read it without importing the stream app.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from boltstream.broker.log_range import LogRange, LogRangeError, parse_position, read_range, resolve
from boltstream.config import Settings
from boltstream.errors import BoltstreamError
from boltstream.schemas import Codec

TOPIC = "replay"  # short name, in the replay's namespace
RECORD = "ReplayDone"


class ReplayNotDone(BoltstreamError):
    """A replay namespace's output is not known to be complete: no marker (running, or killed)."""


def done_record(namespace: str, source: LogRange, outputs: Mapping[tuple[str, int], int],
                settings: Mapping[str, Any], counts: Mapping[str, int]) -> dict[str, Any]:
    """The ``ReplayDone`` record of a finished replay (``outputs``: (topic, partition) -> log end)."""
    return {
        "namespace": namespace,
        "source_topic": source.topic,
        "range_from": source.start_text,
        "range_to": source.end_text,
        "source_offsets": [{"partition": p.partition, "start": p.start, "end": p.end} for p in source.partitions],
        "outputs": [{"topic": t, "partition": p, "end": int(e)} for (t, p), e in sorted(outputs.items())],
        "settings_json": json.dumps(dict(settings), sort_keys=True, default=str),
        "counts": {k: int(v) for k, v in counts.items()},
        "finished_ns": time.time_ns(),
    }


def namespace_of(batches_topic: str) -> str | None:
    """``exp1.batches`` -> ``exp1.``; None for a topic not named ``<namespace>batches``."""
    return batches_topic[: -len("batches")] if batches_topic.endswith("batches") else None


async def replay_status(settings: Settings, batches_topic: str, codec: Codec) -> dict[str, Any] | None:
    """The newest marker of the replay that wrote ``batches_topic``; None when it is not a replay's.

    Raises :class:`ReplayNotDone` for a replay namespace with no marker.
    """
    namespace = namespace_of(batches_topic)
    if namespace is None:
        return None
    topic = f"{namespace}{TOPIC}"
    try:
        marker_range = await resolve(settings, topic, parse_position("earliest"), parse_position("now", "--to"),
                                     allow_empty=True)
    except LogRangeError:  # no such topic: not a replay's namespace
        return None
    last = None
    async for fetched in read_range(settings, marker_range):
        last = fetched[-1] if fetched else last
    if last is None:
        raise ReplayNotDone(f"{batches_topic} is the output of a replay that has not finished ({topic} holds no "
                            f"{RECORD} record): it is still running, or it was killed; wait for it, or run it "
                            "again with --overwrite")
    return codec.decode(last.value, topic=topic, expect=RECORD)
