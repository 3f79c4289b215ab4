"""One check convention (issue 11): names, rank functions, verdicts and how ``CHECKS`` is built.

Pure (no ranks): the registered checks and the claim modules' source.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import fsdp_conformance
from fsdp_conformance.claims import all_checks, init
from fsdp_conformance.claims.check import Check, Verdict, variants
from fsdp_conformance.models import ModelSpec

pytestmark = pytest.mark.cpu

EVERY_CHECK = all_checks() + list(init.SEEDS_CHECKS)
CLAIMS = Path(fsdp_conformance.__file__).parent / "claims"


def _rank(ctx: Any, **params: Any) -> None:
    return None


def _verdict(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    return Verdict(True, "")


@pytest.mark.parametrize("check", EVERY_CHECK, ids=lambda c: c.name)
def test_every_check_follows_the_naming_scheme(check: Check) -> None:
    assert check.claim == check.name.split(".", 1)[0]
    assert "fsdp1" not in check.name and "fsdp2" not in check.name  # the version is a variant
    assert check.rank_fn.__name__.startswith("rank_"), check.rank_fn.__name__
    assert check.verdict.__name__.startswith("verdict_"), check.verdict.__name__


def test_variants_put_the_version_and_model_in_params_never_in_the_name() -> None:
    a, b = ModelSpec(reference="massive"), ModelSpec(reference="tied")
    built = variants("wrap.x", {"fsdp1": "one", "fsdp2": "two"}, _rank, _verdict,
                     specs=(a, b), policy="recommended")
    assert [(c.name, c.params["version"], c.params["spec"], c.description) for c in built] == [
        ("wrap.x", "fsdp1", a, "one"), ("wrap.x", "fsdp1", b, "one"),
        ("wrap.x", "fsdp2", a, "two"), ("wrap.x", "fsdp2", b, "two"),
    ]
    assert all(c.params["policy"] == "recommended" and c.claim == "wrap" for c in built)
    (plain,) = variants("init.y", "text", _rank, _verdict, versions=None, lanes=("cpu",), k=1)
    assert plain.params == {"k": 1} and plain.lanes == ("cpu",) and plain.env is None


def test_check_has_no_claim_argument() -> None:
    # The claim derives from the name: a separate argument could disagree with it.
    assert Check("memory.z", "text", _rank, _verdict).claim == "memory"
    assert "claim" not in {f.name for f in dataclasses.fields(Check)}


# A claim is a module or a folder of check-family modules (its __init__ builds CHECKS).
@pytest.mark.parametrize("module", sorted(str(p.relative_to(CLAIMS)) for p in CLAIMS.rglob("*.py")
                                          if str(p.relative_to(CLAIMS))
                                          not in ("check.py", "__init__.py")))
def test_claim_modules_build_checks_only_with_variants(module: str) -> None:
    tree = ast.parse((CLAIMS / module).read_text())
    direct = [node.lineno for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "Check"]
    assert direct == [], f"claims/{module} builds Check(...) directly at lines {direct}"
