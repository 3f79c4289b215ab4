"""Run the whole suite on every model of the corpus and write a table (docs/corpus.md).

Each model gets ``fsdp-conformance run --model corpus.models:NAME`` (plus ``--input`` where its
forward takes no token ids, ``--block-cls`` for the hand-written styles, which no
``_no_split_modules`` names), one model at a time, its report under ``OUT/NAME/``. The table
(``OUT/corpus.md`` and ``OUT/corpus.json``): model, kind, the outcome counts, wall seconds, and
``clean`` (0 failed, 0 errors) or the cause classes of its non-pass rows
(``corpus/causes.py``). Resumable: a model whose report (or preflight refusal) exists is not
run again unless ``--force``.

Usage:
  python benchmarks/run_corpus.py --list
  python benchmarks/run_corpus.py [--only NAME ...] [--out DIR] [--python PY] [--force]
  python benchmarks/run_corpus.py --probe   # which architectures build and train at tiny size
  python benchmarks/run_corpus.py --table   # the table of the reports so far, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from corpus import causes, models  # noqa: E402 - after the path that finds them

#: The longest one model's whole run may take before it is stopped and recorded as such.
MODEL_TIMEOUT_S = 3600
#: Run first (after the hand-written styles): widely trained architectures of every kind, so
#: that a partial run is already a varied sample.
WELL_KNOWN = (
    "llama",
    "vit",
    "bert",
    "t5",
    "mixtral",
    "wav2vec2",
    "gpt2",
    "qwen2_moe",
    "bart",
    "mobilenet_v2",
    "gemma2",
    "deepseek_v3",
    "roberta",
    "hubert",
    "mamba",
    "beit",
    "phi3",
    "olmoe",
    "whisper",
    "distilbert",
    "mistral",
    "switch_transformers",
    "opt",
    "dinov2",
    "gpt_oss",
    "falcon",
    "modernbert",
    "qwen3",
    "mbart",
    "gpt_neox",
)


def corpus_names() -> dict[str, str]:
    """name -> kind of every model the corpus runs: the hand-written styles, then the probed
    survivors, interleaved by kind (a varied sample comes first)."""
    survivors = models.load_survivors()["survivors"]
    by_kind: dict[str, list[str]] = {}
    for name, row in sorted(survivors.items()):
        by_kind.setdefault(row["kind"], []).append(name)
    order = {name: "hand-written" for name in models.hand_written()}
    order.update((name, survivors[name]["kind"]) for name in WELL_KNOWN if name in survivors)
    queues = [list(v) for _, v in sorted(by_kind.items())]
    while any(queues):
        for queue in queues:
            if queue:
                name = queue.pop(0)
                order.setdefault(name, survivors[name]["kind"])
    return order


def command(name: str, out: Path, python: str) -> list[str]:
    args = [python, "-m", "fsdp_conformance.cli", "run", "--no-plot", "--out", str(out)]
    args += ["--model", f"{models.MODULE}:{name}"]
    flag = models.input_flag(name)
    if flag:
        args += ["--input", flag]
    style = models.hand_written().get(name)
    if style and style.block_cls:
        args += ["--block-cls", style.block_cls]
    return args


def run_one(name: str, out: Path, python: str) -> dict[str, Any]:
    """One model's whole run; its row (also written to ``OUT/NAME/row.json``)."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.perf_counter()
    with open(folder / "run.log", "w") as log:
        try:
            done = subprocess.run(
                command(name, folder, python),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=MODEL_TIMEOUT_S,
            )
            code: int | str = done.returncode
        except subprocess.TimeoutExpired:
            code = f"stopped after {MODEL_TIMEOUT_S} s"
    row = row_of(name, folder, code, round(time.perf_counter() - start, 1))
    (folder / "row.json").write_text(json.dumps(row, indent=1) + "\n")
    return row


def row_of(name: str, folder: Path, code: int | str, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "kind": corpus_names().get(name, "?"), "wall_s": seconds}
    report_path = folder / "report.json"
    if not report_path.exists():
        log = (folder / "run.log").read_text() if (folder / "run.log").exists() else ""
        lines = [line for line in log.splitlines() if "error:" in line] or log.splitlines()[-1:]
        why = lines[-1].split("error:", 1)[-1].strip()[:160] if lines else "no output"
        row.update(
            status="refused", exit=code, cause=f"refused before any rank (exit {code}): {why}"
        )
        return row
    report = json.loads(report_path.read_text())
    summary = report.get("summary", {})
    rows = causes.non_pass(report)
    row.update(
        exit=code,
        passed=summary.get("passed", 0),
        failed=summary.get("failed", 0),
        skipped=summary.get("skipped", 0),
        errors=summary.get("error", 0),
        xfailed=summary.get("xfailed", 0),
        status="clean" if not rows else "not clean",
        causes=dict(Counter(r["cause"] for r in rows)),
        non_pass=rows,
    )
    return row


def write_table(out: Path, rows: list[dict[str, Any]]) -> None:
    (out / "corpus.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "| model | kind | passed | failed | skipped | errors | xfailed | wall s | clean or causes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        counts = [str(r.get(k, "-")) for k in ("passed", "failed", "skipped", "errors", "xfailed")]
        verdict = r.get("cause") or (
            "clean"
            if r["status"] == "clean"
            else "; ".join(f"{c} ({n})" for c, n in sorted(r["causes"].items()))
        )
        lines.append(
            f"| {r['model']} | {r['kind']} | {' | '.join(counts)} | {r['wall_s']} | {verdict} |"
        )
    clean = sum(r["status"] == "clean" for r in rows)
    lines += ["", f"{clean} of {len(rows)} clean.", ""]
    lines += cause_lines(rows)
    (out / "corpus.md").write_text("\n".join(lines) + "\n")


def cause_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each cause class: how many models and rows it names, and one representative row (the
    first seen: its check id and the first line of its message)."""
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        for row in r.get("non_pass", []):
            entry = seen.setdefault(row["cause"], {"models": set(), "rows": 0, "first": row})
            entry["models"].add(r["model"])
            entry["rows"] += 1
    lines = ["| cause | models | rows | a representative row |", "|---|---|---|---|"]
    for cause, entry in sorted(seen.items(), key=lambda kv: -len(kv[1]["models"])):
        first = entry["first"]
        detail = first["detail"].replace("|", "\\|")
        lines.append(
            f"| {cause} | {len(entry['models'])} | {entry['rows']} | `{first['id']}` "
            f"({first['outcome']}): {detail} |"
        )
    return lines


def existing_row(name: str, out: Path) -> dict[str, Any] | None:
    """A model's row from its earlier run, read again from its report (so that the cause
    classes are today's), or None when it has not run."""
    path = out / name / "row.json"
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    return row_of(name, out / name, old.get("exit", "?"), old["wall_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the corpus, run nothing")
    parser.add_argument("--probe", action="store_true", help="probe every architecture")
    parser.add_argument("--table", action="store_true", help="write the table of existing rows")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these models only")
    parser.add_argument("--out", type=Path, default=ROOT / "fsdp-conformance-report" / "corpus")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the suite")
    parser.add_argument("--force", action="store_true", help="run models whose report exists")
    args = parser.parse_args(argv)
    if args.probe:
        result = models.probe_all(sorted(models.architectures()), lambda s: print(s, flush=True))
        models.SURVIVORS.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"{len(result['survivors'])} survivors, {len(result['failed'])} failed to build")
        return 0
    names = corpus_names()
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            parser.error(f"unknown corpus model(s) {', '.join(unknown)}; see --list")
        names = {n: names[n] for n in args.only}
    if args.list:
        for name, kind in names.items():
            print(
                f"{name:28} {kind:13} {' '.join(command(name, Path('OUT') / name, 'python')[3:])}"
            )
        print(f"{len(names)} models")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(names, 1):
        row = existing_row(name, args.out)
        if row is None and not args.table or args.force:
            print(f"[{i}/{len(names)}] {name} ({names[name]}) ...", flush=True)
            row = run_one(name, args.out, args.python)
        if row is None:
            continue
        rows.append(row)
        verdict = row.get("cause") or (row["status"] if row["status"] == "clean" else row["causes"])
        print(f"[{i}/{len(names)}] {name}: {verdict} ({row['wall_s']} s)", flush=True)
        write_table(args.out, rows)
    write_table(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
