"""``stack.meshes.hsdp`` / ``stack.meshes.replicated``: HSDP on a 2-D device mesh (replicate x
shard) trains as the single-process reference does, every replica ends each step with the same
parameters, and the gradients travel as HSDP sends them.

The mesh is the user's ``init_device_mesh(device_type, (r, s), mesh_dim_names=("replicate",
"shard"))``; FSDP2 takes it as ``fully_shard(..., mesh=mesh)``, FSDP1 as
``FullyShardedDataParallel(..., sharding_strategy=HYBRID_SHARD or _HYBRID_SHARD_ZERO2,
device_mesh=mesh)`` (both strategies in one run).

* ``hsdp``: the meshes with both dimensions above 1 (``(2, world / 2)`` at world size 4), and
  ``(1, world)``: one replica, HSDP degenerate to full sharding.
* ``replicated``: ``(world, 1)``: every rank a replica of its own one-rank shard group, the mesh
  on which FSDP1's ``HYBRID_SHARD`` dropped the replicas' all-reduce (pytorch/pytorch#154888).

Each run trains :data:`STEPS` plain SGD steps on both sides and proves, per mesh and strategy:
every rank's loss and every step's update equal the reference's (:class:`SliceReference` over
all ranks' slices); every rank's full parameters after each step are bitwise the same (the
replicas did not diverge); in backward, each unit's gradient reduce-scattered on this rank's
shard group (where it has more than one rank) and all-reduced on its replicate group (where it
has more than one rank), and reduced on no other group of several ranks. The user's code is
this module's steps (:func:`make_mesh`, :func:`shard_with_mesh`), which faults may patch; the
negative control patches torch's ``all_reduce``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.faults import Fault, FaultTable, patched
from fsdp_conformance.claims.stack.common import (
    LR,
    STEPS,
    build_side,
    parity_problems,
)
from fsdp_conformance.fsdp.collectives import record_collectives, unit_sizes
from fsdp_conformance.fsdp.reference_step import (
    TensorComparison,
    full_params,
    model_loss,
    observe_update,
    reference_params,
    reported_dtype,
    sgd_step,
)
from fsdp_conformance.fsdp.sharding import check_fsdp_version, shard
from fsdp_conformance.fsdp.tensors import state_digest
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import ModelSpec

#: FSDP1's hybrid strategies, both run on every mesh (torch's ``ShardingStrategy`` names).
FSDP1_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
LAYOUTS = ("hsdp", "replicated")


def mesh_shapes(world_size: int, layout: str) -> list[tuple[int, int]]:
    """The (replicate, shard) meshes a layout runs at ``world_size``."""
    if layout == "replicated":
        return [(world_size, 1)]
    if layout != "hsdp":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    both = [(r, world_size // r) for r in range(2, world_size) if world_size % r == 0]
    return both[:1] + [(1, world_size)]


# --------------------------------------------------------------------------------------------
# The user's code
# --------------------------------------------------------------------------------------------


def make_mesh(ctx: RankContext, shape: tuple[int, int]) -> Any:
    """The user's 2-D mesh: ``shape`` (replicate, shard) ranks, the dimensions named."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device_type, shape, mesh_dim_names=("replicate", "shard"))


def shard_with_mesh(
    model: nn.Module, ctx: RankContext, version: str, strategy: str, mesh: Any, policy: Any
) -> nn.Module:
    """The user's HSDP call: FSDP2 ``fully_shard(mesh=mesh)`` on the policy's units then the
    root; FSDP1 ``FullyShardedDataParallel(sharding_strategy=strategy, device_mesh=mesh)``."""
    if version == "fsdp2":
        return shard(model, ctx, version, policy, mesh=mesh)
    from torch.distributed.fsdp import ShardingStrategy

    return shard(
        model,
        ctx,
        version,
        policy,
        sharding_strategy=ShardingStrategy[strategy],
        device_mesh=mesh,
    )


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


def _group_all_reduce_dropped(original: Any) -> Any:
    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if group is not None:
            return None  # the replicas' all-reduce FSDP issues on its replicate group
        return original(tensor, *args, **kwargs)

    return all_reduce


FAULTS = FaultTable(
    dropped_all_reduce=Fault(
        "torch.distributed.all_reduce on a named process group does nothing (FSDP's all-reduce "
        "across the replicate group): each replica keeps its own shard group's gradient",
        lambda ctx: patched(dist, "all_reduce", _group_all_reduce_dropped),
    ),
)

# --------------------------------------------------------------------------------------------
# The rank function
# --------------------------------------------------------------------------------------------


class MeshRun(TypedDict):
    """One mesh and strategy on a rank."""

    #: (replicate, shard) ranks, and this rank's two groups (global ranks).
    mesh: list[int]
    strategy: str
    #: The dtype both sides ran in (the model's own).
    dtype: str
    shard_group: list[int]
    replicate_group: list[int]
    #: This rank's loss per step, and the reference's of the same slice.
    losses: list[float]
    ref_losses: list[float]
    #: Each step's update against the reference's.
    updates: list[TensorComparison]
    #: A digest of the full parameters after each step (bitwise: equal on every rank).
    digests: list[str]
    #: Per step, the gradient reductions issued in backward: "<op> <group ranks>".
    reductions: list[list[str]]
    #: The units holding parameters (each reduces its gradients once per step).
    units: int


class MeshesResult(TypedDict):
    """A rank's runs, one per mesh and strategy."""

    rank: int
    version: str
    world_size: int
    layout: str
    dtype: str
    runs: list[MeshRun]


def _groups(mesh: Any) -> tuple[list[int], list[int]]:
    return (
        list(dist.get_process_group_ranks(mesh.get_group("shard"))),
        list(dist.get_process_group_ranks(mesh.get_group("replicate"))),
    )


def _train(
    ctx: RankContext, spec: ModelSpec, version: str, strategy: str, shape: tuple[int, int]
) -> MeshRun:
    meshes: list[Any] = []

    def shard_on_mesh(model: nn.Module, policy: Any) -> nn.Module:
        meshes.append(make_mesh(ctx, shape))
        return shard_with_mesh(model, ctx, version, strategy, meshes[0], policy)

    side = build_side(ctx, spec, shard_on_mesh)
    sharded, reference, dtype, mesh = side.sharded, side.reference, side.dtype, meshes[0]
    shard_group, replicate_group = _groups(mesh)
    run: MeshRun = {
        "mesh": list(shape),
        "strategy": strategy,
        "dtype": str(dtype),
        "shard_group": shard_group,
        "replicate_group": replicate_group,
        "losses": [],
        "ref_losses": [],
        "updates": [],
        "digests": [],
        "reductions": [],
        "units": len(unit_sizes(sharded, version, shape[1])),
    }
    for step in range(STEPS):
        before = full_params(sharded, version, dtype)
        ref_before = reference_params(reference.model, dtype)
        with record_collectives(groups=True) as recorder:
            loss = model_loss(sharded, side.batches[step][ctx.rank])
            loss.backward()
        run["reductions"].append(
            [
                f"{r['op']} {r['group']}"
                for r in recorder.records
                if r["op"] in ("reduce_scatter", "all_reduce")
            ]
        )
        run["losses"].append(float(loss))
        run["ref_losses"].append(reference.forward_backward(side.batches[step])[ctx.rank])
        sgd_step(sharded, LR)
        sgd_step(reference.model, LR)
        after = full_params(sharded, version, dtype)
        run["digests"].append(state_digest(after))
        seen = observe_update(after, before, reference.model, ref_before, dtype)
        run["updates"].append(seen["comparison"])
    return run


def rank_meshes(
    ctx: RankContext,
    spec: ModelSpec,
    version: str = "fsdp2",
    layout: str = "hsdp",
    fault: str | Sequence[str] | None = None,
) -> MeshesResult:
    """Each mesh of ``layout`` at this world size, each strategy of ``version``: the model
    sharded on it and trained :data:`STEPS` steps beside the reference."""
    check_fsdp_version(version)
    shapes = mesh_shapes(ctx.world_size, layout)
    strategies = FSDP1_STRATEGIES if version == "fsdp1" else ("fully_shard",)
    with FAULTS.inject(fault, ctx):
        runs = [_train(ctx, spec, version, s, shape) for shape in shapes for s in strategies]
    return {
        "rank": ctx.rank,
        "version": version,
        "world_size": ctx.world_size,
        "layout": layout,
        "dtype": runs[0]["dtype"],
        "runs": runs,
    }


# --------------------------------------------------------------------------------------------
# The verdict
# --------------------------------------------------------------------------------------------


def _label(run: MeshRun) -> str:
    r, s = run["mesh"]
    return f"mesh ({r}, {s}) {run['strategy']}"


def _parity_problems(rank: int, run: MeshRun, dtype: torch.dtype) -> list[str]:
    label = f"{_label(run)}: rank {rank}"
    return parity_problems(label, run["losses"], run["ref_losses"], run["updates"], dtype)


def _collective_problems(rank: int, run: MeshRun) -> list[str]:
    """Per step: ``units`` reduce-scatters on the shard group and ``units`` all-reduces on the
    replicate group (each only where that group has several ranks), and no reduction on another
    group of several ranks."""
    expected = []
    if len(run["shard_group"]) > 1:
        expected.append(f"reduce_scatter {run['shard_group']}")
    if len(run["replicate_group"]) > 1:
        expected.append(f"all_reduce {run['replicate_group']}")
    problems = []
    for step, issued in enumerate(run["reductions"]):
        where = f"{_label(run)}: rank {rank}: step {step} backward"
        for want in expected:
            count = issued.count(want)
            if count != run["units"]:
                problems.append(
                    f"{where}: {count} {want.split(' ', 1)[0].replace('_', '-')}(s) on group "
                    f"{want.split(' ', 1)[1]} for {run['units']} units"
                    + (": the gradients were not reduced across the replicas" * (count == 0))
                )
        others = sorted({i for i in issued if i not in expected and i.count(",") > 0})
        if others:
            problems.append(f"{where}: gradient reductions on other groups: {', '.join(others)}")
    return problems


def _replica_problems(values: Sequence[MeshesResult], index: int) -> list[str]:
    problems = []
    run = values[0]["runs"][index]
    for step in range(len(run["digests"])):
        digests = {v["rank"]: v["runs"][index]["digests"][step] for v in values}
        if len(set(digests.values())) > 1:
            groups: dict[str, list[int]] = {}
            for rank, digest in digests.items():
                groups.setdefault(digest, []).append(rank)
            problems.append(
                f"{_label(run)}: step {step}: the replicas diverged: the full parameters differ "
                f"across ranks (ranks holding the same values: "
                f"{', '.join(str(g) for g in groups.values())})"
            )
            break
    return problems


def verdict_meshes(values: Sequence[MeshesResult], params: Mapping[str, Any]) -> Verdict:
    """Every mesh and strategy: parity on every rank, the replicas bitwise equal after every
    step, the gradients reduced on the shard and replicate groups."""
    dtype = reported_dtype(values[0]["dtype"])
    problems: list[str] = []
    for index in range(len(values[0]["runs"])):
        problems += _replica_problems(values, index)
        for v in values:
            problems += _parity_problems(v["rank"], v["runs"][index], dtype)
            problems += _collective_problems(v["rank"], v["runs"][index])
    runs = values[0]["runs"]
    worst = max((c["max_rel"] for v in values for r in v["runs"] for c in r["updates"]), default=0)
    figures = {
        "update_rel_diff": worst,
        "meshes": [_label(r) for r in runs],
        "steps": STEPS,
        "dtype": values[0]["dtype"],
    }
    # the first step's gradient reductions per mesh, counted by op and group (rank 0's)
    data = {_label(r): dict(Counter(r["reductions"][0])) for r in runs}
    what = ", ".join(_label(r) for r in runs)
    if problems:
        return Verdict(
            False,
            f"HSDP ({what}) differs from the reference:\n  " + "\n  ".join(dict.fromkeys(problems)),
            figures,
            data,
        )
    return Verdict(
        True,
        f"{what}: {STEPS} steps, every update equals the reference's (worst {worst:.1e}), the "
        "replicas bitwise equal after every step, each unit's gradient reduce-scattered on its "
        "shard group and all-reduced on its replicate group where those have several ranks",
        figures,
        data,
    )
