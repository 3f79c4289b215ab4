"""The object tests use (the ``ranks`` fixture) and the CLI drives: one lane, one world size."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from fsdp_conformance.harness.engine import RankEngine, RankRequest
from fsdp_conformance.harness.launcher import launch_gpu_unavailable, launched_externally
from fsdp_conformance.harness.outcomes import resolve_outcomes
from fsdp_conformance.harness.protocol import CheckSkipped, RankOutcome, function_name
from fsdp_conformance.settings import OPTIONS_BY_NAME, FlagStyle


@functools.cache
def cuda_device_count() -> int:
    """The CUDA devices this process sees, asked of torch once per process.

    Every lane decision of every check reads it, and each torch query may initialize CUDA;
    the devices do not change under a running process. ``cuda_device_count.cache_clear()``
    asks again (tests that fake the devices).
    """
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as none
        return 0


class GpuShare(NamedTuple):
    """The part of this machine's CUDA devices a process's pools use: part ``worker`` of
    ``workers`` contiguous parts (:func:`device_slice`). The plugin gives each pytest-xdist
    worker its own (:func:`xdist_share`), so that no two workers' ranks share a GPU;
    ``GpuShare()``, the default, is every device (rank ``r`` on ``cuda:r``)."""

    worker: int = 0
    workers: int = 1


def xdist_share(worker_id: str, worker_count: int | str) -> GpuShare:
    """The share of pytest-xdist worker ``worker_id`` (``gw3``) of ``worker_count`` workers
    (``config.workerinput``'s ``workerid`` and ``workercount``). An id not of that form, or
    one worker, gets every device."""
    digits = worker_id.removeprefix("gw")
    count = int(worker_count)
    if not digits.isdigit() or not 0 <= int(digits) < count:
        return GpuShare()
    return GpuShare(int(digits), count)


def device_slice(visible: int, share: GpuShare) -> tuple[int, ...]:
    """The device indices of ``share`` among ``visible`` devices: contiguous, disjoint, sizes
    differing by at most one, the first workers getting the extra ones (8 devices, 2 workers:
    0-3 and 4-7; 2 devices, 3 workers: 0, 1 and none)."""
    per, extra = divmod(visible, share.workers)
    start = share.worker * per + min(share.worker, extra)
    return tuple(range(start, start + per + (1 if share.worker < extra else 0)))


def _devices_named(devices: tuple[int, ...]) -> str:
    if not devices:
        return "none"
    if len(devices) == 1:
        return f"1 (cuda:{devices[0]})"
    return f"{len(devices)} (cuda:{devices[0]} to cuda:{devices[-1]})"


def share_shortfall(world_size: int, visible: int, share: GpuShare, flag: str) -> str | None:
    """Why this pytest-xdist worker's devices cannot hold ``world_size`` ranks, or None.

    Only the worker's own slice counts (:func:`device_slice`): ``visible`` is at least
    ``world_size`` here (the machine has enough; its workers split it too thin).
    """
    devices = device_slice(visible, share)
    if world_size <= len(devices):
        return None
    workers = visible // world_size
    return (
        f"gpu lane: world size {world_size} needs {world_size} CUDA "
        f"device{'' if world_size == 1 else 's'}, and pytest-xdist "
        f"worker gw{share.worker} has {_devices_named(devices)} of this machine's {visible} "
        f"(each of the {share.workers} workers gets its own slice, so that no two share a "
        f"GPU); run fewer xdist workers (-n {workers} or fewer gives each {world_size}) or "
        f"fewer ranks (world_size markers, {flag})"
    )


def lane_unavailable(
    lane: str, world_size: int, flag_style: FlagStyle = "pytest", share: GpuShare = GpuShare()
) -> str | None:
    """Why this lane cannot run at this world size here, or None when it can.

    The one decision: the plugin's ``pytest_runtest_setup`` asks it for every test (before any
    fixture), :meth:`Ranks.run_outcomes` for every check run outside pytest's parametrization
    (``fsdp-conformance run``, a ``Ranks`` built by hand or reconfigured); the others use their
    answer. ``flag_style`` spells the world-size flag as the front end in use does. ``share``:
    the devices this process's pools may use (a pytest-xdist worker's slice). Under an external
    launcher the ranks of this node are counted instead (:func:`.launcher.launch_gpu_unavailable`).
    """
    if lane != "gpu":
        return None
    found = cuda_device_count()
    if found == 0:
        return "gpu lane: no CUDA device (torch.cuda.is_available() is False)"
    if launched_externally():
        return launch_gpu_unavailable(os.environ, found)
    flag = OPTIONS_BY_NAME["world_sizes"].flag_in(flag_style)
    if world_size > found:
        return (
            f"gpu lane: world size {world_size} needs {world_size} CUDA devices, found {found} "
            f"(one rank per device); run it on a machine with {world_size} GPUs (tests without "
            f"a world_size marker follow {flag}, e.g. {found})"
        )
    return share_shortfall(world_size, found, share, flag)


def pool_devices(device_type: str, share: GpuShare) -> tuple[int, ...] | None:
    """The CUDA devices a pool's ranks take, rank ``r`` the ``r``-th: the share's slice of this
    machine's devices; None (rank ``r`` on ``cuda:r``) on CPU or with every device."""
    if device_type != "cuda" or share.workers == 1:
        return None
    return device_slice(cuda_device_count(), share)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Runs checks on ``world_size`` ranks of one lane; returns each rank's value.

    ``ranks.run(check, *args, **kwargs)`` calls ``check(ctx, *args, **kwargs)`` on every rank
    and returns the list of values by rank; a failure on any rank raises :class:`RankFailure`,
    a skip on every rank raises :class:`CheckSkipped`. ``ranks.configured(...)`` returns a
    runner with other options (timeout, fresh processes, environment, backend). The ranks are
    ``engine``'s (:class:`~.engine.RankEngine`: the caller's warm pools, or the launch this
    process is a rank of); each check is one :class:`~.engine.RankRequest` to it.
    """

    engine: RankEngine
    world_size: int
    lane: str = "cpu"
    backend: str = "gloo"
    timeout: float = 120.0
    #: Where ``timeout`` came from, said where a check runs out of it (a derived one).
    timeout_note: str = ""
    fresh: bool = False
    env: Mapping[str, str] | None = None
    #: Called with the reason when every rank skipped (the plugin passes ``pytest.skip``).
    skip: Callable[[str], Any] | None = None
    #: Called with the reason when a check fails as a known torch defect says it does
    #: (``fsdp_conformance.expectations``; the plugin passes ``pytest.xfail``).
    xfail: Callable[[str], Any] | None = None
    #: ``time.monotonic()`` by which every check must end (an outer pytest-timeout, less the
    #: time to dump stacks): a check's timeout shrinks to fit, and its failure says so.
    deadline: float | None = None
    #: What the deadline is, for that failure ("this test's pytest-timeout of 6s ...").
    deadline_note: str = ""
    #: The front end in use, whose flags a message names (``cli``: ``fsdp-conformance run``).
    flag_style: FlagStyle = "pytest"
    #: The CUDA devices this process's pools may use (the plugin: this pytest-xdist worker's).
    gpu_share: GpuShare = GpuShare()

    @property
    def device_type(self) -> str:
        return "cuda" if self.lane == "gpu" else "cpu"

    def configured(self, **changes: Any) -> Ranks:
        return dataclasses.replace(self, **changes)

    def request(self) -> RankRequest:
        """What a check run through this object asks of its engine."""
        return RankRequest(
            self.world_size,
            lane=self.lane,
            backend=self.backend,
            timeout=self.timeout,
            timeout_note=self.timeout_note,
            fresh=self.fresh,
            env=self.env,
            deadline=self.deadline,
            deadline_note=self.deadline_note,
            devices=pool_devices(self.device_type, self.gpu_share),
        )

    def run_outcomes(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[RankOutcome]:
        """Every rank's outcome of ``fn``; :class:`CheckSkipped` where this machine lacks the
        lane's devices (:func:`lane_unavailable`) or the engine cannot provide the request."""
        unavailable = lane_unavailable(self.lane, self.world_size, self.flag_style, self.gpu_share)
        if unavailable:
            raise CheckSkipped(unavailable)
        request = self.request()
        unavailable = self.engine.cannot_provide(request)
        if unavailable:
            raise CheckSkipped(unavailable)
        return self.engine.run_outcomes(request, fn, args, kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        __tracebackhide__ = True  # a failure points at the test's line, then the ranks' story
        try:
            return resolve_outcomes(function_name(fn), self.run_outcomes(fn, *args, **kwargs))
        except CheckSkipped as exc:
            if self.skip is None:
                raise
            self.skip(str(exc))
            raise  # a skip callable that returns: still a skip
