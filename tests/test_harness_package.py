"""The harness as a package: its public face, its inner import rules, and how its ranks start.

Users import ``Ranks``, ``RankContext``, ``skip_rank`` and the exceptions from
``fsdp_conformance.harness`` itself, whichever of its modules defines them; these tests hold the
package to that face. The rule that keeps the rank side (``worker`` and ``clean_state``) and the
parent side (``pool``, ``launcher`` and ``outcomes``) apart, sharing only ``protocol``, is in
tests/test_architecture.py with the package's other import rules.
"""

from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_conformance.harness as harness
from fsdp_conformance.harness import HarnessError, RankContext

PACKAGE = "fsdp_conformance"
HARNESS = f"{PACKAGE}.harness"
WORKER_MODULE = f"{HARNESS}.worker"

#: The public names user code imports from ``fsdp_conformance.harness``: the package keeps
#: them all, each importable from the package itself.
PUBLIC_NAMES = {
    "GRACE_AFTER_FAILURE_S",
    "GRACE_AFTER_SKIP_S",
    "LOG_TAIL_LINES",
    "OUTER_TIMEOUT_RESERVE_S",
    "STACK_DUMP_WAIT_S",
    "CheckSkipped",
    "HarnessError",
    "LaunchSupervisor",
    "PoolManager",
    "RankContext",
    "RankFailure",
    "RankOutcome",
    "RankPool",
    "Ranks",
    "all_gather_objects",
    "close_all_pools",
    "cuda_device_count",
    "describe_exit",
    "fit_timeout",
    "format_failure",
    "lane_unavailable",
    "launched_externally",
    "log",
    "outer_deadline",
    "resolve_outcomes",
    "skip_rank",
    "startup_environ",
    "traceback_text",
}
#: The other public names: the lifecycle the CLI and the plugin open, the GPU share of a
#: pytest-xdist worker that the plugin hands to it, and the engines' contract that the CLI, the
#: gate and the plugin hand to ``Ranks``, and the timeout the gate derives from a check's work.
ADDED_NAMES = {
    "HarnessSession",
    "GpuShare",
    "xdist_share",
    "RankEngine",
    "RankRequest",
    "SharedVerdicts",
    "scaled_timeout",
}


def test_public_names_are_the_single_modules() -> None:
    assert set(harness.__all__) == PUBLIC_NAMES | ADDED_NAMES
    missing = [name for name in PUBLIC_NAMES if not hasattr(harness, name)]
    assert not missing, f"fsdp_conformance.harness lost {missing}"


def test_exceptions_keep_the_name_users_see() -> None:
    # pytest prints "fsdp_conformance.harness.RankFailure" (docs/harness.md); pickles name it so.
    for cls in (harness.CheckSkipped, harness.HarnessError, harness.RankFailure):
        assert cls.__module__ == HARNESS, cls
        assert type(pickle.loads(pickle.dumps(cls("why")))) is cls


def test_the_logger_keeps_its_name() -> None:
    from fsdp_conformance.harness import pool

    assert pool.log is harness.log
    assert harness.log.name == HARNESS  # users configure it by this name


def _how_this_rank_started(ctx: RankContext) -> dict[str, object]:
    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0") if a]
    return {"argv": argv, "worker_imported_twice": WORKER_MODULE in sys.modules}


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_ranks_run_the_worker_module_once(ranks) -> None:
    if isinstance(ranks.engine, harness.LaunchSupervisor):
        pytest.skip("under an external launcher the ranks are its processes, not pool workers")
    for started in ranks.run(_how_this_rank_started):
        assert started["argv"][1:3] == ["-m", WORKER_MODULE], started["argv"]
        # The worker runs as __main__; nothing in the package imports it as a module too
        # (runpy would warn, and its globals would exist twice).
        assert started["worker_imported_twice"] is False


UNGUARDED_SCRIPT = """
from fsdp_conformance.harness import RankPool

RankPool(1, start_timeout=60.0)  # at the top level: every rank re-imports this script
"""


@pytest.mark.process
def test_a_pool_started_while_a_rank_imports_the_parents_script_is_refused(tmp_path: Path) -> None:
    # The flag the worker sets (protocol.loading_parent_main) is the one the pool reads.
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert f"{HarnessError.__module__}.HarnessError: could not start 1 gloo ranks" in done.stderr
    assert "a RankPool was started while a rank imported the parent's __main__ script" in (
        done.stderr
    )


#: The front ends that drive the harness: they reach it only through its public names.
FRONT_ENDS = ("cli.py", "cli_parser.py", "plugin.py", "gate")


def _past_the_public_face(source: str, name: str) -> list[str]:
    """Each import of the harness in ``source`` that goes past its public face: a submodule,
    or a name ``fsdp_conformance.harness`` does not export."""
    bad: list[str] = []
    for node in sorted(
        (n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))),
        key=lambda n: n.lineno,
    ):
        if isinstance(node, ast.Import):
            bad += [
                f"{name}:{node.lineno} import {a.name}"
                for a in node.names
                if a.name.startswith(HARNESS + ".")
            ]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.startswith(HARNESS + "."):
                bad.append(f"{name}:{node.lineno} from {node.module}")
            elif node.module == HARNESS:
                bad += [
                    f"{name}:{node.lineno} {HARNESS}.{a.name}"
                    for a in node.names
                    if a.name not in harness.__all__
                ]
    return bad


def test_the_front_ends_reach_the_harness_only_through_its_public_names() -> None:
    package = Path(harness.__file__).parent.parent
    paths = [
        path
        for entry in FRONT_ENDS
        for path in (
            sorted((package / entry).glob("*.py"))
            if (package / entry).is_dir()
            else [package / entry]
        )
    ]
    assert len(paths) > 3, paths
    bad = [
        line
        for path in paths
        for line in _past_the_public_face(path.read_text(encoding="utf-8"), path.name)
    ]
    assert not bad, "past fsdp_conformance.harness's public names:\n" + "\n".join(bad)
    # Negative control: what this test exists to catch is caught, a public name is not.
    sneaky = (
        "from fsdp_conformance.harness.pool import pg_timeout_for\n"
        "def f():\n    from fsdp_conformance.harness import forkserver, Ranks\n"
        "import fsdp_conformance.harness.interrupts\n"
    )
    assert _past_the_public_face(sneaky, "sneaky.py") == [
        "sneaky.py:1 from fsdp_conformance.harness.pool",
        "sneaky.py:3 fsdp_conformance.harness.forkserver",
        "sneaky.py:4 import fsdp_conformance.harness.interrupts",
    ]
