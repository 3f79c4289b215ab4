"""``loop.clipping.l2`` / ``loop.clipping.inf``: gradient clipping by the global norm, FSDP1 and
FSDP2, against the slice-wise reference on the odd model (float32, as users clip).

On torch 2.13 one variant meets a torch defect (``expectations.toml``): FSDP2's inf-norm clip
raises on the rank that holds an empty shard (the odd model's one-element ``gain``) while the
others wait in the norm's all-reduce. It is run for real here: it must fail exactly where an
expectation names it, and pass on any other torch. The L2 clip is judged in full on both
versions, the inf clip on FSDP1 and, for FSDP2, on a model where every rank holds part of every
parameter; the negative controls (``clipping.FAULTS``) run on both versions and both norm
types; the verdict's rules are also failed one at a time on the clean run's values, in the
parent.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from loop_runs import by_version
from torch import nn

from fsdp_conformance.claims.check import Check, expectation_for, run_check
from fsdp_conformance.harness import RankFailure, Ranks
from fsdp_conformance.models.model_spec import ModelSpec

pytestmark = pytest.mark.cpu


L2 = by_version("loop.clipping.l2")
INF = by_version("loop.clipping.inf")
CHECKS = {"loop.clipping.l2": L2, "loop.clipping.inf": INF}

# --------------------------------------------------------------------------------------------
# A model where every rank holds part of every parameter (world sizes 2 and 4)
# --------------------------------------------------------------------------------------------

DIM = 8


class EvenBlock(nn.Module):
    """One unit: a linear layer and a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class EvenNet(nn.Module):
    """Two blocks and a head of 4 outputs: every parameter has 4 or 8 rows."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([EvenBlock(), EvenBlock()])
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def even_net() -> nn.Module:
    return EvenNet()


def rows(model: nn.Module, batch_size: int, device: Any) -> torch.Tensor:
    """The input: ``batch_size`` rows of ``DIM`` features."""
    return torch.randn(batch_size, DIM, generator=torch.Generator().manual_seed(0)).to(device)


EVEN = ModelSpec(
    reference=None,
    factory=f"{__name__}:even_net",
    block_cls=("EvenBlock",),
    input_builder=f"{__name__}:rows",
)

# --------------------------------------------------------------------------------------------
# FSDP2's L2 clip, judged in full
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Every rank's values of FSDP2's clean L2 run: the positive test and the parent-side
    negative controls judge the same values."""
    return {}


def clean_l2(ranks: Ranks, shared: dict[tuple[Any, ...], list[dict[str, Any]]]) -> Any:
    key = (ranks.device_type, ranks.world_size)
    if key not in shared:
        shared[key] = ranks.run(L2["fsdp2"].rank_fn, **L2["fsdp2"].params)
    return copy.deepcopy(shared[key])


def test_fsdp2_l2_clip_norm_is_identical_on_every_rank_and_equals_the_reference(
    ranks: Ranks, shared_runs: dict
) -> None:
    check = L2["fsdp2"]
    verdict = check.verdict(clean_l2(ranks, shared_runs), check.params)
    assert verdict.passed, verdict.message
    assert len(verdict.figures["total_norm"]) == verdict.figures["steps"] == 2
    # max_norm is half the reference's norm: the clipped gradient keeps half of it (less the
    # 1e-6 torch adds to the norm), observed on the reference whose update the sharded one equals
    assert all(abs(r - 0.5) < 1e-5 for r in verdict.figures["clip_ratio"])
    # torch 2.13 returns the total norm as a replicated DTensor
    assert all(t == "DTensor(Replicate())" for t in verdict.data["returned"])
    # the norm reduced across ranks by DTensor's functional all-reduce, one per clip, float32
    for per_rank in verdict.data["clip_collectives"].values():
        assert all(ops == ["all_reduce torch.float32 76B"] for ops in per_rank.values())


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_fsdp1_clip_norm_is_identical_on_every_rank_and_equals_the_reference(
    ranks: Ranks, name: str
) -> None:
    verdict = run_check(ranks, CHECKS[name]["fsdp1"])
    assert verdict.passed, verdict.message
    assert all(abs(r - 0.5) < 1e-5 for r in verdict.figures["clip_ratio"])
    assert verdict.figures["dtype"] == "torch.float32"
    # FSDP1 reduces the norm itself: one all-reduce per clip (its returned norm a plain tensor)
    assert all(t.startswith("Tensor(") for t in verdict.data["returned"])
    for per_rank in verdict.data["clip_collectives"].values():
        assert all([op.split()[0] for op in ops] == ["all_reduce"] for ops in per_rank.values()), (
            per_rank
        )


def test_each_rule_of_the_verdict_fails_on_its_own(ranks: Ranks, shared_runs: dict) -> None:
    """Parent-side controls on the clean run's values: one rank's norm one ulp off (bitwise
    across ranks), every norm 1e-4 off the reference, one rank's clip without an all-reduce."""
    check = L2["fsdp2"]
    ulp = clean_l2(ranks, shared_runs)
    ulp[-1]["total_norms"][0] = math.nextafter(ulp[-1]["total_norms"][0], math.inf)
    verdict = check.verdict(ulp, check.params)
    assert not verdict.passed
    assert "step 0: the total norm differs across ranks" in verdict.message
    assert "differs from the reference's" not in verdict.message, "one ulp is within tolerance"

    off = clean_l2(ranks, shared_runs)
    for value in off:
        value["total_norms"][1] *= 1 + 1e-4
    verdict = check.verdict(off, check.params)
    assert not verdict.passed and "across ranks" not in verdict.message
    assert (
        "step 1: total norm" in verdict.message and "> 1.0e-05, the model's own" in verdict.message
    )

    silent = clean_l2(ranks, shared_runs)
    silent[0]["clip_collectives"]["clip 1"] = []
    verdict = check.verdict(silent, check.params)
    assert not verdict.passed
    assert verdict.message.endswith(
        "rank 0: clip 1: no all-reduce issued: the norm was not reduced across ranks "
        "(issued: nothing)"
    )


def test_fsdp2_inf_clip_equals_the_reference_where_every_rank_holds_a_shard(ranks: Ranks) -> None:
    verdict = run_check(ranks.configured(xfail=None), INF["fsdp2"], spec=EVEN)
    assert verdict.passed, verdict.message
    assert all(abs(r - 0.5) < 1e-5 for r in verdict.figures["clip_ratio"])
    # the inf norm comes back partial (each rank its local max): the all-reduce of the user's
    # full_tensor() follows DTensor's own one for the clip coefficient
    assert all(t == "DTensor(Partial(max))" for t in verdict.data["returned"])
    for per_rank in verdict.data["clip_collectives"].values():
        assert all(ops == ["all_reduce torch.float32 4B"] * 2 for ops in per_rank.values())


# --------------------------------------------------------------------------------------------
# The known torch defects, for real
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("check", "torch_error"),
    [
        pytest.param(
            INF["fsdp2"],
            "_foreach_norm cannot compute the infinity norm on an empty tensor because the "
            "operation does not have an identity",
            id="fsdp2-inf-empty-shard",
        ),
    ],
)
def test_a_clip_torch_cannot_run_fails_exactly_where_an_expectation_names_it(
    ranks: Ranks, check: Check, torch_error: str
) -> None:
    """FSDP2's inf clip raises on the ranks holding an empty shard of the one-element gain while
    rank 0 waits in the norm's all-reduce. On any torch no expectation names, the check must
    pass."""
    if expectation_for(ranks, check, check.params) is None:
        verdict = run_check(ranks.configured(xfail=None), check)
        assert verdict.passed, (
            "fails on a torch no expectation names: record it in "
            "fsdp_conformance/expectations.toml\n" + verdict.message
        )
        return
    with pytest.raises(RankFailure) as failure:
        run_check(ranks.configured(xfail=None), check)
    told = str(failure.value)
    assert f"RuntimeError: {torch_error}" in told
    if check.params["version"] == "fsdp2":
        assert "rank 0 did not finish" in told, "rank 0 holds the gain: it waits, never raises"


# --------------------------------------------------------------------------------------------
# Negative controls: both faults, both versions, both norm types
# --------------------------------------------------------------------------------------------


def run_fault(ranks: Ranks, check: Check, fault: str) -> Any:
    return check.verdict(ranks.run(check.rank_fn, **{**check.params, "fault": fault}), check.params)


@pytest.mark.parametrize(
    ("name", "version"), [("loop.clipping.l2", "fsdp2"), ("loop.clipping.inf", "fsdp1")]
)
def test_a_norm_of_the_local_shards_only_fails(ranks: Ranks, name: str, version: str) -> None:
    verdict = run_fault(ranks, CHECKS[name][version], "local_norm")
    assert not verdict.passed
    assert "the total norm differs across ranks" in verdict.message
    assert "differs from the reference's" in verdict.message
    assert "update: " in verdict.message and verdict.figures["update_rel_diff"] >= 0.3
    assert "no all-reduce issued" in verdict.message


@pytest.mark.parametrize(
    ("name", "version"), [("loop.clipping.l2", "fsdp1"), ("loop.clipping.inf", "fsdp2")]
)
def test_a_skipped_clip_fails(ranks: Ranks, name: str, version: str) -> None:
    verdict = run_fault(ranks, CHECKS[name][version], "no_clip")
    assert not verdict.passed
    assert "the clip step returned no total norm (None" in verdict.message
    assert verdict.figures["total_norm"] == [None, None]
    # unclipped, each update is twice the reference's: off by its whole scale
    assert "update: " in verdict.message and verdict.figures["update_rel_diff"] >= 0.3
