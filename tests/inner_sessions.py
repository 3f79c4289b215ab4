"""Inner pytest sessions for the harness's tests: start one in a folder, wait for it, and find
the rank processes it left (shared by ``test_harness.py`` and ``test_harness_sessions.py``);
whether a process has exited (``test_harness.py``, ``test_forkserver.py``)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest


def inner_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without anything that would steer an inner session."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FSDP_CONFORMANCE_", "PYTEST_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(extra or {})
    return env


#: Wall-clock limit for one inner pytest session (a guard, not a timing assertion).
SESSION_LIMIT_S = 300

WORKER_MODULE = "fsdp_conformance.harness.worker"


def start_session(
    directory: Path, args: Sequence[str], env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args],
        cwd=directory,
        env=inner_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@dataclasses.dataclass
class Session:
    """A finished inner pytest session: where it ran, its pid and its result."""

    directory: Path
    pid: int
    result: pytest.RunResult


def finish_session(proc: subprocess.Popen[str], directory: Path) -> Session:
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=SESSION_LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"inner pytest session ran over {SESSION_LIMIT_S}s:\n{out}")
    result = pytest.RunResult(proc.returncode, out.splitlines(), [], time.monotonic() - start)
    return Session(directory, proc.pid, result)


def rank_processes_of(session: Session) -> list[str]:
    """Live rank processes of a session: started by its pid, or in its folder (xdist workers)."""
    pattern = re.compile(rf"'parent_pid': {session.pid}\b")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:  # the process ended while we looked, or is not ours to read
            continue
        if WORKER_MODULE in cmdline and (
            pattern.search(cmdline) or Path(cwd) == session.directory.resolve()
        ):
            found.append(f"{entry.name}: {cmdline}")
    return found


def failure_section(result: pytest.RunResult, test_name: str) -> pytest.LineMatcher:
    """The lines of one test's failure report (from its ``___ name ___`` header to the next)."""
    lines = result.outlines
    header = re.compile(rf"^_+ {re.escape(test_name)}(\[.*\])? _+$")
    starts = [i for i, line in enumerate(lines) if header.match(line)]
    assert starts, f"no failure section for {test_name}:\n" + "\n".join(lines)
    end = starts[0] + 1
    while end < len(lines) and not re.match(r"^(_{3,} \S.* _{3,}|={3,} .* ={3,})$", lines[end]):
        end += 1
    return pytest.LineMatcher(lines[starts[0] : end])


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited: gone, or a zombie with no thread left.

    A zombie leader whose other threads are still dying (the aborting thread, say) is not yet
    reported to ``waitpid``: its parent still sees it running.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    state = fields.get("State", "").split()[:1]
    return state in (["Z"], ["X"]) and fields.get("Threads", "1").strip() == "1"
