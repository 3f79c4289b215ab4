"""The complexity rule (pyproject ``[tool.ruff.lint.mccabe]``) holds and can fail.

Pure static checks through ruff (no torch, no ranks). ruff is a development dependency; where it
is missing the ruff tests skip with that reason (tox's lint environment always has it).
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import textwrap

import pytest

pytestmark = pytest.mark.cpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff")
needs_ruff = pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install ruff)")


def _c901(*paths: str | pathlib.Path) -> str:
    assert RUFF is not None
    done = subprocess.run(
        [RUFF, "check", "--config", str(ROOT / "pyproject.toml"), "--select", "C90",
         "--output-format", "concise", "--no-cache", *map(str, paths)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
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
    paths = [*ROOT.glob("fsdp_conformance/**/*.py"), *ROOT.glob("tests/*.py"),
             *ROOT.glob("benchmarks/*.py")]
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
