"""Make ``tests.*`` importable however pytest is started (the span factory is ``tests.unit.streams.factory``)."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
