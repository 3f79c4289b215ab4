"""Tests and docs say what holds, not which issue built it.

No test module, no doc page (README.md and docs/; CHANGELOG.md keeps the history, with git log)
and no docstring or comment of the package names an issue number ("issue N", "issues N and
M"). The package's code (its messages included) is not prose read here: only its docstrings
and comments are.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fsdp_conformance"
#: "issue N", "Issues N and M", "issue #N" (N a number); not "tissue N", not "owner/repo#N".
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
FIX = "say what holds (what the test proves, what the code does and why); history is CHANGELOG.md's"


def issue_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line of ``text`` that names an issue number."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if ISSUE.search(line)]


def package_prose(source: str) -> str:
    """A module's docstrings and comments, each on its own line number; code lines left blank."""
    lines = source.splitlines()
    prose = [""] * len(lines)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                end = first.end_lineno or first.lineno
                prose[first.lineno - 1 : end] = lines[first.lineno - 1 : end]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            prose[token.start[0] - 1] = token.string
    return "\n".join(prose)


def prose_files() -> Iterator[tuple[Path, str]]:
    """Each file this rule reads, with the text it reads of it."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        yield path, path.read_text(encoding="utf-8")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        if path.name != "CHANGELOG.md":
            yield path, path.read_text(encoding="utf-8")
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        # Only a module that names an issue somewhere needs parsing (its prose is part of it).
        yield path, package_prose(text) if ISSUE.search(text) else text


def test_no_test_doc_page_or_package_docstring_names_an_issue_number() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line}"
        for path, text in prose_files()
        for n, line in issue_lines(text)
    ]
    assert not found, f"issue numbers in prose ({FIX}):\n" + "\n".join(found)


def test_the_rule_reads_every_kind_of_file() -> None:
    kinds = {path.relative_to(ROOT).parts[0] for path, _ in prose_files()}
    assert kinds == {"tests", "README.md", "docs", "fsdp_conformance"}, kinds


def test_the_issue_rule_catches_an_issue_number_and_passes_plain_prose() -> None:
    # Negative control on synthetic text; the word is assembled so that this module stays clean.
    word = "iss" + "ue"
    assert [n for n, _ in issue_lines(f"a\nThe preflight ({word} 33, item 3).\n")] == [2]
    assert issue_lines(f"Enforced since {word.title()}s 11 and 32") != []
    assert issue_lines(f"{word} #7") != []
    plain = "pytorch/pytorch#153354; a tissue 3 mm thick; known issues: none; item 3"
    assert issue_lines(plain) == []


def test_package_prose_is_docstrings_and_comments_not_code() -> None:
    word = "iss" + "ue"
    source = (
        f'"""The module ({word} 33)."""\n'
        "\n"
        "def f() -> str:\n"
        f'    """What f does, since {word} 12."""\n'
        f"    # a comment naming {word} 5\n"
        f'    return "a message naming {word} 9"  # {word} 6 at the end of a line\n'
    )
    assert [n for n, _ in issue_lines(package_prose(source))] == [1, 4, 5, 6]
    assert "message" not in package_prose(source)
