"""The defaults fingerprint on real ranks, FSDP1 and FSDP2: what torch does with an option
omitted, observed; a default changed in torch on the ranks fails the check and is a regression
in compare."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.claims.defaults import EXPECTED, rank_fingerprint, verdict_fingerprint
from fsdp_conformance.harness import Ranks

VERSIONS = ("fsdp1", "fsdp2")


@pytest.mark.world_size(2)
def test_fingerprint_probe(ranks: Ranks) -> None:
    for version in VERSIONS:
        values = ranks.run(rank_fingerprint, version=version)
        verdict = verdict_fingerprint(values, {"version": version})
        print(version, verdict.message)
        for k, v in verdict.figures.items():
            print("  ", k, v)
        for case, recs in verdict.data["collectives"].items():
            print(case)
            for r in recs:
                print("    ", r)
