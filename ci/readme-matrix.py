"""Publish a measured torch matrix: docs/torch-matrix.json (the data), docs/torch-matrix.svg, the
table in docs/torch-matrix.md (every row) and the one in README.md (the differing rows), each
between the <!-- torch-matrix --> markers. tests/test_readme_figures.py fails when the README or
the page differ from what the committed data renders.

Usage: python ci/readme-matrix.py MATRIX_JSON [--measured-at TEXT]
  MATRIX_JSON: the matrix.json `fsdp-conformance matrix --out DIR` wrote (ci/torch-matrix.sh's
  MATRIX_OUT); --measured-at: what was measured, as the page says it (default: the commit
  checked out here, `main at <short sha>`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from fsdp_conformance.gate import matrix

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "torch-matrix.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("matrix_json")
    parser.add_argument("--measured-at", default=None)
    args = parser.parse_args()
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    data = json.loads(Path(args.matrix_json).read_text(encoding="utf-8"))
    data["measured_at"] = args.measured_at or f"`{sha}`"
    DATA.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (ROOT / "docs" / "torch-matrix.svg").write_text(
        matrix.to_svg(matrix.from_data(data)), encoding="utf-8"
    )
    for path, differing in (("docs/torch-matrix.md", False), ("README.md", True)):
        text = (ROOT / path).read_text(encoding="utf-8")
        block = matrix.published_block(data, differing=differing)
        (ROOT / path).write_text(matrix.replace_block(text, block, path), encoding="utf-8")
        print(f"readme-matrix: {path}")


if __name__ == "__main__":
    main()
