"""The version matrix: ``fsdp-conformance matrix REPORT...`` renders checks x
torch versions from one report per version, as Markdown with footnotes and as an SVG picture
whose cells carry their reason. The reports here are built with the report module itself."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.dom.minidom
from pathlib import Path
from typing import Any

import pytest

from fsdp_conformance import cli
from fsdp_conformance.fsdp import capabilities
from fsdp_conformance.gate import matrix
from fsdp_conformance.gate import report as gate_report
from fsdp_conformance.gate.report import write_json_report
from fsdp_conformance.harness import CheckSkipped
from fsdp_conformance.settings import Settings


def entry(
    check: str,
    outcome: str,
    message: str = "ok",
    variant: str = "fsdp2,massive",
    expected: dict[str, str] | None = None,
) -> dict[str, Any]:
    return gate_report.check_entry(
        check=check,
        claim=check.split(".")[0],
        lane="cpu",
        world_size=2,
        variant=variant,
        outcome=outcome,
        message=message,
        figures={},
        data={},
        seconds=0.1,
        warnings=(),
        expected=expected,
    )


def report(torch_version: str, *entries: dict[str, Any]) -> dict[str, Any]:
    built = gate_report.build_report(list(entries), Settings(), 1.0)
    built["environment"]["torch"] = torch_version
    return built


def capability_skip_message() -> str:
    """What :func:`capabilities.require` says when a capability is missing (read, not copied)."""
    missing = capabilities.Capability(
        "FSDP2 on CPU", "a CPU stream event", "first seen in 2.8.0", lambda: False
    )
    with pytest.raises(CheckSkipped) as info:
        capabilities.require(missing)
    return str(info.value)


DEFECT = {"reason": "FSDP2 on gloo sums gradients\nsecond line", "link": "https://x/1"}


def three_versions() -> list[tuple[str, dict[str, Any]]]:
    skip_capability = capability_skip_message()
    return [
        (
            "a/report.json",
            report(
                "2.6.0",
                entry("wrap.train.fp32", "skipped", skip_capability),
                entry("init.weights", "passed"),
                entry(
                    "memory.sawtooth", "skipped", "the largest unit is small; use a larger config"
                ),
            ),
        ),
        (
            "b/report.json",
            report(
                "2.8.0",
                entry("wrap.train.fp32", "xfailed", "2.00x the reference", expected=DEFECT),
                entry("init.weights", "failed", "digests differ | rank 1\nthe tree"),
                entry(
                    "memory.sawtooth", "skipped", "the largest unit is small; use a larger config"
                ),
            ),
        ),
        (
            "c/report.json",
            report(
                "2.13.0+cpu",
                entry("wrap.train.fp32", "passed"),
                entry("init.weights", "error", "RuntimeError: boom"),
                entry("state.dcp", "passed"),
            ),
        ),
    ]


def test_each_outcome_becomes_its_cell_with_the_reason_a_reader_needs() -> None:
    assert matrix.cell_of(entry("a", "passed")) == matrix.Cell("pass")
    skip = matrix.cell_of(entry("a", "skipped", capability_skip_message()))
    assert skip.kind == "capability" and "FSDP2 on CPU" in skip.reason
    assert matrix.cell_of(entry("a", "skipped", "too small; use a larger config")) == matrix.Cell(
        "skip", "too small; use a larger config"
    )
    xfail = matrix.cell_of(entry("a", "xfailed", "2.00x", expected=DEFECT))
    assert xfail == matrix.Cell(
        "xfail", "known torch defect: FSDP2 on gloo sums gradients (https://x/1)"
    )
    change = matrix.cell_of(entry("a", "xfailed", "differs", expected={**DEFECT, "kind": "change"}))
    assert change.reason.startswith("known torch change: FSDP2 on gloo")
    assert matrix.cell_of(entry("a", "failed", "\nfirst\nsecond")) == matrix.Cell("fail", "first")
    assert matrix.cell_of(entry("a", "error", "x" * 500)).reason.endswith("...")


def test_matrix_has_a_column_per_version_and_a_row_per_check_absent_where_not_run() -> None:
    table = matrix.build_matrix(three_versions())
    assert table.columns == ["2.6.0", "2.8.0", "2.13.0+cpu"]
    assert table.rows == [
        "wrap.train.fp32[cpu,ws2,fsdp2,massive]",
        "init.weights[cpu,ws2,fsdp2,massive]",
        "memory.sawtooth[cpu,ws2,fsdp2,massive]",
        "state.dcp[cpu,ws2,fsdp2,massive]",
    ]
    kinds = [[table.cell(r, c).kind for c in table.columns] for r in table.rows]
    assert kinds == [
        ["capability", "xfail", "pass"],
        ["pass", "fail", "error"],
        ["skip", "skip", "absent"],
        ["absent", "absent", "pass"],
    ]
    assert table.counts("2.13.0+cpu") == {
        "pass": 2,
        "fail": 0,
        "error": 1,
        "xfail": 0,
        "capability": 0,
        "skip": 0,
        "absent": 1,
    }


def test_markdown_gives_each_distinct_reason_one_footnote_and_totals_per_version() -> None:
    text = matrix.to_markdown(matrix.build_matrix(three_versions()))
    lines = text.splitlines()
    assert lines[0] == "| check | 2.6.0 | 2.8.0 | 2.13.0+cpu |"
    assert lines[2].startswith(
        "| `wrap.train.fp32[cpu,ws2,fsdp2,massive]` | capability [1] | xfail [2] | pass |"
    )
    # The same skip on two versions is one footnote; a '|' in a reason cannot split a cell.
    sawtooth = next(line for line in lines if line.startswith("| `memory.sawtooth"))
    assert sawtooth.count("skip [5]") == 2 and sawtooth.endswith("| — |")
    assert "[3] digests differ \\| rank 1  " in lines
    assert lines[6] == (
        "| **total** | 1 pass, 1 capability, 1 skip, 1 absent | 1 fail, 1 xfail, "
        "1 skip, 1 absent | 2 pass, 1 error, 1 absent |"
    )
    assert sum(line.startswith("[") for line in lines) == 5


def test_svg_is_one_cell_per_check_and_version_with_its_reason_on_hover() -> None:
    table = matrix.build_matrix(three_versions())
    doc = xml.dom.minidom.parseString(matrix.to_svg(table))
    titles = [t.firstChild.data for t in doc.getElementsByTagName("title")]
    assert len(titles) == len(table.rows) * len(table.columns)
    assert (
        "wrap.train.fp32[cpu,ws2,fsdp2,massive] on torch 2.8.0: xfail: known torch defect: "
        "FSDP2 on gloo sums gradients (https://x/1)"
    ) in titles
    assert "state.dcp[cpu,ws2,fsdp2,massive] on torch 2.6.0: absent" in titles


def test_cli_matrix_prints_the_table_writes_both_files_and_names_a_bad_report(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    paths = []
    for name, built in three_versions():
        path = tmp_path / name
        path.parent.mkdir()
        write_json_report(str(path), built)
        paths.append(str(path))
    assert cli.main(["matrix", *paths, "--out", str(tmp_path / "out")]) == cli.EXIT_OK
    out, err = capsys.readouterr()
    assert out == (tmp_path / "out" / "matrix.md").read_text()
    assert out.startswith("| check | 2.6.0 | 2.8.0 | 2.13.0+cpu |")
    assert (tmp_path / "out" / "matrix.svg").read_text().startswith("<svg")
    assert err.strip().startswith("matrix: ")
    assert cli.main(["matrix", paths[0], str(tmp_path / "nope.json")]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "nope.json' does not exist" in err


def test_differing_shows_only_checks_that_do_not_pass_everywhere_and_counts_the_rest() -> None:
    versions = three_versions()
    everywhere = entry("wrap.units.exact", "passed")
    for _, built in versions:
        built["checks"].append(everywhere)
    table = matrix.build_matrix(versions)
    assert "wrap.units.exact[cpu,ws2,fsdp2,massive]" not in matrix.differing_rows(table)
    lines = matrix.to_markdown(table, differing=True).splitlines()
    assert lines[2] == "| *1 other checks* | pass | pass | pass |"
    assert not any("wrap.units.exact" in line for line in lines)
    assert lines[7].startswith("| **total** | 2 pass, 1 capability")  # every check counted
    assert matrix.to_markdown(table).count("wrap.units.exact") == 1


ROOT = Path(__file__).resolve().parents[1]

#: A kept venv of ci/torch-matrix.sh, faked: its python answers the script's version probe, its
#: fsdp-conformance writes a prepared report on `run` and renders with the real CLI on `matrix`.
FAKE_PYTHON = """#!/usr/bin/env bash
PYTHONPATH="$SITE" exec "$REAL_PYTHON" "$@"
"""
FAKE_CLI = """#!/usr/bin/env bash
if [ "$1" = run ]; then
  while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done
  [ -f "$PREPARED" ] || exit 3  # a version whose run crashed: no report
  mkdir -p "$out" && cp "$PREPARED" "$out/report.json" && exit 1  # failures: exit 1
fi
exec "$REAL_PYTHON" -m fsdp_conformance.cli "$@"
"""


def fake_venv(venvs: Path, version: str, prepared: Path) -> None:
    """A venv the script keeps: a torch module of that version only, and the two commands."""
    root = venvs / f"torch-{version}"
    (root / "site" / "torch").mkdir(parents=True)
    (root / "site" / "torch" / "__init__.py").write_text(f"__version__ = '{version}+cpu'\n")
    (root / "bin").mkdir()
    for name, text in (("python", FAKE_PYTHON), ("fsdp-conformance", FAKE_CLI)):
        path = root / "bin" / name
        path.write_text(
            text.replace("$SITE", str(root / "site")).replace("$PREPARED", str(prepared))
        )
        path.chmod(0o755)


@pytest.mark.process
def test_torch_matrix_script_runs_each_kept_venv_and_renders_the_matrix(tmp_path: Path) -> None:
    """ci/torch-matrix.sh with its venvs already there (nothing installed): each version's run
    exits 1 (a failed check) and still counts, a version that wrote no report is named and the
    exit status is 1, and the matrix has a column for each version that gave a report."""
    prepared = []
    for (_, built), version in zip(three_versions(), ("2.6.0", "2.8.0", "2.13.0")):
        path = tmp_path / f"prepared-{version}.json"
        write_json_report(str(path), built)
        prepared.append((version, path))
    venvs = tmp_path / "venvs"
    for version, path in prepared:
        fake_venv(venvs, version, path)
    fake_venv(venvs, "2.7.0", tmp_path / "no-report.json")
    env = {
        **os.environ,
        "MATRIX_OUT": str(tmp_path / "out"),
        "MATRIX_VENVS": str(venvs),
        "REAL_PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        ["bash", str(ROOT / "ci" / "torch-matrix.sh"), "2.6.0", "2.7.0", "2.8.0", "2.13.0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "torch-matrix: torch 2.7.0 wrote no report; its column is missing" in result.stderr
    assert "torch-matrix: missing: 2.7.0" in result.stderr
    text = (tmp_path / "out" / "matrix.md").read_text()
    assert text.splitlines()[0] == "| check | 2.6.0 | 2.8.0 | 2.13.0+cpu |"
    differing = (tmp_path / "out" / "matrix-differing.md").read_text()
    assert differing.splitlines()[2] == "| *0 other checks* | pass | pass | pass |"
    assert (tmp_path / "out" / "matrix.svg").is_file()
