"""The architectures of ``hf_models.ARCHITECTURES`` (ci/architectures.sh runs the whole suite on
each): each passes the preflight with ``--model`` alone (``--input`` for the vision model), so a
correctly set-up model of every kind reaches its checks, and the script refuses a name it does
not know with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_conformance import hf_models
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.user_model import validate_user_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.cpu
@pytest.mark.parametrize("name", sorted(hf_models.ARCHITECTURES))
def test_every_architecture_passes_the_preflight_with_only_its_model(name: str) -> None:
    _, input_builder = hf_models.ARCHITECTURES[name]
    spec = ModelSpec(
        reference=None, factory=f"fsdp_conformance.hf_models:{name}", input_builder=input_builder
    )
    notes = validate_user_model(spec, ["cpu"], [2])
    # BERT's default block classes would split its tied embedding: the run goes on with the
    # classes that keep it whole, and says so; every other architecture needs no note.
    assert [n for n in notes if "BertLayer" not in n] == []
    assert (name == "bert") == any("BertLayer" in n for n in notes)


@pytest.mark.process
def test_the_architectures_script_refuses_an_unknown_model_in_one_line() -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "ci" / "architectures.sh"), "gpt9"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, "OUT": "/nonexistent-unused"},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "architectures.sh: unknown model 'gpt9'; choose from llama, gpt2, mixtral, bert"
        )
    )
