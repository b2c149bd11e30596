"""The check every library fence's test makes: the installed version of each distribution is one its
contract was checked with (the fence's ``CHECKED_WITH``)."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def assert_checked(fence: ModuleType, dist: str) -> None:
    installed, checked = version(dist), fence.CHECKED_WITH[dist]
    file = Path(fence.__file__ or fence.__name__)
    path = file.relative_to(REPO) if file.is_relative_to(REPO) else file
    assert installed in checked, (
        f"{dist} {installed} is installed, but {path} was checked with {', '.join(checked)} only: check the "
        "contract in its docstring against this version, then add it to CHECKED_WITH")
