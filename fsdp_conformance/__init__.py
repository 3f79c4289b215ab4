"""fsdp-conformance: a pytest-based distributed conformance suite for PyTorch FSDP."""

__version__ = "0.1.0"
