"""Noise: how far each measured float of a report moves between runs on the same torch, so that
``compare`` can tell numeric drift (a move beyond it) from run-to-run noise (docs/upgrade-gate.md).

The procedure: run the same suite two or more times on one torch (``fsdp-conformance run``,
same settings), then ``fsdp-conformance noise R1.json R2.json [...] --out noise.json``. The table
holds, per check name and lane and per measured figure, the largest spread (max - min) seen
across the runs, over the check's variants, world sizes and list elements (one measurement
procedure, one noise). Measured figures: memory figures (``*_bytes``, ``*_MiB``) and every other
float (a loss, a relative difference against the reference, a ratio); counts, dtypes, digests
and the ``*_norm(s)`` results (judged by their own rule) are not.

The package stores the table measured on the reference models on the CPU lane
(:data:`REFERENCE_TABLE`); ``run`` writes each check's noise from it into the report (the
entry's ``noise``), so a report of the reference models carries its noise. For a user's model,
``ci/upgrade-gate.sh`` measures it (the current torch's side runs twice) and passes it to
``compare --noise``.

Imports no torch (``compare`` stays light).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

#: The noise table's schema name and version.
SCHEMA = "fsdp-conformance-noise"
SCHEMA_VERSION = 1
#: The package's table: the reference models on the CPU lane (docs/upgrade-gate.md says how it
#: was measured).
REFERENCE_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "noise-reference.json")
#: Figures judged by other rules in compare (numeric results, digests, the stated tolerance).
_NOT_MEASURED = ("_norm", "_norms", "_digest", "_digests")
_NOT_MEASURED_KEYS = ("numeric_rtol", "units")


class NoiseError(ValueError):
    """Reports that cannot give a noise table, or a table file that is not one."""


def is_memory_key(key: str) -> bool:
    """Memory figures: ``*_bytes``, or ``*_MiB`` / ``*_mib`` (already in MiB)."""
    return key.endswith("_bytes") or key.lower().endswith("_mib")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numbers(value: Any) -> list[float] | None:
    """The figure's values (a number, or a list of numbers), else None."""
    if _number(value):
        return [float(value)]
    if isinstance(value, list) and value and all(_number(v) for v in value):
        return [float(v) for v in value]
    return None


def is_measured(key: str, value: Any) -> bool:
    """A figure the noise table covers: a memory figure, or a float (or a list of numbers with a
    float among them) that no other compare rule judges."""
    if key in _NOT_MEASURED_KEYS or key.endswith(_NOT_MEASURED):
        return False
    if numbers(value) is None:
        return False
    if is_memory_key(key):
        return True
    return isinstance(value, float) or (
        isinstance(value, list) and any(isinstance(v, float) for v in value)
    )


def family(entry: Mapping[str, Any]) -> str:
    """The table's key for an entry: its check name and lane, ``wrap.train.fp32[cpu]``."""
    return f"{entry['check']}[{entry['lane']}]"


def _spread(values: Sequence[list[float]]) -> float | None:
    """The largest max - min over the elements of several runs' values of one figure; None when
    the runs' values do not line up (another length) or one is not finite."""
    if len({len(v) for v in values}) != 1:
        return None
    worst = 0.0
    for column in zip(*values):
        if not all(math.isfinite(x) for x in column):
            return None
        worst = max(worst, max(column) - min(column))
    return worst


def _check_runs(reports: Sequence[Mapping[str, Any]], sources: Sequence[str]) -> None:
    """Two or more runs of the same suite on one torch; else a message naming the fix."""
    if len(reports) < 2:
        raise NoiseError(
            f"noise needs two or more reports of the same run on one torch, got {len(reports)}; "
            "run `fsdp-conformance run` again with the same settings and pass every report"
        )
    torches = {r["environment"]["torch"] for r in reports}
    if len(torches) != 1:
        raise NoiseError(
            f"the reports are of torch {', '.join(sorted(torches))}: noise is measured on one "
            "torch; pass reports of repeated runs on the same torch"
        )
    first = reports[0]["settings"]
    for path, report in zip(sources[1:], reports[1:]):
        moved = [k for k in _RUN_KEYS if report["settings"].get(k) != first.get(k)]
        if moved:
            raise NoiseError(
                f"{path} was run with other settings than {sources[0]} ({', '.join(moved)}): "
                "noise compares repeated runs of the same suite; rerun with the same settings"
            )


#: Settings repeated runs must share.
_RUN_KEYS = ("model", "block_cls", "min_params", "input", "world_sizes")


def _figure_values(entries: Sequence[Mapping[str, Any]]) -> dict[str, list[list[float]]]:
    """Each measured figure's values in each run (one entry per run)."""
    per_key: dict[str, list[list[float]]] = {}
    for entry in entries:
        for key, value in (entry.get("figures") or {}).items():
            if is_measured(key, value):
                per_key.setdefault(key, []).append(numbers(value) or [])
    return per_key


def measure(reports: Sequence[Mapping[str, Any]], sources: Sequence[str]) -> dict[str, Any]:
    """The noise table of ``reports``: runs of one suite on one torch (``sources``: their paths,
    for the messages and the table)."""
    _check_runs(reports, sources)
    by_id: dict[str, list[Mapping[str, Any]]] = {}
    for report in reports:
        for entry in report["checks"]:
            by_id.setdefault(entry["id"], []).append(entry)
    table: dict[str, dict[str, float]] = {}
    for entries in by_id.values():
        if len(entries) != len(reports):
            continue  # a check only some runs have (an opt-in, a lane): no measurement
        for key, values in _figure_values(entries).items():
            spread = _spread(values) if len(values) == len(reports) else None
            if spread is not None:
                slot = table.setdefault(family(entries[0]), {})
                slot[key] = max(slot.get(key, 0.0), spread)
    first = reports[0]["settings"]
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "torch": reports[0]["environment"]["torch"],
        "model": first.get("model"),
        "world_sizes": first.get("world_sizes"),
        "runs": len(reports),
        "sources": [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in sources],
        "noise": {k: dict(sorted(v.items())) for k, v in sorted(table.items())},
    }


def load_table(path: str) -> dict[str, Any]:
    """A noise table written by ``fsdp-conformance noise``; a clear error otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            table: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise NoiseError(
            f"{path}: no such noise table; write one with `fsdp-conformance noise R1.json "
            "R2.json --out FILE` from repeated runs on the current torch"
        ) from None
    except (OSError, ValueError) as exc:
        raise NoiseError(f"{path}: not a noise table ({exc})") from None
    schema = table.get("schema") if isinstance(table, dict) else None
    if schema != SCHEMA:
        raise NoiseError(
            f"{path}: not a noise table (schema {schema!r}, expected {SCHEMA!r}); write one "
            "with `fsdp-conformance noise`"
        )
    noise = table.get("noise")
    if not isinstance(noise, dict) or not all(
        isinstance(v, dict) and all(_number(x) and x >= 0 for x in v.values())
        for v in noise.values()
    ):
        raise NoiseError(f"{path}: 'noise' must map 'check[lane]' to {{figure: spread >= 0}}")
    return table


@functools.cache
def reference_table() -> dict[str, Any]:
    """The package's table of the reference models (CPU lane), read once per process (every
    report of the reference models is annotated from it; callers do not change it)."""
    return load_table(REFERENCE_TABLE)


def annotate(entries: Sequence[dict[str, Any]], table: Mapping[str, Any]) -> None:
    """Write each entry's noise from ``table`` into it (``entry["noise"]``: figure -> spread),
    for the measured figures the table has; the table's torch and runs go with it."""
    noise = table["noise"]
    for entry in entries:
        known = noise.get(family(entry), {})
        mine = {
            key: known[key]
            for key, value in (entry.get("figures") or {}).items()
            if key in known and is_measured(key, value)
        }
        if mine:
            entry["noise"] = mine


def entry_noise(
    entry: Mapping[str, Any], table: Mapping[str, Any] | None, key: str
) -> float | None:
    """The noise of one figure of an entry: the entry's own (``run`` wrote it), else the
    table's; None when it was never measured."""
    own = (entry.get("noise") or {}).get(key)
    if isinstance(own, (int, float)) and not isinstance(own, bool):
        return float(own)
    if table is not None:
        value = table["noise"].get(family(entry), {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None
