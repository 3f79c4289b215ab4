"""The harness's timeouts: how long ranks get to start, a check to run, a process group to wait.

Each is derived from the check's timeout or an outer deadline (a test's pytest-timeout), so
that the harness, not a process group's watchdog or pytest-timeout, stops what is stuck, with
every rank's stacks. Used by the warm pool (:mod:`.pool`), its manager (:mod:`.manager`), the
``ranks`` fixture's object (:mod:`.ranks`) and the session (:mod:`.session`).
"""

from __future__ import annotations

import time

#: Time kept back, before an outer pytest-timeout fires, for dumping every rank's stack and
#: killing the pool (at most this, and at most a quarter of a short pytest-timeout).
OUTER_TIMEOUT_RESERVE_S = 5.0
#: Seconds ranks get to start and join their process group, before the per-rank allowance
#: below (:func:`start_timeout_for`), unless an outer deadline is nearer.
START_TIMEOUT_S = 60.0
#: Seconds each CPU rank adds to the start timeout: an ``exec``-started rank spends about
#: 2.4 CPU-seconds importing torch (docs/harness.md, "Rank starts"), and on a 2-core machine
#: 16 of them take their turns.
START_PER_CPU_RANK_S = 2.5
#: Seconds each CUDA rank adds to the start timeout: a GPU rank is always ``exec``-started
#: (no fork after CUDA), imports torch cold, creates its CUDA context and joins NCCL eagerly
#: (``device_id``), and the ranks of one machine do that at once, contending for the driver
#: and the CPUs; eight such ranks can need more than the fixed 60 s.
START_PER_CUDA_RANK_S = 15.0
#: The process group's timeout never goes below this (what it was before it was derived).
PG_TIMEOUT_MIN_S = 300.0
#: How much longer the process group's timeout is than the check's: the parent must have
#: declared a stuck check "did not finish", dumped every rank's stacks and killed the ranks
#: before the process group gives up on the same collective (gloo raises, NCCL's watchdog
#: aborts it, or under torch's default error handling tears the rank down: "died", without
#: stacks). The collective starts after the check was sent, so this margin is for the
#: parent's stack dump and a loaded machine's scheduling delays.
PG_TIMEOUT_MARGIN_S = 60.0
#: A check's timeout where nothing else is said (``Settings.timeout``'s default).
DEFAULT_CHECK_TIMEOUT_S = 120.0
#: A timeout derived from a check's work (:func:`scaled_timeout`) is at most this many times
#: the run's: a check that hangs on a large model still ends.
SCALED_TIMEOUT_MAX_FACTOR = 10.0


def seconds(value: float) -> str:
    """``value`` seconds as a failure message writes them: ``"12s"``, ``"2.5s"``."""
    return f"{value:.0f}s" if value >= 10 or value == int(value) else f"{value:.1f}s"


def outer_deadline(started: float, pytest_timeout: float, source: str) -> tuple[float, str]:
    """When checks of a test must be done so that its pytest-timeout never fires first.

    ``started``: ``time.monotonic()`` when the test began; ``pytest_timeout``: its pytest-timeout
    in seconds, from ``source``. Returns the monotonic deadline and the words a failure uses.
    """
    reserve = min(OUTER_TIMEOUT_RESERVE_S, pytest_timeout / 4)
    note = (
        f"this test's pytest-timeout of {seconds(pytest_timeout)} ({source}), less "
        f"{seconds(reserve)} for the stack dump and teardown"
    )
    return started + pytest_timeout - reserve, note


def scaled_timeout(default: float, cost_steps: float, step_s: float) -> tuple[float, str]:
    """A check's timeout from the work it does, and the words its timeout message uses.

    ``cost_steps``: what the check's work is worth in its model's eager training steps (its
    ``Check.cost``); ``step_s``: one such step's seconds, measured on this machine now
    (:func:`fsdp_conformance.measure.step_cost.eager_step_seconds`). The timeout is their
    product, never below ``default`` (the run's timeout, 120 s unless set) and at most
    :data:`SCALED_TIMEOUT_MAX_FACTOR` times it. A check of cost 15000 on a model whose step
    takes 0.02 s gets 300 s; on one whose step takes 0.002 s, the default.
    """
    work = cost_steps * step_s
    ceiling = default * SCALED_TIMEOUT_MAX_FACTOR
    timeout = min(max(default, work), ceiling)
    bound = (
        f"at most {SCALED_TIMEOUT_MAX_FACTOR:g} x the default {seconds(default)}"
        if work > ceiling
        else f"at least the default {seconds(default)}"
    )
    note = (
        f" (derived from the check's work: {cost_steps:g} x the model's eager step of "
        f"{step_s:.3g}s measured in this run = {seconds(work)}, {bound}; an explicit "
        "--timeout is used as given)"
    )
    return timeout, note


def pg_timeout_for(check_timeout: float) -> float:
    """The process-group timeout for ranks that run checks of ``check_timeout`` seconds.

    The harness's own check timeout must fire first (every rank's stacks, then the pool is
    killed): ``max(PG_TIMEOUT_MIN_S, check_timeout + PG_TIMEOUT_MARGIN_S)``. A check timeout of
    400 s gets a process group of 460 s, where a fixed 300 s let the watchdog end the ranks
    first.
    """
    return max(PG_TIMEOUT_MIN_S, check_timeout + PG_TIMEOUT_MARGIN_S)


def start_timeout_for(world_size: int, device_type: str) -> float:
    """Seconds ``world_size`` ranks on ``device_type`` get to start and join their group.

    ``START_TIMEOUT_S`` plus an allowance per rank (``START_PER_CUDA_RANK_S`` for CUDA ranks,
    ``START_PER_CPU_RANK_S`` for CPU ones): a world of 8 GPU ranks gets 180 s, one of 2 CPU
    ranks 65 s. An outer deadline still cuts it (:func:`fit_timeout`, in
    :meth:`.manager.PoolManager.run_outcomes`). A start that fails (a rank exits) is reported
    at once; only a start that hangs waits this long.
    """
    per_rank = START_PER_CUDA_RANK_S if device_type == "cuda" else START_PER_CPU_RANK_S
    return START_TIMEOUT_S + per_rank * world_size


def fit_timeout(
    timeout: float, deadline: float | None, deadline_note: str = ""
) -> tuple[float, str]:
    """The check's timeout cut to end by ``deadline``, and what the failure says about it."""
    if deadline is None:
        return timeout, ""
    left = deadline - time.monotonic()
    if left >= timeout:
        return timeout, ""
    # Past the deadline still gets a moment: the stack dump is the point of fitting at all.
    fitted = max(left, 0.1)
    return fitted, f" (cut from {seconds(timeout)} to end within {deadline_note})"
