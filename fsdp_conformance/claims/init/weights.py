"""``init.no_meta``, ``init.weights`` and ``init.weights.default_path``: a sharded meta init puts
every tensor on the compute device with the single-process reference's values.

One rank function (:func:`rank_weights`) builds on meta, shards, materializes by method and
inspects the result against the reference
(:func:`~fsdp_conformance.fsdp.meta_materialize.reference_for` built from the same seed); each
verdict reads the part of the report it judges. The seeds' checks
(:mod:`~fsdp_conformance.claims.init.seeds`) run the same rank function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.init.common import (
    DEFAULT_SPEC,
    FAULTS,
    InitReport,
    agree_on_failure,
    describe_init_error,
    init_report,
    judge_no_meta,
    judge_weights,
    model_level,
)
from fsdp_conformance.fsdp.meta_init import (
    build_on_meta,
    init_contract,
    reference_model,
)
from fsdp_conformance.fsdp.meta_materialize import (
    inspect_sharded,
    materialize,
    reference_for,
    unwrapped,
)
from fsdp_conformance.fsdp.model_init import MODEL_LEVEL
from fsdp_conformance.fsdp.reference_step import buffers_kept
from fsdp_conformance.fsdp.tensors import listing
from fsdp_conformance.harness import CheckSkipped, RankContext, skip_rank
from fsdp_conformance.models.model_spec import ModelSpec, call_model, without_reset_parameters
from fsdp_conformance.models.policies import PolicyName


def rank_weights(
    ctx: RankContext,
    spec: ModelSpec = DEFAULT_SPEC,
    version: str = "fsdp2",
    method: str = "deterministic",
    seed: int = 0,
    policy: PolicyName = "recommended",
    forward: bool = True,
    fault: str | Sequence[str] | None = None,
) -> InitReport:
    """Meta build, shard, materialize with ``method``; report against the reference.

    ``method`` (:data:`~fsdp_conformance.fsdp.meta_materialize.METHODS`) is a variant the checks
    run (``reset_parameters`` for the default path, the seeds' functions for
    :data:`~fsdp_conformance.claims.init.SEEDS_CHECKS`). ``forward=False`` leaves out the first
    forward, so that the inspection, not torch's error at the forward, reports a tensor left on
    meta. ``fault``: a negative control applied to the sharded build
    (``ranks_seeded_differently``); the reference always uses ``seed``. A failure inside torch
    is caught on every rank and returned as a one-line finding, never a traceback.
    """
    if method == "reset_parameters":
        reason = default_path_inapplicable(spec)
        if reason:
            skip_rank(reason)
    error = None
    try:
        # The reference first: an init that leaves modules uninitialized is named for all
        # of them at once (the sharded path stops at the first).
        reference = reference_for(spec, method, seed, ctx.device, policy)
        # A model-level init on FSDP2 draws per shard: its random tensors are judged by
        # distribution against the unsharded init, told apart by a second seed.
        whole = method == "deterministic" and model_level(spec)
        drawn = reference_model(spec, seed + 1) if whole and version == "fsdp2" else None
        with FAULTS.inject(fault, ctx):
            model = materialize(ctx, spec, version, method, seed, policy=policy)
        if forward:  # FSDP2 and a buffer left on meta only fail here
            # A probe: its train-mode update of running statistics is not the init compared.
            with torch.no_grad(), buffers_kept(model):
                call_model(model, spec.batch(unwrapped(model), batch_size=1, device=ctx.device))
    except CheckSkipped:
        raise  # a capability this torch lacks (every rank alike): a skip, not the finding
    except Exception as exc:  # noqa: BLE001 - torch's refusal (or InitError) is the finding
        error = describe_init_error(exc)
    errors = agree_on_failure(ctx, error)
    if any(errors):
        return {"rank": ctx.rank, "error": error, "errors": errors}
    report = init_report(inspect_sharded(model, reference, ctx, version, drawn))
    report.update({"error": None, "method": method, "version": version})
    if whole:
        report["model_init"] = spec.model_init or "init_weights()"
    return report


def default_path_inapplicable(spec: ModelSpec) -> str | None:
    """Why FSDP1's default meta path does not apply to ``spec``'s model (None: it does).

    The default path calls ``reset_parameters()`` on every module that owns state. A model
    initialized another way (transformers' ``_init_weights``, ``--init-fn``) whose modules
    lack it is outside that path: FSDP1 would raise on the first such module. A model with no
    contract at all is not skipped: its finding (no way to initialize it) is the check's.
    """
    model = build_on_meta(spec).model
    contract = init_contract(spec, model)
    missing = without_reset_parameters(model)
    if contract == "reset_parameters" or not missing:
        return None
    how = {
        "transformers": "transformers' _init_weights",
        "init_fn": f"the init function {spec.init_fn!r}",
        "model_init": f"the model init function {spec.model_init!r}",
    }.get(contract, "its model-level init_weights()")
    return (
        f"FSDP1's default meta path (no param_init_fn) calls reset_parameters() on every module "
        f"that owns state, and {len(missing)} module(s) of {spec.name} have none "
        f"({listing(missing, 3)}): FSDP1 would raise on them. This model is initialized by "
        f"{how}, which init.no_meta and init.weights check; to use the "
        "default path instead, define reset_parameters() on those classes"
    )


def verdict_no_meta(values: Sequence[InitReport], params: Mapping[str, Any]) -> Verdict:
    """Every tensor on the compute device, with values (= the reference's), on every rank."""
    return judge_no_meta(values)


def verdict_weights(values: Sequence[InitReport], params: Mapping[str, Any]) -> Verdict:
    """Local shards = slices of the reference; gathered = the reference; on every rank.

    FSDP1's default path (``method="reset_parameters"``) on a model named with ``--init-fn``:
    the path is checked as it is, and the verdict says that its values are reset_parameters()'s,
    not the init function's (the model's init, which init.weights.faithful compares).
    """
    verdict = judge_weights(values)
    spec = params.get("spec")
    if params.get("method") != "reset_parameters" or not isinstance(spec, ModelSpec):
        return verdict
    contract = init_contract(spec, build_on_meta(spec).model)
    if contract == "init_fn":
        init, fix = f"the init function {spec.init_fn!r}", "pass the init as param_init_fn"
    elif contract in MODEL_LEVEL:
        init = (
            f"the model init function {spec.model_init!r}"
            if spec.model_init
            else "the model-level init_weights()"
        )
        fix = "run the model-level init after wrapping, as init.weights does"
    else:
        return verdict
    note = (
        f"; note: FSDP1's default path calls reset_parameters(), not {init} that initializes "
        "this model: its values are not the model's unless reset_parameters() gives the same "
        f"({fix} instead)"
    )
    return dataclasses.replace(verdict, message=verdict.message + note)
