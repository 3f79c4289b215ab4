"""Memory timelines as a PNG: per-layer sawtooth against the monolithic/naive saturation.

Needs matplotlib (a dependency; the checks never import this module). ``fsdp-conformance run``
writes the report's timelines next to the report by default (``gate.outputs.write_plot``); the
memory benchmark draws its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

# The y axis is in MiB, the unit of the table, the summary and compare.
from fsdp_conformance.sizes import MiB

#: Legend names of the wrappings the memory checks measure.
_WRAPPING_NAMES = {
    "per_layer": "per-layer wrapping",
    "monolithic": "monolithic (root unit only; sampled at its hooks)",
}


def _name(label: str) -> str:
    return _WRAPPING_NAMES.get(label, label)


def _xs(events: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]]) -> list[float]:
    """x of each sample on the reference timeline's sample axis.

    Samples of another wrapping are placed where the reference took the same (unit, phase)
    sample (the root's hooks fire in both: start of forward, end of forward, start of
    backward), so the lines are compared at the same point of the step. Without such a match
    the samples are spread over the reference's width.
    """
    first: dict[tuple[Any, Any], int] = {}
    for i, e in enumerate(reference):
        first.setdefault((e.get("unit"), e.get("phase")), i)
    keys = [(e.get("unit"), e.get("phase")) for e in events]
    if events is not reference and len(set(keys)) == len(keys) and all(k in first for k in keys):
        return [float(first[k]) for k in keys]
    if events is reference or len(events) < 2:
        return [float(i) for i in range(len(events))]
    width = max(1, len(reference) - 1)
    return [i * width / (len(events) - 1) for i in range(len(events))]


def _draw(
    ax: Any,
    timelines: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    limit_bytes: int | None,
    peaks: Mapping[str, int] | None,
    title: str,
) -> None:
    reference = next(iter(timelines.values()), [])
    others = iter(["tab:orange", "tab:purple", "tab:brown", "tab:gray"])
    for label, events in timelines.items():
        ys = [e["bytes"] / MiB for e in events]
        color = "tab:blue" if events is reference else next(others, None)
        ax.step(
            _xs(events, reference),
            ys,
            where="post",
            label=_name(label),
            color=color,
            linewidth=1.6,
            marker="." if len(ys) < 12 else None,
        )
        if peaks and label in peaks:
            # the peak can fall between two hook samples (inside a unit's forward or backward)
            ax.axhline(
                peaks[label] / MiB,
                color=color,
                linestyle=":",
                linewidth=1.2,
                label=f"{_name(label)}: measured peak {peaks[label] / MiB:.1f} MiB",
            )
    if limit_bytes:
        ax.axhline(
            limit_bytes / MiB,
            color="tab:red",
            linestyle="--",
            linewidth=1.2,
            label=f"per-layer bound + tolerance {limit_bytes / MiB:.1f} MiB",
        )
    backward = next((i for i, e in enumerate(reference) if e.get("phase") == "pre_backward"), None)
    if backward:
        ax.axvline(backward, color="0.4", linewidth=0.8)
        ax.annotate(
            "forward | backward",
            xy=(backward, 0.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize="small",
            color="0.3",
            backgroundcolor="white",
        )
    ax.set_xlabel(
        "hook sample, in step order (each unit's gather and release, forward then backward)"
    )
    ax.set_ylabel("tensor memory, rank 0 (MiB)")
    ax.set_title(title, fontsize="medium")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    ax.grid(alpha=0.3)


def _save(fig: Any, path: str) -> str:
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on CI runners and rank machines
    import matplotlib.pyplot as plt

    return plt


def plot_timelines(
    timelines: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str,
    *,
    limit_bytes: int | None = None,
    peaks: Mapping[str, int] | None = None,
    title: str = "memory during one training step",
) -> str:
    """Draw each timeline (samples at unit hooks, in order) as a step line; return ``path``.

    The first timeline (the per-layer sawtooth) sets the x axis, one step per hook sample;
    the others are placed at the samples they share with it. ``limit_bytes``: the per-layer
    bound's limit, a horizontal line. ``peaks``: each timeline's measured peak, dotted.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    _draw(ax, timelines, limit_bytes=limit_bytes, peaks=peaks, title=title)
    return _save(fig, path)


_VERSIONS = ("fsdp1", "fsdp2")

#: The check whose timeline a run's panel shows first; another check's timeline of the same
#: run (``memory.peak_within_bound``'s step) is drawn only where that one has none (skipped).
_PANEL_CHECK = "memory.sawtooth"


def _run_key(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    return (entry.get("lane"), entry.get("world_size"), str(entry.get("variant", "")))


def _scaled_note(data: Mapping[str, Any]) -> str:
    """`` at config.hidden_size 88 (scaled from 64)`` for a step measured at a scaled size."""
    s = data.get("scaled")
    if not s:
        return ""
    return (
        f", at {s.get('setting', s.get('what'))} {s.get('after')} (scaled from {s.get('before')})"
    )


def report_panels(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One panel per run with a timeline (per lane, world size and variant: FSDP1, FSDP2,
    ...): the sawtooth check's, else the timeline another memory check measured."""
    entries = [e for e in report.get("checks", ()) if (e.get("data") or {}).get("timeline")]
    drawn = {_run_key(e) for e in entries if e.get("check") == _PANEL_CHECK}
    panels = []
    for entry in entries:
        data = entry["data"]
        if entry.get("check") != _PANEL_CHECK and _run_key(entry) in drawn:
            continue
        drawn.add(_run_key(entry))
        label = data.get("wrapping", "measured")
        timelines = {label: data["timeline"]}
        peaks = {label: data["peak_bytes"]} if data.get("peak_bytes") else {}
        compare = data.get("compare")
        if compare and compare.get("timeline"):
            other = compare.get("wrapping", "compare")
            timelines[other] = compare["timeline"]
            if compare.get("peak"):
                peaks[other] = compare["peak"]
        variant = [p for p in str(entry.get("variant", "")).split(",") if p]
        # The FSDP version exactly: a model's import path may start with "fsdp" too
        # (fsdp_conformance.hf_models:llama).
        version = next((p.upper() for p in variant if p in _VERSIONS), None)
        model = ", ".join(p for p in variant if p not in _VERSIONS)
        where = ", ".join(
            x
            for x in (
                f"model {model}" if model else "",
                str(entry.get("lane", "")),
                f"world size {entry['world_size']}" if entry.get("world_size") else "",
            )
            if x
        )
        head = f"{version}: " if version else ""
        outcome = f": {entry['outcome']}" if entry.get("outcome") else ""
        panels.append(
            {
                "timelines": timelines,
                "peaks": peaks,
                "limit_bytes": data.get("limit_bytes"),
                "title": f"{head}{entry.get('check', entry.get('id', 'check'))} "
                f"({where}{_scaled_note(data)}){outcome}",
            }
        )
    return panels


def plot_report_timelines(report: Mapping[str, Any], path: str) -> str | None:
    """Every timeline of a report, one panel per check; ``path``, or None if it has none."""
    panels = report_panels(report)
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.2 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        _draw(
            ax,
            panel["timelines"],
            limit_bytes=panel["limit_bytes"],
            peaks=panel["peaks"],
            title=panel["title"],
        )
    torch_version = (report.get("environment") or {}).get("torch")
    fig.suptitle(
        "Memory during one training step" + (f", torch {torch_version}" if torch_version else ""),
        fontsize="large",
    )
    fig.tight_layout()
    return _save(fig, path)
