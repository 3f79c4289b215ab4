"""The conformance checks as pytest tests, on the reference models or on the user's model.

The plugin adds this module to the session when ``--fsdp-model`` is given, so
``pytest -m cpu --fsdp-model mypkg.model:build --fsdp-block-cls Block`` runs every claim on the
user's model. Without ``--fsdp-model`` it runs the reference suite:
``pytest -m cpu --pyargs fsdp_conformance.model_tests``. The plugin parametrizes
``conformance_check`` (one test per selected check and variant); this module imports nothing
from the plugin.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.claims.check import Check, run_check
from fsdp_conformance.harness import Ranks


def test_conformance(ranks: Ranks, conformance_check: tuple[Check, dict[str, Any]]) -> None:
    check, params = conformance_check
    if ranks.lane not in check.lanes:
        pytest.skip(f"{check.name} runs on the {', '.join(check.lanes)} lane(s) only")
    verdict = run_check(ranks, check, **params)
    assert verdict.passed, verdict.message
