"""The planner's activation working set per unit (docs/planning.md, "Per unit"): what the meta
backward records while each unit runs, and how the bound takes the working set and the
recomputed unit at the one unit where their sum is largest.

The profile side runs a small model on meta whose blocks keep a known number of temporaries
alive at once; the bound side feeds hand-made profiles to ``per_layer_bound``. No ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance.measure.bound import ActivationProfile, Bound, StepConfig, per_layer_bound
from fsdp_conformance.measure.profile import profile_activations
from fsdp_conformance.models.units import UnitInfo

BATCH, WIDTH = 4, 64
#: Bytes of one activation of the model below (fp32, batch x width).
X = BATCH * WIDTH * 4


class Temporaries(nn.Module):
    """Makes ``alive`` elementwise temporaries that are alive at once and saves none of them
    (adding or multiplying by a Python number saves nothing for backward); its linear saves
    the last one (its input)."""

    def __init__(self, alive: int) -> None:
        super().__init__()
        self.alive = alive
        self.lin = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = [x + 1]
        for _ in range(self.alive - 1):
            kept.append(kept[-1] * 2)
        last = kept.pop() * 3  # the linear's input: saved, not working set
        del kept
        out: torch.Tensor = self.lin(last)
        return out


class TwoBlocks(nn.Module):
    """Two blocks with a unit between them that makes nothing (``idle``)."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = Temporaries(1)
        self.idle = nn.Identity()
        self.wide = Temporaries(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.wide(self.idle(self.narrow(x)))
        return out


def _profile() -> ActivationProfile:
    """The step on meta with each block a unit (its linear in it), as a policy wraps them."""
    with torch.device("meta"):
        model = TwoBlocks()
    units = [
        UnitInfo(fqn=n, cls=type(model.get_submodule(n)).__name__, numel=0)
        for n in ("", "narrow", "idle", "wide")
    ]
    batch = torch.empty(BATCH, WIDTH, device="meta")
    return profile_activations(model, batch, units, count_flops=False, backward=True)


def test_a_units_forward_working_set_is_what_it_keeps_alive_at_once() -> None:
    acts = _profile()
    # What each block's own forward makes alive at once: its temporaries (the last, the
    # linear's input, is saved); then its output, which is not saved after the narrow block
    # (adding a number saves nothing) and is after the wide one (the loss squares it). Three
    # at once in the wide block; the root's span holds both blocks.
    assert acts.forward_local_by_unit["narrow"] == X
    assert acts.forward_local_by_unit["wide"] == 3 * X
    assert acts.forward_local_by_unit[""] == 4 * X  # the narrow block's output, then 3
    assert acts.forward_local_by_unit["idle"] == 0  # runs no op: its span ends where it starts
    # No parameter, buffer or input is the step's: the transposed weight each linear uses,
    # 16 x X here, is in no figure (it would be, were views of parameters counted).
    assert acts.working_forward_bytes is not None and acts.working_forward_bytes < 16 * X
    # While a block runs the step's working set is at least its own; the step's is the most
    # of its units'.
    for unit in ("narrow", "wide"):
        fwd, bwd = acts.unit_working(unit)
        assert fwd >= acts.forward_local_by_unit[unit] and bwd >= X
    assert acts.working_forward_bytes == max(acts.working_forward_by_unit.values())
    assert acts.working_backward_bytes == max(acts.working_backward_by_unit.values())
    # Each block saved its linear's input; during its backward that is alive with the
    # working set, and the gradient flowing in (one activation) is alive as it starts.
    for unit in ("narrow", "wide"):
        saved, working = acts.backward_with_saved_by_unit[unit]
        assert saved == acts.saved_bytes[unit] == X and working >= X
        assert acts.backward_entry_by_unit[unit] >= X


def _bound(acts: ActivationProfile, checkpointed: tuple[str, ...]) -> Bound:
    units = [UnitInfo(fqn=u, cls="Block", numel=16) for u in ("", "a", "b")]
    config = StepConfig(world_size=2, version="fsdp2", activations=acts, checkpointed=checkpointed)
    return per_layer_bound(units, config)


def _acts(**per_unit: Any) -> ActivationProfile:
    """A profile of a root and blocks ``a`` and ``b``, each saving 1,000 B."""
    base: dict[str, Any] = {
        "saved_bytes": {"": 0, "a": 1000, "b": 1000},
        "entry_bytes": {"": 0, "a": 10, "b": 10},
        "working_forward_bytes": 0,
        "working_backward_bytes": 0,
        "working_forward_by_unit": {"": 50, "a": 100, "b": 100},
        "working_backward_by_unit": {"": 300, "a": 200, "b": 200},
        "forward_local_by_unit": {"": 50, "a": 100, "b": 100},
        "backward_entry_by_unit": {"": 0, "a": 20, "b": 20},
        "backward_with_saved_by_unit": {"": (0, 300), "a": (600, 200), "b": (600, 200)},
    }
    base.update(per_unit)
    return ActivationProfile(**base)


def _peak(bound: Bound) -> tuple[int, int]:
    return bound.term("recomputed unit").bytes, bound.term("activation working set").bytes


def test_without_checkpointing_the_working_set_is_the_largest_units() -> None:
    bound = _bound(_acts(), ())
    assert bound.term("activation working set").bytes == 300  # the root's backward
    assert "while (root) runs" in bound.term("activation working set").derivation
    with pytest.raises(KeyError):
        bound.term("recomputed unit")


def test_a_checkpointed_units_recompute_and_its_backward_are_each_a_candidate() -> None:
    # The recompute (1,000 saved + 20 entry + 100 made again) beats its backward (600 + 200)
    # and the root's 300: the recomputed unit is all of its saved set.
    assert _peak(_bound(_acts(), ("a", "b"))) == (1000, 120)
    # Its backward beats its recompute when most of its saved set is still alive with a large
    # working set: the saved part alive then is the recomputed unit.
    later = {"": (0, 300), "a": (900, 700), "b": (600, 200)}
    assert _peak(_bound(_acts(backward_with_saved_by_unit=later), ("a", "b"))) == (900, 700)
    # A unit not checkpointed whose working set beats every checkpointed one's sum: the
    # recomputed unit is 0 and says why.
    bound = _bound(_acts(working_backward_by_unit={"": 5000, "a": 200, "b": 200}), ("a",))
    assert _peak(bound) == (0, 5000)
    assert bound.term("recomputed unit").derivation.startswith("0: no checkpointed unit")
    # Its first forward keeps none of its saved set: with a forward working set above what
    # the recompute makes again, that is the working set.
    busy = _acts(working_forward_by_unit={"": 50, "a": 150, "b": 100})
    assert _peak(_bound(busy, ("a", "b"))) == (1000, 150)
    # Only the checkpointed units' recomputes count: b's larger saved set is saved activations.
    big_b = _acts(saved_bytes={"": 0, "a": 1000, "b": 9000})
    assert _peak(_bound(big_b, ("a",))) == (1000, 120)
    assert _bound(big_b, ("a",)).term("saved activations").bytes == 9000 + 10


def test_without_per_unit_figures_the_steps_working_set_is_summed_with_the_largest_recompute() -> (
    None
):
    # A profile from before the per-unit figures (or the memory checks' profile): the step's
    # working set and the largest recomputed saved set, as if they coincided.
    acts = ActivationProfile(
        saved_bytes={"": 0, "a": 1000, "b": 2000},
        entry_bytes={"": 0, "a": 10, "b": 10},
        working_forward_bytes=400,
        working_backward_bytes=700,
    )
    assert _peak(_bound(acts, ("a", "b"))) == (2000, 700)
