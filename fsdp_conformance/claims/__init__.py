"""The claims: one module per claim, each with its rank functions, verdicts and ``CHECKS``.

A claim module imports the check contract (:mod:`~fsdp_conformance.claims.check`) and the
shared building blocks beside this folder, never another claim. A new claim goes in a module of
its own here and in :data:`CLAIM_MODULES`.
"""

from __future__ import annotations

import importlib

from fsdp_conformance.claims.check import Check

#: Claim modules that contribute checks, in report order.
CLAIM_MODULES = (
    "fsdp_conformance.claims.wrap",
    "fsdp_conformance.claims.init",
    "fsdp_conformance.claims.memory",
    "fsdp_conformance.claims.defaults",
    "fsdp_conformance.claims.state",
)


def all_checks() -> list[Check]:
    """Every registered check (each claim module's ``CHECKS``)."""
    checks: list[Check] = []
    for name in CLAIM_MODULES:
        module = importlib.import_module(name)
        checks.extend(getattr(module, "CHECKS", ()))
    return checks
