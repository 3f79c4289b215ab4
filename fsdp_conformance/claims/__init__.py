"""The claims: a folder per claim with a module per check family (a small claim may be one
module), each family with its rank functions, verdicts and negative controls, and the claim's
``CHECKS`` in its ``__init__``.

A claim imports the check contract (:mod:`~fsdp_conformance.claims.check`), its own folder and
the shared building blocks beside this folder, never another claim. A new claim goes in a folder
of its own here and in :data:`CLAIM_MODULES`, the one list of claims that ``run``, the reports,
the tests and the docs read (docs/architecture.md, "Where a new piece goes").
"""

from __future__ import annotations

import importlib

from fsdp_conformance.claims.check import Check

#: The claims that contribute checks, in report order.
CLAIM_MODULES = (
    "fsdp_conformance.claims.wrap",
    "fsdp_conformance.claims.init",
    "fsdp_conformance.claims.memory",
    "fsdp_conformance.claims.defaults",
    "fsdp_conformance.claims.state",
    "fsdp_conformance.claims.loop",
    "fsdp_conformance.claims.stack",
)


def all_checks() -> list[Check]:
    """Every registered check (each claim module's ``CHECKS``)."""
    checks: list[Check] = []
    for name in CLAIM_MODULES:
        module = importlib.import_module(name)
        checks.extend(getattr(module, "CHECKS", ()))
    return checks
