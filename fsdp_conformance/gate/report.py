"""Reports: the JSON report (versioned schema), its validation and the Markdown summary.

Schema ``fsdp-conformance-report`` version 1 (documented in docs/report-schema.md)::

    {
      "schema": "fsdp-conformance-report", "schema_version": 1,
      "tool_version": "0.1.0", "created": "2026-11-29T12:00:00+00:00", "duration_s": 12.3,
      "environment": {"torch": "2.13.0+cpu", "torch_cuda": null, "python": "3.11.7", ...},
      "settings": {"world_sizes": [2], "backend": "auto", "model": null, ...},
      "summary": {"passed": 20, "failed": 0, "skipped": 2, "error": 0, "xfailed": 1},
      "checks": [
        {"id": "wrap.units.exact[cpu,ws2,fsdp1,massive]", "check": "wrap.units.exact",
         "claim": "wrap", "lane": "cpu", "world_size": 2, "variant": "fsdp1,massive",
         "outcome": "passed", "message": "...", "figures": {...}, "data": {...},
         "seconds": 0.12, "warnings": ["UserWarning: ..."], "deprecations": ["FutureWarning: ..."],
         "expected": {"check": "...", "torch": ">=2.13, <2.16", "reason": "...", "link": "..."},
         "noise": {"update_rel_diff": 0.0},
         "traceback": "check 'x' failed on 2 ranks: ..."}

``xfailed``: a failure a known torch defect explains (``fsdp_conformance/expectations.toml``);
``expected`` is on every entry an expectation covers, xfailed or passed. ``noise``: the spread
of each measured figure over repeated runs on one torch (gate/noise.py), on the entries of the
reference models' runs; absent where never measured. ``traceback``: on an
error, every rank's story (its ``message`` is then one line); absent in reports before it.
      ]
    }

What compare makes of the figures and the unit lists is in ``gate/compare.py``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fsdp_conformance._files import write_atomic
from fsdp_conformance.expectations import known_label
from fsdp_conformance.settings import Settings, world_sizes_left_out
from fsdp_conformance.sizes import format_bytes

SCHEMA = "fsdp-conformance-report"
SCHEMA_VERSION = 1
OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed")
#: Outcomes a report of an earlier version may have no summary count of (0 then).
_LATER_OUTCOMES = ("xfailed",)
DEPRECATION_CATEGORIES = ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning")


class ReportError(ValueError):
    """A report file cannot be read or is not a report of a schema we know."""


def environment_summary(settings: Settings) -> str:
    """One line: torch version and build, devices, backends, world sizes, launcher mode."""
    from fsdp_conformance.harness import launched_externally

    env = environment_info()
    build = f"cuda {env['torch_cuda']}" if env["torch_cuda"] else "cpu build"
    parts = [
        f"torch {env['torch']} ({build})",
        f"cuda devices {env['cuda_devices']}",
        f"backends {','.join(env['backends']) or 'none'}",
        f"backend {settings.backend}",
        f"world sizes {','.join(map(str, settings.world_sizes))}"
        + (f" ({left})" if (left := world_sizes_left_out(settings)) else ""),
        f"check timeout {settings.timeout:g}s",
        "ranks: external launcher (env://)" if launched_externally() else "ranks: warm pool",
    ]
    if settings.model:
        parts.append(f"model {settings.model}")
    if settings.init_fn:
        parts.append(f"init fn {settings.init_fn}")
    return ", ".join(parts)


def environment_info() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from fsdp_conformance.harness import cuda_device_count

    devices = cuda_device_count()
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_git": getattr(torch.version, "git_version", None),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda_devices": devices,
        "cuda_device_name": torch.cuda.get_device_name(0) if devices else None,
        "backends": [b for b in ("gloo", "nccl") if getattr(dist, f"is_{b}_available")()],
    }


def _jsonable(value: Any) -> Any:
    """Plain JSON data from check data (dataclasses, tuples, torch dtypes, ...)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def check_entry(
    *,
    check: str,
    claim: str,
    lane: str,
    world_size: int,
    variant: str,
    outcome: str,
    message: str,
    figures: Mapping[str, Any],
    data: Mapping[str, Any],
    seconds: float,
    warnings: Iterable[str],
    expected: Mapping[str, str] | None = None,
    traceback: str = "",
) -> dict[str, Any]:
    warnings = sorted(set(warnings))
    entry = {
        "id": f"{check}[{lane},ws{world_size}{',' + variant if variant else ''}]",
        "check": check,
        "claim": claim,
        "lane": lane,
        "world_size": world_size,
        "variant": variant,
        "outcome": outcome,
        "message": message,
        "figures": _jsonable(figures),
        "data": _jsonable(data),
        "seconds": round(seconds, 4),
        "warnings": warnings,
        "deprecations": [w for w in warnings if w.split(":", 1)[0] in DEPRECATION_CATEGORIES],
    }
    if expected is not None:
        entry["expected"] = dict(expected)
    if traceback:
        entry["traceback"] = traceback  # an error's whole story; its message is one line
    return entry


def build_report(
    entries: Sequence[Mapping[str, Any]], settings: Settings, duration_s: float
) -> dict[str, Any]:
    summary = dict.fromkeys(OUTCOMES, 0)
    for e in entries:
        summary[e["outcome"]] = summary.get(e["outcome"], 0) + 1
    settings_data = {
        k: _jsonable(v) for k, v in dataclasses.asdict(settings).items() if k != "sources"
    }
    if settings.model is None:
        # The reference models' measured figures carry their noise (gate/noise.py); a user's
        # model has its own, measured by the gate (ci/upgrade-gate.sh).
        from fsdp_conformance.gate.noise import annotate, reference_table

        annotate([e for e in entries if isinstance(e, dict)], reference_table())
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "tool_version": _tool_version(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(duration_s, 3),
        "environment": environment_info(),
        "settings": settings_data,
        "summary": summary,
        "checks": list(entries),
    }


def _tool_version() -> str:
    from fsdp_conformance import __version__

    return __version__


def write_json_report(path: str, report: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps(report, indent=2, sort_keys=False) + "\n")


def load_report(path: str) -> dict[str, Any]:
    """Read and validate a whole report (docs/report-schema.md); any damage is one ReportError.

    The message names the file, the JSON path of the bad field (``checks[3].figures``), what
    the schema expects there and what the file holds, so compare never reads a damaged report
    (a traceback, or a string's characters taken as warnings).
    """
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except FileNotFoundError:
        raise ReportError(
            f"report {path!r} does not exist; give the path of a JSON report "
            "written by `fsdp-conformance run --json`"
        ) from None
    except IsADirectoryError:
        inside = os.path.join(path, "report.json")
        hint = f" ({inside!r} is there)" if os.path.isfile(inside) else ""
        raise ReportError(
            f"report {path!r} is a folder, not a file{hint}; give the path of "
            "the JSON report itself, e.g. fsdp-conformance-report/report.json"
        ) from None
    except UnicodeDecodeError:
        raise ReportError(
            f"report {path!r} is not text (not UTF-8); give the path of a JSON "
            "report written by `fsdp-conformance run`"
        ) from None
    except OSError as exc:
        raise ReportError(
            f"cannot read report {path!r} ({exc.strerror or exc}); check the path "
            "and its permissions"
        ) from None
    except json.JSONDecodeError as exc:
        raise ReportError(
            f"report {path!r} is not valid JSON ({exc}); was it written by `fsdp-conformance run`?"
        ) from None
    except RecursionError:
        raise ReportError(
            f"report {path!r} is nested too deeply to be a report; was it written "
            "by `fsdp-conformance run`?"
        ) from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ReportError(f"{path!r} is not an fsdp-conformance report (no schema {SCHEMA!r})")
    version = report.get("schema_version")
    if _is_int(version) and version != SCHEMA_VERSION:
        raise ReportError(
            f"{path!r} has schema version {version}, this tool reads {SCHEMA_VERSION}; "
            "re-run `fsdp-conformance run` with this version to produce a comparable report"
        )
    try:
        validate_report(report)
    except _Damage as damage:
        raise ReportError(
            f"{path!r} is damaged: {damage.where}: expected {damage.expected}, found "
            f"{damage.found}; re-run `fsdp-conformance run` to write a complete report"
        ) from None
    return report


class _Damage(Exception):
    """One bad field: where (a JSON path), what the schema expects, what was found."""

    def __init__(self, where: str, expected: str, found: str) -> None:
        super().__init__(f"{where}: expected {expected}, found {found}")
        self.where, self.expected, self.found = where, expected, found


def _is_int(value: Any) -> bool:
    # JSON true/false load as bool, a subclass of int: a boolean is not a count or a version.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, bool)) or _is_number(value)


def _found(value: Any) -> str:
    """A value in JSON terms, short: ``a list ([1, 2])``, ``a boolean (true)``."""
    if isinstance(value, _Missing):
        return "nothing (the field is missing)"
    text = json.dumps(value, allow_nan=True)
    if len(text) > 40:
        text = text[:37] + "..."
    kind = (
        "null"
        if value is None
        else "a boolean"
        if isinstance(value, bool)
        else "an integer"
        if isinstance(value, int)
        else "a number"
        if isinstance(value, float)
        else "a string"
        if isinstance(value, str)
        else "a list"
        if isinstance(value, list)
        else "an object"
    )
    return kind if value is None else f"{kind} ({text})"


class _Missing:
    pass


_MISSING = _Missing()

#: Value kinds of the schema: (what the message says is expected, the test).
_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "string": ("a string", lambda v: isinstance(v, str)),
    "name": ("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "string|null": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "count": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "count|null": ("an integer >= 0 or null", lambda v: v is None or (_is_int(v) and v >= 0)),
    "positive": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "seconds": ("a finite number >= 0", lambda v: _is_number(v) and v >= 0),
    "number|null": ("a finite number or null", lambda v: v is None or _is_number(v)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "list": ("a list", lambda v: isinstance(v, list)),
    "strings": (
        "a list of strings",
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    ),
    "sizes": (
        "a list of integers >= 1",
        lambda v: isinstance(v, list) and all(_is_int(x) and x >= 1 for x in v),
    ),
    "lane": ("one of cpu, gpu", lambda v: v in ("cpu", "gpu")),
    "outcome": (f"one of {', '.join(OUTCOMES)}", lambda v: isinstance(v, str) and v in OUTCOMES),
}

#: The documented fields (docs/report-schema.md) and their kinds. Fields not listed here are
#: allowed: schema version 1 grows by adding fields.
_TOP_FIELDS = {
    "tool_version": "string",
    "created": "string",
    "duration_s": "seconds",
    "environment": "object",
    "settings": "object",
    "summary": "object",
    "checks": "list",
}
_ENVIRONMENT_FIELDS = {
    "torch": "name",
    "torch_cuda": "string|null",
    "torch_git": "string|null",
    "python": "string",
    "platform": "string",
    "cuda_devices": "count",
    "cuda_device_name": "string|null",
    "backends": "strings",
}
_SETTINGS_FIELDS = {
    "world_sizes": "sizes",
    "backend": "string",
    "timeout": "number|null",
    "model": "string|null",
    "block_cls": "string|null",
    "min_params": "number|null",
    "input": "string|null",
}
_CHECK_FIELDS = {
    "id": "name",
    "check": "name",
    "claim": "name",
    "lane": "lane",
    "world_size": "positive",
    "variant": "string",
    "outcome": "outcome",
    "message": "string",
    "figures": "object",
    "data": "object",
    "seconds": "seconds",
    "warnings": "strings",
    "deprecations": "strings",
}
#: ``data`` keys that hold a check's unit list (the units torch built), in order of preference.
UNIT_DATA_KEYS = ("units", "actual", "plan")
_UNIT_FIELDS = {
    "fqn": "string",
    "cls": "string",
    "numel": "count",
    "local_numel": "count|null",
    "parent": "string|null",
    "params": "strings",
}
#: ``data`` key of a check's recorded collectives: ``{step: [record, ...]}`` (or one list).
COLLECTIVES_DATA_KEY = "collectives"
_COLLECTIVE_FIELDS = {
    "op": "name",
    "unit": "string",
    "phase": "string",
    "in_dtype": "string|null",
    "out_dtype": "string|null",
    "in_bytes": "count",
    "out_bytes": "count",
}


def collective_steps(entry: Mapping[str, Any]) -> dict[str, list[Any]] | None:
    """A check entry's recorded collectives by step, or None when it recorded none."""
    value = (entry.get("data") or {}).get(COLLECTIVES_DATA_KEY)
    if isinstance(value, list):
        return {"": value}
    if isinstance(value, dict) and all(isinstance(v, list) for v in value.values()):
        return dict(value)
    return None


def _field(obj: Mapping[str, Any], key: str, where: str, kind: str) -> Any:
    value = obj.get(key, _MISSING)
    expected, test = _KINDS[kind]
    if isinstance(value, _Missing) or not test(value):
        raise _Damage(where, expected, _found(value))
    return value


def _fields(obj: Mapping[str, Any], spec: Mapping[str, str], prefix: str) -> None:
    for key, kind in spec.items():
        _field(obj, key, f"{prefix}{key}", kind)


def validate_report(report: Mapping[str, Any]) -> None:
    """Raise ``_Damage`` at the first field that does not match the documented schema."""
    if not _is_int(report.get("schema_version")):
        raise _Damage(
            "schema_version",
            f"the integer {SCHEMA_VERSION}",
            _found(report.get("schema_version", _MISSING)),
        )
    _fields(report, _TOP_FIELDS, "")
    _fields(report["environment"], _ENVIRONMENT_FIELDS, "environment.")
    _fields(report["settings"], _SETTINGS_FIELDS, "settings.")
    counts = dict.fromkeys(OUTCOMES, 0)
    first_at: dict[str, int] = {}
    for i, entry in enumerate(report["checks"]):
        where = f"checks[{i}]"
        if not isinstance(entry, dict):
            raise _Damage(where, "an object (a check entry)", _found(entry))
        _validate_entry(entry, where)
        if entry["id"] in first_at:
            # compare matches checks by id: a repeated id would silently hide one of them.
            raise _Damage(
                f"{where}.id",
                "an id unique in the report",
                f"{_found(entry['id'])}, which appears twice (also "
                f"checks[{first_at[entry['id']]}])",
            )
        first_at[entry["id"]] = i
        counts[entry["outcome"]] += 1
    summary = report["summary"]
    for outcome in OUTCOMES:
        if outcome in _LATER_OUTCOMES and outcome not in summary and not counts[outcome]:
            continue  # a report written before this outcome existed
        value = _field(summary, outcome, f"summary.{outcome}", "count")
        if value != counts[outcome]:
            raise _Damage(
                f"summary.{outcome}",
                f"{counts[outcome]} (the checks with outcome {outcome!r})",
                _found(value),
            )


def _validate_entry(entry: Mapping[str, Any], where: str) -> None:
    _fields(entry, _CHECK_FIELDS, f"{where}.")
    if "traceback" in entry:  # optional: an error's whole story (absent in older reports)
        _field(entry, "traceback", f"{where}.traceback", "string")
    variant = entry["variant"]
    expected_id = (
        f"{entry['check']}[{entry['lane']},ws{entry['world_size']}"
        f"{',' + variant if variant else ''}]"
    )
    if entry["id"] != expected_id:
        raise _Damage(
            f"{where}.id",
            f"{expected_id!r} (from check, lane, world_size, variant)",
            _found(entry["id"]),
        )
    for key, value in entry["figures"].items():
        # Flat: the table and compare read scalars and lists of scalars, nothing nested.
        if not (_is_scalar(value) or (isinstance(value, list) and all(map(_is_scalar, value)))):
            raise _Damage(
                f"{where}.figures.{key}",
                "a number, string, boolean, null or a list of those",
                _found(value),
            )
    warnings = set(entry["warnings"])
    for j, text in enumerate(entry["deprecations"]):
        if text not in warnings:
            raise _Damage(f"{where}.deprecations[{j}]", "one of the entry's warnings", _found(text))
    for key in UNIT_DATA_KEYS:
        units = entry["data"].get(key)
        if isinstance(units, list) and all(isinstance(u, dict) and "fqn" in u for u in units):
            # what compare reads as the unit list: its fields must be what it compares
            for j, u in enumerate(units):
                _fields(u, _UNIT_FIELDS, f"{where}.data.{key}[{j}].")
            break
    if COLLECTIVES_DATA_KEY in entry["data"]:
        _validate_collectives(entry, f"{where}.data.{COLLECTIVES_DATA_KEY}")


def _validate_collectives(entry: Mapping[str, Any], path: str) -> None:
    # what compare reads as the collectives: every record's fields must be there, typed
    steps = collective_steps(entry)
    if steps is None:
        raise _Damage(
            path,
            "an object of lists of collective records (or one list)",
            _found(entry["data"][COLLECTIVES_DATA_KEY]),
        )
    for step, records in steps.items():
        at = f"{path}.{step}" if step else path
        for j, r in enumerate(records):
            if not isinstance(r, dict):
                raise _Damage(f"{at}[{j}]", "an object (a collective record)", _found(r))
            _fields(r, _COLLECTIVE_FIELDS, f"{at}[{j}].")


# --------------------------------------------------------------------------------------------
# Human output: table and Markdown
# --------------------------------------------------------------------------------------------


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
