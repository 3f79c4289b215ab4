"""The claims package: one module per claim, listed once.

That each claim knows only the check contract (no claim imports another) is an import rule:
tests/test_architecture.py.
"""

from __future__ import annotations

import importlib

from fsdp_conformance import claims
from fsdp_conformance.claims.check import Check


def test_all_checks_are_the_claim_modules_checks_in_report_order() -> None:
    assert claims.CLAIM_MODULES == (
        "fsdp_conformance.claims.wrap",
        "fsdp_conformance.claims.init",
        "fsdp_conformance.claims.memory",
        "fsdp_conformance.claims.defaults",
        "fsdp_conformance.claims.state",
    )
    expected: list[Check] = []
    for name in claims.CLAIM_MODULES:
        module_checks = importlib.import_module(name).CHECKS
        assert module_checks, f"{name} registers no checks"
        expected.extend(module_checks)
    assert claims.all_checks() == expected
    prefixes = [c.name.split(".")[0] for c in claims.all_checks()]
    assert prefixes == sorted(prefixes, key=["wrap", "init", "memory", "defaults", "state"].index)
