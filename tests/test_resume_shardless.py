"""``state.resume`` and ``state.resume.dcp_shardless`` (FSDP1) on hand-written models: a
parameter with fewer rows than ranks leaves a rank no shard of it in FSDP1's sharded state dict,
and torch 2.13's ``dcp.load`` then fails the optimizer resume ("Missing key in checkpoint
state_dict: optim.param_groups", seen on Qwen2-MoE and ViT). ``state.resume`` checks the other
kinds and leaves the dcp kind to ``state.resume.dcp_shardless``, whose failure is one line naming
torch's behaviour (an expected failure on the torch versions of ``expectations.toml``); a model
where every rank holds a shard of every parameter, one of them given no gradient, resumes from
the files and passes, and ``state.resume.dcp_shardless`` skips it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance.claims import state
from fsdp_conformance.claims.check import XFAILED, Check, execute, expectation_for, run_check
from fsdp_conformance.claims.state import resume
from fsdp_conformance.harness import CheckSkipped, Ranks
from fsdp_conformance.models.model_spec import ModelSpec

pytestmark = pytest.mark.cpu

DIM = 8


class ShardBlock(nn.Module):
    """One FSDP1 unit: a linear layer and a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class ShardNet(nn.Module):
    """Two blocks and a head of ``rows`` outputs; ``unused``: a layer the forward never runs
    (its parameters get no gradient, so AdamW keeps no state for them)."""

    def __init__(self, rows: int, unused: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ShardBlock(), ShardBlock()])
        self.head = nn.Linear(DIM, rows)
        self.unused = nn.Linear(DIM, DIM) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def one_row_head() -> nn.Module:
    """A ``Linear(8, 1)`` head: one row, so at world size 2 rank 1 holds no shard of it."""
    return ShardNet(rows=1, unused=False)


def every_rank_a_shard() -> nn.Module:
    """Every parameter with at least 4 rows, and a layer that gets no gradient."""
    return ShardNet(rows=4, unused=True)


def rows(model: nn.Module, batch_size: int, device: Any) -> torch.Tensor:
    """The input: ``batch_size`` rows of ``DIM`` features."""
    return torch.randn(batch_size, DIM, generator=torch.Generator().manual_seed(0)).to(device)


def spec(factory: str) -> ModelSpec:
    return ModelSpec(
        reference=None,
        factory=f"{__name__}:{factory}",
        block_cls=("ShardBlock",),
        input_builder=f"{__name__}:rows",
    )


def fsdp1(name: str) -> Check:
    (check,) = (c for c in state.CHECKS if c.name == name and c.params["version"] == "fsdp1")
    return check


@pytest.mark.world_size(2)
def test_fsdp1_dcp_resume_with_a_rank_without_a_shard_is_one_line_naming_torchs_defect(
    ranks: Ranks,
) -> None:
    model = spec("one_row_head")
    resumed = run_check(ranks, fsdp1("state.resume"), spec=model)
    assert resumed.passed, resumed.message
    assert resumed.figures["kinds"] == ["full", "full_rank0_only", "sharded"]
    assert resumed.figures["dcp_left_to"] == resume.DCP_SHARDLESS_CHECK
    assert "no shard of head.bias, head.weight, fewer rows than ranks" in resumed.message

    check = fsdp1(resume.DCP_SHARDLESS_CHECK)
    verdict = run_check(ranks.configured(xfail=None, skip=None), check, spec=model)
    if expectation_for(ranks, check, {**check.params, "spec": model}) is None:
        assert verdict.passed, (
            "fails on a torch no expectation names: record it in "
            "fsdp_conformance/expectations.toml\n" + verdict.message
        )
        return
    assert not verdict.passed
    assert "\n" not in verdict.message, verdict.message
    assert verdict.message.startswith(
        "FSDP1 + DCP optimizer resume fails when a rank holds no shard of a parameter "
        "(head.bias, head.weight: fewer rows than ranks): dcp.load's planner"
    ), verdict.message
    assert "Missing key in checkpoint state_dict: optim.param_groups" in verdict.message
    assert verdict.message.endswith(f"ranks 0, 1): torch {torch.__version__}")
    assert verdict.figures["failed_ranks"] == [0, 1]
    assert execute(ranks, check, spec=model).outcome == XFAILED


@pytest.mark.world_size(2)
def test_fsdp1_dcp_resume_where_every_rank_holds_a_shard_passes_with_an_unused_layer(
    ranks: Ranks,
) -> None:
    model = spec("every_rank_a_shard")
    resumed = run_check(ranks, fsdp1("state.resume"), spec=model)
    assert resumed.passed, resumed.message
    assert resumed.figures["kinds"] == list(resume.RESUME_KINDS["fsdp1"])
    assert "dcp_left_to" not in resumed.figures
    with pytest.raises(CheckSkipped, match="every rank holds a shard of every parameter"):
        run_check(
            ranks.configured(xfail=None, skip=None), fsdp1(resume.DCP_SHARDLESS_CHECK), spec=model
        )


def test_a_dcp_load_error_other_than_the_planners_is_named_as_raised() -> None:
    values: list[Any] = [
        {
            "rank": r,
            "version": "fsdp1",
            "unbroken": {"loss": 1.0, "loss_hex": "x", "digests": {}},
            "kinds": {},
            "shardless": ["a.weight"],
            "dcp_failure": "ValueError: something else",
        }
        for r in (0, 1)
    ]
    check = fsdp1(resume.DCP_SHARDLESS_CHECK)
    verdict = check.verdict(values, check.params)
    assert not verdict.passed
    assert "(a.weight: fewer rows than ranks): dcp.load raised (ValueError: something else" in (
        verdict.message
    )
    assert "pre-2.4" not in verdict.message
