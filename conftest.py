"""Repository-level pytest configuration.

The suite's own plugin (fixtures, markers, options) is registered through the package's
``pytest11`` entry point, and ``pytester`` through ``-p pytester`` in pyproject's addopts, so
this file declares no plugins: it is also loaded when ``--fsdp-model`` collects the checks from
an editable install of this repository. It holds the fixtures the tests share, ``lent_pools`` and
``warm_pools``, and imports torch only when they are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from fsdp_conformance.harness import PoolManager


class _BorrowedPools:
    """The session's pool manager, lent to an in-process run: its close leaves the pools warm
    (the session closes them); everything else is the session manager's own."""

    def __init__(self, manager: PoolManager) -> None:
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def close(self, force: bool = False) -> None:
        pass


@pytest.fixture(scope="session")
def lent_pools(rank_pools: PoolManager) -> PoolManager:
    """The session's warm pools, lent to in-process runs of any fixture scope: closing the
    lent manager leaves them warm (the session closes them)."""
    return _BorrowedPools(rank_pools)  # type: ignore[return-value]


@pytest.fixture
def warm_pools(
    rank_pools: PoolManager, lent_pools: PoolManager, monkeypatch: pytest.MonkeyPatch
) -> PoolManager:
    """In-process runs (``run_suite``, ``main(["run", ...])``) run on the session's warm pools."""
    from fsdp_conformance.gate import suite

    monkeypatch.setattr(suite, "PoolManager", lambda: lent_pools)
    return rank_pools
