"""S3 glue (minio SDK): one client factory so every component talks to MinIO, moto or AWS the same way.

The minio SDK is used rather than boto3 because it is small, has no
credential-chain surprises (it uses exactly the keys in Settings) and works
against any S3-compatible endpoint.
"""

from __future__ import annotations

import logging

import minio
import urllib3
from minio.error import S3Error

from boltstream.config import Settings

log = logging.getLogger(__name__)


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
