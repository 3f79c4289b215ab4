"""The whole run on a model with a frozen parameter inside every block unit
(``tests/trait_models.py`` ``frozen_in_block``): FSDP1 runs it with ``use_orig_params=True``, the
preflight's one line says so, no check meets torch's flatten error, and nothing fails or errors
(FSDP1's local state dict under ``use_orig_params=True`` is the torch defect of
``expectations.toml``'s entries for ``state.round_trip`` and ``loop.buffers``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_conformance import cli

REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.mark.process  # a whole run: the process lane
def test_the_whole_run_on_a_model_with_frozen_parameters_in_its_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_conformance.gate.report import load_report

    for variable in [k for k in os.environ if k.startswith("FSDP_CONFORMANCE_")]:
        monkeypatch.delenv(variable)
    monkeypatch.chdir(tmp_path)  # no pyproject table of this repository applies
    monkeypatch.syspath_prepend(str(REPOSITORY))  # tests.trait_models, here and on the ranks
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")])
    )
    code = cli.main(
        [
            "run",
            "--model",
            "tests.trait_models:frozen_in_block",
            "--block-cls",
            "Block",
            "--out",
            str(tmp_path / "out"),
            "--no-plot",
        ]
    )
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if "use_orig_params=True" in line]
    assert len(notes) == 1 and "the FSDP1 checks run with the fix" in notes[0], err
    assert "Must flatten tensors" not in out.replace(notes[0], "")
    report = load_report(str(tmp_path / "out" / "report.json"))
    # The report keeps what the console said: the fix the FSDP1 checks ran with.
    assert report.get("notes") == [notes[0].split("note: ", 1)[1]], report.get("notes")
    summary = (tmp_path / "out" / "summary.md").read_text(encoding="utf-8")
    assert f"Note: {report['notes'][0]}" in summary
    bad = [
        f"{e['id']}: {e['outcome']}: {e['message'][:600]}"
        for e in report["checks"]
        if e["outcome"] in ("failed", "error")
    ]
    assert bad == [], "\n".join(bad)
    assert code == cli.EXIT_OK, out + err
    fsdp1 = [e for e in report["checks"] if "fsdp1" in str(e["variant"])]
    assert sum(e["outcome"] == "passed" for e in fsdp1) >= 30
