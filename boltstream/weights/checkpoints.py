"""The checkpoint format shared by the learner (publisher) and the inference workers (consumers).

Layout in the object store::

    s3://<bucket>/<run>/v<version>/<files...>
    s3://<bucket>/<run>/v<version>/manifest.json      <- written LAST

``manifest.json``: ``{model, version, kind: "full"|"lora", base_model, files:
[{path, sha256, size}], learner_step, offsets: [{topic, partition, offset}],
created_ns, extra}``. Writing the manifest last makes it the commit marker: a
version without one is an upload in progress (or an abandoned one) and is
never loaded. Every consumer verifies every file's size and sha256 against the
manifest, so a torn or corrupted upload is refused instead of served.

``kind="full"`` is an HF model directory (``save_pretrained``: config.json +
safetensors); ``kind="lora"`` is a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors) for ``base_model``.

The learner announces a version with a ``CheckpointEvent`` on the
``checkpoints`` topic (key: model name); see :func:`announce_checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import S3Error

from boltstream.errors import CheckpointError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
KINDS = ("full", "lora")
# Multipart (parallel parts) only above this: the embedded S3 (moto) takes ~6 s for a 540 MB single PUT
# but 10-17 s as 32-256 MB parts; real S3/MinIO are fine either way below 1 GiB.
PART_SIZE = 1024 * 1024 * 1024
CHUNK = 1024 * 1024
WORKERS = 4
_EVENT_FIELDS = ("model", "version", "uri", "manifest_uri", "kind", "files", "base_model", "learner_step",
                 "offsets", "created_ns")


def version_prefix(run: str, version: int) -> str:
    """Object key prefix of one version: ``<run>/v<version>/``."""
    return f"{run.strip('/')}/v{int(version)}/"


def s3_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key)."""
    if not uri.startswith("s3://") or "/" not in uri[5:]:
        raise CheckpointError(f"not an s3:// object URI: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


def _safe_relpath(path: str) -> str:
    """Refuse manifest paths that would escape the destination directory."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or path == MANIFEST:
        raise CheckpointError(f"unsafe or reserved file path in checkpoint: {path!r}")
    return p.as_posix()


def _local_files(local_dir: Path) -> list[str]:
    files = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
    if not files:
        raise CheckpointError(f"nothing to publish: {local_dir} holds no files")
    return [_safe_relpath(f) for f in files]


def publish_checkpoint(
    s3_client: Minio,
    bucket: str,
    run: str,
    version: int,
    local_dir: str | os.PathLike[str],
    *,
    kind: str = "full",
    base_model: str,
    learner_step: int,
    offsets: Iterable[Mapping[str, Any]] = (),
    model_name: str,
    extra: Mapping[str, Any] | None = None,
    part_size: int = PART_SIZE,
) -> dict[str, Any]:
    """Upload ``local_dir`` as ``<run>/v<version>/`` with its manifest last; return the CheckpointEvent dict.

    Files upload in parallel, big ones as multipart (``part_size``). The
    returned dict is exactly a ``CheckpointEvent`` record, ready for
    :func:`announce_checkpoint`.
    """
    if kind not in KINDS:
        raise CheckpointError(f"checkpoint kind must be one of {KINDS}, got {kind!r}")
    root = Path(local_dir)
    rel_paths = _local_files(root)
    prefix = version_prefix(run, version)

    def upload(rel: str) -> dict[str, Any]:
        size = (root / rel).stat().st_size
        with open(root / rel, "rb") as f:
            reader = _HashingReader(f)  # one pass over the file: hashed as the SDK reads it
            s3_client.put_object(bucket, prefix + rel, reader, length=size, part_size=part_size,
                                 num_parallel_uploads=WORKERS)
        if reader.size != size:
            raise CheckpointError(f"{rel} changed while it was uploaded ({reader.size} != {size} bytes)")
        return {"path": rel, "sha256": reader.hash.hexdigest(), "size": size}

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        files = list(pool.map(upload, rel_paths))
    manifest = {
        "model": model_name,
        "version": int(version),
        "kind": kind,
        "base_model": base_model,
        "files": files,
        "learner_step": int(learner_step),
        "offsets": [{"topic": o["topic"], "partition": int(o["partition"]), "offset": int(o["offset"])}
                    for o in offsets],
        "created_ns": time.time_ns(),
        "extra": dict(extra or {}),
    }
    body = json.dumps(manifest, indent=1).encode()
    s3_client.put_object(bucket, prefix + MANIFEST, _Reader(body), length=len(body),
                         content_type="application/json")
    log.info("published %s checkpoint %s v%d (%d files, %.1f MB)", kind, run, version, len(files),
             sum(f["size"] for f in files) / 1e6)
    return checkpoint_event(manifest, bucket, run)


class _HashingReader:
    """File wrapper that sha256-hashes what is read through it (the SDK reads parts in order)."""

    def __init__(self, f: Any) -> None:
        self._f, self.hash, self.size = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data


class _Reader:
    """Minimal readable over bytes (minio wants an object with ``read``)."""

    def __init__(self, data: bytes) -> None:
        self._data, self._pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n < 0 else self._pos + n
        out = self._data[self._pos:end]
        self._pos += len(out)
        return out


def checkpoint_event(manifest: Mapping[str, Any], bucket: str, run: str) -> dict[str, Any]:
    """The CheckpointEvent record announcing ``manifest`` (stored under ``<bucket>/<run>``)."""
    prefix = version_prefix(run, manifest["version"])
    event = {k: manifest[k] for k in _EVENT_FIELDS if k in manifest}
    event["uri"] = s3_uri(bucket, prefix)
    event["manifest_uri"] = s3_uri(bucket, prefix + MANIFEST)
    return {k: event[k] for k in _EVENT_FIELDS}


async def announce_checkpoint(producer: Any, codec: Any, topic: str, event: Mapping[str, Any]) -> None:
    """Produce ``event`` to the checkpoints ``topic`` keyed by model name and wait for the broker's ack."""
    value = codec.encode("CheckpointEvent", dict(event), topic=topic)
    await producer.send_and_wait(topic, value, key=str(event["model"]).encode())


def _get_bytes(s3_client: Minio, bucket: str, key: str) -> bytes:
    resp = s3_client.get_object(bucket, key)
    try:
        return resp.read()
    finally:
        resp.close()
        resp.release_conn()


def read_manifest(s3_client: Minio, manifest_uri: str) -> dict[str, Any]:
    """Download and validate one manifest; CheckpointError when missing or malformed."""
    bucket, key = parse_s3_uri(manifest_uri)
    try:
        manifest = json.loads(_get_bytes(s3_client, bucket, key))
    except S3Error as exc:
        raise CheckpointError(f"manifest {manifest_uri} unreadable: {exc.code}") from exc
    except ValueError as exc:
        raise CheckpointError(f"manifest {manifest_uri} is not JSON: {exc}") from exc
    missing = [k for k in ("model", "version", "kind", "files") if k not in manifest]
    if missing or not isinstance(manifest.get("files"), list):
        raise CheckpointError(f"manifest {manifest_uri} lacks {missing or ['files list']}")
    return manifest


def fetch_checkpoint(
    s3_client: Minio, event_or_manifest_uri: Mapping[str, Any] | str, dest_dir: str | os.PathLike[str]
) -> Path:
    """Download a version into ``dest_dir`` and verify every file (size + sha256) against the manifest.

    Files land in a hidden sibling directory that is renamed to ``dest_dir``
    only after all of them verified, so ``dest_dir`` never holds a partial
    checkpoint. Raises CheckpointError naming the first bad or missing file;
    an event whose file list disagrees with its manifest is refused too.
    """
    if isinstance(event_or_manifest_uri, str):
        manifest_uri, event_files = event_or_manifest_uri, None
    else:
        manifest_uri, event_files = event_or_manifest_uri["manifest_uri"], event_or_manifest_uri.get("files")
    manifest = read_manifest(s3_client, manifest_uri)
    bucket, manifest_key = parse_s3_uri(manifest_uri)
    prefix = manifest_key[: -len(MANIFEST)]
    expected = {_safe_relpath(f["path"]): (f["sha256"], int(f["size"])) for f in manifest["files"]}
    if event_files is not None:
        announced = {f["path"]: (f["sha256"], int(f["size"])) for f in event_files}
        for path in sorted(set(announced) ^ set(expected)) + sorted(
            p for p in set(announced) & set(expected) if announced[p] != expected[p]
        ):
            raise CheckpointError(f"{path}: the event and the manifest {manifest_uri} disagree")
    dest = Path(dest_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()

    def download(rel: str) -> None:
        sha, size = expected[rel]
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        h, got = hashlib.sha256(), 0
        try:
            resp = s3_client.get_object(bucket, prefix + rel)
        except S3Error as exc:
            raise CheckpointError(f"{rel}: missing from {s3_uri(bucket, prefix)} ({exc.code})") from exc
        try:
            with open(target, "wb") as out:
                for chunk in resp.stream(CHUNK):
                    h.update(chunk)
                    got += len(chunk)
                    out.write(chunk)
        finally:
            resp.close()
            resp.release_conn()
        if got != size:
            raise CheckpointError(f"{rel}: size {got} != {size} in the manifest of {manifest_uri}")
        if h.hexdigest() != sha:
            raise CheckpointError(f"{rel}: sha256 mismatch against the manifest of {manifest_uri}")

    try:
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            for future in [pool.submit(download, rel) for rel in expected]:
                future.result()
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def list_versions(s3_client: Minio, bucket: str, run: str) -> list[int]:
    """Every version prefix under ``<run>/`` (complete or not), ascending."""
    versions = []
    for obj in s3_client.list_objects(bucket, prefix=f"{run.strip('/')}/", recursive=False):
        name = obj.object_name.rstrip("/").rsplit("/", 1)[-1]
        if obj.is_dir and name.startswith("v") and name[1:].isdigit():
            versions.append(int(name[1:]))
    return sorted(versions)


def _has_manifest(s3_client: Minio, bucket: str, run: str, version: int) -> bool:
    try:
        s3_client.stat_object(bucket, version_prefix(run, version) + MANIFEST)
    except S3Error:
        return False
    return True


def latest_manifest(s3_client: Minio, bucket: str, run: str) -> dict[str, Any] | None:
    """The manifest of the newest complete version of ``run`` (for resume), or None when there is none."""
    for version in reversed(list_versions(s3_client, bucket, run)):
        if _has_manifest(s3_client, bucket, run, version):
            return read_manifest(s3_client, s3_uri(bucket, version_prefix(run, version) + MANIFEST))
    return None


def prune_checkpoints(
    s3_client: Minio,
    bucket: str,
    run: str,
    *,
    keep_last: int,
    protected_versions: Iterable[int] = (),
) -> list[int]:
    """Delete all but the newest ``keep_last`` complete versions (and ``protected_versions``); return deleted.

    Incomplete versions older than the newest complete one are abandoned
    uploads and go too; newer incomplete ones may be uploading and stay. The
    manifest is deleted first so a half-deleted version never looks complete.
    """
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    versions = list_versions(s3_client, bucket, run)
    complete = [v for v in versions if _has_manifest(s3_client, bucket, run, v)]
    keep = set(complete[-keep_last:]) | {int(v) for v in protected_versions}
    newest = complete[-1] if complete else None
    doomed = [v for v in versions if v not in keep and newest is not None and v < newest]
    for version in doomed:
        prefix = version_prefix(run, version)
        s3_client.remove_object(bucket, prefix + MANIFEST)
        keys = [DeleteObject(o.object_name) for o in s3_client.list_objects(bucket, prefix=prefix, recursive=True)]
        errors = list(s3_client.remove_objects(bucket, keys))
        if errors:
            raise CheckpointError(f"could not delete {s3_uri(bucket, prefix)}: {errors[0]}")
        log.info("pruned checkpoint %s", s3_uri(bucket, prefix))
    return doomed
