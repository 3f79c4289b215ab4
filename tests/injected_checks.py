"""Test-only checks that ``fsdp-conformance run`` subprocesses get through a ``sitecustomize``.

``tests/test_launcher.py`` and ``tests/test_signals.py`` test what a run does around its
checks (the launch, the signal, the exit code), not what a check proves, so they run these
instead of real checks. :func:`site_path` writes a folder whose ``sitecustomize.py`` adds
:data:`CHECKS` to ``fsdp_conformance.claims.all_checks()`` in every process started with that
folder (and this one's) on ``PYTHONPATH``; ``--checks NAME`` selects one of them.

- ``test.blocks_until_signalled``: each rank writes ``rank{N}.in_check`` in its working
  directory (the run's), then sleeps. A test waits for both files and only then signals, so
  the signal always finds every rank inside the check: the run cannot end first, however
  loaded the machine.
- ``init.peak_memory.injected_failure``: passes on rank 0 and raises on rank 1. Its name
  extends ``init.peak_memory`` so that ``--checks init.peak_memory`` selects it with the two
  real checks of that name: one launch shows both those checks running and a failure on
  rank 1 only.

Importing this module imports neither torch nor a claim module (the ``sitecustomize`` also
runs in torchrun's own process).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_conformance.claims.check import Check, Verdict

BLOCKING = "test.blocks_until_signalled"
FAILING_ON_RANK1 = "init.peak_memory.injected_failure"
#: How long a blocked rank sleeps: far past any test's guard (the signal ends it first).
BLOCK_S = 600.0

SITECUSTOMIZE = """
import injected_checks

injected_checks.register()
"""


def marker(directory: Path, rank: int) -> Path:
    """The file rank ``rank`` writes once it is inside ``test.blocks_until_signalled``."""
    return directory / f"rank{rank}.in_check"


def rank_blocks_until_signalled(ctx: Any) -> None:
    marker(Path.cwd(), ctx.rank).write_text(str(os.getpid()))
    time.sleep(BLOCK_S)


def rank_fails_on_rank1(ctx: Any) -> int:
    if ctx.rank == 1:
        raise RuntimeError(f"failure injected on rank {ctx.rank}")
    return ctx.rank


def verdict_passes(values: Sequence[Any], params: Mapping[str, Any]) -> Verdict:
    return Verdict(True, f"every rank returned: {list(values)}")


CHECKS = (
    Check(BLOCKING, "test only: every rank waits in the check until the run is signalled",
          rank_blocks_until_signalled, verdict_passes, lanes=("cpu",)),
    Check(FAILING_ON_RANK1, "test only: passes on rank 0, raises on rank 1",
          rank_fails_on_rank1, verdict_passes, lanes=("cpu",)),
)


def register() -> None:
    """Make ``all_checks()`` end with :data:`CHECKS` (before the CLI imports it)."""
    from fsdp_conformance import claims

    real = claims.all_checks

    def all_checks() -> list[Check]:
        return [*real(), *CHECKS]

    claims.all_checks = all_checks


def site_path(directory: Path) -> list[str]:
    """``PYTHONPATH`` entries that add :data:`CHECKS` to a run: a ``sitecustomize.py`` written
    in ``directory / "site"``, and this module's folder."""
    site = directory / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return [str(site), str(Path(__file__).resolve().parent)]
