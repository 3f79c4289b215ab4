"""The complexity rule (pyproject ``[tool.ruff.lint.mccabe]``) holds and can fail; the
repetition rule (``[tool.pylint]``, which ci/lint.sh runs on the package) can fail.

Pure static checks through ruff and pylint (no torch, no ranks), both from the environment the
tests run in (ruff's own binary, ``python -m pylint``), never from whatever PATH has: both are in
the test extra, so the CPU lane has them; only an install without that extra skips these tests,
with that reason.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.cpu

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff_bin() -> str | None:
    """The binary of the ``ruff`` package installed beside these tests, None without one."""
    try:
        from ruff.__main__ import find_ruff_bin
    except ImportError:
        return None
    try:
        return str(find_ruff_bin())
    except FileNotFoundError:
        return None


def _has_pylint() -> bool:
    try:
        import pylint  # noqa: F401
    except ImportError:
        return False
    return True


RUFF = _ruff_bin()
MISSING = "{} is not installed beside pytest: pip install -e '.[test]' (the test extra has it)"
needs_ruff = pytest.mark.skipif(RUFF is None, reason=MISSING.format("ruff"))
needs_pylint = pytest.mark.skipif(not _has_pylint(), reason=MISSING.format("pylint"))


def _c901(*paths: str | pathlib.Path) -> str:
    assert RUFF is not None
    done = subprocess.run(
        [
            RUFF,
            "check",
            "--config",
            str(ROOT / "pyproject.toml"),
            "--select",
            "C90",
            "--output-format",
            "concise",
            "--no-cache",
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    return done.stdout + done.stderr


@needs_ruff
def test_no_function_in_the_package_is_over_the_complexity_limit() -> None:
    out = _c901("fsdp_conformance", "tests", "benchmarks")
    assert "C901" not in out, out


@needs_ruff
def test_the_limit_is_twelve_and_catches_a_function_over_it(tmp_path: pathlib.Path) -> None:
    # Negative control: 13 branches is one over the documented limit, 11 one under it.
    def module(branches: int) -> str:
        body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(branches))
        return f"def f(x):\n{body}    return -1\n"

    (tmp_path / "over.py").write_text(module(12))  # complexity 13
    (tmp_path / "under.py").write_text(module(11))  # complexity 12
    out = _c901(tmp_path / "over.py", tmp_path / "under.py")
    assert re.search(r"over\.py:1:5: C901 `f` is too complex \(13 > 12\)", out), out
    assert "under.py" not in out, out


def _bare_exemptions(text: str) -> list[int]:
    """Line numbers of ``noqa: C901`` comments that give no ``- <reason>``."""
    bare = []
    for n, line in enumerate(text.splitlines(), 1):
        m = re.search(r"#\s*noqa:\s*C901\b(.*)", line)
        if m and not re.match(r"\s*-\s*\S", m.group(1)):
            bare.append(n)
    return bare


def test_every_complexity_exemption_gives_its_reason() -> None:
    paths = [
        *ROOT.glob("fsdp_conformance/**/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("benchmarks/*.py"),
    ]
    bare = [f"{p.relative_to(ROOT)}:{n}" for p in paths for n in _bare_exemptions(p.read_text())]
    assert not bare, f"noqa: C901 without ' - <reason>': {bare}"


def test_the_exemption_rule_catches_a_bare_noqa() -> None:
    noqa = "# noqa" + ": C901"  # split, so that this file's own scan does not see it
    text = textwrap.dedent(f"""\
        def f(x):  {noqa}
            pass
        def g(x):  {noqa} - a flat table
            pass
        """)
    assert _bare_exemptions(text) == [1]


def _repeated_blocks(*paths: str | pathlib.Path) -> str:
    """pylint's duplicate-code report with pyproject's ``[tool.pylint]`` (the rule alone)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pylint",
            "--rcfile",
            str(ROOT / "pyproject.toml"),
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    return done.stdout + done.stderr


@needs_pylint
def test_the_repetition_rule_is_six_lines_of_code(tmp_path: pathlib.Path) -> None:
    # Negative control: six common lines of code are one block, five are none; the same
    # imports, module docstrings and signatures around them count for nothing.
    imports = "".join(f"import {m}\n" for m in ("os", "sys", "json", "re", "math", "time"))
    doc = '"""One of two modules.\n\nA docstring long enough\nto span\nsix lines\nor more.\n"""\n'

    def module(name: str, common: int) -> str:
        body = "".join(f"    total = total * {i} + 1\n" for i in range(common))
        return (
            f"{doc}{imports}\n\ndef f(a, b, c):\n    total = len({name!r})\n{body}"
            f"    return total, {name!r}\n"
        )

    for common in (5, 6):
        for name in ("one", "two"):
            (tmp_path / f"{name}_{common}.py").write_text(module(name, common))
    six = _repeated_blocks(tmp_path / "one_6.py", tmp_path / "two_6.py")
    # The block is the six common lines (0-based [17:23]), nothing around them.
    assert six.count("R0801") == 1 and "==one_6:[17:23]" in six, six
    five = _repeated_blocks(tmp_path / "one_5.py", tmp_path / "two_5.py")
    assert "R0801" not in five, five
