"""faust's internals as streams/faust_internals.py uses them: the installed versions are the checked
ones, the private methods it overrides exist, and the consumer fetches only what faust reads ("the
100 ms fetch stalls": a real aiokafka consumer with a manual assignment; pausing and resuming are
local state, so no broker is needed, nothing connects before ``start()``).
"""

from __future__ import annotations

import inspect

import faust
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from boltstream.streams import faust_internals
from boltstream.streams.faust_internals import fetch_only
from tests.fences import assert_checked


@pytest.mark.parametrize("dist", sorted(faust_internals.CHECKED_WITH))
def test_the_installed_version_is_one_the_contract_was_checked_with(dist: str) -> None:
    assert_checked(faust_internals, dist)


@pytest.mark.parametrize(("cls", "name", "params"), [
    (faust.App, "_new_transport", []),
    (faust_aiokafka.Consumer, "_new_consumer_thread", []),
    (faust_aiokafka.Consumer, "_getmany", ["active_partitions", "timeout"]),
    (faust_aiokafka.Consumer, "_drain_messages", ["fetcher"]),
    (faust_aiokafka.AIOKafkaConsumerThread, "_create_worker_consumer", ["transport"]),
    (faust_aiokafka.AIOKafkaConsumerThread, "_fetch_records", ["consumer", "active_partitions", "timeout",
                                                                "max_records"]),
])
def test_the_overridden_private_methods_exist_with_the_parameters_relied_on(cls: type, name: str,
                                                                             params: list[str]) -> None:
    method = getattr(cls, name, None)
    assert method is not None, f"{cls.__qualname__}.{name} is gone: streams/faust_internals.py overrides it"
    assert list(inspect.signature(method).parameters)[1:] == params, f"{cls.__qualname__}.{name} changed"

SPANS = [TopicPartition("spans", 0), TopicPartition("spans", 1)]
CHANGELOGS = [TopicPartition("stream-rollout-spans-changelog", 0), TopicPartition("stream-rollout-spans-changelog", 1)]


async def test_partitions_faust_does_not_read_are_paused_and_resumed_when_read_again() -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9")
    consumer.assign(SPANS + CHANGELOGS)
    try:
        # After recovery faust reads the source topics only (its TP type, as faust passes it).
        fetch_only(consumer, {TP("spans", 0), TP("spans", 1)})
        assert consumer.paused() == set(CHANGELOGS)
        # The next recovery reads the changelogs with the sources held back.
        fetch_only(consumer, {TP(tp.topic, tp.partition) for tp in CHANGELOGS})
        assert consumer.paused() == set(SPANS)
        # A partition back in the wanted set is fetched again; one still missing stays paused.
        fetch_only(consumer, {TP("spans", 1), *CHANGELOGS})
        assert consumer.paused() == {SPANS[0]}
        fetch_only(consumer, set(SPANS + CHANGELOGS))
        assert consumer.paused() == set()
    finally:
        await consumer.stop()


async def test_a_wanted_partition_not_assigned_is_ignored() -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9")
    consumer.assign(SPANS)
    try:
        fetch_only(consumer, {TP("spans", 0), TP("revoked", 3)})
        assert consumer.paused() == {SPANS[1]}
    finally:
        await consumer.stop()
