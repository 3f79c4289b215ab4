"""The gate's layout: ``gate/`` holds report, compare, plots and the suite run; no flat shims.

``fsdp-conformance compare`` and ``--help`` must stay light (no torch import), because the gate
compares reports on machines and in CI steps that need not load torch; the suite run may.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_conformance

pytestmark = pytest.mark.cpu

#: A guard on the subprocess (not a timing assertion): importing the modules takes a second.
SUBPROCESS_LIMIT_S = 120
#: Each flat module of the old layout and the gate module that holds it now.
GATE_HOMES = {"reports": "report", "suite": "suite", "plots": "plots"}


def _loads_torch(*modules: str) -> bool:
    """Whether importing ``modules`` in a fresh interpreter loads torch."""
    code = ("import importlib, sys\n"
            f"for name in {list(modules)!r}:\n"
            "    importlib.import_module(name)\n"
            "print('torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=SUBPROCESS_LIMIT_S, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def test_compare_and_report_import_without_torch() -> None:
    assert not _loads_torch("fsdp_conformance.cli", "fsdp_conformance.gate.report",
                            "fsdp_conformance.gate.compare")
    # the control: the probe sees torch where a module does load it (the suite run does)
    assert _loads_torch("fsdp_conformance.gate.suite")


@pytest.mark.parametrize("old", ["reports", "suite", "plots"])
def test_the_flat_gate_modules_are_gone_without_shims(old: str) -> None:
    # A shim would keep stale imports working and hide them from review; every importer moved.
    # (The package folder, not find_spec: an editable install of another checkout would answer.)
    package = Path(fsdp_conformance.__file__).parent
    assert not (package / f"{old}.py").exists()
    assert (package / "gate" / f"{GATE_HOMES[old]}.py").is_file()
    # a regular package, not a namespace one: setuptools' find() ships only those
    assert (package / "gate" / "__init__.py").is_file()


def test_user_model_rules_live_beside_the_gate_not_in_it() -> None:
    from fsdp_conformance import user_model
    from fsdp_conformance.gate import suite
    from fsdp_conformance.settings import Settings, SettingsError, resolve_settings

    assert user_model.user_spec(Settings()) is None
    # "--block-cls needs --model" is a rule of settings resolution (tests/test_settings.py)
    with pytest.raises(SettingsError, match="--block-cls is set but no --model"):
        resolve_settings({"block_cls": "Block"}, {}, {}, flag_style="cli")
    # the suite run uses the one rule, not a copy of it
    assert suite.user_spec is user_model.user_spec
