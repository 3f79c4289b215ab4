"""Reports: what is in effect, and (issue 6) the JSON report, Markdown summary and compare."""

from __future__ import annotations

from fsdp_conformance.settings import Settings


def environment_summary(settings: Settings) -> str:
    """One line: torch version and build, devices, backends, world sizes, launcher mode."""
    import torch
    import torch.distributed as dist

    from fsdp_conformance.harness import cuda_device_count, launched_externally

    build = f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu build"
    backends = [b for b in ("gloo", "nccl") if getattr(dist, f"is_{b}_available")()]
    parts = [
        f"torch {torch.__version__} ({build})",
        f"cuda devices {cuda_device_count()}",
        f"backends {','.join(backends) or 'none'}",
        f"backend {settings.backend}",
        f"world sizes {','.join(map(str, settings.world_sizes))}",
        f"check timeout {settings.timeout:g}s",
        "ranks: external launcher (env://)" if launched_externally() else "ranks: warm pool",
    ]
    if settings.model:
        parts.append(f"model {settings.model}")
    return ", ".join(parts)
