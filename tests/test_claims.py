"""The claims package: each claim a folder of check families (or one module), listed once.

:data:`fsdp_conformance.claims.CLAIM_MODULES` is the one list: ``run``, the reports and these
tests read it, and every claim it names has its page in docs/ and its place in
docs/architecture.md. That each claim knows only the check contract (no claim imports another)
is an import rule: tests/test_architecture.py; that every claim in ``claims/`` is listed, a
convention rule: tests/test_check_convention.py.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from fsdp_conformance import claims
from fsdp_conformance.claims.check import Check

DOCS = Path(__file__).resolve().parents[1] / "docs"
CLAIM_NAMES = [m.rsplit(".", 1)[1] for m in claims.CLAIM_MODULES]


def test_all_checks_are_the_claim_modules_checks_in_report_order() -> None:
    assert CLAIM_NAMES[:3] == ["wrap", "init", "memory"]  # the brief's claims lead the report
    expected: list[Check] = []
    for name in claims.CLAIM_MODULES:
        module_checks = importlib.import_module(name).CHECKS
        assert module_checks, f"{name} registers no checks"
        expected.extend(module_checks)
    assert claims.all_checks() == expected
    prefixes = [c.name.split(".")[0] for c in claims.all_checks()]
    assert prefixes == sorted(prefixes, key=CLAIM_NAMES.index)


def test_every_listed_claim_has_its_docs_page_and_its_place_in_the_architecture() -> None:
    architecture = (DOCS / "architecture.md").read_text(encoding="utf-8")
    for name in CLAIM_NAMES:
        page = "wrapping.md" if name == "wrap" else f"{name}.md"
        assert (DOCS / page).is_file(), f"claim {name!r} has no docs/{page}"
        assert f"{name}/" in architecture or f"{name}.py" in architecture, name
