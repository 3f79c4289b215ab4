"""Cause classes of a corpus run's non-pass rows: each failed or errored check of a report read
(its message, and an error's traceback) and named by what went wrong, so that the table groups
the models by cause rather than by check.

The classes are matched in order, the first that matches naming the row; a row none matches is
``other: <the message's first line>``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: (cause, pattern searched in the check id + message + traceback), first match wins.
CAUSES: tuple[tuple[str, str], ...] = (
    ("FSDP1 frozen flat param", r"uniform `?requires_grad"),
    (
        "forward not runnable on meta (or at the scaled width)",
        r"cannot be called on meta tensors|on meta failed|_profile_on_meta",
    ),
    ("depth invariance", r"depth invariance fails"),
    ("FSDP1 local state dict load", r"Unexpected key\(s\) in state_dict: \"_flat_param"),
    (
        "no reset_parameters (not in preflight)",
        r"have no reset_parameters\(\)|no attribute 'reset_parameters'",
    ),
    (
        "non-float buffer",
        r"(not implemented for '(Bool|Long|Int|ComplexFloat)')|with a bool tensor is not supported"
        r"|bool tensor|on a Bool|ComplexFloat|expected a floating.point"
        r"|cannot be converted to type int64_t",
    ),
    ("REENTRANT checkpoint of a block fed the input", r"None of the inputs have requires_grad"),
    (
        "collective matching",
        r"no reduction for unit|no all-gather for unit|no reduction of the gradients|\(by size\)"
        r"|unit sizes unknown|reductions served|collectives? of a size",
    ),
    ("prefetch order", r"prefetch"),
    ("BatchNorm under low-precision parameters", r"batch_norm: expected scalar type"),
    ("mixed collective dtypes in one step", r"no bound can be derived: the step issued"),
    ("plan estimate ratio", r"planning estimate vs measured"),
    ("BatchNorm stats", r"running_mean|running_var|num_batches_tracked|BatchNorm"),
    ("already sharded", r"already (sharded|managed)|fully_shard.*twice|FSDPModule"),
    ("width scaling", r"width|data-dependent control flow"),
    ("embedding dtype", r"did not run in (bf16|fp16|bfloat16|float16)"),
    ("timeout", r"timed out|hung|did not report|timeout"),
    ("fp16 tolerance", r"(loss_scaling|fp16|bf16|mixed).*(toleran|differ|rel)"),
    ("fp32 tolerance", r"toleran|rel_diff|differs? from the reference"),
    ("checkpointing", r"checkpoint"),
    ("state dict", r"state_dict|load_state"),
    ("the suite's own code raised", r"Error in fsdp_conformance/"),
    ("torch defect", r"torch/distributed/.*Error"),
)


def first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def cause_of(row: Mapping[str, Any]) -> str:
    """The cause class of one failed or errored report row."""
    text = "\n".join(str(row.get(k) or "") for k in ("id", "message", "traceback"))
    for cause, pattern in CAUSES:
        if re.search(pattern, text, re.IGNORECASE | re.MULTILINE):
            return cause
    return f"other: {first_line(str(row.get('message') or ''))[:120]}"


def non_pass(report: Mapping[str, Any]) -> list[dict[str, str]]:
    """Every failed or errored row of a report: its id, outcome, cause and first line."""
    rows = []
    for check in report.get("checks", []):
        if check.get("outcome") in ("failed", "error"):
            rows.append(
                {
                    "id": check["id"],
                    "outcome": check["outcome"],
                    "cause": cause_of(check),
                    "detail": first_line(str(check.get("message") or ""))[:300],
                }
            )
    return rows
