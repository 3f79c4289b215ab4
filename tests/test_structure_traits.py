"""The suite on models with a structural trait (``tests/trait_models.py``): a frozen parameter
inside every block unit, blocks that run in another order than they are registered, a size-rule
unit above block units, a block class fed the model's input.

* Collectives are matched to the unit torch issued them for, not by size: a unit holding a
  frozen parameter reduces its trainable part and is reported as reduced (FSDP1 with
  ``use_orig_params=True`` and FSDP2); a unit whose reduction torch really skips still fails.
* FSDP1's units that mix frozen and trainable parameters run with ``use_orig_params=True``, and
  the preflight says so in one line.
* Prefetch is judged in the order the forward runs the blocks; FSDP2's forward prefetch set in
  module order still fails, and so does prefetch left off.
* Checkpointing shards a container of blocks after the blocks inside it; REENTRANT leaves out a
  block whose inputs need no gradient, and applied to it anyway still fails.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance.claims import loop, stack, wrap
from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.harness import RankContext, Ranks
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.user_model import validate_user_model

pytestmark = pytest.mark.cpu

TRAITS = "tests.trait_models"


def _spec(factory: str, blocks: tuple[str, ...] = ("Block",), **kwargs: Any) -> ModelSpec:
    return ModelSpec(reference=None, factory=f"{TRAITS}:{factory}", block_cls=blocks, **kwargs)


FROZEN = _spec("frozen_in_block")
REVERSED = _spec("reversed_blocks")
CONTAINER = _spec("container_in_size_unit")
STEM = _spec("stem_blocks", ("Block", "Stem"), input_builder=f"{TRAITS}:features")


def _check(checks: Sequence[Check], name: str, version: str) -> Check:
    return next(c for c in checks if c.name == name and c.params["version"] == version)


def _run(ranks: Ranks, check: Check, spec: ModelSpec, **more: Any) -> Verdict:
    params = {**check.params, "spec": spec, **more}
    return check.verdict(ranks.run(check.rank_fn, **params), params)


# --------------------------------------------------------------------------------------------
# Collectives matched by what torch says
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_units_holding_a_frozen_parameter_are_reduced_by_their_own_collective(
    ranks: Ranks, version: str
) -> None:
    verdict = _run(ranks, _check(loop.CHECKS, "loop.accumulation.synced", version), FROZEN)
    assert verdict.passed, verdict.message
    assert {"blocks.0", "blocks.1", "blocks.2"} <= set(verdict.data["trainable_units"])
    for units in verdict.data["reduced"].values():  # one reduction per unit that trains
        assert sorted(units) == sorted(verdict.data["trainable_units"])


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_a_unit_whose_reduction_torch_skips_still_fails(ranks: Ranks, version: str) -> None:
    check = _check(loop.CHECKS, "loop.accumulation.synced", version)
    params = {**check.params, "spec": FROZEN}
    verdict = check.verdict(ranks.run(rank_skipping_one_reduction, params=params), params)
    assert not verdict.passed
    assert "no reduction of the gradients of 1 unit(s)" in verdict.message


def rank_skipping_one_reduction(ctx: RankContext, params: dict[str, Any]) -> Any:
    """The check's rank function with torch's reduction of the second unit of the first
    backward skipped (FSDP1: its ``reduce_scatter_tensor`` not issued; FSDP2: its param group
    told not to reduce), as a torch that loses one unit's reduce-scatter would."""
    check = _check(loop.CHECKS, "loop.accumulation.synced", params["version"])
    with _one_reduction_skipped(params["version"]):
        return check.rank_fn(ctx, **params)


class _Skip:
    def __init__(self) -> None:
        self.calls = itertools.count()

    def now(self) -> bool:
        return next(self.calls) == 1


def _one_reduction_skipped(version: str) -> Any:
    import contextlib

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        skip = _Skip()
        if version == "fsdp1":
            import torch.distributed as dist

            # torch 2.13's FSDP1 issues reduce_scatter_single (older: reduce_scatter_tensor)
            name = next(
                n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)
            )
            original = getattr(dist, name)

            def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
                return None if skip.now() else original(*args, **kwargs)

            setattr(dist, name, reduce_scatter)
            try:
                yield
            finally:
                setattr(dist, name, original)
            return
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        post_backward = FSDPParamGroup.post_backward

        def without_reduction(self: Any, *args: Any) -> Any:
            if self.reduce_grads and any(
                p.unsharded_param.grad is not None
                for p in self.fsdp_params
                if hasattr(p, "_unsharded_param")
            ):
                if skip.now():
                    self.reduce_grads = False
                    try:
                        return post_backward(self, *args)
                    finally:
                        self.reduce_grads = True
            return post_backward(self, *args)

        FSDPParamGroup.post_backward = without_reduction  # type: ignore[method-assign]
        try:
            yield
        finally:
            FSDPParamGroup.post_backward = post_backward  # type: ignore[method-assign]

    return patched()


# --------------------------------------------------------------------------------------------
# FSDP1: units mixing frozen and trainable parameters
# --------------------------------------------------------------------------------------------


def test_the_preflight_says_fsdp1_runs_with_use_orig_params_in_one_line() -> None:
    notes = validate_user_model(FROZEN, ["cpu"], [2], depth_rebuild=False)
    lines = [n for n in notes if "use_orig_params=True" in n]
    assert len(lines) == 1, notes
    assert "'blocks.0', 'blocks.1', 'blocks.2'" in lines[0]
    assert "Must flatten tensors with uniform requires_grad" in lines[0]
    plain = _spec("reversed_blocks")
    assert not [
        n
        for n in validate_user_model(plain, ["cpu"], [2], depth_rebuild=False)
        if "use_orig_params" in n
    ]


@pytest.mark.parametrize(
    "claim, name",
    [
        (wrap.CHECKS, "wrap.mixed"),
        (loop.CHECKS, "loop.entry_points.two_forwards"),
        (stack.CHECKS, "stack.reshard.strategies"),
    ],
)
def test_fsdp1_runs_units_mixing_frozen_and_trainable_parameters(
    ranks: Ranks, claim: Sequence[Check], name: str
) -> None:
    verdict = _run(ranks, _check(claim, name, "fsdp1"), FROZEN)
    assert verdict.passed, verdict.message


# --------------------------------------------------------------------------------------------
# Prefetch in the order the forward runs the blocks
# --------------------------------------------------------------------------------------------

PREFETCH = ("wrap.prefetch.forward", "wrap.prefetch.backward")


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("name", PREFETCH)
def test_prefetch_follows_the_order_the_blocks_run_in(
    ranks: Ranks, version: str, name: str
) -> None:
    verdict = _run(ranks, _check(wrap.CHECKS, name, version), REVERSED)
    assert verdict.passed, verdict.message


@pytest.mark.parametrize(
    "version, fault",
    [
        ("fsdp1", "no_forward_prefetch"),
        ("fsdp2", "no_forward_prefetch"),
        ("fsdp2", "module_order_prefetch"),
    ],
)
def test_forward_prefetch_off_or_in_module_order_fails(
    ranks: Ranks, version: str, fault: str
) -> None:
    verdict = _run(
        ranks, _check(wrap.CHECKS, "wrap.prefetch.forward", version), REVERSED, fault=fault
    )
    assert not verdict.passed
    assert "was not gathered before block" in verdict.message


# --------------------------------------------------------------------------------------------
# Checkpointing: a size-rule unit above the blocks; a block fed the model's input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_checkpointing_shards_a_container_of_blocks_after_its_blocks(
    ranks: Ranks, version: str
) -> None:
    verdict = _run(ranks, _check(stack.CHECKS, "stack.checkpointing", version), CONTAINER)
    assert verdict.passed, verdict.message


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_reentrant_checkpointing_leaves_out_a_block_fed_the_input(
    ranks: Ranks, version: str
) -> None:
    check = _check(stack.CHECKS, "stack.checkpointing", version)
    verdict = _run(ranks, check, STEM)
    assert verdict.passed, verdict.message
    assert "REENTRANT left out 1 block(s) whose inputs need no gradient" in verdict.message
    assert "'stem'" in verdict.message
    faulted = _run(ranks, check, STEM, fault="reentrant_on_inputs_without_grad")
    assert not faulted.passed
    assert "None of the inputs have requires_grad=True" in faulted.message


def test_trait_models_run_forward() -> None:
    """The trait models build and run as the tests above assume (plain, one process)."""
    from tests import trait_models

    ids = torch.randint(0, trait_models.VOCAB, (2, 5))
    for factory in (trait_models.frozen_in_block, trait_models.reversed_blocks):
        model: nn.Module = factory()
        assert model(ids).shape == (2, 5, trait_models.VOCAB)
    stem = trait_models.stem_blocks()
    assert stem(trait_models.features(stem, 2, "cpu")).shape[0] == 2
