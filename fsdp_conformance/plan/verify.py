"""The cross-check: FSDP2 applied for real to the meta model on a fake process group, each unit's
local shard compared with the estimate's analytic dim-0 padding."""

from __future__ import annotations

import math
import time
from typing import Any

from fsdp_conformance.models.units import ROOT, UnitInfo
from fsdp_conformance.plan.estimate import ModelPlan
from fsdp_conformance.plan.model import DTYPE_BYTES, build_meta_model


def fsdp2_padded_local_numel(plan: ModelPlan, unit: UnitInfo, world_size: int) -> int:
    """FSDP2's per-rank shard of a unit: each parameter's dim 0 padded to a multiple of W."""
    total = 0
    for name in unit.params:
        shape = plan.param_shapes[name]
        rows = shape[0] if shape else 1
        rest = math.prod(shape[1:]) if len(shape) > 1 else 1
        total += -(-rows // world_size) * rest
    return total


def verify_fsdp2_shards(plan: ModelPlan, world_size: int, model: Any = None) -> dict[str, Any]:
    """Apply FSDP2 to the meta model on a fake process group of ``world_size`` ranks.

    Reads every unit's actual local shard on rank 0 (the largest: FSDP2 gives rank 0 a full
    chunk) and compares it with the analytic dim-0 padding and with the estimate's
    ``ceil(numel / W)``. Shards ``model`` in place (build a fresh one when not given). Needs
    this process to have no default process group of its own (it makes and destroys one).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_conformance import _compat
    from fsdp_conformance.fsdp.sharding import shard_fsdp2_modules
    from fsdp_conformance.models.units import fsdp2_units, unit_differences

    if dist.is_available() and dist.is_initialized():
        return {
            "skipped": "this process already has a default process group; the fake one "
            "needs its own (run the plan in a fresh process)"
        }
    start = time.perf_counter()
    model = build_meta_model(plan.choice) if model is None else model
    store = _compat.fake_store_cls()()  # importing its module registers the "fake" backend
    dist.init_process_group("fake", store=store, rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        modules = [model.get_submodule(u.fqn) for u in plan.units if u.fqn != ROOT]
        shard_fsdp2_modules(model, None, modules, mesh=mesh)  # type: ignore[arg-type]
        actual = fsdp2_units(model)
    finally:
        dist.destroy_process_group()
    by_fqn = {u.fqn: u for u in actual}
    rows: list[dict[str, Any]] = []
    mismatched: list[str] = []
    for u in plan.units:
        got = by_fqn.get(u.fqn)
        padded = fsdp2_padded_local_numel(plan, u, world_size)
        local = got.local_numel if got is not None else None
        rows.append(
            {
                "fqn": u.fqn,
                "numel": u.numel,
                "local_numel": local,
                "padded_numel": padded,
                "ceil_numel": -(-u.numel // world_size),
            }
        )
        if local != padded:
            mismatched.append(u.fqn or "(root)")
    structure = unit_differences(plan.units, actual, compare=("cls", "numel"))
    ceil_total = sum(r["ceil_numel"] for r in rows)
    local_total = sum(r["local_numel"] or 0 for r in rows)
    return {
        "world_size": world_size,
        "rank": 0,
        "seconds": time.perf_counter() - start,
        "units": rows,
        "unit_differences": structure,
        "matches": not mismatched and not structure,
        "mismatched": mismatched,
        "local_numel": local_total,
        "ceil_numel": ceil_total,
        # What the padding adds per rank to every sharded-state term (params, grads, state).
        "padding_numel": local_total - ceil_total,
        "padding_bytes_per_state": (local_total - ceil_total)
        * DTYPE_BYTES[plan.settings.param_dtype],
    }
