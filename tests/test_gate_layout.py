"""The gate's layout: ``gate/`` holds report, compare, plots and the suite run; no flat shims.

``fsdp-conformance compare`` and ``--help`` must stay light (no torch import), because the gate
compares reports on machines and in CI steps that need not load torch; the suite run may.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch_probe import loads_torch, probe

import fsdp_conformance

pytestmark = pytest.mark.cpu

#: Each flat module name that must not exist, and the gate module that holds its code.
GATE_HOMES = {"reports": "report", "suite": "suite", "plots": "plots"}


def test_compare_and_report_import_without_torch() -> None:
    assert not loads_torch(
        "fsdp_conformance.cli",
        "fsdp_conformance.gate.report",
        "fsdp_conformance.gate.schema",
        "fsdp_conformance.gate.tables",
        "fsdp_conformance.gate.compare",
        "fsdp_conformance.gate.difference",
        "fsdp_conformance.gate.figures",
        "fsdp_conformance.gate.structure",
        "fsdp_conformance.gate.new_warnings",
    )
    # the control: the probe sees torch where a module does load it (the suite run does)
    assert loads_torch("fsdp_conformance.gate.suite")


def test_help_a_bad_flag_and_compare_run_through_main_without_torch(tmp_path: Path) -> None:
    # main() itself, not only the import: its error handling must not import the model and
    # policy modules (torch) up front, which would cost `compare` and `--help` about 2 s.
    from fsdp_conformance.gate.report import build_report, write_json_report
    from fsdp_conformance.settings import Settings

    write_json_report(str(tmp_path / "r.json"), build_report([], Settings(), 0.0))
    code = (
        "import contextlib, io\n"
        "from fsdp_conformance import cli\n"
        "def call(*argv):\n"
        "    out = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):\n"
        "            code = cli.main(list(argv))\n"
        "    except SystemExit as exc:\n"
        "        code = exc.code\n"
        "    except ImportError:\n"
        "        if not attempts:\n"
        "            raise\n"
        "        code = 'torch'\n"
        "    print(code, bool(attempts))\n"
        "call('--help')\n"
        "call('run', '--bogus')\n"
        "call('compare', 'r.json', 'missing.json')\n"  # a bad report: exit 2
        "call('compare', 'r.json', 'r.json')\n"  # no check in common: exit 2
        "call('run', '--list')\n"
    )  # the control: the suite's checks do load torch
    assert probe(code, cwd=tmp_path).splitlines() == [
        "0 False",
        "2 False",
        "2 False",
        "2 False",
        "torch True",
    ]


@pytest.mark.parametrize("old", ["reports", "suite", "plots"])
def test_the_flat_gate_modules_are_gone_without_shims(old: str) -> None:
    # A shim would keep stale imports working and hide them from review; every importer names
    # the gate module.
    # (The package folder, not find_spec: an editable install of another checkout would answer.)
    package = Path(fsdp_conformance.__file__).parent
    assert not (package / f"{old}.py").exists()
    assert (package / "gate" / f"{GATE_HOMES[old]}.py").is_file()
    # a regular package, not a namespace one: setuptools' find() ships only those
    assert (package / "gate" / "__init__.py").is_file()


def test_user_model_rules_live_beside_the_gate_not_in_it() -> None:
    from fsdp_conformance.gate import suite
    from fsdp_conformance.models import user_model
    from fsdp_conformance.settings import Settings, SettingsError, resolve_settings

    assert user_model.user_spec(Settings()) is None
    # "--block-cls needs --model" is a rule of settings resolution (tests/test_settings.py)
    with pytest.raises(SettingsError, match="--block-cls is set but no --model"):
        resolve_settings({"block_cls": "Block"}, {}, {}, flag_style="cli")
    # the suite run uses the one rule, not a copy of it
    assert suite.user_spec is user_model.user_spec
