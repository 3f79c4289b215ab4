"""A model's eager training step, timed in this process: what a check's timeout scales by.

A check whose work grows with the model (``torch.compile`` traces every operator of it) needs a
timeout that grows too; a fixed number is crossed by a large model on a loaded machine and is
far too long for a small one. :func:`eager_step_seconds` is the measure (docs/harness.md,
"Timeouts that scale with the work"): the model built on the CPU and forward-and-backward steps
on the suite's batch, in the process that runs the suite (no ranks, no FSDP), on one thread as
each rank of a two-rank run on two cores has. One step is not timed (its one-time costs, such
as autograd's threads and lazy modules, do not grow with the model); the median of the next
:data:`STEPS` is the measure: one thread is not stalled by a busy sibling thread (two threads
on a loaded machine measured 50 times apart), and the median is not one scheduling delay. On a
busy machine every step is slower, as the check will be.
"""

from __future__ import annotations

import statistics
import time

import torch

from fsdp_conformance.fsdp.reference_step import model_loss
from fsdp_conformance.models.model_spec import ModelSpec

#: Steps timed after the untimed first; their median counts.
STEPS = 5


def eager_step_seconds(spec: ModelSpec, steps: int = STEPS) -> float:
    """Seconds of one eager forward and backward of ``spec``'s model on the CPU, on one thread:
    the median of ``steps`` after an untimed first, on one model built once."""
    model = spec.build()
    batch = spec.batch(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.enable_grad():
            model_loss(model, batch).backward()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                model_loss(model, batch).backward()
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)
