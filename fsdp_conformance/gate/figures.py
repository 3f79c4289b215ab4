"""The rules for one changed figure: memory, drift against the noise, numeric results, digests,
dtypes (the conventions are in :mod:`fsdp_conformance.gate.compare`'s docstring).
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_conformance.gate.difference import Difference, listed
from fsdp_conformance.gate.noise import numbers
from fsdp_conformance.sizes import MiB

#: A measured figure is drift when it moves by more than this many times its noise (the largest
#: spread of repeated runs on one torch, gate/noise.py): the spread of 2-3 runs underestimates
#: the true one, 3x covers that (docs/upgrade-gate.md).
DRIFT_K = 3.0
#: The rounding floor of a measured float whose check states no ``numeric_rtol``: relative to
#: the value (absolute for a difference against a reference, already relative). float32's
#: summation-order scale (~1e-7 per operation, 1e-5 over a step: the loop's float32
#: ``numeric_rtol``); a check in float64 or a lower precision states its own.
DRIFT_RTOL = 1e-5
#: Figure keys that are numeric results (a number or a list of numbers): a move beyond
#: :data:`~fsdp_conformance.gate.compare.NUMERIC_RTOL` (or the
#: check's stated ``numeric_rtol``) is a regression.
NUMERIC_SUFFIXES = ("_norm", "_norms")
#: Figure keys that are digests of values that must stay bitwise the same: a change is a
#: regression.
DIGEST_SUFFIXES = ("_digest", "_digests")
#: Digest figures that are reported as a change, not a regression: init's ``reference_digest``
#: is the single-process model built from the seed on this torch; a torch whose initializers
#: draw differently changes it (the same seed, other weights: reproducibility, said), while
#: whether meta init equals that reference is init's own verdict on each side.
CHANGE_ONLY_DIGESTS = ("reference_digest",)


def figure_change(
    cid: str, key: str, a: Any, b: Any, rtol: float, unit_lists: bool
) -> list[Difference]:
    """One changed figure that is not a measurement, by the conventions of compare's module
    docstring; ``rtol``: the numeric results' relative tolerance."""
    if key.endswith(("_dtype", "_dtypes")):
        return [Difference(cid, "dtype", True, f"{key}: {a} -> {b}")]
    if key == "units":
        # With both unit lists, the change is reported with them.
        return [] if unit_lists else [Difference(cid, "units", True, f"unit count {a} -> {b}")]
    if key.endswith(NUMERIC_SUFFIXES + DIGEST_SUFFIXES) and key not in CHANGE_ONLY_DIGESTS:
        if a is None or b is None:  # a figure the suite added or dropped: a change
            return [Difference(cid, "figure", False, f"{key}: {a!r} -> {b!r}")]
        if key.endswith(NUMERIC_SUFFIXES):
            return _numeric_change(cid, key, a, b, rtol)
        return [Difference(cid, "digest", True, f"{key}: {_changed_values(a, b)}")]
    if key == "numeric_rtol" or _is_measurement(a) or _is_measurement(b):
        return []  # a stated tolerance, or a figure the suite added or dropped
    return [Difference(cid, "figure", False, f"{key}: {a!r} -> {b!r}")]


def is_error_figure(key: str) -> bool:
    """A difference against a reference (``update_rel_diff``, ``max_param_diff``): growing is
    moving away from the reference, shrinking is moving towards it."""
    return key.endswith(("_diff", "_diffs"))


def is_loss_figure(key: str) -> bool:
    """A loss (``loss``, ``reference_loss``, ``losses``): what the step computed."""
    return key in ("loss", "losses") or key.endswith(("_loss", "_losses"))


def drift(cid: str, key: str, a: Any, b: Any, spread: float, rtol: float) -> list[Difference]:
    """A measured float (not memory) against its noise: each value moved by more than
    :data:`DRIFT_K` times the noise, and more than the rounding floor (``rtol``, relative to the
    value, or absolute for a difference against a reference, which is already relative), is
    drift. A regression when the step computes something else: a
    difference against the reference grown, a loss moved; another figure (a ratio) moved, or a
    difference shrunk towards the reference, is drift reported, not a regression."""
    xs, ys = numbers(a) or [], numbers(b) or []
    if len(xs) != len(ys):
        return [Difference(cid, "figure", False, f"{key}: {a!r} -> {b!r}")]
    moved, grew = [], False
    for i, (x, y) in enumerate(zip(xs, ys)):
        scale = 1.0 if is_error_figure(key) else max(abs(x), abs(y))
        floor = rtol * scale
        if math.isnan(x) != math.isnan(y) or abs(y - x) > max(DRIFT_K * spread, floor):
            label = f"[{i}] " if len(xs) > 1 else ""
            moved.append(f"{label}{x!r} -> {y!r}")
            grew = grew or not y <= x  # a NaN is never better
    if not moved:
        return []
    if is_error_figure(key):
        regression = grew
        how = "away from the reference" if grew else "towards the reference"
    else:
        regression = is_loss_figure(key)
        how = "the step computes another loss" if regression else "moved"
    return [
        Difference(
            cid,
            "drift",
            regression,
            f"{key}: {listed(moved)} ({how}; noise {spread:.3g} over repeated runs, "
            f"drift beyond {DRIFT_K}x it and the rounding floor {rtol:.0e})",
        )
    ]


def _changed_values(a: Any, b: Any) -> str:
    """``a -> b``, or for two lists of one length the positions that differ, ``[i] x -> y``."""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return listed([f"[{i}] {x!r} -> {y!r}" for i, (x, y) in enumerate(zip(a, b)) if x != y])
    return f"{a!r} -> {b!r}"


def _same_number(x: float, y: float, rtol: float) -> bool:
    """Equal within ``rtol`` of the larger magnitude (two NaNs are the same result)."""
    if x == y or (math.isnan(x) and math.isnan(y)):
        return True
    return abs(y - x) <= rtol * max(abs(x), abs(y))  # False with one NaN


def _numeric_change(cid: str, key: str, a: Any, b: Any, rtol: float) -> list[Difference]:
    """A numeric result (a number, or a list of numbers compared value by value): each value
    moved beyond ``rtol``, relative to the larger, is named; a regression."""
    if is_number(a) and is_number(b):
        pairs = [("", a, b)]
    elif (
        isinstance(a, list)
        and isinstance(b, list)
        and len(a) == len(b)
        and all(is_number(x) for x in a + b)
    ):
        pairs = [(f"[{i}] ", x, y) for i, (x, y) in enumerate(zip(a, b))]
    else:
        return [
            Difference(
                cid, "numeric", True, f"{key}: {a!r} -> {b!r} (not comparable value by value)"
            )
        ]
    moved = []
    for label, x, y in pairs:
        if not _same_number(x, y, rtol):
            rel = (y - x) / abs(x) if x else math.inf
            moved.append(f"{label}{x!r} -> {y!r} ({rel:+.1e})")
    if not moved:
        return []
    return [
        Difference(
            cid,
            "numeric",
            True,
            f"{key}: {listed(moved)} (relative tolerance {rtol:.0e})",
        )
    ]


def _is_measurement(value: Any) -> bool:
    """A float, or a list of numbers with a float among them."""
    if isinstance(value, float):
        return True
    if isinstance(value, list) and value:
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        return numbers and any(isinstance(v, float) for v in value)
    return False


def _mib(key: str, value: float) -> float:
    return value / MiB if key.endswith("_bytes") else value


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def memory_change(
    cid: str, key: str, a: Any, b: Any, tol: float, floor_bytes: float, spread: float | None
) -> list[Difference]:
    """A memory figure (a number, or a list of numbers compared element by element): a rise
    beyond the relative tolerance, the absolute floor and :data:`DRIFT_K` times its noise (where
    measured) is a regression; a move beyond its noise inside the tolerance is drift, said."""
    xs, ys = numbers(a), numbers(b)
    if xs is None or ys is None or len(xs) != len(ys):
        return [Difference(cid, "figure", False, f"{key}: {a!r} -> {b!r}")]
    single = is_number(a)
    floor = floor_bytes if key.endswith("_bytes") else floor_bytes / MiB
    noise = DRIFT_K * spread if spread is not None else 0.0
    diffs, drifted = [], []
    for i, (x, y) in enumerate(zip(xs, ys)):
        label = key if single else f"{key}[{i}]"
        # Both a relative and an absolute threshold: a move off a zero (or tiny) baseline is
        # infinite in relative terms, and OS high-water marks resolve to about 1 MB.
        rel = (y - x) / x if x else float("inf") if y > x else float("-inf")
        values = f"{_mib(key, x):.2f} MiB -> {_mib(key, y):.2f} MiB ({rel:+.1%}"
        beyond_noise = abs(y - x) > noise
        if abs(y - x) > floor and abs(rel) > tol and abs(y - x) > noise:
            said = f"; noise {_mib(key, spread):.2f} MiB" if spread is not None else ""
            diffs.append(
                Difference(
                    cid,
                    "memory",
                    y > x,
                    f"{label}: {values}; tolerance {tol:.0%}, floor {floor_bytes / MiB:.2f} "
                    f"MiB{said})",
                )
            )
        elif spread is not None and beyond_noise:
            drifted.append(f"{label}: {values})")
    if drifted:
        diffs.append(
            Difference(
                cid,
                "drift",
                False,
                f"memory moved beyond its noise ({_mib(key, spread or 0.0):.2f} MiB over "
                f"repeated runs), inside the tolerance: {listed(drifted)}",
            )
        )
    return diffs
