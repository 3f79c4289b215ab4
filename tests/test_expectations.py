"""Known torch defects as expectations: the file, the matching, what a run
and pytest make of a covered failure, and what compare says when one starts passing.

The expectation of the packaged file is exercised for real in tests/test_state.py
(``state.summon.rank0_discard``); here a check of this module's own, with a verdict that fails
on demand, and expectations given in place of the file's. An expectation excuses only the
failure it describes (its ``match``, its ``raises``): an unrelated exception injected into a
covered check (tests/injected_checks.py) stays an error, in a run and in pytest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import injected_checks
import pytest

from fsdp_conformance import expectations
from fsdp_conformance.claims import all_checks
from fsdp_conformance.claims.check import (
    ERROR,
    FAILED,
    PASSED,
    XFAILED,
    Verdict,
    execute,
    expectation_for,
    run_check,
    variants,
)
from fsdp_conformance.expectations import Expectation, ExpectationsError, known_label
from fsdp_conformance.harness import RankContext, RankFailure, Ranks
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


#: A well-formed entry's fields, which the malformed ones below change.
GOOD = {"check": "a.b", "torch": ">=2.13", "reason": "r", "link": "l", "match": "norm is \\d+"}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"check": "a.b", "torch": ">=2.13", "reason": "r", "match": "x"}, "needs link"),
        (
            {k: v for k, v in GOOD.items() if k != "match"},
            "needs match (strings); every entry names check, torch, reason, link, match "
            "(match is a Python regular expression searched (re.search) in the failure's text",
        ),
        ({**GOOD, "versoin": "fsdp1"}, "unknown field(s) versoin"),
        ({**GOOD, "torch": "2.13+"}, "'2.13+' is not a clause"),
        (
            {**GOOD, "kind": "bug"},
            "kind 'bug' is not one of defect, change; leave it out for a defect",
        ),
        ({**GOOD, "match": "norm ("}, "match 'norm (' is not a Python regular expression"),
        ({**GOOD, "match": ".*"}, "match '.*' matches any text, so it would excuse any failure"),
        ({**GOOD, "match": "error|"}, "match 'error|' matches any text"),
        (
            {**GOOD, "raises": "Runtime Error"},
            "raises 'Runtime Error' is not an exception's name such as 'RuntimeError'; give the "
            "exception's class name, or leave raises out for a failed verdict",
        ),
        ({**GOOD, "raises": 1}, "raises 1 is not an exception's name"),
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
        "match = 'total norm \\S+ differs'\nraises = \"RuntimeError\"\n"
    )
    (e,) = expectations.load(str(good))
    assert e.applies("a.b", "fsdp2", "cpu", "2.13.0") and not e.applies(
        "a.b", "fsdp1", "cpu", "2.13.0"
    )
    assert (e.match, e.raises) == ("total norm \\S+ differs", "RuntimeError")
    assert e.as_data()["match"] == e.match and e.as_data()["raises"] == "RuntimeError"
    bad = tmp_path / "bad.toml"
    bad.write_text("[[expected]\n")
    with pytest.raises(ExpectationsError, match="bad.toml: not valid TOML"):
        expectations.load(str(bad))


def test_an_expectation_matches_the_failures_text_and_the_exception_a_rank_raised() -> None:
    e = Expectation("a.b", ">=2", "r", "l", match=r"empty tensor", raises="RuntimeError")
    assert e.mismatch("x\ncannot compute the inf norm on an empty tensor", ["RuntimeError"]) is None
    # The class name decides, with or without its module; any rank's exception may be it.
    assert e.mismatch("empty tensor", ["builtins.RuntimeError"]) is None
    assert e.mismatch("empty tensor", ["ValueError", "RuntimeError"]) is None
    assert e.mismatch("empty tensor", ["ValueError"]) == (
        "no rank raised RuntimeError (raised: ValueError)"
    )
    assert e.mismatch("empty tensor", []) == (
        "no rank raised RuntimeError (raised: no exception (a failed verdict))"
    )
    assert e.mismatch("a wrong input", ["RuntimeError"]) == (
        "its match 'empty tensor' is not in the failure's text"
    )
    # Without raises: the text alone (a failed verdict's message).
    assert (
        Expectation("a.b", ">=2", "r", "l", match="2.00x").mismatch("2.00x the reference") is None
    )


def test_every_packaged_expectation_is_specific_to_its_failure() -> None:
    """A pattern that an unrelated error's text, or a passing check's summary, holds would
    excuse it: none of the packaged ones does."""
    unrelated = (
        "rank 1: ValueError in fsdp_conformance/claims/x.py:rank_x: an input the check was not "
        "written for\nTraceback (most recent call last):\nValueError: an input the check was "
        "not written for\nrank 0: did not finish (still running 3s after rank 1 raised)"
    )
    for e in expectations.load():
        assert e.mismatch(unrelated, ["ValueError"]) is not None, e.check
        assert e.mismatch(f"{e.check}: passed on every rank", ()) is not None, e.check


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
    match="the probe failed",
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
        Expectation("probe.expectation", ">=2", "r", "l", "probe", version="fsdp2"),
        Expectation("probe.expectation", ">=2", "r", "l", "probe", lane="gpu"),
        Expectation("probe.expectation", "<2", "r", "l", "probe"),
    )
    monkeypatch.setattr(expectations, "load", lambda path=expectations.DEFAULT_PATH: others)
    assert execute(ranks, PROBE).outcome == FAILED


def test_a_covered_failure_the_expectation_does_not_match_stays_a_failure_saying_so(
    ranks: Ranks,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = dataclasses.replace(COVERING, match="a different defect")
    monkeypatch.setattr(expectations, "load", lambda path=expectations.DEFAULT_PATH: (other,))
    run = execute(ranks, PROBE)
    assert run.outcome == FAILED and run.expected == other.as_data()
    first, note = run.detail.split("\n")
    assert first == "the probe failed"
    assert note.startswith(
        "the expectation did not match: expectations.toml's entry for probe.expectation fsdp1 "
        "on torch >=2 (match 'a different defect') covers this check, but its match "
        "'a different defect' is not in the failure's text: not the known defect, so a failure"
    )
    # In pytest: no xfail; the returned verdict's message says it too.
    verdict = run_check(ranks, PROBE)
    assert not verdict.passed and verdict.message == run.detail


#: The packaged expectation exercised for real (a failed verdict on every torch it names).
SUMMON = "state.summon.rank0_discard"


def the_check(name: str, version: str) -> Any:
    return next(c for c in all_checks() if c.name == name and c.params.get("version") == version)


def test_an_unrelated_exception_injected_into_a_covered_check_is_an_error_not_the_defect(
    ranks: Ranks,
) -> None:
    """The check the packaged file names, as the suite runs it, with its rank function raising
    an unrelated error: an error whose line says the expectation did not match. The check
    itself, on the same torch, is the expected failure."""
    real = the_check(SUMMON, "fsdp1")
    expected = expectation_for(ranks, real, real.params)
    if expected is None:
        pytest.skip(f"no packaged expectation covers {SUMMON} on this torch")
    injected = dataclasses.replace(real, rank_fn=injected_checks.rank_raises_unrelated)
    run = execute(ranks, injected)
    assert run.outcome == ERROR and run.expected == expected.as_data()
    assert "\n" not in run.detail, run.detail  # an error's detail stays one line
    assert run.detail.startswith(f"ranks 0, 1: ValueError in {injected_checks.__name__}")
    assert f"(the expectation did not match: expectations.toml's entry for {SUMMON} fsdp1 " in (
        run.detail
    )
    assert f"on torch {expected.torch} (match {expected.match!r})" in run.detail
    assert "is not in the failure's text: not the known defect" in run.detail
    assert injected_checks.UNRELATED in run.traceback
    # A failed verdict of another cause (a verdict injected in place of the check's): a failure.
    wrong = dataclasses.replace(real, verdict=injected_checks.verdict_fails_unrelated)
    run = execute(ranks, wrong)
    assert run.outcome == FAILED and "the expectation did not match" in run.detail
    # The defect itself is matched: expected.
    run = execute(ranks, real)
    assert run.outcome == XFAILED, run.detail
    assert "rank0_only_write: WRONG" in run.detail


def test_an_expectation_naming_an_exception_excuses_only_that_exception(
    ranks: Ranks,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``raises``: the exception's name among the ranks' errors, and ``match`` in their text."""
    check = injected_checks.CHECKS[-1]  # raises RuntimeError on rank 1
    assert check.name == injected_checks.FAILING_ON_RANK1
    known = Expectation(
        check.name, ">=2", "r", "l", match=r"failure injected on rank \d", raises="RuntimeError"
    )
    monkeypatch.setattr(expectations, "load", lambda path=expectations.DEFAULT_PATH: (known,))
    assert execute(ranks, check).outcome == XFAILED
    with pytest.raises(pytest.xfail.Exception, match="expected failure: r"):
        run_check(ranks, check)
    for other in (
        dataclasses.replace(known, raises="ValueError"),
        dataclasses.replace(known, match="empty tensor"),
    ):
        monkeypatch.setattr(
            expectations, "load", lambda path=expectations.DEFAULT_PATH, o=other: (o,)
        )
        run = execute(ranks, check)
        assert run.outcome == ERROR and "(the expectation did not match: " in run.detail
        with pytest.raises(RankFailure, match="the expectation did not match") as info:
            run_check(ranks, check)
        assert "Traceback" in str(info.value)  # the ranks' story follows its line


PLUGIN_TESTS = """
import dataclasses

import injected_checks
from fsdp_conformance.claims import all_checks
from fsdp_conformance.claims.check import run_check

REAL = next(
    c for c in all_checks()
    if c.name == "state.summon.rank0_discard" and c.params.get("version") == "fsdp1"
)


def test_the_defect(ranks):
    run_check(ranks, REAL).raise_if_failed()


def test_an_unrelated_error(ranks):
    run_check(ranks, dataclasses.replace(REAL, rank_fn=injected_checks.rank_raises_unrelated))
"""


def test_under_the_plugin_only_the_matched_defect_is_an_xfail(
    pytester: pytest.Pytester,
    ranks: Ranks,
) -> None:
    real = the_check(SUMMON, "fsdp1")
    if expectation_for(ranks, real, real.params) is None:
        pytest.skip(f"no packaged expectation covers {SUMMON} on this torch")
    pytester.makepyfile(test_covered=PLUGIN_TESTS)
    result = pytester.runpytest_inprocess("-m", "cpu", "-rA", "-p", "no:cacheprovider")
    result.assert_outcomes(xfailed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*ranks 0, 1: ValueError in injected_checks.py:rank_raises_unrelated: an input the "
            "check was not written for (injected) (the expectation did not match: "
            f"expectations.toml's entry for {SUMMON} fsdp1 on torch *",
            "XFAIL test_covered.py::test_the_defect* - expected failure: FSDP1 summon_full_params*",
            "FAILED test_covered.py::test_an_unrelated_error*",
        ]
    )


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


def test_a_covered_error_it_does_not_match_is_a_regression_in_compare_and_an_error_cell(
    tmp_path: Any,
) -> None:
    """The report keeps the entry's expectation (``match`` and ``raises`` among its fields) on
    the error; compare and the torch matrix treat it as the error it is."""
    from fsdp_conformance.gate import report as gate_report
    from fsdp_conformance.gate.compare import compare_reports
    from fsdp_conformance.gate.matrix import cell_of
    from fsdp_conformance.settings import Settings

    known = dataclasses.replace(COVERING, raises="RuntimeError")
    why = known.mismatch("ValueError: a wrong input", ["ValueError"])
    assert why is not None
    line = f"ranks 0, 1: ValueError in x.py:f: a wrong input ({known.unmatched(why)})"

    def entry(outcome: str, message: str) -> dict[str, Any]:
        return gate_report.check_entry(
            check="probe.expectation",
            claim="probe",
            lane="cpu",
            world_size=2,
            variant="fsdp1",
            outcome=outcome,
            message=message,
            figures={},
            data={},
            seconds=1.0,
            warnings=(),
            expected=known.as_data(),
            traceback="Traceback (most recent call last):\nValueError: a wrong input"
            if outcome == ERROR
            else "",
        )

    old = gate_report.build_report(
        [entry(XFAILED, "expected failure: r\nthe probe")], Settings(), 1
    )
    new = gate_report.build_report([entry(ERROR, line)], Settings(), 1)
    path = str(tmp_path / "new.json")
    gate_report.write_json_report(path, new)
    loaded = gate_report.load_report(path)["checks"][0]
    assert loaded["expected"]["match"] == "the probe failed"
    assert loaded["expected"]["raises"] == "RuntimeError"
    (diff,) = compare_reports(old, new)
    assert (diff.kind, diff.regression) == ("outcome", True)
    assert diff.text.startswith("xfailed -> error: ranks 0, 1: ValueError in x.py:f")
    cell = cell_of(loaded)
    assert cell.kind == "error" and "the expectation did not match" in cell.reason
