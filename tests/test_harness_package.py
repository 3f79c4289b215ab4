"""The harness as a package: its public face, its inner import rules, and how its ranks start.

``fsdp_conformance.harness`` was one module; users import ``Ranks``, ``RankContext``,
``skip_rank`` and the exceptions from it. These tests hold the package to that face, and to the
rule that ends the old back-and-forth: the rank side (``worker``, ``clean_state``) and the parent
side (``pool``, ``launcher``, ``outcomes``) share only ``protocol``.
"""

from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fsdp_conformance.harness as harness
from fsdp_conformance.harness import HarnessError, RankContext

pytestmark = pytest.mark.cpu

PACKAGE = "fsdp_conformance"
HARNESS = f"{PACKAGE}.harness"
HARNESS_DIR = Path(harness.__file__).resolve().parent
WORKER_MODULE = f"{HARNESS}.worker"

#: The public names of the single-module harness (every top-level name without a leading
#: underscore in fsdp_conformance/harness.py before the split): the package keeps them all.
PUBLIC_NAMES = {
    "GRACE_AFTER_FAILURE_S", "GRACE_AFTER_SKIP_S", "LOG_TAIL_LINES", "OUTER_TIMEOUT_RESERVE_S",
    "STACK_DUMP_WAIT_S", "CheckSkipped", "HarnessError", "LauncherRunner", "PoolManager",
    "RankContext", "RankFailure", "RankOutcome", "RankPool", "Ranks", "all_gather_objects",
    "close_all_pools", "cuda_device_count", "describe_exit", "fit_timeout", "format_failure",
    "lane_unavailable", "launched_externally", "log", "outer_deadline", "resolve_outcomes",
    "skip_rank", "startup_environ", "traceback_text",
}

#: What each module of the folder may import from the package (docs/harness.md: the rank side
#: and the parent side share only ``protocol``; the pool starts the worker by its module name).
#: The base modules (settings and the stdlib-only helpers) are allowed everywhere.
BASE = {f"{PACKAGE}._compat", f"{PACKAGE}.settings", f"{PACKAGE}.sizes", f"{PACKAGE}._files"}
ALLOWED = {
    "protocol": set(),
    "interrupts": set(),
    "clean_state": {"protocol"},
    "worker": {"protocol", "clean_state"},
    "outcomes": {"protocol"},
    "pool": {"protocol", "outcomes"},
    "launcher": {"protocol", "outcomes", "worker", "interrupts"},
}


def package_imports(source: str) -> set[str]:
    """Every ``fsdp_conformance`` module ``source`` imports, at any depth (function bodies too).

    ``from fsdp_conformance.harness import protocol`` counts as the submodule; ``from
    fsdp_conformance.harness import Ranks`` as the package ``fsdp_conformance.harness`` itself,
    whose ``__init__`` imports the whole folder.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                relative = Path(*sub.split(".")[1:])
                is_module = (HARNESS_DIR.parent / relative).with_suffix(".py").is_file() or (
                    HARNESS_DIR.parent / relative / "__init__.py").is_file()
                found.add(sub if is_module else node.module)
    return found


def broken_rules(module: str, source: str) -> list[str]:
    """The imports of ``harness/<module>.py`` (given as ``source``) that its rule forbids."""
    imported = package_imports(source)
    if module in ALLOWED:
        allowed = {f"{HARNESS}.{m}" for m in ALLOWED[module]}
    else:  # ranks, __init__: the whole folder
        allowed = {HARNESS} | {f"{HARNESS}.{p.stem}" for p in HARNESS_DIR.glob("*.py")}
    return sorted(imported - allowed - BASE)


def test_public_names_are_the_single_modules() -> None:
    assert set(harness.__all__) == PUBLIC_NAMES
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


@pytest.mark.parametrize("module", sorted(p.stem for p in HARNESS_DIR.glob("*.py")))
def test_each_harness_module_imports_only_what_its_layer_allows(module: str) -> None:
    source = (HARNESS_DIR / f"{module}.py").read_text(encoding="utf-8")
    assert broken_rules(module, source) == [], (
        f"harness/{module}.py imports beyond its rule {sorted(ALLOWED.get(module, ['*']))}")


def test_the_import_rule_catches_a_worker_reaching_for_the_parent_side() -> None:
    # Negative control: the old back-and-forth, written into the worker, is caught, also when
    # the import hides in a function body.
    source = (HARNESS_DIR / "worker.py").read_text(encoding="utf-8") + textwrap.dedent("""
        def _sneak():
            from fsdp_conformance.harness.pool import RankPool
            from fsdp_conformance.harness import Ranks
            import fsdp_conformance.memory
            return RankPool, Ranks
        """)
    assert broken_rules("worker", source) == [
        HARNESS, f"{HARNESS}.pool", f"{PACKAGE}.memory"]


def _how_this_rank_started(ctx: RankContext) -> dict[str, object]:
    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0") if a]
    return {"argv": argv, "worker_imported_twice": WORKER_MODULE in sys.modules}


@pytest.mark.world_size(2)
def test_ranks_run_the_worker_module_once(ranks) -> None:
    if ranks.launcher is not None:
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


def test_a_pool_started_while_a_rank_imports_the_parents_script_is_refused(tmp_path: Path) -> None:
    # The flag the worker sets (protocol.loading_parent_main) is the one the pool reads.
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode != 0, done.stdout + done.stderr
    assert f"{HarnessError.__module__}.HarnessError: could not start 1 gloo ranks" in done.stderr
    assert "a RankPool was started while a rank imported the parent's __main__ script" in (
        done.stderr)
