"""The stream worker's /metrics: lag arithmetic and what a scrape of a snapshot shows."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from boltstream.streams.config import StreamConfig
from boltstream.streams.metrics import StreamMetrics, partition_lag


def samples(metrics: StreamMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_partition_lag() -> None:
    assert partition_lag(None, 5, 3) is None  # no fetch yet: the end is unknown
    assert partition_lag(10, 4, None) == 5  # offsets 5..9 unread
    assert partition_lag(10, 9, None) == 0
    assert partition_lag(10, None, 7) == 3  # nothing read: from the committed offset
    assert partition_lag(10, None, None) == 10
    assert partition_lag(3, 9, None) == 0  # a stale watermark never reads negative


def test_snapshot_is_what_a_scrape_shows() -> None:
    m = StreamMetrics()
    m.refresh({"rollout.records": 12, "rollout.open": 2, "rollout.closed": 3, "rollout.timed_out": 1,
               "group.closed": 4, "group.timed_out": 1, "group.samples": 9, "group.open": 1,
               "group.records": 5, "dlq.undecodable": 2},
              {("t.spans", 0): 7, ("t.spans", 1): 0})
    m.observe_save("rollout", 0.004)
    s = samples(m)
    assert s[("boltstream_stream_spans_total", ())] == 12
    assert s[("boltstream_stream_rollouts_open", ())] == 2
    assert s[("boltstream_stream_rollouts_closed_total", (("reason", "ended"),))] == 3
    assert s[("boltstream_stream_rollouts_closed_total", (("reason", "timed_out"),))] == 1
    assert s[("boltstream_stream_groups_emitted_total", (("complete", "true"),))] == 4
    assert s[("boltstream_stream_groups_emitted_total", (("complete", "false"),))] == 1
    assert s[("boltstream_stream_samples_total", ())] == 9
    assert s[("boltstream_stream_dead_letters_total", (("category", "undecodable"),))] == 2
    assert s[("boltstream_stream_consumer_lag_records", (("partition", "0"), ("topic", "t.spans")))] == 7
    assert s[("boltstream_stream_changelog_save_seconds_count", (("stage", "rollout"),))] == 1


def test_serve_on_a_free_port() -> None:
    m = StreamMetrics()
    port = m.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"boltstream_stream_rollouts_open" in r.read()
    finally:
        m.close()


def test_metrics_port_is_checked() -> None:
    import pytest

    from boltstream.errors import ConfigError

    assert StreamConfig(metrics_port=0).metrics_port == 0
    with pytest.raises(ConfigError, match="metrics_port"):
        StreamConfig(metrics_port=70000)


def test_faust_has_what_the_lag_reader_relies_on() -> None:
    """streams/metrics.py reads faust-streaming 0.15.3's Consumer.highwater() and _read_offset /
    _committed_offset; another faust that renamed them must fail here, not show no lag."""
    import inspect

    import faust
    import faust.transport.consumer as consumer
    import faust.transport.drivers.aiokafka as aiokafka_driver

    init = inspect.getsource(consumer.Consumer.__init__)
    assert callable(getattr(aiokafka_driver.Consumer, "highwater", None)), faust.__version__
    assert "self._read_offset" in init and "self._committed_offset" in init, faust.__version__


def test_consumer_lag_of_the_assigned_input_partitions() -> None:
    from typing import NamedTuple

    from boltstream.streams.metrics import consumer_lag

    class TP(NamedTuple):
        topic: str
        partition: int

    class Consumer:  # the three things consumer_lag reads, with faust's names
        _read_offset = {TP("s", 0): 4}
        _committed_offset = {TP("s", 1): 2}

        def assignment(self) -> set[TP]:
            return {TP("s", 0), TP("s", 1), TP("s-changelog", 0), TP("s", 2)}

        def highwater(self, tp: TP) -> int | None:
            return {TP("s", 0): 10, TP("s", 1): 5, TP("s-changelog", 0): 99}.get(tp)

    assert consumer_lag(Consumer(), ["s"]) == {("s", 0): 5, ("s", 1): 3}
