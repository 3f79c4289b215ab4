"""The report as people read it: the console's table and the Markdown summary.

Each check's outcome and its key figures, or its reason whole; the counts, where each error's
traceback is, each expected failure in one line, and the deprecations torch emitted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fsdp_conformance.expectations import known_label
from fsdp_conformance.sizes import format_bytes


def _key_figures(figures: Mapping[str, Any], limit: int = 4) -> str:
    parts = []
    for key, value in figures.items():
        if key.endswith("_bytes") and isinstance(value, (int, float)):
            parts.append(f"{key[:-6]} {format_bytes(value)}")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
        elif isinstance(value, (int, str, bool)):
            parts.append(f"{key} {value}")
        if len(parts) == limit:
            break
    return ", ".join(parts)


def first_line(message: str, width: int | None = 100) -> str:
    """The most telling line of a failure message: the last exception line, else the first;
    cut at ``width`` (None: whole)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    errors = [line for line in lines if "Error:" in line or "Exception:" in line]
    line = errors[-1] if errors else lines[0]
    return line if width is None or len(line) <= width else line[: width - 3] + "..."


def reason(entry: Mapping[str, Any]) -> str:
    """A non-pass's reason in one line, whole: a skip's reason, an error's line (in a report
    before one-line errors: the telling line of its traceback), a failure's telling line, an
    expected failure's kind and link."""
    if entry["outcome"] == "xfailed":
        expected = entry.get("expected", {})
        return f"{known_label(expected.get('kind'))}: {expected.get('link', '')}"
    message = entry.get("message", "")
    if entry["outcome"] == "skipped":
        return " ".join(line.strip() for line in message.splitlines() if line.strip())
    return first_line(message, width=None)


def traceback_pointer(entry: Mapping[str, Any], report_path: str | None) -> str:
    """Where an error's whole story is: the check's id, the report file and the field."""
    where = report_path or "the JSON report"
    field = "traceback" if "traceback" in entry else "message"
    return f"traceback of {entry['id']}: {where} (the check's {field!r})"


def expected_note(entry: Mapping[str, Any]) -> str:
    """An expected failure's one line after its kind: a known torch defect fails so on any
    model, so its reason (a paragraph) stays in the report."""
    expected = entry.get("expected", {})
    return (
        f"of torch {expected.get('torch', '?')}, on any model ({expected.get('link', '')}); "
        "its reason is in the report's 'expected'"
    )


def format_table(report: Mapping[str, Any], report_path: str | None = None) -> str:
    """The console's table: each check's outcome and its key figures, or its reason whole; then
    the counts, where each error's traceback is, and each expected failure in one line."""
    rows = [("check", "outcome", "key figures")]
    for e in report["checks"]:
        figures = _key_figures(e["figures"])
        if e["outcome"] in ("failed", "error", "skipped"):
            figures = reason(e) + (f" | {figures}" if figures else "")
        elif e["outcome"] == "xfailed":
            figures = reason(e)
        rows.append((e["id"], e["outcome"].upper(), figures))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}" for r in rows]
    lines.insert(1, "-" * min(120, max(len(line) for line in lines)))
    for e in report["checks"]:  # the notes, then the counts last
        if e["outcome"] == "error":
            lines.append(traceback_pointer(e, report_path))
        elif e["outcome"] == "xfailed":
            label = known_label(e.get("expected", {}).get("kind"))
            lines.append(f"expected failure {e['id']}: {label} {expected_note(e)}")
    s = report["summary"]
    lines.append("")
    lines.append(
        f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, "
        f"{s['error']} errors{_xfailed_count(s)} in {report['duration_s']:.1f}s "
        f"(torch {report['environment']['torch']})"
    )
    return "\n".join(lines)


def _xfailed_count(summary: Mapping[str, Any]) -> str:
    n = summary.get("xfailed", 0)
    return f", {n} expected failure{'s' if n != 1 else ''}" if n else ""


def format_markdown(
    report: Mapping[str, Any],
    plot: str | None = None,
    plot_file: str | None = None,
    report_path: str | None = None,
) -> str:
    """The summary. ``plot``: the timeline PNG relative to the summary's folder, shown inline;
    ``plot_file``: its path on this machine, named (where a link could not resolve, such as
    the CI job page). Neither: the summary says nothing about a picture. Every non-pass's row
    holds its reason; a failure's message follows in full, then where each error's traceback is
    (``report_path``), and each expected failure in one line.
    """
    env, s = report["environment"], report["summary"]
    status = "PASS" if s["failed"] == 0 and s["error"] == 0 else "FAIL"
    build = f"cuda {env['torch_cuda']}" if env["torch_cuda"] else "cpu build"
    lines = [
        f"## FSDP conformance: {status}",
        "",
        (
            f"torch `{env['torch']}` ({build}), "
            f"{env['cuda_devices']} CUDA device(s), python {env['python']}; "
            f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, {s['error']} errors"
            f"{_xfailed_count(s)} in {report['duration_s']:.1f}s."
        ),
        "",
        *(f"Note: {note}" + "\n" for note in report.get("notes", ())),
        "| check | outcome | key figures or reason |",
        "|---|---|---|",
    ]
    icons = {"passed": "✅", "failed": "❌", "skipped": "⏭️", "error": "💥", "xfailed": "⚠️"}
    for e in report["checks"]:
        cell = _key_figures(e["figures"]) if e["outcome"] == "passed" else reason(e)
        lines.append(
            f"| `{e['id']}` | {icons.get(e['outcome'], '')} {e['outcome']} | "
            f"{cell.replace('|', chr(92) + '|')} |"
        )
    if plot:
        target = plot.replace(os.sep, "/").replace(" ", "%20")
        lines += [
            "",
            "### Memory timeline",
            "",
            f"![memory timeline, one panel per check]({target})",
            "",
            f"[{plot}]({target}): rank 0's memory at every unit hook during one step, "
            "per-layer wrapping against monolithic.",
        ]
    elif plot_file:
        lines += [
            "",
            f"Memory timeline plot: `{plot_file}` (written on the machine that ran the checks).",
        ]
    for e in report["checks"]:
        if e["outcome"] == "failed":
            lines += ["", f"<details><summary>{e['id']}: failed</summary>", "", "```"]
            lines += [e["message"].strip(), "```", "</details>"]
        elif e["outcome"] == "error":  # its one line is its row's reason
            lines += ["", f"- {traceback_pointer(e, report_path)}"]
        elif e["outcome"] == "xfailed":
            label = known_label(e.get("expected", {}).get("kind"))
            lines += ["", f"- {e['id']}: expected failure ({label}) {expected_note(e)}"]
    deprecations = sorted({d for e in report["checks"] for d in e.get("deprecations", [])})
    if deprecations:
        lines += ["", "### Deprecations torch emitted", ""] + [f"- {d}" for d in deprecations]
    return "\n".join(lines) + "\n"
