"""Policies: block classes by class / dotted path / name, plan validation, torch's builders."""

from __future__ import annotations

import pytest

from fsdp_conformance.claims.check import run_check
from fsdp_conformance.claims.wrap import CHECKS
from fsdp_conformance.claims.wrap.builders import BUILDERS, rank_builders, verdict_builders
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.block_classes import resolve_block_classes
from fsdp_conformance.models.model_spec import BuiltModel
from fsdp_conformance.models.policies import (
    PLAN_POLICIES,
    POLICY_NAMES,
    WRAPPINGS,
    PolicyError,
    Wrapping,
    policy,
    recommended_policy,
    seeds_hybrid_policy,
    validate_plan,
)
from fsdp_conformance.models.reference_models import (
    DecoderLayer,
    EncoderDecoder,
    EncoderLayer,
    MassiveModel,
    ModelConfig,
    TiedLM,
)
from fsdp_conformance.models.units import plan_units

SMALL = ModelConfig(num_layers=2, dim=32)


@pytest.mark.parametrize(
    "given",
    [
        DecoderLayer,
        "DecoderLayer",
        "fsdp_conformance.models.reference_models.DecoderLayer",
        "fsdp_conformance.models.reference_models:DecoderLayer",
        ["DecoderLayer"],
    ],
    ids=["class", "name", "dotted", "colon", "list"],
)
def test_block_classes_resolve_from_class_path_or_name(given: object) -> None:
    assert resolve_block_classes(MassiveModel(SMALL), given) == (DecoderLayer,)


def test_several_block_classes_resolve_in_order() -> None:
    model = EncoderDecoder(SMALL)
    assert resolve_block_classes(model, ["EncoderLayer", DecoderLayer]) == (
        EncoderLayer,
        DecoderLayer,
    )


def test_unknown_block_name_lists_the_models_module_classes() -> None:
    with pytest.raises(PolicyError) as info:
        resolve_block_classes(MassiveModel(SMALL), "TransformerBlock")
    message = str(info.value)
    assert "'TransformerBlock' matches no module class in the model MassiveModel" in message
    assert "fsdp_conformance.models.reference_models.DecoderLayer" in message
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
        validate_plan(model, policy("monolithic", model, (DecoderLayer,), 1))


def test_unknown_policy_name_lists_the_choices() -> None:
    with pytest.raises(PolicyError) as info:
        policy("best", MassiveModel(SMALL), (DecoderLayer,), 1)  # type: ignore[arg-type]
    assert str(info.value) == (
        "unknown policy 'best'; choose one of recommended, seeds, seeds_verbatim, blocks_only, "
        "monolithic, top_level"
    )


# The registry: every name resolves, the labels of memory and the planner map onto it.


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_name_resolves_to_a_plan(name: str) -> None:
    model = MassiveModel(SMALL)
    units = [
        u.fqn
        for u in plan_units(
            model,
            policy(
                name,
                model,
                (DecoderLayer,),  # type: ignore[arg-type]
                SMALL.min_params,
            ),
        )
    ]
    expected_blocks = name not in ("monolithic", "top_level")
    assert ("layers.0" in units) == expected_blocks, units
    assert units[0] == "" and (len(units) == 1) == (name == "monolithic"), units
    if name == "top_level":  # the root's non-container children: embed and head, not layers
        assert sorted(units) == ["", "embed", "head"], units


def test_built_model_policy_takes_blocks_and_threshold_from_the_spec() -> None:
    from fsdp_conformance.models.model_spec import ModelSpec
    from fsdp_conformance.models.policies import SEED_MIN_PARAMS

    spec = ModelSpec(reference="massive", config=SMALL)
    model = spec.build("meta")
    direct = plan_units(model, seeds_hybrid_policy((DecoderLayer,), SMALL.min_params))
    assert plan_units(model, BuiltModel(spec, model).policy("seeds")) == direct
    # At full scale the seeds keep their literal 2e7, which wraps nothing inside this model.
    full = plan_units(model, BuiltModel(spec, model).policy("seeds", full_scale=True))
    assert full == plan_units(model, seeds_hybrid_policy((DecoderLayer,), SEED_MIN_PARAMS))
    assert full != direct


def test_wrapping_labels_and_planner_names_are_registry_names() -> None:
    from fsdp_conformance.models.policies import wrapping, wrapping_label

    assert dict(WRAPPINGS) == {
        "per_layer": Wrapping("recommended"),
        "monolithic": Wrapping("monolithic"),
        "top_level": Wrapping("top_level"),
        "no_reshard": Wrapping("recommended", reshard_after_forward=False),
    }
    assert all(w.policy in POLICY_NAMES for w in WRAPPINGS.values())
    assert wrapping("no_reshard") == Wrapping("recommended", reshard_after_forward=False)
    with pytest.raises(PolicyError) as info:
        wrapping("flat")
    assert str(info.value) == (
        "unknown wrapping 'flat'; choose one of per_layer, monolithic, top_level, no_reshard"
    )
    assert wrapping_label("recommended") == "per_layer"
    assert wrapping_label("monolithic") == "monolithic" and wrapping_label("seeds") is None
    assert PLAN_POLICIES == ("recommended", "seeds", "monolithic")
    assert set(PLAN_POLICIES) <= set(POLICY_NAMES)
    from fsdp_conformance.plan.model import PlanError, PlanSettings

    with pytest.raises(
        PlanError, match="policy 'root_only' is not one of recommended, seeds, monolithic"
    ):
        PlanSettings(policy="root_only")  # type: ignore[arg-type]


def test_seeds_policy_wraps_each_side_of_a_tied_weight() -> None:
    # The seeds' size lambda wraps `embed` and `head` separately although they share one
    # weight; the recommended policy keeps the weight in the root.
    model = TiedLM(SMALL)
    seeds = [
        u.fqn for u in plan_units(model, seeds_hybrid_policy((DecoderLayer,), SMALL.min_params))
    ]
    assert "embed" in seeds and "head" in seeds
    recommended = [
        u.fqn
        for u in plan_units(model, recommended_policy(model, (DecoderLayer,), SMALL.min_params))
    ]
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
    assert counts == {
        "transformer": 5,
        "size": 10,
        "lambda": 2,
        "or": 6,
        "module_wrap": 15,
        "custom": 6,
    }


@pytest.mark.world_size(2)
def test_negative_control_builder_verdict_catches_a_different_result(ranks: Ranks) -> None:
    # Apply ModuleWrapPolicy({Linear}) but claim transformer_auto_wrap_policy's result.
    values = ranks.run(rank_builders, builder="transformer", fault="module_wrap_applied")
    verdict = verdict_builders(values, {})
    assert not verdict.passed
    assert "+ unexpected unit layers.0.attn (Linear" in verdict.message
    # Per-unit overrides are checked too: CustomPolicy's NO_SHARD head claimed, none applied.
    values = ranks.run(rank_builders, builder="custom", fault="or_applied")
    verdict = verdict_builders(values, {})
    assert not verdict.passed
    assert "unit head: sharding strategy expected NO_SHARD, got FULL_SHARD" in verdict.message
