"""The defaults fingerprint on real ranks, FSDP1 and FSDP2: what torch does with an option
omitted, observed; a default changed in torch on the ranks (``fault``) fails the check, and
compare between the clean and the changed report shows a regression."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.claims.check import PASSED, CheckRun, execute
from fsdp_conformance.claims.defaults import CHECKS
from fsdp_conformance.claims.defaults.fingerprint import (
    EXPECTED,
    LAYERS,
    observe_backward_prefetch,
    observe_forward_prefetch,
    observe_sharding,
    verdict_fingerprint,
)
from fsdp_conformance.fsdp.collectives import UNKNOWN_UNIT
from fsdp_conformance.gate import report as gate_report
from fsdp_conformance.gate.compare import compare_reports
from fsdp_conformance.harness import Ranks
from fsdp_conformance.settings import Settings

#: The defaults each version's fault changes, as a torch upgrade could.
FAULTS = {
    "fsdp1": ("reduce_dtype_default", "backward_prefetch_default"),
    "fsdp2": ("reduce_dtype_default", "reshard_after_forward_default"),
}


def _report(runs: dict[str, CheckRun]) -> dict[str, Any]:
    entries = []
    for version, run in runs.items():
        assert run.verdict is not None, run.detail
        entries.append(
            gate_report.check_entry(
                check=run.check,
                claim="defaults",
                lane="cpu",
                world_size=2,
                variant=version,
                outcome=run.outcome,
                message=run.detail,
                figures=run.verdict.figures,
                data=run.verdict.data,
                seconds=run.seconds,
                warnings=run.warnings,
            )
        )
    return gate_report.build_report(entries, Settings(), 1.0)


@pytest.mark.world_size(2)
def test_fingerprint_matches_torch_and_a_changed_default_is_a_regression(ranks: Ranks) -> None:
    checks = {c.params["version"]: c for c in CHECKS if c.name == "defaults.fingerprint"}
    clean = {v: execute(ranks, checks[v]) for v in ("fsdp1", "fsdp2")}
    for version, run in clean.items():
        assert run.outcome == PASSED, run.detail
        assert run.verdict is not None
        figures = run.verdict.figures
        assert {k: figures[k] for k in EXPECTED[version]} == EXPECTED[version]
        for case, records in run.verdict.data["collectives"].items():
            # every collective named by its unit (the tiny model's units all differ in size)
            assert records and all(r["unit"] != UNKNOWN_UNIT for r in records), (case, records)
    changed = {v: execute(ranks, checks[v], fault=FAULTS[v]) for v in ("fsdp1", "fsdp2")}
    for run in changed.values():
        assert run.outcome == "failed", run.detail
    assert changed["fsdp1"].detail.splitlines()[1:] == [
        "  defaults.backward_prefetch: expected 'prefetched' (torch 2.13, the option omitted), "
        "observed 'not prefetched'",
        "  param_dtype_only.reduce_scatter_dtype: expected 'torch.bfloat16' (torch 2.13, the "
        "option omitted), observed 'torch.float32'",
    ]
    assert changed["fsdp2"].detail.splitlines()[1:] == [
        "  defaults.unsharded_after_forward: expected [''] (torch 2.13, the option omitted), "
        "observed ['layers.0', 'layers.1', 'layers.2', '']",
        "  defaults.regathered_in_backward: expected ['layers.0', 'layers.1', 'layers.2'] "
        "(torch 2.13, the option omitted), observed []",
        "  defaults.backward_prefetch: expected 'prefetched' (torch 2.13, the option omitted), "
        "observed 'nothing to observe'",
        "  param_dtype_only.reduce_scatter_dtype: expected 'torch.bfloat16' (torch 2.13, the "
        "option omitted), observed 'torch.float32'",
    ]
    diffs = compare_reports(_report(clean), _report(changed))
    found: dict[tuple[str, str, bool], list[str]] = {}
    for d in diffs:
        version = d.check_id.rsplit(",", 1)[-1].rstrip("]")
        found.setdefault((version, d.kind, d.regression), []).append(d.text)
    for version in ("fsdp1", "fsdp2"):
        [outcome] = found[(version, "outcome", True)]
        assert outcome.startswith("passed -> failed: ")
        dtypes = found[(version, "dtype", True)]
        # the figure, and each reduce-scatter record of the param_dtype-only step
        assert "param_dtype_only.reduce_scatter_dtype: torch.bfloat16 -> torch.float32" in dtypes
        assert any(
            t.startswith(
                "param_dtype_only: collective dtype: backward reduce_scatter "
                "layers.2 in_dtype torch.bfloat16 -> torch.float32"
            )
            for t in dtypes
        ), dtypes
        assert any(
            t.startswith("param_dtype_only: collective bytes: backward reduce_scatter")
            for t in found[(version, "collectives", True)]
        )
    # FSDP1 without backward prefetch: the same collectives, the all-gathers later
    assert [t for t in found[("fsdp1", "order", False)] if t.startswith("defaults:")]
    # FSDP2 keeping units unsharded after forward: the backward all-gathers are gone
    assert any(
        t.startswith("defaults: collectives issued: - backward all_gather layers.2")
        for t in found[("fsdp2", "collectives", True)]
    )


def _rec(op: str, unit: str, phase: str) -> dict[str, Any]:
    return {"op": op, "unit": unit, "phase": phase}


def test_observers_name_what_the_collectives_show() -> None:
    # the derived observables, each on a hand-made step with and without the behaviour
    gathers = [_rec("all_gather", u, "forward") for u in LAYERS]
    ag, rs = "all_gather", "reduce_scatter"
    pre = [*gathers] + [
        _rec(op, unit, "backward")
        for op, unit in (
            (ag, "layers.2"),
            (ag, "layers.1"),
            (rs, "layers.2"),
            (ag, "layers.0"),
            (rs, "layers.1"),
            (rs, "layers.0"),
        )
    ]
    post = [*gathers] + [
        _rec(op, unit, "backward")
        for op, unit in (
            (ag, "layers.2"),
            (rs, "layers.2"),
            (ag, "layers.1"),
            (rs, "layers.1"),
            (ag, "layers.0"),
            (rs, "layers.0"),
        )
    ]
    assert observe_backward_prefetch(pre) == "prefetched"
    assert observe_backward_prefetch(post) == "not prefetched"
    assert observe_sharding(pre) == "FULL_SHARD"
    kept = [r for r in pre if not (r["op"] == "all_gather" and r["phase"] == "backward")]
    assert observe_sharding(kept) == "SHARD_GRAD_OP"
    assert observe_sharding([_rec("all_reduce", u, "backward") for u in LAYERS]) == "NO_SHARD"
    # forward: layer k+1 gathered before layer k's forward returned (marks: index, kind, unit)
    ends_after = [
        (1, "fwd_end", "layers.0"),
        (2, "fwd_end", "layers.1"),
        (3, "fwd_end", "layers.2"),
    ]
    ends_before = [
        (2, "fwd_end", "layers.0"),
        (3, "fwd_end", "layers.1"),
        (3, "fwd_end", "layers.2"),
    ]
    assert observe_forward_prefetch(gathers, ends_after) == "not prefetched"
    assert observe_forward_prefetch(gathers, ends_before) == "prefetched"


def test_an_explicit_option_whose_meaning_moved_fails_naming_it() -> None:
    # Parent side: torch 2.13's figures with the root kept unsharded after forward despite an
    # explicit reshard_after_forward=True (its meaning changed in 2025: pytorch/pytorch#154704),
    # and SHARD_GRAD_OP issuing FULL_SHARD's collectives.
    fsdp2 = {**EXPECTED["fsdp2"], "explicit_true.unsharded_after_forward": [""]}
    fsdp1 = {**EXPECTED["fsdp1"], "explicit_shard_grad_op.sharding": "FULL_SHARD"}
    for version, figures, key in (
        ("fsdp2", fsdp2, "explicit_true.unsharded_after_forward"),
        ("fsdp1", fsdp1, "explicit_shard_grad_op.sharding"),
    ):
        values = [{"rank": r, "figures": figures, "collectives": {}} for r in range(2)]
        verdict = verdict_fingerprint(values, {"version": version})
        assert not verdict.passed
        assert verdict.message.splitlines()[0].endswith(f": {key}"), verdict.message
        assert "(torch 2.13, the option as given)" in verdict.message
