"""Known torch defects as expectations: the file, the matching, what a run
and pytest make of a covered failure, and what compare says when one starts passing.

The expectation of the packaged file is exercised for real in tests/test_state.py
(``state.summon.rank0_discard``); here a check of this module's own, with a verdict that fails
on demand, and expectations given in place of the file's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from fsdp_conformance import expectations
from fsdp_conformance.claims import all_checks
from fsdp_conformance.claims.check import (
    FAILED,
    PASSED,
    XFAILED,
    Verdict,
    execute,
    run_check,
    variants,
)
from fsdp_conformance.expectations import Expectation, ExpectationsError, known_label
from fsdp_conformance.harness import RankContext, Ranks
from fsdp_conformance.models.model_spec import ModelSpec

pytestmark = pytest.mark.cpu


# --------------------------------------------------------------------------------------------
# The file and the matching (no ranks)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "spec", "inside"),
    [
        ("2.13.0+cpu", ">=2.13, <2.16", True),
        ("2.15.9", ">=2.13, <2.16", True),
        ("2.16.0", ">=2.13, <2.16", False),
        ("2.12.1", ">=2.13, <2.16", False),
        ("2.14.1+cu130", "==2.14.1", True),
        ("2.14", "==2.14.0", True),  # a missing part counts as 0
        ("2.16.0.dev20261101+cpu", "<2.16", False),  # a pre-release is its release
        ("2.15.0a0", "!=2.15", False),
    ],
)
def test_a_torch_version_is_in_a_range_by_its_release_numbers(
    version: str,
    spec: str,
    inside: bool,
) -> None:
    assert expectations.in_range(version, spec) is inside


def test_every_packaged_expectation_names_a_check_of_the_suite_and_a_link() -> None:
    names = {c.name for c in all_checks()}
    loaded = expectations.load()
    assert loaded, "the packaged file holds no expectation"
    for e in loaded:
        assert e.check in names, f"{e.check}: no such check (renamed?)"
        assert e.link.startswith("https://") and len(e.reason) > 40, e


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"check": "a.b", "torch": ">=2.13", "reason": "r"}, "needs link"),
        (
            {"check": "a.b", "torch": ">=2.13", "reason": "r", "link": "l", "versoin": "fsdp1"},
            "unknown field(s) versoin",
        ),
        ({"check": "a.b", "torch": "2.13+", "reason": "r", "link": "l"}, "'2.13+' is not a clause"),
        (
            {"check": "a.b", "torch": ">=2.13", "reason": "r", "link": "l", "kind": "bug"},
            "kind 'bug' is not one of defect, change; leave it out for a defect",
        ),
        ("check = a.b", "is not a table; write it as [[expected]]"),
    ],
)
def test_a_malformed_entry_names_itself_and_the_fix(entry: Any, message: str) -> None:
    with pytest.raises(ExpectationsError, match="expectations.toml: expected\\[0\\]") as info:
        expectations.parse([entry], "expectations.toml")
    assert message in str(info.value)


def test_the_file_is_read_as_toml_and_a_broken_one_is_named(tmp_path: Any) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        '[[expected]]\ncheck = "a.b"\ntorch = ">=2.13"\nreason = "why"\n'
        'link = "https://x"\nversion = "fsdp2"\n'
    )
    (e,) = expectations.load(str(good))
    assert e.applies("a.b", "fsdp2", "cpu", "2.13.0") and not e.applies(
        "a.b", "fsdp1", "cpu", "2.13.0"
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("[[expected]\n")
    with pytest.raises(ExpectationsError, match="bad.toml: not valid TOML"):
        expectations.load(str(bad))


# --------------------------------------------------------------------------------------------
# A covered check in a run (execute) and in pytest (run_check)
# --------------------------------------------------------------------------------------------


def rank_expectation_probe(
    ctx: RankContext,
    version: str = "fsdp1",
    fail: bool = True,
    broken: bool = False,
    spec: ModelSpec | None = None,
) -> dict[str, Any]:
    return {"rank": ctx.rank, "fail": fail}


def verdict_expectation_probe(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    failing = all(v["fail"] for v in values)
    return Verdict(not failing, "the probe failed" if failing else "the probe passed")


(PROBE,) = variants(
    "probe.expectation",
    "fails when asked",
    rank_expectation_probe,
    verdict_expectation_probe,
    versions=("fsdp1",),
    fail=True,
)
COVERING = Expectation(
    check="probe.expectation",
    torch=">=2",
    reason="a known defect of the probe",
    link="https://example.org/defect",
    version="fsdp1",
)


@pytest.fixture
def covered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expectations, "load", lambda path=expectations.DEFAULT_PATH: (COVERING,))


def test_a_covered_failure_is_xfailed_in_a_run_with_the_reason(ranks: Ranks, covered: None) -> None:
    run = execute(ranks, PROBE)
    assert run.outcome == XFAILED
    assert run.detail.startswith("expected failure: a known defect of the probe")
    assert "the probe failed" in run.detail and run.expected == COVERING.as_data()


def test_a_covered_check_that_passes_passes_and_says_the_defect_may_be_fixed(
    ranks: Ranks,
    covered: None,
) -> None:
    run = execute(ranks, PROBE, fail=False)  # the suite never runs it so: not its own params
    assert (run.outcome, run.expected) == (PASSED, None)
    passing = variants(
        "probe.expectation",
        "",
        rank_expectation_probe,
        verdict_expectation_probe,
        versions=("fsdp1",),
        fail=False,
    )[0]
    run = execute(ranks, passing)
    assert run.outcome == PASSED and "the defect may be fixed" in run.detail
    # On the user's model (another spec) a pass says nothing about torch: the model may not
    # meet the defect's conditions (loop.clipping.inf needs an empty shard); no such note.
    run = execute(ranks, passing, spec=ModelSpec(reference="tied"))
    assert run.outcome == PASSED and "may be fixed" not in run.detail, run.detail
    assert run.expected == COVERING.as_data()


def test_a_negative_control_of_a_covered_check_is_never_excused(
    ranks: Ranks,
    covered: None,
) -> None:
    run = execute(ranks, PROBE, broken=True)
    assert (run.outcome, run.expected) == (FAILED, None)
    verdict = run_check(ranks, PROBE, broken=True)  # returned, not turned into an xfail
    assert not verdict.passed


def test_a_covered_failure_is_an_xfail_in_pytest_and_a_failure_without_the_hook(
    ranks: Ranks,
    covered: None,
) -> None:
    with pytest.raises(pytest.xfail.Exception, match="expected failure: a known defect"):
        run_check(ranks, PROBE)
    assert not run_check(ranks.configured(xfail=None), PROBE).passed


def test_an_uncovered_failure_stays_a_failure(ranks: Ranks) -> None:
    run = execute(ranks, PROBE)  # the packaged file does not know the probe
    assert (run.outcome, run.expected) == (FAILED, None)


def test_an_expectation_for_another_version_or_lane_does_not_cover(
    ranks: Ranks,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    others = (
        Expectation("probe.expectation", ">=2", "r", "l", version="fsdp2"),
        Expectation("probe.expectation", ">=2", "r", "l", lane="gpu"),
        Expectation("probe.expectation", "<2", "r", "l"),
    )
    monkeypatch.setattr(expectations, "load", lambda path=expectations.DEFAULT_PATH: others)
    assert execute(ranks, PROBE).outcome == FAILED


@pytest.mark.parametrize(
    ("check", "version", "on", "torch_version", "expected"),
    [
        ("wrap.train.fp32", "fsdp2", "cpu", "2.8.0", True),
        ("init.train_step", "fsdp2", "cpu", "2.8.1", True),
        ("wrap.train.fp32", "fsdp1", "cpu", "2.8.0", False),  # FSDP1 divides itself
        ("wrap.train.fp32", "fsdp2", "gpu", "2.8.0", False),  # NCCL applies AVG
        ("wrap.train.fp32", "fsdp2", "cpu", "2.10.0", False),  # fixed
        ("wrap.train.fp32", "fsdp2", "cpu", "2.13.0", False),
    ],
)
def test_the_gloo_gradient_sum_of_torch_2_8_is_expected_only_where_it_was_measured(
    check: str,
    version: str,
    on: str,
    torch_version: str,
    expected: bool,
) -> None:
    # pytorch/pytorch#162338: FSDP2's fp32 reduce-scatter on gloo summed instead of averaging
    # (2.00x the reference at world size 2 on 2.8.0; 2.10.0 and 2.13.0 correct).
    found = expectations.find(check, version, on, torch_version)
    assert (found is not None) == expected, found
    if found is not None:
        assert "summed" in found.reason and found.link.endswith("/issues/162338")


def test_the_fsdp2_reduce_dtype_change_of_2_15_is_a_change_not_a_defect() -> None:
    """2.15 reduces in the gradient's dtype when reduce_dtype is unset (its docstring says so):
    the fingerprint flags it by design, and the expectation says it is a change, with the fix."""
    found = expectations.find("defaults.fingerprint", "fsdp2", "cpu", "2.15.0+cu132")
    assert found is not None and found.kind == "change"
    assert known_label(found.kind) == "known torch change"
    assert "reduce_dtype=torch.bfloat16" in found.reason and found.as_data()["kind"] == "change"
    assert expectations.find("defaults.fingerprint", "fsdp2", "cpu", "2.14.1") is None
    assert expectations.find("defaults.fingerprint", "fsdp1", "cpu", "2.15.0") is None
    defect = expectations.find("state.summon.rank0_discard", "fsdp1", "cpu", "2.13.0")
    assert defect is not None and known_label(defect.kind) == "known torch defect"
