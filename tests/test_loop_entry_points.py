"""``loop.entry_points``: two forwards before one backward, a block's own forward in the loss,
the user's gradient divide factor (FSDP2), each with the optimizer made after the first
backward, against the reference; each with its negative control. One clean run per check and
version serves the positive test and the parent-side checks.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from loop_runs import by_version, clean_run
from torch import nn

from fsdp_conformance.claims.check import Check
from fsdp_conformance.claims.loop import entry_points
from fsdp_conformance.claims.loop.common import torch_raised
from fsdp_conformance.harness import Ranks

pytestmark = pytest.mark.cpu


TWO = by_version("loop.entry_points.two_forwards")
NON_ROOT = by_version("loop.entry_points.non_root")
FACTOR = by_version("loop.entry_points.divide_factor")
CHECKS = {"two_forwards": TWO, "non_root": NON_ROOT, "divide_factor": FACTOR}
RUNS = [(what, version) for what, checks in CHECKS.items() for version in sorted(checks)]


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Every rank's values of one clean run per (world size, check, version)."""
    return {}


def run_fault(ranks: Ranks, check: Check, fault: str) -> Any:
    return check.verdict(ranks.run(check.rank_fn, **{**check.params, "fault": fault}), check.params)


def test_divide_factor_is_fsdp2_only() -> None:
    assert sorted(FACTOR) == ["fsdp2"] and sorted(TWO) == sorted(NON_ROOT) == ["fsdp1", "fsdp2"]


@pytest.mark.parametrize(("what", "version"), RUNS)
def test_each_entry_point_equals_the_reference_with_every_unit_reduced(
    ranks: Ranks, shared_runs: dict, what: str, version: str
) -> None:
    values = clean_run(ranks, shared_runs, CHECKS[what][version])
    check = CHECKS[what][version]
    verdict = check.verdict(values, check.params)
    assert verdict.passed, verdict.message
    assert verdict.figures["steps"] == entry_points.STEPS
    assert verdict.figures["grad_norm_ratio"] == pytest.approx(1.0, rel=1e-9)
    units = verdict.figures["units_that_train"]
    assert units and verdict.figures["reductions"] == units, verdict.data["reduced"]
    gathers = verdict.data["gathers"]["micro 0.forward"]
    # The odd model's two blocks are of equal size: each named by torch's own unit.
    layers = gathers["layers.0"] + gathers["layers.1"]
    # Observed: each block gathered once per forward it ran in (FSDP reshards after forward).
    assert layers == {"two_forwards": 4, "non_root": 3, "divide_factor": 2}[what], gathers


def test_a_second_forward_left_out_of_the_backward_fails(ranks: Ranks) -> None:
    verdict = run_fault(ranks, TWO["fsdp2"], "second_forward_lost")
    assert not verdict.passed
    assert "differs from the reference" in verdict.message and "step 0 update" in verdict.message


def test_a_block_forward_under_no_grad_fails_on_the_block(ranks: Ranks) -> None:
    verdict = run_fault(ranks, NON_ROOT["fsdp1"], "probe_no_grad")
    assert not verdict.passed
    assert "step 0 update: layers.0." in verdict.message, verdict.message


def test_a_divide_factor_not_applied_fails_with_twice_the_gradient(ranks: Ranks) -> None:
    verdict = run_fault(ranks, FACTOR["fsdp2"], "divide_factor_ignored")
    assert not verdict.passed
    assert verdict.figures["grad_norm_ratio"] == pytest.approx(2.0)
    assert "gradient norm 2 x the reference's" in verdict.message


def test_torch_refusing_the_loop_is_a_failure_naming_its_line(
    ranks: Ranks, shared_runs: dict
) -> None:
    values = copy.deepcopy(clean_run(ranks, shared_runs, CHECKS["two_forwards"]["fsdp1"]))
    line = "RuntimeError in torch/autograd/graph.py:_engine_run_backward: something"
    values[-1]["torch_error"] = line
    verdict = TWO["fsdp1"].verdict(values, TWO["fsdp1"].params)
    assert not verdict.passed
    assert "torch refused this loop" in verdict.message and line in verdict.message


def test_a_unit_never_reduced_fails(ranks: Ranks, shared_runs: dict) -> None:
    values = copy.deepcopy(clean_run(ranks, shared_runs, CHECKS["non_root"]["fsdp2"]))
    values[0]["reduced"]["micro 1.backward"].remove("head")
    verdict = NON_ROOT["fsdp2"].verdict(values, NON_ROOT["fsdp2"].params)
    assert not verdict.passed
    assert "micro 1.backward: no reduction of the gradients of 1 unit(s) that train: 'head'" in (
        verdict.message
    )


def test_only_an_error_raised_inside_torch_counts_as_torch_refusing() -> None:
    try:
        torch.zeros(2).backward()
    except RuntimeError as exc:
        line = torch_raised(exc)
    assert line is not None and line.startswith("RuntimeError in torch/"), line
    try:
        raise RuntimeError("the suite's own bug")
    except RuntimeError as exc:
        assert torch_raised(exc) is None


def test_a_model_without_the_named_block_calls_its_first_block() -> None:
    from torch import nn

    from fsdp_conformance.harness import CheckSkipped

    class Block(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(3, 3), Block(3, 3), Block(3, 3))
    assert entry_points.resolve_block(model, (Block,), "layers.0") == "1"
    assert entry_points.resolve_block(model, (Block,), "2") == "2"
    with pytest.raises(CheckSkipped, match="no module 'layers.0' and no block"):
        entry_points.resolve_block(model, (), "layers.0")


class _Cache:
    """A state object (not a container torch's pytree looks into), like transformers' Cache."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class _Appending(nn.Module):
    """A block handed a state it appends to (as a transformers layer appends its keys to the
    ``Cache`` it is given): run twice on one state, it sees its own earlier call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        if cache.keys:
            raise RuntimeError(f"the cache holds {len(cache.keys)} earlier keys")
        cache.keys.append(x)
        out: torch.Tensor = self.lin(x)
        return out


class _WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Appending()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(x, cache=_Cache())
        return out


def test_the_block_called_on_its_own_gets_the_state_the_root_gave_it() -> None:
    """Without the copy, Bloom's, Falcon's and Gemma-2's first layer saw the root's keys twice."""
    model = _WithCache()
    loss = entry_points.non_root_loss(model, torch.ones(2, 4), "block")
    assert loss.requires_grad
