"""Memory timelines as a PNG: per-layer sawtooth against the monolithic/naive saturation.

Optional: needs matplotlib (``pip install matplotlib``, the 'plot' extra). The checks never
import this module; the CLI's ``--plot`` and the benchmark do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

MB = 1e6


def plot_timelines(
    timelines: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str,
    *,
    limit_bytes: int | None = None,
    title: str = "memory during one training step",
) -> str:
    """Draw each timeline (samples at unit hooks, in order) as a step line; return ``path``.

    ``limit_bytes``: the per-layer bound's limit, drawn as a horizontal line.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, events in timelines.items():
        ys = [e["bytes"] / MB for e in events]
        ax.step(range(len(ys)), ys, where="post", label=label,
                color="tab:blue" if label == "per_layer" else None, linewidth=1.5)
    if limit_bytes:
        ax.axhline(limit_bytes / MB, color="tab:red", linestyle="--",
                   label=f"per-layer bound + tolerance ({limit_bytes / MB:.1f} MB)")
    ax.set_xlabel("hook sample (pre/post forward and backward of each unit, in order)")
    ax.set_ylabel("tensor memory on rank 0 (MB)")
    ax.set_title(title)
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_report_timelines(report: Mapping[str, Any], path: str) -> str | None:
    """The first sawtooth check of a report (with its monolithic comparison), or None if none."""
    for entry in report.get("checks", ()):
        data = entry.get("data") or {}
        if not data.get("timeline"):
            continue
        timelines = {data.get("wrapping", "measured"): data["timeline"]}
        compare = data.get("compare")
        if compare and compare.get("timeline"):
            timelines[compare.get("wrapping", "compare")] = compare["timeline"]
        title = f"memory timeline: {entry.get('id', entry.get('check', 'check'))}"
        return plot_timelines(timelines, path, limit_bytes=data.get("limit_bytes"), title=title)
    return None
