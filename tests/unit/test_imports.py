"""The package's import graph: no cycles (not even behind a function-level import), the layering
docs/architecture.md describes ("Code layout"), and every module importable first in a fresh
interpreter, in any order.

Why both a static and a runtime check: a cycle hidden behind an import inside a function works
until someone moves that import to the top; the static graph sees it today. The runtime check
proves the graph is what Python actually does.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# pyproject's [tool.setuptools.package-dir]: folder -> import name.
PACKAGE_DIRS = {
    "boltstream": "boltstream", "schemas": "boltstream.schemas", "producers": "boltstream.producers",
    "inference": "boltstream.inference", "streams": "boltstream.streams", "learner": "boltstream.learner",
    "examples": "boltstream.examples",
}
# Needs an optional extra that a CPU install does not have (vLLM: GPU only); imported only with
# `serve --backend vllm`.
OPTIONAL = {"boltstream.inference.vllm_backend": "vllm"}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for n in ast.walk(node))
    return inside


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, bool]]:
    """(imported module of ours, executed when the module is imported?) for every import statement,
    in functions and under ``if TYPE_CHECKING:`` too: a cycle that only type hints close is still a
    cycle (the two modules cannot be understood, or split, one without the other)."""
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_nodes(tree)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                   for n in ast.walk(f)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            if target in known and target != name:
                yield target, id(node) not in in_function and id(node) not in typing_only


def graph(top_level_only: bool = False) -> dict[str, set[str]]:
    mods = modules()
    return {name: {t for t, top in imports_of(name, path, set(mods)) if top or not top_level_only}
            for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in edges.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_package_has_no_import_cycle_even_behind_function_level_or_type_checking_imports() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_records_layer_depends_on_nothing_else_in_boltstream() -> None:
    edges = graph()
    for name in edges:
        if name.startswith("boltstream.schemas"):
            outside = {t for t in reachable(edges, name) if not t.startswith("boltstream.schemas")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_the_learner_never_imports_the_stream_app() -> None:
    edges = graph()
    for name in edges:
        if name.startswith("boltstream.learner"):
            streams = {t for t in reachable(edges, name) if t.startswith("boltstream.streams")}
            assert not streams, f"{name} reaches {sorted(streams)}"


def _third_party(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_an_agent_process_loads_no_torch_through_producers() -> None:
    # What an agent imports at top level, transitively through our modules, never pulls torch.
    mods, top = modules(), graph(top_level_only=True)
    for name in (n for n in mods if n.startswith("boltstream.producers")):
        heavy = {m for m in reachable(top, name) | {name} if "torch" in _third_party(m, mods[m])}
        assert not heavy, f"importing {name} imports torch through {sorted(heavy)}"


RUNTIME = textwrap.dedent('''
    import importlib, json, os, random, sys
    names, optional = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    # Third-party libraries first, so each fork below starts with none of our modules loaded but
    # does not pay for torch again: what "first import in a fresh interpreter" means for us.
    for lib in ("torch", "transformers", "peft", "faust", "fastapi", "uvicorn", "aiokafka", "fastavro",
                "opentelemetry.sdk.trace", "prometheus_client", "minio", "safetensors", "yaml", "httpx"):
        importlib.import_module(lib)
    assert not [m for m in sys.modules if m.startswith("boltstream")]

    def start(order):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for name in order:
                    try:
                        importlib.import_module(name)
                    except ImportError as exc:
                        if optional.get(name) is None or optional[name] not in str(exc):
                            raise
            except BaseException as exc:
                where = order[0] if len(order) == 1 else f"a random order of {len(order)} modules"
                sys.stderr.write(f"{where}: {type(exc).__name__}: {exc}\\n")
                code = 1
            os._exit(code)
        return pid

    # as many forks at a time as there are cores: each is independent of the others
    jobs = [(n, [n]) for n in names]
    jobs += [(f"order {seed}", random.Random(seed).sample(names, len(names))) for seed in range(3)]
    running, failed = {}, []
    while jobs or running:
        while jobs and len(running) < (os.cpu_count() or 1):
            label, order = jobs.pop(0)
            running[start(order)] = label
        pid, status = os.wait()
        label = running.pop(pid, None)  # None: a child some library started, not ours
        if label is not None and status != 0:
            failed.append(label)
    print(json.dumps(failed))
''')


def test_every_module_imports_first_in_a_fresh_interpreter_and_in_any_order() -> None:
    names = sorted(modules())
    proc = subprocess.run([sys.executable, "-c", RUNTIME, json.dumps(names), json.dumps(OPTIONAL)],
                          capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], proc.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(OPTIONAL))
def test_optional_modules_exist(name: str) -> None:
    assert name in modules()
