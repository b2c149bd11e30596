"""Make ``tests.*`` importable however pytest is started.

These tests share fixtures as modules (``tests.unit.schemas.record_examples``, ``tests.golden.regenerate``).
``python -m pytest`` from the repository root already has the root on ``sys.path``; plain ``pytest``
(or a run from another directory) does not, so put it there. A no-op once pytest's
``pythonpath = ["."]`` is configured.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
