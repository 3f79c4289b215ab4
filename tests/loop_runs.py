"""What the loop claim's test modules share: each check by FSDP version, and one clean run of a
check per world size, kept so that the positive test and the parent-side negative controls
judge the same values (each module keeps its own ``shared_runs`` fixture, module-scoped)."""

from __future__ import annotations

from typing import Any

from fsdp_conformance.claims import loop
from fsdp_conformance.claims.check import Check
from fsdp_conformance.harness import Ranks


def by_version(name: str) -> dict[str, Check]:
    """The loop claim's check ``name``, one per FSDP version."""
    return {c.params["version"]: c for c in loop.CHECKS if c.name == name}


def clean_run(ranks: Ranks, shared: dict[tuple[Any, ...], Any], check: Check) -> Any:
    """Every rank's values of ``check`` run with its own parameters, once per (check, version,
    device type, world size) in ``shared``."""
    key = (check.name, check.params.get("version"), ranks.device_type, ranks.world_size)
    if key not in shared:
        shared[key] = ranks.run(check.rank_fn, **check.params)
    return shared[key]
