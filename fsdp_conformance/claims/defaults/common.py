"""What the defaults families share: the tiny model both observe torch's defaults on, and how a
verdict states an observable that moved (expected at the pinned torch, observed)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_conformance.claims.check import Verdict


class TinyModel(nn.Module):
    """Three linear layers of different sizes (so a collective's size names its unit) and a
    norm the root unit owns."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 12), nn.Linear(12, 6)])
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        out: torch.Tensor = self.norm(x)
        return out


def unexpected(
    expected: Mapping[str, Any], observed: Mapping[str, Any], note: Callable[[str], str]
) -> list[str]:
    """``<key>: expected <value> (torch 2.13, <note(key)>), observed <value>`` for each figure
    that differs from its family's ``EXPECTED`` table."""
    return [
        f"{key}: expected {want!r} (torch 2.13, {note(key)}), observed {observed.get(key)!r}"
        for key, want in expected.items()
        if observed.get(key) != want
    ]


def differ(what: str, problems: Sequence[str], figures: Any, data: Any) -> Verdict:
    """The failed verdict: its first line names what moved (compare shows only that line),
    then one line per problem."""
    moved = [p.split(":", 1)[0] for p in problems]
    return Verdict(
        False,
        f"{what} differ from the pinned torch's: {', '.join(moved)}\n  " + "\n  ".join(problems),
        figures,
        data,
    )
