"""The shared checkpoint format against the real S3 endpoint (moto server)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from boltstream.errors import CheckpointError
from boltstream.weights.checkpoints import (
    MANIFEST,
    fetch_checkpoint,
    latest_manifest,
    list_versions,
    prune_checkpoints,
    publish_checkpoint,
    version_prefix,
)

MiB = 1024 * 1024


def _local(tmp_path: Path, tag: str, big: bool = False) -> Path:
    d = tmp_path / f"src-{tag}"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"tag": tag}))
    (d / "sub" / "weights.bin").write_bytes(os.urandom(11 * MiB if big else 1000))
    return d


def _publish(settings, s3_client, tmp_path: Path, version: int, **kw) -> dict:
    return publish_checkpoint(s3_client, settings.s3_bucket, f"{settings.namespace}run", version,
                              _local(tmp_path, f"v{version}", kw.pop("big", False)), kind=kw.pop("kind", "full"),
                              base_model="tiny", learner_step=version * 100, model_name="tiny",
                              offsets=[{"topic": "b", "partition": 0, "offset": 7}], part_size=5 * MiB, **kw)


def test_publish_then_fetch_round_trips_and_verifies(settings, s3_client, tmp_path: Path) -> None:
    event = _publish(settings, s3_client, tmp_path, 1, big=True, extra={"loss": 0.5})
    assert event["manifest_uri"] == f"s3://{settings.s3_bucket}/{settings.namespace}run/v1/manifest.json"
    assert {f["path"] for f in event["files"]} == {"config.json", "sub/weights.bin"}
    assert event["offsets"] == [{"topic": "b", "partition": 0, "offset": 7}] and event["learner_step"] == 100
    dest = fetch_checkpoint(s3_client, event, tmp_path / "dest")
    src = tmp_path / "src-v1"
    assert (dest / "sub" / "weights.bin").read_bytes() == (src / "sub" / "weights.bin").read_bytes()
    assert json.loads((dest / MANIFEST).read_text())["extra"] == {"loss": 0.5}
    assert fetch_checkpoint(s3_client, event["manifest_uri"], tmp_path / "again").is_dir()


def test_corrupt_missing_or_inconsistent_files_are_refused(settings, s3_client, tmp_path: Path) -> None:
    event = _publish(settings, s3_client, tmp_path, 2)
    key = version_prefix(f"{settings.namespace}run", 2) + "sub/weights.bin"
    data = bytearray(s3_client.get_object(settings.s3_bucket, key).read())
    data[0] ^= 0xFF
    s3_client.put_object(settings.s3_bucket, key, io.BytesIO(bytes(data)), length=len(data))
    with pytest.raises(CheckpointError, match=r"sub/weights.bin: sha256 mismatch"):
        fetch_checkpoint(s3_client, event, tmp_path / "d1")
    s3_client.put_object(settings.s3_bucket, key, io.BytesIO(bytes(data[:-1])), length=len(data) - 1)
    with pytest.raises(CheckpointError, match=r"sub/weights.bin: size"):
        fetch_checkpoint(s3_client, event, tmp_path / "d1")
    s3_client.remove_object(settings.s3_bucket, key)
    with pytest.raises(CheckpointError, match=r"sub/weights.bin: missing"):
        fetch_checkpoint(s3_client, event, tmp_path / "d1")
    assert not (tmp_path / "d1").exists() and not list(tmp_path.glob(".d1.partial-*"))

    other = _publish(settings, s3_client, tmp_path, 3)
    forged = dict(other, files=[dict(f, sha256="0" * 64) for f in other["files"]])
    with pytest.raises(CheckpointError, match="disagree"):
        fetch_checkpoint(s3_client, forged, tmp_path / "d2")
    with pytest.raises(CheckpointError, match="manifest"):
        fetch_checkpoint(s3_client, dict(other, manifest_uri=other["manifest_uri"] + ".nope"), tmp_path / "d3")


def test_unsafe_paths_in_a_manifest_are_refused(settings, s3_client, tmp_path: Path) -> None:
    event = _publish(settings, s3_client, tmp_path, 4)
    manifest = {"model": "tiny", "version": 4, "kind": "full",
                "files": [{"path": "../escape", "sha256": "0" * 64, "size": 1}]}
    body = json.dumps(manifest).encode()
    key = version_prefix(f"{settings.namespace}run", 4) + MANIFEST
    s3_client.put_object(settings.s3_bucket, key, io.BytesIO(body), length=len(body))
    with pytest.raises(CheckpointError, match="unsafe"):
        fetch_checkpoint(s3_client, event["manifest_uri"], tmp_path / "d")


def test_latest_manifest_and_prune(settings, s3_client, tmp_path: Path) -> None:
    bucket, run = settings.s3_bucket, f"{settings.namespace}run"
    assert latest_manifest(s3_client, bucket, run) is None
    for v in (1, 2, 3, 4, 5):
        _publish(settings, s3_client, tmp_path, v)
    s3_client.remove_object(bucket, version_prefix(run, 2) + MANIFEST)  # an abandoned upload
    junk = version_prefix(run, 6) + "config.json"  # an upload in progress: no manifest yet
    s3_client.put_object(bucket, junk, io.BytesIO(b"{}"), length=2)
    latest = latest_manifest(s3_client, bucket, run)
    assert latest["version"] == 5 and latest["learner_step"] == 500 and latest["offsets"][0]["offset"] == 7
    deleted = prune_checkpoints(s3_client, bucket, run, keep_last=2, protected_versions=[1])
    assert deleted == [2, 3] and list_versions(s3_client, bucket, run) == [1, 4, 5, 6]
    with pytest.raises(CheckpointError):
        prune_checkpoints(s3_client, bucket, run, keep_last=0)
