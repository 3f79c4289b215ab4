"""Policies: block classes by class / dotted path / name, plan validation, torch's builders."""

from __future__ import annotations

import pytest

from fsdp_conformance.claims.check import run_check
from fsdp_conformance.claims.wrap import (
    BUILDERS,
    CHECKS,
    build_policy,
    builder_units,
    verdict_builder,
)
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models import (
    DecoderLayer,
    EncoderDecoder,
    EncoderLayer,
    MassiveModel,
    ModelConfig,
    TiedLM,
)
from fsdp_conformance.policies import (
    PolicyError,
    recommended_policy,
    resolve_block_classes,
    seeds_hybrid_policy,
    validate_plan,
)
from fsdp_conformance.units import plan_units

SMALL = ModelConfig(num_layers=2, dim=32)


@pytest.mark.parametrize(
    "given",
    [DecoderLayer, "DecoderLayer", "fsdp_conformance.models.DecoderLayer",
     "fsdp_conformance.models:DecoderLayer", ["DecoderLayer"]],
    ids=["class", "name", "dotted", "colon", "list"],
)
def test_block_classes_resolve_from_class_path_or_name(given: object) -> None:
    assert resolve_block_classes(MassiveModel(SMALL), given) == (DecoderLayer,)


def test_several_block_classes_resolve_in_order() -> None:
    model = EncoderDecoder(SMALL)
    assert resolve_block_classes(model, ["EncoderLayer", DecoderLayer]) == (
        EncoderLayer, DecoderLayer)


def test_unknown_block_name_lists_the_models_module_classes() -> None:
    with pytest.raises(PolicyError) as info:
        resolve_block_classes(MassiveModel(SMALL), "TransformerBlock")
    message = str(info.value)
    assert "'TransformerBlock' matches no module class in the model MassiveModel" in message
    assert "fsdp_conformance.models.DecoderLayer" in message
    assert "torch.nn.modules.linear.Linear" in message


def test_block_class_absent_from_the_model_is_refused() -> None:
    with pytest.raises(PolicyError, match="EncoderLayer is not in the model MassiveModel"):
        resolve_block_classes(MassiveModel(SMALL), EncoderLayer)


def test_bad_dotted_path_names_the_module() -> None:
    with pytest.raises(PolicyError, match="cannot import block class 'nowhere.Block'"):
        resolve_block_classes(MassiveModel(SMALL), "nowhere.Block")


def test_validate_plan_accepts_a_policy_that_wraps_blocks() -> None:
    model = MassiveModel(SMALL)
    units = validate_plan(model, recommended_policy(model, (DecoderLayer,), SMALL.min_params))
    assert [u.fqn for u in units] == ["", "layers.0", "layers.1", "head"]


def test_negative_control_policy_that_wraps_only_the_root_is_an_error() -> None:
    model = MassiveModel(SMALL)
    # A block class that is not in the model and a threshold nothing reaches: wraps nothing.
    root_only = recommended_policy(model, (EncoderLayer,), 10**9)
    with pytest.raises(PolicyError) as info:
        validate_plan(model, root_only)
    message = str(info.value)
    assert "wraps nothing but the root of MassiveModel" in message
    assert "DecoderLayer (x2" in message and "Fix: name the model's block class" in message
    with pytest.raises(PolicyError, match="wraps nothing but the root"):
        validate_plan(model, build_policy("root_only", model, (DecoderLayer,), 1))


def test_unknown_policy_name_lists_the_choices() -> None:
    with pytest.raises(PolicyError, match="choose one of recommended, seeds"):
        build_policy("best", MassiveModel(SMALL), (DecoderLayer,), 1)


def test_seeds_policy_wraps_each_side_of_a_tied_weight() -> None:
    # The seeds' size lambda wraps `embed` and `head` separately although they share one
    # weight; the recommended policy keeps the weight in the root.
    model = TiedLM(SMALL)
    seeds = [u.fqn for u in plan_units(model, seeds_hybrid_policy((DecoderLayer,),
                                                                  SMALL.min_params))]
    assert "embed" in seeds and "head" in seeds
    recommended = [u.fqn for u in plan_units(
        model, recommended_policy(model, (DecoderLayer,), SMALL.min_params))]
    assert "embed" not in recommended and "head" not in recommended


def test_builder_checks_are_registered() -> None:
    names = {c.name for c in CHECKS}
    assert {f"wrap.builders.{b}" for b in BUILDERS} <= names


@pytest.mark.world_size(2)
def test_each_torch_builder_gives_its_documented_units(ranks: Ranks) -> None:
    counts = {}
    for builder in BUILDERS:
        check = next(c for c in CHECKS if c.name == f"wrap.builders.{builder}")
        verdict = run_check(ranks, check)
        assert verdict.passed, verdict.message
        counts[builder] = verdict.figures["units"]
    # massive, 4 blocks at dim 64: root + 4 blocks (+ head, + MLP linears by size, ...).
    assert counts == {"transformer": 5, "size": 10, "lambda": 2, "or": 6, "module_wrap": 15,
                      "custom": 6}


@pytest.mark.world_size(2)
def test_negative_control_builder_verdict_catches_a_different_result(ranks: Ranks) -> None:
    # Apply ModuleWrapPolicy({Linear}) but claim transformer_auto_wrap_policy's result.
    values = ranks.run(builder_units, builder="module_wrap", claimed_builder="transformer")
    verdict = verdict_builder(values, {})
    assert not verdict.passed
    assert "+ unexpected unit layers.0.attn (Linear" in verdict.message
    # Per-unit overrides are checked too: CustomPolicy's NO_SHARD head claimed, none applied.
    values = ranks.run(builder_units, builder="or", claimed_builder="custom")
    verdict = verdict_builder(values, {})
    assert not verdict.passed
    assert "unit head: sharding strategy expected NO_SHARD, got FULL_SHARD" in verdict.message
