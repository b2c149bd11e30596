"""The README's "Files" section matches the tree: what it names exists, and every folder of the
repository, every ``boltstream`` subpackage and every ``boltstream`` core module is named.

A newcomer reads that section first; a module added without a line there is invisible to them.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Top-level folders that hold no project files of their own.
NOT_LISTED = {"build", "dist", "out"}


def files_block() -> str:
    text = (REPO / "README.md").read_text()
    assert "## Files" in text, "README.md has no Files section"
    return text.split("## Files", 1)[1].split("```")[1]


def named_folders(block: str) -> tuple[set[str], set[str]]:
    """(top-level folders, subfolders of boltstream/) as the block's lines start with them."""
    top, sub = set(), set()
    for line in block.splitlines():
        if m := re.match(r"^(\w[\w.-]*)/\s", line):
            top.add(m.group(1))
        elif m := re.match(r"^  (\w+)/\s", line):
            sub.add(m.group(1))
    return top, sub


def test_every_named_folder_and_module_exists() -> None:
    block = files_block()
    top, sub = named_folders(block)
    assert top and sub, "the Files block's layout changed: this test no longer reads it"
    assert [t for t in top if not (REPO / t).is_dir()] == []
    assert [s for s in sub if not (REPO / "boltstream" / s).is_dir()] == []
    for module in set(re.findall(r"\b(\w+\.py)\b", block)):
        found = [p for p in REPO.rglob(module) if ".venv" not in p.parts]
        assert found, f"README's Files section names {module}, which is not in the repository"


def test_every_folder_subpackage_and_core_module_is_named() -> None:
    block = files_block()
    top, sub = named_folders(block)
    folders = {p.name for p in REPO.iterdir()
               if p.is_dir() and not p.name.startswith((".", "_")) and not p.name.endswith(".egg-info")}
    assert folders - NOT_LISTED - top == set(), "top-level folders missing from README's Files section"
    packages = {p.parent.name for p in (REPO / "boltstream").glob("*/__init__.py")}
    assert packages - sub == set(), "boltstream subpackages missing from README's Files section"
    modules = {p.name for p in (REPO / "boltstream").glob("*.py") if p.name != "__init__.py"}
    assert {m for m in modules if m not in block} == set(), "boltstream modules missing from README's Files"
