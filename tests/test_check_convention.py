"""One check convention, enforced: names, rank functions, verdicts and
the one way ``CHECKS`` is built.

Pure (no ranks): the registered checks and the claim packages' source. Each rule is a function
returning its problems, run on every registered check and on a deliberately broken one (its
negative control): a rule that finds nothing wrong with the broken input would be a rule that
cannot fail.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import fsdp_conformance
from fsdp_conformance.claims import CLAIM_MODULES, all_checks, init
from fsdp_conformance.claims.check import Check, Verdict, variants
from fsdp_conformance.models.model_spec import ModelSpec

pytestmark = pytest.mark.cpu

EVERY_CHECK = all_checks() + list(init.SEEDS_CHECKS)
CLAIMS = Path(fsdp_conformance.__file__).parent / "claims"


def _rank(ctx: Any, **params: Any) -> None:
    return None


def _verdict(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    return Verdict(True, "")


def _prefixes(name: str, kind: str) -> list[str]:
    """``kind_<what>`` for each leading run of the name's parts after the claim:
    ``wrap.units.exact`` -> ``rank_units``, ``rank_units_exact``."""
    what = name.split(".")[1:]
    return [f"{kind}_" + "_".join(what[:k]) for k in range(1, len(what) + 1)]


def _allowed_rank_names(check: Check) -> list[str]:
    """A rank function is named for its check (a leading part of the name), or, when it serves
    several checks, for the check family whose module holds it (``claims/init/weights.py``'s
    ``rank_weights`` also runs ``init.no_meta``)."""
    family = check.rank_fn.__module__.rsplit(".", 1)[-1]
    return [*_prefixes(check.name, "rank"), f"rank_{family}"]


def naming_problems(check: Check) -> list[str]:
    """What in ``check`` breaks the naming convention (docs/architecture.md, "The data path of a
    check"); empty when nothing does."""
    problems = []
    if check.claim != check.name.split(".", 1)[0] or "." not in check.name:
        problems.append(f"{check.name}: not <claim>.<what>[.<detail>]")
    if "fsdp1" in check.name or "fsdp2" in check.name:
        problems.append(f"{check.name}: the FSDP version is a variant, not part of the name")
    allowed = {"rank": _allowed_rank_names(check), "verdict": _prefixes(check.name, "verdict")}
    for fn, kind in ((check.rank_fn, "rank"), (check.verdict, "verdict")):
        if fn.__name__ not in allowed[kind]:
            problems.append(
                f"{check.name}: {kind} function {fn.__name__} is not one of "
                f"{', '.join(allowed[kind])}"
            )
    return problems


def _variants_only(
    node: ast.expr, helpers: Mapping[str, ast.FunctionDef], seen: frozenset[str] = frozenset()
) -> bool:
    """``variants(...)``, ``a + b`` of such, or a call to a function of the same module whose
    every return is such a chain (``wrap``'s per-version chain): the one registration shape."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _variants_only(node.left, helpers, seen) and _variants_only(
            node.right, helpers, seen
        )
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return False
    if node.func.id == "variants":
        return True
    helper = helpers.get(node.func.id)
    if helper is None or node.func.id in seen:
        return False
    returns = [r.value for r in ast.walk(helper) if isinstance(r, ast.Return)]
    return bool(returns) and all(
        r is not None and _variants_only(r, helpers, seen | {node.func.id}) for r in returns
    )


def registration_problems(source: str, label: str) -> list[str]:
    """Where ``source`` (a claim's module) registers checks other than by ``CHECKS =`` (or
    ``SEEDS_CHECKS =``) a concatenation of ``variants(...)`` calls."""
    problems = []
    registered = 0
    tree = ast.parse(source)
    helpers = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "Check"
        ):
            problems.append(f"{label}:{node.lineno}: builds Check(...) directly")
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for target in targets:
            if isinstance(target, ast.Name) and target.id.endswith("CHECKS"):
                registered += 1
                value = node.value  # type: ignore[union-attr]
                if value is None or not _variants_only(value, helpers):
                    problems.append(
                        f"{label}:{node.lineno}: {target.id} is not a concatenation "
                        "of variants(...) calls"
                    )
    calls = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "variants"
    ]
    if calls and not registered:
        problems.append(f"{label}:{calls[0]}: variants(...) outside a CHECKS assignment")
    return problems


def _claim_sources() -> list[Path]:
    return sorted(
        p for p in CLAIMS.rglob("*.py") if p.name != "check.py" and p != CLAIMS / "__init__.py"
    )


@pytest.mark.parametrize("check", EVERY_CHECK, ids=lambda c: c.name)
def test_every_check_follows_the_naming_scheme(check: Check) -> None:
    assert naming_problems(check) == []


def test_a_misnamed_check_breaks_the_naming_scheme() -> None:
    # Negative control: a rank function and a verdict named for another check.
    (good,) = variants("state.round_trip", "text", _rank, _verdict, versions=None)
    misnamed = dataclasses.replace(good, name="state.resume")
    problems = naming_problems(misnamed)
    assert len(problems) == 2 and "_rank is not one of rank_resume" in problems[0], problems
    assert "_verdict is not one of verdict_resume" in problems[1], problems
    assert naming_problems(dataclasses.replace(misnamed, name="state.fsdp1")) != []


@pytest.mark.parametrize("path", _claim_sources(), ids=lambda p: str(p.relative_to(CLAIMS)))
def test_claims_register_checks_only_as_a_chain_of_variants(path: Path) -> None:
    assert registration_problems(path.read_text(), str(path.relative_to(CLAIMS))) == []


def test_a_table_loop_or_a_direct_check_breaks_the_registration_shape() -> None:
    # Negative controls: the shapes the convention replaced.
    loop = "CHECKS = tuple(c for row in ROWS for c in variants(*row))\n"
    direct = "X = Check('wrap.x', 'text', rank_x, verdict_x)\n"
    stray = "EXTRA = variants('wrap.x', 'text', rank_x, verdict_x)\n"
    assert registration_problems(loop, "loop.py") == [
        "loop.py:1: CHECKS is not a concatenation of variants(...) calls"
    ]
    assert registration_problems(direct, "direct.py") == ["direct.py:1: builds Check(...) directly"]
    assert registration_problems(stray, "stray.py") == [
        "stray.py:1: variants(...) outside a CHECKS assignment"
    ]
    chain = "CHECKS = variants('a.b', 't', r, v) + variants('a.c', 't', r, v)\n"
    assert registration_problems(chain, "chain.py") == []
    per_version = (
        "def _one(v):\n    return variants('a.b', 't', r, v, versions=(v,))\n"
        "CHECKS = _one('fsdp1') + _one('fsdp2')\n"
    )
    assert registration_problems(per_version, "per_version.py") == []
    table = (
        "def _rows():\n    return tuple(c for row in ROWS for c in variants(*row))\n"
        "CHECKS = _rows()\n"
    )
    assert registration_problems(table, "table.py") == [
        "table.py:3: CHECKS is not a concatenation of variants(...) calls"
    ]


def test_every_claim_module_is_a_package_of_check_families_or_one_module() -> None:
    # The one list of claims: every claim's source in claims/ is listed, and nothing else is
    # (the check contract and the faults' helpers are no claim).
    listed = {m.rsplit(".", 1)[1] for m in CLAIM_MODULES}
    present = {p.stem for p in CLAIMS.glob("*.py") if p.stem not in ("__init__", "check", "faults")}
    present |= {p.name for p in CLAIMS.iterdir() if (p / "__init__.py").is_file()}
    assert present == listed


def test_variants_put_the_version_and_model_in_params_never_in_the_name() -> None:
    a, b = ModelSpec(reference="massive"), ModelSpec(reference="tied")
    built = variants(
        "wrap.x",
        {"fsdp1": "one", "fsdp2": "two"},
        _rank,
        _verdict,
        specs=(a, b),
        policy="recommended",
    )
    assert [(c.name, c.params["version"], c.params["spec"], c.description) for c in built] == [
        ("wrap.x", "fsdp1", a, "one"),
        ("wrap.x", "fsdp1", b, "one"),
        ("wrap.x", "fsdp2", a, "two"),
        ("wrap.x", "fsdp2", b, "two"),
    ]
    assert all(c.params["policy"] == "recommended" and c.claim == "wrap" for c in built)
    (plain,) = variants("init.y", "text", _rank, _verdict, versions=None, lanes=("cpu",), k=1)
    assert plain.params == {"k": 1} and plain.lanes == ("cpu",) and plain.env is None


def test_check_has_no_claim_argument() -> None:
    # The claim derives from the name: a separate argument could disagree with it.
    assert Check("memory.z", "text", _rank, _verdict).claim == "memory"
    assert "claim" not in {f.name for f in dataclasses.fields(Check)}
