"""The report's schema: its name, version, outcomes and fields, and the validation of a report.

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
         "expected": {"check": "...", "torch": ">=2.13, <2.16", "reason": "...", "link": "...",
                      "match": "..."},
         "noise": {"update_rel_diff": 0.0},
         "traceback": "check 'x' failed on 2 ranks: ..."}
      ]
    }

``xfailed``: a failure a known torch defect explains (``fsdp_conformance/expectations.toml``);
``expected`` is on every entry an expectation covers: xfailed, passed, or failed (an error) whose
content its ``match`` did not match (the message says so). ``noise``: the spread
of each measured figure over repeated runs on one torch (gate/noise.py), on the entries of the
reference models' runs; absent where never measured. ``traceback``: on an
error, every rank's story (its ``message`` is then one line); absent in reports before it.

What compare makes of the figures and the unit lists is in ``gate/compare.py``; a report is
built, written and read in ``gate/report.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

SCHEMA = "fsdp-conformance-report"
SCHEMA_VERSION = 1
OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed")
#: Outcomes a report of an earlier version may have no summary count of (0 then).
_LATER_OUTCOMES = ("xfailed",)
DEPRECATION_CATEGORIES = ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning")


class Damage(Exception):
    """One bad field: where (a JSON path), what the schema expects, what was found."""

    def __init__(self, where: str, expected: str, found: str) -> None:
        super().__init__(f"{where}: expected {expected}, found {found}")
        self.where, self.expected, self.found = where, expected, found


def is_int(value: Any) -> bool:
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
    "count": ("an integer >= 0", lambda v: is_int(v) and v >= 0),
    "count|null": ("an integer >= 0 or null", lambda v: v is None or (is_int(v) and v >= 0)),
    "positive": ("an integer >= 1", lambda v: is_int(v) and v >= 1),
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
        lambda v: isinstance(v, list) and all(is_int(x) and x >= 1 for x in v),
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
#: Optional top-level fields (absent in older reports, and where there is nothing to say).
_OPTIONAL_TOP_FIELDS = {"notes": "list"}
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
        raise Damage(where, expected, _found(value))
    return value


def _fields(obj: Mapping[str, Any], spec: Mapping[str, str], prefix: str) -> None:
    for key, kind in spec.items():
        _field(obj, key, f"{prefix}{key}", kind)


def validate_report(report: Mapping[str, Any]) -> None:
    """Raise ``Damage`` at the first field that does not match the documented schema."""
    if not is_int(report.get("schema_version")):
        raise Damage(
            "schema_version",
            f"the integer {SCHEMA_VERSION}",
            _found(report.get("schema_version", _MISSING)),
        )
    _fields(report, _TOP_FIELDS, "")
    if "notes" in report:
        _fields(report, _OPTIONAL_TOP_FIELDS, "")
    _fields(report["environment"], _ENVIRONMENT_FIELDS, "environment.")
    _fields(report["settings"], _SETTINGS_FIELDS, "settings.")
    counts = dict.fromkeys(OUTCOMES, 0)
    first_at: dict[str, int] = {}
    for i, entry in enumerate(report["checks"]):
        where = f"checks[{i}]"
        if not isinstance(entry, dict):
            raise Damage(where, "an object (a check entry)", _found(entry))
        _validate_entry(entry, where)
        if entry["id"] in first_at:
            # compare matches checks by id: a repeated id would silently hide one of them.
            raise Damage(
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
            raise Damage(
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
        raise Damage(
            f"{where}.id",
            f"{expected_id!r} (from check, lane, world_size, variant)",
            _found(entry["id"]),
        )
    for key, value in entry["figures"].items():
        # Flat: the table and compare read scalars and lists of scalars, nothing nested.
        if not (_is_scalar(value) or (isinstance(value, list) and all(map(_is_scalar, value)))):
            raise Damage(
                f"{where}.figures.{key}",
                "a number, string, boolean, null or a list of those",
                _found(value),
            )
    warnings = set(entry["warnings"])
    for j, text in enumerate(entry["deprecations"]):
        if text not in warnings:
            raise Damage(f"{where}.deprecations[{j}]", "one of the entry's warnings", _found(text))
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
        raise Damage(
            path,
            "an object of lists of collective records (or one list)",
            _found(entry["data"][COLLECTIVES_DATA_KEY]),
        )
    for step, records in steps.items():
        at = f"{path}.{step}" if step else path
        for j, r in enumerate(records):
            if not isinstance(r, dict):
                raise Damage(f"{at}[{j}]", "an object (a collective record)", _found(r))
            _fields(r, _COLLECTIVE_FIELDS, f"{at}[{j}].")
