"""The claims package: one module per claim, listed once, each knowing only the check contract."""

from __future__ import annotations

import importlib
import pathlib

import pytest
from package_imports import file_imports

import fsdp_conformance
from fsdp_conformance import claims
from fsdp_conformance.claims.check import Check

PACKAGE = pathlib.Path(fsdp_conformance.__file__).parent
CLAIM_FILES = sorted(p.stem for p in (PACKAGE / "claims").glob("*.py")
                     if p.stem not in ("__init__", "check"))


def test_all_checks_are_the_claim_modules_checks_in_report_order() -> None:
    assert claims.CLAIM_MODULES == ("fsdp_conformance.claims.wrap",
                                    "fsdp_conformance.claims.init",
                                    "fsdp_conformance.claims.memory")
    expected: list[Check] = []
    for name in claims.CLAIM_MODULES:
        module_checks = importlib.import_module(name).CHECKS
        assert module_checks, f"{name} registers no checks"
        expected.extend(module_checks)
    assert claims.all_checks() == expected
    prefixes = [c.name.split(".")[0] for c in claims.all_checks()]
    assert prefixes == sorted(prefixes, key=["wrap", "init", "memory"].index)


@pytest.mark.parametrize("claim", CLAIM_FILES)
def test_a_claim_imports_no_other_claim(claim: str) -> None:
    # Shared code lives in a building block beside claims/, never in another claim.
    others = {f"fsdp_conformance.claims.{c}" for c in CLAIM_FILES if c != claim}
    found = file_imports(PACKAGE / "claims" / f"{claim}.py")
    assert not {m for m in found if m in others or m.rsplit(".", 1)[0] in others}, sorted(found)
    assert not {m for m in found if m.startswith(("fsdp_conformance.suite",
                                                   "fsdp_conformance.cli",
                                                   "fsdp_conformance.plugin"))}, sorted(found)


def test_policies_do_not_import_models() -> None:
    # models imports policies (SEED_MIN_PARAMS, block-class resolution); the way back would be
    # the import cycle the seeds' threshold used to close.
    assert not {m for m in file_imports(PACKAGE / "policies.py")
                if m.startswith("fsdp_conformance.models")}
