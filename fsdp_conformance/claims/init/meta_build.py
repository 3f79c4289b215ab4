"""``init.meta_build``: building the model on meta allocates no storage.

The process's peak memory (``VmHWM``) is read before and after the build; a meta build may grow
it by a tiny fraction of the model's bytes plus a fixed allowance for Python objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.init.common import FAULTS
from fsdp_conformance.fsdp.meta_init import named_state, state_bytes
from fsdp_conformance.fsdp.meta_materialize import Ranked
from fsdp_conformance.harness import RankContext
from fsdp_conformance.measure.meters import reset_peak_rss, status_bytes
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.sizes import MiB

#: Meta build: allowed growth of the process's peak memory, as a fraction of the model's
#: bytes, plus a fixed allowance for Python objects (modules, dicts; ~KB per module).
META_GROWTH_FRACTION = 0.001
META_GROWTH_FIXED_MIB = 16.0


class MetaBuildReport(Ranked):
    """One rank's build: where, how big, how much the peak grew, what was not on meta."""

    device: str
    numel: int
    model_bytes: int
    growth_bytes: int
    not_on_meta: list[str]


def rank_meta_build(
    ctx: RankContext, spec: ModelSpec, fault: str | Sequence[str] | None = None
) -> MetaBuildReport:
    """Build ``spec`` on meta and measure how much the process's peak memory grew.

    ``fault``: a negative control from :data:`~fsdp_conformance.claims.init.common.FAULTS`
    applied to the measured build (``eager_build``: the model gets storage).
    """
    spec.build("meta")  # warm-up: imports and first-call caches are not the model's cost
    rss_before = reset_peak_rss()
    with FAULTS.inject(fault, ctx):
        model = spec.build("meta")
    peak = status_bytes("VmHWM")
    numel = sum(p.numel() for p in model.parameters())
    report: MetaBuildReport = {
        "rank": ctx.rank,
        "device": str(next(model.parameters()).device),
        "numel": numel,
        "model_bytes": state_bytes(model),
        "growth_bytes": peak - rss_before,
        "not_on_meta": [n for n, t in named_state(model) if not t.is_meta][:10],
    }
    del model
    return report


def verdict_meta_build(values: Sequence[MetaBuildReport], params: Mapping[str, Any]) -> Verdict:
    worst = max(values, key=lambda v: v["growth_bytes"])
    model_mib = worst["model_bytes"] / MiB
    allowed = META_GROWTH_FRACTION * worst["model_bytes"] + META_GROWTH_FIXED_MIB * MiB
    figures = {
        "params": worst["numel"],
        "model_MiB": round(model_mib, 1),
        "growth_MiB": round(worst["growth_bytes"] / MiB, 2),
        "allowed_MiB": round(allowed / MiB, 1),
    }
    real = [v for v in values if v["not_on_meta"]]
    if real:
        return Verdict(
            False,
            f"rank {real[0]['rank']}: built with storage (not on meta): "
            f"{', '.join(real[0]['not_on_meta'])}",
            figures,
        )
    if worst["growth_bytes"] > allowed:
        return Verdict(
            False,
            f"building {worst['numel']:,} parameters ({model_mib:,.0f} MiB) grew rank "
            f"{worst['rank']}'s peak memory by {worst['growth_bytes'] / MiB:,.1f} MiB, over the "
            f"{allowed / MiB:,.1f} MiB allowed for a meta build: the model allocated storage",
            figures,
        )
    return Verdict(
        True,
        f"{worst['numel']:,} parameters ({model_mib:,.0f} MiB) on meta; peak memory grew by "
        f"{worst['growth_bytes'] / MiB:,.2f} MiB at most (allowed {allowed / MiB:,.1f} MiB)",
        figures,
    )
