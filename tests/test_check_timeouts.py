"""A check's timeout that scales with its work: derived from its declared cost and its model's
measured eager step, never below the run's timeout; an explicit timeout is used as given.

The derivation is arithmetic on a step's seconds given here (no timing is asserted); the
measure itself runs once on a reference model; a hang's message says where its timeout came
from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch.distributed as dist

from fsdp_conformance.claims import all_checks
from fsdp_conformance.claims.check import Check, Verdict
from fsdp_conformance.gate.suite import CheckTimeouts
from fsdp_conformance.harness import RankContext, RankFailure, Ranks
from fsdp_conformance.harness.timeouts import SCALED_TIMEOUT_MAX_FACTOR, scaled_timeout
from fsdp_conformance.measure.step_cost import eager_step_seconds
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.settings import Settings, resolve_settings

pytestmark = pytest.mark.cpu

ODD = ModelSpec(reference="odd")
TIED = ModelSpec(reference="tied")


@pytest.mark.parametrize(
    ("cost", "step", "timeout", "words"),
    [
        (
            600,
            0.05,
            120.0,
            "600 x the model's eager step of 0.05s measured in this run = 30s, "
            "at least the default 120s",
        ),
        (600, 0.35, 210.0, "= 210s, at least the default 120s"),
        (600, 5.0, 1200.0, "= 3000s, at most 10 x the default 120s"),
    ],
)
def test_the_timeout_is_the_checks_work_in_measured_steps_never_below_the_default(
    cost: float, step: float, timeout: float, words: str
) -> None:
    got, note = scaled_timeout(120.0, cost, step)
    assert got == pytest.approx(timeout)
    assert note.startswith(" (derived from the check's work: ") and words in note
    assert note.endswith("; an explicit --timeout is used as given)")
    assert SCALED_TIMEOUT_MAX_FACTOR == 10.0


def test_stack_compile_declares_its_work_and_other_checks_keep_the_runs_timeout() -> None:
    costs = {c.name: c.cost for c in all_checks()}
    assert costs["stack.compile"] >= 100 and costs["stack.compile.inductor"] >= 100
    assert costs["wrap.units.exact"] == 0


def _rank(ctx: RankContext, **params: Any) -> int:
    return ctx.rank


def _verdict(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    return Verdict(True, "ok")


COMPILE_LIKE = Check("test.costly", "test only", _rank, _verdict, {"spec": ODD}, cost=600.0)
CHEAP = Check("test.cheap", "test only", _rank, _verdict, {"spec": ODD})


def test_a_run_measures_each_model_once_and_derives_each_costly_checks_timeout() -> None:
    measured: list[ModelSpec] = []

    def measure(spec: ModelSpec) -> float:
        measured.append(spec)
        return 0.5 if spec == ODD else 0.01

    timeouts = CheckTimeouts(Settings(), measure=measure)
    assert timeouts.for_check(CHEAP, CHEAP.params) == (120.0, "")
    assert measured == []  # a check without a cost costs no measure
    timeout, note = timeouts.for_check(COMPILE_LIKE, COMPILE_LIKE.params)
    assert timeout == pytest.approx(300.0) and "eager step of 0.5s" in note
    assert timeouts.for_check(COMPILE_LIKE, {"spec": ODD})[0] == pytest.approx(300.0)
    assert timeouts.for_check(COMPILE_LIKE, {"spec": TIED})[0] == 120.0  # 6 s of work
    assert measured == [ODD, TIED]


def test_a_model_whose_step_cannot_be_measured_keeps_the_runs_timeout() -> None:
    def broken(spec: ModelSpec) -> float:
        raise RuntimeError("the model's forward raised")

    timeouts = CheckTimeouts(Settings(), measure=broken)
    assert timeouts.for_check(COMPILE_LIKE, COMPILE_LIKE.params) == (120.0, "")


@pytest.mark.parametrize(
    ("cli", "environ"),
    [({"timeout": "30"}, {}), ({}, {"FSDP_CONFORMANCE_TIMEOUT": "30"})],
)
def test_an_explicit_timeout_is_used_as_given_for_every_check(
    cli: Mapping[str, Any], environ: Mapping[str, str]
) -> None:
    settings = resolve_settings(cli, environ, {}, cores=lambda: 2)
    timeouts = CheckTimeouts(settings, measure=lambda spec: 10.0)  # 6000 s of work
    assert timeouts.for_check(COMPILE_LIKE, COMPILE_LIKE.params) == (30.0, "")
    # The default, unset: derived.
    default = resolve_settings({}, {}, {}, cores=lambda: 2)
    assert CheckTimeouts(default, measure=lambda spec: 10.0).for_check(
        COMPILE_LIKE, COMPILE_LIKE.params
    )[0] == pytest.approx(1200.0)


def test_the_measured_step_is_a_positive_number_of_seconds() -> None:
    assert eager_step_seconds(ODD) > 0


def _hang_rank1(ctx: RankContext) -> None:
    if ctx.rank == 1:
        import time

        time.sleep(600)
    dist.barrier()


def test_a_check_out_of_its_derived_timeout_says_what_it_was_derived_from(ranks: Ranks) -> None:
    _, note = scaled_timeout(120.0, 600.0, 0.5)
    with pytest.raises(RankFailure) as failure:
        ranks.configured(timeout=2.0, timeout_note=note).run(_hang_rank1)
    assert f"no result after the check's timeout of 2s{note}; its stacks:" in str(failure.value)
