"""The pool's timeouts follow the settings, a CUDA rank's check waits for its device, and NCCL
ranks raise on a failed collective.

No rank is started here: the timeouts are pure functions, the managers that the plugin builds
and ``run_suite`` is handed are watched through a stand-in ``RankPool`` that runs each check in
this process, and the device synchronization is ``execute_check`` with a CUDA context and a stubbed
``torch.cuda.synchronize``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch  # before pytester's in-process session, which would unload a torch it imported

import fsdp_conformance.harness.manager as manager_module
import fsdp_conformance.harness.ranks as ranks_module
from fsdp_conformance.harness import PoolManager, RankContext, RankOutcome, RankRequest
from fsdp_conformance.harness.pool import RankPool, rank_environment
from fsdp_conformance.harness.timeouts import (
    PG_TIMEOUT_MARGIN_S,
    START_TIMEOUT_S,
    pg_timeout_for,
    start_timeout_for,
)
from fsdp_conformance.harness.worker import execute_check

pytestmark = pytest.mark.cpu


# --------------------------------------------------------------------------------------------
# The derived timeouts
# --------------------------------------------------------------------------------------------


def test_the_process_group_outlasts_the_check_timeout_by_the_margin() -> None:
    # A check timeout above the 300 s floor: the watchdog must not end the ranks first.
    assert pg_timeout_for(400.0) > 400.0
    assert pg_timeout_for(400.0) == 400.0 + PG_TIMEOUT_MARGIN_S
    for check_timeout in (1.0, 120.0, 239.0, 240.0, 241.0, 3600.0, 604800.0):
        assert pg_timeout_for(check_timeout) >= check_timeout + PG_TIMEOUT_MARGIN_S
    # Never below 300 s, which is what the default check timeout gets.
    assert pg_timeout_for(120.0) == 300.0
    assert pg_timeout_for(1.0) == 300.0


def test_the_start_timeout_grows_with_the_world_and_more_for_gpu_ranks() -> None:
    assert start_timeout_for(8, "cuda") > 60.0  # eight cold CUDA ranks: more than 60 s
    assert start_timeout_for(8, "cuda") > start_timeout_for(8, "cpu")
    assert (
        start_timeout_for(1, "cuda") < start_timeout_for(2, "cuda") < start_timeout_for(8, "cuda")
    )
    assert start_timeout_for(2, "cpu") < start_timeout_for(16, "cpu")
    # The fixed part stays: no world starts with less than before.
    assert start_timeout_for(1, "cpu") >= START_TIMEOUT_S


# --------------------------------------------------------------------------------------------
# A stand-in RankPool: records how it was started, runs each check in this process
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Started:
    world_size: int
    backend: str
    device_type: str
    start_timeout: float | None
    pg_timeout: float


class _RecordingPool:
    """Takes ``RankPool``'s place in ``harness.manager``: no process is started."""

    started: list[_Started] = []

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        device_type: str = "cpu",
        *,
        env: Mapping[str, str] | None = None,
        start_timeout: float | None = None,
        pg_timeout: float = 300.0,
        fork_servers: Any = None,
    ) -> None:
        self.world_size, self.backend, self.device_type = world_size, backend, device_type
        self.pg_timeout = pg_timeout
        self.broken = False
        self.alive = True
        _RecordingPool.started.append(
            _Started(world_size, backend, device_type, start_timeout, pg_timeout)
        )

    def run_outcomes(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        **_: Any,
    ) -> list[RankOutcome]:
        return [
            RankOutcome(
                rank,
                "ok",
                value=fn(
                    RankContext(rank, self.world_size, rank, self.backend, self.device_type),
                    *args,
                    **dict(kwargs or {}),
                ),
            )
            for rank in range(self.world_size)
        ]

    def close(self, force: bool = False) -> None:
        self.alive = False


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[_Started]]:
    """Pools started from now on (stand-ins), and 8 CUDA devices as far as lanes are concerned."""
    started: list[_Started] = []
    monkeypatch.setattr(_RecordingPool, "started", started)
    monkeypatch.setattr(manager_module, "RankPool", _RecordingPool)
    monkeypatch.setattr(ranks_module, "cuda_device_count", lambda: 8)
    yield started


def _rank(ctx: RankContext) -> int:
    return ctx.rank


def _run(
    manager: PoolManager,
    *,
    timeout: float,
    world_size: int = 2,
    device_type: str = "cpu",
    deadline: float | None = None,
) -> list[RankOutcome]:
    request = RankRequest(
        world_size,
        lane="gpu" if device_type == "cuda" else "cpu",
        backend="nccl" if device_type == "cuda" else "gloo",
        timeout=timeout,
        deadline=deadline,
    )
    return manager.run_outcomes(request, _rank, (), {})


def test_a_manager_starts_pools_with_the_timeouts_derived_for_them(
    recorded: list[_Started],
) -> None:
    manager = PoolManager(check_timeout=400.0)
    assert manager.pg_timeout > 400.0
    _run(manager, timeout=400.0, world_size=8, device_type="cuda")
    _run(manager, timeout=400.0, world_size=2)
    assert [(s.world_size, s.device_type) for s in recorded] == [(8, "cuda"), (2, "cpu")]
    assert all(s.pg_timeout > 400.0 for s in recorded)
    assert recorded[0].start_timeout == start_timeout_for(8, "cuda") > 60.0
    assert recorded[1].start_timeout == start_timeout_for(2, "cpu")


def test_a_check_longer_than_the_pools_group_gets_a_pool_that_outlasts_it(
    recorded: list[_Started],
) -> None:
    manager = PoolManager()  # the default check timeout: process groups of 300 s
    _run(manager, timeout=120.0)
    _run(manager, timeout=120.0)
    assert [s.pg_timeout for s in recorded] == [300.0]  # warm: reused
    _run(manager, timeout=500.0)  # ranks.configured(timeout=500)
    assert [s.pg_timeout for s in recorded] == [300.0, 560.0]
    _run(manager, timeout=120.0)  # the longer group serves shorter checks too
    assert len(recorded) == 2
    assert manager.pools_started == 2


def test_an_outer_deadline_still_cuts_the_derived_start_timeout(
    recorded: list[_Started],
) -> None:
    _run(
        PoolManager(),
        timeout=120.0,
        world_size=8,
        device_type="cuda",
        deadline=time.monotonic() + 30.0,
    )
    start_timeout = recorded[0].start_timeout
    assert start_timeout is not None and 25.0 < start_timeout <= 30.0


INNER_TEST = """
import pytest


def _rank(ctx):
    return ctx.rank


@pytest.mark.gpu
@pytest.mark.world_size(8)
def test_a_gpu_world_of_eight(ranks, rank_pools):
    assert rank_pools.pg_timeout > 400
    assert ranks.run(_rank) == list(range(8))
"""


def test_the_plugins_manager_derives_its_timeouts_from_the_settings(
    pytester: pytest.Pytester,
    recorded: list[_Started],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("FSDP_CONFORMANCE_TIMEOUT", "PYTEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(test_inner=INNER_TEST)
    result = pytester.runpytest_inprocess("--fsdp-timeout", "400", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert [(s.world_size, s.backend, s.device_type) for s in recorded] == [(8, "nccl", "cuda")]
    assert recorded[0].pg_timeout > 400.0
    start_timeout = recorded[0].start_timeout
    assert start_timeout is not None and start_timeout > 60.0


def _verdict(values: Sequence[Any], params: Mapping[str, Any]) -> Any:
    from fsdp_conformance.claims.check import Verdict

    return Verdict(passed=values == list(range(len(values))), message=f"ranks {values}")


def test_run_suite_starts_its_pools_with_timeouts_derived_from_the_settings(
    recorded: list[_Started],
) -> None:
    import io

    from fsdp_conformance.claims.check import Check
    from fsdp_conformance.gate.suite import plan_suite, run_suite
    from fsdp_conformance.settings import Settings

    check = Check("test.timeouts", "test only: each rank's number", _rank, _verdict, lanes=("gpu",))
    plan = plan_suite(Settings(timeout=400.0, world_sizes=(8,)), ["gpu"], checks=[check])
    manager = PoolManager()  # the default check timeout: each check carries the run's own
    report = run_suite(plan, manager, stream=io.StringIO())
    manager.close()
    assert [c["outcome"] for c in report["checks"]] == ["passed"], report["checks"]
    assert [(s.world_size, s.backend, s.device_type) for s in recorded] == [(8, "nccl", "cuda")]
    assert recorded[0].pg_timeout > 400.0
    start_timeout = recorded[0].start_timeout
    assert start_timeout is not None and start_timeout > 60.0


# --------------------------------------------------------------------------------------------
# A CUDA rank's check waits for its device before reporting
# --------------------------------------------------------------------------------------------


CUDA_CTX = RankContext(0, 1, 0, "nccl", "cuda")
CPU_CTX = RankContext(0, 1, 0, "gloo", "cpu")


@pytest.fixture
def synchronize_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``torch.cuda.synchronize`` stubbed: each call lands in the list, with its device."""
    calls: list[Any] = []
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device))
    )
    return calls


def _returns_after_queuing(ctx: RankContext, log: list[Any]) -> str:
    log.append("check returned")
    return "value"


def test_a_cuda_ranks_check_is_synchronized_after_it_returns(
    synchronize_calls: list[Any],
) -> None:
    status, value, detail, _ = execute_check(
        _returns_after_queuing, CUDA_CTX, (synchronize_calls,), {}
    )
    assert (status, value, detail) == ("ok", "value", "")
    assert synchronize_calls == ["check returned", ("synchronize", torch.device("cuda", 0))]


def test_a_cpu_ranks_check_is_not_synchronized(synchronize_calls: list[Any]) -> None:
    status, value, _, _ = execute_check(_returns_after_queuing, CPU_CTX, (synchronize_calls,), {})
    assert (status, value) == ("ok", "value")
    assert synchronize_calls == ["check returned"]


def test_an_error_the_synchronize_raises_is_that_checks_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def failing_synchronize(device: Any = None) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", failing_synchronize)
    status, value, detail, _ = execute_check(_returns_after_queuing, CUDA_CTX, ([],), {})
    assert (status, value) == ("error", None)
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in detail
    assert "synchronize_device" in detail  # the traceback shows where it surfaced


def test_a_check_that_raised_is_not_synchronized(synchronize_calls: list[Any]) -> None:
    def _raises(ctx: RankContext) -> None:
        raise ValueError("the check's own error")

    status, _, detail, _ = execute_check(_raises, CUDA_CTX, (), {})
    assert status == "error" and "ValueError: the check's own error" in detail
    assert synchronize_calls == []


# --------------------------------------------------------------------------------------------
# NCCL ranks raise on a failed collective
# --------------------------------------------------------------------------------------------


@pytest.fixture
def no_error_handling_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_error_handling_set")
def test_nccl_ranks_get_async_error_handling_that_raises() -> None:
    assert rank_environment(backend="nccl")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in rank_environment(backend="gloo")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in rank_environment()


@pytest.mark.usefixtures("no_error_handling_set")
def test_a_users_nccl_error_handling_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given to the check's ranks (ranks.configured(env=...)) or set in the session.
    env = rank_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, backend="nccl")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    assert rank_environment(backend="nccl")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "0")  # the older name torch still reads
    env = rank_environment(backend="nccl")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env
    assert env["NCCL_ASYNC_ERROR_HANDLING"] == "0"


class _Stop(Exception):
    pass


@pytest.mark.usefixtures("no_error_handling_set")
def test_a_pool_starts_its_ranks_with_its_backends_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, dict[str, str]] = {}

    def spawn(self: RankPool, procs: list[Any], env: dict[str, str], *_: Any) -> None:
        seen[self.backend] = env
        raise _Stop  # before any process starts

    monkeypatch.setattr(RankPool, "_spawn", spawn)
    for backend, device_type in (("nccl", "cuda"), ("gloo", "cpu")):
        with pytest.raises(_Stop):
            RankPool(1, backend, device_type)
    assert seen["nccl"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in seen["gloo"]
