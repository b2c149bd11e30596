"""What ``learn --offline SOURCE`` names: exported batches Parquet files or a topic.

Kept apart from the offline reader so that the learner's config can refuse a missing
source before the model loads without importing the training stack.
"""

from __future__ import annotations

import glob
from pathlib import Path

from boltstream.errors import BoltstreamError

TOPIC_PREFIX = "topic:"
PARQUET_SUFFIXES = (".parquet", ".pq")


class OfflineError(BoltstreamError):
    """The offline dataset cannot be read, or is not the one the run's checkpoint trained on."""


def parquet_files(source: str) -> list[Path]:
    """The Parquet files ``source`` names: a file, a folder's ``*.parquet``, or a glob; in name order."""
    path = Path(source)
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.suffix.lower() in PARQUET_SUFFIXES and f.is_file())
    elif any(ch in source for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(source, recursive=True) if Path(f).is_file())
    elif path.is_file():
        files = [path]
    else:
        raise OfflineError(f"--offline {source}: no such file or folder (exported batches Parquet: a file, a folder, "
                           f"a glob; or {TOPIC_PREFIX}<full topic name>)")
    if not files:
        raise OfflineError(f"--offline {source}: no Parquet files there")
    return files
