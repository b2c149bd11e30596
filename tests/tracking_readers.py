"""Read back what each ``--report-to`` tracker wrote, with each tool's own reader where it has one.

* TensorBoard: ``EventAccumulator`` (public).
* MLflow: ``MlflowClient`` on the file store (public).
* W&B has no public reader of an offline run in Python: :func:`wandb_records` reads the run's
  ``run-<id>.wandb`` file, a LevelDB-style log (a 7-byte header ``:W&B`` + magic 0xBEE1 + version 0,
  then 32 KiB blocks of records, each a 7-byte header: crc32c, little-endian length, type
  full/first/middle/last) of ``wandb_internal_pb2.Record`` protobufs. A wandb that writes
  another format fails :func:`wandb_records` on its header check, naming it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the event files in ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_text(folder: Path, tag: str = "config") -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    tags = {t for t in acc.Tags()["tensors"] if t.startswith(tag)}
    assert tags, f"no text tag {tag!r} in {folder}: {acc.Tags()}"
    return "\n".join(e.tensor_proto.string_val[0].decode() for t in tags for e in acc.Tensors(t))


def mlflow_runs(store: Path, experiment: str = "boltstream") -> dict[str, Any]:
    """run name -> mlflow Run, from the file store at ``store``."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} in {store}"
    return {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


def mlflow_history(store: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def wandb_records(path: Path) -> list[Any]:
    """Every ``Record`` of one ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == HEADER, f"{path}: not a W&B LevelDB-style log (header {data[:7]!r}); the format changed?"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:  # zero padding at a file's end
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_run(folder: Path) -> dict[str, Any]:
    """The one offline run under ``folder`` (its ``wandb/offline-run-*``): name, group, config,
    history rows (step -> {key: value}) and summary, decoded from its ``.wandb`` file."""
    runs = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert runs, f"no offline W&B run under {folder}"
    return wandb_run_file(runs[-1])


def wandb_run_file(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"name": None, "group": None, "config": {}, "history": {}, "summary": {}}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["group"] = r.run.display_name, r.run.run_group
        elif kind == "config":
            for item in r.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            out["history"][int(row.pop("_step", r.history.step.num))] = row
        elif kind == "summary":
            for item in r.summary.update:
                out["summary"]["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return out
