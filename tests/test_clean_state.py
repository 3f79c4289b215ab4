"""Every check starts from the same global state: fault injection, one leak per test.

Each test runs a check that changes one piece of process-wide state on the warm pool, proves
the change took effect inside that check (the negative control), and then asserts either that
the next check on the same warm processes sees the clean value (what the harness restores) or
that the leaking check itself fails, naming the rank and what it changed, and the next check
runs on a new pool (what the harness cannot restore). The check functions live at module level
so that the ranks can unpickle them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import pytest

from fsdp_conformance.harness import RankContext, RankFailure

pytestmark = pytest.mark.cpu


def _handler(signum: int, frame: Any) -> None:  # a signal handler a check installs
    pass


def _handler_name(handler: Any) -> str:
    return getattr(handler, "__name__", repr(handler))


def _probe(item: str) -> Any:  # noqa: C901 - a flat table, one branch per leak item
    """The current value of one piece of process state, as plain data."""
    import torch

    if item == "num_threads":
        return torch.get_num_threads()
    if item == "deterministic":
        return (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
    if item == "anomaly":
        return (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    if item == "recursion_limit":
        return sys.getrecursionlimit()
    if item in ("sys_path", "sys_path_replaced"):
        return list(sys.path)
    if item == "root_log_level":
        return logging.getLogger().level
    if item == "root_handlers":
        return [type(h).__name__ for h in logging.getLogger().handlers]
    if item == "umask":
        mask = os.umask(0o022)
        os.umask(mask)
        return mask
    if item == "signal_handler":
        return _handler_name(signal.getsignal(signal.SIGUSR2))
    if item == "backend_flags":
        return (
            torch.backends.mkldnn.enabled,
            torch.backends.opt_einsum.enabled,
            torch.backends.cudnn.benchmark,
        )
    if item == "gc":
        import gc

        return gc.isenabled()
    if item == "alarm":
        return signal.getitimer(signal.ITIMER_REAL)[0] > 0
    if item == "fsdp2_patch":
        from torch.distributed import device_mesh
        from torch.distributed.fsdp import FSDPModule

        return (
            _handler_name(device_mesh.init_device_mesh),
            hasattr(FSDPModule, "fsdp_conformance_leak"),
        )
    raise AssertionError(f"unknown item {item}")


def _leak(item: str) -> None:  # noqa: C901 - a flat table, one branch per leak item
    import torch

    if item == "num_threads":
        torch.set_num_threads(1 if torch.get_num_threads() != 1 else 2)
    elif item == "deterministic":
        torch.use_deterministic_algorithms(True, warn_only=True)
    elif item == "anomaly":
        torch.autograd.set_detect_anomaly(True, check_nan=False)
    elif item == "recursion_limit":
        sys.setrecursionlimit(sys.getrecursionlimit() + 1234)
    elif item == "sys_path":
        sys.path.insert(0, "/nonexistent/fsdp-conformance-leak")
    elif item == "sys_path_replaced":
        sys.path = ["/nonexistent/fsdp-conformance-leak", *sys.path]
    elif item == "root_log_level":
        logging.getLogger().setLevel(logging.DEBUG)
    elif item == "root_handlers":
        logging.getLogger().addHandler(logging.NullHandler())
    elif item == "umask":
        os.umask(0o077)
    elif item == "signal_handler":
        signal.signal(signal.SIGUSR2, _handler)
    elif item == "backend_flags":
        torch.backends.mkldnn.enabled = False
        torch.backends.opt_einsum.enabled = False
        torch.backends.cudnn.benchmark = True
    elif item == "gc":
        import gc

        gc.disable()
    elif item == "alarm":
        signal.setitimer(signal.ITIMER_REAL, 3600)
    elif item == "fsdp2_patch":
        from torch.distributed import device_mesh
        from torch.distributed.fsdp import FSDPModule

        device_mesh.init_device_mesh = _handler
        FSDPModule.fsdp_conformance_leak = True  # type: ignore[attr-defined]
    else:
        raise AssertionError(f"unknown item {item}")


def _probe_check(ctx: RankContext, item: str) -> Any:
    return _probe(item)


def _leak_check(ctx: RankContext, item: str) -> Any:
    _leak(item)
    return _probe(item)


def _pid(ctx: RankContext) -> int:
    return os.getpid()


RESTORED = [
    "num_threads",
    "deterministic",
    "anomaly",
    "recursion_limit",
    "sys_path",
    "sys_path_replaced",
    "root_log_level",
    "root_handlers",
    "umask",
    "signal_handler",
    "backend_flags",
    "gc",
    "alarm",
    "fsdp2_patch",
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("item", RESTORED)
def test_a_change_made_by_one_check_is_not_seen_by_the_next(ranks, item: str) -> None:
    pids = ranks.run(_pid)
    clean = ranks.run(_probe_check, item)
    leaked = ranks.run(_leak_check, item)
    assert leaked != clean, f"the leaking check did not change {item}: the test proves nothing"
    assert ranks.run(_probe_check, item) == clean
    assert ranks.run(_pid) == pids  # restored in place: the same warm processes


def _two_dim_mesh(ctx: RankContext) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))
    return list(mesh.shape)


@pytest.mark.world_size(2)
def test_process_groups_made_by_one_check_do_not_block_the_next(ranks) -> None:
    # A DeviceMesh's groups outlive the check; restoring c10d's group counter made the second
    # mesh raise "The specified group name has already been created".
    assert ranks.run(_two_dim_mesh) == [[2, 1], [2, 1]]
    assert ranks.run(_two_dim_mesh) == [[2, 1], [2, 1]]


def _hang(ctx: RankContext) -> None:
    threading.Event().wait(60)


def _replace_sigusr1(ctx: RankContext) -> str:
    signal.signal(signal.SIGUSR1, _handler)
    return _handler_name(signal.getsignal(signal.SIGUSR1))


@pytest.mark.world_size(2)
def test_a_check_replacing_sigusr1_does_not_cost_the_next_hang_its_stack_dump(ranks) -> None:
    # SIGUSR1 is how the parent asks a stuck rank for its stacks (faulthandler).
    assert ranks.run(_replace_sigusr1) == ["_handler", "_handler"]
    with pytest.raises(RankFailure) as info:
        ranks.configured(timeout=2).run(_hang)
    message = str(info.value)
    assert "rank 0 did not finish, rank 1 did not finish" in message
    assert message.count("in _hang") == 2, message  # each rank's own stack, not "no dump"


# -- what cannot be restored: the check that did it fails, the next one runs clean -----------


def _leave_thread_on_rank1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        stop = threading.Event()
        threading.Thread(target=stop.wait, args=(60,), name="leaky-worker").start()
    return ctx.rank


def _thread_names(ctx: RankContext) -> list[str]:
    return [t.name for t in threading.enumerate()]


@pytest.mark.world_size(2)
def test_a_live_non_daemon_thread_fails_the_check_that_started_it(ranks) -> None:
    pids = ranks.run(_pid)
    with pytest.raises(RankFailure) as info:
        ranks.run(_leave_thread_on_rank1)
    message = str(info.value)
    assert "rank 0 passed, rank 1 left state behind" in message
    assert "--- rank 1: left state behind ---" in message
    assert "'leaky-worker'" in message and "--- rank 0" not in message
    after = ranks.run(_thread_names)
    assert all("leaky-worker" not in names for names in after)
    assert set(ranks.run(_pid)).isdisjoint(pids)  # the pool was rebuilt


def _daemon_thread(ctx: RankContext) -> int:
    threading.Thread(target=threading.Event().wait, args=(60,), daemon=True).start()
    return ctx.rank


def _short_thread(ctx: RankContext) -> int:
    # Ends a moment after the check returns (not joined): not a leak.
    threading.Timer(0.05, lambda: None).start()
    return ctx.rank


@pytest.mark.world_size(2)
def test_daemon_threads_and_threads_about_to_end_are_not_leaks(ranks) -> None:
    pids = ranks.run(_pid)
    assert ranks.run(_daemon_thread) == [0, 1]
    assert ranks.run(_short_thread) == [0, 1]
    assert ranks.run(_pid) == pids


def _destroy_group(ctx: RankContext, victim: int) -> int:
    import torch.distributed as dist

    if ctx.rank == victim:
        dist.destroy_process_group()
    return ctx.rank


def _all_reduce(ctx: RankContext) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([ctx.rank + 1])
    dist.all_reduce(t)
    return int(t.item())


@pytest.mark.world_size(2)
@pytest.mark.parametrize("victim", [0, 1])
def test_destroying_the_process_group_fails_that_check_not_the_next(ranks, victim: int) -> None:
    pids = ranks.run(_pid)
    with pytest.raises(RankFailure) as info:
        ranks.run(_destroy_group, victim)
    message = str(info.value)
    assert f"rank {victim} left state behind" in message
    assert f"rank {1 - victim} passed" in message
    assert "destroyed the default process group" in message
    assert ranks.run(_all_reduce) == [3, 3]  # the next, innocent check passes
    assert set(ranks.run(_pid)).isdisjoint(pids)


def _set_interop_threads(ctx: RankContext) -> int:
    import torch

    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pytest.skip("this rank already ran inter-op work: torch refuses the change itself")
    return torch.get_num_interop_threads()


def _raise_after_thread(ctx: RankContext) -> None:
    threading.Thread(target=threading.Event().wait, args=(60,), name="leaky-raiser").start()
    raise ValueError("the check failed too")


@pytest.mark.world_size(2)
def test_a_check_that_raises_and_leaks_reports_both(ranks) -> None:
    with pytest.raises(RankFailure) as info:
        ranks.run(_raise_after_thread)
    message = str(info.value)
    assert "rank 0 raised, rank 1 raised" in message
    assert message.count("ValueError: the check failed too") == 2
    assert message.count("'leaky-raiser'") == 2


@pytest.mark.world_size(2)
def test_a_setting_torch_cannot_change_back_fails_the_check_that_set_it(ranks) -> None:
    # A fresh pool, so no inter-op work ran before: torch accepts the first change only.
    with pytest.raises(RankFailure) as info:
        ranks.configured(fresh=True).run(_set_interop_threads)
    message = str(info.value)
    assert "rank 0 left state behind, rank 1 left state behind" in message
    assert "torch.get_num_interop_threads()" in message
