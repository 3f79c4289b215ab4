"""Report ids across the renames of ``CHECK_RENAMES``: a report of the old layout compares.

``tests/data/report-main-597df7e.json`` is a real report of ``fsdp-conformance run --lane cpu``
made at 597df7e, whose init check names still carry their FSDP version. The new-layout side is
built without ranks: every check of today's layout with the old run's outcomes, in order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from fsdp_conformance import cli
from fsdp_conformance.claims import all_checks, init
from fsdp_conformance.gate import suite
from fsdp_conformance.gate.compare import comparability, compare_reports
from fsdp_conformance.gate.migrate import (
    CHECK_RENAMES,
    LEGACY_NAMES,
    legacy_name,
    migrate_report,
)
from fsdp_conformance.gate.report import build_report, check_entry, load_report
from fsdp_conformance.settings import Settings

pytestmark = pytest.mark.cpu

GOLDEN = Path(__file__).parent / "data" / "report-main-597df7e.json"


@pytest.fixture(scope="module")
def old() -> dict[str, Any]:
    return load_report(str(GOLDEN))


def new_layout(old: Mapping[str, Any]) -> dict[str, Any]:
    """Today's checks, in the suite's order, each with the old run's outcome at that position.

    Checks added since the golden report (a new claim's) are left out: it never ran them.
    """
    old_names = {e["check"] for e in old["checks"]}
    selected = [
        (check, params)
        for check, params in suite.select_checks(all_checks(), None)
        if check.name in old_names or legacy_name(check.name, params.get("version")) in old_names
    ]
    assert len(selected) == len(old["checks"]), "the golden report is not a full cpu run"
    entries = []
    for (check, params), was in zip(selected, old["checks"]):
        entries.append(
            check_entry(
                check=check.name,
                claim=check.claim,
                lane=was["lane"],
                world_size=was["world_size"],
                variant=suite.variant_of(params),
                outcome=was["outcome"],
                message=was["message"],
                figures=was["figures"],
                data=was["data"],
                seconds=was["seconds"],
                warnings=was["warnings"],
            )
        )
    return build_report(entries, Settings(world_sizes=tuple(old["settings"]["world_sizes"])), 1.0)


def test_the_golden_report_is_of_the_old_layout(old: dict[str, Any]) -> None:
    # The control: without the migration the two layouts share no init id, so compare would
    # call every init check missing and added.
    new = new_layout(old)
    old_ids = {e["id"] for e in old["checks"]}
    new_ids = {e["id"] for e in new["checks"]}
    renamed = {e["id"] for e in old["checks"] if e["check"] in CHECK_RENAMES}
    assert len(renamed) == 11 and old_ids - new_ids == renamed
    assert "init.no_meta.fsdp1[cpu,ws2,fsdp1,llama]" in renamed
    assert "init.no_meta[cpu,ws2,fsdp1,llama]" in new_ids


@pytest.mark.parametrize("direction", ["old-new", "new-old", "old-old", "new-new"])
def test_old_and_new_layout_reports_compare_check_for_check(
    old: dict[str, Any], direction: str
) -> None:
    new = new_layout(old)
    a, b = {"old": old, "new": new}[direction[:3]], {"old": old, "new": new}[direction[-3:]]
    assert comparability(a, b) is None
    diffs = compare_reports(a, b)
    assert [d for d in diffs if d.kind != "settings"] == []  # same ids, outcomes, figures
    outcomes_a = {e["id"]: e["outcome"] for e in migrate_report(a)["checks"]}
    outcomes_b = {e["id"]: e["outcome"] for e in migrate_report(b)["checks"]}
    assert outcomes_a == outcomes_b and len(outcomes_a) == len(old["checks"])


def test_a_changed_outcome_is_still_found_across_the_layouts(old: dict[str, Any]) -> None:
    new = new_layout(old)
    (entry,) = [e for e in new["checks"] if e["id"] == "init.weights[cpu,ws2,fsdp2,llama]"]
    entry["outcome"] = "failed"
    diffs = compare_reports(old, new)
    assert [(d.check_id, d.kind, d.regression) for d in diffs if d.kind != "settings"] == [
        ("init.weights[cpu,ws2,fsdp2,llama]", "outcome", True)
    ]


def test_no_two_old_ids_migrate_to_the_same_new_id(old: dict[str, Any]) -> None:
    migrated = [e["id"] for e in migrate_report(old)["checks"]]
    assert len(migrated) == len(set(migrated)) == len(old["checks"])
    # Every renamed name (the seeds' checks are not in a run's report): the old name's version
    # is the variant's, so (new name, version) is one-to-one with the old names.
    assert len(LEGACY_NAMES) == len(CHECK_RENAMES)
    known = {(c.name, c.params.get("version")) for c in init.CHECKS + init.SEEDS_CHECKS}
    assert set(LEGACY_NAMES) <= known


def test_migrating_twice_changes_nothing(old: dict[str, Any]) -> None:
    once = migrate_report(old)
    assert migrate_report(once) == once
    assert load_report(str(GOLDEN)) == old  # the stored form is left as it is


@pytest.mark.parametrize(
    "pattern, selected",
    [
        ("init.weights.fsdp2", [("init.weights", "fsdp2")]),
        ("init.no_meta.fsdp1", [("init.no_meta", "fsdp1")]),
        ("init.weights.fsdp1_default", [("init.weights.default_path", "fsdp1")]),
        ("init.peak_memory.fsdp2", [("init.peak_memory", "fsdp2")]),
        ("init.seeds_fn_to_empty.fsdp1", [("init.seeds_fn_to_empty", "fsdp1")]),
        ("init.train_step", [("init.train_step", "fsdp1"), ("init.train_step", "fsdp2")]),
    ],
)
def test_check_patterns_of_the_old_names_select_the_same_variants(
    pattern: str, selected: list[tuple[str, str]]
) -> None:
    checks = all_checks() + list(init.SEEDS_CHECKS)
    chosen = suite.select_checks(checks, None, pattern)
    assert [(c.name, p.get("version")) for c, p in chosen] == selected


def test_cli_compare_of_the_golden_report_and_a_new_one_exits_0(
    old: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new_path = tmp_path / "new.json"
    new_path.write_text(json.dumps(new_layout(old)))
    for a, b in ((GOLDEN, new_path), (new_path, GOLDEN), (GOLDEN, GOLDEN)):
        assert cli.main(["compare", str(a), str(b)]) == cli.EXIT_OK
        out = capsys.readouterr().out
        assert "regressions 0," in out and "missing" not in out and "added" not in out
