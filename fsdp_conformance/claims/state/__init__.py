"""The state claim: what a sharded model's state dicts hold, and that loading one gives the
model back, bitwise equal to the single-process reference (docs/state.md).

One module per check family: ``state.round_trip`` (:mod:`.round_trip`: every state-dict kind,
got and loaded), ``state.resume`` (:mod:`.resume`: model and optimizer state, a resumed step
against the unbroken run; ``state.resume.dcp_shardless``, FSDP1's files where a rank holds no
shard of a parameter, a known torch defect), ``state.dcp`` (:mod:`.dcp`:
``torch.distributed.checkpoint`` files loaded into both FSDP versions and one process),
``state.reshard`` (:mod:`.reshard`: saved by fewer ranks, loaded by all), ``state.checkpoint``
(:mod:`.checkpoint`: saved by one run, loaded by another), ``state.checkpoint.optimizer`` and
``state.checkpoint.torch_save`` (:mod:`.across_versions`: model and optimizer state, DCP and
``torch.save``, across runs, torch versions and world sizes),
``state.checkpoint.torch_save.shared_step`` (:mod:`.shared_step`: FSDP1's full optimizer dict in
one process) and, FSDP1 only, ``state.summon`` (:mod:`.summon`: ``summon_full_params``). What
they share: :mod:`.common`. Each family's negative controls are its own ``FAULTS``, beside the
steps they patch.
"""

from __future__ import annotations

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.state.across_versions import (
    rank_across_versions,
    verdict_checkpoint_optimizer,
    verdict_checkpoint_torch_save,
)
from fsdp_conformance.claims.state.checkpoint import rank_checkpoint, verdict_checkpoint
from fsdp_conformance.claims.state.common import DEFAULT_SPEC
from fsdp_conformance.claims.state.dcp import rank_dcp, verdict_dcp
from fsdp_conformance.claims.state.reshard import rank_reshard, verdict_reshard
from fsdp_conformance.claims.state.resume import (
    rank_resume,
    verdict_resume,
    verdict_resume_dcp_shardless,
)
from fsdp_conformance.claims.state.round_trip import rank_round_trip, verdict_round_trip
from fsdp_conformance.claims.state.shared_step import (
    rank_checkpoint_torch_save_shared_step,
    verdict_checkpoint_torch_save_shared_step,
)
from fsdp_conformance.claims.state.summon import rank_summon, verdict_summon

CHECKS: tuple[Check, ...] = (
    variants(
        "state.round_trip",
        {
            "fsdp1": "FULL (rank 0 only and not), SHARDED and LOCAL state dicts: got and loaded into "
            "another sharded model, equal to the reference bitwise",
            "fsdp2": "get/set_model_state_dict full (rank 0 with broadcast, every rank) and sharded: "
            "got and loaded into another sharded model, equal to the reference bitwise",
        },
        rank_round_trip,
        verdict_round_trip,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "state.resume",
        {
            "fsdp1": "FSDP.optim_state_dict / optim_state_dict_to_load with FULL and SHARDED model "
            "state after two AdamW steps: the resumed step equals the unbroken run bitwise",
            "fsdp2": "get/set_optimizer_state_dict and get/set_model_state_dict, full and sharded, "
            "after two AdamW steps: the resumed step equals the unbroken run bitwise",
        },
        rank_resume,
        verdict_resume,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "state.resume.dcp_shardless",
        "FSDP1 model and optimizer state saved with get_state_dict and torch.distributed.checkpoint "
        "(real files) where some rank holds no shard of a parameter (fewer rows than ranks), "
        "loaded with dcp.load and set_state_dict: the resumed step equals the unbroken run "
        "bitwise (a known defect on the torch versions in expectations.toml; skipped on a model "
        "without such a parameter, whose dcp resume state.resume checks)",
        rank_resume,
        verdict_resume_dcp_shardless,
        versions=("fsdp1",),
        specs=(DEFAULT_SPEC,),
        dcp_shardless=True,
    )
    + variants(
        "state.dcp",
        {
            "fsdp1": "SHARDED_STATE_DICT saved with torch.distributed.checkpoint (real files), loaded "
            "into FSDP1, FSDP2 and one unsharded process: equal to the reference bitwise",
            "fsdp2": "get_model_state_dict saved with torch.distributed.checkpoint (real files), "
            "loaded into FSDP2, FSDP1 and one unsharded process: equal to the reference "
            "bitwise",
        },
        rank_dcp,
        verdict_dcp,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "state.reshard",
        {
            "fsdp1": "SHARDED_STATE_DICT saved with torch.distributed.checkpoint by half the ranks (a "
            "process group of their own), loaded by every rank into FSDP1 and FSDP2: equal "
            "to the reference bitwise",
            "fsdp2": "get_model_state_dict saved with torch.distributed.checkpoint by half the ranks "
            "(a mesh of their own), loaded by every rank into FSDP2 and FSDP1: equal to the "
            "reference bitwise",
        },
        rank_reshard,
        verdict_reshard,
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "state.checkpoint",
        "a checkpoint saved by one run (run --save-checkpoint DIR) loaded by another, on another "
        "torch (--load-checkpoint DIR) into FSDP1, FSDP2 and one process: the saved values, bitwise "
        "(only in runs given one of the two flags)",
        rank_checkpoint,
        verdict_checkpoint,
        specs=(DEFAULT_SPEC,),
        opt_in=("save_to", "load_from"),
        save_to=None,
        load_from=None,
    )
    + variants(
        "state.checkpoint.optimizer",
        "model and AdamW state after one step saved by one run with get_state_dict and "
        "torch.distributed.checkpoint, loaded by another (maybe another torch) with dcp.load and "
        "set_state_dict at its world size and in one process, every saved world size: the saved "
        "values bitwise, the next step the unbroken run's (only in runs given --save-checkpoint "
        "or --load-checkpoint)",
        rank_across_versions,
        verdict_checkpoint_optimizer,
        specs=(DEFAULT_SPEC,),
        opt_in=("save_to", "load_from"),
        family="optimizer",
        save_to=None,
        load_from=None,
    )
    + variants(
        "state.checkpoint.torch_save",
        "FSDP1 full, sharded and local model and optimizer state dicts written with torch.save by "
        "one run, read by another with torch.load's defaults and loaded (the full one also "
        "resharded, and in one process): the saved values bitwise, the next step the unbroken "
        "run's (only in runs given --save-checkpoint or --load-checkpoint)",
        rank_across_versions,
        verdict_checkpoint_torch_save,
        versions=("fsdp1",),
        specs=(DEFAULT_SPEC,),
        opt_in=("save_to", "load_from"),
        family="torch_save",
        save_to=None,
        load_from=None,
    )
    + variants(
        "state.checkpoint.torch_save.shared_step",
        "FSDP1 full optimizer state dict written with torch.save, read with torch.load's defaults "
        "and loaded into one unsharded process with set_optimizer_state_dict: every parameter's "
        "AdamW step count after the next step is the unbroken run's (a known defect on the torch "
        "versions in expectations.toml; only in runs given --save-checkpoint or "
        "--load-checkpoint)",
        rank_checkpoint_torch_save_shared_step,
        verdict_checkpoint_torch_save_shared_step,
        versions=("fsdp1",),
        specs=(DEFAULT_SPEC,),
        opt_in=("save_to", "load_from"),
        save_to=None,
        load_from=None,
    )
    + variants(
        "state.summon",
        "FSDP1 summon_full_params (writeback on and off, rank0_only, with_grads): whole parameters "
        "equal to the reference inside, a change inside kept only with writeback, whole gradients "
        "equal to a single-process backward",
        rank_summon,
        verdict_summon,
        versions=("fsdp1",),
        specs=(DEFAULT_SPEC,),
    )
    + variants(
        "state.summon.rank0_discard",
        "FSDP1 summon_full_params(rank0_only=True, writeback=False): a change made inside on every "
        "rank is discarded after the context, as the docstring says (a known defect on the torch "
        "versions in expectations.toml)",
        rank_summon,
        verdict_summon,
        versions=("fsdp1",),
        specs=(DEFAULT_SPEC,),
        cases=("rank0_only_write",),
    )
)
