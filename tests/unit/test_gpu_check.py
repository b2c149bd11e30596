"""benchmarks/gpu_check.sh runs only on a GPU machine: here, everything about it that can rot unseen is checked.

Its syntax (``bash -n``), every repository path it names, every make target it calls (``make -n``
with the same variables), that each part it lists has a branch printing PASS/FAIL under that name,
and the Python it writes out: it compiles, and every name it imports from boltstream or from a
benchmark exists.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
TEXT = SCRIPT.read_text()
HEREDOC = re.compile(r'^cat >"\$WORK/(?P<name>[\w.]+)" <<\'PY\'\n(?P<body>.*?)^PY$', re.M | re.S)


def _assignments() -> dict[str, str]:
    """The script's plain ``NAME=value`` lines (``${VAR:-default}`` taken as its default)."""
    out = {}
    for m in re.finditer(r"^([A-Z_]+)=(\S+)", TEXT, re.M):
        value = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", m.group(2))
        out[m.group(1)] = value
    return out


def _expand(word: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), word.strip('"'))


def test_the_script_parses() -> None:
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_every_path_it_names_exists() -> None:
    paths = set(re.findall(r"\b((?:benchmarks|tests|learner|inference|boltstream)/[\w./-]*\w)", TEXT))
    assert {"benchmarks/bench_serving.py", "benchmarks/bench_reload.py", "tests/vllm"} <= paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"gpu_check.sh names paths that do not exist: {missing}"


def test_every_make_target_it_calls_exists() -> None:
    values = _assignments()
    calls = [line.split("make", 1)[1] for line in TEXT.splitlines()
             if re.search(r"\brun [\w-]+ \d+ make ", line)]
    assert len(calls) == 2  # the main virtualenv and the vLLM one
    for call in calls:
        words = [_expand(w, values) for w in shlex.split(call.split(";;")[0]) if not w.startswith("-")]
        target, variables = words[0], words[1:]
        r = subprocess.run(["make", "-n", "-C", str(ROOT), target, *variables], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, f"make {target}: {r.stderr}"


def test_every_part_prints_pass_or_fail_under_its_own_name() -> None:
    parts = re.search(r"^ALL_PARTS=\(([^)]*)\)", TEXT, re.M).group(1).split()
    assert parts
    for part in parts:
        assert re.search(rf"^\s+{re.escape(part)}\) run {re.escape(part)} \d+ ", TEXT, re.M), part
    assert 'echo "PASS $name' in TEXT and 'echo "FAIL $name' in TEXT
    assert TEXT.rstrip().endswith('[ "${#FAILED[@]}" -eq 0 ]')  # the exit status says whether any failed


@pytest.mark.parametrize("name", [m.group("name") for m in HEREDOC.finditer(TEXT)])
def test_its_python_compiles_and_imports_what_exists(name: str) -> None:
    body = next(m.group("body") for m in HEREDOC.finditer(TEXT) if m.group("name") == name)
    tree = ast.parse(body, filename=name)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.module is None:
                continue
            if not (node.module.startswith("boltstream") or node.module.startswith("bench_")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{name}: {node.module} has no {alias.name}"
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_three_python_parts_are_written_out() -> None:
    assert sorted(m.group("name") for m in HEREDOC.finditer(TEXT)) == [
        "deepspeed_step.py", "learner_tree.py", "vllm_platform.py"]
