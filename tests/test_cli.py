"""``fsdp-conformance run|compare`` and the user's own model, end to end.

The real suite runs a few times only, narrowed with ``--checks``: once as a subprocess (the
report, the table, progress, exit 0), once in process with an injected failing check (exit 1),
once on a user model whose forward breaks (exit 1). Every bad input is checked through
``main(argv)`` in process (``run --list`` validates the model without running a check), and
the pytest front end (``--fsdp-model``) through ``pytester`` subprocesses.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_conformance import cli, reports, suite
from fsdp_conformance.checks import Check, Verdict
from fsdp_conformance.settings import OPTIONS, Settings

pytestmark = pytest.mark.cpu

#: A guard on each subprocess (not a timing assertion): the narrowed runs take seconds.
SUBPROCESS_LIMIT_S = 240

USER_MODULE = "fsdpc_user_model"
USER_MODEL = '''
"""A user's model package, as ``--model`` sees it."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self, dim=32, layers=2):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class BrokenNet(Net):
    def forward(self, x):
        raise RuntimeError("forward is broken on purpose")


def build():
    return Net()


def broken():
    return BrokenNet()


def raises():
    raise FileNotFoundError("config.yaml")


def not_a_module():
    return {"dim": 32}


def huge():
    # 40 blocks of 16384 x 16384: 10.7 B parameters, cheap on meta where validation builds it
    return nn.Sequential(*[Block(16384) for _ in range(40)])


NOT_CALLABLE = 3
'''


@pytest.fixture(autouse=True)
def _no_outer_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Runs here see only the settings a test gives them (no env, no repo pyproject table)."""
    monkeypatch.chdir(tmp_path)
    for option in OPTIONS:
        monkeypatch.delenv(option.env, raising=False)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder holding the user's model module, on sys.path (rank processes inherit it)."""
    directory = tmp_path_factory.mktemp("user")
    (directory / f"{USER_MODULE}.py").write_text(USER_MODEL)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(directory))
        yield directory
    sys.modules.pop(USER_MODULE, None)


def run_cli(args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("FSDP_CONFORMANCE_", "PYTEST_")) and k != "GITHUB_STEP_SUMMARY"}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "fsdp_conformance.cli", *args], cwd=cwd,
                          env=environ, capture_output=True, text=True, check=False,
                          timeout=SUBPROCESS_LIMIT_S)


def main(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, command: str, *parts: str) -> None:
    assert code == cli.EXIT_USAGE, (out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"fsdp-conformance {command}: error: ")
    assert "Traceback" not in err
    for part in parts:
        assert part in lines[0], (part, lines[0])


# --------------------------------------------------------------------------------------------
# run: a real, narrowed run (subprocess)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`fsdp-conformance run --checks wrap.units.exact` on the reference models."""
    directory = tmp_path_factory.mktemp("run")
    step_summary = directory / "step_summary.md"
    step_summary.write_text("earlier step\n")
    result = run_cli(["run", "--checks", "wrap.units.exact", "--out", "out"], directory,
                     {"GITHUB_STEP_SUMMARY": str(step_summary)})
    return result, directory


def test_run_exits_0_and_writes_report_and_summary(
    real_run: tuple[subprocess.CompletedProcess[str], Path]
) -> None:
    result, directory = real_run
    assert result.returncode == cli.EXIT_OK, result.stderr
    out = directory / "out"
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "summary.md"]  # no temp files
    assert (out / "summary.md").read_text().startswith("## FSDP conformance: PASS")
    # appended to the CI job summary, after what was there
    assert (directory / "step_summary.md").read_text().startswith(
        "earlier step\n## FSDP conformance: PASS")
    assert result.stdout.splitlines()[-2:] == ["report: out/report.json", "summary: out/summary.md"]


def test_run_report_has_the_schema_environment_settings_and_unit_trees(
    real_run: tuple[subprocess.CompletedProcess[str], Path]
) -> None:
    _, directory = real_run
    report = reports.load_report(str(directory / "out" / "report.json"))
    assert report["schema"] == "fsdp-conformance-report" and report["schema_version"] == 1
    assert report["environment"]["torch"] == torch.__version__
    assert report["settings"]["world_sizes"] == [2] and report["settings"]["model"] is None
    assert report["summary"] == {"passed": 4, "failed": 0, "skipped": 0, "error": 0}
    ids = [e["id"] for e in report["checks"]]
    assert ids == [f"wrap.units.exact[cpu,ws2,{v},{m}]"
                   for v in ("fsdp1", "fsdp2") for m in ("massive", "tied")]
    for e in report["checks"]:
        assert e["outcome"] == "passed" and e["seconds"] >= 0
        units = reports.unit_list(e)
        assert units is not None and units[0]["fqn"] == "" and units[0]["parent"] is None
        blocks = [u for u in units if u["cls"] == "DecoderLayer"]
        assert blocks and all(u["local_numel"] * 2 == u["numel"] for u in blocks)  # ws 2
        assert e["figures"]["units"] == len(units)


def test_run_prints_the_table_and_progress_on_stderr(
    real_run: tuple[subprocess.CompletedProcess[str], Path]
) -> None:
    result, _ = real_run
    table = result.stdout
    assert table.splitlines()[0].split() == ["check", "outcome", "key", "figures"]
    assert any(line.startswith("wrap.units.exact[cpu,ws2,fsdp1,massive]") and " PASSED " in line
               and "units 6" in line for line in table.splitlines())
    assert "4 passed, 0 failed, 0 skipped, 0 errors in " in table
    err = result.stderr.splitlines()
    assert err[0].startswith(f"fsdp-conformance: torch {torch.__version__}")
    progress = [line for line in err if line.startswith("[")]
    assert [line.split(" ... ")[0] for line in progress] == [
        "[1/4] wrap.units.exact [cpu, ws2, fsdp1,massive]",
        "[2/4] wrap.units.exact [cpu, ws2, fsdp1,tied]",
        "[3/4] wrap.units.exact [cpu, ws2, fsdp2,massive]",
        "[4/4] wrap.units.exact [cpu, ws2, fsdp2,tied]",
    ]
    assert all(" ... passed (" in line for line in progress)


def test_compare_a_real_report_with_itself_and_with_a_changed_unit(
    real_run: tuple[subprocess.CompletedProcess[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    old = str(real_run[1] / "out" / "report.json")
    code, out, _ = main(["compare", old, old], capsys)
    assert code == cli.EXIT_OK and out.splitlines()[-1] == "no differences"
    changed = json.loads(Path(old).read_text())
    layer = next(u for u in reports.unit_list(changed["checks"][0]) or [] if u["fqn"] == "layers.1")
    layer["numel"] += 64
    new = tmp_path / "new.json"
    new.write_text(json.dumps(changed))
    code, out, _ = main(["compare", old, str(new)], capsys)
    assert code == cli.EXIT_FAILED
    assert ("[REGRESSION] wrap.units.exact[cpu,ws2,fsdp1,massive]: units: unit structure "
            "changed: ~ layers.1 numel: 37248 -> 37312") in out


# --------------------------------------------------------------------------------------------
# run: failures, --list, --checks (in process)
# --------------------------------------------------------------------------------------------


def _report_value(ctx: Any, value: int, expected: int) -> dict[str, int]:
    # the rank only reports; the verdict (in the parent) compares with ``expected``
    return {"rank": ctx.rank, "value": value}


def _verdict_expected(values: Sequence[Mapping[str, int]], params: Mapping[str, Any]) -> Verdict:
    # every rank's value, not rank 0's alone
    wrong = [f"rank {v['rank']} reported {v['value']}" for v in values
             if v["value"] != params["expected"]]
    if wrong:
        return Verdict(False, f"expected {params['expected']} on every rank: " + ", ".join(wrong),
                       {"value": values[0]["value"]})
    return Verdict(True, f"{params['expected']} on every rank", {"value": values[0]["value"]})


PASSING = Check("test.right", "wrap", "every rank reports the expected value", _report_value,
                _verdict_expected, params={"value": 2, "expected": 2}, lanes=("cpu",))
FAILING = Check("test.wrong", "wrap", "every rank reports the expected value", _report_value,
                _verdict_expected, params={"value": 1, "expected": 2}, lanes=("cpu",))


def test_run_suite_reports_a_failing_check_as_failed_with_progress() -> None:
    stream = io.StringIO()
    report = suite.run_suite(Settings(), ["cpu"], checks=[PASSING, FAILING], stream=stream)
    assert report["summary"] == {"passed": 1, "failed": 1, "skipped": 0, "error": 0}
    failed = report["checks"][1]
    assert failed["id"] == "test.wrong[cpu,ws2]" and failed["outcome"] == "failed"
    assert failed["message"] == "expected 2 on every rank: rank 0 reported 1, rank 1 reported 1"
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[1/2] test.right [cpu, ws2] ... passed (")
    assert lines[1].startswith("[2/2] test.wrong [cpu, ws2] ... failed (")
    assert lines[2] == "      expected 2 on every rank: rank 0 reported 1, rank 1 reported 1"


def test_run_exits_1_when_a_check_fails_and_still_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(suite, "all_checks", lambda: [PASSING, FAILING])
    code, out, err = main(["run", "--out", str(tmp_path)], capsys)
    assert code == cli.EXIT_FAILED
    report = reports.load_report(str(tmp_path / "report.json"))
    assert [e["outcome"] for e in report["checks"]] == ["passed", "failed"]
    assert "test.wrong[cpu,ws2]  FAILED   expected 2 on every rank" in out
    assert "[2/2] test.wrong [cpu, ws2] ... failed" in err  # progress, on stderr
    assert (tmp_path / "summary.md").read_text().startswith("## FSDP conformance: FAIL")


def test_run_exits_1_when_the_user_models_forward_breaks(
    user_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = main(["run", "--model", f"{USER_MODULE}:broken", "--block-cls", "Block",
                         "--checks", "wrap.train.fp32", "--out", str(tmp_path)], capsys)
    assert code == cli.EXIT_FAILED
    report = reports.load_report(str(tmp_path / "report.json"))
    assert report["settings"]["model"] == f"{USER_MODULE}:broken"
    assert [(e["id"], e["outcome"]) for e in report["checks"]] == [
        (f"wrap.train.fp32[cpu,ws2,{v},{USER_MODULE}:broken]", "error") for v in ("fsdp1", "fsdp2")
    ]
    assert all("forward is broken on purpose" in e["message"] for e in report["checks"])
    assert "RuntimeError: forward is broken on purpose" in out  # the table's reason column


def test_list_shows_each_check_and_variant_once(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = main(["run", "--list"], capsys)
    assert code == cli.EXIT_OK
    labels = [line.split()[0] for line in out.splitlines()]
    assert len(labels) == len(set(labels)) == len(suite.select_checks(suite.all_checks(), None))
    assert "wrap.units.exact[fsdp1,massive]" in labels and "wrap.builders.size" in labels
    code, out, _ = main(["run", "--list", "--checks", "init.weights.fsdp2"], capsys)
    assert [line.split()[0] for line in out.splitlines()] == ["init.weights.fsdp2[fsdp2,llama]"]


def test_list_on_the_user_model_shows_the_checks_that_run_on_it(
    user_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = main(["run", "--list", "--model", f"{USER_MODULE}:build", "--block-cls",
                         "Block", "--checks", "wrap.units.plan"], capsys)
    assert code == cli.EXIT_OK
    assert [line.split()[0] for line in out.splitlines()] == [
        f"wrap.units.plan[fsdp1,{USER_MODULE}:build]",
        f"wrap.units.plan[fsdp2,{USER_MODULE}:build]",
    ]


def test_checks_matching_nothing_is_exit_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = main(["run", "--checks", "wrap.no_such", "--out", str(tmp_path / "o")], capsys)
    assert_one_line_error(code, out, err, "run", "no check matched --checks 'wrap.no_such'",
                          "fsdp-conformance run --list")
    assert not (tmp_path / "o").exists()  # no empty report that a gate could take for a pass


# --------------------------------------------------------------------------------------------
# The user's model: bad input, one line each (in process; --list validates without running)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (["--model", "fsdpc_no_such_pkg.model:build"],
         ["cannot import module 'fsdpc_no_such_pkg.model'", "on PYTHONPATH"]),
        (["--model", f"{USER_MODULE}:buidl"],
         [f"module '{USER_MODULE}' has no attribute 'buidl'", "check the name after the colon"]),
        (["--model", USER_MODULE], ["is not of the form 'pkg.module:name'"]),
        (["--model", f"{USER_MODULE}:NOT_CALLABLE"],
         ["is not callable (int)", "name a function or class"]),
        (["--model", f"{USER_MODULE}:raises", "--block-cls", "Block"],
         [f"model factory '{USER_MODULE}:raises' raised FileNotFoundError: config.yaml",
          "fix the factory"]),
        (["--model", f"{USER_MODULE}:not_a_module", "--block-cls", "Block"],
         ["returned dict, not an nn.Module", "make it return the model itself"]),
        (["--model", f"{USER_MODULE}:build"],
         ["no block class given", "pass --fsdp-block-cls"]),
        (["--model", f"{USER_MODULE}:build", "--block-cls", "TransformerBlock"],
         ["'TransformerBlock' matches no module class in the model Net",
          f"its module classes are: {USER_MODULE}.Net", f"{USER_MODULE}.Block"]),
        (["--model", f"{USER_MODULE}:build", "--block-cls", "Net"],
         ["the wrap policy wraps nothing but the root", "block classes Net",
          "names the model's block class"]),
        (["--block-cls", "Block"], ["--block-cls is set but no --model", "--model mypkg"]),
        (["--model", f"{USER_MODULE}:build", "--block-cls", "Block", "--min-params", "lots"],
         ["invalid min_params 'lots' from command line --fsdp-min-params", "expected N"]),
    ],
    ids=["import-path", "attribute", "no-colon", "not-callable", "factory-raises", "not-module",
         "no-block-cls", "block-not-in-model", "wraps-nothing", "block-without-model",
         "bad-min-params"],
)
def test_bad_user_model_input_is_one_line_and_exit_2(
    user_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], parts: list[str]
) -> None:
    code, out, err = main(["run", "--list", *args], capsys)
    assert_one_line_error(code, out, err, "run", *parts)


def test_model_too_large_for_the_cpu_lane_is_one_line_and_exit_2(
    user_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(suite, "_available_host_bytes", lambda: 64 * 2**30)
    code, out, err = main(["run", "--list", "--model", f"{USER_MODULE}:huge", "--block-cls",
                           "Block"], capsys)
    assert_one_line_error(code, out, err, "run", "has 10.74 B parameters",
                          "needs about 320.0 GiB of host memory, 64.0 GiB is available",
                          "use a smaller config of the model", "fsdp-conformance plan")
    # the gpu lane alone does not hold the model in host memory
    code, out, err = main(["run", "--list", "--lane", "gpu", "--model", f"{USER_MODULE}:huge",
                           "--block-cls", "Block", "--checks", "wrap.units.plan"], capsys)
    assert code == cli.EXIT_OK, err


def test_bad_model_input_from_the_command_line_prints_no_traceback(user_dir: Path) -> None:
    result = run_cli(["run", "--model", f"{USER_MODULE}:build", "--block-cls", "Nope"], user_dir,
                     {"PYTHONPATH": str(user_dir)})
    assert result.returncode == cli.EXIT_USAGE
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        (f"fsdp-conformance run: error: block class 'Nope' matches no module class in the model "
         f"Net; its module classes are: {USER_MODULE}.Net, torch.nn.modules.linear.Linear, "
         f"torch.nn.modules.container.ModuleList, {USER_MODULE}.Block")
    ]


def test_pyproject_table_gives_the_cli_its_model_and_an_unknown_key_is_exit_2(
    user_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(f'[tool.fsdp_conformance]\nmodel = "{USER_MODULE}:build"\n'
                         'block_cls = "Block"\nworld_sizes = [2, 4]\n')
    code, out, err = main(["run", "--list", "--checks", "init.meta_build"], capsys)
    assert code == cli.EXIT_OK, err
    assert out.split()[0] == f"init.meta_build[{USER_MODULE}:build]"
    pyproject.write_text('[tool.fsdp_conformance]\nmodel = "x:y"\nblock-cls = "Block"\n')
    code, out, err = main(["run", "--list"], capsys)
    assert_one_line_error(code, out, err, "run", "unknown key(s) block-cls",
                          "known keys: world_sizes, backend, timeout, model, block_cls")


# --------------------------------------------------------------------------------------------
# compare through the CLI (hand-built reports)
# --------------------------------------------------------------------------------------------


def _entry(check: str, outcome: str = "passed", **figures: Any) -> dict[str, Any]:
    return reports.check_entry(check=check, claim="memory", lane="cpu", world_size=2,
                               variant="fsdp2,massive", outcome=outcome, message="why: " + outcome,
                               figures=figures, data={}, seconds=0.1, warnings=())


def _write_report(path: Path, *entries: dict[str, Any], torch_version: str) -> str:
    report = reports.build_report(list(entries), Settings(), 1.0)
    report["environment"]["torch"] = torch_version
    reports.write_json_report(str(path), report)
    return str(path)


@pytest.fixture
def pair(tmp_path: Path) -> tuple[str, str, str]:
    """(old, new with one memory move of +6% and a fail->pass, new identical to old)."""
    old = [_entry("memory.peak", peak_bytes=100 * 2**20), _entry("wrap.mixed", "failed")]
    new = [_entry("memory.peak", peak_bytes=106 * 2**20), _entry("wrap.mixed", "passed")]
    return (_write_report(tmp_path / "old.json", *old, torch_version="2.13.0"),
            _write_report(tmp_path / "new.json", *new, torch_version="2.14.1"),
            _write_report(tmp_path / "same.json", *copy.deepcopy(old), torch_version="2.14.1"))


def test_compare_exit_1_on_a_regression_and_lists_every_difference(
    pair: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    old, new, _ = pair
    code, out, _ = main(["compare", old, new], capsys)
    assert code == cli.EXIT_FAILED
    assert out.splitlines() == [
        "compare: torch 2.13.0 -> 2.14.1: 1 regression(s), 2 difference(s)",
        ("  [REGRESSION] memory.peak[cpu,ws2,fsdp2,massive]: memory: peak_bytes: 100.00 MiB -> "
         "106.00 MiB (+6.0%; tolerance 5%, floor 1.00 MiB)"),
        "  [change] wrap.mixed[cpu,ws2,fsdp2,massive]: outcome: failed -> passed",
    ]


def test_compare_memory_tolerance_flag_turns_the_move_into_no_regression(
    pair: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    old, new, _ = pair
    code, out, _ = main(["compare", old, new, "--memory-tolerance", "0.1"], capsys)
    assert code == cli.EXIT_OK  # the remaining difference (fail -> pass) is not a regression
    assert "0 regression(s), 1 difference(s)" in out
    code, out, _ = main(["compare", old, new, "--memory-tolerance", "0.1", "--fail-on-change"],
                        capsys)
    assert code == cli.EXIT_FAILED
    code, out, _ = main(["compare", old, new, "--memory-floor-mib", "10"], capsys)
    assert code == cli.EXIT_OK and "memory" not in out


def test_compare_identical_reports_exit_0_with_no_differences(
    pair: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    old, _, same = pair
    for extra in ([], ["--fail-on-change"]):
        code, out, _ = main(["compare", old, same, *extra], capsys)
        assert code == cli.EXIT_OK
        assert out.splitlines() == [
            "compare: torch 2.13.0 -> 2.14.1: 0 regression(s), 0 difference(s)", "no differences"]


def test_compare_json_output_parses_and_counts_regressions(
    pair: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    old, new, _ = pair
    code, out, _ = main(["compare", old, new, "--json"], capsys)
    assert code == cli.EXIT_FAILED
    data = json.loads(out)
    assert data["regressions"] == 1
    assert data["old"] == {"path": old, "torch": "2.13.0"}
    assert data["new"] == {"path": new, "torch": "2.14.1"}
    assert data["memory_tolerance"] == 0.05 and data["memory_floor_mib"] == 1.0
    assert [(d["check_id"], d["kind"], d["regression"]) for d in data["differences"]] == [
        ("memory.peak[cpu,ws2,fsdp2,massive]", "memory", True),
        ("wrap.mixed[cpu,ws2,fsdp2,massive]", "outcome", False),
    ]


def _bad_report(tmp_path: Path, kind: str) -> str:
    path = tmp_path / f"{kind}.json"
    if kind == "missing":
        return str(path)
    if kind == "not-json":
        path.write_text("<html>not a report</html>")
    elif kind == "schema":
        path.write_text(json.dumps({"schema": "other", "checks": []}))
    elif kind == "version":
        report = reports.build_report([], Settings(), 0.0)
        report["schema_version"] = 99
        path.write_text(json.dumps(report))
    return str(path)


@pytest.mark.parametrize(
    ("kind", "part"),
    [("missing", "does not exist"), ("not-json", "is not valid JSON"),
     ("schema", "is not an fsdp-conformance report"), ("version", "has schema version 99")],
)
def test_compare_bad_report_is_one_line_and_exit_2(
    pair: tuple[str, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    kind: str, part: str,
) -> None:
    bad = _bad_report(tmp_path, kind)
    for args in ([pair[0], bad], [bad, pair[0]]):
        code, out, err = main(["compare", *args], capsys)
        assert_one_line_error(code, out, err, "compare", repr(bad), part)


@pytest.mark.parametrize("flag", ["--memory-tolerance", "--memory-floor-mib"])
def test_compare_negative_thresholds_are_one_line_and_exit_2(
    pair: tuple[str, str, str], capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    code, out, err = main(["compare", pair[0], pair[1], flag, "-1"], capsys)
    assert_one_line_error(code, out, err, "compare", f"{flag} must be", "got -1.0")


# --------------------------------------------------------------------------------------------
# The user's model through pytest (--fsdp-model), end to end
# --------------------------------------------------------------------------------------------


@pytest.fixture
def user_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A project folder with the user's model module (importable by the inner session's ranks)."""
    pytester.makepyfile(**{USER_MODULE: USER_MODEL})
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    return pytester


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fsdp-model", "fsdpc_no_such_pkg:build"],
         "ERROR: --fsdp-model: cannot import module 'fsdpc_no_such_pkg'*"),
        (["--fsdp-model", f"{USER_MODULE}:build", "--fsdp-block-cls", "TransformerBlock"],
         ("ERROR: --fsdp-model: block class 'TransformerBlock' matches no module class in the "
          f"model Net; its module classes are: {USER_MODULE}.Net, *{USER_MODULE}.Block")),
        # As `fsdp-conformance run --block-cls` without --model: not silently ignored.
        (["--fsdp-block-cls", "Block"],
         ("ERROR: --fsdp-block-cls is set but no --fsdp-model: give the model factory too "
          "(e.g. --fsdp-model mypkg.model:build_model)")),
    ],
    ids=["import-path", "block-not-in-model", "block-without-model"],
)
def test_pytest_fsdp_model_bad_input_is_a_usage_error(
    user_project: pytest.Pytester, args: list[str], message: str
) -> None:
    result = user_project.runpytest_subprocess("-m", "cpu", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str()


def test_pytest_runs_the_checks_on_the_model_from_the_pyproject_table(
    user_project: pytest.Pytester,
) -> None:
    # model from [tool.fsdp_conformance], block class from the command line: both sources at once
    user_project.makepyprojecttoml(
        f'[tool.fsdp_conformance]\nmodel = "{USER_MODULE}:build"\nworld_sizes = [2]\n')
    result = user_project.runpytest_subprocess(
        "-m", "cpu", "-k", "wrap.units", "-v", "-p", "no:cacheprovider",
        "--fsdp-block-cls", "Block")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines([
        f"fsdp-conformance: torch {torch.__version__}*model {USER_MODULE}:build*",
        f"*test_conformance?wrap.units.exact?fsdp1,{USER_MODULE}:build?-ws2-cpu? PASSED*",
    ], consecutive=False)


def test_pytest_unknown_pyproject_key_is_a_usage_error_naming_the_known_keys(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyprojecttoml("[tool.fsdp_conformance]\nworld_size = [2, 4]\n")
    result = pytester.runpytest_subprocess("-m", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        ("ERROR: unknown key(s) world_size in [[]tool.fsdp_conformance[]] of *pyproject.toml; "
         "known keys: world_sizes, backend, timeout, model, block_cls, min_params, input, "
         "max_world_size")])


def test_unwritable_report_folder_is_exit_2_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(suite, "all_checks", lambda: [PASSING])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, out, err = main(["run", "--out", str(blocker / "out")], capsys)
    assert_one_line_error(code, out, err, "run", f"cannot write the report to {blocker / 'out'}",
                          "--out")
    code, out, err = main(["run", "--out", str(tmp_path / "ok"), "--markdown",
                           str(blocker / "summary.md")], capsys)
    assert_one_line_error(code, out, err, "run", "cannot write the report to", "--markdown")
