"""``stack.checkpointing``: activation checkpointing through torch's public APIs under FSDP1 and
FSDP2, trained against the reference, with the recompute, the collectives and the state-dict
FQNs observed; and its negative controls (``claims/stack/checkpointing.py`` ``FAULTS``)."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.claims import stack
from fsdp_conformance.claims.stack.checkpointing import SETTINGS
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.cpu

MAIN = {c.params["version"]: c for c in stack.CHECKS if c.name == "stack.checkpointing"}
OUTSIDE = next(c for c in stack.CHECKS if c.name == "stack.checkpointing.reentrant_outside_unit")
#: Every FSDP1 setting of both checks: one rank call judged by both verdicts.
FSDP1_ALL = ("none", *SETTINGS[("fsdp1", "main")], *SETTINGS[("fsdp1", "reentrant_outside_unit")])


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Every rank's values of one clean run per (version, device type, world size)."""
    return {}


def clean_values(ranks: Ranks, shared: dict[tuple[Any, ...], Any], version: str) -> Any:
    key = (version, ranks.device_type, ranks.world_size)
    if key not in shared:
        check = MAIN[version]
        settings = FSDP1_ALL if version == "fsdp1" else ()
        shared[key] = ranks.run(check.rank_fn, **check.params, settings=settings)
    return shared[key]


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_checkpointing_trains_as_the_reference_recomputes_and_keeps_fqns(
    ranks: Ranks, shared_runs: dict, version: str
) -> None:
    check = MAIN[version]
    verdict = check.verdict(clean_values(ranks, shared_runs, version), check.params)
    assert verdict.passed, verdict.message
    data = verdict.data
    assert data["none"]["module_forwards"].get("backward", {}) == {}
    for setting in SETTINGS[(version, "main")]:
        # every block's modules ran forward again in backward, nothing outside the blocks
        bwd = data[setting]["module_forwards"]["backward"]
        assert set(bwd) == {"layers.0", "layers.1"}, (setting, bwd)
        assert data[setting]["all_gathers_per_unit"] == data["none"]["all_gathers_per_unit"]


def test_fsdp1_reentrant_checkpoint_around_the_unit_all_gathers_each_block_twice(
    ranks: Ranks, shared_runs: dict
) -> None:
    # torch 2.13: apply_activation_checkpointing(REENTRANT) before wrapping puts the unit's
    # hooks inside the checkpointed region; the recompute's forward all-gathers the block and
    # reshards it, and the pre-backward hook all-gathers it again. The numbers still agree.
    values = clean_values(ranks, shared_runs, "fsdp1")
    verdict = OUTSIDE.verdict(values, OUTSIDE.params)
    assert not verdict.passed
    for unit in ("layers.0", "layers.1"):  # each unit named by torch's own handle
        assert (
            f"before_wrap REENTRANT: backward 0: 2 all_gather(s) for unit '{unit}', expected 1"
        ) in verdict.message
    assert "update" not in verdict.message and "keys" not in verdict.message
    assert verdict.figures["before_wrap_reentrant.backward_all_gathers"] == 5


def with_fault(ranks: Ranks, version: str, fault: str, settings: tuple[str, ...]) -> Any:
    check = MAIN[version]
    params = {**check.params, "settings": ("none", *settings)}
    return check.verdict(ranks.run(check.rank_fn, **params, fault=fault), params)


def test_dropped_checkpointing_fails_on_the_recompute_count(ranks: Ranks) -> None:
    verdict = with_fault(
        ranks,
        "fsdp1",
        "checkpoint_dropped",
        ("after_wrap NO_REENTRANT", "before_wrap NO_REENTRANT"),
    )
    assert not verdict.passed
    assert "after_wrap NO_REENTRANT: backward 0: 0 forward(s) block 'layers.0'" in verdict.message
    assert "before_wrap NO_REENTRANT: backward 0: 0 forward(s)" in verdict.message
    assert "update" not in verdict.message, "the numbers agree; only the recompute is missing"


def test_a_recompute_that_differs_and_prefixed_fqns_fail(ranks: Ranks) -> None:
    verdict = with_fault(
        ranks,
        "fsdp2",
        ["recompute_perturbed", "keys_prefixed", "optimizer_fqns_prefixed"],  # type: ignore[arg-type]
        SETTINGS[("fsdp2", "main")],
    )
    assert not verdict.passed
    for setting in SETTINGS[("fsdp2", "main")]:
        assert f"{setting}: step 0 update" in verdict.message
        assert (
            f"{setting}: model get_model_state_dict keys differ from the plain model's"
            in verdict.message
        )
        assert f"{setting}: optimizer state keys differ" in verdict.message
    assert "none: step" not in verdict.message


def test_a_reentrant_block_torch_leaves_out_of_backward_is_named_with_the_fix(
    ranks: Ranks, shared_runs: dict
) -> None:
    # ViT (measured): its first block, the embeddings, takes pixels that need no gradient; under
    # REENTRANT torch warns and backward never reaches it. The clean values with torch's warning
    # put on one rank's reentrant setting: the verdict names it and the fix.
    import copy

    check = MAIN["fsdp2"]
    values = copy.deepcopy(clean_values(ranks, shared_runs, "fsdp2"))
    run = next(r for r in values[1]["runs"] if r["setting"] == "before_shard REENTRANT")
    run["lost_gradients"] = ["None of the inputs have requires_grad=True. Gradients will be None"]
    verdict = check.verdict(values, check.params)
    assert not verdict.passed
    assert (
        "rank 1: before_shard REENTRANT: torch warned in forward: 'None of the inputs have "
        "requires_grad=True. Gradients will be None'"
    ) in verdict.message
    assert "use CheckpointImpl.NO_REENTRANT for it" in verdict.message
