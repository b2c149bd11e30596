"""docs/architecture.md's module map ("Code layout") matches the package: every module has one line, and
every line names a module that exists.

Which modules: the ones the package is built from, found as tests/unit/test_imports.py finds them (every
``.py`` under the folders of pyproject's ``[tool.setuptools.package-dir]``); a test here checks that this
is exactly what setuptools packages, so the map cannot miss a module the wheel ships.

The rule for ``__init__.py``: it has a line when it holds code besides its docstring and ``from
__future__`` imports (re-exports, lazily resolved names); an empty or docstring-only ``__init__.py``
has none, and a line for one is an error.

A line is ``- `<path from the repository root>`: <what it holds>``, under the ``### `<folder>/` ...``
heading of the module's folder. Nothing here imports the package (no torch): it reads files only.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections import Counter
from pathlib import Path

from tests.unit.test_imports import REPO, modules

DOC = REPO / "docs" / "architecture.md"
SECTION = "## Code layout"
ENTRY = re.compile(r"^- `([^`]+\.py)`: *(.*)$")
FOLDER_HEADING = re.compile(r"^### `([^`]+)/`")
PY_PATH = re.compile(r"`([^`\s]*/[^`\s]*\.py)`")  # a path: a bare `__init__.py` is a kind of file


def holds_code(source: str) -> bool:
    """Whether a module has a statement besides its docstring and ``from __future__`` imports."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return any(not (isinstance(node, ast.ImportFrom) and node.module == "__future__") for node in body)


def mapped_modules() -> dict[str, str]:
    """Path from the repository root -> module name, for every module that must have a line."""
    return {path.relative_to(REPO).as_posix(): name for name, path in modules().items()
            if path.name != "__init__.py" or holds_code(path.read_text())}


def section_lines() -> list[str]:
    text = DOC.read_text()
    assert f"\n{SECTION}\n" in text, f"docs/architecture.md has no '{SECTION}' section"
    section = text.split(f"\n{SECTION}\n", 1)[1]
    return re.split(r"^## ", section, maxsplit=1, flags=re.MULTILINE)[0].splitlines()


def entries() -> list[tuple[str | None, str, str]]:
    """(folder of the heading above, path, description) for every module line of the section."""
    found, folder = [], None
    for line in section_lines():
        if line.startswith("#"):
            heading = FOLDER_HEADING.match(line)
            folder = heading.group(1) if heading else None
        elif m := ENTRY.match(line):
            found.append((folder, m.group(1), m.group(2).strip()))
    assert found, f"no '- `path.py`: ...' lines in '{SECTION}': the map's format changed, this test no longer reads it"
    return found


def setuptools_modules() -> dict[str, Path]:
    """Module name -> file, for every module of every package pyproject lists (what the wheel ships)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = config["package-dir"]
    found: dict[str, Path] = {}
    for package in config["packages"]:
        parts = package.split(".")
        root = next(i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in package_dir)
        folder = REPO / package_dir[".".join(parts[:root])] / Path(*parts[root:])
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def test_the_modules_enumerated_are_the_modules_setuptools_packages() -> None:
    enumerated = {name: path.resolve() for name, path in modules().items()}
    built = {name: path.resolve() for name, path in setuptools_modules().items()}
    assert sorted(set(enumerated) - set(built)) == [], "modules under a package folder that pyproject does not package"
    assert sorted(set(built) - set(enumerated)) == [], "packaged modules that tests/unit/test_imports.py does not find"
    assert {n: p for n, p in enumerated.items() if built[n] != p} == {}


def test_the_init_rule() -> None:
    assert not holds_code("")
    assert not holds_code('"""A package."""\n')
    assert not holds_code('"""A package."""\n\nfrom __future__ import annotations\n')
    assert holds_code('"""A package."""\n\nfrom .codec import Codec\n')
    assert holds_code("__all__ = []\n")


def test_every_package_module_has_a_line() -> None:
    documented = {path for _, path, _ in entries()}
    missing = sorted(set(mapped_modules()) - documented)
    assert missing == [], (f"docs/architecture.md ('{SECTION}') has no line for these modules; add "
                           f"'- `<path>`: <what it holds>' under its folder's heading: {missing}")


def test_every_line_names_a_module_of_the_package() -> None:
    mapped = mapped_modules()
    documented = {path for _, path, _ in entries()}
    absent = sorted(p for p in documented if not (REPO / p).is_file())
    assert absent == [], f"docs/architecture.md ('{SECTION}') names module files that do not exist: {absent}"
    not_mapped = sorted(p for p in documented if p not in mapped)
    assert not_mapped == [], (f"docs/architecture.md ('{SECTION}') has lines for files that are not package "
                              f"modules, or docstring-only __init__.py files: {not_mapped}")


def test_one_line_per_module_under_its_folder_heading() -> None:
    found = entries()
    twice = sorted(p for p, n in Counter(path for _, path, _ in found).items() if n > 1)
    assert twice == [], f"modules with more than one line: {twice}"
    misplaced = [f"{path} (under {folder!r})" for folder, path, _ in found if folder != Path(path).parent.as_posix()]
    assert misplaced == [], f"lines not under the '### `<folder>/`' heading of their module's folder: {misplaced}"
    empty = [path for _, path, text in found if not text]
    assert empty == [], f"lines that do not say what the module holds: {empty}"


def test_every_python_path_the_section_names_exists() -> None:
    # the prose too, not only the module lines: a path in a sentence goes stale as easily
    named = {p for line in section_lines() for p in PY_PATH.findall(line)}
    assert sorted(p for p in named if not (REPO / p).is_file()) == [], \
        f"'{SECTION}' names .py paths (from the repository root) that do not exist"
