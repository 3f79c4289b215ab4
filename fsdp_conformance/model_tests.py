"""The conformance checks as pytest tests, on the reference models or on the user's model.

The plugin adds this module to the session when ``--fsdp-model`` is given, so
``pytest -m cpu --fsdp-model mypkg.model:build --fsdp-block-cls Block`` runs every claim on the
user's model. Without ``--fsdp-model`` it runs the reference suite:
``pytest -m cpu --pyargs fsdp_conformance.model_tests``.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance import user_model
from fsdp_conformance.claims.check import Check, run_check
from fsdp_conformance.gate import suite
from fsdp_conformance.harness import Ranks


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_check" not in metafunc.fixturenames:
        return
    from fsdp_conformance.plugin import SETTINGS_KEY

    spec = user_model.user_spec(metafunc.config.stash[SETTINGS_KEY])
    pairs = suite.select_checks(suite.all_checks(), spec)
    ids = []
    for check, params in pairs:
        variant = suite.variant_of(params)
        ids.append(f"{check.name}[{variant}]" if variant else check.name)
    metafunc.parametrize("conformance_check", pairs, ids=ids)


def test_conformance(ranks: Ranks, conformance_check: tuple[Check, dict[str, Any]]) -> None:
    check, params = conformance_check
    if ranks.lane not in check.lanes:
        pytest.skip(f"{check.name} runs on the {', '.join(check.lanes)} lane(s) only")
    verdict = run_check(ranks, check, **params)
    assert verdict.passed, verdict.message
