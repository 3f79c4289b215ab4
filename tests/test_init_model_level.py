"""A model-level init (torchtitan's ``init_weights(buffer_device=None)`` on the root, or
``--model-init pkg.module:fn``): run in place of per-module init, after ``to_empty`` on FSDP2's
DTensor parameters and inside ``summon_full_params(writeback=True)`` on FSDP1, and judged as
the per-module path is: faithful to the eager build, and the same model on every rank.

The model is :mod:`titan_llama` (hand-written as torchtitan writes its Llama). Negative controls:
an ``init_weights`` seeded from the rank, one that scales every block's ``wo`` three times, and
one that forgets a norm; positive: the model as written, and the same init named as a free
function.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_conformance.claims import init
from fsdp_conformance.claims.check import Check, run_check
from fsdp_conformance.fsdp import meta_init
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.model_spec import ModelSpec, root_init_weights
from fsdp_conformance.settings import SettingsError, resolve_settings

sys.path.insert(0, str(Path(__file__).parent))  # the ranks import the model by this name

TITAN = "titan_llama"


def spec(factory: str = "titan_llama", model_init: str | None = None) -> ModelSpec:
    return ModelSpec(
        reference=None,
        factory=f"{TITAN}:{factory}",
        block_cls=("TransformerBlock",),
        model_init=model_init,
    )


def checks(name: str) -> list[Check]:
    return [c for c in init.CHECKS if c.name == name]


# --------------------------------------------------------------------------------------------
# Detection: which models have a model-level init
# --------------------------------------------------------------------------------------------


class NeedsArguments(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def init_weights(self, std: float) -> None:  # a helper, not a model-level init
        nn.init.normal_(self.fc.weight, std=std)


def test_the_roots_init_weights_is_detected_only_when_callable_without_arguments() -> None:
    import titan_llama

    with torch.device("meta"):
        titan = titan_llama.titan_llama()
    assert meta_init.init_contract(spec(), titan) == "init_weights"
    assert root_init_weights(NeedsArguments()) is None
    assert meta_init.init_contract(None, NeedsArguments()) == "reset_parameters"
    named = spec(model_init=f"{TITAN}:init_as_titan")
    assert meta_init.init_contract(named, titan) == "model_init"
    # An explicit per-module init wins over the detected one.
    per_module = ModelSpec(reference=None, factory=f"{TITAN}:titan_llama", init_fn="x:y")
    assert meta_init.init_contract(per_module, titan) == "init_fn"


def test_a_transformers_models_init_weights_is_not_taken_for_a_model_level_init() -> None:
    from fsdp_conformance import hf_models

    with torch.device("meta"):
        model = hf_models.llama(num_layers=1)
    assert callable(model.init_weights)  # transformers' own, called in post_init
    assert meta_init.init_contract(None, model) == "transformers"


def test_the_reference_runs_init_weights_on_the_unsharded_model() -> None:
    import titan_llama

    reference = meta_init.reference_model(spec(), 0)
    eager = titan_llama.titan_llama()  # its constructor's draws come first: not the same
    torch.manual_seed(0)
    eager.init_weights()
    # Values: the same global seed, the same calls in the same order as the user's script.
    for (name, a), (_, b) in zip(
        meta_init.full_state(reference).items(), meta_init.full_state(eager).items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_an_init_weights_leaving_a_tensor_is_named() -> None:
    with pytest.raises(meta_init.InitError) as info:
        meta_init.reference_model(spec("titan_llama_norm_left_out"), 0)
    assert str(info.value) == (
        "the model's init_weights() leaves 1 tensor(s) of NormLeftOut uninitialized: "
        "norm.weight; make it initialize every parameter and buffer of the model "
        "(non-persistent ones included)"
    )


def test_init_fn_and_model_init_together_are_refused_naming_both_flags() -> None:
    cli = {"model": "m:f", "init_fn": "m:a", "model_init": "m:b"}
    with pytest.raises(SettingsError, match="--init-fn and --model-init are both set"):
        resolve_settings(cli, {}, {}, flag_style="cli", cores=lambda: 2)
    with pytest.raises(SettingsError, match="--fsdp-model-init is set but no --fsdp-model"):
        resolve_settings({"model_init": "m:b"}, {}, {}, cores=lambda: 2)


# --------------------------------------------------------------------------------------------
# On ranks: the init checks as the suite runs them
# --------------------------------------------------------------------------------------------


@pytest.mark.world_size(2)
@pytest.mark.parametrize("model_init", [None, f"{TITAN}:init_as_titan"])
def test_a_faithful_model_level_init_passes_every_init_check(
    ranks: Ranks, model_init: str | None
) -> None:
    model = spec(model_init=model_init)
    contract = "model_init" if model_init else "init_weights"
    for name in ("init.no_meta", "init.weights", "init.train_step", "init.broadcast_rank0"):
        for check in checks(name):
            if name == "init.broadcast_rank0" and check.params["version"] == "fsdp1":
                continue  # skipped, its reason tested below
            verdict = run_check(ranks, check, spec=model)
            assert verdict.passed, (name, check.params.get("version"), verdict.message)
            if name == "init.weights":  # the report says the model-level init was used
                used = model_init or "init_weights()"
                assert f"(the model-level init, {used}, run after sharding)" in verdict.message
                drawn = "match its distribution instead" in verdict.message
                assert drawn == (check.params["version"] == "fsdp2"), verdict.message
    (faithful,) = checks("init.weights.faithful")
    verdict = run_check(ranks, faithful, spec=model)
    assert verdict.passed, verdict.message
    assert verdict.message.startswith(f"meta init ({contract}) gives all ")


@pytest.mark.world_size(2)
def test_an_init_weights_seeded_from_the_rank_fails_on_both_versions(ranks: Ranks) -> None:
    for check in checks("init.weights"):
        verdict = run_check(ranks, check, spec=spec("titan_llama_rank_seeded"))
        assert not verdict.passed, check.params["version"]
        assert "the init gives a different model on each rank" in verdict.message
        assert "seed it the same on every rank" in verdict.message


@pytest.mark.world_size(2)
def test_an_init_weights_with_one_projection_wrong_fails_faithful_naming_it(
    ranks: Ranks,
) -> None:
    (faithful,) = checks("init.weights.faithful")
    verdict = run_check(ranks, faithful, spec=spec("titan_llama_one_projection_wrong"))
    assert not verdict.passed
    lines = verdict.message.splitlines()
    assert lines[0].startswith("meta init (init_weights) does not give 2 of ")
    named = sorted(line.split(" ")[2] for line in lines[1:3])
    assert named == ["layers.0.attention.wo.weight", "layers.1.attention.wo.weight"]
    assert all("x)" in line for line in lines[1:3]), lines
    assert lines[-1].startswith("fix: the model's init_weights() must give each tensor")


@pytest.mark.world_size(2)
def test_a_tensor_the_init_leaves_is_one_finding_on_every_init_check(ranks: Ranks) -> None:
    for check in checks("init.no_meta"):
        verdict = run_check(ranks, check, spec=spec("titan_llama_norm_left_out"))
        assert not verdict.passed
        assert verdict.message == (
            "all ranks: the model's init_weights() leaves 1 tensor(s) of NormLeftOut "
            "uninitialized: norm.weight; make it initialize every parameter and buffer of the "
            "model (non-persistent ones included)"
        )


@pytest.mark.world_size(2)
def test_fsdp1_checks_of_a_per_module_param_init_fn_skip_with_the_reason(ranks: Ranks) -> None:
    import dataclasses

    from fsdp_conformance.harness import CheckSkipped

    ranks = dataclasses.replace(ranks, skip=None)  # the skip is what this test looks at
    fsdp1 = [c for c in checks("init.broadcast_rank0") if c.params["version"] == "fsdp1"]
    for check in fsdp1 + checks("init.sync_module_states"):
        with pytest.raises(CheckSkipped, match="initialized by a model-level init after wrapping"):
            run_check(ranks, check, spec=spec())
