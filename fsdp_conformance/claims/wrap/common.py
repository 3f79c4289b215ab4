"""What the wrap families share: the model built from the seed and wrapped under a policy, the
units and strategies torch built read back, the dtypes it computes in recorded; the unit set the
claim asks for (:func:`expected_units`), written from the claim itself; and what ``wrap.train``'s
sharded weights are compared with, and what a difference says.

The family modules call the steps by their module-level names, so a fault of a family
(:func:`fsdp_conformance.claims.faults.patched_attr`) can patch, in that family's module only,
the step it breaks.

The expected unit set is derived *from the claim*, not by running a policy: a policy that is
wrong in the same way as its own plan is still caught.

What ``wrap.train``'s sharded weights are compared with, and what a difference says.

The comparison is per tensor, relative to the tensor's own update (a weight that missed its
gradient reduction is off by a fraction of its, maybe tiny, update), with one floor below which
a tensor's update is rounding, not signal (docs/wrapping.md, "Tensors whose update is
rounding"): a tensor whose true gradient is zero, such as an attention key bias (softmax ignores
a constant added to every score of a query: ViT and BERT measured 2.1e-11 against 7e-5 to 1e-1
for the block's other tensors), has an update that is rounding noise on both sides, and noise
divided by noise is anything. Below ``negligible`` times the model's largest update, a tensor is
judged against that floor instead of its own update: a difference beyond rounding still fails.

A diagnosis is stated only where the figures support it: the update factor of the whole model
(least squares; the world size when gradients were summed) and of the worst tensor (0 when its
update never reached it).

The bf16 reference (:class:`MixedPrecisionReference`) repeats FSDP's mixed-precision arithmetic
in one process (docs/wrapping.md, "bf16 parity").
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.fsdp.reference_step import RankBuffers
from fsdp_conformance.fsdp.sharding import fsdp1_full_precision_hooks, fsdp1_options, shard
from fsdp_conformance.harness import RankContext
from fsdp_conformance.models.model_spec import BuiltModel, ModelSpec, call_model, default_loss
from fsdp_conformance.models.units import ROOT, UnitInfo, clean_fqn, planned_unit_modules

#: Containers with no forward of their own: FSDP1 cannot gather around them, and torch's size
#: policy never wraps them (``exclude_wrap_modules``), so the claim never expects them as units.
CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict)

#: How close (relative) an update factor must be to a named cause for the message to name it.
FACTOR_MATCH_RTOL = 0.02


class RankUnits(TypedDict):
    """What a rank reports of the units torch built (``UnitInfo.to_dict`` each), with its rank
    and world size; each family's result adds its own fields."""

    rank: int
    world_size: int
    actual: list[dict[str, Any]]


def build(spec: ModelSpec, ctx: RankContext, seed: int = 0) -> BuiltModel:
    """``spec``'s model from ``seed``: the same model on every rank."""
    torch.manual_seed(seed)
    return spec.instantiate(ctx.device)


def shard_with_policy(
    model: nn.Module, ctx: RankContext, version: str, policy_obj: Any, **kwargs: Any
) -> nn.Module:
    """``model`` sharded under ``policy_obj`` as a user writes it (FSDP1 with the options its
    plan needs, :func:`fsdp1_options`)."""
    if version == "fsdp1":
        kwargs = {**fsdp1_options(model, planned_unit_modules(model, policy_obj)), **kwargs}
    return shard(model, ctx, version, policy_obj, **kwargs)


def fsdp1_strategies(sharded: nn.Module) -> dict[str, str]:
    """Each FSDP1 unit's sharding strategy, by unit name."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return {
        clean_fqn(n): _compat.fsdp1_sharding_strategy(m)
        for n, m in sharded.named_modules()
        if isinstance(m, FSDP)
    }


def units_of(value: Mapping[str, Any], key: str) -> list[UnitInfo]:
    """The units a rank reported under ``key``, as :class:`UnitInfo`."""
    return [UnitInfo.from_dict(d) for d in value[key]]


def _output_dtype(output: Any) -> str | None:
    """The dtype of the first floating tensor a forward returned (None: it returned none)."""
    for leaf in _compat.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and torch.is_floating_point(leaf):
            return str(leaf.dtype)
    return None


@contextlib.contextmanager
def record_compute_dtypes(
    model: nn.Module,
    seen: dict[str, tuple[str, str]],
    also: Sequence[str] = (),
    outputs: dict[str, str] | None = None,
) -> Iterator[None]:
    """Record, per module with a matrix ``weight`` of its own (Linear, Embedding, and the like:
    GPT-2's ``Conv1D``), the (input, weight) dtypes its forward actually sees; and for the
    modules named in ``also`` (a LayerNorm the mixed configuration puts in an fp32 unit), the
    (input, first own parameter) dtypes. ``outputs``: the same modules' output dtypes (the
    first floating tensor each returns), what the module computed in: an embedding's input is
    indices, whatever their dtype (positions computed from an attention mask arrive as floats),
    so its input says nothing of its compute dtype, while its weight and output do.

    Registered on the original modules: under FSDP their ``weight`` during forward is the
    unsharded (and, with mixed precision, cast) parameter, so this is the compute dtype.
    """
    handles = []
    for raw_name, module in model.named_modules():
        name = clean_fqn(raw_name)  # FSDP1 inserts its wrapper into the module names
        own = dict(module.named_parameters(recurse=False))
        weight = own.get("weight")
        if isinstance(module, (nn.Linear, nn.Embedding)) or (
            weight is not None and weight.dim() >= 2
        ):
            attr = "weight"
        elif name in also and own:
            attr = next(iter(own))
        else:
            continue

        def pre(mod: nn.Module, args: tuple[Any, ...], name: str = name, attr: str = attr) -> None:
            if name not in seen and args and isinstance(args[0], torch.Tensor):
                seen[name] = (str(args[0].dtype), str(getattr(mod, attr).dtype))

        def post(mod: nn.Module, args: Any, output: Any, name: str = name) -> None:
            dtype = _output_dtype(output)
            if outputs is not None and name not in outputs and dtype is not None:
                outputs[name] = dtype

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------
# The claim, as an independent specification
# --------------------------------------------------------------------------------------------


def expected_units(
    model: nn.Module, block_classes: Sequence[type[nn.Module]], min_params: int
) -> list[UnitInfo]:
    """The unit set the claim asks for, derived from the claim (no policy is run).

    1. Every block (an instance of a block class not inside another block) is one unit.
    2. Outside the blocks, a module (not the root, not a container) is a unit when the
       parameters in its subtree that are in no block and no unit below it number at least
       ``min_params``, unless it holds a parameter shared with a module outside its subtree:
       wrapping it would split the tied weight, so that weight stays with the enclosing unit.
    3. Nothing else; everything left belongs to the root.

    Each parameter is counted once, in the innermost unit whose subtree holds every module
    that uses it.
    """
    blocks = tuple(block_classes)
    names = {id(m): n for n, m in model.named_modules()}
    holders: dict[int, set[int]] = {}  # param id -> ids of modules holding it directly
    params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(module))
            params[id(p)] = p
    subtree = {id(m): {id(s) for s in m.modules()} for m in model.modules()}

    unit_ids: list[int] = []  # post-order

    def visit(module: nn.Module, in_block: bool) -> set[int]:
        """Returns ids of params in this subtree not yet taken by a unit (outside blocks)."""
        if module is not model and not in_block and isinstance(module, blocks):
            for child in module.children():
                visit(child, True)
            unit_ids.append(id(module))
            return set()
        free: set[int] = set()
        for child in module.children():
            free |= visit(child, in_block)
        if in_block:
            return set()
        free |= {id(p) for p in module.parameters(recurse=False)}
        splits_tie = any(not holders[pid] <= subtree[id(module)] for pid in free)
        big = sum(params[pid].numel() for pid in free) >= min_params
        if module is not model and big and not splits_tie and not isinstance(module, CONTAINERS):
            unit_ids.append(id(module))
            return set()
        return free

    visit(model, False)
    unit_ids.append(id(model))
    return _assign_params(model, unit_ids, names, holders, params, subtree)


def _assign_params(
    model: nn.Module,
    unit_ids: Sequence[int],
    names: Mapping[int, str],
    holders: Mapping[int, set[int]],
    params: Mapping[int, nn.Parameter],
    subtree: Mapping[int, set[int]],
) -> list[UnitInfo]:
    depth = {uid: (names[uid].count(".") + 1 if names[uid] else 0) for uid in unit_ids}
    first_name: dict[int, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), fqn)
    owned: dict[int, list[int]] = {uid: [] for uid in unit_ids}
    for pid, mods in holders.items():
        owner = max((u for u in unit_ids if mods <= subtree[u]), key=lambda u: depth[u])
        owned[owner].append(pid)
    units = []
    for uid in unit_ids:
        fqn = names[uid]
        parent = None
        if uid != id(model):
            enclosing = [u for u in unit_ids if u != uid and uid in subtree[u]]
            parent = names[max(enclosing, key=lambda u: depth[u])]
        units.append(
            UnitInfo(
                fqn=fqn,
                cls=type(_module_at(model, fqn)).__name__,
                numel=sum(params[pid].numel() for pid in owned[uid]),
                parent=parent,
                params=tuple(sorted(first_name[pid] for pid in owned[uid])),
            )
        )
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(units, key=lambda u: (u.fqn != ROOT, order.get(u.fqn, 0)))


def _module_at(model: nn.Module, fqn: str) -> nn.Module:
    return model.get_submodule(fqn) if fqn else model


# --------------------------------------------------------------------------------------------
# wrap.train's comparison with its reference
# --------------------------------------------------------------------------------------------


def compare_updates(
    full: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    initial: Mapping[str, torch.Tensor],
    negligible: float,
) -> dict[str, Any]:
    """The sharded model's ``full`` weights against the ``reference``'s (both after the steps,
    by name, every alias of a tied tensor present in ``reference`` and ``initial``).

    Returns the worst absolute difference and its tensor; the worst difference relative to the
    tensor's update or the floor (``negligible`` of the model's largest update), its tensor,
    that tensor's update as a share of the model's largest and its own update factor (None when
    its update is rounding); the model's update factor (least squares over every tensor: 1 when
    they agree, the world size when gradients were summed); the model's largest update; and the
    tensors whose update is rounding (below the floor).
    """
    updates = {n: reference[n].detach().float() - initial[n] for n in full if full[n].numel()}
    scale = max((float(u.abs().max()) for u in updates.values()), default=0.0)
    out: dict[str, Any] = {
        "max_param_diff": 0.0,
        "worst_param": "",
        "max_update_rel_diff": 0.0,
        "worst_update_param": "",
        "worst_update_share": 0.0,
        "worst_tensor_factor": None,
        "update_scale": scale,
        "below_rounding": [],
    }
    along, ref_norm = 0.0, 0.0  # the sharded update projected on the reference's, and its norm
    for name, ref_update in updates.items():
        target = reference[name].detach().float()
        diff = float((full[name] - target).abs().max())
        moved = full[name] - initial[name]
        along += float((moved * ref_update).sum())
        ref_norm += float((ref_update * ref_update).sum())
        update = float(ref_update.abs().max())
        floor = negligible * scale
        rounding = update < floor
        if rounding:
            out["below_rounding"].append(name)
        rel = diff / max(update, floor) if max(update, floor) > 0 else 0.0
        if diff > out["max_param_diff"]:
            out["max_param_diff"], out["worst_param"] = diff, name
        if rel > out["max_update_rel_diff"]:
            norm = float((ref_update * ref_update).sum())
            out.update(
                max_update_rel_diff=rel,
                worst_update_param=name,
                worst_update_share=update / scale if scale > 0 else 0.0,
                worst_tensor_factor=(
                    float((moved * ref_update).sum()) / norm if norm and not rounding else None
                ),
            )
    out["update_factor"] = along / ref_norm if ref_norm > 0 else None
    return out


def update_diagnosis(factor: float | None, world_size: int, lost: bool = False) -> str:
    """What the scale between the sharded and the reference update says, in words.

    Summed instead of averaged gradients scale every update by the world size; averaged twice,
    by its inverse; a gradient never applied, by 0. Any other factor is named as measured.
    ``lost``: the worst tensor's own update never reached it (:func:`tensor_diagnosis`), so a
    model-wide factor of 1 says the rest agrees, not that the difference is in a direction.
    """
    if factor is None:
        return "the reference made no update to compare with"
    causes = (
        []
        if world_size == 1
        else [  # at one rank a sum is the mean
            (
                float(world_size),
                f"= the world size ({world_size}): gradients summed across ranks, not averaged",
            ),
            (1.0 / world_size, f"= 1 / the world size ({world_size}): gradients averaged twice"),
        ]
    )
    causes += [
        (
            1.0,
            "the same scale: the difference is in the direction (a permuted shard, a "
            "gradient reduced over the wrong ranks or elements)",
        ),
    ]
    head = f"the sharded update is {factor:.2f}x the reference's (least squares over all weights)"
    if abs(factor) < FACTOR_MATCH_RTOL:
        return f"{head}: no update reached the weights (gradients lost or never applied)"
    for value, cause in causes:
        if abs(factor - value) <= FACTOR_MATCH_RTOL * value:
            if lost and value == 1.0:
                return head
            return f"{head} {cause}" if cause.startswith("=") else f"{head}: {cause}"
    return head


def update_lost(tensor_factor: float | None) -> bool:
    """Whether the worst tensor's own update factor says no update reached it."""
    return tensor_factor is not None and abs(tensor_factor) < FACTOR_MATCH_RTOL


def tensor_diagnosis(name: str, share: float, tensor_factor: float | None) -> str:
    """What the worst tensor's own figures say: its update's share of the model's largest, and
    its own update factor where its update is above rounding."""
    said = f"{name}'s update is {share:.1e} of the model's largest"
    if tensor_factor is None:
        return said + " (at rounding level: judged against the floor)"
    said += f", and its sharded update {tensor_factor:.2f}x the reference's"
    if update_lost(tensor_factor):
        said += ": no update reached it (its gradient lost, or the tensor never stepped)"
    return said


# --------------------------------------------------------------------------------------------
# The bf16 reference: FSDP's mixed-precision arithmetic in one process
# --------------------------------------------------------------------------------------------


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``value`` (nested tuples, lists, mappings) cast to ``dtype``: what
    FSDP's ``_cast_forward_inputs`` does to a unit's arguments."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if torch.is_floating_point(value) else value
    if isinstance(value, Mapping):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    return value


class _UnitInputs(torch.autograd.Function):
    """The identity on a unit's grad-requiring arguments, as FSDP2's
    ``RegisterPostBackwardFunction`` (torch 2.13, ``_fsdp_param_group``): one node for all of
    them, so the gradient of an argument used twice inside the unit is summed there first, and
    only that sum is added to the gradients of the argument's other uses. In bf16 the grouping
    rounds differently from a plain graph (docs/wrapping.md, "bf16 parity")."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


def _unit_inputs(arguments: tuple[Any, Any]) -> tuple[Any, Any]:
    """``arguments`` (args, kwargs) with every tensor that needs a gradient passed through one
    :class:`_UnitInputs` node (in grad mode only, as FSDP2)."""
    needing = [
        t for t in _compat.tree_leaves(arguments) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if not needing or not torch.is_grad_enabled():
        return arguments
    replaced = iter(_UnitInputs.apply(*needing))  # type: ignore[no-untyped-call]
    swapped: tuple[Any, Any] = _compat.tree_map(
        lambda t: next(replaced) if isinstance(t, torch.Tensor) and t.requires_grad else t,
        arguments,
    )
    return swapped


def gradient_divide_factors(version: str, world_size: int) -> tuple[float, float]:
    """(pre, post) division of the gradient around the bf16 reduction, as torch 2.13 does it.

    FSDP1 (``_init_utils``, ``DefaultState._get_gradient_predivide_factor``): the gradient is
    divided by the smallest power of two ``f`` with ``f >= world_size / f`` before the
    reduce-scatter (a sum) and by ``world_size / f`` after it. FSDP2
    (``_fsdp_collectives._get_gradient_divide_factors``): for a bf16 or fp32 reduce dtype and no
    ``gradient_divide_factor``, one ``ReduceOp.AVG`` reduce-scatter: the sum divided by the
    world size.
    """
    if version == "fsdp2":
        return 1.0, float(world_size)
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


class MixedPrecisionReference:
    """The single-process reference computing as FSDP's bf16 mixed precision does.

    FSDP (both versions, torch 2.13; docs/wrapping.md, "bf16 parity") keeps fp32 master
    weights, casts a bf16 copy for forward and backward, casts floating inputs to bf16 at the
    root (FSDP1, ``cast_root_forward_inputs``; at every unit too with ``cast_forward_inputs``,
    the FSDP1 run ``sharding.with_known_fix`` retries) or at every unit (FSDP2,
    ``cast_forward_inputs``,
    then one identity autograd node over the unit's arguments that need a gradient:
    :class:`_UnitInputs`), FSDP1 also casts floating buffers (``buffer_dtype``), reduces each
    rank's bf16 gradient in bf16 divided by :func:`gradient_divide_factors`, casts the reduced
    gradient to fp32 and steps on the fp32 master. The reference repeats each of these steps
    for every rank's slice of the batch in this one process. The ranks' bf16 gradients are
    summed in the order gloo's ring reduce-scatter sums them (measured on torch 2.13: the chunk
    that rank ``k`` receives is ``((g[k-1] + g[k-2]) + ...) + g[k]``, ranks modulo the world
    size, rounded to bf16 after each addition), element by element according to ``owners``
    (``train.element_owners``).
    """

    def __init__(
        self,
        master: nn.Module,
        version: str,
        unit_names: Sequence[str],
        owners: Mapping[str, torch.Tensor],
        cast_forward_inputs: bool = False,
        full_units: Sequence[str] = (),
    ) -> None:
        self.master, self.version, self.owners = master, version, owners
        self.low = copy.deepcopy(master)
        modules = dict(self.low.named_modules())
        # Full-precision units (a _BatchNorm: FSDP2's fix, sharding.with_known_fix, or FSDP1's
        # default, sharding.fsdp1_full_precision_units): fp32 parameters, the gradient reduced
        # in fp32; FSDP2 passes their inputs as they come, FSDP1 casts them to fp32 and back.
        full = {id(p) for n in full_units for p in modules[n].parameters()}
        self.full = {n for n, p in self.low.named_parameters() if id(p) in full}
        for p in self.low.parameters():
            if id(p) not in full:
                p.data = p.data.to(torch.bfloat16)
        if version == "fsdp1":  # buffer_dtype, per unit: a full-precision unit keeps its own
            kept = {id(b) for n in full_units for b in modules[n].buffers()}
            for b in self.low.buffers():
                if torch.is_floating_point(b) and id(b) not in kept:
                    b.data = b.data.to(torch.bfloat16)
        # Each rank's buffers from its own slices (FSDP never synchronises them).
        self.rank_buffers = RankBuffers(self.low)
        # FSDP1 casts the root unit's inputs (``cast_root_forward_inputs``), every unit's with
        # ``cast_forward_inputs=True`` (``_pre_forward``: a cast, no identity node); FSDP2 casts
        # every unit's and passes them through one identity node.
        hook = self._fsdp2_unit_inputs if version == "fsdp2" else self._cast_inputs
        cast_units = version == "fsdp2" or cast_forward_inputs
        for name in dict.fromkeys(["", *unit_names] if cast_units else [""]):
            modules[name].register_forward_pre_hook(hook, with_kwargs=True)
        for name in full_units:
            if version == "fsdp1":  # torch's _override_module_mixed_precision hooks
                fsdp1_full_precision_hooks(modules[name])
                continue
            modules[name].register_forward_pre_hook(
                lambda _, args, kwargs: _unit_inputs((args, kwargs)), with_kwargs=True
            )

    @staticmethod
    def _cast_inputs(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        return _cast_floats(args, torch.bfloat16), _cast_floats(kwargs, torch.bfloat16)

    @staticmethod
    def _fsdp2_unit_inputs(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        """What FSDP2's pre-forward does to a unit's arguments: cast (``cast_forward_inputs``),
        then every one that needs a gradient through one identity autograd node
        (``_register_post_backward_hook``), which sums each argument's gradient within the unit
        before it meets the gradients of its other uses (:class:`_UnitInputs`)."""
        return _unit_inputs(
            (_cast_floats(args, torch.bfloat16), _cast_floats(kwargs, torch.bfloat16))
        )

    def step(self, slices: Sequence[Any], lr: float) -> float:
        """One step on the ranks' ``slices``; returns the mean of their losses (what the
        FSDP side reports)."""
        with torch.no_grad():
            for low, master in zip(self.low.parameters(), self.master.parameters()):
                low.copy_(master)
        grads: list[list[torch.Tensor | None]] = []
        losses = []
        for rank, rows in enumerate(slices):
            with self.rank_buffers.as_rank(rank):
                loss = default_loss(call_model(self.low, rows))
                loss.backward()
            losses.append(float(loss))
            grads.append([p.grad for p in self.low.parameters()])
            self.low.zero_grad(set_to_none=True)
        world = len(slices)
        pre, post = gradient_divide_factors(self.version, world)
        with torch.no_grad():
            for i, (name, master) in enumerate(self.master.named_parameters()):
                if any(g[i] is None for g in grads):
                    continue
                owner = self.owners[name]
                dtype = torch.float32 if name in self.full else torch.bfloat16
                reduced = torch.zeros_like(master, dtype=dtype)
                for k in owner.unique().tolist():
                    order = [(k - 1 - j) % world for j in range(world)]  # k-1, k-2, ..., k
                    total = grads[order[0]][i] / pre
                    for r in order[1:]:
                        total = total + grads[r][i] / pre
                    reduced = torch.where(owner == k, total, reduced)
                master.add_((reduced / post).float(), alpha=-lr)
        return sum(losses) / len(losses)
