"""Retention of the replayable topics is explicit and follows Settings."""

from boltstream.broker.topics import topic_configs
from boltstream.config import Settings


def test_spans_and_dlq_keep_everything_by_default() -> None:
    s = Settings()
    for short in ("spans", "dlq"):
        assert topic_configs(s, short) == {"retention.ms": "-1", "retention.bytes": "-1"}


def test_retention_knobs_reach_the_spans_topic_only() -> None:
    s = Settings(log_retention_ms=604_800_000, log_retention_bytes=10_000_000_000)
    assert topic_configs(s, "spans") == {"retention.ms": "604800000", "retention.bytes": "10000000000"}
    assert topic_configs(s, "batches") == {}
    assert topic_configs(s, "checkpoints") == {"cleanup.policy": "compact"}
