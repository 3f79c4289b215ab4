"""Reports: the JSON report (versioned schema), the Markdown summary, and compare.

Schema ``fsdp-conformance-report`` version 1 (documented in docs/report-schema.md)::

    {
      "schema": "fsdp-conformance-report", "schema_version": 1,
      "tool_version": "0.1.0", "created": "2026-11-29T12:00:00+00:00", "duration_s": 12.3,
      "environment": {"torch": "2.13.0+cpu", "torch_cuda": null, "python": "3.11.7", ...},
      "settings": {"world_sizes": [2], "backend": "auto", "model": null, ...},
      "summary": {"passed": 20, "failed": 0, "skipped": 2, "error": 0},
      "checks": [
        {"id": "wrap.unit_set[cpu,ws2,fsdp1]", "check": "wrap.unit_set", "claim": "wrap",
         "lane": "cpu", "world_size": 2, "variant": "fsdp1", "outcome": "passed",
         "message": "...", "figures": {...}, "data": {...}, "seconds": 0.12,
         "warnings": ["UserWarning: ..."], "deprecations": ["FutureWarning: ..."]}
      ]
    }

``figures`` conventions that compare understands: keys ending in ``_bytes`` (or ``_MiB``) are
memory figures (compared with a relative tolerance), keys ending in ``_dtype`` are dtypes (any change is
reported), ``units`` is a unit count and ``data["units"]`` a unit list (structure changes are
reported), ``digest`` an init digest.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fsdp_conformance.settings import Settings

SCHEMA = "fsdp-conformance-report"
SCHEMA_VERSION = 1
DEPRECATION_CATEGORIES = ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning")
#: compare's default relative tolerance on memory figures.
DEFAULT_MEMORY_TOLERANCE = 0.05


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
        f"world sizes {','.join(map(str, settings.world_sizes))}",
        f"check timeout {settings.timeout:g}s",
        "ranks: external launcher (env://)" if launched_externally() else "ranks: warm pool",
    ]
    if settings.model:
        parts.append(f"model {settings.model}")
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
) -> dict[str, Any]:
    warnings = sorted(set(warnings))
    return {
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


def build_report(
    entries: Sequence[Mapping[str, Any]], settings: Settings, duration_s: float
) -> dict[str, Any]:
    summary = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    for e in entries:
        summary[e["outcome"]] = summary.get(e["outcome"], 0) + 1
    settings_data = {
        k: _jsonable(v) for k, v in dataclasses.asdict(settings).items() if k != "sources"
    }
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


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that an interrupted run never leaves a truncated file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_report(path: str, report: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps(report, indent=2, sort_keys=False) + "\n")


def load_report(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except FileNotFoundError:
        raise ReportError(f"report {path!r} does not exist; give the path of a JSON report "
                          "written by `fsdp-conformance run --json`") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"report {path!r} is not valid JSON ({exc}); was it written by "
                          "`fsdp-conformance run`?") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ReportError(f"{path!r} is not an fsdp-conformance report (no schema {SCHEMA!r})")
    version = report.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ReportError(
            f"{path!r} has schema version {version}, this tool reads {SCHEMA_VERSION}; "
            "re-run `fsdp-conformance run` with this version to produce a comparable report"
        )
    return report


# --------------------------------------------------------------------------------------------
# Human output: table and Markdown
# --------------------------------------------------------------------------------------------


def _key_figures(figures: Mapping[str, Any], limit: int = 4) -> str:
    parts = []
    for key, value in figures.items():
        if key.endswith("_bytes") and isinstance(value, (int, float)):
            parts.append(f"{key[:-6]} {value / 2**20:.2f} MiB")
        elif isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
        elif isinstance(value, (int, str, bool)):
            parts.append(f"{key} {value}")
        if len(parts) == limit:
            break
    return ", ".join(parts)


def _first_line(message: str, width: int = 100) -> str:
    """The most telling line of a failure message: the last exception line, else the first."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    errors = [line for line in lines if "Error:" in line or "Exception:" in line]
    line = errors[-1] if errors else lines[0]
    return line if len(line) <= width else line[: width - 3] + "..."


def format_table(report: Mapping[str, Any]) -> str:
    rows = [("check", "outcome", "key figures")]
    for e in report["checks"]:
        figures = _key_figures(e["figures"])
        if e["outcome"] in ("failed", "error", "skipped"):
            figures = _first_line(e["message"]) + (f" | {figures}" if figures else "")
        rows.append((e["id"], e["outcome"].upper(), figures))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}" for r in rows]
    lines.insert(1, "-" * min(120, max(len(line) for line in lines)))
    s = report["summary"]
    lines.append("")
    lines.append(
        f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, "
        f"{s['error']} errors in {report['duration_s']:.1f}s "
        f"(torch {report['environment']['torch']})"
    )
    return "\n".join(lines)


def format_markdown(report: Mapping[str, Any]) -> str:
    env, s = report["environment"], report["summary"]
    status = "PASS" if s["failed"] == 0 and s["error"] == 0 else "FAIL"
    lines = [
        f"## FSDP conformance: {status}",
        "",
        f"torch `{env['torch']}` ({'cuda ' + str(env['torch_cuda']) if env['torch_cuda'] else 'cpu build'}), "
        f"{env['cuda_devices']} CUDA device(s), python {env['python']}; "
        f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, {s['error']} errors "
        f"in {report['duration_s']:.1f}s.",
        "",
        "| check | outcome | key figures |",
        "|---|---|---|",
    ]
    icons = {"passed": "✅", "failed": "❌", "skipped": "⏭️", "error": "💥"}
    for e in report["checks"]:
        lines.append(
            f"| `{e['id']}` | {icons.get(e['outcome'], '')} {e['outcome']} | "
            f"{_key_figures(e['figures'])} |"
        )
    failures = [e for e in report["checks"] if e["outcome"] in ("failed", "error")]
    for e in failures:
        lines += ["", f"<details><summary>{e['id']}: {e['outcome']}</summary>", "", "```",
                  e["message"].strip(), "```", "</details>"]
    deprecations = sorted({d for e in report["checks"] for d in e.get("deprecations", [])})
    if deprecations:
        lines += ["", "### Deprecations torch emitted", ""] + [f"- {d}" for d in deprecations]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# compare: the upgrade gate
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Difference:
    """One difference between two reports."""

    check_id: str
    kind: str  # outcome | missing | added | units | memory | dtype | warning | figure
    regression: bool
    text: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compare_reports(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE,
) -> list[Difference]:
    """Every difference that matters for an upgrade, regressions flagged."""
    old_checks = {e["id"]: e for e in old["checks"]}
    new_checks = {e["id"]: e for e in new["checks"]}
    diffs: list[Difference] = []
    for cid in sorted(old_checks.keys() - new_checks.keys()):
        diffs.append(Difference(cid, "missing", True,
                                f"check missing from the new report (was {old_checks[cid]['outcome']})"))
    for cid in sorted(new_checks.keys() - old_checks.keys()):
        diffs.append(Difference(cid, "added", False,
                                f"new check (now {new_checks[cid]['outcome']})"))
    for cid in sorted(old_checks.keys() & new_checks.keys()):
        diffs += _compare_entry(cid, old_checks[cid], new_checks[cid], memory_tolerance)
    return diffs


_RANK = {"passed": 3, "skipped": 1, "failed": 0, "error": 0}


def _compare_entry(
    cid: str, old: Mapping[str, Any], new: Mapping[str, Any], tol: float
) -> list[Difference]:
    diffs = []
    o, n = old["outcome"], new["outcome"]
    if o != n:
        regression = _RANK.get(n, 0) < _RANK.get(o, 0)
        diffs.append(Difference(cid, "outcome", regression, f"{o} -> {n}"))
    old_units = old.get("data", {}).get("units")
    new_units = new.get("data", {}).get("units")
    if old_units is not None and new_units is not None and old_units != new_units:
        diffs.append(Difference(cid, "units", True, _unit_change(old_units, new_units)))
    of, nf = old.get("figures", {}), new.get("figures", {})
    for key in sorted(of.keys() | nf.keys()):
        a, b = of.get(key), nf.get(key)
        if a == b:
            continue
        if _is_memory_key(key) and isinstance(a, (int, float)) and isinstance(b, (int, float)):
            rel = (b - a) / a if a else float("inf")
            if abs(rel) > tol:
                diffs.append(Difference(
                    cid, "memory", rel > 0,
                    f"{key}: {_mib(key, a):.2f} MiB -> {_mib(key, b):.2f} MiB ({rel:+.1%}, "
                    f"tolerance {tol:.0%})"))
        elif key.endswith("_dtype") or key.endswith("_dtypes"):
            diffs.append(Difference(cid, "dtype", True, f"{key}: {a} -> {b}"))
        elif key == "units" and old_units is not None:
            continue  # reported with the unit lists
        elif key == "units":
            diffs.append(Difference(cid, "units", True, f"unit count {a} -> {b}"))
        elif not isinstance(a, float) and not isinstance(b, float):
            diffs.append(Difference(cid, "figure", False, f"{key}: {a!r} -> {b!r}"))
    new_warnings = sorted(set(new.get("warnings", [])) - set(old.get("warnings", [])))
    deprecations = set(new.get("deprecations", []))
    for w in new_warnings:
        kind = "deprecation" if w in deprecations else "warning"
        diffs.append(Difference(cid, kind, False, f"new {kind}: {w}"))
    return diffs


def _is_memory_key(key: str) -> bool:
    """Memory figures: ``*_bytes``, or ``*_MiB`` / ``*_mib`` (already in MiB)."""
    return key.endswith("_bytes") or key.lower().endswith("_mib")


def _mib(key: str, value: float) -> float:
    return value / 2**20 if key.endswith("_bytes") else value


def _unit_change(old_units: Sequence[Mapping[str, Any]], new_units: Sequence[Mapping[str, Any]]) -> str:
    o = {u["fqn"]: u for u in old_units}
    n = {u["fqn"]: u for u in new_units}
    parts = []
    for fqn in sorted(o.keys() - n.keys()):
        parts.append(f"- {fqn or '(root)'} ({o[fqn].get('cls')})")
    for fqn in sorted(n.keys() - o.keys()):
        parts.append(f"+ {fqn or '(root)'} ({n[fqn].get('cls')})")
    for fqn in sorted(o.keys() & n.keys()):
        for field in ("cls", "numel", "parent"):
            if o[fqn].get(field) != n[fqn].get(field):
                parts.append(f"~ {fqn or '(root)'} {field}: {o[fqn].get(field)!r} -> {n[fqn].get(field)!r}")
    return "unit structure changed: " + ("; ".join(parts) if parts else "order or local sizes")


def format_differences(
    old: Mapping[str, Any], new: Mapping[str, Any], diffs: Sequence[Difference]
) -> str:
    head = (
        f"compare: torch {old['environment']['torch']} -> {new['environment']['torch']}: "
        f"{sum(d.regression for d in diffs)} regression(s), {len(diffs)} difference(s)"
    )
    if not diffs:
        return head + "\nno differences"
    lines = [head]
    for d in diffs:
        mark = "REGRESSION" if d.regression else "change"
        lines.append(f"  [{mark}] {d.check_id}: {d.kind}: {d.text}")
    return "\n".join(lines)
