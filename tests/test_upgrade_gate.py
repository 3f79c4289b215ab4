"""The upgrade gate's story: numeric drift against measured noise, known defects the
candidate has, deprecations grouped by the torch call, rollback, and the verdict first, each
from an injected change through ``compare`` (its lines and its exit code).

No ranks: reports built by hand as tests/test_reports.py builds them; the deprecation's torch
call is recorded from a real torch deprecation in this process.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from fsdp_conformance import cli, expectations
from fsdp_conformance.gate import noise, verdict
from fsdp_conformance.gate import report as gate_report
from fsdp_conformance.gate.compare import compare_reports
from fsdp_conformance.harness import protocol
from fsdp_conformance.settings import Settings

pytestmark = pytest.mark.cpu

MiB = 2**20


def entry(
    check: str = "user.step",
    outcome: str = "passed",
    message: str = "ok",
    warnings: Sequence[str] = (),
    expected: Mapping[str, str] | None = None,
    **figures: Any,
) -> dict[str, Any]:
    return gate_report.check_entry(
        check=check,
        claim=check.split(".", 1)[0],
        lane="cpu",
        world_size=2,
        variant="fsdp2,odd",
        outcome=outcome,
        message=message,
        figures=figures,
        data={},
        seconds=0.1,
        warnings=warnings,
        expected=expected,
    )


def report(*entries: dict[str, Any], torch_version: str) -> dict[str, Any]:
    # a user's model: the package's table of the reference models does not apply
    built = gate_report.build_report(list(entries), Settings(model="pkg.mod:build"), 1.0)
    built["environment"]["torch"] = torch_version
    return built


def write(path: Path, data: Mapping[str, Any]) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def gate(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    old: Sequence[dict[str, Any]],
    new: Sequence[dict[str, Any]],
    *extra: str,
    table: Mapping[str, Any] | None = None,
    rollback: Mapping[str, Any] | None = None,
) -> tuple[int, list[str]]:
    """``fsdp-conformance compare`` of two reports: its exit code and lines."""
    args = [
        "compare",
        write(tmp_path / "old.json", report(*old, torch_version="2.13.0")),
        write(tmp_path / "new.json", report(*new, torch_version="2.15.0")),
        *extra,
    ]
    if table is not None:
        args += ["--noise", write(tmp_path / "noise.json", table)]
    if rollback is not None:
        args += ["--rollback", write(tmp_path / "rollback.json", rollback)]
    code = cli.main(args)
    return code, capsys.readouterr().out.splitlines()


def noise_table(**figures: float) -> dict[str, Any]:
    """A noise table for ``user.step[cpu]`` (as ``fsdp-conformance noise`` writes one)."""
    return {
        "schema": noise.SCHEMA,
        "schema_version": noise.SCHEMA_VERSION,
        "torch": "2.13.0",
        "runs": 3,
        "noise": {"user.step[cpu]": figures},
    }


# --------------------------------------------------------------------------------------------
# 1. Drift with its noise
# --------------------------------------------------------------------------------------------


def test_noise_is_measured_from_repeated_runs_and_refuses_what_is_not_repeated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [
        report(entry(loss=0.25, peak_bytes=10 * MiB, steps=2), torch_version="2.13.0"),
        report(entry(loss=0.25, peak_bytes=10 * MiB + 4096, steps=2), torch_version="2.13.0"),
        report(entry(loss=0.25, peak_bytes=10 * MiB + 1024, steps=2), torch_version="2.13.0"),
    ]
    paths = [write(tmp_path / f"r{i}.json", r) for i, r in enumerate(runs)]
    out = tmp_path / "noise.json"
    assert cli.main(["noise", *paths, "--out", str(out)]) == cli.EXIT_OK
    said = capsys.readouterr().out
    assert "2 measured figures of 1 checks over 3 runs on torch 2.13.0; 1 moved" in said
    table = noise.load_table(str(out))
    # counts (steps) are not measurements; the spread is the largest over the runs
    assert table["noise"] == {"user.step[cpu]": {"loss": 0.0, "peak_bytes": 4096.0}}
    # one run, or runs on two torch versions, are not noise
    assert cli.main(["noise", paths[0], "--out", str(out)]) == 2
    assert "two or more reports" in capsys.readouterr().err
    other = write(tmp_path / "other.json", report(entry(loss=0.25), torch_version="2.15.0"))
    assert cli.main(["noise", paths[0], other, "--out", str(out)]) == 2
    assert "noise is measured on one torch" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(noise.NoiseError, match="not a noise table"):
        noise.load_table(str(tmp_path / "bad.json"))


def test_the_reference_models_report_carries_its_noise() -> None:
    """``run`` of the reference models writes each measured figure's noise into its entry, from
    the package's table; a user's model has none there (the gate measures it)."""
    e = entry("loop.accumulation.no_sync", update_rel_diff=2.7e-8, steps=2)
    built = gate_report.build_report([e], Settings(), 1.0)
    assert built["checks"][0]["noise"] == {"update_rel_diff": 0.0}
    table = noise.reference_table()
    assert table["runs"] >= 2 and table["torch"].startswith("2.13.0")
    assert "noise" not in report(entry(update_rel_diff=2.7e-8), torch_version="2.13.0")["checks"][0]


def test_a_loss_moved_beyond_its_noise_is_drift_that_blocks_and_within_it_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = noise_table(loss=1e-3)
    # within 3x the noise: nothing
    code, lines = gate(tmp_path, capsys, [entry(loss=0.250)], [entry(loss=0.252)], table=table)
    assert code == cli.EXIT_OK and lines[-1] == "no differences"
    # beyond it: drift, both values and the noise, and the upgrade is not safe
    code, lines = gate(tmp_path, capsys, [entry(loss=0.250)], [entry(loss=0.260)], table=table)
    assert code == cli.EXIT_FAILED
    assert lines[0] == "safe to upgrade: no (torch 2.13.0 -> 2.15.0)"
    assert lines[1].startswith("  regressions 0, drift 1, ")
    assert lines[2] == "numeric and memory drift:"
    assert lines[3] == (
        "  [BLOCKS] user.step[cpu,ws2,fsdp2,odd]: drift: loss: 0.25 -> 0.26 (the step computes "
        "another loss; noise 0.001 over repeated runs, drift beyond 3.0x it and the rounding "
        "floor 1e-05)"
    )


def test_a_difference_from_the_reference_growing_blocks_and_shrinking_is_said() -> None:
    table = noise_table(update_rel_diff=0.0)
    old = report(entry(update_rel_diff=9.07e-4), torch_version="2.13.0")
    grown = report(entry(update_rel_diff=4.0e-3), torch_version="2.15.0")
    shrunk = report(entry(update_rel_diff=5.52e-4), torch_version="2.15.0")
    rounding = report(entry(update_rel_diff=9.071e-4), torch_version="2.15.0")
    ((up,),) = [compare_reports(old, grown, noise=table)]
    assert (up.kind, up.regression) == ("drift", True) and "away from the reference" in up.text
    ((down,),) = [compare_reports(old, shrunk, noise=table)]
    assert (down.kind, down.regression) == ("drift", False)
    assert "towards the reference" in down.text
    # a move inside the rounding floor (1e-5, absolute for a relative difference) is not drift
    assert compare_reports(old, rounding, noise=table) == []


def test_memory_beyond_its_noise_inside_the_tolerance_is_drift_and_noise_widens_the_bound() -> None:
    old = report(entry(peak_bytes=100 * MiB), torch_version="2.13.0")
    new = report(entry(peak_bytes=102 * MiB), torch_version="2.15.0")
    (d,) = compare_reports(old, new, noise=noise_table(peak_bytes=0.0))
    assert (d.kind, d.regression) == ("drift", False)
    assert "peak_bytes: 100.00 MiB -> 102.00 MiB (+2.0%)" in d.text
    # a 6% rise is a memory regression, unless the figure's own noise is that large
    higher = report(entry(peak_bytes=106 * MiB), torch_version="2.15.0")
    (d,) = compare_reports(old, higher, noise=noise_table(peak_bytes=0.0))
    assert (d.kind, d.regression) == ("memory", True)
    assert compare_reports(old, higher, noise=noise_table(peak_bytes=3.0 * MiB)) == []


def test_a_measured_figure_without_noise_is_said_once_never_blocking() -> None:
    old = report(entry(loss=0.25), entry("user.other", loss=1.0), torch_version="2.13.0")
    new = report(entry(loss=0.26), entry("user.other", loss=1.5), torch_version="2.15.0")
    (d,) = compare_reports(old, new)
    assert (d.check_id, d.kind, d.regression) == ("2 checks", "drift", False)
    assert "noise was never measured" in d.text and "--noise" in d.text


# --------------------------------------------------------------------------------------------
# 2. Known defects count
# --------------------------------------------------------------------------------------------

DEFECT = {
    "check": "user.step",
    "torch": ">=2.15, <2.16",
    "reason": "gloo sums gradients instead of averaging them",
    "link": "https://github.com/pytorch/pytorch/issues/1",
    "match": "step differs",
}


def test_an_expectation_covering_the_candidate_is_a_known_defect_your_checks_hit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    known = expectations.parse([DEFECT], "injected")
    assert expectations.find("user.step", "fsdp2", "cpu", "2.13.0", known) is None
    hit = expectations.find("user.step", "fsdp2", "cpu", "2.15.0", known)
    assert hit is not None
    xfailed = entry(outcome="xfailed", message="step differs", expected=hit.as_data())
    code, lines = gate(tmp_path, capsys, [entry()], [xfailed])
    assert code == cli.EXIT_FAILED
    assert lines[0].startswith("safe to upgrade: no")
    assert lines[1].startswith("  regressions 0, drift 0, known defects 1, ")
    assert lines[3] == (
        "  [BLOCKS] user.step[cpu,ws2,fsdp2,odd]: known_defect: passed -> xfailed: the candidate "
        "has a known torch defect your checks hit: gloo sums gradients instead of averaging them "
        "(https://github.com/pytorch/pytorch/issues/1)"
    )
    # the other way: fixed upstream, said, safe
    code, lines = gate(tmp_path, capsys, [xfailed], [entry()])
    assert code == cli.EXIT_OK
    assert "fixed upstream 1" in lines[1]
    assert "no longer fails on the candidate: fixed upstream?" in lines[3]


# --------------------------------------------------------------------------------------------
# 3. Deprecations
# --------------------------------------------------------------------------------------------


def test_a_deprecation_is_recorded_with_the_torch_call_it_came_through() -> None:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    caught: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = protocol.recording_warnings(caught)
        # torch warns on the call, before it finds no FSDP unit in a plain module (and raises)
        with contextlib.suppress(Exception):
            with FullyShardedDataParallel.state_dict_type(
                torch.nn.Linear(2, 2), StateDictType.FULL_STATE_DICT
            ):
                pass
        warnings.warn("not a deprecation", UserWarning, stacklevel=1)
    deprecations = [w for w in caught if w.startswith("FutureWarning")]
    assert deprecations, caught  # torch 2.13 deprecates FSDP.state_dict_type
    assert deprecations[0].endswith(
        "[called as torch.distributed.fsdp.fully_sharded_data_parallel."
        "FullyShardedDataParallel.state_dict_type]"
    )
    assert "UserWarning: not a deprecation" in caught  # no call named for other warnings


FAKE_TORCH_MODULE = """
import functools, warnings

def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper

def _inner():
    warnings.warn("save is deprecated", FutureWarning, stacklevel=2)

@logged
def save():
    _inner()
"""


def test_a_decorators_wrapper_inside_torch_is_passed_over_for_the_function_it_wraps() -> None:
    """torch.distributed.checkpoint wraps its entry points in a logging decorator: the call
    named is ``save``, not ``...<locals>.wrapper``; the outermost named torch frame wins."""
    module: dict[str, Any] = {"__name__": "torch.distributed.fake_checkpoint"}
    exec(compile(FAKE_TORCH_MODULE, "fake_checkpoint.py", "exec"), module)
    caught: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = protocol.recording_warnings(caught)
        module["save"]()
    assert caught == [
        "FutureWarning: save is deprecated [called as torch.distributed.fake_checkpoint.save]"
    ]


def test_new_deprecations_are_grouped_by_api_and_block_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel.state_dict_type"
    dep = f"FutureWarning: FSDP.state_dict_type() is being deprecated. [called as {api}]"
    moved = f"FutureWarning: FSDP.state_dict_type() will be removed in 2.17. [called as {api}]"
    old = [entry("state.a"), entry("state.b"), entry("state.c", warnings=[dep])]
    new = [
        entry("state.a", warnings=[dep]),
        entry("state.b", warnings=[moved]),
        entry("state.c", warnings=[dep]),
    ]
    code, lines = gate(tmp_path, capsys, old, new)
    assert code == cli.EXIT_OK
    assert "deprecations 1 (0 blocking)," in lines[1]
    (said,) = [line for line in lines if ": deprecation: " in line]
    assert said == (
        f"  [said] 2 checks: deprecation: {api} will break: FutureWarning: FSDP.state_dict_type() "
        "is being deprecated. | FutureWarning: FSDP.state_dict_type() will be removed in 2.17. "
        "(called by state.a[cpu,ws2,fsdp2,odd], state.b[cpu,ws2,fsdp2,odd])"
    )
    code, lines = gate(tmp_path, capsys, old, new, "--fail-on-deprecation")
    assert code == cli.EXIT_FAILED and lines[0].startswith("safe to upgrade: no")
    assert any(line.startswith("  [BLOCKS] 2 checks: deprecation: ") for line in lines)


# --------------------------------------------------------------------------------------------
# 5. Rollback
# --------------------------------------------------------------------------------------------

UNREADABLE = (
    "checkpoints written by torch 2.15.0 cannot be read by torch 2.13.0: global metadata read "
    "failed: too many values to unpack (expected 5)"
)


def test_a_checkpoint_the_current_torch_cannot_read_is_a_rollback_failure_of_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failed = entry("state.checkpoint", "failed", UNREADABLE + "\n  loaded into fsdp2: ...")
    back = report(failed, torch_version="2.13.0")
    code, lines = gate(tmp_path, capsys, [entry()], [entry()], rollback=back)
    assert code == cli.EXIT_FAILED
    assert lines[0].startswith("safe to upgrade: no") and "rollback 1," in lines[1]
    assert lines[2:] == [
        "rollback: the current torch loading the candidate's checkpoints:",
        f"  [BLOCKS] state.checkpoint[cpu,ws2,fsdp2,odd]: rollback: {UNREADABLE}",
    ]
    loads = report(entry("state.checkpoint"), torch_version="2.13.0")
    code, lines = gate(tmp_path, capsys, [entry()], [entry()], rollback=loads)
    assert code == cli.EXIT_OK
    assert lines[-1] == (
        "  [said] (checkpoints loaded by torch 2.13.0 at world size 2): rollback: torch 2.13.0 "
        "loads the checkpoints the other side wrote (1 checks)"
    )
    # a rollback report without the checkpoint check proves nothing: said, and it blocks
    code, lines = gate(
        tmp_path, capsys, [entry()], [entry()], rollback=report(entry(), torch_version="2.13.0")
    )
    assert code == cli.EXIT_FAILED and "holds no state.checkpoint check" in lines[-1]


def test_a_checkpoint_the_candidate_cannot_load_resharded_is_a_regression(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gate's reshard leg: the candidate loads the current torch's checkpoints at world
    size 4 (``compare --loads``)."""
    refused = entry(
        "state.checkpoint.optimizer",
        "failed",
        "fsdp2 odd: loaded the optimizer state saved at world size 2 into 4 ranks: 1 value differs",
    )
    at4 = report(refused, torch_version="2.15.0")
    at4["settings"]["world_sizes"] = [4]
    args = ["--loads", write(tmp_path / "ws4.json", at4)]
    code, lines = gate(tmp_path, capsys, [entry()], [entry()], *args)
    assert code == cli.EXIT_FAILED and "regressions 1," in lines[1]
    assert lines[3] == (
        "  [BLOCKS] state.checkpoint.optimizer[cpu,ws2,fsdp2,odd]: checkpoint: fsdp2 odd: loaded "
        "the optimizer state saved at world size 2 into 4 ranks: 1 value differs"
    )


# --------------------------------------------------------------------------------------------
# 8. The verdict first, in text, Markdown and JSON
# --------------------------------------------------------------------------------------------


def test_the_verdict_opens_every_format_with_counts_by_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = [entry(loss=0.25), entry("user.other", outcome="failed")]
    new = [entry(loss=0.30), entry("user.other")]
    table = noise_table(loss=0.0)
    code, lines = gate(tmp_path, capsys, old, new, "--markdown", table=table)
    assert code == cli.EXIT_FAILED
    assert lines[:4] == ["# Safe to upgrade: no", "", "torch 2.13.0 -> 2.15.0", ""]
    assert "| drift | 1 | 1 |" in lines and "| other changes | 1 | 0 |" in lines
    assert "## Numeric and memory drift" in lines
    code, lines = gate(tmp_path, capsys, old, new, "--json", table=table)
    data = json.loads("\n".join(lines))
    assert data["safe_to_upgrade"] is False
    assert data["counts"]["drift"] == {"count": 1, "blocking": 1}
    assert data["counts"]["change"] == {"count": 1, "blocking": 0}
    assert [d["category"] for d in data["differences"]] == ["change", "drift"]
    same = [entry(loss=0.25)]
    code, lines = gate(tmp_path, capsys, same, same, "--json")
    assert code == cli.EXIT_OK and json.loads("\n".join(lines))["safe_to_upgrade"] is True
    assert verdict.safe([]) is True
