"""Every tensor kind, batch statistics, measured fp16 tolerances and compute dtypes, on trait
models (tests/numerics_models.py): each check runs them without a crash or a false alarm, and a
fault on the same model still fails.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numerics_models
import pytest
import torch

from fsdp_conformance import cli
from fsdp_conformance.claims import init, loop, stack, state, wrap
from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.claims.loop import clipping
from fsdp_conformance.claims.stack import loss_scaling
from fsdp_conformance.fsdp.reference_step import (
    SliceReference,
    buffers_kept,
    compare_tensors,
    comparison_problems,
    norm_of,
)
from fsdp_conformance.fsdp.tensors import max_abs_diff, total
from fsdp_conformance.harness import CheckSkipped, Ranks
from fsdp_conformance.models.model_spec import ModelSpec

MODELS = numerics_models.__name__
KINDS = ModelSpec(reference=None, factory=f"{MODELS}:buffer_kinds", block_cls=("KindsBlock",))
MOE = ModelSpec(reference=None, factory=f"{MODELS}:top_k_moe", block_cls=("MoEBlock",))
CNN = ModelSpec(
    reference=None,
    factory=f"{MODELS}:small_cnn",
    block_cls=("ConvBlock",),
    input_builder=f"{MODELS}:images",
)
POSITIONS = ModelSpec(
    reference=None, factory=f"{MODELS}:float_positions", block_cls=("Sequential",)
)
FP32_HEAD = ModelSpec(reference=None, factory=f"{MODELS}:fp32_head", block_cls=("Sequential",))


def check_of(checks: list[Check], name: str, version: str | None = None) -> Check:
    return next(c for c in checks if c.name == name and version in (None, c.params.get("version")))


def judged(
    ranks: Ranks, check: Check, spec: ModelSpec, fault: str | None = None
) -> tuple[Verdict, list[Any]]:
    params = {**check.params, "spec": spec}
    values = ranks.run(check.rank_fn, **params, **({"fault": fault} if fault else {}))
    return check.verdict(values, params), values


# --------------------------------------------------------------------------------------------
# Every tensor kind, compared one way (no ranks)
# --------------------------------------------------------------------------------------------


@pytest.mark.cpu
def test_tensors_of_every_kind_compare_exactly_or_in_fp64() -> None:
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    phase = torch.polar(torch.ones(3), torch.tensor([0.0, 0.5, 1.0]))
    ref = {
        "mask": mask,
        "count": torch.tensor(3),
        "phase": phase,
        "half": torch.ones(3, dtype=torch.float16),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
    }
    same = compare_tensors({k: v.clone() for k, v in ref.items()}, ref)
    assert same["max_rel"] == 0.0 and same["not_bitwise"] == same["exact_mismatch"] == []
    assert comparison_problems("buffers", same, 1e-6) == []
    flipped = {**ref, "mask": ~mask, "count": torch.tensor(4), "phase": phase * 1j}
    c = compare_tensors(flipped, ref)
    assert c["exact_mismatch"] == ["count", "mask"]
    assert c["worst"] == "phase" and c["max_rel"] > 0.5
    assert any("exact values" in p for p in comparison_problems("buffers", c, 1e-6))
    assert max_abs_diff(mask, ~mask) == 1.0 and max_abs_diff(mask, mask) == 0.0
    assert total(phase) == pytest.approx(float(phase.real.sum() + phase.imag.sum()))
    assert total(mask) == 10 and isinstance(total(mask), int)
    assert norm_of({"mask": mask, "half": ref["half"]}) == pytest.approx(3**0.5)


@pytest.mark.cpu
def test_a_probe_forward_leaves_running_statistics_and_counters_as_they_were() -> None:
    model = numerics_models.SmallCNN()
    block = numerics_models.KindsModel()
    before = {n: b.clone() for n, b in model.named_buffers()}
    with torch.no_grad(), buffers_kept(model):
        model(torch.randn(4, 3, 8, 8))
        assert not torch.equal(model.layers[0].bn.running_mean, before["layers.0.bn.running_mean"])
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())
    with buffers_kept(block):
        block(torch.randint(0, 8, (2, 5)))
    assert int(block.layers[0].calls) == 0


@pytest.mark.cpu
def test_the_slice_reference_keeps_each_ranks_batch_statistics_apart() -> None:
    torch.manual_seed(0)
    model = numerics_models.SmallCNN()
    reference = SliceReference(model, 2)
    low, high = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8) + 5.0
    reference.forward_backward([low, high])
    means = [reference.buffers(r)["layers.0.bn.running_mean"] for r in (0, 1)]
    assert not torch.equal(means[0], means[1])


# --------------------------------------------------------------------------------------------
# Every tensor kind through the checks that compare tensors
# --------------------------------------------------------------------------------------------

KIND_CHECKS = [
    (loop.CHECKS, "loop.buffers", "fsdp2"),
    (loop.CHECKS, "loop.buffers", "fsdp1"),
    (state.CHECKS, "state.round_trip", "fsdp1"),
    (state.CHECKS, "state.resume", "fsdp2"),
    (init.CHECKS, "init.weights", "fsdp2"),
    (init.CHECKS, "init.no_meta", "fsdp1"),
    (init.CHECKS, "init.train_step", "fsdp2"),
    (wrap.CHECKS, "wrap.train.fp32", "fsdp1"),
    (stack.CHECKS, "stack.loss_scaling", "fsdp2"),
]


@pytest.mark.parametrize(
    ("checks", "name", "version"), KIND_CHECKS, ids=[f"{n}-{v}" for _, n, v in KIND_CHECKS]
)
def test_buffers_of_every_kind_pass_the_checks_that_compare_tensors(
    ranks: Ranks, checks: list[Check], name: str, version: str
) -> None:
    """A bool causal mask, an integer counter, a complex table, fp16 (not persistent) and bf16
    buffers: no crash, no false alarm."""
    verdict, _ = judged(ranks, check_of(checks, name, version), KINDS)
    assert verdict.passed, verdict.message


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_negative_control_a_corrupted_bool_buffer_fails_loop_buffers(
    ranks: Ranks, version: str
) -> None:
    verdict, _ = judged(
        ranks, check_of(loop.CHECKS, "loop.buffers", version), KINDS, "buffer_corrupted"
    )
    assert not verdict.passed
    assert "exact values (bool or integer) differ: layers.0.mask" in verdict.message


# --------------------------------------------------------------------------------------------
# Batch norm: each rank's statistics its own
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize(
    ("checks", "name"),
    [
        (wrap.CHECKS, "wrap.train.fp32"),
        (init.CHECKS, "init.no_meta"),
        (init.CHECKS, "init.weights"),
        (init.CHECKS, "init.train_step"),
    ],
    ids=["wrap.train.fp32", "init.no_meta", "init.weights", "init.train_step"],
)
def test_a_batch_norm_cnn_passes_training_and_init_on_both_versions(
    ranks: Ranks, checks: list[Check], name: str, version: str
) -> None:
    verdict, _ = judged(ranks, check_of(checks, name, version), CNN)
    assert verdict.passed, verdict.message


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_negative_control_a_wrong_train_step_still_fails_on_the_batch_norm_cnn(
    ranks: Ranks, version: str
) -> None:
    check = check_of(wrap.CHECKS, "wrap.train.fp32", version)
    verdict, _ = judged(ranks, check, CNN, "summed_grads")
    assert not verdict.passed
    assert "fp32 training under FSDP differs from the reference" in verdict.message
    assert "update differs from the reference's" in verdict.message


# --------------------------------------------------------------------------------------------
# Compute dtype: what a module computes in, not an embedding's indices
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_an_embedding_fed_float_positions_computes_in_bf16(ranks: Ranks, version: str) -> None:
    verdict, values = judged(ranks, check_of(wrap.CHECKS, "wrap.train.bf16", version), POSITIONS)
    assert verdict.passed, verdict.message
    assert values[0]["compute_dtypes"]["positions"][0] != "torch.bfloat16"  # the float input
    assert values[0]["output_dtypes"]["positions"] == "torch.bfloat16"


def test_a_module_upcasting_its_bf16_weight_in_its_own_code_is_named_not_failed(
    ranks: Ranks,
) -> None:
    # A mixture of experts' router computing its logits in fp32 on purpose (the corpus's
    # AXK1): FSDP handed it bf16 weights, which is what wrap.train.bf16 proves; its own upcast
    # is the model's numerics, named in the verdict. FSDP not casting at all (the weight fp32:
    # fault no_mixed_precision) still fails (tests/test_wrapping.py).
    verdict, _ = judged(ranks, check_of(wrap.CHECKS, "wrap.train.bf16", "fsdp2"), FP32_HEAD)
    assert verdict.passed, verdict.message
    assert "1 module(s) upcast in their own code" in verdict.message
    assert "head (float32)" in verdict.message


# --------------------------------------------------------------------------------------------
# fp16 loss scaling: the tolerance from the model's own fp16 noise
# --------------------------------------------------------------------------------------------

FP16_MODELS = [(MOE, "fsdp1"), (MOE, "fsdp2"), (CNN, "fsdp1")]


@pytest.mark.parametrize(("spec", "version"), FP16_MODELS, ids=["moe-1", "moe-2", "cnn-1"])
def test_fp16_loss_scaling_passes_a_moe_and_a_cnn_with_its_measured_tolerance(
    ranks: Ranks, spec: ModelSpec, version: str
) -> None:
    verdict, _ = judged(ranks, check_of(stack.CHECKS, "stack.loss_scaling", version), spec)
    assert verdict.passed, verdict.message
    tol = verdict.data["tolerances"]
    assert 0 < tol["noise"] and tol["update"] >= loss_scaling.UPDATE_RTOL
    assert "x the model's own fp16 noise" in verdict.message


@pytest.mark.parametrize(("spec", "version"), FP16_MODELS, ids=["moe-1", "moe-2", "cnn-1"])
@pytest.mark.parametrize("fault", ["scale_not_applied", "not_unscaled"])
def test_negative_control_a_scaling_fault_still_fails_on_them(
    ranks: Ranks, spec: ModelSpec, version: str, fault: str
) -> None:
    check = check_of(stack.CHECKS, "stack.loss_scaling", version)
    verdict, _ = judged(ranks, check, spec, fault)
    assert not verdict.passed
    assert "update:" in verdict.message and "of its scale >" in verdict.message


def _finite_step(update_rel: float, noise: float) -> dict[str, Any]:
    return {
        "poisoned": "",
        "update": {"max_rel": update_rel, "worst": "w"},
        "loss": 1.0,
        "ref_loss": 1.0,
        "noise": noise,
        "loss_noise": 0.0,
    }


def test_the_tolerance_grows_with_the_measured_noise_up_to_its_cap() -> None:
    """Parent side: a difference of 0.05 passes a model whose fp16 step measured 0.02 from fp32
    (5 x 0.02 = 0.1), fails one that measured nothing (0.02 fixed), and a model whose noise
    asks for more than the cap is reported as too noisy, never passed."""

    def problems(update_rel: float, noise: float) -> list[str]:
        values: Any = [
            {"rank": r, "finite": True, "steps": [_finite_step(update_rel, noise)]} for r in (0, 1)
        ]
        return loss_scaling._parity_problems(values, loss_scaling.tolerances(values))

    assert problems(0.05, 0.02) == []
    assert any("> 2.0e-02" in p for p in problems(0.05, 0.0))
    # A fault (the whole update) on a noisy model: beyond the capped tolerance as well.
    assert any("> 2.5e-01" in p for p in problems(1.0, 0.2))

    def verdict(update_rel: float, noise: float) -> Any:
        poisoned = [loss_scaling.POISONED.get(i, "") for i in range(loss_scaling.STEPS)]
        scales = loss_scaling.expected_scales(poisoned)
        steps = [
            {
                **_finite_step(update_rel, 0.0 if how else noise),
                "poisoned": how,
                "changed": not how,
                "ref_changed": not how,
                "scale": scale,
                "ref_scale": scale,
            }
            for how, scale in zip(poisoned, scales)
        ]
        values: Any = [
            {"rank": r, "finite": True, "steps": steps, "poisoned_param": "", "input_casts": None}
            for r in (0, 1)
        ]
        return loss_scaling.verdict_loss_scaling(values, {})

    # Within the cap on a noisy model: skipped, saying why, never passed; the fault still fails,
    # its message saying the model is noisy too.
    with pytest.raises(CheckSkipped, match="too noisy in fp16"):
        verdict(0.05, 0.2)
    failed = verdict(1.0, 0.2)
    assert not failed.passed and "too noisy in fp16" in failed.message


# --------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------


@pytest.mark.process  # a whole run: the process lane
def test_the_whole_run_passes_a_model_with_buffers_of_every_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_conformance.gate.report import load_report

    for variable in [k for k in os.environ if k.startswith("FSDP_CONFORMANCE_")]:
        monkeypatch.delenv(variable)
    monkeypatch.chdir(Path(numerics_models.__file__).parent)
    code = cli.main(
        [
            "run",
            "--model",
            f"{MODELS}:buffer_kinds",
            "--block-cls",
            "KindsBlock",
            "--out",
            str(tmp_path / "out"),
            "--no-plot",
        ]
    )
    out, err = capsys.readouterr()
    report = load_report(str(tmp_path / "out" / "report.json"))
    bad = [
        f"{e['id']}: {e['outcome']}: {e['message'][:600]}"
        for e in report["checks"]
        if e["outcome"] in ("failed", "error")
    ]
    assert bad == [], "\n".join(bad)
    assert code == cli.EXIT_OK, out + err


# --------------------------------------------------------------------------------------------
# fp32 clipping: the norm's tolerance from the model's own reduction-order noise
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_clipping_on_a_moe_passes_with_its_measured_norm_tolerance(
    ranks: Ranks, version: str
) -> None:
    verdict, values = judged(ranks, check_of(loop.CHECKS, "loop.clipping.l2", version), MOE)
    assert verdict.passed, verdict.message
    assert all(0 <= x < 1e-5 for v in values for x in v["norm_noise"])
    assert verdict.figures["norm_rtol"] >= clipping.NORM_RTOL


def test_negative_control_a_local_norm_still_fails_clipping_on_the_moe(ranks: Ranks) -> None:
    check = check_of(loop.CHECKS, "loop.clipping.l2", "fsdp1")
    verdict, _ = judged(ranks, check, MOE, "local_norm")
    assert not verdict.passed
    assert "total norm" in verdict.message and "the model's own norm noise" in verdict.message


def test_the_norm_tolerance_follows_the_measured_noise_up_to_its_cap() -> None:
    def tolerance(noise: float) -> float:
        values: Any = [{"norm_noise": [0.0, noise]}]
        return clipping.norm_tolerance(values)[0]

    assert tolerance(0.0) == clipping.NORM_RTOL
    assert tolerance(1e-5) == pytest.approx(clipping.NORM_NOISE_FACTOR * 1e-5)
    assert tolerance(1.0) == clipping.NORM_CAP
    noisy: Any = [{"norm_noise": [1e-3]}]
    assert "too noisy" in clipping._noise_problems(noisy)[0]
