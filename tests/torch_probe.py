"""Whether code loads torch, seen in a fresh interpreter that refuses to import it.

Not a test module (pytest collects ``test_*.py`` only); the tests import it by name, as pytest
puts their folder on ``sys.path``. The probe records every attempt to import torch and refuses
it: a probe then costs no torch import (about 2 s of CPU on the build machine), and an import
that a ``try`` would swallow is seen too. The code after :data:`TORCH_BLOCKER` reads
``attempts`` (the torch modules asked for) and prints what the test asserts on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: A guard on the subprocess (not a timing assertion): the probe imports no torch.
PROBE_LIMIT_S = 120

TORCH_BLOCKER = """
import importlib, importlib.abc, sys
attempts = []
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            attempts.append(name)
            raise ModuleNotFoundError(f"probe: torch refused ({name})", name=name)
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def probe(code: str, cwd: Path | None = None) -> str:
    """stdout of ``TORCH_BLOCKER + code`` in a fresh interpreter (this one's sys.path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", TORCH_BLOCKER + code],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=PROBE_LIMIT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def loads_torch(*modules: str) -> bool:
    """Whether importing ``modules`` in a fresh interpreter loads (asks for) torch."""
    code = (
        f"for name in {list(modules)!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        if not attempts:\n"
        "            raise\n"
        "        break\n"
        "print(bool(attempts))\n"
    )
    return probe(code).strip() == "True"
