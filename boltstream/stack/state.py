"""The stack's state file: where it lives, how it is written, and what it means to other processes.

``start_stack`` records addresses, pids (with their start times), credentials
and log paths here; every other command finds the stack through it
(:func:`boltstream.config.load` reads it), so nothing is configured by hand.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from boltstream.config import DEFAULT_STATE_FILE, ENV_PREFIX, Settings
from boltstream.processes import pid_alive

STATE_VERSION = 1
CREDENTIALS_ENV = {
    "access_key": f"{ENV_PREFIX}S3_ACCESS_KEY",
    "secret_key": f"{ENV_PREFIX}S3_SECRET_KEY",
}


def resolve_state_file(state_file: str | os.PathLike[str] | None = None) -> Path:
    """Explicit path > BOLTSTREAM_STATE_FILE > .boltstream/stack.json (relative to the cwd)."""
    return Path(state_file or os.environ.get(f"{ENV_PREFIX}STATE_FILE") or DEFAULT_STATE_FILE)


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Atomic write so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(state, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(state_file: Path) -> Iterator[None]:
    """Serialise up/down on one state file, so two concurrent ``up`` never start two stacks."""
    state_file.parent.mkdir(parents=True, exist_ok=True)
    with open(state_file.with_name(state_file.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def state_pids(state: dict[str, Any]) -> list[int]:
    """Every pid a state records."""
    return [int(p) for p in state.get("pids", {}).values()]


def alive(state: dict[str, Any]) -> dict[str, bool]:
    """Each recorded process's liveness, by name (a recycled pid counts as dead)."""
    starts = state.get("proc_starts", {})
    return {name: pid_alive(int(pid), starts.get(name)) for name, pid in state.get("pids", {}).items()}


def settings_from_state(state: dict[str, Any], **overrides: Any) -> Settings:
    """Settings for a stack state (no env vars consulted): what tests and the demo use."""
    fields = {k: state[k] for k in Settings.from_state if k in state}
    if "state_file" in state:
        fields["state_file"] = state["state_file"]
    fields.update(overrides)
    return Settings(**fields)


def settings_env(settings: Settings, state_file: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """``BOLTSTREAM_*`` variables that make any process resolve to ``settings`` (what ``stack env`` prints)."""
    env = {f"{ENV_PREFIX}{name.upper()}": str(getattr(settings, name)) for name in Settings.from_state
           if getattr(settings, name) is not None}
    if state_file is not None:
        env[f"{ENV_PREFIX}STATE_FILE"] = str(Path(state_file).resolve())
    return env
