"""Reports: entries, the JSON report and its atomic write, the human formats, and compare.

Everything here is built by hand with ``check_entry``/``build_report``: no suite run. The
translation of torch's errors (:mod:`fsdp_conformance.fsdp.torch_errors`) is tested on the texts
torch raises, and once on ranks where torch raises it for real. The CLI end to end (real runs,
real reports) is in test_cli.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_conformance import _files
from fsdp_conformance.claims.check import Check, Verdict, execute, run_check
from fsdp_conformance.fsdp import torch_errors
from fsdp_conformance.gate import compare, schema, tables, verdict
from fsdp_conformance.gate import report as gate_report
from fsdp_conformance.gate.compare import compare_reports
from fsdp_conformance.gate.difference import Difference
from fsdp_conformance.gate.report import ReportError
from fsdp_conformance.harness import RankFailure, RankOutcome, Ranks
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.settings import Settings

pytestmark = pytest.mark.cpu

MiB = 2**20


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def entry(
    check: str = "wrap.units.exact",
    outcome: str = "passed",
    *,
    variant: str = "fsdp1,massive",
    figures: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    warnings: Iterable[str] = (),
    message: str = "ok",
) -> dict[str, Any]:
    return gate_report.check_entry(
        check=check,
        claim=check.split(".")[0],
        lane="cpu",
        world_size=2,
        variant=variant,
        outcome=outcome,
        message=message,
        figures=figures or {},
        data=data or {},
        seconds=0.1,
        warnings=warnings,
    )


def report(
    *entries: Mapping[str, Any], torch_version: str = "2.13.0+cpu", settings: Settings | None = None
) -> dict[str, Any]:
    built = gate_report.build_report(list(entries), settings or Settings(), 1.5)
    built["environment"]["torch"] = torch_version
    return built


def unit(
    fqn: str, cls: str, numel: int, parent: str | None = "", params: Sequence[str] = ()
) -> dict[str, Any]:
    return {
        "fqn": fqn,
        "cls": cls,
        "numel": numel,
        "local_numel": numel // 2,
        "parent": parent,
        "params": list(params),
    }


def per_layer_units(layers: int = 2, layer_numel: int = 100) -> list[dict[str, Any]]:
    return [unit("", "MassiveModel", 10, None, ["embed.weight"])] + [
        unit(f"layers.{i}", "DecoderLayer", layer_numel, "", [f"layers.{i}.attn.weight"])
        for i in range(layers)
    ]


def compare_one(old: Mapping[str, Any], new: Mapping[str, Any], **kw: Any) -> list[Difference]:
    return compare_reports(report(old), report(new), **kw)


def kinds(diffs: Sequence[Difference]) -> list[tuple[str, bool]]:
    return [(d.kind, d.regression) for d in diffs]


# --------------------------------------------------------------------------------------------
# Entries and the report
# --------------------------------------------------------------------------------------------


def test_check_entry_id_names_check_lane_world_size_and_variant() -> None:
    e = entry("init.weights.fsdp1", variant="fsdp1,llama")
    assert e["id"] == "init.weights.fsdp1[cpu,ws2,fsdp1,llama]"
    assert entry("wrap.builders.size", variant="")["id"] == "wrap.builders.size[cpu,ws2]"


def test_check_entry_sorts_warnings_and_picks_out_the_deprecations() -> None:
    e = entry(
        warnings=[
            "UserWarning: b",
            "FutureWarning: NO_SHARD is deprecated",
            "UserWarning: b",
            "DeprecationWarning: old api",
        ]
    )
    assert e["warnings"] == [
        "DeprecationWarning: old api",
        "FutureWarning: NO_SHARD is deprecated",
        "UserWarning: b",
    ]
    assert e["deprecations"] == [
        "DeprecationWarning: old api",
        "FutureWarning: NO_SHARD is deprecated",
    ]


def test_check_entry_turns_check_data_into_plain_json() -> None:
    @dataclasses.dataclass
    class Row:
        name: str
        dtype: Any

    e = entry(
        figures={"param_dtype": torch.bfloat16, "sizes": (1, 2)},
        data={"rows": [Row("a", torch.float32)], "seen": {3, 1}, 7: None},
    )
    text = json.dumps(e)  # must not raise
    back = json.loads(text)
    assert back["figures"] == {"param_dtype": "torch.bfloat16", "sizes": [1, 2]}
    assert back["data"] == {
        "rows": [{"name": "a", "dtype": "torch.float32"}],
        "seen": [1, 3],
        "7": None,
    }


def test_build_report_has_schema_environment_settings_and_counts() -> None:
    settings = Settings(world_sizes=(2, 4), model="pkg.mod:build", sources={"model": "cli"})
    r = gate_report.build_report(
        [entry(outcome="passed"), entry("a.b", "failed"), entry("c.d", "skipped")], settings, 2.0
    )
    assert r["schema"] == schema.SCHEMA and r["schema_version"] == 1
    assert r["environment"]["torch"] == torch.__version__
    assert "gloo" in r["environment"]["backends"]
    assert r["settings"]["world_sizes"] == [2, 4] and r["settings"]["model"] == "pkg.mod:build"
    assert "sources" not in r["settings"]  # where a value came from is not part of the result
    assert r["summary"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 0, "xfailed": 0}
    assert [e["check"] for e in r["checks"]] == ["wrap.units.exact", "a.b", "c.d"]
    assert "notes" not in r  # nothing to say: no field
    json.dumps(r)


def test_the_preflight_notes_are_kept_by_the_report_and_its_summary() -> None:
    note = "FSDP1 unit(s) 'h.0' hold frozen and trainable parameters; the checks run with the fix"
    r = gate_report.build_report([entry(outcome="passed")], Settings(), 1.0, notes=[note])
    assert r["notes"] == [note]
    schema.validate_report(r)
    assert f"Note: {note}" in tables.format_markdown(r)
    damaged = {**r, "notes": "not a list"}
    with pytest.raises(schema.Damage, match="notes"):
        schema.validate_report(damaged)


# --------------------------------------------------------------------------------------------
# Writing and loading
# --------------------------------------------------------------------------------------------


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in ("report.json",))


def test_report_round_trips_through_write_and_load(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "report.json"  # the folder is created
    r = report(entry(figures={"peak_bytes": 3 * MiB}))
    gate_report.write_json_report(str(path), r)
    assert gate_report.load_report(str(path)) == r
    assert _leftovers(path.parent) == []


def test_written_report_is_readable_by_others_like_any_file(tmp_path: Path) -> None:
    # mkstemp makes 0600 files; a CI artifact must get the mode open() would give it.
    path = tmp_path / "report.json"
    old_mask = os.umask(0o022)
    try:
        gate_report.write_json_report(str(path), report())
    finally:
        os.umask(old_mask)
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("fail_at", ["dumps", "fsync", "replace"])
def test_interrupted_write_keeps_the_old_report_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: str
) -> None:
    path = tmp_path / "report.json"
    old = report(entry(outcome="passed"))
    gate_report.write_json_report(str(path), old)
    before = path.read_bytes()

    def interrupt(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt  # as Ctrl-C mid-write

    target = {
        "dumps": (gate_report.json, "dumps"),
        "fsync": (_files.os, "fsync"),
        "replace": (_files.os, "replace"),
    }[fail_at]
    monkeypatch.setattr(*target, interrupt)
    with pytest.raises(KeyboardInterrupt):
        gate_report.write_json_report(str(path), report(entry(outcome="failed")))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert gate_report.load_report(str(path))["summary"]["passed"] == 1
    assert _leftovers(tmp_path) == []


def _write(path: Path, content: Any) -> str:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_load_report_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"does not exist; give the path of a JSON report"):
        gate_report.load_report(str(tmp_path / "nope.json"))


def test_load_report_refuses_a_file_that_is_not_json(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"is not valid JSON .*written by `fsdp-conformance run`"):
        gate_report.load_report(_write(tmp_path / "r.json", '{"schema": "fsdp-conf'))


def test_load_report_refuses_another_schema(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"not an fsdp-conformance report"):
        gate_report.load_report(_write(tmp_path / "r.json", {"schema": "junit", "checks": []}))
    with pytest.raises(ReportError, match=r"not an fsdp-conformance report"):
        gate_report.load_report(_write(tmp_path / "r.json", [1, 2]))


def test_load_report_refuses_another_schema_version_and_says_to_rerun(tmp_path: Path) -> None:
    r = report()
    r["schema_version"] = 2
    with pytest.raises(ReportError, match=r"schema version 2, this tool reads 1; re-run"):
        gate_report.load_report(_write(tmp_path / "r.json", r))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda r: r.pop("environment"),
            "damaged: environment: expected an object, found "
            r"nothing \(the field is missing\)",
        ),
        (lambda r: r.update(checks={}), r"checks: expected a list, found an object \({}\)"),
        (lambda r: r["checks"][0].pop("outcome"), r"checks\[0\].outcome: expected one of"),
        (
            lambda r: r["checks"][0].update(outcome="ok"),
            r"checks\[0\].outcome: expected one of passed, failed, skipped, error, xfailed, found a "
            r"string "
            r"\(\"ok\"\)",
        ),
        (
            lambda r: r["checks"].append(dict(r["checks"][0])),
            r"checks\[1\].id: expected an id unique in the report, .* appears twice \(also "
            r"checks\[0\]\)",
        ),
    ],
)
def test_load_report_refuses_a_damaged_report_in_one_message(
    tmp_path: Path, damage: Any, message: str
) -> None:
    r = report(entry())
    damage(r)
    with pytest.raises(ReportError, match=message) as info:
        gate_report.load_report(_write(tmp_path / "r.json", r))
    assert "\n" not in str(info.value)


def test_load_report_accepts_fields_the_schema_does_not_document(tmp_path: Path) -> None:
    # schema version 1 grows by adding fields: a newer tool's extra fields are not damage
    r = report(entry(data={"units": per_layer_units()}))
    r["launcher"] = "torchrun"
    r["environment"]["hostname"] = "node-1"
    r["checks"][0]["ranks"] = [0, 1]
    r["checks"][0]["data"]["units"][0]["extra"] = {"any": ["thing"]}
    assert gate_report.load_report(_write(tmp_path / "r.json", r)) == r
    del r["checks"][0]["data"]["units"][0]["cls"]  # the control: a documented field missing
    with pytest.raises(ReportError, match=r"checks\[0\]\.data\.units\[0\]\.cls: expected a string"):
        gate_report.load_report(_write(tmp_path / "r.json", r))


def test_comparability_names_model_settings_and_missing_common_checks() -> None:
    same = report(entry())
    assert compare.comparability(same, report(entry(), torch_version="2.14.1")) is None
    other = report(
        entry(variant="fsdp1,pkg:build"),
        settings=Settings(model="pkg:build", block_cls="Block", min_params=4000),
    )
    assert compare.comparability(same, other) == (
        "settings.model None vs 'pkg:build'; settings.block_cls None vs 'Block'; "
        "settings.min_params None vs 4000; no check in common (1 checks vs 1)"
    )
    # the same model, one common check: comparable (the others are missing / added)
    assert compare.comparability(report(entry(), entry("a.b")), same) is None


# --------------------------------------------------------------------------------------------
# Human output
# --------------------------------------------------------------------------------------------


def test_table_shows_each_check_its_outcome_figures_and_the_failure_reason() -> None:
    r = report(
        entry(figures={"units": 6, "peak_bytes": 27 * MiB + MiB // 2}),
        entry(
            "memory.sawtooth",
            "failed",
            figures={"max_rise_bytes": 300 * 1024},
            message="the timeline is not a sawtooth\n  rank 0: ...\n",
        ),
        entry(
            "init.weights.fsdp1",
            "error",
            message="check failed\nTraceback ...\nValueError: meta vs cpu\n",
        ),
    )
    table = tables.format_table(r)
    lines = table.splitlines()
    assert lines[0].split() == ["check", "outcome", "key", "figures"]
    assert "wrap.units.exact[cpu,ws2,fsdp1,massive]" in lines[2]
    assert "PASSED" in lines[2] and "units 6, peak 27.50 MiB" in lines[2]
    # KiB below a MiB: a small model's units would otherwise all read 0.00 MiB.
    assert "FAILED   the timeline is not a sawtooth | max_rise 300.0 KiB" in table
    assert "ERROR    ValueError: meta vs cpu" in table  # the telling line, not the first
    assert lines[-1] == "1 passed, 1 failed, 0 skipped, 1 errors in 1.5s (torch 2.13.0+cpu)"


def test_markdown_summary_has_status_table_failure_details_and_deprecations() -> None:
    passing = tables.format_markdown(report(entry()))
    assert passing.startswith("## FSDP conformance: PASS")
    r = report(
        entry(warnings=["FutureWarning: The `NO_SHARD` sharding strategy is deprecated."]),
        entry("memory.sawtooth", "failed", message="rank 1: unit layers.0 gathered twice"),
    )
    md = tables.format_markdown(r)
    assert md.startswith("## FSDP conformance: FAIL")
    assert "| `memory.sawtooth[cpu,ws2,fsdp1,massive]` | ❌ failed |" in md
    assert "<details><summary>memory.sawtooth[cpu,ws2,fsdp1,massive]: failed</summary>" in md
    assert "rank 1: unit layers.0 gathered twice" in md
    assert "### Deprecations torch emitted" in md
    assert "- FutureWarning: The `NO_SHARD` sharding strategy is deprecated." in md


# --------------------------------------------------------------------------------------------
# compare: outcomes and presence
# --------------------------------------------------------------------------------------------


def test_identical_reports_have_no_differences() -> None:
    e = entry(
        figures={"units": 3, "peak_bytes": 5 * MiB, "loss": 0.33},
        data={"actual": per_layer_units()},
        warnings=["UserWarning: x"],
    )
    old, new = report(e, torch_version="2.13.0"), report(e, torch_version="2.14.1")
    assert compare_reports(old, new) == []
    assert verdict.format_text(old, new, []).splitlines() == [
        "safe to upgrade: yes (torch 2.13.0 -> 2.14.1)",
        "  regressions 0, drift 0, known defects 0, deprecations 0, rollback 0, "
        "fixed upstream 0, other changes 0",
        "no differences",
    ]


def test_pass_to_fail_is_a_regression_with_the_reason() -> None:
    diffs = compare_one(entry(), entry(outcome="failed", message="unit set differs\n- layers.1"))
    assert kinds(diffs) == [("outcome", True)]
    assert diffs[0].text == "passed -> failed: unit set differs"


def test_fail_to_pass_is_a_change_not_a_regression() -> None:
    diffs = compare_one(entry(outcome="failed"), entry(outcome="passed"))
    assert kinds(diffs) == [("outcome", False)] and diffs[0].text == "failed -> passed"


@pytest.mark.parametrize(
    ("old", "new", "regression"),
    [
        ("passed", "skipped", True),  # a check that stopped running proves nothing any more
        ("passed", "error", True),
        ("skipped", "failed", True),
        ("skipped", "passed", False),
        ("error", "failed", False),  # broken both times: a change of how, not a regression
        ("failed", "error", False),
    ],
)
def test_outcome_moves_are_regressions_only_when_worse(
    old: str, new: str, regression: bool
) -> None:
    diffs = compare_one(entry(outcome=old), entry(outcome=new))
    assert kinds(diffs) == [("outcome", regression)]


EXPECTED = {
    "check": "state.summon.rank0_discard",
    "torch": ">=2.13, <2.16",
    "reason": "a known torch defect",
    "link": "https://example.org/defect",
}


def xfailed(check: str = "wrap.units.exact") -> dict[str, Any]:
    e = entry(check, "xfailed", message="expected failure: a known torch defect\nthe tree")
    e["expected"] = dict(EXPECTED)
    return e


def test_an_expected_failure_is_counted_shown_and_does_not_fail_the_summary(
    tmp_path: Path,
) -> None:
    r = report(entry(), xfailed("a.b"))
    assert r["summary"]["xfailed"] == 1 and r["summary"]["failed"] == 0
    path = str(tmp_path / "r.json")
    gate_report.write_json_report(path, r)
    assert gate_report.load_report(path)["checks"][1]["expected"] == EXPECTED
    table = tables.format_table(r)
    assert "XFAILED  known torch defect: https://example.org/defect" in table
    assert "1 expected failure in" in table and "expected failure a.b[" in table
    markdown = tables.format_markdown(r)
    assert markdown.startswith("## FSDP conformance: PASS")
    assert "a.b[cpu,ws2,fsdp1,massive]: expected failure (known torch defect)" in markdown


def test_a_report_from_before_expected_failures_still_loads(tmp_path: Path) -> None:
    r = report(entry())
    del r["summary"]["xfailed"]
    path = _write(tmp_path / "old.json", r)
    assert gate_report.load_report(path)["summary"] == {
        "passed": 1,
        "failed": 0,
        "skipped": 0,
        "error": 0,
    }
    r = report(xfailed())
    del r["summary"]["xfailed"]  # but a count it needs is still required
    with pytest.raises(ReportError, match="summary.xfailed"):
        gate_report.load_report(_write(tmp_path / "damaged.json", r))


@pytest.mark.parametrize(
    ("old", "new", "kind", "regression", "says"),
    [
        ("xfailed", "passed", "fixed", False, "fixed upstream? its expectation can go"),
        # the user would hit the defect: the candidate is not safe
        (
            "passed",
            "xfailed",
            "known_defect",
            True,
            "the candidate has a known torch defect your checks hit",
        ),
        # the check never passed here: nothing the user had is lost
        (
            "skipped",
            "xfailed",
            "known_defect",
            False,
            "the candidate has a known torch defect your checks hit",
        ),
        ("xfailed", "failed", "outcome", True, "xfailed -> failed"),
        ("xfailed", "error", "outcome", True, "xfailed -> error"),
        ("failed", "xfailed", "outcome", False, "failed -> xfailed"),
    ],
)
def test_compare_says_when_an_expected_failure_passes_and_when_no_expectation_covers_one(
    old: str,
    new: str,
    kind: str,
    regression: bool,
    says: str,
) -> None:
    before = xfailed() if old == "xfailed" else entry(outcome=old)
    after = xfailed() if new == "xfailed" else entry(outcome=new, message="boom")
    (diff,) = compare_one(before, after)
    assert (diff.kind, diff.regression) == (kind, regression)
    assert says in diff.text


def test_a_documented_change_as_an_expected_failure_is_named_a_change_and_its_figures_still_count() -> (
    None
):
    """defaults.fingerprint on 2.15 (kind "change"): the outcome move is a known change the
    user's checks hit, said as such; the dtype it moved is a regression too."""
    before = entry("defaults.fingerprint", figures={"reduce_scatter_dtype": "torch.bfloat16"})
    after = entry(
        "defaults.fingerprint", "xfailed", figures={"reduce_scatter_dtype": "torch.float32"}
    )
    after["expected"] = {**EXPECTED, "kind": "change"}
    diffs = compare_one(before, after)
    assert kinds(diffs) == [("known_defect", True), ("dtype", True)]
    assert "passed -> xfailed: the candidate has a known torch change your checks hit" in (
        diffs[0].text
    )
    table = tables.format_table(report(after))
    assert "XFAILED  known torch change: " in table


def test_a_missing_check_is_a_regression_and_an_added_one_a_change() -> None:
    old = report(entry("wrap.units.exact"), entry("init.weights", variant="fsdp1,llama"))
    new = report(entry("wrap.units.exact"), entry("memory.sawtooth"))
    diffs = compare_reports(old, new)
    assert [(d.check_id, d.kind, d.regression) for d in diffs] == [
        ("init.weights[cpu,ws2,fsdp1,llama]", "missing", True),
        ("memory.sawtooth[cpu,ws2,fsdp1,massive]", "added", False),
    ]
    assert diffs[0].text == "check missing from the new report (was passed)"


def test_an_added_check_that_fails_is_a_regression() -> None:
    old = report(entry("wrap.units.exact"))
    new = report(entry("wrap.units.exact"), entry("memory.sawtooth", outcome="failed"))
    diffs = compare_reports(old, new)
    assert [(d.check_id, d.kind, d.regression) for d in diffs] == [
        ("memory.sawtooth[cpu,ws2,fsdp1,massive]", "added", True),
    ]


def test_different_settings_are_reported_as_context_not_regressions() -> None:
    old = report(entry(), settings=Settings(world_sizes=(2,)))
    new = report(entry(), settings=Settings(world_sizes=(2, 4), model="pkg.mod:build"))
    diffs = compare_reports(old, new)
    assert [(d.check_id, d.kind, d.regression, d.text) for d in diffs] == [
        ("(settings)", "settings", False, "model: None -> 'pkg.mod:build'"),
        ("(settings)", "settings", False, "world_sizes: [2] -> [2, 4]"),
    ]


# --------------------------------------------------------------------------------------------
# compare: unit structure
# --------------------------------------------------------------------------------------------


def test_changed_unit_structure_is_a_regression_naming_the_units() -> None:
    old_units = per_layer_units(layers=2)
    mlp = unit("layers.1.mlp", "Sequential", 60, "", ["layers.1.mlp.0.weight"])
    new_units = [*old_units[:2], mlp]
    diffs = compare_one(
        entry(figures={"units": 3}, data={"actual": old_units}),
        entry(figures={"units": 3}, data={"actual": new_units}),
    )
    assert kinds(diffs) == [("units", True)]
    assert diffs[0].text == (
        "unit structure changed: - layers.1 (DecoderLayer); + layers.1.mlp (Sequential)"
    )


def test_unit_count_change_is_reported_once_with_the_unit_lists() -> None:
    diffs = compare_one(
        entry(figures={"units": 3}, data={"units": per_layer_units(2)}),
        entry(figures={"units": 2}, data={"units": per_layer_units(1)}),
    )
    assert kinds(diffs) == [("units", True)]
    assert "- layers.1 (DecoderLayer)" in diffs[0].text


def test_unit_size_parent_and_parameter_moves_are_named_field_by_field() -> None:
    old_units = per_layer_units(2)
    new_units = [dict(u) for u in old_units]
    new_units[1] = dict(new_units[1], numel=120, local_numel=60)
    new_units[2] = dict(
        new_units[2], parent="layers.0", params=["layers.1.attn.weight", "embed.weight"]
    )
    diffs = compare_one(entry(data={"plan": old_units}), entry(data={"plan": new_units}))
    assert kinds(diffs) == [("units", True)]
    assert diffs[0].text == (
        "unit structure changed: ~ layers.0 numel: 100 -> 120; ~ layers.0 local_numel: 50 -> 60; "
        "~ layers.1 parent: '' -> 'layers.0'; ~ layers.1 params: +embed.weight"
    )


def test_parameter_order_inside_a_unit_is_not_a_structure_change() -> None:
    a = [unit("", "M", 10, None, ["a.weight", "a.bias"])]
    b = [unit("", "M", 10, None, ["a.bias", "a.weight"])]
    assert compare_one(entry(data={"actual": a}), entry(data={"actual": b})) == []


def test_unit_count_without_unit_lists_is_still_compared() -> None:
    diffs = compare_one(entry(figures={"units": 6}), entry(figures={"units": 5}))
    assert [(d.kind, d.regression, d.text) for d in diffs] == [("units", True, "unit count 6 -> 5")]


# --------------------------------------------------------------------------------------------
# compare: memory, dtypes, other figures
# --------------------------------------------------------------------------------------------


def test_memory_up_by_more_than_the_tolerance_is_a_regression() -> None:
    diffs = compare_one(
        entry(figures={"peak_bytes": 100 * MiB}), entry(figures={"peak_bytes": 106 * MiB})
    )
    assert kinds(diffs) == [("memory", True)]
    assert diffs[0].text == (
        "peak_bytes: 100.00 MiB -> 106.00 MiB (+6.0%; tolerance 5%, floor 1.00 MiB)"
    )


def test_memory_within_the_tolerance_is_not_reported() -> None:
    assert (
        compare_one(
            entry(figures={"peak_bytes": 100 * MiB}), entry(figures={"peak_bytes": 104 * MiB})
        )
        == []
    )


def test_memory_down_by_more_than_the_tolerance_is_a_change() -> None:
    diffs = compare_one(entry(figures={"peak_MiB": 40.0}), entry(figures={"peak_MiB": 30.0}))
    assert kinds(diffs) == [("memory", False)]
    assert "peak_MiB: 40.00 MiB -> 30.00 MiB (-25.0%" in diffs[0].text


def test_memory_tolerance_is_honoured() -> None:
    old, new = entry(figures={"peak_bytes": 100 * MiB}), entry(figures={"peak_bytes": 106 * MiB})
    assert compare_one(old, new, memory_tolerance=0.10) == []
    assert kinds(compare_one(old, new, memory_tolerance=0.01)) == [("memory", True)]


def test_memory_floor_keeps_moves_off_a_zero_baseline_from_counting() -> None:
    # growth off 0 is infinite in relative terms; under the absolute floor it is noise.
    old, new = entry(figures={"growth_MiB": 0.0}), entry(figures={"growth_MiB": 0.5})
    assert compare_one(old, new) == []
    diffs = compare_one(old, new, memory_floor_bytes=0.25 * MiB)
    assert kinds(diffs) == [("memory", True)] and "(+inf%" in diffs[0].text


def test_memory_lists_are_compared_element_by_element() -> None:
    old = entry(figures={"working_set_bytes": [7 * MiB, 7 * MiB, 7 * MiB]})
    within = entry(figures={"working_set_bytes": [7 * MiB, 7 * MiB, 7 * MiB + 65536]})
    beyond = entry(figures={"working_set_bytes": [7 * MiB, 7 * MiB, 9 * MiB]})
    assert compare_one(old, within) == []
    diffs = compare_one(old, beyond)
    assert kinds(diffs) == [("memory", True)]
    assert diffs[0].text.startswith("working_set_bytes[2]: 7.00 MiB -> 9.00 MiB")


def test_dtype_change_is_a_regression() -> None:
    diffs = compare_one(
        entry(figures={"reduce_dtype": "torch.float32"}),
        entry(figures={"reduce_dtype": "torch.bfloat16"}),
    )
    assert [(d.kind, d.regression, d.text) for d in diffs] == [
        ("dtype", True, "reduce_dtype: torch.float32 -> torch.bfloat16")
    ]


def test_measured_floats_are_left_to_the_checks_and_other_figures_are_changes() -> None:
    old = entry(
        figures={
            "loss": 0.3328,
            "tracker_over_truth": [0.999, 0.991],
            "digest": "b70745a46663be67",
            "steps": 3,
        }
    )
    new = entry(
        figures={
            "loss": 0.3329,
            "tracker_over_truth": [0.987, 0.992],
            "digest": "8c4881791b91a717",
            "steps": 3,
        }
    )
    diffs = compare_one(old, new)
    # No noise measured for the two floats: drift cannot be told from noise, and is said once.
    assert [(d.kind, d.regression) for d in diffs] == [("figure", False), ("drift", False)]
    assert diffs[0].text == "digest: 'b70745a46663be67' -> '8c4881791b91a717'"
    assert "noise was never measured" in diffs[1].text
    assert "loss" in diffs[1].text and "tracker_over_truth" in diffs[1].text


# --------------------------------------------------------------------------------------------
# compare: warnings and deprecations
# --------------------------------------------------------------------------------------------


def test_new_warning_and_new_deprecation_are_reported_as_changes() -> None:
    old = entry(warnings=["UserWarning: known"])
    new = entry(
        warnings=[
            "UserWarning: known",
            "UserWarning: returned a view tensor",
            "FutureWarning: `NO_SHARD` is deprecated",
        ]
    )
    diffs = compare_one(old, new)
    cid = new["id"]
    assert [(d.kind, d.regression, d.text) for d in diffs] == [
        (
            "deprecation",
            False,
            f"NO_SHARD will break: FutureWarning: `NO_SHARD` is deprecated (called by {cid})",
        ),
        ("warning", False, "new warning: UserWarning: returned a view tensor"),
    ]


def test_a_new_warning_raised_by_several_checks_is_one_difference_naming_them() -> None:
    view = (
        "UserWarning: FSDP2-wrapped module (FSDPLinear) returned a view tensor. An in-place "
        "op on this view"
    )
    checks = ("wrap.units.exact", "wrap.units.plan", "wrap.units.accounting")
    old = report(*(entry(c) for c in checks))
    new = report(
        entry(checks[0], warnings=[view]),
        entry(checks[1], warnings=[view]),
        entry(checks[2], warnings=["UserWarning: only here"]),
    )
    ids = [e["id"] for e in new["checks"]]
    diffs = compare_reports(old, new)
    # Checks are compared in id order (accounting, exact, plan); a group sits where it was
    # first seen.
    assert [(d.check_id, d.kind, d.text) for d in diffs] == [
        (ids[2], "warning", "new warning: UserWarning: only here"),
        ("2 checks", "warning", f"new warning: {view} (raised by {ids[0]}, {ids[1]})"),
    ], diffs


def test_a_warning_whose_source_line_moved_is_not_new() -> None:
    # torch's C++ warnings carry their source location, which moves in every release.
    text = (
        "UserWarning: Converting a tensor with requires_grad=True to a scalar may lead to "
        "unexpected behavior.\nConsider using tensor.detach() first. (Triggered internally "
        "at /__w/pytorch/pytorch/torch/csrc/autograd/generated/"
        "python_variable_methods.cpp:{}.)"
    )
    old, new = entry(warnings=[text.format(822)]), entry(warnings=[text.format(820)])
    assert compare_one(old, new) == []
    # a genuinely new one is reported on one line
    diffs = compare_one(entry(), new)
    assert kinds(diffs) == [("warning", False)] and "\n" not in diffs[0].text
    assert diffs[0].text.endswith(
        "scalar may lead to unexpected behavior. Consider using "
        "tensor.detach() first. (Triggered internally at "
        "/__w/pytorch/pytorch/torch/csrc/autograd/generated/"
        "python_variable_methods.cpp:820.)"
    )


# --------------------------------------------------------------------------------------------
# compare: the human output
# --------------------------------------------------------------------------------------------


def test_differences_print_regressions_first_with_their_check_ids() -> None:
    old = report(entry("a.one", outcome="failed"), entry("b.two"), torch_version="2.13.0")
    new = report(
        entry("a.one"), entry("b.two", outcome="failed", message="boom"), torch_version="2.14.1"
    )
    text = verdict.format_text(old, new, compare_reports(old, new))
    assert text.splitlines() == [
        "safe to upgrade: no (torch 2.13.0 -> 2.14.1)",
        "  regressions 1, drift 0, known defects 0, deprecations 0, rollback 0, "
        "fixed upstream 0, other changes 1",
        "regressions:",
        "  [BLOCKS] b.two[cpu,ws2,fsdp1,massive]: outcome: passed -> failed: boom",
        "other changes:",
        "  [said] a.one[cpu,ws2,fsdp1,massive]: outcome: failed -> passed",
    ]


# --------------------------------------------------------------------------------------------
# Every non-pass's reason, read by a user
# --------------------------------------------------------------------------------------------

LONG_SKIP = (
    "memory.sawtooth: the model's per-layer rise (3.1 KiB) is below the meter's resolution "
    "(64.0 KiB) at this width; nothing to measure (pass a wider model or a larger batch)"
)
ERROR_LINE = (
    "ranks 0, 1: ValueError in fully_shard (FSDP2's lazy init) (torch/distributed/fsdp/"
    "_fully_shard/_fsdp_state.py:_validate_no_duplicate_params): parameter 'decoder.weight' "
    "is tied to a parameter in another FSDP unit; pass --block-cls Layer"
)
STORY = (
    "check 'rank_train' failed on 2 ranks: rank 0 raised, rank 1 raised\n--- rank 0: raised ---\n"
    "Traceback (most recent call last):\n" + '  File "x.py", line 1, in f\n' * 80 + "ValueError: x"
)


def non_passes() -> dict[str, Any]:
    error = entry("wrap.train.fp32", "error", message=ERROR_LINE)
    error["traceback"] = STORY
    xfail = xfailed("state.summon.rank0_discard")
    xfail["expected"]["reason"] = "FSDP1 summon_full_params keeps the shard's change. " * 12
    return report(
        entry(),
        entry("memory.sawtooth", "skipped", message=LONG_SKIP),
        entry("wrap.units.exact", "failed", variant="fsdp2,massive", message="units differ\n- a"),
        error,
        xfail,
    )


def test_every_non_pass_has_its_whole_reason_in_the_summary_and_on_the_console() -> None:
    r = non_passes()
    md = tables.format_markdown(r, report_path="out/report.json")
    table = tables.format_table(r, "out/report.json")
    # the skip's row holds its reason, whole (it was empty in summary.md and cut at 100 columns)
    assert f"| `memory.sawtooth[cpu,ws2,fsdp1,massive]` | ⏭️ skipped | {LONG_SKIP} |" in md
    assert LONG_SKIP in table and "..." not in table
    # the error: one line, and where its traceback is (the report file and the check's id)
    assert f"💥 error | {ERROR_LINE} |" in md and f"ERROR    {ERROR_LINE}" in table
    pointer = "traceback of wrap.train.fp32[cpu,ws2,fsdp1,massive]: out/report.json (the check's 'traceback')"
    assert pointer in md and pointer in table
    assert "Traceback" not in md and "Traceback" not in table
    # the failure keeps its message (expected against actual) in the summary
    assert "<details><summary>wrap.units.exact[cpu,ws2,fsdp2,massive]: failed</summary>" in md
    # the expected failure (a torch defect on any model): one line, its paragraph in the report
    assert "keeps the shard's change" not in md + table
    xfail_lines = [line for line in table.splitlines() if "expected failure state.summon" in line]
    assert xfail_lines == [
        "expected failure state.summon.rank0_discard[cpu,ws2,fsdp1,massive]: known torch "
        "defect of torch >=2.13, <2.16, on any model "
        "(https://example.org/defect); its reason is in the report's 'expected'"
    ]


def test_a_pipe_in_a_reason_does_not_break_the_summary_table() -> None:
    md = tables.format_markdown(report(entry("a.b", "skipped", message="needs a | b")))
    assert "| `a.b[cpu,ws2,fsdp1,massive]` | ⏭️ skipped | needs a \\| b |" in md


def test_an_error_traceback_is_kept_in_the_report_and_validated(tmp_path: Path) -> None:
    r = non_passes()
    path = _write(tmp_path / "r.json", r)
    assert gate_report.load_report(path)["checks"][3]["traceback"] == STORY
    r["checks"][3]["traceback"] = ["not", "text"]  # the control: a damaged traceback
    with pytest.raises(ReportError, match=r"checks\[3\]\.traceback: expected a string"):
        gate_report.load_report(_write(tmp_path / "r.json", r))


def test_a_report_of_an_older_version_still_loads_formats_and_compares() -> None:
    golden = Path(__file__).parent / "data" / "report-main-597df7e.json"
    old = gate_report.load_report(str(golden))
    table = tables.format_table(old, str(golden))
    md = tables.format_markdown(old, report_path=str(golden))
    assert len(table.splitlines()) == len(old["checks"]) + 4 + old["summary"]["error"] + (
        old["summary"].get("xfailed", 0)
    )
    assert md.startswith("## FSDP conformance:")
    assert compare.comparability(old, old) is None and compare_reports(old, old) == []


# --------------------------------------------------------------------------------------------
# torch's exceptions translated: one test per known error, the generic form
# --------------------------------------------------------------------------------------------

TORCH = "/venv/lib/python3.11/site-packages/torch"


def traceback_of(frames: Sequence[tuple[str, str]], last: str) -> str:
    """A traceback's text as Python prints it: (path, function) frames, then the exception."""
    body = "".join(
        f'  File "{path}", line {n + 10}, in {func}\n    code()\n    ^^^^^^\n'
        for n, (path, func) in enumerate(frames)
    )
    return f"Traceback (most recent call last):\n{body}{last}\n"


def rank_story(text: str, ranks: Sequence[int] = (0, 1)) -> list[RankOutcome]:
    return [RankOutcome(r, "error", detail=text) for r in ranks]


class Layer(torch.nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Embeddings(torch.nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.word = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.word(ids))


class TiedEncoder(torch.nn.Module):
    """An encoder whose decoder is tied to the embedding, outside the embedding block (BERT's
    masked-LM layout): ``Embeddings`` as a block class splits the tie."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embeddings = Embeddings(vocab, dim)
        self.layers = torch.nn.ModuleList(Layer(dim) for _ in range(2))
        self.decoder = torch.nn.Linear(dim, vocab)
        self.decoder.weight = self.embeddings.word.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.decoder(x)


def build_tied_encoder() -> TiedEncoder:
    return TiedEncoder()


TIED_SPEC = ModelSpec(
    reference=None, factory=f"{__name__}:build_tied_encoder", block_cls=("Embeddings", "Layer")
)

SPLIT_TIE = traceback_of(
    [
        ("/home/u/train.py", "forward"),
        (f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_state.py", "_root_pre_forward"),
        (f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_state.py", "_lazy_init"),
        (f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_state.py", "_validate_no_duplicate_params"),
    ],
    "ValueError: Parameter 'decoder.weight' is shared with a parameter already managed by "
    "another FSDP group. For shared/tied parameters, use fully_shard([module_a, module_b]) to "
    "place them in the same FSDP group.",
)
#: FSDP1 with MixedPrecision(param_dtype=bf16) on a model whose root casts its input to the
#: dtype of a nested unit's weight (read while it is the fp32 shard): torch 2.13's text.
FSDP1_CONV = traceback_of(
    [
        (f"{TORCH}/distributed/fsdp/fully_sharded_data_parallel.py", "forward"),
        ("/home/u/vit.py", "forward"),
        (f"{TORCH}/distributed/fsdp/fully_sharded_data_parallel.py", "forward"),
        (f"{TORCH}/nn/modules/conv.py", "forward"),
        (f"{TORCH}/nn/modules/conv.py", "_conv_forward"),
    ],
    "RuntimeError: Input type (float) and bias type (c10::BFloat16) should be the same",
)
FSDP1_LINEAR = traceback_of(
    [
        (f"{TORCH}/distributed/fsdp/fully_sharded_data_parallel.py", "forward"),
        (f"{TORCH}/nn/modules/linear.py", "forward"),
    ],
    "RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16",
)
FSDP2_BATCH_NORM = traceback_of(
    [
        ("/home/u/resnet.py", "forward"),
        (f"{TORCH}/nn/modules/batchnorm.py", "forward"),
        (f"{TORCH}/nn/functional.py", "batch_norm"),
    ],
    "RuntimeError: expected scalar type Half but found Float",
)
DCP_PARAM_GROUPS = traceback_of(
    [
        ("/home/u/resume.py", "resume"),
        (f"{TORCH}/distributed/checkpoint/state_dict_loader.py", "load"),
        (f"{TORCH}/distributed/checkpoint/default_planner.py", "create_default_local_load_plan"),
    ],
    "RuntimeError: Missing key in checkpoint state_dict: optim.param_groups.",
)
# The same, as DCP raises it from its collective plan: every rank's traceback in one exception.
DCP_WRAPPED = (
    traceback_of(
        [(f"{TORCH}/distributed/checkpoint/utils.py", "reduce_scatter")],
        "torch.distributed.checkpoint.api.CheckpointException: CheckpointException "
        "ranks:dict_keys([0])",
    )
    + "Traceback (most recent call last): (RANK 0)\n"
    + f'  File "{TORCH}/distributed/checkpoint/default_planner.py", line 495, in '
    "create_default_local_load_plan\n"
    + "RuntimeError: Missing key in checkpoint state_dict: optim.param_groups.\n"
)


@pytest.mark.parametrize(
    ("text", "params", "entry_name", "says"),
    [
        (
            SPLIT_TIE,
            {"version": "fsdp2", "spec": TIED_SPEC},
            "fsdp2-split-tie",
            [
                "ranks 0, 1: ValueError in fully_shard (FSDP2's lazy init) (torch/distributed/"
                "fsdp/_fully_shard/_fsdp_state.py:_validate_no_duplicate_params): parameter "
                "'decoder.weight' is tied to a parameter in another FSDP unit",
                "pass --block-cls Layer (--fsdp-block-cls under pytest)",
            ],
        ),
        (
            FSDP1_CONV,
            {"version": "fsdp1"},
            "fsdp1-input-dtype",
            [
                "RuntimeError in FullyShardedDataParallel.forward "
                "(torch/nn/modules/conv.py:_conv_forward)",
                "(Input type (float) and bias type (c10::BFloat16) should be the same)",
                "fix: MixedPrecision(..., cast_forward_inputs=True)",
            ],
        ),
        (
            FSDP1_LINEAR,
            {"version": "fsdp1"},
            "fsdp1-input-dtype",
            ["mat1 and mat2 must have the same dtype", "cast_forward_inputs=True"],
        ),
        (
            FSDP2_BATCH_NORM,
            {"version": "fsdp2"},
            "fsdp2-batch-norm-dtype",
            [
                "RuntimeError in F.batch_norm (a _BatchNorm module's forward) "
                "(torch/nn/functional.py:batch_norm)",
                "weight and bias are in Half while its running statistics are fp32",
                "fix: fully_shard(bn, mp_policy=MixedPrecisionPolicy())",
            ],
        ),
        (
            DCP_PARAM_GROUPS,
            {"version": "fsdp1"},
            "fsdp1-dcp-optim-param-groups",
            [
                "RuntimeError in torch.distributed.checkpoint.load",
                "torch behaviour, not a fault of the model",
                "asks for 'optim.param_groups'",
            ],
        ),
        (DCP_WRAPPED, {}, "fsdp1-dcp-optim-param-groups", ["torch behaviour"]),
    ],
    ids=["fsdp2-split-tie", "fsdp1-conv", "fsdp1-linear", "fsdp2-bn", "dcp", "dcp-wrapped"],
)
def test_a_known_torch_error_is_one_line_naming_the_api_the_ranks_and_the_fix(
    text: str, params: Mapping[str, Any], entry_name: str, says: Sequence[str]
) -> None:
    error = torch_errors.parse_traceback(text)
    assert error is not None
    known = torch_errors.known_error(error)
    assert known is not None and known.name == entry_name
    line = torch_errors.failure_line(rank_story(text), params)
    assert "\n" not in line
    for part in says:
        assert part in line, line


def test_every_known_error_has_its_test() -> None:
    tested = {
        "fsdp2-split-tie",
        "fsdp1-input-dtype",
        "fsdp2-batch-norm-dtype",
        "fsdp1-dcp-optim-param-groups",
    }
    assert {e.name for e in torch_errors.KNOWN_ERRORS} == tested


@pytest.mark.parametrize(
    ("text", "why"),
    [
        # the same messages, not through the API the entry is about: not that cause
        (
            FSDP1_CONV.replace("distributed/fsdp/fully_sharded_data_parallel", "nn/parallel/x"),
            "no FSDP1",
        ),
        (SPLIT_TIE.replace("ValueError", "RuntimeError"), "another exception type"),
        (FSDP2_BATCH_NORM.replace("nn/modules/batchnorm", "nn/modules/x"), "no _BatchNorm"),
        (SPLIT_TIE.replace("is shared with", "is sharded with"), "another message"),
    ],
)
def test_a_near_miss_is_not_taken_for_a_known_error(text: str, why: str) -> None:
    error = torch_errors.parse_traceback(text)
    assert error is not None and torch_errors.known_error(error) is None, why


def test_an_unknown_error_names_the_innermost_torch_frame_and_torch_s_message() -> None:
    text = traceback_of(
        [
            ("/home/u/model.py", "forward"),
            (f"{TORCH}/distributed/fsdp/_fully_shard/_fsdp_param.py", "init_unsharded_param"),
            (f"{TORCH}/distributed/tensor/_api.py", "full_tensor"),
        ],
        "RuntimeError: shapes do not match\nsecond line of the message",
    )
    died = (
        "killed by SIGSEGV (exit status -11) inside torch: torch.distributed.x.y, line 3 before "
        "reporting; its log ends:\nlog line"
    )
    hung = "no result after the check's timeout of 120s; its stacks:\nThread 0x1"
    outcomes = [
        *rank_story(text, (1,)),
        RankOutcome(0, "ok"),
        RankOutcome(2, "died", detail=died),
        RankOutcome(3, "hung", detail=hung),
    ]
    assert torch_errors.failure_line(outcomes, {}) == (
        "rank 1: RuntimeError in torch/distributed/tensor/_api.py:full_tensor: shapes do not "
        "match; rank 2: died (killed by SIGSEGV (exit status -11) inside torch: "
        "torch.distributed.x.y, line 3 before reporting); rank 3: did not finish (no result "
        "after the check's timeout of 120s)"
    )
    # raised outside torch (the suite's own step, the user's forward called by torch): there
    own = traceback_of(
        [
            ("/site/fsdp_conformance/claims/wrap/train.py", "rank_train"),
            (f"{TORCH}/nn/modules/module.py", "_call_impl"),
            ("/site/fsdp_conformance/claims/wrap/train.py", "rank_train"),
        ],
        "KeyError: 'lm_head'",
    )
    assert torch_errors.failure_line(rank_story(own, (0,)), {}) == (
        "rank 0: KeyError in fsdp_conformance/claims/wrap/train.py:rank_train: 'lm_head'"
    )
    # a rank's text that is no traceback (a harness message): its first line
    harness = [RankOutcome(0, "error", detail="protocol error: task 3 != 2\nmore")]
    assert torch_errors.failure_line(harness, {}) == "rank 0: protocol error: task 3 != 2"


def test_the_classes_that_keep_a_tie_whole_are_the_block_classes_without_the_splitting_one() -> (
    None
):
    assert torch_errors.tie_keeping_block_classes(TIED_SPEC) == ["Layer"]
    # the control: block classes that split no tie are all kept
    whole = dataclasses.replace(TIED_SPEC, block_cls=("Layer",))
    assert torch_errors.tie_keeping_block_classes(whole) == ["Layer"]
    assert torch_errors.tie_keeping_block_classes(None) is None
    # a model that cannot be built again: the line still comes, with the fix in words
    broken = dataclasses.replace(TIED_SPEC, factory=f"{__name__}:build_nothing")
    assert torch_errors.tie_keeping_block_classes(broken) is None
    line = torch_errors.failure_line(rank_story(SPLIT_TIE), {"spec": broken})
    assert line.endswith(
        "pass --block-cls with block classes that hold both names of every tied parameter, "
        "or neither"
    )


def build_nothing() -> torch.nn.Module:
    raise RuntimeError("the factory cannot build twice")


def rank_split_tie(ctx: Any, spec: ModelSpec) -> None:
    """FSDP2 on the tied encoder with ``Embeddings`` a unit of its own: torch refuses the split
    tie at the first forward (the error the check's outcome reads)."""
    from fsdp_conformance.fsdp.sharding import shard_fsdp2_modules

    built = spec.instantiate()
    units = [m for m in built.model.modules() if isinstance(m, built.blocks)]
    model = shard_fsdp2_modules(built.model, ctx, units)
    model(torch.zeros(2, 4, dtype=torch.long))


def verdict_split_tie(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    return Verdict(True, "no rank raised")


def test_a_torch_error_on_the_ranks_becomes_one_line_with_the_fix_and_the_traceback_is_kept(
    ranks: Ranks,
) -> None:
    check = Check("wrap.split_tie", "torch's error", rank_split_tie, verdict_split_tie)
    run = execute(ranks, check, spec=TIED_SPEC)
    assert run.outcome == "error"
    assert run.detail == (
        f"ranks {', '.join(map(str, range(ranks.world_size)))}: ValueError in fully_shard "
        "(FSDP2's lazy init) (torch/distributed/fsdp/_fully_shard/_fsdp_state.py:"
        "_validate_no_duplicate_params): parameter 'embeddings.word.weight' is tied to a parameter in "
        "another FSDP unit: the block classes split a tie, and FSDP2 refuses a parameter "
        "managed by two units; pass --block-cls Layer (--fsdp-block-cls under pytest): those "
        "block classes keep every tie inside one unit"
    )
    assert "Traceback (most recent call last)" in run.traceback
    assert "_validate_no_duplicate_params" in run.traceback
    e = gate_report.check_entry(
        check=check.name,
        claim=check.claim,
        lane=ranks.lane,
        world_size=ranks.world_size,
        variant="fsdp2",
        outcome=run.outcome,
        message=run.detail,
        figures={},
        data={},
        seconds=run.seconds,
        warnings=run.warnings,
        traceback=run.traceback,
    )
    assert e["message"] == run.detail and e["traceback"] == run.traceback
    # the pytest path: the failure starts with the same line, every rank's story below it
    with pytest.raises(RankFailure) as info:
        run_check(ranks, check, spec=TIED_SPEC)
    assert str(info.value).splitlines()[0] == run.detail
    assert "Traceback (most recent call last)" in str(info.value)


class Patches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 8, 2, 2)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels)


class TinyViT(torch.nn.Module):
    """An image model whose root casts the pixels to its patch weight's dtype (ViT's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = Patches()
        self.head = torch.nn.Linear(8, 2)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = pixels.to(self.patches.proj.weight.dtype)
        return self.head(self.patches(pixels).mean((2, 3)))


def rank_fsdp1_input_dtype(ctx: Any, version: str) -> None:
    """FSDP1 in bf16 on :class:`TinyViT`, its patches a unit: the root reads the patch weight
    while it is the fp32 shard, and the conv gets fp32 pixels (torch's error, for real)."""
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fsdp_conformance.fsdp.sharding import shard_fsdp1

    model = shard_fsdp1(
        TinyViT(),
        ctx,
        ModuleWrapPolicy({Patches}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
    )
    model(torch.randn(2, 3, 4, 4))


def test_fsdp1_s_input_dtype_error_on_the_ranks_names_cast_forward_inputs(ranks: Ranks) -> None:
    check = Check("wrap.input_dtype", "torch's error", rank_fsdp1_input_dtype, verdict_split_tie)
    run = execute(ranks, check, version="fsdp1")
    assert run.outcome == "error"
    assert "\n" not in run.detail
    assert run.detail.startswith(
        f"ranks {', '.join(map(str, range(ranks.world_size)))}: RuntimeError in "
        "FullyShardedDataParallel.forward (torch/nn/modules/conv.py:_conv_forward): a unit's "
        "inputs are not in its parameters' dtype (Input type (float) and bias type "
        "(c10::BFloat16) should be the same)"
    ), run.detail
    assert run.detail.endswith("fix: MixedPrecision(..., cast_forward_inputs=True)")
