"""The README's figures cannot go stale: every count of checks it states is the
check registry's (what ``fsdp-conformance run --list`` prints), and its torch matrix, with
docs/torch-matrix.md and docs/torch-matrix.svg, is what the committed data
(docs/torch-matrix.json, written by ``ci/readme-matrix.py`` from ``ci/torch-matrix.sh``'s
reports) renders. No ranks, no torch run: the registry and the files only."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from fsdp_conformance.claims import all_checks
from fsdp_conformance.gate import matrix, suite
from fsdp_conformance.models.model_spec import ModelSpec

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DATA = ROOT / "docs" / "torch-matrix.json"
FIX = "re-run ci/torch-matrix.sh, then ci/readme-matrix.py MATRIX_OUT/matrix.json"


#: A user's model as ``--model`` names it: the selection is the same on every model.
USER = ModelSpec(reference=None, factory="mypkg.model:build")


def cpu_lane_ids(spec: ModelSpec | None = None) -> list[str]:
    """The report ids (``check[cpu,ws2,variant]``) of a run on the CPU lane at world size 2:
    the reference models' (no ``spec``), or a user model's."""
    return [
        f"{c.name}[cpu,ws2{',' + v if (v := suite.variant_of(p)) else ''}]"
        for c, p in suite.select_checks(all_checks(), spec)
        if "cpu" in c.lanes
    ]


def registry_counts() -> dict[str, int]:
    """Every count of checks the README may state, from the registry: what ``run --list``
    lists and what a CPU run runs (the GPU-only checks left out), on the reference models and
    on a user's model."""
    return {
        "listed, reference models": len(suite.select_checks(all_checks(), None)),
        "run on the CPU lane, reference models": len(cpu_lane_ids()),
        "listed, a user's model": len(suite.select_checks(all_checks(), USER)),
        "run on the CPU lane, a user's model": len(cpu_lane_ids(USER)),
    }


def prose(text: str) -> str:
    """``text`` without its code blocks (transcripts of past runs) and the generated matrix."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return re.sub(
        re.escape(matrix.BLOCK_START) + ".*?" + re.escape(matrix.BLOCK_END),
        "",
        text,
        flags=re.DOTALL,
    )


def test_every_count_of_checks_in_the_readme_is_the_registrys() -> None:
    """ "N checks" in the README's prose (outside transcripts and the generated matrix) is one of
    the registry's counts."""
    counts = registry_counts()
    stated = [int(n) for n in re.findall(r"\b(\d+) checks\b", prose(README.read_text("utf-8")))]
    assert stated, "README.md states no count of checks: the test would hold nothing"
    wrong = [n for n in stated if n not in counts.values()]
    assert not wrong, f"README.md states {wrong} checks; the registry's counts are {counts}"


def test_the_readmes_runs_on_user_models_add_up_to_a_run_today() -> None:
    """A whole run's summary line on a user model and each row of the architectures table add
    up to what a CPU run on a user's model runs."""
    text = README.read_text(encoding="utf-8")
    runs = re.findall(
        r"^\$ fsdp-conformance run --model [^\n]*\n(?:\.\.\.\n)?(\d+) passed, (\d+) failed, "
        r"(\d+) skipped, (\d+) errors, (\d+) expected failures?",
        text,
        flags=re.MULTILINE,
    )
    rows = re.findall(
        r"^\| `\w+`[^|]*\|[^|]*\| (\d+) / (\d+) / (\d+) / (\d+) / (\d+) \|", text, re.MULTILINE
    )
    assert runs and rows, "README.md: the user-model run and the architectures table are gone"
    user = registry_counts()["run on the CPU lane, a user's model"]
    sums = [sum(map(int, figures)) for figures in runs + rows]
    assert sums == [user] * len(sums), (
        f"README.md: the runs on user models add up to {sums} checks, a CPU run has {user} "
        "today; measure them again (ci/architectures.sh)"
    )


def published() -> dict[str, Any]:
    if not DATA.is_file():
        pytest.fail(f"{DATA.relative_to(ROOT)} is missing; {FIX}")
    data: dict[str, Any] = json.loads(DATA.read_text(encoding="utf-8"))
    return data


@pytest.mark.parametrize(
    ("path", "differing"), [("README.md", True), ("docs/torch-matrix.md", False)]
)
def test_the_published_matrix_is_what_the_committed_data_renders(
    path: str, differing: bool
) -> None:
    text = (ROOT / path).read_text(encoding="utf-8")
    assert matrix.current_block(text) == matrix.published_block(published(), differing=differing), (
        f"{path}: the torch matrix between {matrix.BLOCK_START} and {matrix.BLOCK_END} is not "
        f"what docs/torch-matrix.json renders; {FIX}"
    )


def test_the_matrix_picture_is_what_the_committed_data_renders() -> None:
    svg = (ROOT / "docs" / "torch-matrix.svg").read_text(encoding="utf-8")
    assert svg == matrix.to_svg(matrix.from_data(published())), f"docs/torch-matrix.svg: {FIX}"


def test_the_published_matrix_has_every_check_a_run_runs_today() -> None:
    """The matrix's rows are the checks a CPU run on the reference models runs today: a check
    added or renamed since the measurement fails here until the matrix is measured again."""
    rows, ids = list(published()["rows"]), cpu_lane_ids()
    assert sorted(rows) == sorted(ids), (
        f"docs/torch-matrix.json lacks {sorted(set(ids) - set(rows))} and has "
        f"{sorted(set(rows) - set(ids))}; {FIX}"
    )


def test_the_matrix_data_round_trips() -> None:
    """``matrix.json`` (what ``fsdp-conformance matrix --out`` writes) reads back as the matrix
    it was written from, cell by cell: the published tables are the measured ones."""
    table = matrix.from_data(published())
    assert matrix.from_data(matrix.to_data(table)) == table
    assert table.columns and all(len(v) == len(table.columns) for v in published()["rows"].values())
