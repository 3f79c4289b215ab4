"""``init.seeds_fn`` and ``init.seeds_fn_to_empty``: the seeds' ``materialization_fn`` as
written, and with the minimal fix, run through the no-meta judgement.

Expected to fail, each with a one-line finding (docs/init.md): they judge the seeds' code, not
the user's model, so they are :data:`~fsdp_conformance.claims.init.SEEDS_CHECKS`, not part of
``CHECKS``. The rank function is :func:`~fsdp_conformance.claims.init.weights.rank_weights`
with ``method="seeds"`` or ``"seeds_to_empty"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.init.common import InitReport, judge_no_meta


def verdict_seeds_fn(values: Sequence[InitReport], params: Mapping[str, Any]) -> Verdict:
    """The seeds' function as written: every tensor materialized and initialized, or the
    finding that says why not."""
    return judge_no_meta(values)


def verdict_seeds_fn_to_empty(values: Sequence[InitReport], params: Mapping[str, Any]) -> Verdict:
    """The seeds' function with ``to_empty`` first: what it still leaves uninitialized."""
    return judge_no_meta(values)
