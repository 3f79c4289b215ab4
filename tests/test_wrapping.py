"""The wrap claim on real ranks, FSDP1 and FSDP2: each check passes on the recommended policy
and fails, with a specific message, on a broken one (negative controls)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fsdp_conformance.claims.wrap.mixed import rank_mixed, verdict_mixed
from fsdp_conformance.claims.wrap.prefetch import (
    rank_prefetch,
    verdict_prefetch_backward,
    verdict_prefetch_coarse,
    verdict_prefetch_forward,
)
from fsdp_conformance.claims.wrap.train import (
    BF16_LOSS_RTOL,
    BF16_UPDATE_RTOL,
    FP32_ATOL,
    rank_train,
    verdict_train,
)
from fsdp_conformance.claims.wrap.units import (
    rank_units,
    verdict_units_accounting,
    verdict_units_exact,
    verdict_units_plan,
)
from fsdp_conformance.harness import CheckSkipped, Ranks
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.reference_models import ModelConfig

VERSIONS = ("fsdp1", "fsdp2")
#: dim 30: the head (30 x 234 + 234 = 7,254) does not divide by 4, so padding shows at ws 4.
ODD = ModelSpec(reference="massive", config=ModelConfig(num_layers=2, dim=30))
SMALL = ModelSpec(reference="massive", config=ModelConfig(num_layers=3, dim=32))
TIED = ModelSpec(reference="tied", config=ModelConfig(num_layers=2, dim=32))
LORA = ModelSpec(reference="lora", config=ModelConfig(num_layers=2, dim=30))
EMB = ModelSpec(reference="embedding_classifier", config=ModelConfig(num_layers=2, dim=32))


def _all_unit_verdicts(values: list[Any], params: dict[str, Any]) -> None:
    for verdict_fn in (verdict_units_exact, verdict_units_plan, verdict_units_accounting):
        verdict = verdict_fn(values, params)
        assert verdict.passed, verdict.message


# --------------------------------------------------------------------------------------------
# Exact unit set, plan == actual, parameter accounting
# --------------------------------------------------------------------------------------------


@pytest.mark.world_size(2, 4)
def test_recommended_units_exact_plan_and_accounting(ranks: Ranks, world_size: int) -> None:
    # The tied model at world size 2 only: a 4-rank pool is the costly part on 2 cores.
    for version in VERSIONS:
        for spec in (ODD, TIED) if world_size == 2 else (ODD,):
            params = {"spec": spec, "version": version, "policy": "recommended"}
            values = ranks.run(rank_units, **params)
            assert len(values) == world_size
            _all_unit_verdicts(values, params)
            accounting = verdict_units_accounting(values, params)
            if spec is ODD and world_size == 4:
                # 7,254 head elements over 4 ranks: FSDP1 pads its flat parameter to 7,256.
                assert accounting.figures["padding"] >= (2 if version == "fsdp1" else 0)


@pytest.mark.world_size(2)
def test_mixed_requires_grad_block_is_one_unit(ranks: Ranks) -> None:
    # FSDP1 needs use_orig_params=True for a block mixing frozen and trainable parameters;
    # its flat parameter then carries alignment padding, which accounting must subtract.
    for version in VERSIONS:
        params = {"spec": LORA, "version": version, "policy": "recommended"}
        values = ranks.run(rank_units, **params)
        _all_unit_verdicts(values, params)
        if version == "fsdp1":
            block = next(u for u in values[0]["actual"] if u["fqn"] == "layers.0")
            assert block["flat_numel"] > block["numel"]  # alignment padding present


@pytest.mark.world_size(2)
def test_negative_control_seeds_policy_fails_the_unit_set(ranks: Ranks) -> None:
    for version in VERSIONS:
        params = {"spec": SMALL, "version": version, "policy": "seeds"}
        verdict = verdict_units_exact(ranks.run(rank_units, **params), params)
        assert not verdict.passed
        assert "layers.0.mlp.0 is a unit nested inside the block unit layers.0" in verdict.message
        assert "expected units:" in verdict.message and "actual units:" in verdict.message


@pytest.mark.world_size(2)
def test_negative_control_blocks_only_misses_the_oversized_head(ranks: Ranks) -> None:
    params = {"spec": SMALL, "version": "fsdp2", "policy": "blocks_only"}
    verdict = verdict_units_exact(ranks.run(rank_units, **params), params)
    assert not verdict.passed
    assert "- missing unit head (Linear" in verdict.message


@pytest.mark.world_size(2)
def test_negative_control_plan_that_does_not_describe_the_wrapping(ranks: Ranks) -> None:
    for version in VERSIONS:
        params = {
            "spec": SMALL,
            "version": version,
            "policy": "recommended",
            "fault": "seeds_applied",
        }
        verdict = verdict_units_plan(ranks.run(rank_units, **params), params)
        assert not verdict.passed
        assert "+ unexpected unit layers.0.mlp.0 (Linear" in verdict.message


@pytest.mark.world_size(2)
def test_negative_control_a_parameter_fsdp_leaves_unmanaged_fails_every_unit_check(
    ranks: Ranks,
) -> None:
    """The units come from torch's state (FSDP2's param groups, FSDP1's FlatParameters), not
    from the modules the suite sharded: a block parameter FSDP was told to ignore is plain and
    replicated on every rank, in no unit, and all three unit checks fail on every rank."""
    for version in VERSIONS:
        params = {
            "spec": ODD,
            "version": version,
            "policy": "recommended",
            "fault": "unmanaged_parameter",
        }
        values = ranks.run(rank_units, **params)
        exact = verdict_units_exact(values, params)
        plan = verdict_units_plan(values, params)
        accounting = verdict_units_accounting(values, params)
        for verdict in (exact, plan, accounting):
            assert not verdict.passed, (version, verdict.message)
            assert "ranks 0, 1: parameter layers.0.attn.weight is in no unit" in verdict.message
        # The readable expected-vs-actual tree: the block is 900 parameters short.
        assert "~ unit layers.0: numel expected 8,280, got 7,380" in exact.message
        assert "expected units:" in exact.message and "actual units:" in exact.message
        assert "fewer: parameters are outside every unit" in accounting.message
        if version == "fsdp2":
            assert (
                "ranks 0, 1: layers.0.attn.weight: managed by no FSDP2 param group (plain "
                "Parameter, replicated: all 900 elements on every rank)"
            ) in exact.message


def test_fsdp2_units_are_read_from_the_param_groups_not_the_modules() -> None:
    """One process, fake backend: a parameter re-assigned after ``fully_shard`` (plain, whole)
    is still in the module's ``named_parameters()`` but in no param group; the units leave it
    out, and the management check names both sides of the swap."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_conformance import _compat
    from fsdp_conformance.models.units import fsdp2_management_problems, fsdp2_units

    if dist.is_initialized():
        pytest.skip("this process already has a default process group (the fake one needs its own)")
    store = _compat.fake_store_cls()()
    dist.init_process_group("fake", store=store, rank=0, world_size=2)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        mesh = init_device_mesh("cpu", (2,))
        fully_shard = _compat.fully_shard()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert fsdp2_management_problems(model) == []
        before = {u.fqn: (u.numel, u.local_numel, u.params) for u in fsdp2_units(model)}
        assert before == {
            "": (14, 7, ("1.weight", "1.bias")),
            "0": (30, 15, ("0.weight", "0.bias")),
        }
        model[0].weight = torch.nn.Parameter(torch.zeros(6, 4))  # plain, replicated
        after = {u.fqn: u.params for u in fsdp2_units(model)}
        # The group still manages its DTensor under the name torch recorded for it.
        assert after == {"": ("1.weight", "1.bias"), "0": ("0.weight", "0.bias")}
        problems = fsdp2_management_problems(model)
        assert problems == [
            "0.weight: managed by no FSDP2 param group (plain Parameter, replicated: all 24 "
            "elements on every rank)",
            "0.weight: unit 0 manages a parameter the model no longer holds there "
            "(re-assigned after fully_shard)",
        ]
    finally:
        dist.destroy_process_group()


@pytest.mark.world_size(2)
def test_seeds_policy_on_tied_weights_duplicates_the_weight(ranks: Ranks) -> None:
    """Negative control for accounting, and what the seeds' policy does to a tied weight:
    `embed` and `head` become two units that each hold the shared weight."""
    for version in VERSIONS:
        params = {"spec": TIED, "version": version, "policy": "seeds"}
        values = ranks.run(rank_units, **params)
        verdict = verdict_units_accounting(values, params)
        assert not verdict.passed
        assert "tied weight embed.weight = head.weight is in 2 units (embed, head)" in (
            verdict.message
        )
        assert "more: a weight is counted in two units" in verdict.message
        if version == "fsdp1":
            # FSDP1 flattens the weight twice (two copies); the plan, which assigns each
            # parameter once, does not describe that.
            plan = verdict_units_plan(values, params)
            assert not plan.passed and "~ unit head: numel expected 0, got 16,000" in plan.message


@pytest.mark.world_size(2)
def test_negative_control_one_rank_with_a_wrong_shard_or_units(ranks: Ranks) -> None:
    params = {"spec": ODD, "version": "fsdp1", "policy": "recommended"}
    values = ranks.run(rank_units, **params)
    _all_unit_verdicts(values, params)
    bad = copy.deepcopy(values)
    bad[1]["actual"][-1]["local_numel"] += 1  # rank 1 alone reports a wrong shard size
    verdict = verdict_units_accounting(bad, params)
    assert not verdict.passed and "rank 1: unit head holds a local shard of" in verdict.message
    bad = copy.deepcopy(values)
    bad[1]["actual"] = bad[1]["actual"][:-1]  # rank 1 alone lost a unit
    verdict = verdict_units_exact(bad, params)
    assert not verdict.passed and "ranks disagree on the actual units" in verdict.message


# --------------------------------------------------------------------------------------------
# Training parity
# --------------------------------------------------------------------------------------------


@pytest.mark.world_size(2)
def test_training_steps_match_single_process_reference(ranks: Ranks) -> None:
    for version in VERSIONS:
        for precision in ("fp32", "bf16"):
            params = {"spec": SMALL, "version": version, "precision": precision}
            values = ranks.run(rank_train, **params)
            verdict = verdict_train(values, params)
            assert verdict.passed, verdict.message
            if precision == "fp32":
                assert verdict.figures["max_param_diff"] <= FP32_ATOL
            else:  # the reference computes as FSDP does: what is left is bf16 rounding
                assert verdict.figures["loss_rel_diff"] <= BF16_LOSS_RTOL
                assert verdict.figures["update_rel_diff"] <= BF16_UPDATE_RTOL
                dtypes = {w for v in values for _, w in v["compute_dtypes"].values()}
                assert dtypes == {"torch.bfloat16"}


@pytest.mark.world_size(2)
def test_negative_control_bf16_summed_or_unreduced_gradients_fail(ranks: Ranks) -> None:
    # Before the mixed-precision reference both passed: the bf16 verdict had no update limit
    # and its parameter limit (2e-2) was above the 9e-4 that summed gradients moved a weight.
    for version in VERSIONS:
        for fault in ("summed_grads", "skipped_reduction"):
            # One step shows a gradient error: the lane pays for four sharded models, not more.
            params = {
                "spec": SMALL,
                "version": version,
                "precision": "bf16",
                "fault": fault,
                "steps": 1,
            }
            verdict = verdict_train(ranks.run(rank_train, **params), params)
            assert not verdict.passed, f"{version} {fault}: {verdict.message}"
            assert "'s update differs from the reference's by" in verdict.message
            assert verdict.figures["update_rel_diff"] > 0.5  # 3 steps: 0.72 to 1.0 (ws 2)
            # The message names the cause from the measured scale, only where it fits.
            summed = "= the world size (2): gradients summed across ranks, not averaged"
            assert (summed in verdict.message) == (fault == "summed_grads"), verdict.message


@pytest.mark.parametrize(
    ("factor", "ranks_n", "words"),
    [
        (
            2.0,
            2,
            "2.00x the reference's (least squares over all weights) = the world size (2): "
            "gradients summed across ranks, not averaged",
        ),
        (3.97, 4, "= the world size (4): gradients summed"),
        (0.25, 4, "= 1 / the world size (4): gradients averaged twice"),
        (0.001, 2, "no update reached the weights"),
        (1.0, 2, "the same scale: the difference is in the direction"),
        (1.37, 2, "the sharded update is 1.37x the reference's (least squares over all weights)"),
        (None, 2, "the reference made no update to compare with"),
    ],
)
def test_the_update_scale_names_its_cause_only_where_it_fits(
    factor: float | None,
    ranks_n: int,
    words: str,
) -> None:
    from fsdp_conformance.claims.wrap.train import update_diagnosis

    said = update_diagnosis(factor, ranks_n)
    assert words in said, said
    if factor == 1.37:
        assert said.endswith("(least squares over all weights)")  # a factor, not a guess


@pytest.mark.world_size(2)
def test_negative_control_parameters_outside_fsdp_diverge(ranks: Ranks) -> None:
    for version in VERSIONS:
        params = {"spec": SMALL, "version": version, "precision": "fp32", "fault": "unsynced_root"}
        verdict = verdict_train(ranks.run(rank_train, **params), params)
        assert not verdict.passed
        assert "embed.weight's update differs from the reference's by" in verdict.message


@pytest.mark.world_size(2)
def test_negative_control_bf16_not_in_effect_or_params_not_fp32(ranks: Ranks) -> None:
    params = {"spec": SMALL, "version": "fsdp1", "precision": "bf16", "fault": "no_mixed_precision"}
    verdict = verdict_train(ranks.run(rank_train, **params), params)
    assert not verdict.passed and "compute did not run in bf16" in verdict.message
    params = {"spec": SMALL, "version": "fsdp2", "precision": "bf16", "fault": "params_bf16"}
    verdict = verdict_train(ranks.run(rank_train, **params), params)
    assert not verdict.passed
    assert "stored parameters are ['torch.bfloat16'], expected float32" in verdict.message


# --------------------------------------------------------------------------------------------
# The second seed's mixed configuration
# --------------------------------------------------------------------------------------------


@pytest.mark.world_size(2)
def test_mixed_configuration_embedding_no_shard_fp32_blocks_bf16(ranks: Ranks) -> None:
    for version in VERSIONS:
        params = {"spec": EMB, "version": version}
        values = ranks.run(rank_mixed, **params)
        verdict = verdict_mixed(values, params)
        assert verdict.passed, verdict.message
        for v in values:
            assert v["strategies"]["embedding"] == "NO_SHARD"
            assert v["compute_dtypes"]["embedding"][1] == "torch.float32"
            assert v["compute_dtypes"]["layers.0.attn"] == ("torch.bfloat16", "torch.bfloat16")


@pytest.mark.world_size(2)
def test_mixed_configuration_on_tied_weights_one_unit_or_a_skip(ranks: Ranks) -> None:
    # FSDP2: the tied head joins the embedding's unit (fully_shard([embed, head])); before, the
    # first forward raised "Parameter 'head.weight' is shared with a parameter already managed
    # by another FSDP group". FSDP1 cannot build that unit: every rank skips with the reason.
    params = {"spec": TIED, "version": "fsdp2"}
    values = ranks.run(rank_mixed, **params)
    verdict = verdict_mixed(values, params)
    assert verdict.passed, verdict.message
    assert "embedding embed (one unit with the tied head) NO_SHARD fp32" in verdict.message
    # Negative controls: rank 1 alone reports the head outside the unit, or the tie split.
    for key, message in (
        ("same_unit", "rank 1: head shares embed's weight but is not in its unit"),
        (
            "still_tied",
            "rank 1: after sharding, head no longer holds embed's parameter (the tie was split)",
        ),
    ):
        bad = copy.deepcopy(values)
        bad[1]["tied"]["head"][key] = False
        failed = verdict_mixed(bad, params)
        assert not failed.passed and message in failed.message
    with pytest.raises(CheckSkipped, match="embed's weight is tied to head. FSDP1 units follow"):
        ranks.configured(skip=None).run(rank_mixed, spec=TIED, version="fsdp1")


@pytest.mark.world_size(2)
def test_negative_control_uniform_configuration_is_not_the_mixed_one(ranks: Ranks) -> None:
    for version in VERSIONS:
        params = {"spec": EMB, "version": version, "fault": "uniform"}
        verdict = verdict_mixed(ranks.run(rank_mixed, **params), params)
        assert not verdict.passed
        assert "unit embedding is FULL_SHARD, expected NO_SHARD" in verdict.message
        assert "unit embedding computed with weights in ['torch.bfloat16']" in verdict.message


# --------------------------------------------------------------------------------------------
# Prefetch
# --------------------------------------------------------------------------------------------


@pytest.mark.world_size(2)
def test_prefetch_with_one_unit_per_block(ranks: Ranks) -> None:
    for version in VERSIONS:
        params = {"spec": SMALL, "version": version}
        values = ranks.run(rank_prefetch, **params)
        for verdict_fn in (verdict_prefetch_forward, verdict_prefetch_backward):
            verdict = verdict_fn(values, params)
            assert verdict.passed, verdict.message
        # Nothing to prefetch is not what per-block wrapping looks like.
        coarse = verdict_prefetch_coarse(values, params)
        assert not coarse.passed and "not a single coarse unit" in coarse.message


@pytest.mark.world_size(2)
def test_one_coarse_unit_has_nothing_to_prefetch(ranks: Ranks) -> None:
    for version in VERSIONS:
        params = {"spec": SMALL, "version": version, "policy": "monolithic"}
        values = ranks.run(rank_prefetch, **params)
        assert verdict_prefetch_coarse(values, params).passed
        forward = verdict_prefetch_forward(values, params)
        assert not forward.passed and "there is no next unit to prefetch" in forward.message


@pytest.mark.world_size(2)
def test_negative_control_prefetch_switched_off(ranks: Ranks) -> None:
    # FSDP1's defaults: forward_prefetch=False, so the next unit is gathered only when its
    # block starts; backward_prefetch=None likewise gathers late in backward.
    params = {
        "spec": SMALL,
        "version": "fsdp1",
        "fault": ("no_forward_prefetch", "no_backward_prefetch"),
    }
    values = ranks.run(rank_prefetch, **params)
    forward = verdict_prefetch_forward(values, params)
    assert not forward.passed
    assert "unit layers.1 was not gathered before block layers.0 finished its forward" in (
        forward.message
    )
    backward = verdict_prefetch_backward(values, params)
    assert not backward.passed
    assert "unit layers.1 was not gathered before block layers.2 finished its backward" in (
        backward.message
    )
    # FSDP2 without explicit forward prefetch: its implicit prefetch overlaps on CUDA streams
    # only; in the order the CPU issues all-gathers, unit k+1 comes after block k.
    params = {"spec": SMALL, "version": "fsdp2", "fault": "no_forward_prefetch"}
    forward = verdict_prefetch_forward(ranks.run(rank_prefetch, **params), params)
    assert not forward.passed and "was not gathered before" in forward.message


def test_prefetch_verdicts_cannot_pass_with_fewer_than_two_blocks() -> None:
    # One block has no next unit: a verdict that examined no block pair proved nothing.
    run = [
        ("fwd_start", 0),
        ("gather", "layers.0"),
        ("fwd_end", 0),
        ("fwd_done", None),
        ("bwd_start", 0),
        ("bwd_end", 0),
    ]
    values = [
        {
            "rank": r,
            "version": "fsdp2",
            "blocks": ["layers.0"],
            "units": ["", "layers.0"],
            "runs": [run],
        }
        for r in range(2)
    ]
    for verdict_fn in (verdict_prefetch_forward, verdict_prefetch_backward):
        verdict = verdict_fn(values, {})
        assert not verdict.passed
        assert "fewer than two blocks" in verdict.message


@pytest.mark.world_size(2)
def test_prefetch_skips_a_model_with_one_block_on_every_rank(ranks: Ranks) -> None:
    one_block = ModelSpec(reference="massive", config=ModelConfig(num_layers=1, dim=32))
    with pytest.raises(CheckSkipped, match="needs at least two blocks"):
        ranks.configured(skip=None).run(rank_prefetch, spec=one_block, version="fsdp2")


def test_accounting_verdict_checks_every_rank_not_rank_0_only() -> None:
    # Two ranks of FSDP1 on a model whose embed.weight is tied to head.weight (16 elements).
    def value(rank: int, units: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "rank": rank,
            "world_size": 2,
            "version": "fsdp1",
            "actual": units,
            "model_numel": 16,
            "shared": [["embed.weight", "head.weight"]],
            "strategies": {},
            "param_shapes": {"embed.weight": [4, 4], "head.weight": [4, 4]},
        }

    def unit(fqn: str, numel: int, params: tuple[str, ...]) -> dict[str, Any]:
        return {
            "fqn": fqn,
            "cls": "Net" if not fqn else "Linear",
            "numel": numel,
            "local_numel": numel // 2,
            "parent": None if not fqn else "",
            "params": params,
            "flat_numel": None,
        }

    good = [unit("", 16, ("embed.weight",))]
    assert verdict_units_accounting([value(0, good), value(1, good)], {}).passed
    # Rank 1 alone splits the tied weight into a second unit.
    split = [*good, unit("head", 0, ("head.weight",))]
    verdict = verdict_units_accounting([value(0, good), value(1, split)], {})
    assert not verdict.passed
    assert "rank 1: tied weight embed.weight = head.weight is in 2 units" in verdict.message
    # Rank 1 alone counts more parameters than the model has.
    more = [unit("", 20, ("embed.weight",))]
    verdict = verdict_units_accounting([value(0, good), value(1, more)], {})
    assert not verdict.passed
    assert "rank 1: units hold 20 parameters, the model has 16" in verdict.message


# --------------------------------------------------------------------------------------------
# The fault tables
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["units", "builders", "train", "mixed", "prefetch"])
def test_each_fault_patches_a_step_for_its_duration_only(family: str) -> None:
    """Every fault changes a step of its family's module (or torch.distributed, torch's wrap
    policies, the suite's policies) while injected and restores it on exit: a warm rank serves
    the next check unchanged. A name the family does not know is refused, not ignored."""
    import importlib

    import torch.distributed as dist
    from torch.distributed.fsdp import wrap as torch_wrap

    from fsdp_conformance.harness import RankContext
    from fsdp_conformance.models import policies

    module = importlib.import_module(f"fsdp_conformance.claims.wrap.{family}")
    ctx = RankContext(rank=0, world_size=2, local_rank=0, backend="gloo", device_type="cpu")

    def steps() -> dict[str, Any]:
        return {
            **{f"{family}.{k}": v for k, v in vars(module).items()},
            **{f"dist.{k}": getattr(dist, k) for k in dir(dist) if "reduce_scatter" in k},
            **{f"torch_wrap.{k}": v for k, v in vars(torch_wrap).items()},
            **{f"policies.{k}": v for k, v in vars(policies).items()},
        }

    before = steps()
    assert len(module.FAULTS) >= 1
    for name in module.FAULTS:
        with module.FAULTS.inject(name, ctx):
            during = steps()
            assert [k for k in before if during[k] is not before[k]], f"{name} patches nothing"
        after = steps()
        assert [k for k in before if after[k] is not before[k]] == [], name
    with pytest.raises(ValueError, match="unknown fault"), module.FAULTS.inject("no_such", ctx):
        pass
