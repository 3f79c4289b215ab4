"""The repository's own promises: the README's test command is what CI runs, lint first."""

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


def lint_order(command: str) -> list[str]:
    """What must hold of a test command for CI to enforce the habits (docs/architecture.md)."""
    steps = [step.strip() for step in command.split("&&")]
    problems = []
    installs = [s for s in steps if s.startswith("pip install")]
    if not installs or not re.search(r"\.\[[^\]]*\blint\b", installs[0]):
        problems.append("the install lacks the lint extra (.[test,lint])")
    if "-c ci/constraints-cpu.txt" not in (installs[0] if installs else ""):
        problems.append("the install does not pin through ci/constraints-cpu.txt")
    lint = [i for i, s in enumerate(steps) if s.split()[-1:] == ["ci/lint.sh"]]
    tests = [i for i, s in enumerate(steps) if "-m pytest" in s]
    if not lint:
        problems.append("ci/lint.sh is not a step")
    elif not tests or lint[0] > tests[0]:
        problems.append("ci/lint.sh does not run before the tests")
    return problems


def test_ci_lints_before_the_tests_with_the_pinned_tools() -> None:
    assert lint_order(readme_test_command()) == []


def test_the_lint_order_rule_catches_a_command_without_lint() -> None:
    # Negative controls: the command before the lint step, and lint after the tests.
    assert lint_order(
        'pip install -c ci/constraints-cpu.txt -e ".[test]" && python -m pytest -m cpu'
    ) == ["the install lacks the lint extra (.[test,lint])", "ci/lint.sh is not a step"]
    assert lint_order(
        'pip install -c ci/constraints-cpu.txt -e ".[test,lint]" && '
        "python -m pytest -m cpu && bash ci/lint.sh"
    ) == ["ci/lint.sh does not run before the tests"]


def test_ci_script_is_strict_and_executable() -> None:
    script = ROOT / ".ci" / "run"
    assert script.stat().st_mode & 0o111, ".ci/run must be executable"
    assert "set -euo pipefail" in script.read_text()
