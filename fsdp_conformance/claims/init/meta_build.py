"""``init.meta_build``: building the model on meta allocates no storage.

The process's peak memory (``VmHWM``) is read before and after the build; a meta build may grow
it by a tiny fraction of the model's bytes plus a fixed allowance for Python objects. A tensor
the constructor leaves real (:func:`~fsdp_conformance.fsdp.meta_init.real_under_meta`) is named
in the row either way; it fails the check when the real tensors hold more than a negligible
fraction of one layer's share of the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.init.common import FAULTS
from fsdp_conformance.fsdp.meta_init import real_under_meta, state_bytes
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
    #: The bytes of the tensors not on meta, and the bytes a meta build may leave real.
    real_bytes: int
    real_allowed: int


def rank_meta_build(
    ctx: RankContext, spec: ModelSpec, fault: str | Sequence[str] | None = None
) -> MetaBuildReport:
    """Build ``spec`` on meta and measure how much the process's peak memory grew.

    ``fault``: a negative control from :data:`~fsdp_conformance.claims.init.common.FAULTS`
    applied to the measured build (``eager_build``: the model gets storage).
    """
    blocks = spec.instantiate("meta").blocks  # warm-up: imports, first-call caches
    rss_before = reset_peak_rss()
    with FAULTS.inject(fault, ctx):
        model = spec.build("meta")
    peak = status_bytes("VmHWM")
    numel = sum(p.numel() for p in model.parameters())
    real = real_under_meta(model, sum(isinstance(m, blocks) for m in model.modules()))
    report: MetaBuildReport = {
        "rank": ctx.rank,
        "device": str(next(model.parameters()).device),
        "numel": numel,
        "model_bytes": state_bytes(model),
        "growth_bytes": peak - rss_before,
        "not_on_meta": real.names[:10],
        "real_bytes": real.bytes,
        "real_allowed": real.allowed,
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
    real = max(values, key=lambda v: v["real_bytes"])
    if real["not_on_meta"]:
        figures["real_bytes"] = real["real_bytes"]
    if real["real_bytes"] > real["real_allowed"]:
        return Verdict(
            False,
            f"rank {real['rank']}: built with storage (not on meta): "
            f"{', '.join(real['not_on_meta'])} ({real['real_bytes']:,} bytes, over the "
            f"{real['real_allowed']:,} a meta build may leave real: 1% of one layer's share of "
            "the model); create them without an explicit device= (the legacy torch.Tensor(n) "
            "constructor ignores torch.device('meta'): use torch.empty(n)) so that meta init "
            "allocates nothing",
            figures,
        )
    left = (
        f"; left real, {real['real_bytes']:,} bytes (at most {real['real_allowed']:,}, 1% of "
        f"one layer's share of the model): {', '.join(real['not_on_meta'])} (created with "
        "storage under torch.device('meta'), e.g. by the legacy torch.Tensor(n) constructor; "
        "to_empty reallocates it and the model's init must cover it, as the init checks judge)"
        if real["not_on_meta"]
        else ""
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
        f"{worst['growth_bytes'] / MiB:,.2f} MiB at most (allowed {allowed / MiB:,.1f} MiB)" + left,
        figures,
    )
