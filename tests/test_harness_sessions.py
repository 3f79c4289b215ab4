"""The rank harness, proven by injecting each fault it must report (the process lane).

Fault injection runs in separate pytest sessions (the plugin loaded through its ``pytest11``
entry point), one session per module for all the faults, and asserts both the outcome and what
the report says; torchrun launches and sessions side by side likewise. The module's inner
sessions and torchrun launches start together (``started``), so that one's waits overlap the
others' work. Every test here starts processes of its own: ``pytest -m process``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from inner_sessions import (
    SESSION_LIMIT_S,
    Session,
    failure_section,
    finish_session,
    inner_env,
    rank_processes_of,
    start_session,
)

from fsdp_conformance.harness import HarnessError

pytestmark = pytest.mark.process


# --------------------------------------------------------------------------------------------
# A rank that dies while joining the process group
# --------------------------------------------------------------------------------------------

DIE_AT_INIT = """
import os
if os.environ.get("FSDPC_TEST_DIE_AT_INIT"):
    import time
    import torch.distributed as dist

    def _die(*args, **kwargs):
        time.sleep(1.0)  # after the hello: the parent is waiting for "ready"
        os._exit(3)

    dist.init_process_group = _die
"""


def test_rank_dying_while_joining_the_group_is_a_harness_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_conformance.harness import RankPool

    (tmp_path / "sitecustomize.py").write_text(DIE_AT_INIT)
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks' PYTHONPATH is the parent's sys.path
    with pytest.raises(HarnessError) as info:
        RankPool(1, env={"FSDPC_TEST_DIE_AT_INIT": "1"}, start_timeout=30.0)
    message = str(info.value)
    assert "could not start 1 gloo ranks" in message
    assert "rank 0: exited with code 3" in message


# --------------------------------------------------------------------------------------------
# Started together: this module's inner sessions and torchrun launches
# --------------------------------------------------------------------------------------------

#: Starts one module fixture's subprocesses (adding each to the list, for the teardown) and
#: returns what waits for them and gives the fixture's value.
Starter = Callable[[pytest.TempPathFactory, list[subprocess.Popen[str]]], Callable[[], Any]]

#: The starters, by the name of the fixture that waits for them.
BACKGROUND: dict[str, Starter] = {}


def background(fixture_name: str) -> Callable[[Starter], Starter]:
    def register(start: Starter) -> Starter:
        BACKGROUND[fixture_name] = start
        return start

    return register


class Background:
    """The subprocesses of this module's fixtures, started before their fixtures ask."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.procs: list[subprocess.Popen[str]] = []
        self.finishers: dict[str, Callable[[], Any]] = {}

    def start(self, name: str) -> None:
        self.finishers[name] = BACKGROUND[name](self.tmp_path_factory, self.procs)

    def result(self, name: str) -> Any:
        """Wait for fixture ``name``'s subprocesses (started now if they were not) and give
        its value."""
        if name not in self.finishers:
            self.start(name)
        return self.finishers[name]()

    def stop(self) -> None:
        for proc in self.procs:  # a run cut short (a failed fixture, Ctrl-C) leaves none behind
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def selected_fixtures(request: pytest.FixtureRequest) -> set[str]:
    """The fixtures that this module's selected tests use, in a session that runs them all.

    Empty in a pytest-xdist worker, which runs only some of the tests it collected: there each
    fixture starts its own subprocesses when asked, so no worker starts another's.
    """
    if hasattr(request.config, "workerinput"):
        return set()
    return {
        name
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        for name in getattr(item, "fixturenames", ())
    }


@pytest.fixture(scope="module", autouse=True)
def started(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Background]:
    """Starts at once every inner session and launch that this module's selected tests need.

    Much of their time is waiting (graces, hangs, torchrun's rendezvous) and each runs the
    torch imports of a few processes: one after another on a 2-core machine they cost the sum
    of their wall times, started together about the CPU time they need. They start with the
    module's first test (autouse), so that the in-process pool tests, which come first, run
    while they do. Each fixture that gives one of them waits for its own; what the tests
    assert is the same either way.
    """
    background = Background(tmp_path_factory)
    needed = selected_fixtures(request)
    try:
        for name in BACKGROUND:
            if name in needed:
                background.start(name)
        yield background
    finally:
        background.stop()


# --------------------------------------------------------------------------------------------
# One inner session, every fault
# --------------------------------------------------------------------------------------------

FAULTS_CONFTEST = """
import os
import re
from pathlib import Path

import pytest


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # Runs after the plugin closed its pools, while this process still lives: any rank
    # process still running now was leaked by the harness.
    pattern = re.compile(r"'parent_pid': %d\\b" % os.getpid())
    left = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\\0", b" ").decode()
        except OSError:
            continue
        if "fsdp_conformance.harness.worker" in cmdline and pattern.search(cmdline):
            left.append(entry.name)
    Path("leftover-ranks.txt").write_text(" ".join(left))
"""

FAULTS = """
import ctypes
import os
import signal
import time

import pytest
import torch.distributed as dist

from fsdp_conformance.harness import skip_rank

pytestmark = pytest.mark.cpu


def _raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one is unhappy")
    return ctx.rank


def _raise_on_every_rank(ctx):
    raise KeyError(f"missing key on rank {ctx.rank}")


def _sigkill(ctx, victim):
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _exit_early(ctx, victim):
    if ctx.rank == victim:
        os._exit(7)
    dist.barrier()


def _segfault_rank1(ctx):
    if ctx.rank == 1:
        ctypes.string_at(0)
    dist.barrier()


def _spin_forever():
    while True:
        time.sleep(0.05)


def _hang_rank1(ctx):
    if ctx.rank == 1:
        _spin_forever()
    dist.barrier()  # rank 0 waits here for rank 1, forever


def _skip_everywhere(ctx):
    skip_rank("feature X is missing in this torch")


def _skip_rank0_only(ctx):
    if ctx.rank == 0:
        skip_rank("rank 0 thinks feature X is missing")
    return ctx.rank


def _skip_rank0_while_rank1_waits(ctx):
    if ctx.rank == 0:
        skip_rank("rank 0 has no feature Y")
    dist.barrier()  # rank 1 waits here for a rank that skipped


def _raise_rank0_while_rank1_waits(ctx):
    if ctx.rank == 0:
        raise ValueError("rank zero gives up")
    dist.barrier()  # rank 1 waits here for a rank that raised (and lives on)


def _rank(ctx):
    return ctx.rank


def _warm(ranks):
    # The first check on a new pool imports this file (pytest with it) on every rank: on a
    # loaded machine that can outlast a 2 s timeout or a grace, and the report would show a
    # rank importing instead of waiting where the fault left it. Done here, before the fault.
    assert ranks.run(_rank) == [0, 1]


# The check timeout (100 s) is far beyond the grace: a report naming the grace proves the peer
# was released by it; the pytest-timeout marker only guards against waiting the timeout out.
@pytest.mark.timeout(120)
def test_skip_while_peer_waits(ranks):
    _warm(ranks)
    ranks.configured(timeout=100).run(_skip_rank0_while_rank1_waits)


@pytest.mark.timeout(120)
def test_failure_while_peer_waits(ranks):
    _warm(ranks)
    ranks.configured(timeout=100).run(_raise_rank0_while_rank1_waits)


def test_exception_on_one_rank(ranks):
    ranks.run(_raise_on_rank1)


def test_exceptions_on_all_ranks(ranks):
    ranks.run(_raise_on_every_rank)


def test_sigkill_rank1(ranks):
    _warm(ranks)
    ranks.run(_sigkill, 1)


def test_sigkill_rank0(ranks):
    _warm(ranks)
    ranks.run(_sigkill, 0)


def test_os_exit_rank1(ranks):
    _warm(ranks)
    ranks.run(_exit_early, 1)


def test_os_exit_rank0(ranks):
    _warm(ranks)
    ranks.run(_exit_early, 0)


def test_segfault_rank1(ranks):
    ranks.run(_segfault_rank1)


def test_hang_rank1(ranks):
    _warm(ranks)
    ranks.configured(timeout=2).run(_hang_rank1)


def test_skip_on_every_rank(ranks):
    ranks.run(_skip_everywhere)


# pytest-timeout (12 s) fires long before the check timeout (120 s by default): the check's
# timeout must shrink to fit, so the report is every rank's stack, not pytest's bare Timeout.
# It follows a skip on every rank, which keeps the pool warm: starting ranks on a loaded machine
# would eat into those 12 s (that case has a test of its own, in the outer session).
@pytest.mark.timeout(12)
def test_hang_under_a_shorter_pytest_timeout(ranks):
    ranks.run(_hang_rank1)


def test_skip_on_one_rank(ranks):
    ranks.run(_skip_rank0_only)


def test_clean_check_after_all_faults(ranks):
    assert ranks.run(_rank) == [0, 1]
"""

FAULT_TESTS = (  # in the order of the file
    "test_skip_while_peer_waits",
    "test_failure_while_peer_waits",
    "test_exception_on_one_rank",
    "test_exceptions_on_all_ranks",
    "test_sigkill_rank1",
    "test_sigkill_rank0",
    "test_os_exit_rank1",
    "test_os_exit_rank0",
    "test_segfault_rank1",
    "test_hang_rank1",
    "test_hang_under_a_shorter_pytest_timeout",
    "test_skip_on_one_rank",
)


@background("faults")
def start_faults(
    tmp_path_factory: pytest.TempPathFactory, procs: list[subprocess.Popen[str]]
) -> Callable[[], Session]:
    """The plain (no xdist) session: every fault, after the all-reduce tests that this session
    runs side by side with the xdist one (``start_side_by_side``)."""
    directory = tmp_path_factory.mktemp("faults")
    (directory / "conftest.py").write_text(FAULTS_CONFTEST)
    (directory / "test_faults.py").write_text(FAULTS)
    (directory / "test_side.py").write_text(SIDE_BY_SIDE)
    proc = start_session(directory, ["test_side.py", "test_faults.py", "-m", "cpu"])
    procs.append(proc)
    return lambda: finish_session(proc, directory)


@pytest.fixture(scope="module")
def faults(started: Background) -> Session:
    """One inner pytest session (a subprocess, in a folder of its own) that runs SIDE_BY_SIDE's
    four all-reduce tests (read by the side-by-side tests, as the plain session) and then every
    fault of FAULTS; read by the fault tests below and by the side-by-side tests."""
    return started.result("faults")


def test_fault_session_outcomes(faults: Session) -> None:
    # The four passes beyond the fault file's one are test_side.py's (SIDE_BY_SIDE).
    faults.result.assert_outcomes(failed=len(FAULT_TESTS), passed=1 + 4, skipped=1)
    faults.result.stdout.fnmatch_lines(
        [f"FAILED test_faults.py::{name}*" for name in FAULT_TESTS], consecutive=False
    )


def test_exception_on_one_rank_shows_that_ranks_traceback(faults: Session) -> None:
    section = failure_section(faults.result, "test_exception_on_one_rank")
    section.fnmatch_lines(
        [
            (
                "*RankFailure: check '*_raise_on_rank1' failed on 2 ranks: "
                "rank 0 passed, rank 1 raised"
            ),
            "*--- rank 1: raised ---",
            "*Traceback (most recent call last):",
            "*in _raise_on_rank1",
            "*ValueError: rank one is unhappy",
        ]
    )
    section.no_fnmatch_line("*--- rank 0:*")


def test_exceptions_on_all_ranks_label_each_traceback_by_rank(faults: Session) -> None:
    section = failure_section(faults.result, "test_exceptions_on_all_ranks")
    section.fnmatch_lines(
        [
            "*failed on 2 ranks: rank 0 raised, rank 1 raised",
            "*--- rank 0: raised ---",
            "*in _raise_on_every_rank",
            "*KeyError: 'missing key on rank 0'",
            "*--- rank 1: raised ---",
            "*in _raise_on_every_rank",
            "*KeyError: 'missing key on rank 1'",
        ]
    )


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkilled_rank_is_named_with_its_signal_and_the_others_story(
    faults: Session, victim: int
) -> None:
    other = 1 - victim
    section = failure_section(faults.result, f"test_sigkill_rank{victim}")
    section.fnmatch_lines([f"*failed on 2 ranks: *rank {victim} died*"])
    section.fnmatch_lines(
        [
            f"*--- rank {victim}: died ---",
            "*killed by SIGKILL (exit status -9) before reporting*",
        ]
    )
    # What the survivor was doing: gloo's error from the barrier, or its stack in the barrier.
    section.fnmatch_lines([f"*--- rank {other}: *"])
    section.fnmatch_lines(["*barrier*"])


@pytest.mark.parametrize("victim", [0, 1])
def test_rank_calling_os_exit_is_named_with_its_exit_code(faults: Session, victim: int) -> None:
    other = 1 - victim
    section = failure_section(faults.result, f"test_os_exit_rank{victim}")
    section.fnmatch_lines([f"*failed on 2 ranks: *rank {victim} died*"])
    section.fnmatch_lines(
        [f"*--- rank {victim}: died ---", "*exited with code 7 before reporting*"]
    )
    section.fnmatch_lines([f"*--- rank {other}: *"])
    section.fnmatch_lines(["*barrier*"])


def test_segfaulting_rank_shows_sigsegv_and_its_python_stack(faults: Session) -> None:
    section = failure_section(faults.result, "test_segfault_rank1")
    section.fnmatch_lines(
        [
            "*failed on 2 ranks: *rank 1 died*",
            "*--- rank 1: died ---",
            # Where it crashed, from faulthandler's stack: no torch frame, so the innermost.
            "*killed by SIGSEGV (exit status -11) in string_at (*ctypes*) before reporting; "
            "its log ends:",
            "*Fatal Python error: Segmentation fault*",
            "*in _segfault_rank1",
        ]
    )


def test_hanging_rank_is_stopped_after_the_timeout_with_every_ranks_stack(
    faults: Session,
) -> None:
    section = failure_section(faults.result, "test_hang_rank1")
    section.fnmatch_lines(
        [
            "*failed on 2 ranks: rank 0 did not finish, rank 1 did not finish",
            "*--- rank 0: did not finish ---",
            "*no result after the check's timeout of 2s; its stacks:",
            "*in barrier",
            "*--- rank 1: did not finish ---",
            "*no result after the check's timeout of 2s; its stacks:",
            "*in _spin_forever",
            "*in _hang_rank1",
        ]
    )


def test_skip_on_every_rank_skips_the_test_with_the_reason(faults: Session) -> None:
    faults.result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *: feature X is missing in this torch"])


def test_skip_on_one_rank_only_is_a_failure_saying_the_ranks_disagree(faults: Session) -> None:
    section = failure_section(faults.result, "test_skip_on_one_rank")
    section.fnmatch_lines(
        [
            "*ranks disagree on skipping (rank 0 skipped, rank 1 passed)*",
            "*--- rank 0: skipped ---",
            "*rank 0 thinks feature X is missing",
        ]
    )


def test_skip_while_a_peer_waits_releases_it_after_the_grace_as_a_disagreement(
    faults: Session,
) -> None:
    section = failure_section(faults.result, "test_skip_while_peer_waits")
    section.fnmatch_lines(
        [
            "*ranks disagree on skipping (rank 0 skipped, rank 1 did not finish)*",
            "*--- rank 0: skipped ---",
            "*rank 0 has no feature Y",
            "*--- rank 1: did not finish ---",
            # The check's timeout reads "100s", or less with a note when starting the pool
            # under load used part of the test's pytest-timeout: released after the grace
            # either way.
            "*still running 5s after rank 0 skipped (released then, not after the check's "
            "timeout of *s*); its stacks:",
            "*in barrier",
        ]
    )


def test_failure_while_a_peer_waits_releases_it_after_the_grace(faults: Session) -> None:
    section = failure_section(faults.result, "test_failure_while_peer_waits")
    section.fnmatch_lines(
        [
            "*failed on 2 ranks: rank 0 raised, rank 1 did not finish",
            "*--- rank 0: raised ---",
            "*ValueError: rank zero gives up",
            "*--- rank 1: did not finish ---",
            "*still running 3s after rank 0 raised (released then, not after the check's "
            "timeout of *s*); its stacks:",
            "*in barrier",
        ]
    )


def test_check_timeout_fits_inside_a_shorter_pytest_timeout_and_dumps_every_rank(
    faults: Session,
) -> None:
    section = failure_section(faults.result, "test_hang_under_a_shorter_pytest_timeout")
    # Under 20 s, the reserve is a quarter of the pytest-timeout (3 s of 12 s), not 5 s.
    note = (
        "(cut from 120s to end within this test's pytest-timeout of 12s (its timeout "
        "marker), less 3s for the stack dump and teardown); its stacks:"
    )
    section.fnmatch_lines(
        [
            "*failed on 2 ranks: rank 0 did not finish, rank 1 did not finish",
            "*--- rank 0: did not finish ---",
            f"*no result after the check's timeout of *s {note}",
            "*in barrier",
            "*--- rank 1: did not finish ---",
            f"*no result after the check's timeout of *s {note}",
            "*in _spin_forever",
        ]
    )
    section.no_fnmatch_line("*Failed: Timeout*")


def test_faults_do_not_end_the_session_and_later_checks_run_on_clean_ranks(
    faults: Session,
) -> None:
    faults.result.stdout.fnmatch_lines(
        ["PASSED test_faults.py::test_clean_check_after_all_faults*"]
    )


def test_no_rank_process_is_left_behind_after_the_faults(faults: Session) -> None:
    leftover = (faults.directory / "leftover-ranks.txt").read_text()
    assert leftover == "", f"rank processes still running at the end of the session: {leftover}"
    assert rank_processes_of(faults) == []


# --------------------------------------------------------------------------------------------
# Sessions side by side
# --------------------------------------------------------------------------------------------

SIDE_BY_SIDE = """
import pytest
import torch
import torch.distributed as dist


def _sum_of_ranks(ctx, offset):
    t = torch.tensor([ctx.rank + offset])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("offset", range(4))
def test_all_reduce(ranks, offset):
    assert ranks.run(_sum_of_ranks, offset) == [1 + 2 * offset] * 2
"""


@background("side_by_side")
def start_side_by_side(
    tmp_path_factory: pytest.TempPathFactory, procs: list[subprocess.Popen[str]]
) -> Callable[[], Session]:
    """The xdist session (two workers), started at once with the plain one, which is the fault
    session (``start_faults``: its first tests are these same all-reduce tests)."""
    directory = tmp_path_factory.mktemp("xdist")
    (directory / "test_side.py").write_text(SIDE_BY_SIDE)
    proc = start_session(directory, ["test_side.py", "-m", "cpu", "-n", "2"])
    procs.append(proc)
    return lambda: finish_session(proc, directory)


@pytest.fixture(scope="module")
def side_by_side(started: Background, faults: Session) -> dict[str, Session]:
    """Two sessions run at once in two folders: ``plain`` (the fault session, whose
    test_side.py runs first) and ``xdist`` (test_side.py on two xdist workers); read by the
    side-by-side tests below."""
    return {"plain": faults, "xdist": started.result("side_by_side")}


def test_two_sessions_side_by_side_both_pass(side_by_side: dict[str, Session]) -> None:
    side_by_side["plain"].result.stdout.fnmatch_lines(
        [f"PASSED test_side.py::test_all_reduce[[]*-{offset}[]]" for offset in range(4)],
        consecutive=False,
    )
    side_by_side["xdist"].result.assert_outcomes(passed=4)


def test_xdist_workers_each_get_their_own_pools(side_by_side: dict[str, Session]) -> None:
    side_by_side["xdist"].result.stdout.fnmatch_lines(["*2 workers*"])
    side_by_side["xdist"].result.assert_outcomes(passed=4)


def test_sessions_side_by_side_leave_no_rank_process(side_by_side: dict[str, Session]) -> None:
    for session in side_by_side.values():
        assert rank_processes_of(session) == []


# --------------------------------------------------------------------------------------------
# External launcher (torchrun)
# --------------------------------------------------------------------------------------------

LAUNCHED = """
import os

import pytest

pytestmark = pytest.mark.cpu


def _rank_and_pid(ctx):
    return [ctx.rank, os.getpid()]


def _raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("only rank 1 fails")
    return ctx.rank


def test_runs_in_a_child_of_each_launched_process(ranks):
    values = ranks.run(_rank_and_pid)
    assert [rank for rank, _ in values] == [0, 1]
    # this launched process supervises its rank's child, which ran the check
    assert values[int(os.environ["RANK"])][1] != os.getpid()


def _unpicklable_on_rank1(ctx):
    return (lambda: None) if ctx.rank == 1 else ctx.rank


def test_failure_on_one_rank(ranks):
    ranks.run(_raise_on_rank1)


def test_unpicklable_value_on_one_rank(ranks):
    ranks.run(_unpicklable_on_rank1)
"""


def start_torchrun(
    directory: Path, procs: list[subprocess.Popen[str]], *pytest_args: str
) -> Callable[[], tuple[int, dict[int, pytest.LineMatcher]]]:
    """Start pytest under torchrun on 2 local ranks; what waits for its exit code and each
    rank's output."""
    (directory / "test_launched.py").write_text(LAUNCHED)
    logs = directory / f"logs-{'-'.join(pytest_args)}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--redirects", "3", "--log-dir", str(logs),
        "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-m", "cpu",
        "--fsdp-timeout=5",  # the outer guard (pytest-timeout) becomes 85 s: a hang fails
        *pytest_args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=directory, env=inner_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    procs.append(proc)

    def finish() -> tuple[int, dict[int, pytest.LineMatcher]]:
        try:
            _, err = proc.communicate(timeout=SESSION_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"torchrun ran over {SESSION_LIMIT_S}s; the ranks' logs are in {logs}")
        by_rank = {}
        for rank in (0, 1):
            found = sorted(logs.glob(f"*/attempt_*/{rank}/stdout.log"))
            assert found, f"no output of rank {rank} under {logs}; torchrun said:\n{err}"
            by_rank[rank] = pytest.LineMatcher(found[-1].read_text().splitlines())
        return proc.returncode, by_rank

    return finish


@background("launched_passing")
def start_launched_passing(
    tmp_path_factory: pytest.TempPathFactory, procs: list[subprocess.Popen[str]]
) -> Callable[[], tuple[int, dict[int, pytest.LineMatcher]]]:
    return start_torchrun(
        tmp_path_factory.mktemp("launched"), procs, "test_launched.py", "-k", "in_a_child"
    )


@background("launched_failing")
def start_launched_failing(
    tmp_path_factory: pytest.TempPathFactory, procs: list[subprocess.Popen[str]]
) -> Callable[[], tuple[int, dict[int, pytest.LineMatcher]]]:
    return start_torchrun(
        tmp_path_factory.mktemp("launched"),
        procs,
        "test_launched.py",
        "-k",
        "failure or unpicklable",
    )


@pytest.fixture(scope="module")
def launched_passing(
    started: Background,
) -> tuple[int, dict[int, pytest.LineMatcher]]:
    return started.result("launched_passing")


@pytest.fixture(scope="module")
def launched_failing(
    started: Background,
) -> tuple[int, dict[int, pytest.LineMatcher]]:
    return started.result("launched_failing")


def test_under_torchrun_every_ranks_pytest_passes(
    launched_passing: tuple[int, dict[int, pytest.LineMatcher]],
) -> None:
    returncode, ranks_output = launched_passing
    for output in ranks_output.values():
        output.fnmatch_lines(
            [
                "*ranks: external launcher (a child rank per launched process)*",
                "*= 1 passed, 2 deselected in *",
            ]
        )
    assert returncode == 0


def test_under_torchrun_a_check_failing_on_one_rank_fails_on_every_rank(
    launched_failing: tuple[int, dict[int, pytest.LineMatcher]],
) -> None:
    returncode, ranks_output = launched_failing
    for output in ranks_output.values():
        output.fnmatch_lines(
            [
                "*RankFailure: check '*_raise_on_rank1' failed on 2 ranks: rank 0 passed, *",
                "*ValueError: only rank 1 fails",
            ]
        )
        # An unpicklable value on one rank is that rank's error: a failure, not a hang.
        output.fnmatch_lines(
            [
                "*RankFailure: check '*_unpicklable_on_rank1' failed on 2 ranks: rank 0 passed, *",
                "*the check returned a value that cannot be pickled*",
            ]
        )
        output.fnmatch_lines(
            [
                "FAILED test_launched.py::test_failure_on_one_rank*",
                "FAILED test_launched.py::test_unpicklable_value_on_one_rank*",
                "*= 2 failed, 1 deselected in *",
            ]
        )
    assert returncode != 0
