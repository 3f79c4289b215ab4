"""What a step costs: meters, the timeline, the measured step, the per-layer bound and the
activation profile.

The top wing of the blocks (docs/architecture.md): it imports the base, the harness, ``models``
and ``fsdp``.
"""
