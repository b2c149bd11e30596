"""S3 glue (minio SDK): one client factory so every component talks to MinIO, moto or AWS the same way.

The minio SDK is used rather than boto3 because it is small, has no
credential-chain surprises (it uses exactly the keys in Settings) and works
against any S3-compatible endpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import minio
import urllib3
from minio.error import S3Error, ServerError

from boltstream.config import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")
# An endpoint that refuses connections, resets them, times out or answers 5xx: worth trying again.
# An S3Error (access denied, no such bucket) is an answer, not an outage: it is raised at once.
TRANSIENT = (urllib3.exceptions.HTTPError, OSError, ServerError)


def make_client(settings: Settings, timeout: float | None = None) -> minio.Minio:
    """A minio client for ``settings.s3_endpoint`` with the configured keys and region.

    The region is passed explicitly so the SDK does not spend a request
    discovering it (and moto/MinIO accept any region). With ``timeout`` the
    client fails fast instead of retrying: for readiness probes, where the
    caller polls with its own deadline.
    """
    http_client = None
    if timeout is not None:
        http_client = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=min(timeout, 2.0), read=timeout),
            retries=urllib3.Retry(total=0),
        )
    return minio.Minio(
        settings.s3_host,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        secure=settings.s3_secure,
        region=settings.s3_region,
        http_client=http_client,
    )


def ensure_bucket(client: minio.Minio, bucket: str) -> None:
    """Create ``bucket`` unless it exists; safe to call from racing processes."""
    if client.bucket_exists(bucket):
        return
    try:
        client.make_bucket(bucket)
        log.info("created bucket %s", bucket)
    except S3Error as exc:
        if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def retrying(fn: Callable[[], T], what: str, deadline_s: float, *, first_wait_s: float = 0.5,
             max_wait_s: float = 5.0, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> T:
    """``fn()``, tried again after a transient S3 failure until ``deadline_s`` seconds have passed.

    Why: the SDK's own retries span a few seconds, so an endpoint down for longer (a restart, a
    network blip) would otherwise fail a learner's checkpoint and end the process. The waits double
    from ``first_wait_s`` up to ``max_wait_s``; the last failure is raised once the deadline is spent.
    """
    start, wait, tries = clock(), first_wait_s, 0
    while True:
        tries += 1
        try:
            return fn()
        except TRANSIENT as exc:
            left = deadline_s - (clock() - start)
            if left <= 0:
                log.error("%s: S3 still failing after %d tries in %.0fs: %s", what, tries, deadline_s, exc)
                raise
            log.warning("%s: S3 failed (%s: %s); try %d again in %.1fs", what, type(exc).__name__,
                        str(exc)[:200], tries + 1, min(wait, left))
            sleep(min(wait, left))
            wait = min(wait * 2, max_wait_s)
