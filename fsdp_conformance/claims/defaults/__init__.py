"""The defaults claim: what torch does when a user leaves an option unset, observed.

One module per check family:

* :mod:`~fsdp_conformance.claims.defaults.fingerprint`: ``defaults.fingerprint``, FSDP1's and
  FSDP2's constructor and mixed-precision options left unset (the collectives' dtypes, the units
  resharded after forward, prefetching, sharding strategy), from one step's recorded
  collectives.
* :mod:`~fsdp_conformance.claims.defaults.state_dict`: ``defaults.state_dict``, the state-dict
  APIs with their options left unset (``get_model_state_dict`` / ``get_optimizer_state_dict`` /
  ``set_model_state_dict``, FSDP1's ``state_dict`` / ``state_dict_type`` / ``optim_state_dict`` /
  ``summon_full_params``, ``torch.load``, ``dcp.save`` / ``dcp.load``), from what they hand back.

Each compares what it observed with ``EXPECTED`` (torch 2.13, measured) and keeps every observed
value in the report, so ``compare`` between two torch versions shows what moved
(docs/defaults.md).
"""

from __future__ import annotations

from fsdp_conformance.claims.check import Check, variants
from fsdp_conformance.claims.defaults.fingerprint import rank_fingerprint, verdict_fingerprint
from fsdp_conformance.claims.defaults.state_dict import rank_state_dict, verdict_state_dict

#: One check per FSDP version and family, each every observable from one rank call.
CHECKS: tuple[Check, ...] = variants(
    "defaults.fingerprint",
    {
        "fsdp1": "FSDP1 with mixed precision, prefetch, gather limit, flat parameters and "
        "sharding strategy left unset does what torch 2.13 does, observed",
        "fsdp2": "FSDP2 with reshard_after_forward, each MixedPrecisionPolicy field and the "
        "offload policy left unset does what torch 2.13 does, observed",
    },
    rank_fingerprint,
    verdict_fingerprint,
) + variants(
    "defaults.state_dict",
    {
        "fsdp1": "get_model_state_dict / get_optimizer_state_dict / set_model_state_dict, "
        "state_dict() and state_dict_type(FULL_STATE_DICT) without a config, optim_state_dict, "
        "summon_full_params(), torch.load and dcp.save / dcp.load with options unset do what "
        "torch 2.13 does, observed",
        "fsdp2": "get_model_state_dict / get_optimizer_state_dict / get_state_dict / "
        "set_model_state_dict, torch.load and dcp.save / dcp.load with options unset do what "
        "torch 2.13 does, observed",
    },
    rank_state_dict,
    verdict_state_dict,
)

__all__ = ["CHECKS"]
