"""One difference between two reports, as compare reports it (``fsdp-conformance compare``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fsdp_conformance._files import PlainData


@dataclasses.dataclass(frozen=True)
class Difference(PlainData):
    """One difference between two reports."""

    check_id: str
    #: outcome | known_defect | fixed | missing | added | units | memory | drift | dtype |
    #: numeric | digest | collectives | order | warning | deprecation | rollback | checkpoint |
    #: figure |
    #: settings (:data:`~fsdp_conformance.gate.verdict.CATEGORIES` groups them for the verdict)
    kind: str
    regression: bool
    text: str


#: Changed items listed in one difference line before "(+N more)".
_SHOWN = 4


def listed(parts: Sequence[str]) -> str:
    """The first few changed items of one difference line, then how many more."""
    more = f"; (+{len(parts) - _SHOWN} more)" if len(parts) > _SHOWN else ""
    return "; ".join(parts[:_SHOWN]) + more
