"""What is sharded: the model a check builds, its blocks, the policies and the unit plans.

The lowest wing of the blocks (docs/architecture.md): it imports only the base layer.
"""
