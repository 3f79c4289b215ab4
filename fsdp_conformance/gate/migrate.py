"""Report ids across check renames: a report of an older layout still compares with a new one.

A report id is ``<check name>[<lane>,ws<N>,<variant>]``. When a check is renamed, compare maps
the old name to the new one in both reports before it matches ids (:func:`migrate_report` is
idempotent), so old↔new, new↔old and old↔old compare alike. Each old id stays unique after
the rename because the variant carries what the old name did (the FSDP version):
``init.no_meta.fsdp1[cpu,ws2,fsdp1,llama]`` becomes ``init.no_meta[cpu,ws2,fsdp1,llama]``.

Plain data only: compare must not import torch or the claims.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Old check name -> new check name: init's names lose their FSDP version (it is the
#: variant's part); append, never edit, so every older report keeps migrating.
CHECK_RENAMES: Mapping[str, str] = {
    "init.no_meta.fsdp1": "init.no_meta",
    "init.no_meta.fsdp2": "init.no_meta",
    "init.weights.fsdp1": "init.weights",
    "init.weights.fsdp2": "init.weights",
    "init.weights.fsdp1_default": "init.weights.default_path",
    "init.broadcast_rank0.fsdp1": "init.broadcast_rank0",
    "init.broadcast_rank0.fsdp2": "init.broadcast_rank0",
    "init.train_step.fsdp1": "init.train_step",
    "init.train_step.fsdp2": "init.train_step",
    "init.peak_memory.fsdp1": "init.peak_memory",
    "init.peak_memory.fsdp2": "init.peak_memory",
    "init.seeds_fn.fsdp1": "init.seeds_fn",
    "init.seeds_fn.fsdp2": "init.seeds_fn",
    "init.seeds_fn_to_empty.fsdp1": "init.seeds_fn_to_empty",
}


def _version_in(old_name: str) -> str:
    # The old names end in ".fsdp1", ".fsdp2" or ".fsdp1_default": the version they ran.
    return old_name.rsplit(".", 1)[1].split("_", 1)[0]


#: (new check name, FSDP version) -> the old name of that variant, for ``--checks`` patterns
#: written against the old names.
LEGACY_NAMES: Mapping[tuple[str, str], str] = {
    (new, _version_in(old)): old for old, new in CHECK_RENAMES.items()
}


def legacy_name(check: str, version: object) -> str | None:
    """The name the check's variant for ``version`` had before a rename, or None."""
    return LEGACY_NAMES.get((check, str(version)))


def migrate_entry(entry: Mapping[str, Any]) -> Mapping[str, Any]:
    """One report entry with its check name and id in the current layout (else unchanged)."""
    new = CHECK_RENAMES.get(entry["check"])
    if new is None:
        return entry
    old = entry["check"]
    return {**entry, "check": new, "id": new + entry["id"][len(old) :]}


def migrate_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report with every entry in the current layout (a new report comes back equal)."""
    return {**report, "checks": [migrate_entry(e) for e in report["checks"]]}
