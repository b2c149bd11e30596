"""The offline phase without a model or a broker: Parquet datasets, epochs, the last short step,
resume from a checkpoint's state, and the refusals."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from boltstream.config import Settings
from boltstream.export.rows import Position, layout
from boltstream.export.writers import open_writer
from boltstream.learner.config import LearnerConfig
from boltstream.learner.offline import OfflineData, OfflineError, open_dataset, parquet_files
from tests.integration.learner.helpers import group, sample_ids
from tests.unit.schemas.record_examples import EXAMPLES


def write_export(path: Path, records: list[dict[str, Any]], kind: str = "batches") -> Path:
    """``records`` as ``boltstream export batches`` writes them (one partition, offsets 0..n-1)."""
    rows_of = layout(kind)
    writer = open_writer("parquet", path, rows_of.schema, {"boltstream": json.dumps({"kind": kind})},
                         row_group_rows=3, row_group_bytes=1 << 20)
    for offset, record in enumerate(records):
        columns = rows_of.columns()
        rows_of.add(columns, record, Position(0, offset, 0, None))
        writer.write(columns)
    writer.close({})
    return path


def config(source: Path | str, **kw: Any) -> LearnerConfig:
    return LearnerConfig(settings=Settings(), model="tiny", offline=str(source), groups_per_step=2, **kw)


def run(data: OfflineData, steps: int | None = None) -> list[list[str]]:
    """Take and commit steps as the loop does (no model); the sample ids of each step."""

    async def go() -> list[list[str]]:  # one event loop: the epoch's reader lives across polls
        out: list[list[str]] = []
        while not data.finished and (steps is None or len(out) < steps):
            inp = data.take_step(2, version=len(out), max_staleness=0)
            if inp is None:
                await data.poll()
                continue
            data.assembler.commit(inp)
            out.append(inp.sample_ids)
        await data.close()
        return out

    return asyncio.run(go())


def open_data(cfg: LearnerConfig, stored: dict[str, Any] | None = None) -> OfflineData:
    return OfflineData(cfg, asyncio.run(open_dataset(cfg, stored)), codec=None, dropped=Counter(), stored=stored)


def test_epochs_train_each_sample_once_with_a_short_last_step(tmp_path: Path) -> None:
    groups = [group(f"g{i}", seed=i, parts=2 if i == 1 else 1) for i in range(5)]
    broken = group("broken", seed=9, parts=2)[0]  # part 0 of 2: its other part never comes
    write_export(tmp_path / "a.parquet", [r for g in groups[:3] for r in g] + groups[0])
    write_export(tmp_path / "b.parquet", [broken, *[r for g in groups[3:] for r in g]])
    data = open_data(config(tmp_path, epochs=2))
    steps = run(data)
    # per epoch: 5 groups at K=2 -> 2, 2, 1; the duplicate of g0 and the half batch dropped each epoch
    assert [len(s) for s in steps] == [8, 8, 4] * 2
    expected = sorted(sample_ids(r for g in groups for r in g))
    assert sorted(sum(steps[:3], [])) == expected and sorted(sum(steps[3:], [])) == expected
    assert data.dropped == {"record_duplicate_batch": 2, "record_parts_never_completed": 2}
    assert data.state()["epoch"] == 2 and data.state()["offsets"] == {}


def test_resume_from_a_checkpoint_state_trains_nothing_twice(tmp_path: Path) -> None:
    groups = [group(f"g{i}", seed=i, parts=2 if i % 2 else 1) for i in range(6)]
    write_export(tmp_path / "a.parquet", [r for g in groups for r in g])
    cfg = config(tmp_path / "a.parquet", epochs=2)
    whole = run(open_data(cfg))

    first = open_data(cfg)
    before = run(first, steps=4)  # epoch 2, one step in
    stored = json.loads(json.dumps(first.state()))  # as a checkpoint keeps it
    assert stored["epoch"] == 1
    resumed = open_data(cfg, stored)
    assert before + run(resumed) == whole

    # another --epochs on the same dataset continues from the epochs done; another dataset starts at epoch 0
    done = json.loads(json.dumps(resumed.state()))
    assert open_data(config(tmp_path / "a.parquet", epochs=3), done).epoch == 2
    assert open_data(config(tmp_path / "a.parquet", epochs=2), done).finished
    assert open_data(config(str(tmp_path / "*.parquet"), epochs=2), done).epoch == 0


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(OfflineError, match="no such file or folder"):
        parquet_files(str(tmp_path / "missing"))
    with pytest.raises(OfflineError, match="no Parquet files there"):
        parquet_files(str(tmp_path))
    (tmp_path / "notes.parquet").write_text("hello")
    with pytest.raises(OfflineError, match="notes.parquet is not a readable Parquet file"):
        asyncio.run(open_dataset(config(tmp_path / "notes.parquet"), None))
    spans = tmp_path / "spans" / "s.parquet"
    spans.parent.mkdir()
    write_export(spans, [EXAMPLES["Span"]], kind="spans")
    with pytest.raises(OfflineError, match="an export of spans, not batches"):
        asyncio.run(open_dataset(config(spans), None))

    # the run's own dataset, changed on disk since its checkpoint
    (tmp_path / "d").mkdir()
    path = write_export(tmp_path / "d" / "a.parquet", group("g0", seed=0))
    cfg = config(path)
    stored = open_data(cfg).state()
    path.unlink()
    write_export(path, [r for i in range(2) for r in group(f"h{i}", seed=i)])
    with pytest.raises(OfflineError, match="differ from those the run's checkpoint trained on"):
        asyncio.run(open_dataset(cfg, stored))
