"""Wrap-policy conformance: every block is exactly one unit, oversized modules outside blocks
are wrapped by the size rule, nothing else; and what follows from the units: training parity,
the second seed's mixed configuration, prefetch order, torch's policy builders.

One module per check family, each with its rank function, verdicts, result type and faults
(negative controls, :mod:`fsdp_conformance.claims.faults`); what the families share is in
:mod:`~fsdp_conformance.claims.wrap.common`:

* :mod:`~fsdp_conformance.claims.wrap.units`: ``wrap.units.exact`` (the actual units equal
  :func:`~fsdp_conformance.claims.wrap.units.expected_units`, trees on failure),
  ``wrap.units.plan`` (the plan, no process group, equals the actual units) and
  ``wrap.units.accounting`` (unit numels add up to the model's, tied weights in one unit, every
  rank's local shard has the expected size, padding accounted);
* :mod:`~fsdp_conformance.claims.wrap.builders`: ``wrap.builders.<builder>``, torch's builders
  give their documented result on a small model; ``wrap.builders.size_boundary``, the size rule
  at its boundary (exactly the threshold wrapped, one fewer not), torch's and the suite's;
* :mod:`~fsdp_conformance.claims.wrap.train`: ``wrap.train.fp32`` / ``wrap.train.bf16``, a few
  steps under FSDP equal a single-process reference;
* :mod:`~fsdp_conformance.claims.wrap.mixed`: ``wrap.mixed``, the second seed's configuration
  (embedding NO_SHARD fp32, blocks FULL_SHARD bf16), each unit's strategy and dtypes;
* :mod:`~fsdp_conformance.claims.wrap.prefetch`: ``wrap.prefetch.forward`` / ``.backward`` /
  ``.coarse``, all-gather order against block execution.
"""

from __future__ import annotations

from typing import Any

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.wrap.builders import (
    rank_builders,
    rank_builders_size_boundary,
    verdict_builders,
    verdict_builders_size_boundary,
)
from fsdp_conformance.claims.wrap.mixed import rank_mixed, verdict_mixed
from fsdp_conformance.claims.wrap.prefetch import (
    rank_prefetch,
    verdict_prefetch_backward,
    verdict_prefetch_coarse,
    verdict_prefetch_forward,
)
from fsdp_conformance.claims.wrap.train import rank_train, verdict_train
from fsdp_conformance.claims.wrap.units import (
    rank_units,
    verdict_units_accounting,
    verdict_units_exact,
    verdict_units_plan,
)
from fsdp_conformance.models.model_spec import ModelSpec

_REF = ModelSpec(reference="massive")
_TIED = ModelSpec(reference="tied")
_EMB = ModelSpec(reference="embedding_classifier")


def _unit_checks(version: str, spec: ModelSpec) -> tuple[Check, ...]:
    """The three unit checks on one reference model, with the recommended policy."""
    on: dict[str, Any] = {"versions": (version,), "specs": (spec,), "policy": "recommended"}
    return (
        variants(
            "wrap.units.exact",
            "each block exactly one unit, oversized modules outside blocks wrapped, nothing else",
            rank_units,
            verdict_units_exact,
            **on,
        )
        + variants(
            "wrap.units.plan",
            "the plan (no process group) equals the actual units on every rank",
            rank_units,
            verdict_units_plan,
            **on,
        )
        + variants(
            "wrap.units.accounting",
            "unit numels add up, tied weights in one unit, shard sizes on every rank",
            rank_units,
            verdict_units_accounting,
            **on,
        )
    )


def _version_checks(version: str) -> tuple[Check, ...]:
    # Version-major, the unit checks per model first: the order reports and ``run --list``
    # have always listed the wrap checks in.
    one = (version,)
    return (
        _unit_checks(version, _REF)
        + _unit_checks(version, _TIED)
        + variants(
            "wrap.train.fp32",
            "fp32 training steps under FSDP equal a single-process reference",
            rank_train,
            verdict_train,
            versions=one,
            specs=(_REF,),
            precision="fp32",
        )
        + variants(
            "wrap.train.bf16",
            "bf16 training steps under FSDP equal a single-process reference",
            rank_train,
            verdict_train,
            versions=one,
            specs=(_REF,),
            precision="bf16",
        )
        + variants(
            "wrap.mixed",
            "embedding NO_SHARD fp32, blocks FULL_SHARD bf16 (second seed)",
            rank_mixed,
            verdict_mixed,
            versions=one,
            specs=(_EMB,),
        )
        + variants(
            "wrap.prefetch.forward",
            "with one unit per block, unit k+1 is gathered before block k ends",
            rank_prefetch,
            verdict_prefetch_forward,
            versions=one,
            specs=(_REF,),
        )
        + variants(
            "wrap.prefetch.backward",
            "in backward, unit k-1 is gathered before block k's backward ends",
            rank_prefetch,
            verdict_prefetch_backward,
            versions=one,
            specs=(_REF,),
        )
        + variants(
            "wrap.prefetch.coarse",
            "with a single coarse unit there is nothing to prefetch",
            rank_prefetch,
            verdict_prefetch_coarse,
            versions=one,
            specs=(_REF,),
            policy="monolithic",
        )
    )


def _builder_check(builder: str) -> tuple[Check, ...]:
    return variants(
        f"wrap.builders.{builder}",
        f"torch's {builder} policy builder gives its documented units",
        rank_builders,
        verdict_builders,
        versions=None,
        builder=builder,
    )


#: Every wrap check with its reference parameters (the CLI swaps in the user's spec).
CHECKS: tuple[Check, ...] = (
    _version_checks("fsdp1")
    + _version_checks("fsdp2")
    + _builder_check("transformer")
    + _builder_check("size")
    + _builder_check("lambda")
    + _builder_check("or")
    + _builder_check("module_wrap")
    + _builder_check("custom")
    + variants(
        "wrap.builders.size_boundary",
        "a module of exactly min_num_params not yet wrapped is a unit, one fewer is not "
        "(torch's size builder and the recommended policy)",
        rank_builders_size_boundary,
        verdict_builders_size_boundary,
    )
)

__all__ = ["CHECKS"]
