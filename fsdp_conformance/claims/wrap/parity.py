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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

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
