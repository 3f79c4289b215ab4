"""``fsdp-conformance run`` under torchrun, as torchrun users expect.

Real ``torchrun --nproc-per-node 2`` launches, each narrowed with ``--checks`` to seconds:
rank 0 prints the progress and the table and writes the report, rank 1 writes
``DIR/rank1.log``; each launched process supervises a child rank that runs the checks, so a
check that needs an allocator setting at process start runs (its children start with it,
whether the launch has it or not); a failure on rank 1 only is every rank's failure and every
rank's exit code. Two completed launches serve those tests (the one with the allocator setting
also runs two test-only checks from ``tests/injected_checks.py``: the environment each rank's
process started with, and one that fails on rank 1); a launched pytest session whose check
never returns on rank 1 fails that test and goes on; two more launches are interrupted
(SIGTERM to torchrun, Ctrl-C in a launched pytest session). Launches of two nodes are in
``tests/test_launch_nodes.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import injected_checks
import pytest

from fsdp_conformance.gate import report as gate_report
from fsdp_conformance.gate import suite
from fsdp_conformance.settings import Settings, SettingsError

#: A guard on each launch (not a timing assertion): the narrowed runs take seconds.
LAUNCH_LIMIT_S = 300
TABLE_HEADER = ["check", "outcome", "key", "figures"]
MALLOC = "MALLOC_MMAP_THRESHOLD_"


class Launch:
    def __init__(self, directory: Path, proc: subprocess.CompletedProcess[str]) -> None:
        self.directory = directory
        self.out = directory / "out"
        self.proc = proc

    @property
    def report(self) -> dict[str, Any]:
        return gate_report.load_report(str(self.out / "report.json"))

    @property
    def rank1_log(self) -> list[str]:
        return (self.out / "rank1.log").read_text().splitlines()

    def explain(self) -> str:
        return f"stdout:\n{self.proc.stdout}\nstderr:\n{self.proc.stderr}"


class Running:
    """A launch under way; ``wait()`` gives its :class:`Launch`."""

    def __init__(self, directory: Path, cmd: list[str], proc: subprocess.Popen[str]) -> None:
        self.directory = directory
        self.cmd = cmd
        self.proc = proc

    def wait(self) -> Launch:
        try:
            out, err = self.proc.communicate(timeout=LAUNCH_LIMIT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"torchrun ran over {LAUNCH_LIMIT_S}s: {' '.join(self.cmd)}")
        return Launch(
            self.directory, subprocess.CompletedProcess(self.cmd, self.proc.returncode, out, err)
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def start_launch(
    directory: Path,
    checks: str,
    env: Mapping[str, str] | None = None,
    pythonpath: Sequence[str] = (),
    stderr: IO[str] | int = subprocess.PIPE,
) -> Running:
    """Start ``torchrun --standalone --nproc-per-node 2 -m fsdp_conformance.cli run`` in
    ``directory`` (its stderr to ``stderr``)."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FSDP_CONFORMANCE_", "PYTEST_", "TORCHELASTIC_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GITHUB_STEP_SUMMARY",
            MALLOC,
        )
    }
    environ["PYTHONPATH"] = os.pathsep.join([*pythonpath, *(p for p in sys.path if p)])
    environ.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "fsdp_conformance.cli",
        "run",
        "--checks",
        checks,
        "--out",
        "out",
    ]
    proc = subprocess.Popen(
        cmd, cwd=directory, env=environ, stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    return Running(directory, cmd, proc)


def _start_without_malloc(tmp_path_factory: pytest.TempPathFactory) -> Running:
    """The two init peak checks (they need MALLOC_MMAP_THRESHOLD_ at start), launched without."""
    return start_launch(tmp_path_factory.mktemp("without"), "init.peak_memory")


def _start_with_malloc_and_a_failure_on_rank1(tmp_path_factory: pytest.TempPathFactory) -> Running:
    """The same two checks launched with the setting, and (selected by the same
    ``--checks init.peak_memory``) the test-only ``init.peak_memory.launch_environment`` and
    ``init.peak_memory.injected_failure`` (raises on rank 1 only)."""
    directory = tmp_path_factory.mktemp("with")
    return start_launch(
        directory, "init.peak_memory", {MALLOC: "65536"}, injected_checks.site_path(directory)
    )


#: The launches below, by the name of the fixture that gives each.
LAUNCHES = {
    "without_malloc": _start_without_malloc,
    "with_malloc_and_a_failure_on_rank1": _start_with_malloc_and_a_failure_on_rank1,
}


@pytest.fixture(scope="module", autouse=True)
def launches(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Running]]:
    """Starts at once the launches this module's selected tests need.

    Each launch is three processes importing torch plus torchrun's rendezvous and monitoring
    waits: together on a 2-core machine they take about the CPU time they need, one after
    another the sum of their wall times. They start with the module's first test (autouse),
    so that the in-process tests, which come first, run while they do. Each fixture below
    waits for its own.
    """
    # A pytest-xdist worker runs only some of the tests it collected: there each fixture
    # starts its own launch when asked, so no worker starts another's.
    needed = (
        set()
        if hasattr(request.config, "workerinput")
        else {
            name
            for item in request.session.items
            if getattr(item, "module", None) is request.module
            for name in getattr(item, "fixturenames", ())
        }
    )
    started = {name: start(tmp_path_factory) for name, start in LAUNCHES.items() if name in needed}
    try:
        yield started
    finally:
        for running in started.values():  # a run cut short leaves no torchrun behind
            running.stop()


def _wait_for(
    name: str, launches: dict[str, Running], tmp_path_factory: pytest.TempPathFactory
) -> Launch:
    """The launch ``name`` once it has ended; started now if the module start skipped it."""
    if name not in launches:
        launches[name] = LAUNCHES[name](tmp_path_factory)
    return launches[name].wait()


@pytest.fixture(scope="module")
def without_malloc(
    launches: dict[str, Running], tmp_path_factory: pytest.TempPathFactory
) -> Launch:
    """``torchrun ... run --checks init.peak_memory``, without MALLOC_MMAP_THRESHOLD_: read by
    the rank-0-speaks test and the skip test."""
    return _wait_for("without_malloc", launches, tmp_path_factory)


@pytest.fixture(scope="module")
def with_malloc_and_a_failure_on_rank1(
    launches: dict[str, Running], tmp_path_factory: pytest.TempPathFactory
) -> Launch:
    """``MALLOC_MMAP_THRESHOLD_=65536 torchrun ... run --checks init.peak_memory`` with the two
    test-only checks: read by the runs-in-process test (the two real checks), the
    launch-provides-an-environment test (``launch_environment``) and the failure-on-rank-1
    test (``injected_failure``, the exit codes)."""
    return _wait_for("with_malloc_and_a_failure_on_rank1", launches, tmp_path_factory)


# --------------------------------------------------------------------------------------------
# In process: world sizes under a launcher
# --------------------------------------------------------------------------------------------


def test_launch_world_size_replaces_the_default_and_must_be_in_explicit_ones() -> None:
    default = Settings(sources={"world_sizes": "default"})
    assert suite.launch_settings(default, 4).world_sizes == (4,)
    explicit = Settings(world_sizes=(2, 4), sources={"world_sizes": "command line --world-sizes"})
    assert suite.launch_settings(explicit, 4) is explicit
    with pytest.raises(SettingsError) as info:
        suite.launch_settings(explicit, 3)
    assert str(info.value) == (
        "world sizes 2,4 (from command line --world-sizes) do not include this launch's "
        "WORLD_SIZE=3; launch 2 ranks (torchrun --nproc-per-node 2) or drop the world-size "
        "setting"
    )


def test_a_launched_run_runs_the_command_lines_plan_at_the_launchs_world_size() -> None:
    # The plan is made once, before the launch is joined; the launch changes only its world size.
    plan = suite.plan_suite(Settings(), ["cpu"], pattern="wrap.units.exact")
    launched = plan.for_launch(4)
    assert launched.selected is plan.selected and launched.spec is plan.spec
    assert launched.lanes == plan.lanes and launched.world_sizes == (4,)
    assert {ws for _, ws, _, _ in launched.runs} == {4}
    assert len(launched.runs) == len(plan.selected) > 0


def test_an_srun_task_with_the_stores_address_is_a_launch() -> None:
    from fsdp_conformance.harness.launcher import launch_environment, ranks_on_this_node

    srun = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "3",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
    }
    launch = launch_environment(srun)
    assert launch is not None
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 8, 1)
    assert (launch.master_addr, launch.master_port) == ("node0", 29500)
    assert launch.local_world_size == 4 and not launch.agent_store and launch.run_id == "77.3"
    assert ranks_on_this_node(srun) == (4, "SLURM_NTASKS_PER_NODE=4")
    # a shell inside an allocation, or a task whose user set no store address: not a launch
    without_port = {k: v for k, v in srun.items() if k != "MASTER_PORT"}
    assert launch_environment(without_port) is None
    # a step of one task (srun -n1 pytest ..., the cluster's MASTER_* exported): its own pool
    assert launch_environment({**srun, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    # torchrun's variables come first (torchrun started under srun)
    torchrun = {**srun, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    torchrun["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    launched = launch_environment(torchrun)
    assert launched is not None and (launched.rank, launched.world_size) == (0, 2)
    assert launched.agent_store


def test_a_checks_exchange_keeps_the_first_failure_and_reads_every_rank() -> None:
    import torch.distributed as dist

    from fsdp_conformance.harness import RankOutcome
    from fsdp_conformance.harness.supervisor import CheckExchange

    store = dist.HashStore()
    ranks = [CheckExchange(store, 4, rank, 3) for rank in range(3)]
    assert ranks[0].first_failure() is None and ranks[0].missing() == [0, 1, 2]
    ranks[2].publish("mod.check", RankOutcome(2, "error", detail="boom"))
    ranks[0].publish("mod.check", RankOutcome(0, "ok", value=0))
    ranks[1].publish("mod.check", RankOutcome(1, "hung", detail="released"))
    first = ranks[0].first_failure()
    assert first is not None and (first.rank, first.status) == (2, "error")  # the first only
    assert ranks[1].published() == 3 and ranks[1].missing() == []
    read = ranks[1].read([0, 1, 2])
    assert [(name, o.rank, o.status) for name, o in read.values()] == [
        ("mod.check", 0, "ok"),
        ("mod.check", 1, "hung"),
        ("mod.check", 2, "error"),
    ]
    assert CheckExchange(store, 5, 0, 3).first_failure() is None  # the next check's keys


# --------------------------------------------------------------------------------------------
# Launched: the narrowed runs started together by ``launches``
# --------------------------------------------------------------------------------------------


@pytest.mark.process
def test_rank0_alone_prints_progress_and_table_and_writes_the_report(
    without_malloc: Launch,
) -> None:
    run = without_malloc
    assert run.proc.returncode == 0, run.explain()
    out = run.proc.stdout.splitlines()  # both ranks' stdout and stderr reach torchrun's
    err = run.proc.stderr.splitlines()
    assert [line.split() for line in out].count(TABLE_HEADER) == 1, run.explain()
    assert sum(line.startswith("fsdp-conformance: torch ") for line in err) == 1, run.explain()
    assert [line.split(" ... ")[0] for line in err if line.startswith("[")] == [
        "[1/2] init.peak_memory [cpu, ws2, fsdp1,massive]",
        "[2/2] init.peak_memory [cpu, ws2, fsdp2,massive]",
    ]
    assert "ranks: external launcher (a child rank per launched process)" in run.proc.stderr
    assert out[-3:] == [
        "report: out/report.json",
        "summary: out/summary.md",
        "other ranks' logs: out/rank1.log",
    ]
    assert sorted(p.name for p in run.out.iterdir()) == ["rank1.log", "report.json", "summary.md"]
    log = run.rank1_log
    assert log[0].startswith("fsdp-conformance: torch ")
    assert [line.split(" ... ")[0] for line in log if line.startswith("[")] == [
        "[1/2] init.peak_memory [cpu, ws2, fsdp1,massive]",
        "[2/2] init.peak_memory [cpu, ws2, fsdp2,massive]",
    ]
    assert [line.split() for line in log].count(TABLE_HEADER) == 1
    assert log[-1] == "exit 0 (the worst of every rank's: rank 0 0, rank 1 0)"


@pytest.mark.process
def test_a_check_needing_an_allocator_setting_runs_in_children_started_with_it(
    without_malloc: Launch,
) -> None:
    # The launch lacks the setting; each supervisor starts its rank's child of that check with
    # it (a generation of its own), as a pool starts fresh ranks.
    run = without_malloc
    report = run.report
    assert report["settings"]["world_sizes"] == [2]  # the launch's WORLD_SIZE
    assert report["summary"] == {"passed": 2, "failed": 0, "skipped": 0, "error": 0, "xfailed": 0}
    for entry in report["checks"]:
        ranks = entry["data"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1], run.explain()
        assert all(r["mmap_threshold"] == "65536" and r["meter"] == "VmHWM" for r in ranks)
    assert sum(" ... passed (" in line for line in without_malloc.rank1_log) == 2


@pytest.mark.process
def test_the_same_check_runs_when_the_launch_has_the_setting(
    with_malloc_and_a_failure_on_rank1: Launch,
) -> None:
    run = with_malloc_and_a_failure_on_rank1
    report = run.report
    entries = [e for e in report["checks"] if e["check"] == "init.peak_memory"]
    assert [(e["variant"], e["outcome"]) for e in entries] == [
        ("fsdp1,massive", "passed"),
        ("fsdp2,massive", "passed"),
    ], run.explain()
    # the launch's other checks are test-only: the launch's environment (next test) and the
    # injected failure (the one after): nothing else failed
    assert report["summary"] == {"passed": 3, "failed": 0, "skipped": 0, "error": 1, "xfailed": 0}
    for entry in entries:
        ranks = entry["data"]["ranks"]
        # measured on both ranks, in the launched processes, with the setting in place
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["mmap_threshold"] == "65536" and r["meter"] == "VmHWM" for r in ranks)


@pytest.mark.process
def test_a_checks_ranks_are_children_started_with_its_environment(
    with_malloc_and_a_failure_on_rank1: Launch,
) -> None:
    run = with_malloc_and_a_failure_on_rank1
    (entry,) = [e for e in run.report["checks"] if e["check"] == injected_checks.LAUNCH_ENVIRONMENT]
    assert entry["outcome"] == "passed", entry["message"]
    by_rank = entry["data"]["ranks"]
    assert [r["rank"] for r in by_rank] == [0, 1]
    for found in by_rank:
        # started with the check's variable (Check.env), which the launch never had ...
        assert found["at_start"] == "1", by_rank
        # ... in a child of the launched process, not the launched process itself
        assert found["launched_rank_variable"] is None, by_rank


@pytest.mark.process
def test_a_failure_on_rank1_only_is_in_rank0s_report_and_every_ranks_exit_code(
    with_malloc_and_a_failure_on_rank1: Launch,
) -> None:
    run = with_malloc_and_a_failure_on_rank1
    assert run.proc.returncode == 1, run.explain()
    report = run.report  # written by rank 0, whose own part of the check passed
    (entry,) = [e for e in report["checks"] if e["outcome"] == "error"]
    assert entry["check"] == injected_checks.FAILING_ON_RANK1
    # one line, every rank's story in the entry's traceback
    assert entry["message"].startswith("rank 1: RuntimeError in "), entry["message"]
    assert entry["message"].endswith(": failure injected on rank 1"), entry["message"]
    assert "failed on 2 ranks: rank 0 passed, rank 1 raised" in entry["traceback"]
    assert "RuntimeError: failure injected on rank 1" in entry["traceback"]
    assert run.rank1_log[-1] == "exit 1 (the worst of every rank's: rank 0 1, rank 1 1)"
    assert [line.split() for line in run.proc.stdout.splitlines()].count(TABLE_HEADER) == 1


def launched_pytest_session(
    directory: Path, name: str, source: str, *args: str, launch: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2 LAUNCH -m pytest ARGS NAME`` on a test file
    written from ``source`` in ``directory``, with this session's import path and none of its
    launch or plugin settings."""
    (directory / name).write_text(source)
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FSDP_CONFORMANCE_", "PYTEST_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *launch,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        *args,
        name,
    ]
    return subprocess.run(
        cmd,
        cwd=directory,
        env=environ,
        capture_output=True,
        text=True,
        timeout=LAUNCH_LIMIT_S,
        check=False,
    )


HANG_SESSION = """
import time


def _stuck_on_rank1(ctx):
    if ctx.rank == 1:
        time.sleep(600)  # never returns: rank 0 returns at once
    return ctx.rank


def _rank(ctx):
    return ctx.rank


def test_stuck(ranks):
    ranks.run(_stuck_on_rank1)


def test_after(ranks):
    assert ranks.run(_rank) == [0, 1]
"""


@pytest.mark.process
def test_a_check_stuck_in_a_launched_pytest_session_is_one_failed_test(tmp_path: Path) -> None:
    # A launched process supervises its rank's child: a child stuck past the check's timeout
    # is dumped (its stacks) and killed by its supervisor, every node's session fails that
    # test with every rank's story, and goes on to the next on a new generation of children.
    logs = tmp_path / "logs"
    done = launched_pytest_session(
        tmp_path,
        "test_hang.py",
        HANG_SESSION,
        "--fsdp-timeout",
        "3",
        launch=("--redirects", "1", "--log-dir", str(logs)),
    )
    # Each rank's stdout in its own file (torchrun --redirects 1): LOG_DIR/.../RANK/stdout.log.
    stdout = {int(p.parent.name): p.read_text() for p in logs.rglob("stdout.log")}
    told = done.stdout + done.stderr + "".join(stdout.values())
    assert done.returncode == 1, told  # pytest's "tests failed", not a watchdog's 124
    assert sorted(stdout) == [0, 1], told
    for rank in (0, 1):
        assert "1 failed, 1 passed" in stdout[rank], told
        assert "rank 0 passed, rank 1 did not finish" in stdout[rank], told
        assert "no result after the check's timeout of 3s" in stdout[rank], told
        # faulthandler's frames: rank 1's child where it is stuck
        assert " in _stuck_on_rank1" in stdout[rank], told


CTRL_C_SESSION = """
import os
import signal
import time
from pathlib import Path


def _ctrl_c(ctx):
    # What the terminal sends on Ctrl-C: SIGINT to every process of the launched process's
    # group (the launched process, its fork server and this child, which ignore it).
    os.killpg(os.getpgid(0), signal.SIGINT)
    time.sleep(30)


def test_interrupted(ranks):
    ranks.run(_ctrl_c)


def test_after(ranks):
    Path(f"after_rank{os.environ['RANK']}").write_text("ran")
"""


@pytest.mark.process
def test_ctrl_c_stops_a_pytest_session_that_torchrun_launched(tmp_path: Path) -> None:
    # Ctrl-C reaches each launched process (its child ignores it; its supervisor kills it): it
    # must end every rank's session (pytest's "KeyboardInterrupt", exit 2), not fail one test
    # and go on to the next.
    done = launched_pytest_session(tmp_path, "test_ctrl_c.py", CTRL_C_SESSION)
    told = done.stdout + done.stderr
    assert not sorted(p.name for p in tmp_path.glob("after_rank*")), told
    # pytest's banner for an interrupted session (torchrun may SIGTERM the other rank while it
    # tears down, so one banner is what is certain)
    assert "!!! KeyboardInterrupt !!!" in told, told
    assert "RankFailure" not in told, told
    assert done.returncode != 0, told


@pytest.mark.process
def test_sigterm_to_torchrun_stops_every_rank_mid_check_with_143(tmp_path: Path) -> None:
    # torchrun forwards SIGTERM to its launched processes and SIGKILLs those still alive after
    # its grace period. Each supervisor waits for its child in the check: the interrupt must
    # end it (its child killed), not become the check's error and the next check.
    # The check blocks until then (tests/injected_checks.py), so the signal finds every rank
    # in it, never between checks or after the run.
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        running = start_launch(
            tmp_path,
            injected_checks.BLOCKING,
            pythonpath=injected_checks.site_path(tmp_path),
            stderr=err_file,
        )
        proc = running.proc
        try:
            # Each rank in the check: it wrote its marker (rank 0 may start the check while
            # rank 1 is still joining the launch's group; a SIGTERM then finds rank 1 outside
            # the check).
            deadline = time.monotonic() + LAUNCH_LIMIT_S
            while not all(injected_checks.marker(tmp_path, rank).exists() for rank in (0, 1)):
                assert proc.poll() is None, err_path.read_text()
                assert time.monotonic() < deadline, err_path.read_text()
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            proc.wait(LAUNCH_LIMIT_S)
        finally:
            running.stop()
    err = err_path.read_text()
    for rank in (0, 1):
        assert (
            f"fsdp-conformance run: interrupted by SIGTERM; rank {rank} of the launch "
            "stopped; no report written (exit 143)"
        ) in err.splitlines(), err
    assert "forcefully exiting via 9" not in err  # no rank needed torchrun's SIGKILL
    assert not (tmp_path / "out" / "report.json").exists()
