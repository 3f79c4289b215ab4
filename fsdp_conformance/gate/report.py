"""A report: each check's entry, the whole report built from them, written and read back.

The report's schema (``fsdp-conformance-report``, version 1) and its validation are in
``gate/schema.py`` (documented in docs/report-schema.md); the table and the Markdown summary
people read in ``gate/tables.py``; what compare makes of two reports in ``gate/compare.py``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fsdp_conformance._files import write_atomic
from fsdp_conformance.gate.schema import (
    DEPRECATION_CATEGORIES,
    OUTCOMES,
    SCHEMA,
    SCHEMA_VERSION,
    Damage,
    is_int,
    validate_report,
)
from fsdp_conformance.settings import Settings, world_sizes_left_out


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
        f"check timeout {settings.timeout:g}s"
        + (
            " (more for a check whose work scales with its model)"
            if settings.sources.get("timeout", "default") == "default"
            else " (as given, every check)"
        ),
        "ranks: external launcher (a child rank per launched process)"
        if launched_externally()
        else "ranks: warm pool",
    ]
    if settings.model:
        parts.append(f"model {settings.model}")
    if settings.init_fn:
        parts.append(f"init fn {settings.init_fn}")
    if settings.model_init:
        parts.append(f"model init {settings.model_init}")
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
    timeout: Mapping[str, Any] | None = None,
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
    if timeout is not None:
        entry["timeout"] = dict(timeout)  # a timeout derived from the check's work
    return entry


def build_report(
    entries: Sequence[Mapping[str, Any]],
    settings: Settings,
    duration_s: float,
    notes: Sequence[str] = (),
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
    report: dict[str, Any] = {
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
    if notes:  # the preflight's lines on the user's model, such as a fix the suite applied
        report["notes"] = list(notes)
    return report


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
    if is_int(version) and version != SCHEMA_VERSION:
        raise ReportError(
            f"{path!r} has schema version {version}, this tool reads {SCHEMA_VERSION}; "
            "re-run `fsdp-conformance run` with this version to produce a comparable report"
        )
    try:
        validate_report(report)
    except Damage as damage:
        raise ReportError(
            f"{path!r} is damaged: {damage.where}: expected {damage.expected}, found "
            f"{damage.found}; re-run `fsdp-conformance run` to write a complete report"
        ) from None
    return report
