"""Rank starts from the fork server (harness/forkserver.py): cheap, and like an exec start.

The warm pools of this session are forked (the ``ranks`` fixture's manager starts CPU pools
from its fork servers), so every harness test already runs on forked ranks; these tests pin what
the fork must preserve and what it must clean up, and what decides between fork and exec.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from inner_sessions import process_gone

from fsdp_conformance.harness import PoolManager, RankContext, RankPool, RankRequest, forkserver
from fsdp_conformance.harness.forkserver import (
    BASE_PRELOAD,
    WORKER_MODULE,
    ForkServers,
    fork_available,
    preload_modules,
    shared_servers,
)
from fsdp_conformance.harness.pool import prestart_fork_server

needs_fork = pytest.mark.skipif(
    not fork_available(),
    reason="this platform has no os.fork or no pidfds (Linux 5.3+): "
    "every rank is started with exec, which the other harness tests cover",
)


def _how_started(ctx: RankContext) -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "malloc": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "probe": os.environ.get("FSDP_CONFORMANCE_PROBE"),
        "cmdline": Path("/proc/self/cmdline").read_bytes().split(b"\0")[1:3],
    }


def _pid(ctx: RankContext) -> int:
    return os.getpid()


def _values(outcomes: list) -> list[dict]:
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), outcomes
    return [o.value for o in outcomes]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def _wait_gone(pids: list[int], limit_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + limit_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _run(
    manager: PoolManager, fn: Any, *args: Any, world_size: int = 2, **needs: Any
) -> list[dict]:
    """Every rank's value of ``fn(ctx, *args)`` on ``manager``'s gloo ranks (``needs``: the
    request's ``env`` or ``fresh``), with these tests' timeout."""
    request = RankRequest(world_size, lane="cpu", backend="gloo", timeout=60.0, **needs)
    return _values(manager.run_outcomes(request, fn, args, {}))


@pytest.mark.process
@needs_fork
def test_ranks_fork_from_one_server_per_environment_and_look_exec_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # ranks take the parent's folder at their start, not the server's
    manager = PoolManager()  # forks from this session's servers (the process's registry)
    try:
        two = _run(manager, _how_started)
        # A variable that changes from test to test (as PYTEST_CURRENT_TEST does) reaches the
        # ranks without a server of its own.
        monkeypatch.setenv("FSDP_CONFORMANCE_PROBE", "seen")
        one = _run(manager, _how_started, world_size=1)
        malloc = _run(manager, _how_started, world_size=1, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
        server = two[0]["ppid"]
        # Forked: the parent is the server, not this process; one server for both pools.
        assert server != os.getpid()
        assert {v["ppid"] for v in two + one} == {server}
        # Another environment, another server; that rank sees the variable from its start.
        assert malloc[0]["ppid"] not in (server, os.getpid())
        assert malloc[0]["malloc"] == "65536" and two[0]["malloc"] is None
        assert [v["probe"] for v in two + one] == [None, None, "seen"]
        for value in two + one + malloc:
            assert value["cwd"] == str(tmp_path) == value["path0"]  # as `python -m` there
            assert value["pythonpath"].split(os.pathsep) == [p for p in sys.path if p]
            assert value["cmdline"] == [b"-m", WORKER_MODULE.encode()]
        servers = {server, malloc[0]["ppid"]}
        ranks = [v["pid"] for v in two + one + malloc]
    finally:
        manager.close()
    # Closing the manager ends its ranks; the servers are the process's, not the manager's,
    # and so is an inner session's end (an in-process CLI run or pytest session). The end of
    # the outermost session closes them: test_harness_sessions.py's fault session finds no
    # server and no rank of its own left at its unconfigure, nor after it exited.
    assert _wait_gone(ranks) == [], "closing the manager left rank processes running"
    forkserver.begin_session()
    assert forkserver.end_session() == 0
    assert servers <= set(shared_servers().pids())
    assert all(_alive(pid) for pid in servers)


def _pid_and_env(ctx: RankContext, name: str) -> tuple[int, str | None]:
    return os.getpid(), os.environ.get(name)


def _threads(ctx: RankContext) -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.process  # the fresh ranks' environment needs a fork server of its own
@pytest.mark.world_size(2)
def test_fresh_processes_see_environment_set_before_start(ranks) -> None:
    warm = ranks.run(_pid)
    fresh = ranks.configured(env={"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "3"})
    seen = fresh.run(_pid_and_env, "MALLOC_MMAP_THRESHOLD_")
    assert [value for _, value in seen] == ["65536", "65536"]
    assert {pid for pid, _ in seen}.isdisjoint(warm)
    assert all(process_gone(pid) for pid, _ in seen)  # fresh ranks end with their check
    # A thread count the user set is theirs, on forked ranks too (torch was imported before
    # the fork and never reads the variable there): the share does not replace it.
    assert fresh.run(_threads) == [3, 3]
    # The warm pool neither saw the variable nor was replaced.
    assert [value for _, value in ranks.run(_pid_and_env, "MALLOC_MMAP_THRESHOLD_")] == [None, None]
    assert ranks.run(_pid) == warm


@needs_fork
def test_managers_of_one_process_share_one_server_per_environment() -> None:
    first, second = PoolManager(), PoolManager()
    try:
        one = _run(first, _how_started)
        other = _run(second, _how_started)
        server = one[0]["ppid"]
        assert server in shared_servers().pids()
        assert {v["ppid"] for v in one + other} == {server}  # one server, two managers' pools
        assert {v["pid"] for v in one}.isdisjoint(v["pid"] for v in other)
        first.close()
        assert _wait_gone([v["pid"] for v in one]) == [], "closing a manager left its ranks"
        # The other manager's warm pool (forked from the same server) is untouched.
        assert _alive(server)
        assert _run(second, _how_started) == other
    finally:
        first.close()
        second.close()


@pytest.mark.process
@needs_fork
def test_a_dead_server_takes_its_ranks_and_the_next_check_gets_fresh_ones() -> None:
    # A registry of its own: killing the process's shared server would take the session's warm
    # pools with it, which every later test would have to start again. Its servers import only
    # what these ranks need, not the session's transformers and test modules (two starts).
    servers = ForkServers(preload=BASE_PRELOAD)
    manager = PoolManager(fork_servers=servers)
    try:
        before = _run(manager, _how_started)
        os.kill(before[0]["ppid"], signal.SIGKILL)
        pids = [v["pid"] for v in before]
        # The ranks' parent-death signal: they do not outlive the server that forked them.
        assert _wait_gone(pids) == [], "ranks outlived their fork server"
        after = _run(manager, _how_started)
        assert {v["pid"] for v in after}.isdisjoint(pids)
        assert after[0]["ppid"] != before[0]["ppid"]  # a new server
        assert servers.pids() == [after[0]["ppid"]]
    finally:
        manager.close()
        servers.close()


def _loaded_at_start(ctx: RankContext, name: str) -> bool:
    return name in sys.modules


@pytest.mark.process
@needs_fork
def test_a_server_started_early_imports_before_each_fork_what_the_parent_loaded_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not in the base list, imported by no rank itself (only the report's plot needs it).
    name = "fsdp_conformance.gate.plots"
    monkeypatch.delitem(sys.modules, name, raising=False)  # restored after the test
    servers = ForkServers()
    manager = PoolManager(fork_servers=servers)
    try:
        assert prestart_fork_server(servers)  # as the CLI does, before its own imports
        (server,) = servers.pids()
        assert _run(manager, _loaded_at_start, name, world_size=1) == [False]
        importlib.import_module(name)  # the parent imports it after the server started
        assert _run(manager, _loaded_at_start, name, world_size=1, fresh=True) == [True]
        assert servers.pids() == [server]  # the same server, which imported it before forking
    finally:
        manager.close()
        servers.close()


#: torch's memory trackers: what every measured step needs, and what the parent of a run never
#: does (their package imports torch's compiler stack, about 1.2 s).
TRACKERS = "torch.distributed._tools.mem_tracker"


@pytest.mark.process
@needs_fork
def test_a_server_imports_the_memory_trackers_for_its_ranks_and_the_parent_never_does(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A server that imports only the base list, not what this process has loaded (the plots
    # module, imported here; this process's modules are restored after the test): the trackers
    # come from its own warm-up.
    plots = "fsdp_conformance.gate.plots"
    monkeypatch.setitem(sys.modules, plots, importlib.import_module(plots))
    servers = ForkServers(preload=BASE_PRELOAD)
    manager = PoolManager(fork_servers=servers)
    try:
        assert _run(manager, _loaded_at_start, TRACKERS, world_size=1) == [True]
        assert _run(manager, _loaded_at_start, plots, world_size=1) == [False]
    finally:
        manager.close()
        servers.close()
    # A run's parent imports every claim (and through them the step and the meters), not them.
    probe = (
        "import sys; from fsdp_conformance.claims import all_checks; all_checks(); "
        f"print({TRACKERS!r} in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        timeout=120,
    ).stdout
    assert out.strip() == "False"


@pytest.mark.process
def test_a_pool_without_fork_servers_starts_its_ranks_with_exec() -> None:
    # The default of a RankPool built by hand, and the path of every GPU pool.
    with RankPool(1) as pool:
        (outcome,) = pool.run_outcomes(_how_started)
    assert _values([outcome])[0]["ppid"] == os.getpid()


@pytest.mark.process
@needs_fork
def test_a_pool_with_fork_servers_on_a_platform_without_fork_uses_exec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fsdp_conformance.harness.pool as pool_module

    monkeypatch.setattr(pool_module, "fork_available", lambda: False)
    servers = ForkServers()
    try:
        with RankPool(1, fork_servers=servers) as pool:
            (outcome,) = pool.run_outcomes(_how_started)
    finally:
        servers.close()
    assert _values([outcome])[0]["ppid"] == os.getpid()


def test_the_server_preloads_torch_and_the_parents_heavy_packages_but_never_the_worker() -> None:
    loaded = dict.fromkeys(
        [
            "os",
            "numpy",
            "fsdp_conformance",
            "fsdp_conformance.claims.wrap",
            WORKER_MODULE,
            "transformers",
            "transformers.models.llama.modeling_llama",
            "pytest",
            "_pytest.python",
            "tests.test_wrapping",
        ]
    )
    names = preload_modules(loaded)
    assert names[: len(BASE_PRELOAD)] == list(BASE_PRELOAD)
    assert set(names) - set(BASE_PRELOAD) == {
        "fsdp_conformance",
        "fsdp_conformance.claims.wrap",
        "transformers",
        "transformers.models.llama.modeling_llama",
        "pytest",
    }
