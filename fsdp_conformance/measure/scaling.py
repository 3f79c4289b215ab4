"""The smallest size that resolves: a search over width (or batch) candidates.

The memory checks measure a user's model that is too small to resolve at a scaled width
(``claims/memory/common.py``). :func:`smallest` bisects a monotone predicate; :class:`Candidates`
wraps the predicate so that a candidate the model cannot run (a width whose partial rotary
dimension is odd, a meta kernel's stride rule) counts as the suite's choice failing, recorded
with its error, never as the model's fault (docs/memory.md, "Scaling a small model").
"""

from __future__ import annotations

from collections.abc import Callable


def smallest(ok: Callable[[int], bool], top: int) -> int | None:
    """The smallest j in 1..top with ok(j) (ok monotone), or None; O(log top) calls."""
    lo, hi, j = 0, None, 1
    while j <= top:  # doubling, then bisection between the last miss and the first hit
        if ok(j):
            hi = j
            break
        lo, j = j, 2 * j
    if hi is None:
        if lo < top and ok(top):
            hi = top
        else:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


class Candidates:
    """The width candidates tried, each once: resolves (True), runs but does not resolve or
    fit (False), or fails to build or profile on meta (None: the suite's width, not the
    model's fault; a partial rotary dimension or a meta kernel's stride rule the model's own
    width never meets)."""

    def __init__(self, predicate: Callable[[int], bool], width: int, step: int) -> None:
        self.predicate = predicate
        self.width, self.step = width, step
        self.results: dict[int, bool | None] = {}
        self.failures: dict[int, str] = {}

    def ok(self, j: int) -> bool:
        if j not in self.results:
            try:
                self.results[j] = bool(self.predicate(j))
            except Exception as exc:  # noqa: BLE001 - the model at a width the suite chose
                self.results[j] = None
                first = (str(exc).strip().splitlines() or [""])[0][:160]
                self.failures[j] = f"{self.width + j * self.step} ({type(exc).__name__}: {first})"
        return self.results[j] is True

    @property
    def failed(self) -> list[str]:
        return [self.failures[j] for j in sorted(self.failures)]

    def smallest_below(self, j: int) -> int:
        """The smallest candidate under ``j`` that resolves: the bisection assumed the
        predicate monotone, which a failed width breaks; widths below the largest one known
        to run without resolving cannot resolve."""
        if not self.failures:
            return j
        start = max((k for k, v in self.results.items() if v is False and k < j), default=0)
        return next((k for k in range(start + 1, j) if self.ok(k)), j)

    def first_ok(self, top: int, limit: int = 16) -> int | None:
        """Where the bisection found none and some candidates failed: the first of at most
        ``limit`` more candidates, in order, that runs and resolves."""
        untried = [k for k in range(1, top + 1) if k not in self.results][:limit]
        return next((k for k in untried if self.ok(k)), None)
