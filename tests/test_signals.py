"""SIGTERM and SIGINT: a message, no rank process and no rank folder left, exit 128 + N.

Fault injection on real subprocesses: ``fsdp-conformance run`` (and a pytest session) is
started with a private ``TMPDIR``, signalled once its rank processes exist (a check is
running), and then the exit code, the message, the rank processes (by pid) and the rank
folders (``fsdp-conformance-ranks-*`` in that ``TMPDIR``) are checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from fsdp_conformance import harness
from fsdp_conformance.harness import interrupts

#: Guards on the subprocesses (not timing assertions).
START_LIMIT_S = 180
EXIT_LIMIT_S = 60
WORKER_MODULE = b"fsdp_conformance.harness.worker"


def clean_env(tmpdir: Path) -> dict[str, str]:
    env = {
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
        )
    }
    env["TMPDIR"] = str(tmpdir)
    return env


def rank_pids(parent: int) -> list[int]:
    """Live rank processes started by ``parent`` (their spec names the parent's pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if WORKER_MODULE in cmdline and f"'parent_pid': {parent},".encode() in cmdline:
            found.append(int(entry.name))
    return found


def still_alive(pids: Sequence[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if WORKER_MODULE in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.append(pid)
        except OSError:
            pass  # gone
    return alive


def signal_when_ranks_run(
    proc: subprocess.Popen[str], signums: Sequence[int], gap_s: float = 0.02
) -> list[int]:
    """Wait until ``proc`` has its rank processes, send ``signums``; return the ranks' pids."""
    deadline = time.monotonic() + START_LIMIT_S
    pids: list[int] = []
    while len(pids) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no rank processes appeared (exit {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.05)
        pids = rank_pids(proc.pid)
    time.sleep(0.5)  # the ranks joined their group and hold a check (or are about to)
    for signum in signums:
        os.kill(proc.pid, signum)
        time.sleep(gap_s)
    return pids


def finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=EXIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running {EXIT_LIMIT_S}s after the signal:\n{out}\n{err}")


def as_from_a_terminal() -> None:
    """``preexec_fn`` of the runs and sessions signalled here: SIGINT at its default, as in a
    process a terminal starts. A process started while SIGINT is ignored keeps it ignored (the
    suite honours that: ``interrupts.install``), and in the whole lane this test's children
    were once started so (the runs ignored SIGINT, not SIGTERM, although this process's Python
    handler was never changed: see the session note); what is tested here is the run's answer
    to a signal it can receive. Also printed: this process's ignored-signal mask at the start."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ignored_here() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return line
    return "SigIgn: unknown"


def start_run(tmp_path: Path, extra: Sequence[str] = ()) -> tuple[subprocess.Popen[str], Path]:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    # Checks that train: each takes long enough on a busy machine to be signalled mid-way.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fsdp_conformance.cli",
            "run",
            "--checks",
            "wrap.train",
            "--out",
            str(tmp_path / "out"),
            *extra,
        ],
        cwd=tmp_path,
        env=clean_env(tmpdir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    print(f"run {tmp_path.name} started; this process's {ignored_here()}")
    return proc, tmpdir


def assert_cleaned_up(pids: Sequence[int], tmpdir: Path) -> None:
    assert still_alive(pids) == [], "rank processes outlived the run"
    assert sorted(p.name for p in tmpdir.glob("fsdp-conformance-ranks-*")) == []


#: The interrupted runs: the signal, how many times it is sent, and the exit code expected.
RUNS = {
    "sigterm": (signal.SIGTERM, 1, 143),
    "sigint": (signal.SIGINT, 1, 130),
    "sigint-twice": (signal.SIGINT, 2, 130),
    "sigint-five-times": (signal.SIGINT, 5, 130),
}


@dataclasses.dataclass
class Interrupted:
    """A run signalled once its ranks existed, after it exited."""

    tmp_path: Path
    tmpdir: Path
    pids: list[int]
    returncode: int
    out: str
    err: str


def signal_each_when_its_ranks_run(
    procs: Mapping[str, subprocess.Popen[str]],
    signals: Mapping[str, Sequence[int]],
    gap_s: float = 0.02,
) -> dict[str, list[int]]:
    """:func:`signal_when_ranks_run` for several runs at once, each on its own clock."""
    deadline = time.monotonic() + START_LIMIT_S
    found: dict[str, tuple[float, list[int]]] = {}
    signalled: dict[str, list[int]] = {}
    while len(signalled) < len(procs):
        for name, proc in procs.items():
            if name in signalled:
                continue
            if name not in found:
                if proc.poll() is not None or time.monotonic() > deadline:
                    for other in procs.values():
                        other.kill()
                    out, err = proc.communicate()
                    pytest.fail(
                        f"{name}: no rank processes appeared (exit {proc.returncode}):"
                        f"\n{out}\n{err}"
                    )
                pids = rank_pids(proc.pid)
                if len(pids) >= 2:
                    found[name] = (time.monotonic(), pids)
            # As signal_when_ranks_run: the ranks joined their group and hold a check (or are
            # about to) 0.5 s after they appeared.
            elif time.monotonic() >= found[name][0] + 0.5:
                for i, signum in enumerate(signals[name]):
                    if i:
                        time.sleep(gap_s)
                    os.kill(proc.pid, signum)
                signalled[name] = found[name][1]
        time.sleep(0.05)
    return signalled


@pytest.fixture(scope="module")
def interrupted_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Interrupted]]:
    """The selected runs of RUNS, started together and each signalled once its ranks exist.

    Each run is mostly one process importing torch, on one core: started together on a 2-core
    machine they take about the CPU time they need, one after another the sum of their wall
    times. Each is signalled on its own clock, as one started alone would be.
    """
    # A pytest-xdist worker runs only some of the tests it collected: there each test runs
    # its own, so no worker starts another's.
    needed = (
        []
        if hasattr(request.config, "workerinput")
        else [
            name
            for name in RUNS
            if any(
                getattr(item, "callspec", None) is not None
                and item.callspec.params.get("run") == name  # type: ignore[attr-defined]
                and getattr(item, "module", None) is request.module
                for item in request.session.items
            )
        ]
    )
    started = {name: start_run(tmp_path_factory.mktemp(name)) for name in needed}
    procs = {name: proc for name, (proc, _) in started.items()}
    try:
        pids = signal_each_when_its_ranks_run(
            procs, {name: [RUNS[name][0]] * RUNS[name][1] for name in needed}
        )
        runs = {}
        for name, (proc, tmpdir) in started.items():
            runs[name] = finished(proc, tmpdir, pids[name])
        yield runs
    finally:
        for proc in procs.values():  # a run cut short leaves none behind
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def finished(proc: subprocess.Popen[str], tmpdir: Path, pids: list[int]) -> Interrupted:
    out, err = finish(proc)
    return Interrupted(tmpdir.parent, tmpdir, pids, proc.returncode, out, err)


@pytest.mark.process
@pytest.mark.parametrize("run", list(RUNS))
def test_run_interrupted_exits_128_plus_n_and_leaves_no_rank_or_folder(
    interrupted_runs: dict[str, Interrupted], run: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    signum, count, code = RUNS[run]
    got = interrupted_runs.get(run)
    if got is None:  # not started with the others (a pytest-xdist worker): alone
        # Named after the run, not the test: the rank sockets live under TMPDIR, and a unix
        # socket's path has at most 107 bytes.
        proc, tmpdir = start_run(tmp_path_factory.mktemp(run))
        got = finished(proc, tmpdir, signal_when_ranks_run(proc, [signum] * count))
    err = got.err
    assert got.returncode == code, err
    name = signal.Signals(signum).name
    assert (
        f"fsdp-conformance run: interrupted by {name}; rank processes stopped and their "
        f"folders removed; no report written (exit {code})"
    ) in err.splitlines()
    assert "Traceback" not in err and "Exception ignored" not in err
    assert got.out == ""  # no table: nothing was decided
    assert not (got.tmp_path / "out" / "report.json").exists()
    assert_cleaned_up(got.pids, got.tmpdir)


SLOW_TEST = """
import time

import pytest

pytestmark = pytest.mark.cpu


def _sleep(ctx):
    time.sleep(120)


def test_sleeps_on_the_ranks(ranks):
    ranks.run(_sleep)
"""


@pytest.mark.process
def test_pytest_session_sigterm_exits_143_and_leaves_no_rank_or_folder(tmp_path: Path) -> None:
    (tmp_path / "test_slow.py").write_text(SLOW_TEST)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "test_slow.py",
            "--basetemp",
            str(tmp_path / "basetemp"),
        ],
        cwd=tmp_path,
        env=clean_env(tmpdir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_from_a_terminal,
    )
    pids = signal_when_ranks_run(proc, [signal.SIGTERM])
    out, err = finish(proc)
    assert proc.returncode == 143, out + err
    assert "Interrupted: SIGTERM" in out, out
    assert_cleaned_up(pids, tmpdir)


def test_interrupt_handler_raises_once_then_only_records() -> None:
    handler = interrupts.InterruptHandler()
    with pytest.raises(interrupts.Interrupted) as info:
        handler(signal.SIGTERM, None)
    assert info.value.exit_code == 143 and info.value.name == "SIGTERM"
    assert isinstance(info.value, KeyboardInterrupt)  # `except Exception` cannot swallow it
    handler(signal.SIGINT, None)  # during the cleanup: recorded, not raised
    assert handler.received == [signal.SIGTERM, signal.SIGINT]
    first = handler.first
    assert first is not None and first.exit_code == 143  # the first signal decides the code


def test_a_signal_ignored_at_start_stays_ignored() -> None:
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        installed = interrupts.install((signal.SIGUSR2,))
        assert installed is not None and installed[1] == {}
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_launched_rank_interrupted_while_joining_the_group_names_itself(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # torchrun's SIGTERM can reach a launched process before the harness session has made its
    # LaunchSupervisor: it is still one of the launch's ranks, with no pool.
    from fsdp_conformance import cli
    from fsdp_conformance.harness import session as session_module

    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        monkeypatch.setenv(key, value)
    session = harness.HarnessSession(owns_exit=True)
    assert not session.launched
    # What the interrupt would stop: recorded, not done (this process's pools are the session's
    # warm pools, shared by the tests after this one).
    closed: list[bool] = []
    monkeypatch.setattr(session_module, "close_all_pools", lambda: closed.append(True))
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = cli._interrupted("run", interrupts.Interrupted(signal.SIGTERM), session)
    finally:
        for signum, handler in saved.items():  # _interrupted ignores both from then on
            signal.signal(signum, handler)
    assert code == 143 and closed == [True]
    assert (
        "interrupted by SIGTERM; rank 1 of the launch stopped; no report written (exit 143)"
        in capsys.readouterr().err
    )
