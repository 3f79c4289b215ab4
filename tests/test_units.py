"""The claim's own specification (expected_units), plans and the unit tree: no process group."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fsdp_conformance.claims.wrap.common import expected_units
from fsdp_conformance.claims.wrap.units import judge_plan, seeds_full_scale_plan
from fsdp_conformance.models.policies import (
    SEED_MIN_PARAMS,
    recommended_policy,
    seeds_hybrid_policy,
)
from fsdp_conformance.models.reference_models import (
    DecoderLayer,
    EncoderDecoder,
    EncoderLayer,
    MassiveModel,
    ModelConfig,
    TiedLM,
)
from fsdp_conformance.models.units import (
    UnitInfo,
    format_unit_tree,
    plan_units,
    unit_set_differences,
    units_for_modules,
)

SMALL = ModelConfig(num_layers=2, dim=32)


def _fqns(units: list[UnitInfo]) -> list[str]:
    return [u.fqn for u in units]


def test_expected_units_massive_blocks_and_head_only() -> None:
    model = MassiveModel(SMALL)
    units = expected_units(model, (DecoderLayer,), SMALL.min_params)
    # The head (32 x 250 + 250 = 8,250) is above the scaled threshold (1,221); the embedding
    # (32 x 32 + 32 = 1,056) below it, so it stays with the root.
    assert SMALL.min_params == 1221
    assert _fqns(units) == ["", "layers.0", "layers.1", "head"]
    by = {u.fqn: u for u in units}
    assert by[""].numel == 1056 and by[""].parent is None
    assert by["layers.0"].numel == sum(p.numel() for p in model.layers[0].parameters())
    assert by["head"].parent == ""
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())


def test_expected_units_never_nests_inside_a_block() -> None:
    # Threshold 1: every linear is "oversized", yet nothing inside a block becomes a unit.
    model = MassiveModel(SMALL)
    units = expected_units(model, (DecoderLayer,), 1)
    assert not any(u.fqn.startswith("layers.0.") for u in units)
    assert "embed" in _fqns(units) and "head" in _fqns(units)
    # Containers (ModuleList) are never units, even when large: they have no forward.
    assert "layers" not in _fqns(units)


def test_expected_units_tied_weight_stays_in_one_unit() -> None:
    model = TiedLM(SMALL)
    units = expected_units(model, (DecoderLayer,), SMALL.min_params)
    holding = [u.fqn for u in units if {"embed.weight", "head.weight"} & set(u.params)]
    assert holding == [""], format_unit_tree(units)
    assert "embed" not in _fqns(units) and "head" not in _fqns(units)


def test_expected_units_asymmetric_encoder_decoder() -> None:
    model = EncoderDecoder(SMALL)
    units = expected_units(model, (EncoderLayer, DecoderLayer), SMALL.min_params)
    assert _fqns(units) == ["", "encoder.0", "encoder.1", "decoder.0", "decoder.1", "head"]


def test_recommended_plan_equals_the_claim_on_every_reference_case() -> None:
    cases = [
        (MassiveModel(SMALL), (DecoderLayer,)),
        (TiedLM(SMALL), (DecoderLayer,)),
        (EncoderDecoder(SMALL), (EncoderLayer, DecoderLayer)),
    ]
    for model, blocks in cases:
        policy = recommended_policy(model, blocks, SMALL.min_params)
        verdict = judge_plan(model, policy, blocks, SMALL.min_params)
        assert verdict.passed, verdict.message


def test_negative_control_seeds_plan_nests_mlp_units_inside_blocks() -> None:
    model = MassiveModel(SMALL)
    verdict = judge_plan(
        model,
        seeds_hybrid_policy((DecoderLayer,), SMALL.min_params),
        (DecoderLayer,),
        SMALL.min_params,
    )
    assert not verdict.passed
    assert "layers.0.mlp.0 is a unit nested inside the block unit layers.0" in verdict.message
    assert "expected units:" in verdict.message and "actual units:" in verdict.message


def test_negative_control_differences_name_missing_and_root_only() -> None:
    model = MassiveModel(SMALL)
    expected = expected_units(model, (DecoderLayer,), SMALL.min_params)
    root_only = units_for_modules(model, [])
    diffs = unit_set_differences(expected, root_only)
    assert "- missing unit layers.0 (DecoderLayer, 9,408 params)" in diffs
    assert any("wrapped nothing but the root" in d for d in diffs)


def test_full_scale_plans_are_fast_and_allocate_nothing() -> None:
    start = time.perf_counter()
    units, verdict = seeds_full_scale_plan("seeds_verbatim")
    elapsed = time.perf_counter() - start
    # Not a timing assert on FSDP: a guard that planning stays a dry run (seconds would mean
    # real allocation). Measured: ~10 ms.
    assert elapsed < 5.0
    assert not verdict.passed
    assert len(units) == 26  # root + 8 blocks + 16 nested MLP linears + head
    nested = [u.fqn for u in units if u.fqn.endswith(("mlp.0", "mlp.2"))]
    assert len(nested) == 16 and all(
        u.parent.startswith("layers.") for u in units if u.fqn in nested
    )
    block = next(u for u in units if u.fqn == "layers.0")
    assert block.numel == 4096 * 4096 + 4096  # only attn is left in the block's own unit
    rec_units, rec_verdict = seeds_full_scale_plan("recommended")
    assert rec_verdict.passed, rec_verdict.message
    assert [u.fqn for u in rec_units] == ["", *(f"layers.{i}" for i in range(8)), "head"]


def test_plan_on_meta_model_matches_plan_on_real_model() -> None:
    with torch.device("meta"):
        meta = MassiveModel(SMALL)
    real = MassiveModel(SMALL)
    plans = [
        plan_units(m, recommended_policy(m, (DecoderLayer,), SMALL.min_params))
        for m in (meta, real)
    ]
    assert plans[0] == plans[1]


def test_unit_tree_prints_nesting_and_local_sizes() -> None:
    units = [
        UnitInfo("", "MassiveModel", 10, 5, None),
        UnitInfo("layers.0", "DecoderLayer", 20, 10, ""),
        UnitInfo("layers.0.mlp.0", "Linear", 30, 15, "layers.0"),
    ]
    text = format_unit_tree(units)
    assert "MassiveModel (root)" in text
    assert "└── layers.0  DecoderLayer" in text
    assert "    └── layers.0.mlp.0  Linear" in text
    assert "local 15" in text


@pytest.mark.parametrize("threshold", [SEED_MIN_PARAMS, 1])
def test_expected_units_counts_each_parameter_once(threshold: int) -> None:
    model = TiedLM(SMALL)
    units = expected_units(model, (DecoderLayer,), threshold)
    assert sum(u.numel for u in units) == sum(p.numel() for p in model.parameters())
    assert isinstance(model.head, nn.Linear)


def test_fsdp2_state_that_an_upgrade_moved_is_one_message_naming_what_moved() -> None:
    # FSDP2's units are read from FSDPState's param groups; a torch whose state keeps them
    # elsewhere (or whose param groups lost fsdp_params) must say so, not raise deep inside.
    from fsdp_conformance import _compat

    class MovedState:  # neither _fsdp_param_groups nor _fsdp_param_group
        pass

    class MovedGroup:  # a group without fsdp_params
        pass

    class OldState:  # torch before per-parameter meshes: one group, or None
        _fsdp_param_group = MovedGroup()

    with pytest.raises(
        _compat.CompatError,
        match="neither _fsdp_param_groups nor _fsdp_param_group.*fsdp2_managed_params",
    ):
        _compat.fsdp2_managed_params(MovedState())
    with pytest.raises(_compat.CompatError, match="param group moved.*fsdp_params"):
        _compat.fsdp2_managed_params(OldState())
    assert _compat.fsdp2_state(nn.Linear(2, 2)) is None  # not an FSDP2 unit
