"""Negative controls: faults injected on the ranks, one way for every claim.

A check must be able to fail, so each claim keeps a table of faults that its tests inject: a
:class:`FaultTable` of named :class:`Fault` entries, each a context manager that changes what
torch (or the user's setup, as a user could get it wrong) does for the duration of one rank
function. The rank function names the faults it was given and runs its body inside
``TABLE.inject(fault, ctx)``; the production path itself has no fault branches.

A fault patches an attribute looked up at call time (:func:`patched`): a torch API
(``torch.distributed.reduce_scatter_tensor``), a default of one (:func:`with_default`), or a
step of the family module that stands for the user's code (how the user shards, casts or
initializes the model), patched where the family looks it up (:func:`patched_attr`). Patches
are restored on exit, so a warm rank serves the next check unchanged.

Each family module keeps its own ``FAULTS`` table beside the code it patches, and its rank
functions take ``fault: str | Sequence[str] | None = None`` (a name, names or none), entered as
``with FAULTS.inject(fault, ctx):``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from fsdp_conformance.harness import RankContext

#: What a fault does once entered: patches for the duration of the ``with`` block.
FaultEffect = Callable[[RankContext], contextlib.AbstractContextManager[Any]]


@dataclasses.dataclass(frozen=True)
class Fault:
    """One negative control: what it breaks, in words, and the patch that breaks it."""

    #: What the fault changes, as the failing check's reader needs it.
    description: str
    #: ``effect(ctx)`` returns the context manager that applies the fault on this rank.
    effect: FaultEffect


class FaultTable(Mapping[str, Fault]):
    """A claim's faults by name; :meth:`inject` applies the ones a rank function was given."""

    def __init__(self, **faults: Fault) -> None:
        self._faults = dict(faults)

    def __getitem__(self, name: str) -> Fault:
        return self._faults[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._faults)

    def __len__(self) -> int:
        return len(self._faults)

    def names(self, faults: str | Sequence[str] | None) -> tuple[str, ...]:
        """``faults`` as a tuple of known names; an unknown one raises ``ValueError`` naming
        the choices."""
        given = () if faults is None else (faults,) if isinstance(faults, str) else tuple(faults)
        unknown = [f for f in given if f not in self._faults]
        if unknown:
            raise ValueError(
                f"unknown fault(s) {', '.join(map(repr, unknown))}; choose from "
                f"{', '.join(self._faults)}"
            )
        return given

    @contextlib.contextmanager
    def inject(
        self, faults: str | Sequence[str] | None, ctx: RankContext | None = None
    ) -> Iterator[tuple[str, ...]]:
        """Apply ``faults`` (a name, names or None) for the duration; yields their names.

        ``ctx`` is passed to each fault's effect (a fault that acts per rank needs it)."""
        names = self.names(faults)
        with contextlib.ExitStack() as stack:
            for name in names:
                stack.enter_context(self._faults[name].effect(ctx))  # type: ignore[arg-type]
            yield names


@contextlib.contextmanager
def patched(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """``owner.name`` replaced by ``make(original)`` for the duration (restored on exit)."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def patched_attr(
    module_name: str, name: str, make: Callable[[Any], Any]
) -> contextlib.AbstractContextManager[None]:
    """:func:`patched` on the module named ``module_name``: a family module patches one of its
    own steps with ``patched_attr(__name__, "shard_with_policy", make)``.

    The module is looked up in ``sys.modules`` when the fault is entered (the family module is
    imported by then: its rank function enters the fault), and its global ``name`` replaced,
    so the family's own calls of ``name`` (looked up at call time) get ``make(original)``. A
    step the family imported from its claim's ``common.py`` is patched in the family's
    namespace, not in ``common``'s: each family's fault changes its own family only."""
    return patched(sys.modules[module_name], name, make)


def with_default(fn: Any, key: str, value: Any) -> Any:
    """``fn`` with keyword ``key`` defaulting to ``value`` (a changed default of a torch API)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault(key, value)
        return fn(*args, **kwargs)

    return call
