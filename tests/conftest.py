"""Shared pytest wiring.

* Every test under ``tests/integration`` is marked ``integration`` automatically,
  so ``pytest -m "not integration"`` gives the fast unit tier.
* ``stack`` (session) starts ONE real embedded stack (Tansu broker + moto S3) for
  the whole run and always stops it, leaving no process behind. It lives here,
  not only in ``tests/integration``, so a test anywhere that asks for it gets
  the same stack (and is marked ``integration`` too).
* ``settings`` (function) is a :class:`boltstream.config.Settings` pointing at
  that stack with a namespace of its own (``t<8 hex>.``): every test gets fresh
  topics, already created, and the bucket exists.
* ``settings_env`` (function) is the environment for a subprocess that must see
  exactly those settings (``BOLTSTREAM_*`` variables, no state file).

Nothing here ever skips: a missing broker binary or moto fails the run loudly,
because an integration tier that silently skips proves nothing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from boltstream.cli import OMP_WAIT_POLICY
from boltstream.config import Settings

# Two pytest workers share two cores with the processes the integration tests start: torch's OpenMP
# threads in this process sleep when they wait, as in every boltstream process (boltstream/cli.py).
os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)

INTEGRATION_DIR = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        in_dir = INTEGRATION_DIR in Path(str(item.fspath)).parents
        uses_stack = "stack" in getattr(item, "fixturenames", ())
        if in_dir or uses_stack:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The running embedded stack's state (as written to its state file)."""
    from boltstream import stack as stack_mod
    from boltstream.processes import pid_alive

    state_file = tmp_path_factory.mktemp("stack") / "stack.json"
    state = stack_mod.start_stack(state_file=state_file, die_with_parent=True)
    try:
        yield state
    finally:
        stack_mod.stop_stack(state_file)
        alive = [pid for pid in stack_mod.state_pids(state) if pid_alive(pid)]
        assert not alive, f"embedded stack left processes behind: {alive}"


@pytest.fixture(scope="session")
def stack_settings(stack: dict[str, Any]) -> Settings:
    """Settings for the session stack with its default namespace (topics created by start_stack)."""
    from boltstream.stack import settings_from_state

    return settings_from_state(stack)


@pytest.fixture
def settings(stack: dict[str, Any]) -> Settings:
    """Settings for the session stack with a namespace of this test's own; topics and bucket exist."""
    from boltstream import s3
    from boltstream.broker.topics import ensure_topics
    from boltstream.stack import run_sync, settings_from_state

    cfg = settings_from_state(stack, namespace=f"t{uuid.uuid4().hex[:8]}.")
    run_sync(ensure_topics(cfg))
    s3.ensure_bucket(s3.make_client(cfg), cfg.s3_bucket)
    return cfg


@pytest.fixture
def settings_env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    """Environment for a subprocess (``boltstream ...``, an agent) that must use ``settings``.

    Starts from ``os.environ`` minus any ``BOLTSTREAM_*`` the developer's shell
    had, then sets every variable ``boltstream stack env`` would, plus a state
    file path that does not exist so no stray ``.boltstream/stack.json`` in
    the working directory can leak in, and a state directory of the test's own
    (the runner's and the worker's default spool live there).
    """
    from boltstream.stack import settings_env as to_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("BOLTSTREAM_")}
    env.update(to_env(settings))
    env["BOLTSTREAM_STATE_FILE"] = str(tmp_path / "no-stack.json")
    env["XDG_STATE_HOME"] = str(tmp_path / "state")  # the runner's and worker's default spool: per test
    return env
