"""The rank pool, in-process: the ``ranks`` fixture of this very session.

The pool's own behaviour (reuse, rebuild, fresh processes, clean global state) is tested through
the ``ranks`` fixture; the check functions live at module level here, so that the ranks can
unpickle them. What the harness reports for each injected fault, in separate pytest sessions and
torchrun launches, is in ``test_harness_sessions.py`` (the process lane).
"""

from __future__ import annotations

import os
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from inner_sessions import Session, process_gone, rank_processes_of

from fsdp_conformance.harness import HarnessError, RankContext, RankFailure, RankRequest

pytestmark = pytest.mark.cpu


# --------------------------------------------------------------------------------------------
# The pool, in-process (the `ranks` fixture of this very session)
# --------------------------------------------------------------------------------------------


def _pid(ctx: RankContext) -> int:
    return os.getpid()


def _raise_on_rank1(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError("rank one is unhappy")


def _abort_after_reporting(ctx: RankContext) -> int:
    """Simulate gloo's abort at exit: this rank dies 0.3 s after its result went out."""
    if ctx.rank == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from the abort
        timer = threading.Timer(0.3, os.abort)
        timer.daemon = True
        timer.start()
    return os.getpid()


def _env(ctx: RankContext, name: str) -> str | None:
    return os.environ.get(name)


def _threads(ctx: RankContext) -> int:
    import torch

    return torch.get_num_threads()


def _global_state(ctx: RankContext) -> dict[str, Any]:
    import torch

    kaiming = torch.nn.init.kaiming_normal_
    return {
        "dtype": str(torch.get_default_dtype()),
        "device": str(torch.empty(0).device),
        "grad": torch.is_grad_enabled(),
        "kaiming_normal_": f"{kaiming.__module__}.{kaiming.__qualname__}",
        "leak": os.environ.get("FSDP_CONFORMANCE_TEST_LEAK"),
        "cwd": os.getcwd(),
        "first_random": torch.rand(1, device="cpu").item(),
    }


def _no_init(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


def _dirty_global_state(ctx: RankContext) -> dict[str, Any]:
    import torch

    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    torch.set_grad_enabled(False)
    torch.nn.init.kaiming_normal_ = _no_init
    os.environ["FSDP_CONFORMANCE_TEST_LEAK"] = "1"
    os.chdir("/")
    torch.manual_seed(1234)
    return _global_state(ctx)


def _return_unpicklable(ctx: RankContext) -> Any:
    return lambda: ctx.rank


def _refuse_to_load() -> None:
    raise RuntimeError("this value only loads on a rank")


class _LoadsOnlyOnRanks:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_to_load, ())


def _return_unloadable(ctx: RankContext) -> Any:
    return _LoadsOnlyOnRanks()


def wait_until_gone(pid: int, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not process_gone(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"process {pid} still running after {limit_s}s")
        time.sleep(0.05)


@pytest.mark.world_size(2)
def test_warm_pool_is_reused_across_checks(ranks) -> None:
    first = ranks.run(_pid)
    second = ranks.run(_pid)
    assert first == second
    assert len(set(first)) == 2 and os.getpid() not in first


@pytest.mark.world_size(2)
def test_leftover_scan_finds_the_live_ranks_of_this_session(ranks) -> None:
    # The scan the fault tests rely on must not be vacuous: it sees this session's warm ranks.
    pids = ranks.run(_pid)
    this_session = Session(Path.cwd(), os.getpid(), None)  # type: ignore[arg-type]
    found = {int(line.split(":")[0]) for line in rank_processes_of(this_session)}
    assert set(pids) <= found


@pytest.mark.world_size(2)
def test_pool_is_rebuilt_after_a_failure(ranks) -> None:
    before = ranks.run(_pid)
    with pytest.raises(RankFailure, match="rank 1 raised"):
        ranks.run(_raise_on_rank1)
    after = ranks.run(_pid)
    assert set(after).isdisjoint(before)
    for pid in before:
        assert process_gone(pid), f"rank process {pid} of the failed pool still runs"


@pytest.mark.world_size(2)
def test_rank_dying_after_reporting_passes_and_the_next_check_gets_a_fresh_pool(ranks) -> None:
    pids = ranks.run(_abort_after_reporting)  # passes: every rank reported before the abort
    wait_until_gone(pids[1])
    after = ranks.run(_pid)
    assert set(after).isdisjoint(pids)


@pytest.mark.world_size(2)
def test_ranks_share_the_cores_and_keep_a_thread_count_the_user_set(ranks) -> None:
    # torch gives each process a thread per core: two ranks on this machine would run twice
    # as many compute threads as cores. Each rank gets its share, at least one.
    from fsdp_conformance.settings import usable_cores

    assert ranks.run(_threads) == [max(1, usable_cores() // 2)] * 2


def test_the_thread_share_divides_the_cores_among_the_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fsdp_conformance import settings
    from fsdp_conformance.harness.pool import rank_threads

    monkeypatch.setattr(settings, "usable_cores", lambda: 16)
    assert [rank_threads(n, {}) for n in (1, 2, 4, 16, 32)] == [16, 8, 4, 1, 1]
    assert rank_threads(4, {"OMP_NUM_THREADS": "2"}) == 2
    assert rank_threads(4, {"OMP_NUM_THREADS": "garbage"}) == 4  # not a count: the share


@pytest.mark.world_size(2)
def test_each_check_starts_from_the_same_global_state(ranks) -> None:
    pids = ranks.run(_pid)
    clean = ranks.run(_global_state)
    dirty = ranks.run(_dirty_global_state)
    assert dirty[0]["dtype"] == "torch.float64" and dirty[0]["leak"] == "1"  # the check did it
    assert ranks.run(_global_state) == clean
    assert clean[0]["dtype"] == "torch.float32"
    assert clean[0]["kaiming_normal_"] == "torch.nn.init.kaiming_normal_"
    assert clean[0]["leak"] is None
    assert ranks.run(_pid) == pids  # same warm processes throughout


@pytest.mark.world_size(2)
def test_unpicklable_check_is_a_harness_error_naming_the_fix(ranks) -> None:
    pids = ranks.run(_pid)
    with pytest.raises(HarnessError, match="cannot be pickled.*define check functions at module"):
        ranks.run(lambda ctx: ctx.rank)
    assert ranks.run(_pid) == pids  # nothing reached the ranks: the pool is still good


@pytest.mark.world_size(2)
def test_unpicklable_return_value_fails_with_a_clear_message(ranks) -> None:
    with pytest.raises(RankFailure) as info:
        ranks.run(_return_unpicklable)
    message = str(info.value)
    assert "rank 0 raised, rank 1 raised" in message
    assert "the check returned a value that cannot be pickled" in message
    assert "return plain data" in message


@pytest.mark.world_size(2)
def test_return_value_that_cannot_load_in_the_parent_fails_with_a_clear_message(ranks) -> None:
    with pytest.raises(RankFailure) as info:
        ranks.run(_return_unloadable)
    message = str(info.value)
    assert "the parent could not unpickle this rank's reply" in message
    assert "this value only loads on a rank" in message
    assert ranks.run(_env, "HOME") is not None  # and the next check runs


# --------------------------------------------------------------------------------------------
# Under a launcher, a lane of another device
# --------------------------------------------------------------------------------------------


def test_under_a_launcher_a_lane_of_another_device_skips_with_the_fix() -> None:
    # One launch has one backend: the cpu lane's checks on an NCCL launch would put CPU
    # tensors into NCCL collectives. The supervisor of an NCCL launch of 2 (no GPU, no store
    # here: its answer needs neither); nothing is run.
    from fsdp_conformance.harness import CheckSkipped, LaunchSupervisor, Ranks

    nccl_launch = LaunchSupervisor.__new__(LaunchSupervisor)
    nccl_launch.rank, nccl_launch.world_size = 0, 2
    nccl_launch.backend, nccl_launch.device_type = "nccl", "cuda"
    ranks = Ranks(nccl_launch, 2, lane="cpu", backend="gloo")
    with pytest.raises(CheckSkipped, match=r"cpu lane: this launch's process group is nccl"):
        ranks.run(_rank_of)
    with pytest.raises(CheckSkipped, match=r"-m cpu --fsdp-backend gloo"):
        ranks.run(_rank_of)
    with pytest.raises(CheckSkipped, match=r"^world size 4 is not this launch's \(WORLD_SIZE=2\)$"):
        ranks.configured(world_size=4).run(_rank_of)


def _rank_of(ctx: RankContext) -> int:
    return ctx.rank


# --------------------------------------------------------------------------------------------
# Check timeouts inside an outer pytest-timeout (pure functions; the fault session proves the
# reports)
# --------------------------------------------------------------------------------------------


def test_check_timeout_is_cut_to_end_before_the_outer_deadline_and_says_so() -> None:
    from fsdp_conformance.harness import fit_timeout, outer_deadline

    now = time.monotonic()
    deadline, note = outer_deadline(now, 60.0, "--timeout")
    assert note == (
        "this test's pytest-timeout of 60s (--timeout), less 5s for the stack dump and teardown"
    )
    assert deadline == pytest.approx(now + 55.0)
    assert fit_timeout(30.0, deadline, note) == (30.0, "")  # fits: untouched
    assert fit_timeout(30.0, None) == (30.0, "")  # no pytest-timeout: untouched
    cut, why = fit_timeout(120.0, deadline, note)
    assert 50.0 < cut <= 55.0
    assert why == f" (cut from 120s to end within {note})"
    # A short pytest-timeout keeps back a quarter of itself, not 5 s of 8.
    assert outer_deadline(now, 8.0, "its timeout marker")[0] == pytest.approx(now + 6.0)
    # Past the deadline a check still gets a moment, so its stacks are dumped.
    assert fit_timeout(120.0, now - 1.0, note)[0] == 0.1


def test_ranks_that_cannot_start_before_the_outer_deadline_are_a_harness_error_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fsdp_conformance.harness.pool as pool_module
    from fsdp_conformance.harness import PoolManager

    # Ranks started with exec: forked from this session's warm fork server, a pool can start
    # within the 0.1 s left (and an exec-started rank killed at once costs no torch import).
    monkeypatch.setattr(pool_module, "fork_available", lambda: False)
    manager = PoolManager()
    try:
        request = RankRequest(
            2, timeout=100.0, deadline=time.monotonic() - 1.0, deadline_note="NOTE"
        )
        with pytest.raises(HarnessError) as info:
            manager.run_outcomes(request, _rank_of, (), {})
    finally:
        manager.close()
    message = str(info.value)
    # Which start phase runs out first depends on the machine's speed: the ranks connecting,
    # or the process group's init (with fork servers, also a server importing torch).
    first_line = message.splitlines()[0]
    assert first_line.startswith("could not start 2 gloo ranks: "), first_line
    assert any(
        phase in first_line
        for phase in (
            "timed out importing torch",
            "timed out connecting",
            "process group init timed out",
        )
    ), first_line
    assert message.endswith("(the ranks had 0.1s to start, the rest of NOTE)")


def test_crash_site_names_the_torch_function_called_or_the_innermost_frame() -> None:
    from fsdp_conformance.harness.outcomes import crash_site

    log = "\n".join(
        [
            "Fatal Python error: Segmentation fault",
            "",
            "Thread 0x00007f0 (most recent call first):",  # another thread: not the crashed one
            '  File "/x/threading.py", line 331 in wait',
            "",
            "Current thread 0x00007f1 (most recent call first):",
            '  File "/usr/lib/python3.11/ctypes/__init__.py", line 519 in string_at',
            '  File "/site-packages/torch/distributed/distributed_c10d.py", line 2942 in all_reduce',
            '  File "/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper',
            '  File "/work/model.py", line 7 in step',
            "",
            "Extension modules: numpy",
        ]
    )
    assert crash_site(log) == (
        "inside torch: torch.distributed.c10d_logger.wrapper (crashed in "
        "torch.distributed.distributed_c10d.all_reduce, line 2942)"
    )
    no_torch = log.replace("/site-packages/torch/", "/site-packages/other/")
    assert crash_site(no_torch) == (
        "in string_at (/usr/lib/python3.11/ctypes/__init__.py, line 519)"
    )
    assert crash_site("exited normally\n") is None


def test_a_pool_under_a_folder_too_deep_for_a_socket_path_still_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A unix socket's path has at most 107 bytes; a deep TMPDIR (a pytest-xdist worker's
    temporary folder) went past it, and the pool's start failed with ``OSError: AF_UNIX path
    too long`` from inside multiprocessing. The control socket moves to the abstract namespace."""
    from fsdp_conformance.harness import PoolManager
    from fsdp_conformance.harness.pool import UNIX_PATH_MAX, control_address

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert (
        len(os.fsencode(os.path.join(deep, "fsdp-conformance-ranks-xxxxxxxx", "ctl.sock")))
        > UNIX_PATH_MAX
    )
    assert control_address(str(deep)).startswith("\0fsdp-conformance-")
    assert control_address(str(tmp_path)) == os.path.join(tmp_path, "ctl.sock")
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    manager = PoolManager()
    try:
        outcomes = manager.run_outcomes(RankRequest(2, timeout=60.0), _rank_of, (), {})
    finally:
        manager.close()
    assert [o.value for o in outcomes] == [0, 1]
    # The pool's folder is gone with the pool (the session's fork server keeps its own).
    assert list(deep.glob("fsdp-conformance-ranks-*")) == []
