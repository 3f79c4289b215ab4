"""``state.checkpoint.torch_save.shared_step``: FSDP1's full optimizer state dict written with
``torch.save``, read with ``torch.load``'s defaults and loaded into one unsharded process: every
parameter's AdamW step count after the next step is the unbroken run's (a known torch defect:
FSDP1 hands every parameter of a flat parameter one shared ``step`` tensor, and ``torch.save``
keeps the sharing; docs/state.md).

The user's steps (``torch_load``, ``set_optimizer``, ``next_step``) are this module's names, so
the faults of :data:`FAULTS` patch them here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import FaultTable
from fsdp_conformance.claims.state.common import (
    DEFAULT_SPEC,
    LR,
    STEP_SEED,
    TRAIN_SEED,
    build_sharded,
    fresh_pair,
    next_step,
    next_step_perturbed,
    optimizer_not_loaded,
    set_optimizer,
    shared_folder,
    torch_load,
    torch_load_refused,
    train_step,
    wrong_value_read,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version
from fsdp_conformance.fsdp.state_dict_kinds import (
    get_optim_state,
    get_state,
    shared_steps,
    whole_state,
)
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec

#: The negative controls of this family: the user's steps above, done wrong.
FAULTS = FaultTable(
    optimizer_not_loaded=optimizer_not_loaded(__name__, "set_optimizer"),
    wrong_value_read=wrong_value_read(__name__),
    torch_load_refused=torch_load_refused(__name__),
    next_step_perturbed=next_step_perturbed(__name__),
)


class SharedStepResult(TypedDict):
    """:func:`rank_checkpoint_torch_save_shared_step`'s result on one rank."""

    rank: int
    #: The parameters whose ``step`` the file read back holds as one tensor with another's.
    shared: list[str]
    #: AdamW's step count saved (every parameter's, distinct values).
    saved_steps: list[float]
    #: Per parameter: its step count after the next step in one process.
    steps_after: dict[str, float]
    #: The sharded (unbroken) run's step counts after its next step (distinct values).
    unbroken_steps: list[float]


def rank_checkpoint_torch_save_shared_step(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp1",
    seed: int = 0,
    save_to: str | None = None,
    load_from: str | None = None,
    fault: str | Sequence[str] | None = None,
) -> SharedStepResult:
    """FSDP1 trained one AdamW step; its full model and optimizer state dicts (``FSDP.state_dict``
    and ``FSDP.optim_state_dict`` under ``FULL_STATE_DICT``) written with ``torch.save`` (a file
    per rank, a folder of this run's: ``save_to`` and ``load_from`` only opt it in), read with
    ``torch.load``'s defaults and loaded into an unsharded model and AdamW in one process
    (``load_state_dict``, ``set_optimizer_state_dict``); each parameter's step count after the
    next step there, against the sharded run's after its own next step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    check_fsdp_version(version)
    with FAULTS.inject(fault, ctx), shared_folder(ctx, "fsdp-conformance-shared-step-") as path:
        model = build_sharded(ctx, spec, "fsdp1", seed)
        optim = torch.optim.AdamW(model.parameters(), lr=LR)
        batch = spec.batch(model, 2, ctx.device)
        train_step(model, optim, batch, TRAIN_SEED)
        file = os.path.join(path, f"full-rank{ctx.rank}.pt")
        torch.save(
            {
                "model": get_state(model, "fsdp1", "full"),
                "optim": get_optim_state(model, optim, "fsdp1", "full"),
            },
            file,
        )
        state = torch_load(file)
        plain, plain_optim = fresh_pair(ctx, spec, "unsharded", seed + 1)
        plain.load_state_dict(state["model"])
        saved_steps = sorted({float(s["step"]) for s in state["optim"]["state"].values()})
        shared = shared_steps(state["optim"])
        set_optimizer(plain, plain_optim, "unsharded", state["optim"])
        next_step(plain, plain_optim, batch)
        after: dict[str, Any] = dict(get_optimizer_state_dict(plain, plain_optim))
        after = after["state"]
        train_step(model, optim, batch, STEP_SEED)
        unbroken = whole_state(model, optim, "fsdp1")[1]["state"]
    return {
        "rank": ctx.rank,
        "shared": shared,
        "saved_steps": saved_steps,
        "steps_after": {str(n): float(s["step"]) for n, s in after.items()},
        "unbroken_steps": sorted({float(s["step"]) for s in unbroken.values()}),
    }


def verdict_checkpoint_torch_save_shared_step(
    values: Sequence[SharedStepResult], params: Mapping[str, Any]
) -> Verdict:
    """Every parameter's step count after the next step in one process equals the unbroken
    run's (one step more than saved), on every rank; else one line naming torch's behaviour."""
    spec = params.get("spec", DEFAULT_SPEC)
    first = sorted(values, key=lambda v: v["rank"])[0]
    expected = first["unbroken_steps"]
    wrong = {
        v["rank"]: sorted({c for c in v["steps_after"].values() if [c] != expected})
        for v in values
        if sorted(set(v["steps_after"].values())) != expected
    }
    figures = {
        "shared_step_parameters": len(first["shared"]),
        "steps_after": sorted(set(first["steps_after"].values())),
        "unbroken_steps": expected,
    }
    if not wrong:
        return Verdict(
            True,
            f"fsdp1 {spec.name}: FSDP1's full optimizer state dict written with torch.save, "
            "loaded into one unsharded process (set_optimizer_state_dict): every parameter's "
            f"AdamW step count after the next step is the unbroken run's ({expected})",
            figures,
        )
    shared = first["shared"]
    return Verdict(
        False,
        "FSDP1's full optimizer state dict (FSDP.optim_state_dict) gives the parameters of each "
        f"flat parameter one shared AdamW step tensor ({len(shared)} parameters, e.g. "
        f"{', '.join(shared[:2])}) and torch.save keeps the sharing: loaded into one unsharded "
        "process with set_optimizer_state_dict, AdamW advances it once per parameter each "
        f"step: step counts {figures['steps_after']} after one step from "
        f"{first['saved_steps']}, the unbroken run's {expected} (ranks "
        f"{', '.join(map(str, sorted(wrong)))}): torch {torch.__version__}",
        figures,
    )
