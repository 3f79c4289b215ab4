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
    peaks: Mapping[str, int] | None = None,
    title: str = "memory during one training step",
) -> str:
    """Draw each timeline (samples at unit hooks, in order) as a step line; return ``path``.

    The x axis is the fraction of the step's hook samples, so timelines with few units (the
    monolithic one has only the root's) span the same width as the per-layer sawtooth.
    ``limit_bytes``: the per-layer bound's limit, drawn as a horizontal line. ``peaks``: each
    timeline's measured peak, drawn as a dotted line (a peak can fall between two hooks).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    others = iter(["tab:orange", "tab:purple", "tab:brown", "tab:gray"])
    for label, events in timelines.items():
        ys = [e["bytes"] / MB for e in events]
        xs = [i / max(1, len(ys) - 1) for i in range(len(ys))]
        color = "tab:blue" if label == "per_layer" else next(others, None)
        ax.step(xs, ys, where="post", label=label, color=color, linewidth=1.5)
        if peaks and label in peaks:
            ax.axhline(peaks[label] / MB, color=color, linestyle=":", linewidth=1,
                       label=f"{label} peak ({peaks[label] / MB:.1f} MB)")
    if limit_bytes:
        ax.axhline(limit_bytes / MB, color="tab:red", linestyle="--",
                   label=f"per-layer bound + tolerance ({limit_bytes / MB:.1f} MB)")
    ax.set_xlabel("fraction of the step (samples at each unit's pre/post forward and backward)")
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
        label = data.get("wrapping", "measured")
        timelines = {label: data["timeline"]}
        peaks = {label: data["peak_bytes"]} if data.get("peak_bytes") else {}
        compare = data.get("compare")
        if compare and compare.get("timeline"):
            other = compare.get("wrapping", "compare")
            timelines[other] = compare["timeline"]
            if compare.get("peak"):
                peaks[other] = compare["peak"]
        title = f"memory timeline: {entry.get('id', entry.get('check', 'check'))}"
        return plot_timelines(timelines, path, limit_bytes=data.get("limit_bytes"), peaks=peaks,
                              title=title)
    return None
