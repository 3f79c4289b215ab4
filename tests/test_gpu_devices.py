"""Which CUDA device each rank takes, proven without a GPU.

- Under an external launcher a rank takes ``LOCAL_RANK`` modulo the devices it sees (an srun
  task given one GPU sees it as ``cuda:0``), and the launch's group is started on that device
  with the timeout derived from the check timeout, and ended at the session's end.
- A pool's rank ``r`` takes the ``r``-th device of the pool's devices: each pytest-xdist worker
  gets its own contiguous slice of the machine's, so that ``pytest -n N`` workers never stack
  their ranks on the same GPUs; a world larger than the worker's slice skips with the fix.

torch's device count, ``set_device`` and ``init_process_group`` are stubbed; the pools are a
stand-in ``RankPool`` that runs each check in this process, or a real one whose start is
stubbed (no process). Lane availability under a launcher is in tests/test_lane_availability.py.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch  # before pytester's in-process session, which would unload a torch it imported

import fsdp_conformance.harness.manager as manager_module
import fsdp_conformance.harness.pool as pool_module
import fsdp_conformance.harness.ranks as ranks_module
from fsdp_conformance.harness import (
    HarnessError,
    PoolManager,
    RankContext,
    RankOutcome,
    RankPool,
    Ranks,
    lane_unavailable,
)
from fsdp_conformance.harness import worker as worker_module
from fsdp_conformance.harness.launcher import launch_device_index
from fsdp_conformance.harness.ranks import GpuShare, device_slice, xdist_share
from fsdp_conformance.harness.timeouts import pg_timeout_for

pytestmark = pytest.mark.cpu

LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_LOCALID",
    "CUDA_VISIBLE_DEVICES",
)


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``fake_gpus(n)``: the lanes and pools see ``n`` CUDA devices, and this process is not
    a launched rank (unless a test sets the launcher's variables after)."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def fake(count: int) -> None:
        monkeypatch.setattr(ranks_module, "cuda_device_count", lambda: count)

    return fake


# --------------------------------------------------------------------------------------------
# The device slices of pytest-xdist workers
# --------------------------------------------------------------------------------------------


def test_two_workers_on_eight_gpus_get_0_to_3_and_4_to_7() -> None:
    assert device_slice(8, GpuShare(0, 2)) == (0, 1, 2, 3)
    assert device_slice(8, GpuShare(1, 2)) == (4, 5, 6, 7)


def test_three_workers_on_two_gpus_leave_the_last_without_a_device() -> None:
    assert [device_slice(2, GpuShare(w, 3)) for w in range(3)] == [(0,), (1,), ()]


def test_the_slices_are_contiguous_disjoint_and_cover_every_device() -> None:
    assert [device_slice(8, GpuShare(w, 3)) for w in range(3)] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    for visible in range(0, 10):
        for workers in range(1, 6):
            slices = [device_slice(visible, GpuShare(w, workers)) for w in range(workers)]
            assert [d for s in slices for d in s] == list(range(visible)), (visible, workers)
            assert max(map(len, slices)) - min(map(len, slices)) <= 1
    assert device_slice(4, GpuShare()) == (0, 1, 2, 3)  # outside xdist: every device


def test_an_xdist_worker_id_gives_its_share() -> None:
    assert xdist_share("gw1", 3) == GpuShare(1, 3)
    assert xdist_share("gw0", "2") == GpuShare(0, 2)  # PYTEST_XDIST_WORKER_COUNT is a string
    assert xdist_share("gw0", 1) == GpuShare()
    assert xdist_share("master", 2) == GpuShare()  # not a worker: every device
    assert xdist_share("gw5", 3) == GpuShare()  # inconsistent: every device, never none


def test_a_world_larger_than_the_workers_slice_skips_naming_the_count_and_the_fix(
    fake_gpus: Callable[[int], None],
) -> None:
    fake_gpus(2)
    assert lane_unavailable("gpu", 2, share=GpuShare(2, 3)) == (
        "gpu lane: world size 2 needs 2 CUDA devices, and pytest-xdist worker gw2 has none of "
        "this machine's 2 (each of the 3 workers gets its own slice, so that no two share a "
        "GPU); run fewer xdist workers (-n 1 or fewer gives each 2) or fewer ranks "
        "(world_size markers, --fsdp-world-sizes)"
    )
    assert lane_unavailable("gpu", 1, share=GpuShare(2, 3)) == (
        "gpu lane: world size 1 needs 1 CUDA device, and pytest-xdist worker gw2 has none of "
        "this machine's 2 (each of the 3 workers gets its own slice, so that no two share a "
        "GPU); run fewer xdist workers (-n 2 or fewer gives each 1) or fewer ranks "
        "(world_size markers, --fsdp-world-sizes)"
    )
    assert lane_unavailable("gpu", 1, share=GpuShare(1, 3)) is None  # gw1 has cuda:1
    assert lane_unavailable("gpu", 2) is None  # outside xdist the machine's 2 are all there
    fake_gpus(8)
    assert lane_unavailable("gpu", 4, share=GpuShare(1, 2)) is None
    reason = lane_unavailable("gpu", 8, share=GpuShare(1, 2), flag_style="cli")
    assert (
        reason is not None
        and "worker gw1 has 4 (cuda:4 to cuda:7) of this machine's 8" in (reason)
        and "(-n 1 or fewer gives each 8)" in reason
        and "--world-sizes)" in reason
    )
    # Too few devices on the whole machine: the machine's reason, not the workers'.
    reason = lane_unavailable("gpu", 16, share=GpuShare(1, 2))
    assert reason is not None and reason.startswith(
        "gpu lane: world size 16 needs 16 CUDA devices, found 8"
    )
    assert lane_unavailable("cpu", 16, share=GpuShare(1, 2)) is None


# --------------------------------------------------------------------------------------------
# A pool's ranks on the pool's devices
# --------------------------------------------------------------------------------------------


def test_a_pool_rank_takes_the_rank_th_of_the_pools_devices() -> None:
    assert worker_module.rank_device_index({"rank": 1, "devices": [4, 5]}) == 5
    assert worker_module.rank_device_index({"rank": 1}) == 1  # the pool has every device


def test_a_cuda_rank_sets_and_binds_its_group_to_its_slices_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    devices_set: list[int] = []
    started: list[dict[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device", devices_set.append)
    monkeypatch.setattr(
        dist,
        "init_process_group",
        lambda backend, **kwargs: started.append({"backend": backend, **kwargs}),
    )
    spec = {
        "backend": "nccl",
        "rank": 2,
        "world_size": 4,
        "device_type": "cuda",
        "devices": [4, 5, 6, 7],
        "store": "/nonexistent/store",
        "pg_timeout": 460.0,
    }
    ctx = worker_module._init_process_group(spec)
    assert devices_set == [6]
    assert started[0]["device_id"] == torch.device("cuda", 6)
    assert started[0]["rank"] == 2 and started[0]["timeout"] == timedelta(seconds=460)
    assert (ctx.rank, ctx.local_rank, ctx.device) == (2, 2, torch.device("cuda", 6))


def test_a_rank_context_names_its_device() -> None:
    assert RankContext(1, 2, 1, "nccl", "cuda", 5).device == torch.device("cuda", 5)
    assert RankContext(1, 2, 1, "nccl", "cuda").device == torch.device("cuda", 1)
    assert RankContext(1, 2, 1, "gloo", "cpu").device == torch.device("cpu")


@pytest.fixture
def specs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Real RankPools whose start only records each rank's spec (no process is started)."""
    recorded: list[dict[str, Any]] = []

    def start(self: RankPool, extra_env: Any, start_timeout: float, pg_timeout: float) -> None:
        for rank in range(self.world_size):
            recorded.append(self._rank_spec(rank, "ctl.sock", b"key", pg_timeout, "stacks", {}))

    monkeypatch.setattr(RankPool, "_start", start)
    yield recorded


def test_the_rank_spec_carries_the_pools_devices_for_cuda_ranks_only(
    specs: list[dict[str, Any]],
) -> None:
    with RankPool(2, "nccl", "cuda", devices=(4, 5, 6, 7)):
        pass
    assert [s["devices"] for s in specs] == [[4, 5], [4, 5]]  # its world's first two
    assert [worker_module.rank_device_index(s) for s in specs] == [4, 5]
    specs.clear()
    with RankPool(2, "nccl", "cuda"):
        pass
    assert [worker_module.rank_device_index(s) for s in specs] == [0, 1]  # as before
    assert all("devices" not in s for s in specs)
    specs.clear()
    with RankPool(2, devices=(4, 5)):  # CPU pools are unchanged
        pass
    assert all("devices" not in s for s in specs)


def test_a_pool_given_too_few_devices_is_refused() -> None:
    with pytest.raises(HarnessError, match=r"4 CUDA ranks need 4 devices, given 2 \(\[6, 7\]\)"):
        RankPool(4, "nccl", "cuda", devices=(6, 7))


# --------------------------------------------------------------------------------------------
# The pools a worker's Ranks start (a stand-in RankPool: no process)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Started:
    world_size: int
    device_type: str
    devices: tuple[int, ...] | None


class _RecordingPool:
    """Takes ``RankPool``'s place in ``harness.manager``: records its devices, runs each check in
    this process with the context each rank's worker would build."""

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
        devices: Sequence[int] | None = None,
    ) -> None:
        self.world_size, self.backend, self.device_type = world_size, backend, device_type
        self.devices = pool_module.checked_devices(world_size, device_type, devices)
        self.pg_timeout = pg_timeout
        self.broken = False
        self.alive = True
        _RecordingPool.started.append(_Started(world_size, device_type, self.devices))

    def run_outcomes(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        **_: Any,
    ) -> list[RankOutcome]:
        outcomes = []
        for rank in range(self.world_size):
            spec = {"rank": rank, "devices": self.devices}
            index = worker_module.rank_device_index(spec) if self.device_type == "cuda" else None
            ctx = RankContext(rank, self.world_size, rank, self.backend, self.device_type, index)
            outcomes.append(RankOutcome(rank, "ok", value=fn(ctx, *args, **dict(kwargs or {}))))
        return outcomes

    def close(self, force: bool = False) -> None:
        self.alive = False


@pytest.fixture
def recorded(
    monkeypatch: pytest.MonkeyPatch, fake_gpus: Callable[[int], None]
) -> Iterator[list[_Started]]:
    """Pools started from now on (stand-ins), on a machine of 8 CUDA devices."""
    started: list[_Started] = []
    monkeypatch.setattr(_RecordingPool, "started", started)
    monkeypatch.setattr(manager_module, "RankPool", _RecordingPool)
    fake_gpus(8)
    yield started


def _device(ctx: RankContext) -> str:
    return str(ctx.device)


def test_each_xdist_workers_pools_use_its_own_devices(recorded: list[_Started]) -> None:
    manager = PoolManager()
    second = Ranks(manager, 2, lane="gpu", backend="nccl", gpu_share=GpuShare(1, 2))
    assert second.run(_device) == ["cuda:4", "cuda:5"]
    assert second.configured(world_size=4).run(_device) == [f"cuda:{i}" for i in range(4, 8)]
    first = Ranks(manager, 2, lane="gpu", backend="nccl", gpu_share=GpuShare(0, 2))
    assert first.run(_device) == ["cuda:0", "cuda:1"]  # another slice: another pool
    assert Ranks(manager, 2).run(_device) == ["cpu", "cpu"]  # CPU pools: unchanged
    assert [(s.world_size, s.device_type, s.devices) for s in recorded] == [
        (2, "cuda", (4, 5)),
        (4, "cuda", (4, 5, 6, 7)),
        (2, "cuda", (0, 1)),
        (2, "cpu", None),
    ]
    manager.close()


def test_outside_xdist_rank_r_stays_on_cuda_r(recorded: list[_Started]) -> None:
    assert Ranks(PoolManager(), 2, lane="gpu", backend="nccl").run(_device) == ["cuda:0", "cuda:1"]
    assert [s.devices for s in recorded] == [None]  # started exactly as before


INNER_WORKER_SESSION = """
import pytest


def _device(ctx):
    return str(ctx.device)


@pytest.mark.gpu
@pytest.mark.world_size(4)
def test_four_ranks(ranks):
    assert ranks.run(_device) == ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]


@pytest.mark.gpu
@pytest.mark.world_size(8)
def test_eight_ranks(ranks):
    ranks.run(_device)
"""

WORKER_CONFTEST = """
def pytest_configure(config):
    # What pytest-xdist gives its second of two workers (xdist itself is off in this session).
    config.workerinput = {"workerid": "gw1", "workercount": 2}
"""


def test_the_plugin_gives_an_xdist_worker_its_slice(
    pytester: pytest.Pytester,
    recorded: list[_Started],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("FSDP_CONFORMANCE_WORLD_SIZES", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    pytester.makeconftest(WORKER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_WORKER_SESSION)
    result = pytester.runpytest_inprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED *gpu lane: world size 8 needs 8 CUDA devices, and pytest-xdist worker gw1 has "
            "4 (cuda:4 to cuda:7) of this machine's 8 (each of the 2 workers gets its own slice, so "
            "that no two share a GPU); run fewer xdist workers (-n 1 or fewer gives each 8) or "
            "fewer ranks (world_size markers, --fsdp-world-sizes)"
        ]
    )
    assert [(s.world_size, s.devices) for s in recorded] == [(4, (4, 5, 6, 7))]


# --------------------------------------------------------------------------------------------
# Under an external launcher
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_rank", "visible", "device"),
    [
        (3, 1, 0),  # srun --gpus-per-task=1: the task's one GPU, whatever its LOCAL_RANK
        (1, 2, 1),  # torchrun --nproc-per-node 2 on 2 GPUs
        (7, 8, 7),
        (5, 4, 1),  # two GPUs per task (srun --gpus-per-task=2 on 8 ranks per node)
    ],
)
def test_a_launched_rank_takes_local_rank_modulo_the_devices_it_sees(
    local_rank: int,
    visible: int,
    device: int,
) -> None:
    assert launch_device_index(local_rank, visible) == device


def test_a_launched_rank_without_a_device_is_told_so() -> None:
    with pytest.raises(
        HarnessError, match="LOCAL_RANK 2 needs a CUDA device; this process sees none"
    ):
        launch_device_index(2, 0)


class _FakeDist:
    """``torch.distributed``'s group start and end, recorded (no group is made)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch.distributed as dist

        self.started: list[dict[str, Any]] = []
        self.destroyed = 0
        monkeypatch.setattr(dist, "init_process_group", self.init_process_group)
        monkeypatch.setattr(dist, "destroy_process_group", self.destroy_process_group)

    def init_process_group(self, backend: str, **kwargs: Any) -> None:
        self.started.append({"backend": backend, **kwargs})

    def destroy_process_group(self) -> None:
        self.destroyed += 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_supervisors_child_gets_the_ranks_device_and_the_pools_nccl_error_handling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rank 3 of a 2-node torchrun launch (LOCAL_RANK 1 of 2) seeing one CUDA device: its child
    # takes cuda:0 (not LOCAL_RANK 1: an invalid ordinal here), and NCCL's error handling of
    # the pools (2) in place of the 1 torchrun sets for every rank.
    import torch.distributed as dist

    from fsdp_conformance.harness import LaunchSupervisor

    port = _free_port()
    # the agent's store, which rank 3 joins
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    environ = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    supervisor = LaunchSupervisor(check_timeout=400.0, environ=environ)
    try:
        assert (supervisor.backend, supervisor.device_type) == ("nccl", "cuda")
        assert supervisor.pg_timeout == pg_timeout_for(400.0) == 460
        hosted = supervisor.hosted_rank(7)
        assert (hosted.rank, hosted.local_rank, hosted.local_world_size) == (3, 1, 2)
        assert hosted.device_index == 0
        assert (hosted.store_host, hosted.store_port) == ("127.0.0.1", port)
        assert hosted.store_prefix.endswith("/generation7")
        assert supervisor.child_environment({"X": "1"}) == {
            "X": "1",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        }
        assert supervisor.fork_servers is None  # CUDA children are exec-started
        assert not supervisor.hosts_store
    finally:
        supervisor.close()
        del server


LAUNCHED_SESSION = """
import pytest

from fsdp_conformance.harness import LaunchSupervisor


def _where(ctx):
    return (ctx.rank, ctx.world_size, ctx.backend)


@pytest.mark.cpu
def test_launched(ranks):
    assert isinstance(ranks.engine, LaunchSupervisor)
    assert ranks.engine.pg_timeout == 460  # max(300, --fsdp-timeout 400 + 60)
    assert ranks.run(_where) == [(0, 1, "gloo")]
"""


def test_a_launched_pytest_session_supervises_a_child_rank_and_joins_no_group_itself(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name in (
        "FSDP_CONFORMANCE_TIMEOUT",
        "FSDP_CONFORMANCE_WORLD_SIZES",
        "FSDP_CONFORMANCE_BACKEND",
    ):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),  # rank 0's supervisor hosts the launch's store there
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dist = _FakeDist(monkeypatch)
    pytester.makepyfile(test_inner=LAUNCHED_SESSION)
    result = pytester.runpytest_inprocess(
        "--fsdp-timeout", "400", "--fsdp-world-sizes", "1", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)
    # The check ran in the supervisor's child; this process never joined a process group.
    assert dist.started == [] and dist.destroyed == 0
