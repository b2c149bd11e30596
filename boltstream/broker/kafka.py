"""aiokafka glue shared by every component: one place that turns Settings into client arguments.

Why a module of its own: the broker we default to (Tansu, embedded) differs
from Kafka/Redpanda in ways every producer and consumer must respect, and
those differences should be encoded once:

* No ``InitProducerId``: the idempotent producer and transactions fail, so
  :func:`producer_kwargs` leaves idempotence off unless a caller asks for it
  (only do that against Redpanda/Kafka).
* Tansu completes a consumer-group join only after HALF a timeout the member
  sends. Measured with aiokafka 0.14 against Tansu 0.6: it is the SESSION
  timeout that counts (session 10 s -> 5.0 s per join, 6 s -> 3.0 s, whatever
  the rebalance timeout), so :func:`consumer_kwargs` uses session = rebalance
  = 6 s with 2 s heartbeats: joins take ~3 s. Heartbeats run on the event
  loop, so a consumer whose loop blocks for > 6 s (a long training step run
  inline) is evicted; such callers should raise ``session_timeout_ms``.
* ``ListOffsets(latest)`` on Tansu 0.6 reports the LAST BATCH's base offset
  + 1, not the last record's offset + 1 (200 records in one batch -> "1").
  Never use ``end_offsets()``/``highwater()`` to decide "caught up" or lag;
  use :func:`log_end_offsets`, which reads the last batch to find the true end.
* A SCRAM refusal (RFC 5802 server-final ``e=unknown-user``, ``e=invalid-proof``) reaches aiokafka 0.14
  as ``KeyError('v')``; importing this module turns it into ``AuthenticationFailedError`` naming the
  broker's reason, for every client of this process (:mod:`.aiokafka_internals`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.conn import create_conn
from aiokafka.errors import AuthenticationFailedError, KafkaError, UnsupportedSaslMechanismError
from aiokafka.helpers import create_ssl_context

from boltstream.broker import aiokafka_internals
from boltstream.config import Settings
from boltstream.errors import BoltstreamError

log = logging.getLogger(__name__)

# Group timings that work on Tansu (join completes after rebalance_timeout/2) and on Kafka.
REBALANCE_TIMEOUT_MS = 6_000
SESSION_TIMEOUT_MS = 6_000
HEARTBEAT_INTERVAL_MS = 2_000
DEFAULT_LINGER_MS = 5


aiokafka_internals.scram_refusal_is_an_auth_error()


class BrokerUnavailableError(BoltstreamError, TimeoutError):
    """The broker did not answer a metadata request before the deadline."""


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """SSL context for SSL / SASL_SSL (system CAs unless ``ssl_cafile`` is set); None for plaintext."""
    if not settings.security_protocol.endswith("SSL"):
        return None
    return create_ssl_context(
        cafile=settings.ssl_cafile,
        certfile=settings.ssl_certfile,
        keyfile=settings.ssl_keyfile,
    )


def client_kwargs(settings: Settings) -> dict[str, Any]:
    """Connection and security arguments common to producer, consumer and admin client."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap_servers,
        "security_protocol": settings.security_protocol,
    }
    ctx = ssl_context(settings)
    if ctx is not None:
        kwargs["ssl_context"] = ctx
    if settings.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = settings.sasl_mechanism
        kwargs["sasl_plain_username"] = settings.sasl_username
        kwargs["sasl_plain_password"] = settings.sasl_password
    return kwargs


def producer_kwargs(settings: Settings, **overrides: Any) -> dict[str, Any]:
    """Arguments for ``AIOKafkaProducer``: durable acks, no idempotence (Tansu lacks InitProducerId).

    ``max_request_size`` follows ``settings.max_message_bytes`` so producers
    fail locally, with a clear error, before the broker would reject a record.
    Pass ``enable_idempotence=True`` only against Redpanda/Kafka.
    """
    kwargs = client_kwargs(settings)
    kwargs.update(
        acks="all",
        compression_type=settings.compression_type,
        linger_ms=DEFAULT_LINGER_MS,
        max_request_size=settings.max_message_bytes,
        enable_idempotence=False,
    )
    kwargs.update(overrides)
    return kwargs


def consumer_kwargs(settings: Settings, group_id: str | None, **overrides: Any) -> dict[str, Any]:
    """Arguments for ``AIOKafkaConsumer`` with group timings that work on Tansu.

    Auto-commit is off: components commit after their output is acknowledged
    (at-least-once). ``auto_offset_reset="earliest"`` because every topic is
    replayable and a new group should see what is already there. Fetch sizes
    are raised to at least ``max_message_bytes`` so one maximal record always
    fits.
    """
    kwargs = client_kwargs(settings)
    fetch = max(settings.max_message_bytes, 1_048_576)
    kwargs.update(
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        rebalance_timeout_ms=REBALANCE_TIMEOUT_MS,
        session_timeout_ms=SESSION_TIMEOUT_MS,
        heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
        max_partition_fetch_bytes=fetch,
        fetch_max_bytes=max(fetch, 52_428_800),
    )
    kwargs.update(overrides)
    return kwargs


def admin_kwargs(settings: Settings, **overrides: Any) -> dict[str, Any]:
    """Arguments for ``AIOKafkaAdminClient``."""
    kwargs = client_kwargs(settings)
    kwargs.update(overrides)
    return kwargs


async def _tcp_open(host: str, port: int, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


async def _raise_if_refused(settings: Settings, host: str, port: int, request_ms: int) -> None:
    """aiokafka's bootstrap logs an authentication failure and reports "unable to bootstrap"; one direct
    connection tells the two apart, so wrong credentials fail at once with the broker's reason."""
    kwargs = {k: v for k, v in client_kwargs(settings).items() if k != "bootstrap_servers"}
    try:
        conn = await create_conn(host, port, request_timeout_ms=request_ms, **kwargs)
    except AuthenticationFailedError as exc:  # waiting will not change the credentials
        raise BrokerUnavailableError(f"broker at {settings.bootstrap_servers}: {exc}") from exc
    except UnsupportedSaslMechanismError as exc:
        raise BrokerUnavailableError(f"broker at {settings.bootstrap_servers} does not accept SASL "
                                     f"{settings.sasl_mechanism} ({exc}): is authentication on there?") from exc
    except (TimeoutError, KafkaError, OSError):
        return
    conn.close()


async def wait_for_broker(settings: Settings, timeout: float = 30.0) -> None:
    """Block until the broker answers a metadata request, or raise BrokerUnavailableError.

    A TCP probe comes first so a not-yet-listening broker does not make
    aiokafka log an error per attempt; then a real metadata round trip, since
    an open port alone does not mean the broker serves requests.
    """
    deadline = time.monotonic() + timeout
    first = settings.bootstrap_servers.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    last_error: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BrokerUnavailableError(
                f"broker at {settings.bootstrap_servers} did not answer within {timeout:.0f}s"
                + (f" (last error: {last_error})" if last_error else "")
            )
        if await _tcp_open(host.strip("[]"), int(port), min(remaining, 2.0)):
            request_ms = int(max(1.0, min(remaining, 5.0)) * 1000)
            client = AIOKafkaClient(**client_kwargs(settings), request_timeout_ms=request_ms)
            try:
                await client.bootstrap()
                if client.cluster.brokers():
                    return
                last_error = RuntimeError("metadata lists no brokers")
            except (TimeoutError, KafkaError, OSError) as exc:
                last_error = exc
                if settings.security_protocol.startswith("SASL"):
                    await _raise_if_refused(settings, host.strip("[]"), int(port), request_ms)
            finally:
                await client.close()
        await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


async def log_end_offsets(
    settings: Settings, partitions: Iterable[TopicPartition], timeout: float = 10.0
) -> dict[TopicPartition, int]:
    """True log-end offset (last record's offset + 1) per partition, correct on Tansu too.

    Tansu reports the last batch's base offset + 1 as the latest offset, so we
    seek to that reported offset - 1 and fetch: the broker returns the whole
    last batch, whose highest offset + 1 is the real end. On Kafka/Redpanda
    the same read simply confirms what ``end_offsets`` said.
    """
    tps = list(partitions)
    consumer = AIOKafkaConsumer(**consumer_kwargs(settings, None))
    await consumer.start()
    try:
        reported = await consumer.end_offsets(tps)
        result = dict(reported)

        def last_batch(tp: TopicPartition, records: list[Any]) -> bool:
            result[tp] = max(result[tp], records[-1].offset + 1)
            return True

        try:
            await read_tails(consumer, {tp: end - 1 for tp, end in reported.items() if end > 0}, last_batch,
                             timeout)
        except TimeoutError as exc:
            raise BrokerUnavailableError(f"could not read the last batch: {exc}") from exc
        return result
    finally:
        await consumer.stop()


async def read_tails(consumer: AIOKafkaConsumer, starts: Mapping[TopicPartition, int],
                     take: Callable[[TopicPartition, list[Any]], bool], timeout: float) -> None:
    """Read each partition of ``starts`` from its offset, handing every fetched batch to ``take(tp,
    records)`` until it returns True for that partition; TimeoutError after ``timeout`` seconds.

    Why: on Tansu a partition's reported end is its last batch's base offset + 1, so whoever needs
    the true tail (the end offsets above, a changelog's last records) reads it."""
    pending = set(starts)
    if not pending:
        return
    consumer.assign(list(pending))
    for tp in pending:
        consumer.seek(tp, starts[tp])
    deadline = time.monotonic() + timeout
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"did not reach the end of {sorted(map(str, pending))}")
        batches = await consumer.getmany(*pending, timeout_ms=500)
        for tp, records in batches.items():
            if records and take(tp, records):
                pending.discard(tp)
