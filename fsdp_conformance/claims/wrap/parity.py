"""What ``wrap.train``'s sharded weights are compared with, and what a difference says.

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

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance import _compat
from fsdp_conformance.models.model_spec import call_model, default_loss

#: How close (relative) an update factor must be to a named cause for the message to name it.
FACTOR_MATCH_RTOL = 0.02


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
    the FSDP1 run ``sharding.with_fsdp1_input_casts`` retries) or at every unit (FSDP2,
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
    ) -> None:
        self.master, self.version, self.owners = master, version, owners
        self.low = copy.deepcopy(master)
        for p in self.low.parameters():
            p.data = p.data.to(torch.bfloat16)
        if version == "fsdp1":
            for b in self.low.buffers():
                if torch.is_floating_point(b):
                    b.data = b.data.to(torch.bfloat16)
        modules = dict(self.low.named_modules())
        # FSDP1 casts the root unit's inputs (``cast_root_forward_inputs``), every unit's with
        # ``cast_forward_inputs=True`` (``_pre_forward``: a cast, no identity node); FSDP2 casts
        # every unit's and passes them through one identity node.
        hook = self._fsdp2_unit_inputs if version == "fsdp2" else self._cast_inputs
        cast_units = version == "fsdp2" or cast_forward_inputs
        for name in dict.fromkeys(["", *unit_names] if cast_units else [""]):
            modules[name].register_forward_pre_hook(hook, with_kwargs=True)

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
        for rows in slices:
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
                reduced = torch.zeros_like(master, dtype=torch.bfloat16)
                for k in owner.unique().tolist():
                    order = [(k - 1 - j) % world for j in range(world)]  # k-1, k-2, ..., k
                    total = grads[order[0]][i] / pre
                    for r in order[1:]:
                        total = total + grads[r][i] / pre
                    reduced = torch.where(owner == k, total, reduced)
                master.add_((reduced / post).float(), alpha=-lr)
        return sum(losses) / len(losses)
