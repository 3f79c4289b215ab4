"""Launches of two nodes on this machine: two torchrun agents (``--nnodes 2 --nproc-per-node 1``,
c10d rendezvous on a free local port), or two srun-style tasks started by hand.

Each launch is narrowed with ``--checks`` to seconds of work. What a multi-node user expects:
one report listing every planned check; a launched pytest session with the same verdict on
every node; a rank that hangs or whose process is killed mid-check costs that check only (one
failed row, every planned check in the report, both agents exit with the same code); a node
lost for good ends the run on the survivors, with the lost rank and the checks not run in the
report. The faults are test-only checks from ``tests/injected_checks.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import injected_checks
import pytest

from fsdp_conformance.gate import report as gate_report

pytestmark = pytest.mark.process

#: A guard on each launch (not a timing assertion): the narrowed runs take seconds.
LAUNCH_LIMIT_S = 300
#: A guard on waiting for a check's marker files.
MARKER_LIMIT_S = 120
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GITHUB_STEP_SUMMARY",
    "MALLOC_MMAP_THRESHOLD_",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_environ(directory: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its launch, plugin and srun settings, with this
    session's import path and the test-only checks."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FSDP_CONFORMANCE_", "PYTEST_", "TORCHELASTIC_", "SLURM_"))
        and k not in LAUNCH_VARIABLES
    }
    paths = [*injected_checks.site_path(directory), *(p for p in sys.path if p)]
    environ["PYTHONPATH"] = os.pathsep.join(paths)
    environ.update(extra or {})
    return environ


class Node:
    """One process started for a launch (a torchrun agent or an srun-style task), its console
    in ``directory/nodeN.out`` and ``.err``, its working directory ``directory/nodeN``."""

    def __init__(self, directory: Path, index: int, cmd: Sequence[str], env: dict[str, str]):
        self.index = index
        self.cwd = directory / f"node{index}"
        self.cwd.mkdir()
        self.out_path = directory / f"node{index}.out"
        self.err_path = directory / f"node{index}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                list(cmd), cwd=self.cwd, env=env, stdout=out, stderr=err, text=True
            )

    @property
    def console(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()

    def wait(self) -> int:
        try:
            return self.proc.wait(LAUNCH_LIMIT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"node {self.index} ran over {LAUNCH_LIMIT_S}s:\n{self.console}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it: a node taken away at once."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(children(p))
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def torchrun_agents(directory: Path, args: Sequence[str]) -> list[Node]:
    """Two torchrun agents of one launch (one rank each), the first started first."""
    port = free_port()
    env = clean_environ(directory)
    nodes = []
    for index in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"fsdpc-{port}",
            *args,
        ]
        nodes.append(Node(directory, index, cmd, env))
        time.sleep(1.0)  # the first agent hosts the rendezvous store
    return nodes


def run_args(checks: str, *more: str) -> list[str]:
    return ["-m", "fsdp_conformance.cli", "run", "--checks", checks, "--out", "../out", *more]


def wait_all(nodes: Sequence[Node]) -> list[int]:
    try:
        return [node.wait() for node in nodes]
    finally:
        for node in nodes:
            node.stop()


def consoles(nodes: Sequence[Node]) -> str:
    return "\n".join(f"--- node {n.index} ---\n{n.console}" for n in nodes)


def report_of(directory: Path) -> dict[str, Any]:
    return gate_report.load_report(str(directory / "out" / "report.json"))


def rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(e["check"], e["outcome"]) for e in report["checks"]]


def rank0_node(nodes: Sequence[Node]) -> Node:
    """The node whose rank is 0: the one that printed the table."""
    (node,) = [n for n in nodes if "report: ../out/report.json" in n.out_path.read_text()]
    return node


def test_a_two_node_run_passes_with_one_report_of_every_planned_check(tmp_path: Path) -> None:
    nodes = torchrun_agents(tmp_path, run_args("loop.clipping.l2"))
    codes = wait_all(nodes)
    told = consoles(nodes)
    assert codes == [0, 0], told
    report = report_of(tmp_path)
    assert rows(report) == [
        ("loop.clipping.l2", "passed"),
        ("loop.clipping.l2", "passed"),
    ], told
    assert report["settings"]["world_sizes"] == [2]
    # one table, on rank 0's node; every node names where the report is
    first = rank0_node(nodes)
    host = socket.gethostname()
    where = f"the report is on {host}:{tmp_path / 'out' / 'report.json'}"
    for node in nodes:
        assert where in node.err_path.read_text(), told
    other = next(n for n in nodes if n is not first)
    assert "check " not in other.out_path.read_text(), told
    # each node writes only its own rank's log into the shared --out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "rank1.log",
        "report.json",
        "summary.md",
    ]
    log = (tmp_path / "out" / "rank1.log").read_text().splitlines()
    assert log[-1] == "exit 0 (the worst of every rank's: rank 0 0, rank 1 0)", told


NODES_SESSION = """
import pytest


def _sum(ctx):
    import torch
    import torch.distributed as dist

    t = torch.tensor([ctx.rank + 1])
    dist.all_reduce(t)
    return int(t.item())


def _fails_on_rank1(ctx):
    if ctx.rank == 1:
        raise RuntimeError("failure injected on rank 1")
    return ctx.rank


@pytest.mark.world_size(2)
def test_sum(ranks):
    assert ranks.run(_sum) == [3, 3]


@pytest.mark.world_size(2)
def test_fails_on_rank1(ranks):
    ranks.run(_fails_on_rank1)


@pytest.mark.world_size(2)
def test_after(ranks):
    assert ranks.run(_sum) == [3, 3]
"""


def test_a_two_node_pytest_session_reaches_the_same_verdict_on_every_node(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_nodes.py").write_text(NODES_SESSION)
    args = [
        "-m",
        "pytest",
        "-m",
        "cpu",
        "-p",
        "no:cacheprovider",
        "-q",
        "--rootdir",
        str(tmp_path),
        str(tmp_path / "test_nodes.py"),
    ]
    nodes = torchrun_agents(tmp_path, args)
    codes = wait_all(nodes)
    told = consoles(nodes)
    assert codes == [1, 1], told  # pytest's "tests failed", on both agents
    for node in nodes:
        out = node.out_path.read_text()
        assert "1 failed, 2 passed" in out, told
        assert "rank 0 passed, rank 1 raised" in out, told


def test_a_hang_on_one_nodes_rank_costs_that_check_only(tmp_path: Path) -> None:
    nodes = torchrun_agents(tmp_path, run_args("test.hang", "--timeout", "5"))
    codes = wait_all(nodes)
    told = consoles(nodes)
    assert codes == [1, 1], told
    report = report_of(tmp_path)
    assert rows(report) == [
        (injected_checks.HANG_ON_RANK1, "error"),
        (injected_checks.HANG_THEN, "passed"),
    ], told
    hang = report["checks"][0]
    story = hang["traceback"]
    assert "rank 0 did not finish, rank 1 did not finish" in story, story
    assert " in rank_hangs_on_rank1" in story, story  # rank 1's stack, where it sleeps
    log = (tmp_path / "out" / "rank1.log").read_text().splitlines()
    assert log[-1] == "exit 1 (the worst of every rank's: rank 0 1, rank 1 1)", told


def test_a_rank_killed_mid_check_costs_that_check_only(tmp_path: Path) -> None:
    nodes = torchrun_agents(tmp_path, run_args("test.dies"))
    codes = wait_all(nodes)
    told = consoles(nodes)
    assert codes == [1, 1], told
    report = report_of(tmp_path)
    assert rows(report) == [
        (injected_checks.DIES_ON_RANK1, "error"),
        (injected_checks.DIES_THEN, "passed"),
    ], told
    story = report["checks"][0]["traceback"]
    assert "--- rank 1: died ---" in story, story
    assert "killed by SIGKILL" in story, story


def test_a_node_lost_for_good_ends_the_run_on_the_survivor_with_a_report(
    tmp_path: Path,
) -> None:
    nodes = torchrun_agents(tmp_path, run_args("test.lost", "--timeout", "60"))
    try:
        deadline = time.monotonic() + MARKER_LIMIT_S
        markers = [injected_checks.marker(n.cwd, rank) for n in nodes for rank in (0, 1)]
        while sum(m.exists() for m in markers) < 2:
            assert all(n.proc.poll() is None for n in nodes), consoles(nodes)
            assert time.monotonic() < deadline, consoles(nodes)
            time.sleep(0.2)
        (lost,) = [n for n in nodes if injected_checks.marker(n.cwd, 1).exists()]
        survivor = next(n for n in nodes if n is not lost)
        lost.stop()  # the agent, its launched process and that one's children, at once
        code = survivor.wait()
    finally:
        for node in nodes:
            node.stop()
    told = consoles(nodes)
    assert code == 1, told
    report = report_of(tmp_path)
    assert rows(report) == [
        (injected_checks.NODE_LOST, "error"),
        (injected_checks.NODE_LOST_THEN, "error"),
    ], told
    first, then = report["checks"]
    assert "rank 1 (on " in first["traceback"] and " was lost: " in first["traceback"], told
    assert then["message"].startswith("HarnessError: not run: the launch lost rank 1"), told


def test_an_srun_style_launch_of_two_tasks_started_by_hand(tmp_path: Path) -> None:
    # What srun gives each task (and its user sets for the store); no RANK, no torchrun.
    port = free_port()
    nodes = []
    for rank in (0, 1):
        env = clean_environ(
            tmp_path,
            {
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_NTASKS": "2",
                "SLURM_JOB_ID": "4242",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        cmd = [sys.executable, *run_args(injected_checks.ALL_REDUCE)]
        nodes.append(Node(tmp_path, rank, cmd, env))
    codes = wait_all(nodes)
    told = consoles(nodes)
    assert codes == [0, 0], told
    assert rows(report_of(tmp_path)) == [(injected_checks.ALL_REDUCE, "passed")], told
    assert "report: ../out/report.json" in nodes[0].out_path.read_text(), told
