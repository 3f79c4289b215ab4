"""Recorded collectives: the recorder's records, their place in the report, and what compare
makes of them (a changed dtype or byte count is a regression, a changed order a difference).

Hand-made records and reports: no ranks. The recorder on real FSDP1/FSDP2 steps is exercised by
tests/test_defaults.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_conformance.fsdp.collectives import UNKNOWN_UNIT, CollectiveRecorder
from fsdp_conformance.gate import report as gate_report
from fsdp_conformance.gate.compare import compare_reports
from fsdp_conformance.gate.report import ReportError
from fsdp_conformance.settings import Settings

pytestmark = pytest.mark.cpu

FP32, BF16 = str(torch.float32), str(torch.bfloat16)


def record(
    op: str, unit: str, phase: str, dtype: str = FP32, numel: int = 144, world_size: int = 2
) -> dict[str, Any]:
    size = 4 if dtype == FP32 else 2
    full, shard = numel * size, numel * size // world_size
    gather = op == "all_gather"
    return {
        "op": op,
        "unit": unit,
        "phase": phase,
        "in_dtype": dtype,
        "out_dtype": dtype,
        "in_bytes": shard if gather else full,
        "out_bytes": full if gather else shard,
    }


def step() -> list[dict[str, Any]]:
    """A FULL_SHARD step of two units with backward prefetch (as FSDP1 issues it)."""
    return [
        record("all_gather", "layers.0", "forward"),
        record("all_gather", "layers.1", "forward", numel=204),
        record("all_gather", "layers.1", "backward", numel=204),
        record("all_gather", "layers.0", "backward"),
        record("reduce_scatter", "layers.1", "backward", numel=204),
        record("reduce_scatter", "layers.0", "backward"),
    ]


def report_of(collectives: Any) -> dict[str, Any]:
    entry = gate_report.check_entry(
        check="defaults.fingerprint",
        claim="defaults",
        lane="cpu",
        world_size=2,
        variant="fsdp1",
        outcome="passed",
        message="ok",
        figures={},
        data={"collectives": collectives},
        seconds=0.1,
        warnings=(),
    )
    return gate_report.build_report([entry], Settings(), 1.0)


def diffs_of(old: Any, new: Any) -> list[tuple[str, bool, str]]:
    return [(d.kind, d.regression, d.text) for d in compare_reports(report_of(old), report_of(new))]


# --------------------------------------------------------------------------------------------
# The recorder
# --------------------------------------------------------------------------------------------


def test_recorder_reads_op_dtypes_bytes_and_names_the_unit_by_size() -> None:
    rec = CollectiveRecorder({"": [12], "layers.0": [144], "a": [50], "b": [50]})
    rec.phase = "forward"
    shard, full = torch.zeros(72, dtype=torch.bfloat16), torch.zeros(144, dtype=torch.bfloat16)
    rec.add("c10d._allgather_base_.default", [full, shard, None])
    # FSDP1 on gloo: allgather_(output lists, inputs); the outputs together are the full side
    rec.add("c10d.allgather_.default", [[[torch.zeros(6), torch.zeros(6)]], [torch.zeros(6)]])
    rec.phase = "backward"
    rec.add("c10d._reduce_scatter_base_.default", [torch.zeros(25), torch.zeros(50)])
    rec.add("c10d.allreduce_.default", [[torch.zeros(7, dtype=torch.float64)]])
    rec.add("c10d.barrier.default", [[torch.zeros(1)]])  # not a collective FSDP's step issues
    assert rec.records == [
        {
            "op": "all_gather",
            "unit": "layers.0",
            "phase": "forward",
            "in_dtype": BF16,
            "out_dtype": BF16,
            "in_bytes": 144,
            "out_bytes": 288,
            "numel": 144,
        },
        {
            "op": "all_gather",
            "unit": "",
            "phase": "forward",
            "in_dtype": FP32,
            "out_dtype": FP32,
            "in_bytes": 24,
            "out_bytes": 48,
            "numel": 12,
        },
        # two units of one size cannot be told apart by size: both are named
        {
            "op": "reduce_scatter",
            "unit": "a|b",
            "phase": "backward",
            "in_dtype": FP32,
            "out_dtype": FP32,
            "in_bytes": 200,
            "out_bytes": 100,
            "numel": 50,
        },
        {
            "op": "all_reduce",
            "unit": UNKNOWN_UNIT,
            "phase": "backward",
            "in_dtype": str(torch.float64),
            "out_dtype": str(torch.float64),
            "in_bytes": 56,
            "out_bytes": 56,
            "numel": 7,
        },
    ]


# --------------------------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------------------------


def test_compare_same_collectives_no_difference() -> None:
    # the negative control: equal records (and equal but reordered steps) are no difference
    assert diffs_of({"defaults": step(), "mp": step()}, {"mp": step(), "defaults": step()}) == []


def test_compare_changed_collective_dtype_is_a_regression() -> None:
    new = step()
    new[4] = record("reduce_scatter", "layers.1", "backward", dtype=BF16, numel=204)
    [(kind, regression, text), (kind2, regression2, text2)] = diffs_of({"mp": step()}, {"mp": new})
    assert (kind, regression) == ("dtype", True)
    assert text == (
        "mp: collective dtype: backward reduce_scatter layers.1 in_dtype "
        "torch.float32 -> torch.bfloat16; backward reduce_scatter layers.1 out_dtype "
        "torch.float32 -> torch.bfloat16"
    )
    # a bf16 reduce-scatter also moves half the bytes: reported as such
    assert (kind2, regression2) == ("collectives", True)
    assert "in_bytes 816 -> 408" in text2


def test_compare_changed_collective_bytes_is_a_regression() -> None:
    new = step()
    new[0] = record("all_gather", "layers.0", "forward", numel=160)  # padded differently
    assert diffs_of([*step()], new) == [
        (
            "collectives",
            True,
            "collective bytes: forward all_gather layers.0 in_bytes 288 -> 320; "
            "forward all_gather layers.0 out_bytes 576 -> 640",
        )
    ]


def test_compare_collective_issued_or_gone_is_a_regression() -> None:
    # reshard_after_forward off: the backward all-gathers are no longer issued
    new = [r for r in step() if not (r["op"] == "all_gather" and r["phase"] == "backward")]
    [(kind, regression, text)] = diffs_of({"defaults": step()}, {"defaults": new})
    assert (kind, regression) == ("collectives", True)
    assert text == (
        "defaults: collectives issued: - backward all_gather layers.1; "
        "- backward all_gather layers.0"
    )
    [(kind, regression, text)] = diffs_of({"defaults": new}, {"defaults": step()})
    assert (regression, text.split(": ", 1)[1]) == (
        True,
        "collectives issued: + backward all_gather layers.1; + backward all_gather layers.0",
    )


def test_compare_changed_collective_order_is_a_difference_not_a_regression() -> None:
    # backward prefetch off: layers.0's all-gather now after layers.1's reduce-scatter
    new = step()
    new[3], new[4] = new[4], new[3]
    assert diffs_of({"defaults": step()}, {"defaults": new}) == [
        (
            "order",
            False,
            "defaults: collective order now: forward all_gather layers.0, forward "
            "all_gather layers.1, backward all_gather layers.1, backward "
            "reduce_scatter layers.1, backward all_gather layers.0, backward "
            "reduce_scatter layers.0",
        )
    ]


def test_compare_step_missing_is_a_regression_and_a_new_step_a_change() -> None:
    assert diffs_of({"a": step(), "b": step()}, {"a": step(), "c": step()}) == [
        ("collectives", True, "b: no collectives recorded any more (was 6)"),
        ("collectives", False, "c: newly recorded (6 collectives)"),
    ]


def test_report_with_a_damaged_collective_record_is_refused(tmp_path: Path) -> None:
    good = report_of({"defaults": step()})
    path = tmp_path / "r.json"
    path.write_text(json.dumps(good))
    assert gate_report.load_report(str(path))["checks"][0]["data"]["collectives"]
    bad = copy.deepcopy(good)
    del bad["checks"][0]["data"]["collectives"]["defaults"][2]["in_bytes"]
    path.write_text(json.dumps(bad))
    with pytest.raises(
        ReportError,
        match=r"checks\[0\]\.data\.collectives\.defaults\[2\]\."
        r"in_bytes: expected an integer >= 0, found nothing",
    ):
        gate_report.load_report(str(path))
    bad = copy.deepcopy(good)
    bad["checks"][0]["data"]["collectives"] = 3
    path.write_text(json.dumps(bad))
    with pytest.raises(ReportError, match=r"data\.collectives: expected an object of lists"):
        gate_report.load_report(str(path))
