"""CI runs exactly the README's test command: ``.ci/run`` installs nothing itself.

An install step in ``.ci/run`` would hide one that ``make test`` lacks: CI would be
green while the README's command fails on a new machine.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_test_command() -> str:
    block = (REPO / "README.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if "test" in line]
    assert len(commands) == 1, f"the README's set-up block names no single test command: {commands}"
    return commands[0]


def ci_commands() -> list[str]:
    """The commands ``.ci/run`` runs: lines that are not comments, shell options or the cd to the checkout."""
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert lines[0].startswith("#!"), ".ci/run has no shebang line"
    setup = re.compile(r"^(set -[euxo pifal]+|cd \"\$\(dirname \"\$0\"\)/\.\.\")$")
    return [line.strip() for line in lines[1:]
            if line.strip() and not line.strip().startswith("#") and not setup.match(line.strip())]


def test_ci_runs_the_readme_test_command_and_nothing_else() -> None:
    assert ci_commands() == [readme_test_command()] == ["make test"]


def test_make_test_installs_the_system_packages_itself() -> None:
    makefile = (REPO / "Makefile").read_text()
    test_target = re.search(r"^test: (.*)$", makefile, re.M)
    assert test_target and "system" in test_target.group(1).split(), "make test does not depend on `system`"
    packages = re.search(r"^SYSTEM_PKGS := (.*)$", makefile, re.M)
    assert packages and {"prometheus", "libtcmalloc-minimal4"} <= set(packages.group(1).split())
