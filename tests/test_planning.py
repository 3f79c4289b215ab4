"""``fsdp-conformance plan``: the wrap plan and memory estimate at full scale, and its trust.

The 70B preset is planned in this process on meta (a few seconds, nothing allocated); so is the
FSDP2 cross-check, through ``cli.main``: it makes its fake process group and destroys it within
the call (twice in one process works), so it runs in a subprocess only where this process holds
a default process group of its own (pytest under torchrun). The trust test measures real steps
on the rank pools.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from torch_probe import probe

from fsdp_conformance import cli, cli_parser
from fsdp_conformance.claims import all_checks
from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.memory import CHECKS as MEMORY_CHECKS
from fsdp_conformance.claims.memory.plan_estimate_matches import (
    HOST_TERM,
    TRUST_MAX_RATIO,
    TRUST_MIN_RATIO,
    compare_to_measurement,
    default_cases,
    estimate_for_case,
    judge_estimates,
    rank_plan_estimate_matches,
    trust_settings,
    verdict_plan_estimate_matches,
)
from fsdp_conformance.gate import suite
from fsdp_conformance.harness import RankContext, Ranks
from fsdp_conformance.measure.bound import Bound, BoundTerm, per_layer_bound
from fsdp_conformance.models.llama import LLAMA_PRESETS
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.reference_models import LlamaConfig, ModelConfig
from fsdp_conformance.models.units import UnitInfo
from fsdp_conformance.plan.estimate import (
    CLAIM_WORLD_SIZES,
    DEFAULT_RESERVE,
    SHARDED_TERMS,
    UNIT_TERMS,
    DeviceReserve,
    ModelPlan,
    breakdown,
    compare_policies,
    devices_needed,
    plan_model,
    term_sum,
)
from fsdp_conformance.plan.model import (
    POLICIES,
    ModelChoice,
    PlanError,
    PlanSettings,
    build_meta_model,
    checkpoint_ops,
    choose_model,
)
from fsdp_conformance.plan.report import (
    _nested_note,
    format_comparison,
    format_plan_tree,
    plan_report,
)
from fsdp_conformance.sizes import format_bytes

GB = 10**9
GiB = 2**30


@pytest.fixture(scope="module")
def llama70b() -> ModelChoice:
    return choose_model(preset="70b")


@pytest.fixture(scope="module")
def meta70(llama70b: ModelChoice) -> Any:
    """One meta build of the 70B preset for every plan here (plan_model leaves it as it was)."""
    return build_meta_model(llama70b)


@pytest.fixture(scope="module")
def plan70(llama70b: ModelChoice, meta70: Any) -> ModelPlan:
    return plan_model(llama70b, PlanSettings(), meta70)


# ------------------------------------------------------------------------------------------
# The plan and the estimate at full scale (meta, this process)
# ------------------------------------------------------------------------------------------


def test_70b_recommended_plan_is_one_unit_per_block_plus_embeddings_and_output(
    plan70: ModelPlan,
) -> None:
    c = LLAMA_PRESETS["70b"]
    units = {u.fqn: u for u in plan70.units}
    assert len(units) == c.num_layers + 3  # root (final norm), embeddings, blocks, output
    assert units[""].numel == c.dim and units[""].params == ("norm.weight",)
    assert units["tok_embeddings"].numel == units["output"].numel == c.vocab_size * c.dim
    kv = c.kv_heads * c.head_dim
    block = c.dim * (2 * c.dim + 2 * kv) + 3 * c.dim * c.hidden + 2 * c.dim
    assert {units[f"layers.{i}"].numel for i in range(c.num_layers)} == {block}
    assert 68e9 < plan70.total_numel < 70e9


def test_estimate_is_memorys_per_layer_bound_not_a_second_formula(
    plan70: ModelPlan,
) -> None:
    for w in (8, 1024):
        assert plan70.estimate(w) == per_layer_bound(plan70.units, plan70.step_config(w))
    config = plan70.step_config(1024)
    # The defaults, as documented: fp32 sharded state, bf16 compute, AdamW, batch 1 x 4096.
    assert (config.param_bytes, config.compute_bytes, config.optimizer) == (4, 2, "adamw")
    assert plan70.activations.input_bytes == 1 * 4096 * 8  # int64 token ids
    bound = plan70.estimate(1024)
    assert bound.term("sharded params").bytes == pytest.approx(
        plan70.total_numel / 1024 * 4, rel=1e-3
    )


def test_sharded_state_shrinks_with_world_size_and_the_rest_does_not(
    plan70: ModelPlan,
) -> None:
    parts = {w: breakdown(plan70.estimate(w)) for w in CLAIM_WORLD_SIZES}
    assert parts[8]["sharded_state"] == pytest.approx(128 * parts[1024]["sharded_state"], rel=1e-3)
    assert parts[8]["activations"] == parts[1024]["activations"]
    assert parts[8]["unit_working_set"] >= parts[1024]["unit_working_set"]
    assert all(p["total"] == sum(v for k, v in p.items() if k != "total") for p in parts.values())


def test_monolithic_70b_never_fits_80gb_because_its_one_unit_alone_is_too_big(
    llama70b: ModelChoice,
    meta70: Any,
) -> None:
    # Negative control for "devices needed": the seeds' "monolithic FSDP ... OOM" at scale.
    plan = plan_model(llama70b, PlanSettings(policy="monolithic", seq_len=512), meta70)
    for w in (8, 64):
        assert plan.estimate(w).total > 80 * GB
    need = devices_needed(plan, 80 * GB)
    assert need.world_size is None
    assert need.reason.startswith("never fits: one unit's working set alone is")
    assert "LlamaModel (root)" in need.reason and "fix: a policy with smaller units" in need.reason


def test_devices_needed_is_the_smallest_world_size_that_fits(
    llama70b: ModelChoice,
    meta70: Any,
) -> None:
    plan = plan_model(llama70b, PlanSettings(seq_len=512), meta70)
    need = devices_needed(plan, 80 * GB)
    w = need.world_size
    usable = 80 * GB - DEFAULT_RESERVE.total  # the device less what a GPU rank holds outside
    assert w is not None and w > 1
    assert plan.estimate(w).total <= usable < plan.estimate(w - 1).total
    assert need.estimate_bytes == plan.estimate(w).total
    assert need.reserve_bytes == DEFAULT_RESERVE.total
    assert "(80.00 GB less the 2.13 GB device reserve)" in need.reason
    bigger = devices_needed(plan, 141 * GB)
    assert bigger.world_size is not None and bigger.world_size < w


def test_devices_needed_keeps_the_device_reserve_free(
    llama70b: ModelChoice,
    meta70: Any,
) -> None:
    # The estimate counts what torch's allocator holds; the CUDA context, NCCL's buffers and
    # the cuBLAS workspaces come on top. A device that fits the estimate exactly at W ranks
    # does not fit once they are kept free: W no longer suffices.
    plan = plan_model(llama70b, PlanSettings(seq_len=512), meta70)
    w = devices_needed(plan, 80 * GB).world_size
    assert w is not None
    exact = plan.estimate(w).total
    assert devices_needed(plan, exact, reserve=DeviceReserve.of_total(0)).world_size == w
    kept = devices_needed(plan, exact)
    assert kept.world_size is not None and kept.world_size > w
    assert plan.estimate(kept.world_size).total <= exact - DEFAULT_RESERVE.total
    assert DEFAULT_RESERVE.total == (
        DEFAULT_RESERVE.cuda_context + DEFAULT_RESERVE.nccl + DEFAULT_RESERVE.cublas_workspaces
    )
    # A reserve as large as the device: nothing fits, and the reason says why.
    none = devices_needed(plan, 2 * GB)
    assert none.world_size is None and "(2.00 GB less the 2.13 GB device reserve)" in none.reason
    with pytest.raises(PlanError, match="--device-reserve must be >= 0 bytes, got -1"):
        DeviceReserve.of_total(-1)


def test_long_sequences_never_fit_because_of_activations_and_the_reason_says_so(
    plan70: ModelPlan,
) -> None:
    # Batch 1 x 4096 without activation checkpointing: ~175 GB of activations per rank.
    need = devices_needed(plan70, 141 * GB)
    assert need.world_size is None
    assert "does not shrink with more ranks" in need.reason
    assert "activation checkpointing" in need.reason


def test_activation_checkpointing_makes_70b_at_seq_4096_fit_80gb_and_costs_a_recompute(
    plan70: ModelPlan,
) -> None:
    # Checkpointing a block keeps only what enters it (batch x seq x dim) until backward, then
    # its saved set once more while it is recomputed; its forward FLOPs run twice.
    full = plan70.with_checkpointing("full")
    assert len(full.checkpointed) == 80 and full.checkpointed[:2] == ("layers.0", "layers.1")
    assert plan70.with_checkpointing("every-2").checkpointed[:2] == ("layers.0", "layers.2")
    assert plan70.checkpointed == () and plan70.recompute_flops == 0
    acts = full.activations
    assert acts.entry_bytes["layers.0"] == 1 * 4096 * 8192 * 2  # batch x seq x dim, bf16
    none_b, full_b = plan70.estimate(1024), full.estimate(1024)
    _assert_activation_peak_is_the_worst_units(full, full_b)
    assert full_b.term("saved activations").bytes == (
        sum(v for k, v in acts.saved_bytes.items() if k not in full.checkpointed)
        + sum(acts.entry_bytes[u] for u in full.checkpointed)
    )
    assert full_b.total < none_b.total / 5
    assert full.recompute_flops == sum(acts.forward_flops[u] for u in full.checkpointed)
    # A Llama block's forward is at least 2 x its parameters x tokens (its matmuls).
    block = next(u for u in plan70.units if u.fqn == "layers.0")
    assert acts.forward_flops["layers.0"] >= 2 * block.numel * 4096
    # The answer for each device: without checkpointing nothing fits (the negative control),
    # the cheapest choice that fits is named with its ranks and the room left.
    report = plan_report(plan70, 1024, [80 * GB, 141 * GB], max_world_size=65536)
    by_choice = {o["checkpointing"]: o for o in report["checkpointing_options"]}
    assert by_choice["none"]["devices_needed"][0]["world_size"] is None
    # The least recompute that fits 80 GB: op-level selective (its kept matmul and attention
    # outputs are not run again), cheaper than full checkpointing.
    answer = report["answer"][0]
    op = plan70.with_checkpointing("op")
    assert answer["checkpointing"] == "op" and answer["world_size"] is not None
    assert op.recompute_flops is not None and full.recompute_flops is not None
    assert op.recompute_flops < full.recompute_flops
    assert answer["room_bytes"] >= 0
    assert answer["estimate_bytes"] == op.estimate(answer["world_size"]).total
    # The same per-rank figure under HSDP from a shard group of that size; fewer ranks with the
    # sharded state on the host (which then holds more per rank).
    assert answer["shard_group"] == answer["world_size"]
    off = answer["offload"]
    assert off is not None and off["world_size"] < answer["world_size"]
    assert off["host_bytes"] > term_sum(op.estimate(answer["world_size"]), SHARDED_TERMS)
    with pytest.raises(PlanError, match="every-K"):
        PlanSettings(checkpointing="every-1")


def _assert_activation_peak_is_the_worst_units(plan: ModelPlan, bound: Bound) -> None:
    """The recomputed unit and the working set are those of one unit, the one whose sum is
    largest: each unit's peak while it runs (a checkpointed one's first forward, recompute and
    backward; the others' working set) is within their sum, and one of them is it."""
    acts = plan.activations
    ops = checkpoint_ops(plan.settings.checkpointing)
    again = {u: acts.saved_bytes[u] - (acts.op_kept(u)[1] if ops else 0) for u in plan.checkpointed}
    peak = bound.term("recomputed unit").bytes + bound.term("activation working set").bytes
    candidates = {}
    for unit in {*acts.working_forward_by_unit, *acts.working_backward_by_unit}:
        fwd, bwd = acts.unit_working(unit)
        if unit in again:
            saved, working = acts.backward_with_saved_by_unit[unit]
            made_again = acts.backward_entry_by_unit[unit] + acts.forward_local_by_unit[unit]
            candidates[unit] = max(
                again[unit] + max(made_again, fwd), min(saved, again[unit]) + working
            )
        else:
            candidates[unit] = max(fwd, bwd)
    assert again and peak == max(candidates.values()), (peak, candidates)
    assert bound.term("recomputed unit").bytes <= max(again.values())


def test_the_seeds_claim_as_numbers_and_the_policies_side_by_side(
    llama70b: ModelChoice,
    meta70: Any,
) -> None:
    # On the module's meta build: its forward at seq 512 was profiled by the tests above.
    data = compare_policies(
        llama70b, PlanSettings(seq_len=512), CLAIM_WORLD_SIZES, [80 * GB, 141 * GB], model=meta70
    )
    fp16 = data["claim"]["fp16_weight_bytes"]
    assert fp16 == data["model"]["params"] * 2
    assert abs(fp16 - 140 * GB) < 0.02 * 140 * GB  # "approximately 140GB": 137.95 GB
    rows = {(r["policy"], r["world_size"]): r for r in data["rows"]}
    assert set(rows) == {(p, w) for p in POLICIES for w in CLAIM_WORLD_SIZES}
    for w in CLAIM_WORLD_SIZES:
        assert rows[("monolithic", w)]["total"] > rows[("recommended", w)]["total"]
        assert not rows[("monolithic", w)]["fits"][str(80 * GB)]
    assert rows[("recommended", 1024)]["fits"][str(80 * GB)]
    assert rows[("recommended", 8)]["units"] == 83 and rows[("seeds", 8)]["units"] == 483
    assert data["devices_needed"]["monolithic"][0]["world_size"] is None
    text = format_comparison(data)
    assert "137.95 GB of weights" in text and "approximately 140GB" in text


def test_plan_tree_collapses_identical_blocks_and_keeps_the_nesting(
    llama70b: ModelChoice,
    plan70: ModelPlan,
    meta70: Any,
) -> None:
    tree = format_plan_tree(plan70, 1024)
    assert "layers.{0..79}  LlamaBlock x80" in tree
    # One block gathered in bf16: GiB by default (devices report GiB), GB where asked.
    assert "1.59 GiB each" in tree
    assert "1.71 GB each" in format_plan_tree(plan70, 1024, style="decimal")
    full = format_plan_tree(plan70, 1024, collapse=False)
    assert "layers.79  LlamaBlock" in full and len(full.splitlines()) == 84
    seeds = plan_model(llama70b, PlanSettings(policy="seeds", seq_len=512), meta70)
    tree = format_plan_tree(seeds, 1024)
    assert "layers.{0..79}  LlamaBlock x80" in tree and "│   ├── wq  Linear" in tree
    report = plan_report(seeds, 1024, [80 * GB])
    assert any("nested in other units" in line for line in _nested_note(seeds))
    assert json.loads(json.dumps(report))["world_size"] == 1024


def _block_saved(config: LlamaConfig, batch: int = 2, seq: int = 64) -> int:
    """Bytes one middle block of ``config`` saves for backward in bf16 (meta)."""
    choice = ModelChoice(ModelSpec(reference="llama", config=config), "llama")
    settings = PlanSettings(compute_dtype="bf16", batch_size=batch, seq_len=seq, optimizer="none")
    return plan_model(choice, settings).activations.saved_bytes["layers.1"]


def test_llama_norm_and_rotary_save_what_production_code_saves() -> None:
    # Per block of batch x seq x dim (bf16): the suite's first reference saves two fp32 copies in
    # each RMSNorm and copies the attention output before wo; torchtitan's eager norm saves one
    # fp32 copy (4 B) and the bf16 product (2 B), its rotary on (b, s, h, d) leaves wo a view;
    # a fused norm saves its bf16 input (2 B) where the eager one saves both.
    base = LlamaConfig(num_layers=3, dim=64)
    bsd = 2 * 64 * 64
    first = _block_saved(base)
    production = _block_saved(dataclasses.replace(base, norm="eager", rotary_layout="seq-first"))
    fused = _block_saved(dataclasses.replace(base, norm="fused", rotary_layout="seq-first"))
    assert first - production == (2 * 4 + 2) * bsd  # two fp32 copies, one output copy
    assert production - fused == 2 * 4 * bsd  # per norm: fp32 copy + bf16 product - bf16 input
    assert {LLAMA_PRESETS[p].norm for p in LLAMA_PRESETS} == {"eager"}
    assert {LLAMA_PRESETS[p].rotary_layout for p in LLAMA_PRESETS} == {"seq-first"}


@pytest.mark.process  # real CPU forwards and backwards of four models: about 1 s
def test_llama_norm_and_rotary_forms_compute_the_same_function() -> None:
    # Same function, whatever it saves: outputs and gradients agree (the fused backward included).
    import torch

    from fsdp_conformance.models.llama import LlamaModel

    base = LlamaConfig(num_layers=2, dim=64)

    def step(config: LlamaConfig) -> tuple[Any, list[Any]]:
        torch.manual_seed(0)
        model = LlamaModel(config)
        out = model(torch.arange(32).reshape(2, 16))
        out.square().mean().backward()
        return out, [p.grad for p in model.parameters()]

    ref_out, ref_grads = step(base)
    for norm, layout in (("eager", "seq-first"), ("fused", "seq-first"), ("fused", "heads-first")):
        out, grads = step(dataclasses.replace(base, norm=norm, rotary_layout=layout))
        torch.testing.assert_close(out, ref_out)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_op_level_selective_checkpointing_keeps_attention_and_every_other_matmul() -> None:
    # torchtitan's "selective op" policy: a block's matmuls in order are wq, wk, wv, wo, w1, w3,
    # w2 (attention between wv and wo); the 1st, 3rd, 5th and 7th outputs are kept (wq, wv, w1,
    # w2) with attention's output and logsumexp, the rest recomputed.
    config = LlamaConfig(num_layers=3, dim=64, norm="eager", rotary_layout="seq-first")
    choice = ModelChoice(ModelSpec(reference="llama", config=config), "llama")
    settings = PlanSettings(compute_dtype="bf16", batch_size=2, seq_len=64, optimizer="none")
    plan = plan_model(choice, settings)
    acts = plan.activations
    kinds = [e[1] for e in sorted(acts.op_outputs["layers.1"])]
    assert kinds == ["mm", "mm", "mm", "attention", "mm", "mm", "mm", "mm"]
    tokens, hidden = 2 * 64, config.hidden
    lse = 2 * config.num_heads * 64 * 4  # fp32 logsumexp per head and position
    kept, kept_saved, kept_flops = acts.op_kept("layers.1")
    assert kept == tokens * (3 * 64 + 64 + hidden) * 2 + lse  # wq, wv, w2, attention; w1
    assert 0 < kept_saved < kept  # the attention output (wo's input) is saved anyway
    op, full = plan.with_checkpointing("op"), plan.with_checkpointing("full")
    assert op.checkpointed == full.checkpointed
    op_b, full_b = op.estimate(2), full.estimate(2)
    outputs = sum(acts.op_kept(u)[0] for u in op.checkpointed)
    assert op_b.term("saved activations").bytes == (
        full_b.term("saved activations").bytes + outputs
    )
    _assert_activation_peak_is_the_worst_units(op, op_b)
    _assert_activation_peak_is_the_worst_units(full, full_b)
    # Less recompute than full checkpointing, by the kept ops' FLOPs; more memory.
    assert op.recompute_flops == full.recompute_flops - sum(
        acts.op_kept(u)[2] for u in op.checkpointed
    )
    assert full_b.total < op_b.total < plan.estimate(2).total
    assert "op-level selective" in op.settings.describe()


def test_activations_follow_the_compute_dtype_and_the_attention_kernel() -> None:
    choice = choose_model(reference="llama", layers=2, dim=64)
    base = PlanSettings(compute_dtype="fp32", seq_len=256, optimizer="none")

    def saved(settings: PlanSettings) -> int:
        return sum(plan_model(choice, settings).activations.saved_bytes.values())

    fp32, bf16 = saved(base), saved(dataclasses.replace(base, compute_dtype="bf16"))
    math_ = saved(dataclasses.replace(base, attention="math"))
    assert bf16 < 0.75 * fp32  # RMSNorm keeps some fp32 copies: not exactly half
    # The unfused path saves the seq x seq weights (2 layers x 4 heads x 256^2 x 4 B = 2.1 MB)
    # instead of the fused kernel's output and logsumexp (0.1 MB).
    weights = 2 * 4 * 256 * 256 * 4
    assert 0.9 * weights <= math_ - fp32 <= weights


def test_a_learned_attention_mask_runs_unfused_on_meta_as_torch_runs_it() -> None:
    # T5 adds a learned position bias to the attention scores: a mask that needs a gradient,
    # which the fused CPU kernel cannot differentiate. The planner's "flash" mode leaves such a
    # call to the unfused path (as torch does when it trains): the same saved tensors as "math".
    # Negative control: a mask without a gradient still takes the fused kernel.
    import torch
    import torch.nn.functional as F

    from fsdp_conformance.plan import activations

    q = torch.empty(1, 4, 128, 16, device="meta", requires_grad=True)
    learned = torch.empty(1, 4, 128, 128, device="meta", requires_grad=True)
    fixed = torch.empty(1, 4, 128, 128, device="meta")

    def saved(mask: torch.Tensor, kind: str) -> list[tuple[int, ...]]:
        shapes: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            shapes.append(tuple(t.shape))
            return t

        with (
            activations._attention(kind),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        assert out.shape == (1, 4, 128, 16)
        return shapes

    assert saved(learned, "flash") == saved(learned, "math")
    assert saved(fixed, "flash") != saved(fixed, "math")


# ------------------------------------------------------------------------------------------
# The command line: one clear line on bad input; the FSDP2 cross-check in a subprocess
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["--preset", "700b"],
            "unknown preset '700b'; choose one of 7b, 13b, 70b, llama3-8b, llama3-70b, llama3-405b, seeds",
        ),
        ([], "no model given: pass --preset"),
        (["--preset", "70b", "--reference", "massive"], "name one model, not --preset and"),
        (["--reference", "gpt9"], "unknown reference model 'gpt9'"),
        (["--preset", "7b", "--device-memory", "80 potatoes"], "is not a size; write e.g. 80GB"),
        (["--preset", "7b", "--world-size", "0"], "--world-size must be >= 1"),
        (["--preset", "7b", "--policy", "flat"], "argument --policy: invalid choice: 'flat'"),
        (
            ["--preset", "7b", "--bogus"],
            "unrecognized arguments: --bogus; see `fsdp-conformance plan --help`",
        ),
        (
            ["--model", "no_such_pkg.mod:build", "--block-cls", "Block"],
            "cannot import module 'no_such_pkg.mod'",
        ),
        (
            ["--model", "fsdp_conformance.models.reference_models:MassiveModel"],
            "no block class given",
        ),
        (["--preset", "7b", "--layers", "2"], "a preset has its own shape"),
        (["--reference", "massive", "--norm", "fused"], "--norm sets a Llama's RMSNorm"),
        (["--reference", "massive", "--loss", "cross-entropy"], "--loss cross-entropy needs token"),
        (["--preset", "7b", "--device-reserve", "lots"], "--device-reserve 'lots' is not a size"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("fsdp-conformance plan: error: ") and err.count("\n") == 1, err
    assert needle in err


def test_plan_is_a_subcommand_of_the_one_parser_and_run_and_compare_stay_light() -> None:
    parser = cli_parser.build_parser()
    args = parser.parse_args(["plan", "--preset", "70b", "--world-size", "64", "--json"])
    assert (args.command, args.preset, args.world_size, args.json, args.usage_error) == (
        "plan",
        "70b",
        64,
        True,
        None,
    )
    # A usage error comes back in args (main prints it: one line, exit 2), not as an exit here.
    bad = parser.parse_args(["plan", "--preset", "7b", "--world-size", "x"])
    assert bad.usage_error == (
        "argument --world-size: invalid int value: 'x'; see `fsdp-conformance plan --help`"
    )
    # plan's flags come from modules that import torch: they are added when `plan` is parsed,
    # so that `run`, `compare` and `--help` do not import torch (the probe's control: plan does).
    # (The probe refuses torch and records the attempt: it costs no torch import.)
    code = (
        "from fsdp_conformance import cli_parser\np = cli_parser.build_parser()\n"
        "p.parse_args(['compare', 'old.json', 'new.json'])\np.format_help()\n"
        "print(bool(attempts))\n"
        "try:\n    p.parse_args(['plan', '--preset', '7b'])\nexcept ImportError:\n    pass\n"
        "print(bool(attempts))\n"
    )
    assert probe(code).split() == ["False", "True"]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``fsdp-conformance plan ARGV``: exit code, stdout, stderr. In this process (the cross-check
    makes and destroys its fake process group inside the call); in a subprocess where this
    process already holds a default process group (pytest under torchrun), which the
    cross-check would refuse."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(
            [sys.executable, "-m", "fsdp_conformance.cli", "plan", *argv],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        return proc.returncode, proc.stdout, proc.stderr
    capsys.readouterr()
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plan_cross_checks_fsdp2_shards_on_a_1024_rank_fake_process_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 7B at 1,024 ranks: vocab 32,000 rows do not divide by 1,024, so FSDP2 pads dim 0 (32
    # rows on rank 0 instead of 31.25): the analytic padding must match fully_shard exactly.
    code, out, err = _cli(capsys, "--preset", "7b", "--world-size", "1024", "--json")
    assert code == 0, err
    data = json.loads(out)
    v = data["verification"]
    assert v["world_size"] == 1024 and v["matches"], v
    rows = {r["fqn"]: r for r in v["units"]}
    assert rows["tok_embeddings"]["local_numel"] == 32 * 4096  # ceil(32000 / 1024) rows
    assert rows["tok_embeddings"]["ceil_numel"] == 32000 * 4096 // 1024
    # Padding per rank over ceil(numel / W): embeddings and output (32,000 rows), and each
    # block's w1 and w3 (11,008 rows = 10.75 per rank): bound.py's "dim 0 divides by W for
    # Llama shapes up to 1,024 ranks" does not hold for 7B (it does for 70B's 28,672).
    embed = 2 * (32 * 4096 - 32000 * 4096 // 1024)
    mlp = 32 * 2 * (11 * 4096 - 11008 * 4096 // 1024)
    assert v["padding_numel"] == embed + mlp == 71680
    assert all(r["local_numel"] == r["padded_numel"] for r in v["units"])
    assert data["devices_needed"][0]["device_bytes"] == 80 * GiB  # the default: 80GiB,140GiB
    assert {t["name"] for t in data["estimate"]["terms"]} >= {*SHARDED_TERMS, *UNIT_TERMS}


def test_cli_plan_no_verify_prints_the_tree_without_the_cross_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Without the cross-check no fake process group is made; the cross-check itself is the
    # test above.
    assert cli.main(["plan", "--preset", "7b", "--world-size", "1024", "--no-verify"]) == 0
    out, err = capsys.readouterr()
    assert "layers.{0..31}  LlamaBlock x32" in out, err
    assert "fsdp2 cross-check" not in out


def test_cli_plan_states_the_device_reserve_and_takes_the_users_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--preset", "7b", "--seq-len", "512", "--no-verify", "--json"]
    assert cli.main(argv) == 0
    stated = json.loads(capsys.readouterr().out)
    assert stated["reserve"] == DEFAULT_RESERVE.to_dict()
    assert [d["reserve_bytes"] for d in stated["devices_needed"]] == [DEFAULT_RESERVE.total] * 2
    assert cli.main([*argv, "--device-reserve", "0"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert [d["reserve_bytes"] for d in own["devices_needed"]] == [0, 0]
    assert "(80.00 GiB less the 0 B device reserve)" in own["devices_needed"][0]["reason"]
    # A size given in GB is 10^9 B and shown as given; the rest of the plan follows it.
    assert cli.main([*argv[:-1], "--device-memory", "80GB"]) == 0
    text = capsys.readouterr().out
    assert "80.00 GB: " in text and "(80.00 GB less the 2.13 GB device reserve)" in text
    assert "GiB" not in text and "(GB = 10^9 B)" in text


def test_reduce_dtype_sizes_the_reduce_scatter_and_fsdp1s_gradient_cast(plan70: ModelPlan) -> None:
    # torchtitan reduces in fp32 under bf16 compute: the reduce-scatter's input copy and output
    # shard double; FSDP1 also keeps its cast of the unsharded gradient beside the bf16 one.
    bf16 = plan70.estimate(64)
    fp32 = plan70.with_settings(reduce_dtype="fp32").estimate(64)
    rs = "reduce-scatter buffers"
    assert fp32.term(rs).bytes == 2 * bf16.term(rs).bytes
    assert fp32.total - bf16.total == bf16.term(rs).bytes
    fsdp1 = plan70.with_settings(version="fsdp1")
    cast = fsdp1.with_settings(reduce_dtype="fp32").estimate(64).term("unsharded grads").bytes
    assert cast == 3 * fsdp1.estimate(64).term("unsharded grads").bytes  # bf16 + its fp32 cast
    assert (
        "gradients reduced in fp32" in plan70.with_settings(reduce_dtype="fp32").settings.describe()
    )
    with pytest.raises(PlanError, match="reduce-dtype 'fp8' is not one of fp32, bf16, fp16"):
        PlanSettings(reduce_dtype="fp8")


# ------------------------------------------------------------------------------------------
# Trust: the estimate against measured peaks (memory.measure_step) at small scale
# ------------------------------------------------------------------------------------------


def _spec(reference: str, layers: int, dim: int) -> ModelSpec:
    config = (
        LlamaConfig(num_layers=layers, dim=dim)
        if reference == "llama"
        else ModelConfig(num_layers=layers, dim=dim)
    )
    return ModelSpec(reference=reference, config=config)


def _case(
    reference: str,
    layers: int,
    dim: int,
    version: str,
    policy: str,
    optimizer: str = "none",
    batch_size: int = 2,
    checkpointing: str = "none",
    **more: Any,
) -> dict:
    return {
        "spec": _spec(reference, layers, dim),
        "version": version,
        "policy": policy,
        "optimizer": optimizer,
        "batch_size": batch_size,
        "checkpointing": checkpointing,
        **more,
    }


#: Several models, depths, both versions and both measurable policies; parameter-heavy
#: (batch 2) and activation-heavy (batch 32 to 64) steps; token and float inputs on both.
TRUST_CASES = [
    _case("massive", 4, 128, "fsdp1", "recommended", "adamw"),
    _case("massive", 4, 64, "fsdp2", "recommended", "adamw"),
    _case("massive", 4, 64, "fsdp1", "recommended", batch_size=64),
    _case("llama", 2, 64, "fsdp2", "recommended"),
    _case("llama", 4, 64, "fsdp2", "recommended", "adamw", batch_size=32),
    _case("tied", 2, 32, "fsdp2", "recommended", batch_size=64),
    _case("encoder_decoder", 2, 64, "fsdp1", "monolithic"),
    _case("massive", 4, 64, "fsdp2", "monolithic"),
    _case("llama", 2, 64, "fsdp1", "recommended", batch_size=32),
    # Activation checkpointing (applied after sharding, as with FSDP1's
    # apply_activation_checkpointing), on every block and on every second one.
    _case("massive", 8, 32, "fsdp1", "recommended", batch_size=128, checkpointing="full"),
    _case("massive", 8, 32, "fsdp2", "recommended", batch_size=128, checkpointing="every-2"),
    # A long sequence in bf16: attention as the planner assumes it (flash), 512 tokens.
    _case("llama", 2, 64, "fsdp2", "recommended", seq_len=512, compute_dtype="bf16"),
]
#: Negative controls: the term that dominates each regime, deliberately left out of the bound.
#: Optimizer state in a parameter-heavy step; saved activations in the activation-heavy ones
#: (they are 90% of the 70B estimate at batch 1 x 4096); with checkpointing on every block and
#: at 512 tokens, the working set measured per unit with the backward on meta. (On these
#: checkpointed massive cases the step's activation peak is the loss's backward, not a
#: recompute: their recomputed unit is 0. Dropping it is caught in the process lane's OP_CASES,
#: where a recomputed Llama block is half the estimate.)
DROPPED_TERMS = {
    0: "optimizer state",
    2: "saved activations",
    4: "saved activations",
    5: "saved activations",
    9: "activation working set",
    10: "saved activations",
    11: "activation working set",
}


def _judged_with(values: list[dict], cases: list[dict], estimates: dict[int, Bound]) -> Verdict:
    """The trust verdict's judgement with ``estimates`` (case index -> Bound) in place of the
    planner's for those cases."""
    world_size = len(values)
    return judge_estimates(
        values,
        cases,
        [estimates.get(i) or estimate_for_case(c, world_size) for i, c in enumerate(cases)],
    )


def _without(bound: Bound, name: str) -> Bound:
    bound.term(name)  # KeyError if the term is not there: the control would prove nothing
    return Bound(tuple(t for t in bound.terms if t.name != name), bound.tolerance)


# At the session's world sizes: 2, and 4 where the machine has a core per rank (four ranks
# time-sharing two cores measure the same peaks at twice the cost; HSDP's 2 x 2 below always
# runs at 4, and `--fsdp-world-sizes 2,4` runs this at 4 anywhere).
@pytest.mark.cpu  # the CUDA allocator adds cuBLAS workspaces and block rounding: not modelled
def test_estimate_is_within_tolerance_of_measured_peaks_and_a_missing_term_is_caught(
    ranks: Ranks,
) -> None:
    values = ranks.run(rank_plan_estimate_matches, cases=TRUST_CASES)
    params = {"cases": TRUST_CASES}
    verdict = verdict_plan_estimate_matches(values, params)
    assert verdict.passed, verdict.message
    assert verdict.figures["cases"] == len(TRUST_CASES)
    assert verdict.figures["max_ratio"] <= TRUST_MAX_RATIO
    # Per term, where the meter has categories (FSDPMemTracker on FSDP2): the sharded
    # parameters at the peak are exactly the estimate's, and every group is reported.
    for row, case in zip(verdict.data["rows"], TRUST_CASES, strict=True):
        if case["version"] == "fsdp2":
            assert row["term_ratios"]["sharded params"] == 1.0, row
            assert row["term_ratios"]["activations"] is not None, row
            # Each category at its own peak: the sharded state is constant; the backward's
            # working set and recomputed unit are reported against what the tracker saw.
            assert row["term_peaks"]["sharded params"] == 1.0, row
            assert row["term_peaks"]["backward: working set + recomputed unit"], row
        else:
            assert row["term_ratios"] == {} and row["term_peaks"] == {}  # no categories
    # Negative control: the same measurements against bounds each missing a dominant term.
    world_size = len(values)
    estimates = {}
    for i, name in DROPPED_TERMS.items():
        case = TRUST_CASES[i]
        estimates[i] = _without(estimate_for_case(case, world_size), name)
        peaks = {v["rank"]: v["peaks"][i]["peak"] for v in values}
        ok, lines = compare_to_measurement(
            estimates[i], peaks, min_ratio=TRUST_MIN_RATIO[case["policy"]]
        )
        assert not ok, f"case {i}: a bound without {name!r} still passed: {lines}"
        assert all("ABOVE 1.10 x the estimate: the estimate misses" in ln for ln in lines)
    broken = _judged_with(values, TRUST_CASES, estimates)
    assert not broken.passed
    assert f"{len(DROPPED_TERMS) * world_size} outside" in broken.message
    assert f"rank {world_size - 1}: measured" in broken.message  # every rank judged


def _measured_within(ranks: Ranks, cases: list[dict], label: str) -> list[dict]:
    """Every case measured on every rank and within its estimate; the pass message has
    ``label`` (the cases' own label: what was measured is what was asked)."""
    values = ranks.run(rank_plan_estimate_matches, cases=cases)
    verdict = verdict_plan_estimate_matches(values, {"cases": cases})
    assert verdict.passed, verdict.message
    assert label in verdict.message
    return values


def _caught_above(
    values: list[dict], cases: list[dict], estimates: dict[int, Bound], outside: int
) -> str:
    """The same peaks judged against ``estimates``: ``outside`` case-rank pairs above them."""
    broken = _judged_with(values, cases, estimates)
    assert not broken.passed and f"{outside} outside" in broken.message, broken.message
    assert "ABOVE 1.10 x the estimate" in broken.message
    return broken.message


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_a_step_measured_without_the_checkpointing_the_estimate_assumes_is_caught(
    ranks: Ranks,
) -> None:
    # The same model and batch measured with activation checkpointing on every block, and
    # without it: the checkpointed step keeps less (the measurement sees the checkpointing),
    # and judged against the checkpointed estimate the step without it is above on every rank.
    on = _case("massive", 8, 32, "fsdp2", "recommended", batch_size=128, checkpointing="full")
    off = {**on, "checkpointing": "none"}
    values = _measured_within(ranks, [on, off], " ac=full fp32: estimate")
    assert all(v["peaks"][1]["peak"] > v["peaks"][0]["peak"] for v in values)
    wrong = {0: estimate_for_case(on, 2), 1: estimate_for_case(on, 2)}  # off judged as on
    message = _caught_above(values, [on, off], wrong, 2)
    assert "opt=none b128 fp32: rank 1: measured" in message


def _full_sharding(case: dict) -> Bound:
    """What a planner that ignores the shard group would say: full sharding over the 4 ranks."""
    return estimate_for_case({**case, "shard_group": None}, 4)


def _no_working_set(case: dict) -> Bound:
    """The bound without the working set (measured with the backward on meta)."""
    return _without(estimate_for_case(case, 4), "activation working set")


#: HSDP 2 x 2 in both regimes: parameter-heavy (AdamW), judged as full sharding as the
#: negative control; activation-heavy with every block checkpointed (the AC trust cases' model
#: and batch, both reductions at once), with the working set dropped.
HSDP_REGIMES = {
    "params": (
        _case("massive", 4, 128, "fsdp1", "recommended", "adamw"),
        "hsdp=2 fp32: estimate",
        _full_sharding,
    ),
    "checkpointed": (
        _case("massive", 8, 32, "fsdp1", "recommended", batch_size=128, checkpointing="full"),
        " ac=full hsdp=2 fp32: estimate",
        _no_working_set,
    ),
}


@pytest.mark.cpu
@pytest.mark.world_size(4)
@pytest.mark.parametrize("regime", list(HSDP_REGIMES))
def test_hsdp_peaks_follow_the_shard_group_and_a_wrong_estimate_is_caught(
    ranks: Ranks,
    regime: str,
) -> None:
    # World size 4 as 2 replicas x shard groups of 2: FSDP2 fully_shard on a 2-D mesh, FSDP1
    # HYBRID_SHARD. Each rank holds half of every unit, as at world size 2.
    base, label, wrong = HSDP_REGIMES[regime]
    cases = [{**base, "version": v, "shard_group": 2} for v in ("fsdp1", "fsdp2")]
    values = _measured_within(ranks, cases, label)
    _caught_above(values, cases, {i: wrong(c) for i, c in enumerate(cases)}, 8)


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_fsdp2_cpu_offload_step_is_within_device_and_host_estimates_and_caught_without_host(
    ranks: Ranks,
) -> None:
    # CPUOffloadPolicy as users write it, parameter-heavy (AdamW). On a CPU device the host's
    # memory and the device's are one: the peak is judged against the device estimate plus the
    # host's offloaded state. (FSDP1 refuses CPUOffload without an accelerator.)
    cases = [_case("massive", 4, 128, "fsdp2", "recommended", "adamw", offload=True)]
    values = _measured_within(ranks, cases, " offload fp32: estimate")
    estimate = estimate_for_case(cases[0], 2)
    assert estimate.term(HOST_TERM).bytes > 0 and estimate.term("offloaded shard copies")
    # Negative control: the host's state left out, every rank's peak is above the estimate.
    _caught_above(values, cases, {0: _without(estimate, HOST_TERM)}, 2)


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_fsdp1_cpu_offload_without_pinned_host_memory_is_a_capability_skip(ranks: Ranks) -> None:
    from fsdp_conformance.harness import CheckSkipped

    case = _case("massive", 2, 32, "fsdp1", "recommended", offload=True)
    refused = "capability 'pinned host memory' is not in torch .*run it on a machine with a GPU"
    with pytest.raises(CheckSkipped, match=refused):
        ranks.configured(skip=None).run(rank_plan_estimate_matches, cases=[case])


def _device_peaks_with_offload_between(ctx: RankContext, case: dict) -> dict:
    """The device's peak (the CUDA allocator) of one step without CPU offload, with it, and
    without it again (what a check comparing two steps that moved nothing sees)."""
    from fsdp_conformance.measure.step import measure_step

    peaks = []
    for offload in (False, True, False):
        m = measure_step(
            ctx,
            case["spec"],
            case["version"],
            "per_layer",
            optimizer="adamw",
            timeline=False,
            offload=offload,
        )
        peaks.append((m["meters"][0]["source"], m["meters"][0]["peak"]))
    return {"rank": ctx.rank, "peaks": peaks}


def _moved_off_the_device(before: int, after: int, planned: int) -> bool:
    """The device's peak fell by at least 80% of what the planner moves to the host (the sharded
    state less the shard copies in transit): one-sided, since the step without offload may also
    peak on optimizer temporaries that the offloaded step keeps on the host."""
    return before - after >= 0.8 * planned


@pytest.mark.gpu
@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_cpu_offload_takes_at_least_the_planned_state_off_the_device(
    ranks: Ranks,
    version: str,
) -> None:
    # The split a CPU machine cannot see (host and device are one memory there): FSDP1
    # CPUOffload(offload_params=True), FSDP2 CPUOffloadPolicy() as users write them, AdamW.
    case = _case("massive", 4, 128, version, "recommended", "adamw")
    values = ranks.run(_device_peaks_with_offload_between, case)
    choice, ws = ModelChoice(case["spec"], case["spec"].name), ranks.world_size
    resident = plan_model(choice, trust_settings(case)).estimate(ws).total
    offloaded = plan_model(choice, trust_settings({**case, "offload": True})).estimate(ws).total
    planned = resident - offloaded
    assert planned > 0
    for v in values:
        (src0, before), (src1, with_offload), (src2, again) = v["peaks"]
        assert src0 == src1 == src2 == "cuda", v
        assert _moved_off_the_device(before, with_offload, planned), (
            f"rank {v['rank']}: device peak {before} B without offload, {with_offload} B with "
            f"it: fell by {before - with_offload} B, the planner moves {planned} B to the host"
        )
        # Negative control: two steps that both keep the state on the device do not pass.
        assert not _moved_off_the_device(before, again, planned)


def test_cpu_offload_moves_the_sharded_state_to_the_host(
    llama70b: ModelChoice,
    meta70: Any,
) -> None:
    # Derived, not measured (a CPU machine cannot tell host from device): the device keeps
    # one unit's shards in transit, the host the sharded params, grads and optimizer state.
    plan = plan_model(llama70b, PlanSettings(seq_len=512), meta70)
    off = plan_model(llama70b, PlanSettings(seq_len=512, cpu_offload=True), meta70)
    on_device, offloaded = plan.estimate(64), off.estimate(64)
    moved = term_sum(on_device, SHARDED_TERMS)
    assert off.host_bytes(64) == moved and plan.host_bytes(64) == 0
    assert not {t.name for t in offloaded.terms} & set(SHARDED_TERMS)
    copies = offloaded.term("offloaded shard copies").bytes
    assert offloaded.total == on_device.total - moved + copies
    need, full = devices_needed(off, 80 * GB), devices_needed(plan, 80 * GB)
    assert need.world_size is not None and full.world_size is not None
    assert need.world_size < full.world_size
    host = format_bytes(off.host_bytes(need.world_size), "decimal")
    assert f"host memory {host} per rank" in need.reason


def test_hsdp_estimate_is_full_sharding_over_the_shard_group(
    llama70b: ModelChoice,
    meta70: Any,
) -> None:
    plan = plan_model(llama70b, PlanSettings(seq_len=512), meta70)
    hsdp = plan_model(llama70b, PlanSettings(seq_len=512, shard_group_size=64), meta70)
    assert hsdp.estimate(1024).total == plan.estimate(64).total
    assert hsdp.estimate(1024).total > plan.estimate(1024).total  # more state per rank
    first = hsdp.estimate(1024).terms[0]
    assert "(HSDP: shard groups of 64 ranks, 16 replicas)" in first.derivation
    with pytest.raises(PlanError, match="world size 1,000 is not a multiple of the shard group"):
        hsdp.estimate(1000)
    need = devices_needed(hsdp, 80 * GB)
    full = devices_needed(plan, 80 * GB)
    assert need.world_size == 64 and full.world_size is not None
    assert f"the smallest shard group that fits is {full.world_size:,} ranks" in need.reason
    small = plan_model(llama70b, PlanSettings(seq_len=512, shard_group_size=8), meta70)
    never = devices_needed(small, 80 * GB)
    assert never.world_size is None and "fix: a larger shard group" in never.reason


def test_checkpointing_wraps_the_chosen_blocks_forward_in_torchs_checkpoint() -> None:
    import torch

    from fsdp_conformance.fsdp.sharding import checkpoint_blocks
    from fsdp_conformance.models.catalog import build_reference
    from fsdp_conformance.models.reference_models import DecoderLayer

    model = build_reference("massive", ModelConfig(num_layers=5, dim=16))
    assert checkpoint_blocks(model, (DecoderLayer,), 2) == ["layers.0", "layers.2", "layers.4"]
    x = torch.randn(2, 3, 16, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        model(x).sum().backward()
    plain = build_reference("massive", ModelConfig(num_layers=5, dim=16))
    plain.load_state_dict(model.state_dict())
    plain_packed = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: plain_packed.append(t) or t, lambda t: t
    ):
        plain(x).sum().backward()
    assert len(packed) < len(plain_packed)  # checkpointed blocks saved nothing in forward
    assert checkpoint_blocks(model, (DecoderLayer,), 0) == []


# The process lane: the check's own cases on both versions, about 5 s of the CPU lane's budget
# (the estimate against measured steps is in the CPU lane above, TRUST_CASES).
@pytest.mark.process
@pytest.mark.world_size(2)
def test_run_judges_the_planner_in_fp32_and_bf16_and_a_peak_above_the_estimate_fails(
    ranks: Ranks,
) -> None:
    # `run` holds the planner check (memory.plan_estimate_matches, one per FSDP version), and
    # its trust cases include a bf16 one besides the fp32 ones.
    selected = [
        (c, p)
        for c, p in suite.select_checks(all_checks(), None)
        if c.name == "memory.plan_estimate_matches"
    ]
    assert [p["version"] for _, p in selected] == ["fsdp1", "fsdp2"]
    for check, params in selected:
        values = ranks.run(check.rank_fn, **params)
        verdict = check.verdict(values, params)
        assert verdict.passed, verdict.message
        f = verdict.figures
        dtypes = [label.rsplit(" ", 1)[1] for label in f["case_labels"]]
        assert dtypes.count("fp32") >= 2 and dtypes.count("bf16") == 1
        assert len(f["estimate_bytes"]) == len(f["peak_bytes"]) == len(f["ratios"]) == f["cases"]
        for est, peak, ratio, low in zip(
            f["estimate_bytes"], f["peak_bytes"], f["ratios"], f["min_allowed_ratios"]
        ):
            assert ratio == round(peak / est, 3) and low <= ratio <= f["max_allowed_ratio"]
        bf16 = dtypes.index("bf16")
        assert f["estimate_bytes"][bf16] < f["estimate_bytes"][0]  # the bf16 terms are smaller
        assert "opt=none bf16: estimate" in verdict.message
        # Negative control: the bf16 case measured as a step that gathered everything at once
        # (the monolithic case's peaks) exceeds its estimate on every rank.
        mono = next(
            i
            for i, c in enumerate(default_cases(params["spec"], params["version"]))
            if c["policy"] == "monolithic"
        )
        bad = copy.deepcopy(values)
        for v in bad:
            v["peaks"][bf16] = v["peaks"][mono]
        broken = check.verdict(bad, params)
        assert not broken.passed
        assert f"{len(values)} outside" in broken.message and "bf16: rank 1" in broken.message
        assert "ABOVE 1.10 x the estimate: the estimate misses" in broken.message


#: What production Llama code saves (torchtitan's eager RMSNorm, rotary before the transpose).
PRODUCTION = {"norm": "eager", "rotary_layout": "seq-first"}
#: Activation checkpointing where what the blocks keep is a large part of the step: four Llama
#: blocks (production norm and rotary) of dim 64, a 64-token vocabulary (small logits), batch
#: 64 x 128 tokens, bf16.
OP_SAC_SPEC = ModelSpec(
    reference="llama",
    config=LlamaConfig(num_layers=4, dim=64, vocab_size=64, **PRODUCTION),
)


def _op_case(version: str, checkpointing: str) -> dict:
    return {
        "spec": OP_SAC_SPEC,
        "version": version,
        "policy": "recommended",
        "optimizer": "none",
        "batch_size": 64,
        "seq_len": 128,
        "compute_dtype": "bf16",
        "checkpointing": checkpointing,
    }


OP_CASES = [
    _op_case("fsdp2", "op"),
    _op_case("fsdp1", "op"),
    _op_case("fsdp2", "none"),
    _op_case("fsdp2", "full"),
    # torchtitan's reduce dtype under bf16 compute, parameter-heavy with AdamW.
    {
        "spec": ModelSpec(
            reference="llama", config=LlamaConfig(num_layers=4, dim=64, **PRODUCTION)
        ),
        "version": "fsdp2",
        "policy": "recommended",
        "optimizer": "adamw",
        "compute_dtype": "bf16",
        "reduce_dtype": "fp32",
    },
]


def _without_op_outputs(case: dict, world_size: int) -> Bound:
    """The case's estimate with the op outputs its policy keeps left out of saved activations."""
    plan = plan_model(ModelChoice(case["spec"], case["spec"].name), trust_settings(case))
    outputs = sum(plan.activations.op_kept(u)[0] for u in plan.checkpointed)
    bound = plan.estimate(world_size)
    assert outputs > 0
    return Bound(
        tuple(
            dataclasses.replace(t, bytes=t.bytes - outputs) if t.name == "saved activations" else t
            for t in bound.terms
        ),
        bound.tolerance,
    )


@pytest.mark.process  # five steps on two ranks: about 10 s
@pytest.mark.world_size(2)
def test_op_level_selective_checkpointing_and_the_reduce_dtype_within_measured_peaks(
    ranks: Ranks,
) -> None:
    values = _measured_within(ranks, OP_CASES, "ac=op")
    world_size = len(values)
    # Negative controls, above on every rank: the op outputs the policy keeps left out of both
    # op estimates; the recomputed block's saved set left out of the full estimate; the step
    # measured without checkpointing judged against the op estimate.
    dropped = {i: _without_op_outputs(OP_CASES[i], world_size) for i in (0, 1)}
    _caught_above(values, OP_CASES, dropped, 2 * world_size)
    no_recompute = {3: _without(estimate_for_case(OP_CASES[3], world_size), "recomputed unit")}
    _caught_above(values, OP_CASES, no_recompute, world_size)
    judged = [OP_CASES[0]] * 3
    swapped = [{**v, "peaks": [v["peaks"][i] for i in (0, 1, 2)]} for v in values]
    broken = judge_estimates(swapped, judged, [estimate_for_case(c, world_size) for c in judged])
    assert not broken.passed and f"{world_size} outside" in broken.message, broken.message


#: torchtitan's published FSDP2-only runs (docs/planning.md, "Against published runs"):
#: (preset, norm, local batch, seq, ranks, GiB per device, checkpointing, ran: True / OOM: False).
PUBLISHED_RUNS = [
    ("13b", "fused", 2, 4096, 64, 80, "none", True),
    ("13b", "fused", 2, 4096, 64, 80, "every-2", True),
    ("13b", "fused", 2, 4096, 64, 80, "op", True),
    ("70b", "eager", 2, 4096, 64, 80, "full", True),
    ("70b", "eager", 2, 4096, 64, 80, "every-2", False),
    ("70b", "eager", 2, 4096, 64, 80, "op", False),
    ("70b", "eager", 1, 4096, 64, 80, "op", True),
    ("llama3-8b", "eager", 1, 8192, 64, 80, "every-2", True),
    ("llama3-8b", "eager", 1, 8192, 64, 80, "op", True),
    ("llama3-70b", "eager", 1, 8192, 64, 80, "full", True),
]


@pytest.mark.process  # six full-scale forwards on meta (three blocks each): about 2 s here
def test_published_torchtitan_runs_fit_or_oom_as_they_ran(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plans: dict[tuple[Any, ...], ModelPlan] = {}
    for preset, norm, batch, seq, ranks_, gib, checkpointing, ran in PUBLISHED_RUNS:
        key = (preset, norm, batch, seq)
        if key not in plans:
            settings = PlanSettings(
                batch_size=batch, seq_len=seq, reduce_dtype="fp32", loss="cross-entropy"
            )
            plans[key] = plan_model(choose_model(preset=preset, norm=norm), settings)
        plan = plans[key].with_checkpointing(checkpointing)
        need = devices_needed(plan, gib * GiB)
        fits = need.world_size is not None and need.world_size <= ranks_
        assert fits == ran, (preset, batch, checkpointing, need.reason)
    # The one published memory figure of an FSDP-only run: Llama 3.1 8B, 8 H100 (96 GB), local
    # batch 2 x 8,192, selective op checkpointing, torchtitan's loss: 82.4 GiB (torchtitan
    # docs/performance.md, Table 1). The estimate is what the allocator holds: within 10%.
    llama3 = plan_model(
        choose_model(preset="llama3-8b"),
        PlanSettings(
            batch_size=2,
            seq_len=8192,
            reduce_dtype="fp32",
            loss="cross-entropy",
            checkpointing="op",
        ),
    )
    assert abs(llama3.estimate(8).total / (82.4 * GiB) - 1) <= 0.10
    # The command: torchtitan's 13B run, fused norm, no checkpointing, 80 GiB.
    code = cli.main(
        [
            "plan", "--preset", "13b", "--batch-size", "2", "--seq-len", "4096",
            "--world-size", "64", "--norm", "fused", "--activation-checkpointing", "none",
            "--device-memory", "80GiB", "--no-verify", "--json",
        ]
    )  # fmt: skip
    need = json.loads(capsys.readouterr().out)["devices_needed"][0]
    assert code == 0 and need["world_size"] is not None and need["world_size"] <= 64, need


def test_comparison_flags_a_reduced_bound_above_and_an_inflated_one_below() -> None:
    terms = (
        BoundTerm("sharded params", 300, "x"),
        BoundTerm("optimizer state", 600, "x"),
        BoundTerm("saved activations", 100, "x"),
    )
    bound = Bound(terms, 0.10)
    peaks = {0: 800, 1: 800}  # where per-layer peaks land: 0.8 of the estimate
    ok, lines = compare_to_measurement(bound, peaks, min_ratio=0.45)
    assert ok and all(ln.endswith(": ok") for ln in lines) and len(lines) == 2
    reduced = Bound(tuple(t for t in terms if t.name != "optimizer state"), 0.10)
    ok, lines = compare_to_measurement(reduced, peaks, min_ratio=0.45)
    assert not ok and all(
        "ABOVE 1.10 x the estimate: the estimate misses 400 B" in ln for ln in lines
    )
    inflated = Bound(terms * 3, 0.10)
    ok, lines = compare_to_measurement(inflated, {0: 800, 1: 2000}, min_ratio=0.45)
    assert not ok
    assert "BELOW 0.45 x the estimate: the estimate is too loose" in lines[0]
    assert lines[1].endswith(": ok")  # judged per rank


def test_trust_check_is_registered_for_both_versions_on_a_model_spec() -> None:
    trust = [c for c in MEMORY_CHECKS if c.name == "memory.plan_estimate_matches"]
    assert {c.params["version"] for c in trust} == {"fsdp1", "fsdp2"}
    for check in trust:
        assert check.name == "memory.plan_estimate_matches" and check.claim == "memory"
        assert isinstance(check.params["spec"], ModelSpec)
        assert check.rank_fn is rank_plan_estimate_matches
    user = ModelSpec(
        reference=None, factory="fsdp_conformance.models.reference_models:MassiveModel"
    )
    # On a user's model monolithic is not measured (it may not fit unsharded).
    assert {c["policy"] for c in default_cases(user, "fsdp2")} == {"recommended"}


#: The Hugging Face Llama at 2 layers (issue: a false "too loose" on FSDP2 at 0.439).
HF_LLAMA_2L = ModelSpec(reference=None, factory="fsdp_conformance.hf_models:llama", depth=2)


def test_fsdp2_estimate_counts_the_prefetched_unit_once_as_its_all_gather_output() -> None:
    # FSDP2 holds the prefetched unit as its all-gather output until its own copy-out, and in
    # forward the current unit's output until the next copy-out: a second unsharded unit next
    # to the all-gather buffers counted one layer twice (fsdp1 gathers in place: two units).
    case = {"spec": HF_LLAMA_2L, "policy": "recommended", "optimizer": "none"}
    layer, root = 36_992, 64  # hf_models.llama: dim 64, MLP 128, 2 kv heads; the final norm
    fsdp2 = estimate_for_case({**case, "version": "fsdp2"}, 2)
    assert fsdp2.term("unsharded params").bytes == (root + layer) * 4
    assert fsdp2.term("all-gather buffers").bytes == (layer // 2 + layer) * 4
    fsdp1 = estimate_for_case({**case, "version": "fsdp1"}, 2)
    assert fsdp1.term("unsharded params").bytes == (root + 2 * layer) * 4
    assert fsdp1.term("all-gather buffers").bytes == 0


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_fsdp2_estimate_is_not_too_loose_on_a_two_layer_hf_llama(ranks: Ranks) -> None:
    # The bound counts FSDP2's prefetched unit once: counted twice, the estimate was 1.96 MB
    # against a measured peak of 859.02 KB, 0.439 < 0.45 ("too loose").
    params = {"spec": HF_LLAMA_2L, "version": "fsdp2"}
    values = ranks.run(rank_plan_estimate_matches, **params)
    verdict = verdict_plan_estimate_matches(values, params)
    assert verdict.passed, verdict.message
    assert verdict.figures["min_ratio"] >= TRUST_MIN_RATIO["recommended"]


def test_plans_that_differ_only_in_what_the_forward_does_not_read_share_one_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The meta forward reads the compute dtype, batch, sequence and attention: a shard group,
    CPU offload, the FSDP version, the optimizer, the storage dtype, the policy or the
    checkpointing reuse one profile (each 70B profile is seconds); any of the four profiles anew.
    """
    from fsdp_conformance.plan import activations

    calls = []
    real = activations.profile_step_activations
    monkeypatch.setattr(
        activations, "profile_step_activations", lambda *a, **k: calls.append(a[3]) or real(*a, **k)
    )
    monkeypatch.setattr(activations, "_SPEC_PROFILES", {})  # none from this session's other plans
    choice = choose_model(reference="llama", layers=2, dim=32)
    meta = build_meta_model(choice)
    base = PlanSettings(seq_len=16)
    plans = [
        plan_model(choice, dataclasses.replace(base, **change), meta)
        for change in (
            {},
            {"shard_group_size": 2},
            {"cpu_offload": True},
            {"version": "fsdp1"},
            {"optimizer": "none"},
            {"param_dtype": "bf16"},
            {"policy": "monolithic"},
            {"checkpointing": "full"},
        )
    ]
    assert len(calls) == 1
    assert all(p.activations.input_bytes == plans[0].activations.input_bytes for p in plans)
    for change in (
        {"compute_dtype": "fp32"},
        {"batch_size": 2},
        {"seq_len": 32},
        {"attention": "math"},
    ):
        plan_model(choice, dataclasses.replace(base, **change), meta)
    assert len(calls) == 5
    # A reference model is named by its spec: another meta build of it reuses the profiles...
    again = plan_model(choice, base, build_meta_model(choice))
    assert len(calls) == 5 and again.activations == plans[0].activations
    # ...another config of it does not.
    plan_model(choose_model(reference="llama", layers=2, dim=64), base)
    assert len(calls) == 6


def test_a_factorys_profile_is_kept_on_its_model_object_not_by_spec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A factory's spec names a path whose code may change in the process: a new build profiles
    anew; the same model object planned again does not."""
    from fsdp_conformance.plan import activations

    calls = []
    real = activations.profile_step_activations
    monkeypatch.setattr(
        activations, "profile_step_activations", lambda *a, **k: calls.append(a[3]) or real(*a, **k)
    )
    choice = choose_model(factory="fsdp_conformance.hf_models:llama")
    meta = build_meta_model(choice)
    settings = PlanSettings(seq_len=16)
    plan_model(choice, settings, meta)
    plan_model(choice, settings, meta)
    assert len(calls) == 1
    plan_model(choice, settings, build_meta_model(choice))
    assert len(calls) == 2


@pytest.mark.parametrize("reference", ["llama", "massive", "tied", "lora", "embedding_classifier"])
def test_a_deep_reference_model_is_profiled_at_three_blocks_with_its_whole_forwards_figures(
    reference: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reference model or preset deeper than three blocks runs three on meta (the first, a
    middle one, the last; the 70B preset's 80 cost three): per module, the bytes and FLOPs of
    its whole forward, fp32 and bf16. A model its spec does not name (a factory) runs whole."""
    from fsdp_conformance.plan import activations

    depths: list[int] = []
    real = activations.profile_step_activations
    monkeypatch.setattr(
        activations,
        "profile_step_activations",
        lambda model, *a: depths.append(len(model.layers)) or real(model, *a),
    )
    choice = choose_model(reference=reference, layers=6, dim=32)
    model = build_meta_model(choice)
    every = [UnitInfo(fqn=n, cls=type(m).__name__, numel=0) for n, m in model.named_modules()]
    for settings in (
        PlanSettings(seq_len=16, compute_dtype="fp32"),
        PlanSettings(seq_len=16, attention="math"),
    ):
        repeated = activations._module_profile(model, choice, settings)
        assert depths[-1] == activations.PROFILED_BLOCKS == 3
        whole = real(model, choice, every, settings)
        # Exact, but for what the root saved (it holds every block: it grows with the depth),
        # which the copy leaves out (the root is never checkpointed).
        assert "" not in repeated.backward_with_saved_by_unit
        whole_less_root = {k: v for k, v in whole.backward_with_saved_by_unit.items() if k != ""}
        assert repeated == dataclasses.replace(whole, backward_with_saved_by_unit=whole_less_root)
        assert whole.forward_flops[""] > 0 and set(whole.saved_bytes) == {u.fqn for u in every}
    factory = ModelChoice(
        ModelSpec(reference=None, factory="fsdp_conformance.hf_models:llama"), "a factory"
    )
    activations._module_profile(model, factory, PlanSettings(seq_len=16))
    assert depths[-1] == 6


def test_the_memory_checks_profile_counts_the_planners_bytes_without_its_flops() -> None:
    """The memory checks' meta profile (profile.plan_step) leaves out the FLOP counter, which
    only the planner's recompute cost reads; its bytes are the planner's for the same forward
    (fp32, unfused attention, batch 2 x 8)."""
    from fsdp_conformance.measure.profile import plan_step

    choice = choose_model(reference="llama", layers=2, dim=32)
    memory_profile = plan_step(choice.spec, 2, "fsdp2")[1].activations
    assert memory_profile is not None and memory_profile.forward_flops == {}
    planned = plan_model(
        choice,
        PlanSettings(
            seq_len=8, batch_size=2, compute_dtype="fp32", attention="math", optimizer="none"
        ),
    ).activations
    assert planned.forward_flops["layers.0"] > 0
    assert (
        memory_profile.saved_bytes,
        memory_profile.produced_bytes,
        memory_profile.input_bytes,
    ) == (planned.saved_bytes, planned.produced_bytes, planned.input_bytes)
