"""The state claim: state dicts got from a sharded model and
loaded into another, against the single-process reference, bitwise; a run resumed from model
and optimizer state dicts against the unbroken run, bitwise; a distributed checkpoint (real
files) loaded into both FSDP versions and into one unsharded process, against the reference.

Each positive run has a negative control on the same model: a value changed before the load (in
every full dict, in rank 0's shard of a sharded or local one) fails every loaded kind; a
reference of another seed fails every kind, as got and as loaded; a rank-0-only getter that hands
rank 1 a state dict fails; a run resumed without the optimizer's state fails; a checkpoint
written with a wrong shard fails every target.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from fsdp_conformance import hf_models
from fsdp_conformance.claims import state
from fsdp_conformance.claims.check import Check, run_check
from fsdp_conformance.claims.state import checkpoint, common, resume, summon
from fsdp_conformance.fsdp import state_dict_kinds
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.model_spec import ModelSpec

pytestmark = pytest.mark.cpu


def by_version(name: str) -> dict[str, Check]:
    """The claim's check ``name``, one per FSDP version."""
    return {c.params["version"]: c for c in state.CHECKS if c.name == name}


CHECK = by_version("state.round_trip")


def gpt2_one_layer() -> Any:
    """GPT-2-style, tied embeddings: the head and the embedding are one tensor under two keys."""
    return hf_models.gpt2(num_layers=1)


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Every rank's values of one clean run per (device type, world size, version): the positive
    test and the parent-side negative controls judge the same values."""
    return {}


def clean_values(
    ranks: Ranks, shared: dict[tuple[Any, ...], list[dict[str, Any]]], version: str
) -> list[dict[str, Any]]:
    key = (ranks.device_type, ranks.world_size, version)
    if key not in shared:
        shared[key] = ranks.run(CHECK[version].rank_fn, **CHECK[version].params)
    return shared[key]


@pytest.mark.parametrize("version", sorted(CHECK))
def test_every_kind_got_and_loaded_equals_the_reference_bitwise(
    ranks: Ranks,
    shared_runs: dict,
    version: str,
) -> None:
    values = clean_values(ranks, shared_runs, version)
    verdict = CHECK[version].verdict(values, CHECK[version].params)
    assert verdict.passed, verdict.message
    assert verdict.figures["kinds"] == list(state_dict_kinds.KINDS[version])
    assert verdict.figures["failed_kinds"] == []
    for value in values:
        got = value["kinds"]
        # Observed: what each getter handed this rank.
        for kind in state_dict_kinds.RANK0_ONLY & set(got):
            assert (got[kind]["got"]["entries"] > 0) == (value["rank"] == 0), (kind, got[kind])
        sharded_type = "DTensor" if version == "fsdp2" else "ShardedTensor"
        assert sharded_type in got["sharded"]["got"]["types"], got["sharded"]


@pytest.mark.parametrize("version", sorted(CHECK))
def test_a_value_changed_before_loading_fails_every_loaded_kind(ranks: Ranks, version: str) -> None:
    check = CHECK[version]
    verdict = run_check(ranks, check, **{**check.params, "fault": "value_changed_before_loading"})
    loaded = [k for k in state_dict_kinds.KINDS[version] if k not in state_dict_kinds.GET_ONLY]
    assert not verdict.passed
    assert verdict.figures["failed_kinds"] == sorted(loaded), verdict.message
    assert "after loading:" in verdict.message and "expected torch.float32" in verdict.message


@pytest.mark.parametrize("version", sorted(CHECK))
def test_a_reference_of_another_seed_fails_every_kind_as_got_and_as_loaded(
    ranks: Ranks,
    shared_runs: dict,
    version: str,
) -> None:
    check = CHECK[version]
    verdict = check.verdict(clean_values(ranks, shared_runs, version), {**check.params, "seed": 1})
    assert not verdict.passed
    assert verdict.figures["failed_kinds"] == sorted(state_dict_kinds.KINDS[version])
    assert "as got:" in verdict.message and "after loading:" in verdict.message


def test_a_rank0_only_getter_that_hands_rank_1_a_dict_fails(
    ranks: Ranks,
    shared_runs: dict,
) -> None:
    if ranks.world_size < 2:
        pytest.skip("needs a rank 1: world size 2 or more")
    values = copy.deepcopy(clean_values(ranks, shared_runs, "fsdp2"))
    rank1 = next(v for v in values if v["rank"] == 1)
    rank1["kinds"]["full_rank0"]["got"]["entries"] = 16
    verdict = CHECK["fsdp2"].verdict(values, CHECK["fsdp2"].params)
    assert not verdict.passed and verdict.figures["failed_kinds"] == ["full_rank0"]
    assert "rank 1 got 16 entries from a rank-0-only getter (expected none)" in verdict.message


@pytest.mark.parametrize("version", sorted(CHECK))
def test_a_tied_transformers_model_round_trips_and_its_negative_control_fails(
    ranks: Ranks,
    version: str,
) -> None:
    spec = ModelSpec(reference=None, factory=f"{__name__}:gpt2_one_layer")
    check = CHECK[version]
    clean = run_check(ranks, check, **{**check.params, "spec": spec})
    assert clean.passed, clean.message
    broken = run_check(
        ranks, check, **{**check.params, "spec": spec, "fault": "value_changed_before_loading"}
    )
    assert not broken.passed and broken.figures["failed_kinds"], broken.message


RESUME = by_version("state.resume")


@pytest.mark.parametrize("version", sorted(RESUME))
def test_a_run_resumed_from_model_and_optimizer_state_equals_the_unbroken_run(
    ranks: Ranks,
    version: str,
) -> None:
    check = RESUME[version]
    verdict = run_check(ranks, check, **check.params)
    assert verdict.passed, verdict.message
    assert verdict.figures["kinds"] == list(resume.RESUME_KINDS[version])
    assert "resumed run equals the unbroken one" in verdict.message


@pytest.mark.parametrize("version", sorted(RESUME))
def test_a_resumed_run_without_the_optimizer_state_fails_every_kind(
    ranks: Ranks,
    version: str,
) -> None:
    check = RESUME[version]
    verdict = run_check(ranks, check, **{**check.params, "fault": "optimizer_not_loaded"})
    assert not verdict.passed
    assert verdict.figures["failed_kinds"] == sorted(resume.RESUME_KINDS[version])
    assert "after the resumed step:" in verdict.message


def test_a_rank0_only_optimizer_getter_that_reaches_rank_1_fails_that_kind() -> None:
    # Judged in the parent: the clean run's values, with rank 1 handed optimizer state.
    check = RESUME["fsdp2"]
    values = [
        {
            "rank": r,
            "unbroken": {"loss": 1.0, "loss_hex": "x", "digests": {}},
            "kinds": {
                "full_rank0": {"loss": 1.0, "loss_hex": "x", "digests": {}, "optim_entries": 16}
            },
        }
        for r in (0, 1)
    ]
    verdict = check.verdict(values, check.params)
    assert verdict.figures["failed_kinds"] == ["full_rank0"]
    assert "handed this rank state for 16 parameter(s) (expected none)" in verdict.message
    values[1]["kinds"]["full_rank0"]["optim_entries"] = 0
    assert check.verdict(values, check.params).passed


def test_a_snapshot_is_a_copy_a_later_step_does_not_reach() -> None:
    live = {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}
    saved = resume.snapshot(live)
    live["step"] += 1
    live["exp_avg"].mul_(0)
    assert float(saved["step"]) == 2.0 and saved["exp_avg"].tolist() == [1.0, 1.0, 1.0]


DCP = by_version("state.dcp")


@pytest.mark.parametrize("version", sorted(DCP))
def test_a_distributed_checkpoint_loads_into_both_versions_and_one_process_bitwise(
    ranks: Ranks,
    version: str,
) -> None:
    check = DCP[version]
    verdict = run_check(ranks, check, **check.params)
    assert verdict.passed, verdict.message
    assert verdict.figures["targets"] == ["fsdp1", "fsdp2", "unsharded"]
    assert verdict.figures["files"] >= ranks.world_size  # a file per rank, and the metadata
    assert f"at world size {ranks.world_size}" in verdict.message


@pytest.mark.parametrize("version", sorted(DCP))
def test_a_checkpoint_with_a_wrong_shard_fails_every_target(ranks: Ranks, version: str) -> None:
    check = DCP[version]
    verdict = run_check(ranks, check, **{**check.params, "fault": "wrong_shards_written"})
    assert not verdict.passed
    assert verdict.figures["failed_targets"] == ["fsdp1", "fsdp2", "unsharded"], verdict.message


RESHARD = by_version("state.reshard")


@pytest.mark.world_size(4)
@pytest.mark.parametrize("version", sorted(RESHARD))
def test_a_checkpoint_saved_at_world_size_2_loads_at_4_into_both_versions_bitwise(
    ranks: Ranks,
    version: str,
) -> None:
    check = RESHARD[version]
    verdict = run_check(ranks, check, **check.params)
    assert verdict.passed, verdict.message
    assert (verdict.figures["saved_world_size"], verdict.figures["loaded_world_size"]) == (2, 4)
    assert verdict.figures["targets"] == ["fsdp1", "fsdp2"]


@pytest.mark.parametrize("version", sorted(RESHARD))
def test_a_resharded_checkpoint_with_a_wrong_shard_fails_both_versions(
    ranks: Ranks,
    version: str,
) -> None:
    check = RESHARD[version]
    verdict = run_check(ranks, check, **{**check.params, "fault": "wrong_shards_written"})
    assert not verdict.passed
    assert verdict.figures["saved_world_size"] == max(1, ranks.world_size // 2)
    assert verdict.figures["failed_targets"] == ["fsdp1", "fsdp2"], verdict.message


@pytest.mark.parametrize("version", sorted(DCP))
def test_a_tied_transformers_checkpoint_loads_everywhere_and_a_wrong_shard_fails(
    ranks: Ranks,
    version: str,
) -> None:
    spec = ModelSpec(reference=None, factory=f"{__name__}:gpt2_one_layer")
    check = DCP[version]
    clean = run_check(ranks, check, **{**check.params, "spec": spec})
    assert clean.passed, clean.message
    broken = run_check(
        ranks, check, **{**check.params, "spec": spec, "fault": "wrong_shards_written"}
    )
    assert broken.figures["failed_targets"] == ["fsdp1", "fsdp2", "unsharded"], broken.message


(SUMMON,) = by_version("state.summon").values()


def test_summon_full_params_shows_the_reference_and_keeps_a_change_only_with_writeback(
    ranks: Ranks,
) -> None:
    verdict = run_check(ranks, SUMMON, **SUMMON.params)
    assert verdict.passed, verdict.message
    assert verdict.figures["cases"] == ["writeback", "no_writeback", "rank0_only", "with_grads"]
    assert "with_grads: every gradient whole inside and equal to a single-process" in (
        verdict.message
    )


def test_gradients_summoned_without_with_grads_fail_that_case_only(ranks: Ranks) -> None:
    # with_grads=True is what makes summon_full_params gather the gradients too; without it no
    # parameter has a whole gradient inside the context.
    verdict = run_check(ranks, SUMMON, **{**SUMMON.params, "fault": "grads_not_summoned"})
    assert not verdict.passed and verdict.figures["failed_cases"] == ["with_grads"]
    assert "no whole gradient inside the context" in verdict.message
    assert "summoned without with_grads=True" in verdict.message


def test_a_writeback_that_does_not_write_back_fails_that_case_only(ranks: Ranks) -> None:
    verdict = run_check(ranks, SUMMON, **{**SUMMON.params, "fault": "writeback_ignored"})
    assert not verdict.passed and verdict.figures["failed_cases"] == ["writeback"]
    assert "after the context:" in verdict.message


TWO_TIES = ModelSpec(
    reference=None, factory="tests.verdict_models:two_ties_model", block_cls=("Block",)
)


def test_aliases_name_every_tie_of_a_module_weights_and_biases() -> None:
    from tests.verdict_models import two_ties_model

    tied = summon.aliases(two_ties_model())
    assert tied["embed.weight"] == ["embed.weight", "head.decoder.weight"]
    assert tied["head.decoder.bias"] == ["head.bias", "head.decoder.bias"]
    assert tied["head.transform.weight"] == ["head.transform.weight"]


def test_summon_changes_a_tied_parameter_under_every_alias(ranks: Ranks) -> None:
    # Before: the first parameter by name (embed.weight) is tied, FSDP1 changed both aliases,
    # and the check expected only that name to change: "head.decoder.weight: expected sum ...,
    # got ..." (a tied Llama and Gemma-2 failed so on lm_head.weight).
    params = {**SUMMON.params, "spec": TWO_TIES, "cases": ("writeback",)}
    values = ranks.run(SUMMON.rank_fn, **params)
    verdict = SUMMON.verdict(values, params)
    assert verdict.passed, verdict.message
    assert all(v["cases"]["writeback"]["changed"] == "embed.weight" for v in values)
    # The negative control, on the same values: one alias left as it was (a split tie) fails.
    reference = common.build(TWO_TIES, 0)
    before = common.digests(reference.state_dict())["head.decoder.weight"]
    split = copy.deepcopy(values)
    split[1]["cases"]["writeback"]["after"]["head.decoder.weight"] = before
    verdict = SUMMON.verdict(split, params)
    assert not verdict.passed and verdict.figures["failed_cases"] == ["writeback"]
    assert "after the context: head.decoder.weight: expected" in verdict.message


(RANK0_DISCARD,) = by_version("state.summon.rank0_discard").values()


def test_rank0_only_without_writeback_fails_exactly_where_an_expectation_names_the_defect(
    ranks: Ranks,
) -> None:
    """The packaged expectation, for real: on the torch versions it names, the case fails (and
    the report says xfailed); on any other torch it must pass, or the defect is new there."""
    from fsdp_conformance.claims.check import expectation_for

    verdict = run_check(ranks.configured(xfail=None), RANK0_DISCARD)
    expected = expectation_for(ranks, RANK0_DISCARD, RANK0_DISCARD.params)
    if expected is None:
        assert verdict.passed, (
            "fails on a torch no expectation names: record it in "
            "fsdp_conformance/expectations.toml\n" + verdict.message
        )
    else:
        assert not verdict.passed and verdict.figures["failed_cases"] == ["rank0_only_write"]
        # Only the ranks that held a shard kept the change: a tensor half changed.
        assert "after the context: embed.weight" in verdict.message


# --------------------------------------------------------------------------------------------
# state.checkpoint: saved by one run, loaded by another (run --save-/--load-checkpoint)
# --------------------------------------------------------------------------------------------

CHECKPOINT = by_version("state.checkpoint")


def test_the_checkpoint_check_runs_only_in_a_run_that_gives_a_folder(tmp_path: Any) -> None:
    from fsdp_conformance.gate import suite

    names = {c.name for c, _ in suite.select_checks(state.CHECKS, None)}
    assert "state.checkpoint" not in names and "state.dcp" in names
    chosen = suite.select_checks(
        state.CHECKS, None, "state.checkpoint", {"save_to": str(tmp_path), "load_from": None}
    )
    assert [
        (c.name, p["save_to"], p["load_from"]) for c, p in chosen if c.name == "state.checkpoint"
    ] == [("state.checkpoint", str(tmp_path), None)] * 2
    # The substring selects the training-state families too (tests/test_state_across_versions.py),
    # each given the same folder.
    assert all(
        c.name.startswith("state.checkpoint") and p["save_to"] == str(tmp_path) for c, p in chosen
    )


@pytest.mark.parametrize("version", sorted(CHECKPOINT))
def test_a_checkpoint_saved_by_one_run_loads_in_another_with_the_saved_values(
    ranks: Ranks,
    version: str,
    tmp_path: Any,
) -> None:
    check = CHECKPOINT[version]
    saved = run_check(ranks, check, **{**check.params, "save_to": str(tmp_path)})
    assert saved.passed, saved.message
    folder = tmp_path / f"{version}-{check.params['spec'].name}"
    manifest = __import__("json").loads((folder / checkpoint.MANIFEST).read_text())
    assert (manifest["torch"], manifest["world_size"]) == (torch.__version__, ranks.world_size)
    loaded = run_check(ranks, check, **{**check.params, "load_from": str(tmp_path)})
    assert loaded.passed, loaded.message
    assert loaded.figures["checkpoint_torch"] == torch.__version__
    # The same figures on both sides: compare shows only what differs.
    assert loaded.figures == saved.figures
    assert loaded.figures["failed"] == []
    # Negative controls: a loader that reads one wrong value fails every target; a save that
    # writes rank 0's shards changed fails its read-back.
    wrong = run_check(
        ranks, check, **{**check.params, "load_from": str(tmp_path), "fault": "wrong_value_read"}
    )
    assert wrong.figures["failed"] == ["load:fsdp1", "load:fsdp2", "load:unsharded"], wrong.message
    bad_save = run_check(
        ranks,
        check,
        **{**check.params, "save_to": str(tmp_path / "again"), "fault": "wrong_shards_written"},
    )
    assert bad_save.figures["failed"] == ["save:fsdp1", "save:fsdp2", "save:unsharded"], (
        bad_save.message
    )


def test_loading_from_a_folder_without_the_variant_skips_naming_the_save_flag(
    ranks: Ranks,
    tmp_path: Any,
) -> None:
    check = CHECKPOINT["fsdp2"]
    # Every rank skips, so the plugin's skip (pytest.skip) is what run_check raises.
    with pytest.raises(pytest.skip.Exception, match="run --save-checkpoint"):
        run_check(ranks, check, **{**check.params, "load_from": str(tmp_path)})


def test_saving_into_a_folder_of_other_files_is_refused_and_leaves_them(
    ranks: Ranks,
    tmp_path: Any,
) -> None:
    from fsdp_conformance.harness import RankFailure

    check = CHECKPOINT["fsdp1"]
    folder = tmp_path / f"fsdp1-{check.params['spec'].name}"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(RankFailure, match="not a checkpoint of this suite"):
        run_check(ranks, check, **{**check.params, "save_to": str(tmp_path)})
    assert (folder / "notes.txt").read_text() == "mine"
