"""The rank-engine contract (``harness/engine.py``): all that ``Ranks`` and ``run_suite`` need.

An engine says whether it can provide what a check asks for (a ``RankRequest``) and returns
every rank's outcome of running it. A fake engine of a dozen lines, running each "rank" in this
process, is enough for ``Ranks`` (values by rank, skips with the engine's reason, every option
carried in the request) and for a whole ``run_suite``; the two real engines keep the same
signatures. No rank process is started here.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

import fsdp_conformance.harness.ranks as ranks_module
from fsdp_conformance.harness import (
    CheckSkipped,
    LaunchSupervisor,
    PoolManager,
    RankContext,
    RankEngine,
    RankOutcome,
    RankRequest,
    Ranks,
)

pytestmark = pytest.mark.cpu


class FakeEngine:
    """Runs each rank's ``fn`` in this process; records every request; refuses with
    ``refusal`` (None: provides everything)."""

    def __init__(self, refusal: str | None = None) -> None:
        self.refusal = refusal
        self.asked: list[RankRequest] = []
        self.ran: list[RankRequest] = []

    def cannot_provide(self, request: RankRequest) -> str | None:
        self.asked.append(request)
        return self.refusal

    def run_outcomes(
        self,
        request: RankRequest,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> list[RankOutcome]:
        self.ran.append(request)
        contexts = (
            RankContext(r, request.world_size, r, request.backend, request.device_type)
            for r in range(request.world_size)
        )
        return [RankOutcome(c.rank, "ok", value=fn(c, *args, **kwargs)) for c in contexts]


def _rank_plus(ctx: RankContext, offset: int, *, scale: int = 1) -> int:
    return (ctx.rank + offset) * scale


def test_ranks_run_a_check_on_any_engine_that_keeps_the_contract() -> None:
    engine = FakeEngine()
    ranks = Ranks(engine, 3, timeout=7.0)
    assert ranks.run(_rank_plus, 10, scale=2) == [20, 22, 24]
    assert engine.asked == engine.ran == [RankRequest(3, "cpu", "gloo", timeout=7.0)]


def test_every_option_of_ranks_reaches_the_engine_in_the_request() -> None:
    engine = FakeEngine()
    ranks = Ranks(engine, 2, deadline=123.0, deadline_note="NOTE").configured(
        world_size=4, timeout=9.0, fresh=True, env={"MALLOC_MMAP_THRESHOLD_": "65536"}
    )
    assert ranks.run(_rank_plus, 0) == [0, 1, 2, 3]
    assert engine.ran == [
        RankRequest(
            4,
            timeout=9.0,
            fresh=True,
            env={"MALLOC_MMAP_THRESHOLD_": "65536"},
            deadline=123.0,
            deadline_note="NOTE",
        )
    ]


def test_what_the_engine_cannot_provide_skips_the_check_with_its_reason_and_runs_nothing() -> None:
    engine = FakeEngine(refusal="needs X at the ranks' start; launch with X=1")
    ranks = Ranks(engine, 2)
    with pytest.raises(CheckSkipped, match=r"^needs X at the ranks' start; launch with X=1$"):
        ranks.run(_rank_plus, 0)
    told: list[str] = []
    with pytest.raises(CheckSkipped):  # a skip callable that returns: still a skip
        ranks.configured(skip=told.append).run(_rank_plus, 0)
    assert told == ["needs X at the ranks' start; launch with X=1"]
    assert len(engine.asked) == 2 and engine.ran == []


def test_a_lane_this_machine_lacks_skips_before_the_engine_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ranks_module, "cuda_device_count", lambda: 0)
    engine = FakeEngine()
    with pytest.raises(CheckSkipped, match=r"^gpu lane: no CUDA device"):
        Ranks(engine, 2, lane="gpu", backend="nccl").run(_rank_plus, 0)
    assert engine.asked == []


@pytest.mark.parametrize("engine", [PoolManager, LaunchSupervisor], ids=lambda e: e.__name__)
def test_both_engines_have_the_contracts_one_signature(engine: type[RankEngine]) -> None:
    for name in ("cannot_provide", "run_outcomes"):
        contract = inspect.signature(getattr(RankEngine, name))
        assert inspect.signature(getattr(engine, name)) == contract, (engine, name)


def _rank_of(ctx: RankContext) -> int:
    return ctx.rank


def _verdict_ranks(values: Sequence[Any], params: Mapping[str, Any]) -> Any:
    from fsdp_conformance.claims.check import Verdict

    return Verdict(list(values) == list(range(len(values))), f"ranks {list(values)}")


def test_run_suite_runs_its_plan_on_the_engine_it_is_handed() -> None:
    from fsdp_conformance.claims.check import Check
    from fsdp_conformance.gate import suite
    from fsdp_conformance.settings import Settings

    check = Check("test.ranks", "test only: each rank's number", _rank_of, _verdict_ranks)
    plan = suite.plan_suite(Settings(world_sizes=(2, 3), timeout=50.0), ["cpu"], checks=[check])
    engine = FakeEngine()
    report = suite.run_suite(plan, engine, stream=io.StringIO())
    assert [(c["id"], c["outcome"]) for c in report["checks"]] == [
        ("test.ranks[cpu,ws2]", "passed"),
        ("test.ranks[cpu,ws3]", "passed"),
    ]
    assert engine.ran == [RankRequest(2, timeout=50.0), RankRequest(3, timeout=50.0)]
