"""The version matrix: every check against every torch version, from one report per version.

``fsdp-conformance matrix REPORT...`` (``ci/torch-matrix.sh`` runs the suite on each supported
torch and calls it) reads the reports and renders checks x versions as a Markdown table, with
each reason a footnote, and as an SVG picture whose cells give their reason on hover. A cell is
what the report says the check did on that torch, nothing inferred:

========== ==========================================================================
pass       passed
FAIL       failed (the footnote: the first line of the failure)
ERROR      error (the footnote: the first line of the error)
xfail      expected failure: a known torch defect, or a documented change a check flags on purpose
           (the footnote: the expectation's kind, reason and link)
capability skipped because this torch lacks a capability (:mod:`fsdp_conformance.fsdp.capabilities`)
skip       skipped for another reason (the footnote: the reason)
absent     the check is not in that report (a check added since, or a renamed one)
========== ==========================================================================
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.expectations import known_label

#: Cell kinds in the order the legend lists them, with their Markdown text and SVG colour.
KINDS: dict[str, tuple[str, str]] = {
    "pass": ("pass", "#4caf50"),
    "fail": ("**FAIL**", "#e53935"),
    "error": ("**ERROR**", "#8e24aa"),
    "xfail": ("xfail", "#ffb300"),
    "capability": ("capability", "#90a4ae"),
    "skip": ("skip", "#cfd8dc"),
    "absent": ("—", "#ffffff"),
}
_OUTCOME_KIND = {"passed": "pass", "failed": "fail", "error": "error", "xfailed": "xfail"}
#: What a capability skip says (capabilities.require), so the matrix can tell it from others.
CAPABILITY_MARK = "skipped by capability"
#: Characters of a reason kept in a footnote (the report has the whole message).
REASON_CHARS = 300


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str
    #: Why, for every kind but pass and absent: one line.
    reason: str = ""


@dataclasses.dataclass
class Matrix:
    #: One column per report: its torch version (with the file where two share one).
    columns: list[str]
    #: Check ids (``check[lane,wsN,variant]``) in the order the reports first list them.
    rows: list[str]
    cells: dict[tuple[str, str], Cell]
    #: When each column's report was written (its ``created``), in column order.
    created: list[str] = dataclasses.field(default_factory=list)

    def cell(self, row: str, column: str) -> Cell:
        return self.cells.get((row, column), Cell("absent"))

    def counts(self, column: str) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for row in self.rows:
            out[self.cell(row, column).kind] += 1
        return out


def _first_line(text: str) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."


def cell_of(entry: Mapping[str, Any]) -> Cell:
    """The cell of one report entry (docs/report-schema.md)."""
    outcome = entry["outcome"]
    message = str(entry.get("message", ""))
    if outcome == "passed":
        return Cell("pass")
    if outcome == "xfailed":
        expected = entry.get("expected") or {}
        reason = str(expected.get("reason", "")) or message
        link = expected.get("link")
        kind = known_label(expected.get("kind"))
        return Cell("xfail", f"{kind}: " + _first_line(reason) + (f" ({link})" if link else ""))
    if outcome == "skipped":
        return Cell("capability" if CAPABILITY_MARK in message else "skip", _first_line(message))
    return Cell(_OUTCOME_KIND.get(outcome, "error"), _first_line(message))


def _version_of(report: Mapping[str, Any]) -> str:
    env = report.get("environment") or {}
    return str(env.get("torch") or "unknown torch")


def build_matrix(reports: Sequence[tuple[str, Mapping[str, Any]]]) -> Matrix:
    """The matrix of ``(path, report)`` pairs, one column each, in the order given."""
    versions = [_version_of(r) for _, r in reports]
    columns = [
        v if versions.count(v) == 1 else f"{v} ({path})" for v, (path, _) in zip(versions, reports)
    ]
    rows: dict[str, None] = {}  # ordered set
    cells: dict[tuple[str, str], Cell] = {}
    for column, (_, report) in zip(columns, reports):
        for entry in report["checks"]:
            rows.setdefault(entry["id"])
            cells[(entry["id"], column)] = cell_of(entry)
    return Matrix(columns, list(rows), cells, [str(r.get("created", "")) for _, r in reports])


def _footnotes(matrix: Matrix) -> dict[str, int]:
    notes: dict[str, int] = {}
    for row in matrix.rows:
        for column in matrix.columns:
            reason = matrix.cell(row, column).reason
            if reason and reason not in notes:
                notes[reason] = len(notes) + 1
    return notes


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def differing_rows(matrix: Matrix) -> list[str]:
    """The checks that do not pass on every version (skipped, failed, absent somewhere)."""
    return [
        row
        for row in matrix.rows
        if any(matrix.cell(row, c).kind != "pass" for c in matrix.columns)
    ]


def to_markdown(matrix: Matrix, differing: bool = False) -> str:
    """Checks x versions as one Markdown table; each distinct reason once, as a footnote.

    ``differing``: only the rows of :func:`differing_rows`, and a line saying how many checks
    pass on every version (the totals row still counts every check)."""
    shown = differing_rows(matrix) if differing else matrix.rows
    notes = _footnotes(dataclasses.replace(matrix, rows=shown))
    lines = [
        "| check | " + " | ".join(matrix.columns) + " |",
        "|---|" + "---|" * len(matrix.columns),
    ]
    if differing:
        lines.append(
            f"| *{len(matrix.rows) - len(shown)} other checks* | "
            + " | ".join(["pass"] * len(matrix.columns))
            + " |"
        )
    for row in shown:
        cells = []
        for column in matrix.columns:
            cell = matrix.cell(row, column)
            text = KINDS[cell.kind][0]
            if cell.reason:
                text += f" [{notes[cell.reason]}]"
            cells.append(text)
        lines.append(f"| `{_md_escape(row)}` | " + " | ".join(cells) + " |")
    totals = []
    for column in matrix.columns:
        counts = matrix.counts(column)
        totals.append(", ".join(f"{n} {kind}" for kind, n in counts.items() if n))
    lines.append("| **total** | " + " | ".join(totals) + " |")
    if notes:
        lines.append("")
        lines += [f"[{n}] {_md_escape(reason)}  " for reason, n in notes.items()]
    return "\n".join(lines) + "\n"


#: SVG geometry (pixels).
_CELL_W, _CELL_H, _LABEL_W, _HEAD_H, _LEGEND_H = 96, 16, 560, 40, 28


def to_svg(matrix: Matrix) -> str:
    """Checks x versions as coloured cells; each cell's check, version, outcome and reason are
    its tooltip (an SVG ``<title>``: shown on hover by browsers and GitHub's viewer)."""
    width = _LABEL_W + _CELL_W * len(matrix.columns) + 8
    height = _HEAD_H + _CELL_H * len(matrix.rows) + _LEGEND_H + 8
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="monospace" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    for i, column in enumerate(matrix.columns):
        x = _LABEL_W + i * _CELL_W + _CELL_W / 2
        out.append(
            f'<text x="{x}" y="{_HEAD_H - 8}" text-anchor="middle" font-weight="bold">'
            f"{html.escape(column)}</text>"
        )
    for j, row in enumerate(matrix.rows):
        y = _HEAD_H + j * _CELL_H
        out.append(f'<text x="4" y="{y + _CELL_H - 4}">{html.escape(row)}</text>')
        for i, column in enumerate(matrix.columns):
            cell = matrix.cell(row, column)
            tip = f"{row} on torch {column}: {cell.kind}" + (
                f": {cell.reason}" if cell.reason else ""
            )
            out.append(
                f'<rect x="{_LABEL_W + i * _CELL_W}" y="{y}" width="{_CELL_W - 2}" '
                f'height="{_CELL_H - 2}" fill="{KINDS[cell.kind][1]}" stroke="#9e9e9e">'
                f"<title>{html.escape(tip)}</title></rect>"
            )
    y = _HEAD_H + len(matrix.rows) * _CELL_H + 20
    x = 4
    for kind, (_, colour) in KINDS.items():
        out.append(
            f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colour}" stroke="#9e9e9e"/>'
        )
        out.append(f'<text x="{x + 16}" y="{y}">{kind}</text>')
        x += 24 + 8 * len(kind) + 16
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_data(matrix: Matrix) -> dict[str, Any]:
    """The matrix as plain JSON (``matrix.json``; docs/torch-matrix.json is one): a row's cells
    in column order, ``"pass"`` for a pass, else ``[kind, reason]``."""
    return {
        "columns": matrix.columns,
        "created": matrix.created,
        "rows": {
            row: [
                "pass" if c.kind == "pass" else [c.kind, c.reason]
                for c in (matrix.cell(row, column) for column in matrix.columns)
            ]
            for row in matrix.rows
        },
    }


def from_data(data: Mapping[str, Any]) -> Matrix:
    """The matrix :func:`to_data` wrote."""
    columns = list(data["columns"])
    cells = {
        (row, column): Cell("pass") if value == "pass" else Cell(*value)
        for row, values in data["rows"].items()
        for column, value in zip(columns, values)
    }
    return Matrix(columns, list(data["rows"]), cells, list(data.get("created", [])))


def print_and_write(matrix: Matrix, out: str | None, *, differing: bool = False) -> None:
    """Print the matrix's Markdown (only the rows that differ with ``differing``) and, with
    ``out``, write ``matrix.md`` (every row), ``matrix.svg`` and ``matrix.json`` there."""
    text = to_markdown(matrix)
    print(to_markdown(matrix, differing=True) if differing else text, end="")
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    data = json.dumps(to_data(matrix), indent=1) + "\n"
    for name, content in (
        ("matrix.md", text),
        ("matrix.svg", to_svg(matrix)),
        ("matrix.json", data),
    ):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            f.write(content)
    print(
        f"matrix: {', '.join(os.path.join(out, n) for n in ('matrix.md', 'matrix.svg', 'matrix.json'))}",
        file=sys.stderr,
    )


#: Around the published table in README.md (the differing rows) and docs/torch-matrix.md (every
#: row): ``ci/readme-matrix.py`` writes what is between them from docs/torch-matrix.json, and
#: tests/test_readme_figures.py holds them to it.
BLOCK_START, BLOCK_END = "<!-- torch-matrix -->", "<!-- /torch-matrix -->"


def published_block(data: Mapping[str, Any], *, differing: bool) -> str:
    """What goes between the markers: a line saying what was measured (the commit, the dates,
    the number of checks, whether any cell is a failure or an error), then the table."""
    table = from_data(data)
    days = sorted({c[:10] for c in table.created if c})
    when = " to ".join(dict.fromkeys([days[0], days[-1]])) if days else "an unrecorded date"
    broken = sum(table.counts(c)["fail"] + table.counts(c)["error"] for c in table.columns)
    shown = (
        "only the checks that do not pass on every version (`matrix --differing`; all "
        f"{len(table.rows)} rows in [docs/torch-matrix.md](docs/torch-matrix.md), the picture in "
        "[docs/torch-matrix.svg](docs/torch-matrix.svg))"
        if differing
        else "every check"
    )
    verdict = (
        "No cell is a failure or an error"
        if not broken
        else f"{broken} cells are failures or errors"
    )
    head = (
        f"Measured on {when} at {data['measured_at']}: CPU lane, gloo, world size 2, "
        f"{len(table.rows)} checks, one run per version, CUDA wheels run on CPU; {shown}. "
        f"{verdict}:"
    )
    return f"{textwrap.fill(head, 100, break_on_hyphens=False)}\n\n{to_markdown(table, differing=differing)}"


def replace_block(text: str, block: str, where: str) -> str:
    """``text`` with what is between :data:`BLOCK_START` and :data:`BLOCK_END` replaced by
    ``block``; ``where`` names the file when a marker is missing."""
    if BLOCK_START not in text or BLOCK_END not in text:
        raise ValueError(f"{where}: no {BLOCK_START} ... {BLOCK_END} markers around the table")
    before, rest = text.split(BLOCK_START, 1)
    after = rest.split(BLOCK_END, 1)[1]
    return f"{before}{BLOCK_START}\n{block}{BLOCK_END}{after}"


def current_block(text: str) -> str:
    """What is between the markers of ``text`` now (empty when they are missing)."""
    if BLOCK_START not in text or BLOCK_END not in text:
        return ""
    return text.split(BLOCK_START, 1)[1].split(BLOCK_END, 1)[0].removeprefix("\n")
