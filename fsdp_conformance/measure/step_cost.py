"""The model's first eager training step, timed in this process: what a check's timeout scales by.

A check whose work grows with the model (``torch.compile`` traces every operator of it) needs a
timeout that grows too; a fixed number is crossed by a large model on a loaded machine and is
far too long for a small one. :func:`eager_step_seconds` is the measure (docs/harness.md,
"Timeouts that scale with the work"): the model built on the CPU and one forward and backward
on the suite's batch, timed from the forward, in the process that runs the suite (no ranks, no
FSDP). The fastest of :data:`STEPS` steps on one model: the first alone carries one-time costs
of the process (autograd's threads, lazy modules) that do not grow with the model, and one
step alone is at the mercy of one scheduling delay; on a busy machine every step is slower, as
the checks after it will be.
"""

from __future__ import annotations

import time

import torch

from fsdp_conformance.fsdp.reference_step import model_loss
from fsdp_conformance.models.model_spec import ModelSpec

#: Steps timed; the fastest counts.
STEPS = 3


def eager_step_seconds(spec: ModelSpec, steps: int = STEPS) -> float:
    """Wall seconds of an eager forward and backward of ``spec``'s model on the CPU: the
    fastest of ``steps`` on one model, built once."""
    model = spec.build()
    batch = spec.batch(model)
    times = []
    with torch.enable_grad():
        for _ in range(steps):
            start = time.perf_counter()
            model_loss(model, batch).backward()
            times.append(time.perf_counter() - start)
    return min(times)
