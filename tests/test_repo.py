"""The repository's own promises: the README's test command is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- test-command -->", "<!-- /test-command -->"


def readme_test_command() -> str:
    """The one command line in a code block between the test-command markers of README.md."""
    readme = ROOT / "README.md"
    if not readme.is_file():
        pytest.skip("README.md does not exist yet")
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        pytest.skip(f"README.md has no {START} ... {END} markers around its test command yet")
    between = text.split(START, 1)[1].split(END, 1)[0]
    block = re.search(r"```[^\n]*\n(.*?)```", between, re.DOTALL)
    assert block, f"README.md: no code block between {START} and {END}"
    lines = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) == 1, f"README.md: the test command must be one line, found {lines}"
    return lines[0]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    command = readme_test_command()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f"README's test command {command!r} is not a line of .ci/run"


def test_ci_script_is_strict_and_executable() -> None:
    script = ROOT / ".ci" / "run"
    assert script.stat().st_mode & 0o111, ".ci/run must be executable"
    assert "set -euo pipefail" in script.read_text()
