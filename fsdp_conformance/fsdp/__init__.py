"""Applying FSDP and reading what it holds: sharding, meta init, state-dict kinds, collectives,
the single-process reference step and what a comparison with it needs.

The middle wing of the blocks (docs/architecture.md): it imports the base, the harness and
``models``.
"""
