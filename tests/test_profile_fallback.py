"""A model whose forward cannot run on meta tensors (it reads a value with ``Tensor.item()``):
the memory checks profile its activations on the CPU instead (the same bytes), and the planner,
which plans at full scale on meta only, says it cannot plan it (the plan-trust check skips with
that reason) instead of an error from every memory check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_conformance.claims.memory.plan_estimate_matches import verdict_plan_estimate_matches
from fsdp_conformance.harness import CheckSkipped
from fsdp_conformance.measure import profile
from fsdp_conformance.measure.bound import MeasureError
from fsdp_conformance.models.model_spec import ModelSpec

pytestmark = pytest.mark.cpu

DATA_DEPENDENT = ModelSpec(
    reference=None, factory="tests.trait_models:data_dependent", block_cls=("ScaledBlock",)
)
TWIN = ModelSpec(reference=None, factory="tests.trait_models:token_model", block_cls=("Block",))


def _saved(spec: ModelSpec, device: str) -> list[int]:
    units, acts, _ = profile._profile_on(device, spec, 2)
    return [acts.saved_bytes.get(u.fqn, 0) for u in units]


def test_a_forward_that_runs_on_meta_profiles_the_same_bytes_on_the_cpu() -> None:
    # What the fallback measures is what meta measures: the same model, two devices.
    assert _saved(TWIN, "cpu") == _saved(TWIN, "meta")
    assert sum(_saved(TWIN, "meta")) > 0


def test_a_forward_that_needs_values_is_profiled_on_the_cpu() -> None:
    with pytest.raises(profile._ForwardFailed) as failed:
        profile._profile_on("meta", DATA_DEPENDENT, 2)
    assert "item()" in failed.value.line("meta"), failed.value.line("meta")
    state = torch.random.get_rng_state()
    units, config = profile.plan_step(DATA_DEPENDENT, 2, "fsdp2")
    assert torch.equal(torch.random.get_rng_state(), state)  # the rank's draws are untouched
    assert config.activations is not None
    # The same bytes as its twin, whose forward runs on meta: only the .item() differs.
    assert [config.activations.saved_bytes.get(u.fqn, 0) for u in units] == _saved(TWIN, "meta")


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this forward fails on every device")


def test_a_forward_that_fails_everywhere_names_both_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = ModelSpec(
        reference=None, factory="tests.trait_models:data_dependent", block_cls=("Linear",)
    )
    monkeypatch.setattr(ModelSpec, "build", lambda self, device="cpu", **kw: _Broken().to(device))
    with pytest.raises(MeasureError, match="on the meta device .* nor on the CPU"):
        profile._profile_on_meta(spec, 2)


def test_the_planner_cannot_plan_it_and_the_trust_check_says_so() -> None:
    with pytest.raises(CheckSkipped, match="the planner cannot plan this model.*on meta failed"):
        verdict_plan_estimate_matches([], {"spec": DATA_DEPENDENT, "version": "fsdp2"})
