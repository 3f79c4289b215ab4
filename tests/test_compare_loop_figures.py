"""compare follows the loop claim's figures: numeric results (``*_norm``, ``*_norms``) held to
a relative tolerance, digests (``*_digest``, ``*_digests``) exactly, each move a regression;
``update_rel_diff`` is a measurement whose check judges it.

No ranks: reports built by hand, as tests/test_reports.py builds them, and compared in process
and through ``fsdp-conformance compare`` (its lines and exit code).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from fsdp_conformance import cli
from fsdp_conformance.gate import report as gate_report
from fsdp_conformance.gate.compare import NUMERIC_RTOL, compare_reports
from fsdp_conformance.gate.difference import Difference
from fsdp_conformance.settings import Settings

pytestmark = pytest.mark.cpu

CHECK = "loop.accumulation.no_sync"
CID = f"{CHECK}[cpu,ws2,fsdp1,odd]"
#: The figures ``loop.accumulation.no_sync`` reported on torch 2.13.0 (odd model, world size 2):
#: the gradient norms per optimizer step, unrounded.
GRAD_NORMS = [3.2066309416553493, 1.832102324112891]
UPDATE_REL_DIFF = 1.1e-15


def entry(outcome: str = "passed", message: str = "ok", **figures: Any) -> dict[str, Any]:
    return gate_report.check_entry(
        check=CHECK,
        claim="loop",
        lane="cpu",
        world_size=2,
        variant="fsdp1,odd",
        outcome=outcome,
        message=message,
        figures=figures,
        data={},
        seconds=0.1,
        warnings=(),
    )


def loop_figures(**changes: Any) -> dict[str, Any]:
    """The accumulation figures, with ``changes`` applied."""
    return {
        "update_rel_diff": UPDATE_REL_DIFF,
        "grad_norms": list(GRAD_NORMS),
        "steps": 2,
        "micro_batches": 3,
        **changes,
    }


def report(*entries: Mapping[str, Any], torch_version: str = "2.13.0+cpu") -> dict[str, Any]:
    built = gate_report.build_report(list(entries), Settings(), 1.5)
    built["environment"]["torch"] = torch_version
    return built


def compare(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, bool, str]]:
    diffs: list[Difference] = compare_reports(report(old), report(new))
    return [(d.kind, d.regression, d.text) for d in diffs]


def moved(value: float, rel: float) -> float:
    return value * (1 + rel)


def test_a_gradient_norm_moved_by_1e_3_is_a_regression_and_by_1e_14_nothing() -> None:
    old = entry(**loop_figures())
    far = entry(**loop_figures(grad_norms=[GRAD_NORMS[0], moved(GRAD_NORMS[1], 1e-3)]))
    near = entry(**loop_figures(grad_norms=[moved(g, 1e-14) for g in GRAD_NORMS]))
    assert near["figures"]["grad_norms"] != GRAD_NORMS  # it did move: the tolerance held it
    assert compare(old, near) == []
    assert compare(old, far) == [
        (
            "numeric",
            True,
            f"grad_norms: [1] 1.832102324112891 -> {moved(GRAD_NORMS[1], 1e-3)!r} (+1.0e-03) "
            "(relative tolerance 1e-09)",
        )
    ]


def test_the_tolerance_is_1e_9_relative_on_either_side_of_it() -> None:
    assert NUMERIC_RTOL == 1e-9
    old = entry(**loop_figures())
    within = entry(**loop_figures(grad_norms=[moved(g, -5e-10) for g in GRAD_NORMS]))
    beyond = entry(**loop_figures(grad_norms=[moved(g, -2e-9) for g in GRAD_NORMS]))
    assert compare(old, within) == []
    ((kind, regression, text),) = compare(old, beyond)
    assert (kind, regression) == ("numeric", True)
    # Every step that moved is named, each with its relative move.
    assert text.startswith("grad_norms: [0] 3.2066309416553493 -> ")
    assert "; [1] 1.832102324112891 -> " in text and text.count("(-2.0e-09)") == 2


def test_a_total_norm_moved_is_a_regression_like_a_gradient_norm() -> None:
    # clipping's total_norm: a list per optimizer step, or a single number.
    for value, bigger in (([2.5, 1.25], [2.5, 1.25125]), (0.75, 0.75075)):
        old = entry(**loop_figures(total_norm=value))
        assert compare(old, entry(**loop_figures(total_norm=bigger))) == [
            (
                "numeric",
                True,
                f"total_norm: {'[1] 1.25' if isinstance(value, list) else '0.75'} -> "
                f"{bigger[1] if isinstance(bigger, list) else bigger!r} (+1.0e-03) "
                "(relative tolerance 1e-09)",
            )
        ]
        near = [moved(v, 1e-14) for v in value] if isinstance(value, list) else moved(value, 1e-14)
        assert compare(old, entry(**loop_figures(total_norm=near))) == []


def test_update_rel_diff_is_judged_by_its_check_and_compare_follows_the_outcome() -> None:
    # Below the check's tolerance (1e-6) it may move: a measurement, not a difference.
    old = entry(**loop_figures())
    assert compare(old, entry(**loop_figures(update_rel_diff=3.0e-7))) == []
    # Above it the check fails: the outcome is the regression, its figure not a second one.
    failed = entry(
        "failed",
        "gradient accumulation differs from the reference:\n  rank 0: step 1 update ...",
        **loop_figures(update_rel_diff=0.35),
    )
    assert compare(old, failed) == [
        ("outcome", True, "passed -> failed: gradient accumulation differs from the reference:")
    ]


def test_a_changed_digest_is_a_regression_and_a_bare_digest_stays_a_change() -> None:
    old = entry(**loop_figures(buffers_digest="b70745a4", frozen_digests=["aa", "bb", "cc"]))
    new = entry(**loop_figures(buffers_digest="8c488179", frozen_digests=["aa", "bd", "cc"]))
    assert compare(old, new) == [
        ("digest", True, "buffers_digest: 'b70745a4' -> '8c488179'"),
        ("digest", True, "frozen_digests: [1] 'bb' -> 'bd'"),
    ]
    assert compare(old, entry(**old["figures"])) == []
    # init's own ``digest`` (no suffix) is still an exact figure whose change is reported.
    bare = compare(entry(digest="b70745a4"), entry(digest="8c488179"))
    assert bare == [("figure", False, "digest: 'b70745a4' -> '8c488179'")]


def test_a_norm_only_one_report_has_is_a_change_and_other_shapes_a_regression() -> None:
    old = entry(**loop_figures())
    # The suite added clipping's figure since the old report: a change, not a regression.
    added = compare(old, entry(**loop_figures(total_norm=[2.5, 1.25])))
    assert added == [("figure", False, "total_norm: None -> [2.5, 1.25]")]
    # A step more or fewer: the results cannot be lined up value by value.
    ((kind, regression, text),) = compare(old, entry(**loop_figures(grad_norms=GRAD_NORMS[:1])))
    assert (kind, regression) == ("numeric", True)
    assert text.endswith("(not comparable value by value)")
    # A NaN norm is a move; NaN on both sides is the same result.
    nan = float("nan")
    assert [d[:2] for d in compare(old, entry(**loop_figures(grad_norms=[nan, 1.0])))] == [
        ("numeric", True)
    ]
    same_nan = entry(**loop_figures(grad_norms=[nan, GRAD_NORMS[1]]))
    assert compare(same_nan, entry(**loop_figures(grad_norms=[nan, GRAD_NORMS[1]]))) == []


# --------------------------------------------------------------------------------------------
# Through ``fsdp-conformance compare``: the lines and the exit code
# --------------------------------------------------------------------------------------------


def _write(path: Path, figures: Mapping[str, Any], torch_version: str) -> str:
    gate_report.write_json_report(str(path), report(entry(**figures), torch_version=torch_version))
    return str(path)


def test_compare_exits_1_on_a_moved_norm_and_0_on_rounding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _write(tmp_path / "old.json", loop_figures(), "2.13.0")
    far = _write(
        tmp_path / "far.json", loop_figures(grad_norms=[moved(GRAD_NORMS[0], 1e-3), 1.8]), "2.14.1"
    )
    near = _write(
        tmp_path / "near.json",
        loop_figures(grad_norms=[moved(g, 1e-14) for g in GRAD_NORMS]),
        "2.14.1",
    )
    code = cli.main(["compare", old, far])
    lines = capsys.readouterr().out.splitlines()
    assert code == cli.EXIT_FAILED
    assert lines[0] == "safe to upgrade: no (torch 2.13.0 -> 2.14.1)"
    assert lines[1].startswith("  regressions 1, drift 0,")
    assert lines[3].startswith(f"  [BLOCKS] {CID}: numeric: grad_norms: [0] 3.2066309416553493 -> ")
    assert (
        "(+1.0e-03); [1] 1.832102324112891 -> 1.8 (-1.8e-02) (relative tolerance 1e-09)"
        in (lines[3])
    )
    for extra in ([], ["--fail-on-change"]):
        code = cli.main(["compare", old, near, *extra])
        assert code == cli.EXIT_OK
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "safe to upgrade: yes (torch 2.13.0 -> 2.14.1)"
        assert out[-1] == "no differences"
