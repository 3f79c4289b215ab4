"""``fsdp-conformance run|compare`` and the user's own model, end to end.

The real suite runs a few times only, narrowed with ``--checks``, all through ``main(argv)`` in
process (the same exit code, table, progress and files as the console script): once on the
reference models (the report, the table, progress, exit 0; several tests read that one run),
once with an injected failing check (exit 1), once on a user model whose forward breaks (exit
1). Every bad input is checked through ``main(argv)`` in process (``run --list`` validates the
model without running a check), and the pytest front end (``--fsdp-model``) through ``pytester``
sessions in process.

``run_suite`` runs here on the session's warm rank pools (the plugin's ``rank_pools``, handed in
as its engine), and the inner pytest sessions borrow them (:class:`LendPools`); a
``main(["run", ...])`` run starts and closes pools of its own, as the console script does,
forked from the session's fork servers (which have imported torch already). A user model the
ranks build is defined in this module (the ranks import it by name, as they import this test
module's checks): warm ranks cannot see a folder put on ``sys.path`` after they started. One
test runs the console script itself, as a process: its exit code and its stderr on bad input
(no traceback); the console script's exit 0 after a real run is
``tests/test_user_model_hf.py``'s run from a model folder.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from fsdp_conformance import cli, plugin
from fsdp_conformance.claims.check import Check, CheckRun, Verdict
from fsdp_conformance.gate import report as gate_report
from fsdp_conformance.gate import structure, suite
from fsdp_conformance.harness import PoolManager
from fsdp_conformance.models import user_model
from fsdp_conformance.settings import OPTIONS, Settings

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


# The user's model that ranks build is defined here, in real code: warm ranks import it by this
# module's name (``--model test_cli:broken``), as they import any test module's checks.
RANK_MODELS = __name__


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class BrokenNet(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Broken on the ranks only: the preflight's forward (meta, then CPU) would stop a
        # forward broken everywhere before any rank, and this test looks at the ranks' error.
        if torch.distributed.is_initialized():
            raise RuntimeError("forward is broken on purpose")
        out: torch.Tensor = super().forward(x)
        return out


def build() -> nn.Module:
    return Net()


def broken() -> nn.Module:
    return BrokenNet()


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


def run_cli(
    args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FSDP_CONFORMANCE_", "PYTEST_")) and k != "GITHUB_STEP_SUMMARY"
    }
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "fsdp_conformance.cli", *args],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        timeout=SUBPROCESS_LIMIT_S,
    )


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
# run: a real, narrowed run (in process, read by several tests)
# --------------------------------------------------------------------------------------------


class Run(NamedTuple):
    """What ``fsdp-conformance run`` gave: its exit code, stdout and stderr."""

    code: int
    out: str
    err: str


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """`fsdp-conformance run --checks wrap.units.exact --out out` on the reference models, once
    for the module, through ``main`` in process, from a folder of its own, with no outer
    settings and no CI job summary. Read by the tests
    ``test_run_exits_0_and_writes_report_and_summary``,
    ``test_run_report_has_the_schema_environment_settings_and_unit_trees``,
    ``test_run_prints_the_table_and_progress_on_stderr`` and
    ``test_compare_a_real_report_with_itself_and_with_a_changed_unit``.

    (The job summary is appended to in ``test_run_no_plot_writes_no_picture_...``.)"""
    directory = tmp_path_factory.mktemp("run")
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(directory)
        for option in OPTIONS:
            mp.delenv(option.env, raising=False)
        mp.delenv("GITHUB_STEP_SUMMARY", raising=False)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["run", "--checks", "wrap.units.exact", "--out", "out"])
    return Run(code, out.getvalue(), err.getvalue()), directory


def test_run_exits_0_and_writes_report_and_summary(reference_run: tuple[Run, Path]) -> None:
    result, directory = reference_run
    assert result.code == cli.EXIT_OK, result.err
    out = directory / "out"
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "summary.md"]  # no temp files
    assert (out / "summary.md").read_text().startswith("## FSDP conformance: PASS")
    assert result.out.splitlines()[-2:] == ["report: out/report.json", "summary: out/summary.md"]


def test_run_report_has_the_schema_environment_settings_and_unit_trees(
    reference_run: tuple[Run, Path],
) -> None:
    _, directory = reference_run
    report = gate_report.load_report(str(directory / "out" / "report.json"))
    assert report["schema"] == "fsdp-conformance-report" and report["schema_version"] == 1
    assert report["environment"]["torch"] == torch.__version__
    assert report["settings"]["world_sizes"] == [2] and report["settings"]["model"] is None
    assert report["summary"] == {"passed": 4, "failed": 0, "skipped": 0, "error": 0, "xfailed": 0}
    ids = [e["id"] for e in report["checks"]]
    assert ids == [
        f"wrap.units.exact[cpu,ws2,{v},{m}]"
        for v in ("fsdp1", "fsdp2")
        for m in ("massive", "tied")
    ]
    for e in report["checks"]:
        assert e["outcome"] == "passed" and e["seconds"] >= 0
        units = structure.unit_list(e)
        assert units is not None and units[0]["fqn"] == "" and units[0]["parent"] is None
        blocks = [u for u in units if u["cls"] == "DecoderLayer"]
        assert blocks and all(u["local_numel"] * 2 == u["numel"] for u in blocks)  # ws 2
        assert e["figures"]["units"] == len(units)


def test_run_prints_the_table_and_progress_on_stderr(reference_run: tuple[Run, Path]) -> None:
    result, _ = reference_run
    table = result.out
    assert table.splitlines()[0].split() == ["check", "outcome", "key", "figures"]
    assert any(
        line.startswith("wrap.units.exact[cpu,ws2,fsdp1,massive]")
        and " PASSED " in line
        and "units 6" in line
        for line in table.splitlines()
    )
    assert "4 passed, 0 failed, 0 skipped, 0 errors in " in table
    err = result.err.splitlines()
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
    reference_run: tuple[Run, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    old = str(reference_run[1] / "out" / "report.json")
    code, out, _ = main(["compare", old, old], capsys)
    assert code == cli.EXIT_OK and out.splitlines()[-1] == "no differences"
    changed = json.loads(Path(old).read_text())
    layer = next(
        u for u in structure.unit_list(changed["checks"][0]) or [] if u["fqn"] == "layers.1"
    )
    layer["numel"] += 64
    new = tmp_path / "new.json"
    new.write_text(json.dumps(changed))
    code, out, _ = main(["compare", old, str(new)], capsys)
    assert code == cli.EXIT_FAILED
    assert (
        "[BLOCKS] wrap.units.exact[cpu,ws2,fsdp1,massive]: units: unit structure "
        "changed: ~ layers.1 numel: 37248 -> 37312"
    ) in out


# --------------------------------------------------------------------------------------------
# run: failures, --list, --checks (in process)
# --------------------------------------------------------------------------------------------


def _report_value(ctx: Any, value: int, expected: int) -> dict[str, int]:
    # the rank only reports; the verdict (in the parent) compares with ``expected``
    return {"rank": ctx.rank, "value": value}


def _verdict_expected(values: Sequence[Mapping[str, int]], params: Mapping[str, Any]) -> Verdict:
    # every rank's value, not rank 0's alone
    wrong = [
        f"rank {v['rank']} reported {v['value']}"
        for v in values
        if v["value"] != params["expected"]
    ]
    if wrong:
        return Verdict(
            False,
            f"expected {params['expected']} on every rank: " + ", ".join(wrong),
            {"value": values[0]["value"]},
        )
    return Verdict(True, f"{params['expected']} on every rank", {"value": values[0]["value"]})


PASSING = Check(
    "test.right",
    "every rank reports the expected value",
    _report_value,
    _verdict_expected,
    params={"value": 2, "expected": 2},
    lanes=("cpu",),
)
FAILING = Check(
    "test.wrong",
    "every rank reports the expected value",
    _report_value,
    _verdict_expected,
    params={"value": 1, "expected": 2},
    lanes=("cpu",),
)


def _crash_rank1_inside_torch(ctx: Any, value: int, expected: int) -> dict[str, int]:
    """Rank 1 dies of SIGSEGV inside a torch API (a callback torch's tree_map calls)."""
    if ctx.rank == 1:
        import ctypes

        from torch.utils import _pytree

        _pytree.tree_map(lambda _: ctypes.string_at(0), [0])
    return {"rank": ctx.rank, "value": value}


CRASHING = Check(
    "test.crash",
    "rank 1 crashes inside torch",
    _crash_rank1_inside_torch,
    _verdict_expected,
    params={"value": 2, "expected": 2},
    lanes=("cpu",),
)


def test_a_crash_inside_torch_on_one_rank_is_one_check_naming_the_api_rank_and_signal(
    rank_pools: PoolManager,
) -> None:
    """A crash inside torch on one rank: the crashed check names the rank, the signal and the
    torch function; the pool is rebuilt and the run goes on."""
    stream = io.StringIO()
    plan = suite.plan_suite(Settings(), ["cpu"], checks=[CRASHING, PASSING])
    report = suite.run_suite(plan, rank_pools, stream=stream)
    crashed, after = report["checks"]
    assert crashed["outcome"] == "error" and after["outcome"] == "passed", report["checks"]
    # one line (the rank, its death, the torch function), every rank's story kept
    assert crashed["message"].startswith(
        "rank 1: died (killed by SIGSEGV (exit status -11) inside torch: "
        "torch.utils._pytree.tree_map (crashed in torch.utils._pytree."
    ), crashed["message"]
    assert "\n" not in crashed["message"]
    assert "rank 1 died" in crashed["traceback"]
    assert (
        "--- rank 1: died ---\nkilled by SIGSEGV (exit status -11) inside torch: "
        "torch.utils._pytree.tree_map (crashed in torch.utils._pytree."
    ) in crashed["traceback"]
    assert report["summary"] == {"passed": 1, "failed": 0, "skipped": 0, "error": 1, "xfailed": 0}


def test_run_suite_reports_a_failing_check_as_failed_with_progress(
    rank_pools: PoolManager,
) -> None:
    stream = io.StringIO()
    plan = suite.plan_suite(Settings(), ["cpu"], checks=[PASSING, FAILING])
    report = suite.run_suite(plan, rank_pools, stream=stream)
    assert report["summary"] == {"passed": 1, "failed": 1, "skipped": 0, "error": 0, "xfailed": 0}
    failed = report["checks"][1]
    assert failed["id"] == "test.wrong[cpu,ws2]" and failed["outcome"] == "failed"
    assert failed["message"] == "expected 2 on every rank: rank 0 reported 1, rank 1 reported 1"
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[1/2] test.right [cpu, ws2] ... passed (")
    assert lines[1].startswith("[2/2] test.wrong [cpu, ws2] ... failed (")
    assert lines[2] == "      expected 2 on every rank: rank 0 reported 1, rank 1 reported 1"


def test_run_exits_1_when_a_check_fails_and_still_writes_the_report(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(suite, "all_checks", lambda: [PASSING, FAILING])
    code, out, err = main(["run", "--out", str(tmp_path)], capsys)
    assert code == cli.EXIT_FAILED
    report = gate_report.load_report(str(tmp_path / "report.json"))
    assert [e["outcome"] for e in report["checks"]] == ["passed", "failed"]
    assert "test.wrong[cpu,ws2]  FAILED   expected 2 on every rank" in out
    assert "[2/2] test.wrong [cpu, ws2] ... failed" in err  # progress, on stderr
    assert (tmp_path / "summary.md").read_text().startswith("## FSDP conformance: FAIL")


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, calls: list[str]) -> None:
    """``module.name`` from now on appends its name to ``calls`` on each call."""
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_run_decides_the_model_and_the_checks_once_and_runs_that_plan(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One plan per command line (``suite.plan_suite``): the preflight, ``--list``'s lines and
    the run read it; ``run_suite`` neither resolves the model nor selects again."""
    calls: list[str] = []
    _count_calls(monkeypatch, suite, "user_spec", calls)
    _count_calls(monkeypatch, suite, "select_checks", calls)
    _count_calls(monkeypatch, suite, "plan_suite", calls)
    monkeypatch.setattr(suite, "all_checks", lambda: [PASSING, FAILING])
    code, out, err = main(["run", "--checks", "test.right", "--out", str(tmp_path)], capsys)
    assert code == cli.EXIT_OK, err
    assert sorted(calls) == ["plan_suite", "select_checks", "user_spec"]
    assert "[1/1] test.right [cpu, ws2] ... passed" in err
    calls.clear()
    code, out, err = main(["run", "--checks", "test.right", "--list"], capsys)
    assert code == cli.EXIT_OK and out.startswith("test.right "), err
    assert sorted(calls) == ["plan_suite", "select_checks", "user_spec"]


def test_run_starts_the_ranks_fork_server_before_its_own_imports_and_forks_from_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The server imports torch on the other core while the run imports the model and the
    checks: started first, and the one the run's pool forks its ranks from."""
    from fsdp_conformance.harness import forkserver
    from fsdp_conformance.harness import session as session_module
    from fsdp_conformance.harness.pool import prestart_fork_server

    shared, served = forkserver.shared_servers(), []

    class Recording:  # the session's servers (warm), each one handed out recorded
        def server(self, env: Mapping[str, str]) -> forkserver.ForkServer:
            served.append(shared.server(env))
            return served[-1]

        def pids(self) -> list[int]:
            return shared.pids()

    order: list[str] = []
    monkeypatch.setattr(forkserver, "_SHARED", Recording())
    monkeypatch.setattr(
        session_module,
        "prestart_fork_server",
        lambda **kw: order.append("fork server") or prestart_fork_server(**kw),
    )
    real_spec = suite.user_spec  # the model is resolved once, by the run's plan
    monkeypatch.setattr(
        suite, "user_spec", lambda settings: order.append("model") or real_spec(settings)
    )
    monkeypatch.setattr(suite, "all_checks", lambda: [PASSING])
    code, _, err = main(["run", "--out", str(tmp_path), "--no-plot"], capsys)
    assert code == cli.EXIT_OK, err
    assert order == ["fork server", "model"]
    assert len(served) == 2 and served[0] is served[1], served  # the pool's is the early one


def test_run_exits_1_when_the_user_models_forward_breaks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = main(
        [
            "run",
            "--model",
            f"{RANK_MODELS}:broken",
            "--block-cls",
            "Block",
            "--checks",
            "wrap.train.fp32",
            "--out",
            str(tmp_path),
        ],
        capsys,
    )
    assert code == cli.EXIT_FAILED
    report = gate_report.load_report(str(tmp_path / "report.json"))
    assert report["settings"]["model"] == f"{RANK_MODELS}:broken"
    assert [(e["id"], e["outcome"]) for e in report["checks"]] == [
        (f"wrap.train.fp32[cpu,ws2,{v},{RANK_MODELS}:broken]", "error") for v in ("fsdp1", "fsdp2")
    ]
    # one line naming where it was raised (the user's forward, not torch's module call) and the
    # ranks; every rank's traceback kept in the report
    line = "ranks 0, 1: RuntimeError in test_cli.py:forward: forward is broken on purpose"
    assert [e["message"] for e in report["checks"]] == [line, line]
    assert all("Traceback (most recent call last)" in e["traceback"] for e in report["checks"])
    assert f"ERROR    {line}" in out  # the table's reason column, whole
    assert "Traceback" not in out + err and f"      {line}" in err  # the progress: one line


def _report_timeline(ctx: Any) -> dict[str, Any]:
    return {"rank": ctx.rank}


def _verdict_with_timeline(
    values: Sequence[Mapping[str, Any]], params: Mapping[str, Any]
) -> Verdict:
    # the shape memory.sawtooth stores: rank 0's samples at each unit hook
    timeline = [
        {"i": i, "unit": f"layers.{i // 2}", "phase": "forward", "bytes": b * 2**20}
        for i, b in enumerate([10, 13, 10, 13, 10])
    ]
    return Verdict(
        True,
        f"{len(values)} ranks",
        {"teeth": 2},
        {
            "timeline": timeline,
            "wrapping": "per_layer",
            "limit_bytes": 20 * 2**20,
            "peak_bytes": 14 * 2**20,
        },
    )


TIMELINE = Check(
    "test.timeline",
    "a check that stores a memory timeline",
    _report_timeline,
    _verdict_with_timeline,
    lanes=("cpu",),
)
PLOT_LINK = "![memory timeline, one panel per check](memory_timeline.png)"


@pytest.mark.process  # a real run drawing its plot (matplotlib): about 5 s, the process lane
def test_run_writes_the_timeline_plot_by_default_and_the_summary_links_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real run of the memory timeline checks: the PNG, one panel per FSDP version, linked."""
    out_dir = tmp_path / "out"
    code, out, err = main(["run", "--checks", "memory.sawtooth", "--out", str(out_dir)], capsys)
    report = gate_report.load_report(str(out_dir / "report.json"))
    s = report["summary"]
    assert code == (cli.EXIT_FAILED if s["failed"] or s["error"] else cli.EXIT_OK), err
    png = out_dir / "memory_timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.splitlines()[-1] == f"plot: {png}"
    summary = (out_dir / "summary.md").read_text()
    assert summary.count(PLOT_LINK) == 1 and "[memory_timeline.png](memory_timeline.png)" in summary
    from fsdp_conformance.gate import plots

    titles = [p["title"] for p in plots.report_panels(report)]
    assert [t.split(":")[0] for t in titles] == ["FSDP1", "FSDP2"]
    assert all("memory.sawtooth (model massive, cpu, world size 2)" in t for t in titles)
    assert all(
        set(p["timelines"]) == {"per_layer", "monolithic"} for p in plots.report_panels(report)
    )


def test_run_no_plot_writes_no_picture_and_the_summary_mentions_none(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(suite, "all_checks", lambda: [TIMELINE])
    step_summary = tmp_path / "step.md"
    step_summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    code, out, err = main(["run", "--out", str(tmp_path / "a")], capsys)
    assert code == cli.EXIT_OK, err
    # appended to the CI job summary, after what was there
    assert step_summary.read_text().startswith("earlier step\n## FSDP conformance: PASS")
    png = tmp_path / "a" / "memory_timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the control: this report has one
    assert PLOT_LINK in (tmp_path / "a" / "summary.md").read_text()
    # the job page cannot resolve a link to the runner's file: it is named, not linked
    assert f"Memory timeline plot: `{png}`" in step_summary.read_text()
    assert PLOT_LINK not in step_summary.read_text()
    step_summary.unlink()
    code, out, err = main(["run", "--no-plot", "--out", str(tmp_path / "b")], capsys)
    assert code == cli.EXIT_OK, err
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["report.json", "summary.md"]
    for text in ((tmp_path / "b" / "summary.md").read_text(), step_summary.read_text()):
        assert "memory timeline" not in text.lower() and "memory_timeline" not in text
    assert not [line for line in out.splitlines() if line.startswith("plot")]
    assert "plot" not in err


def test_run_without_a_timeline_writes_no_plot_and_the_summary_says_nothing_of_one(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(suite, "all_checks", lambda: [PASSING])
    code, out, err = main(["run", "--out", str(tmp_path)], capsys)
    assert code == cli.EXIT_OK, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "summary.md"]
    text = (tmp_path / "summary.md").read_text()
    assert "memory timeline" not in text.lower() and "memory_timeline" not in text
    assert not [line for line in out.splitlines() if line.startswith("plot")]
    assert "plot" not in err
    # asked for explicitly, the missing timeline is said (on stderr), still no file
    code, out, err = main(["run", "--plot", "--out", str(tmp_path)], capsys)
    assert code == cli.EXIT_OK
    assert "no memory timeline in this run" in err
    assert not (tmp_path / "memory_timeline.png").exists()


def test_list_shows_each_check_and_variant_once(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = main(["run", "--list"], capsys)
    assert code == cli.EXIT_OK
    labels = [line.split()[0] for line in out.splitlines()]
    assert len(labels) == len(set(labels)) == len(suite.select_checks(suite.all_checks(), None))
    assert "wrap.units.exact[fsdp1,massive]" in labels and "wrap.builders.size" in labels
    code, out, _ = main(["run", "--list", "--checks", "init.weights.fsdp2"], capsys)
    # a pattern naming the check's old name (gate/migrate.py CHECK_RENAMES) still selects it
    assert [line.split()[0] for line in out.splitlines()] == ["init.weights[fsdp2,llama]"]


def test_list_on_the_user_model_shows_the_checks_that_run_on_it(
    user_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = main(
        [
            "run",
            "--list",
            "--model",
            f"{USER_MODULE}:build",
            "--block-cls",
            "Block",
            "--checks",
            "wrap.units.plan",
        ],
        capsys,
    )
    assert code == cli.EXIT_OK
    assert [line.split()[0] for line in out.splitlines()] == [
        f"wrap.units.plan[fsdp1,{USER_MODULE}:build]",
        f"wrap.units.plan[fsdp2,{USER_MODULE}:build]",
    ]


def test_checks_matching_nothing_is_exit_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = main(["run", "--checks", "wrap.no_such", "--out", str(tmp_path / "o")], capsys)
    assert_one_line_error(
        code,
        out,
        err,
        "run",
        "no check matched --checks 'wrap.no_such'",
        "fsdp-conformance run --list",
    )
    assert not (tmp_path / "o").exists()  # no empty report that a gate could take for a pass


def test_checkpoint_folders_that_cannot_work_are_exit_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "never-saved"
    code, out, err = main(
        ["run", "--load-checkpoint", str(missing), "--out", str(tmp_path / "o")], capsys
    )
    assert_one_line_error(
        code, out, err, "run", f"--load-checkpoint {missing}: no such folder", "--save-checkpoint"
    )
    both = tmp_path / "both"
    both.mkdir()
    code, out, err = main(
        [
            "run",
            "--save-checkpoint",
            str(both),
            "--load-checkpoint",
            str(both),
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert_one_line_error(code, out, err, "run", "name the same folder", "give two folders")
    assert not (tmp_path / "o").exists()
    code, out, _ = main(
        [
            "run",
            "--list",
            "--save-checkpoint",
            str(tmp_path / "ck"),
            "--checks",
            "state.checkpoint",
        ],
        capsys,
    )
    assert code == cli.EXIT_OK
    assert [line.split()[0] for line in out.splitlines()] == [
        "state.checkpoint[fsdp1,massive]",
        "state.checkpoint[fsdp2,massive]",
        "state.checkpoint.optimizer[fsdp1,massive]",
        "state.checkpoint.optimizer[fsdp2,massive]",
        "state.checkpoint.torch_save[fsdp1,massive]",
        "state.checkpoint.torch_save.shared_step[fsdp1,massive]",
    ]


# --------------------------------------------------------------------------------------------
# The user's model: bad input, one line each (in process; --list validates without running)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "parts"),
    [
        (
            ["--model", "fsdpc_no_such_pkg.model:build"],
            ["cannot import module 'fsdpc_no_such_pkg.model'", "on PYTHONPATH"],
        ),
        (
            ["--model", f"{USER_MODULE}:buidl"],
            [f"module '{USER_MODULE}' has no attribute 'buidl'", "check the name after the colon"],
        ),
        (["--model", USER_MODULE], ["is not of the form 'pkg.module:name'"]),
        (
            ["--model", f"{USER_MODULE}:NOT_CALLABLE"],
            ["is not callable (int)", "name a function or class"],
        ),
        (
            ["--model", f"{USER_MODULE}:raises", "--block-cls", "Block"],
            [
                f"model factory '{USER_MODULE}:raises' raised FileNotFoundError: config.yaml",
                "fix the factory",
            ],
        ),
        (
            ["--model", f"{USER_MODULE}:not_a_module", "--block-cls", "Block"],
            ["returned dict, not an nn.Module", "make it return the model itself"],
        ),
        (
            ["--model", f"{USER_MODULE}:build"],
            [
                "no block class given",
                "pass --block-cls",
                "candidates, the module classes it repeats: Block (x2",
            ],
        ),
        (
            ["--model", f"{USER_MODULE}:build", "--block-cls", "TransformerBlock"],
            [
                "'TransformerBlock' matches no module class in the model Net",
                f"its module classes are: {USER_MODULE}.Net",
                f"{USER_MODULE}.Block",
            ],
        ),
        (
            ["--model", f"{USER_MODULE}:build", "--block-cls", "Net"],
            [
                "the wrap policy wraps nothing but the root",
                "block classes Net",
                "names the model's block class",
            ],
        ),
        (["--block-cls", "Block"], ["--block-cls is set but no --model", "--model mypkg"]),
        (
            ["--model", f"{USER_MODULE}:build", "--block-cls", "Block", "--min-params", "lots"],
            ["invalid min_params 'lots' from command line --fsdp-min-params", "expected N"],
        ),
    ],
    ids=[
        "import-path",
        "attribute",
        "no-colon",
        "not-callable",
        "factory-raises",
        "not-module",
        "no-block-cls",
        "block-not-in-model",
        "wraps-nothing",
        "block-without-model",
        "bad-min-params",
    ],
)
def test_bad_user_model_input_is_one_line_and_exit_2(
    user_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], parts: list[str]
) -> None:
    code, out, err = main(["run", "--list", *args], capsys)
    assert_one_line_error(code, out, err, "run", *parts)


def test_model_too_large_for_the_cpu_lane_is_one_line_and_exit_2(
    user_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(user_model, "_available_host_bytes", lambda: 64 * 2**30)
    code, out, err = main(
        ["run", "--list", "--model", f"{USER_MODULE}:huge", "--block-cls", "Block"], capsys
    )
    assert_one_line_error(
        code,
        out,
        err,
        "run",
        "has 10.74 B parameters",
        "needs about 320.0 GiB of host memory, 64.0 GiB is available",
        "use a smaller config of the model",
        "fsdp-conformance plan",
    )
    # the gpu lane alone does not hold the model in host memory
    code, out, err = main(
        [
            "run",
            "--list",
            "--lane",
            "gpu",
            "--model",
            f"{USER_MODULE}:huge",
            "--block-cls",
            "Block",
            "--checks",
            "wrap.units.plan",
        ],
        capsys,
    )
    assert code == cli.EXIT_OK, err


@pytest.mark.process
def test_bad_model_input_from_the_command_line_prints_no_traceback(user_dir: Path) -> None:
    result = run_cli(
        ["run", "--model", f"{USER_MODULE}:build", "--block-cls", "Nope"],
        user_dir,
        {"PYTHONPATH": str(user_dir)},
    )
    assert result.returncode == cli.EXIT_USAGE
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        (
            f"fsdp-conformance run: error: block class 'Nope' matches no module class in the model "
            f"Net; its module classes are: {USER_MODULE}.Net, torch.nn.modules.linear.Linear, "
            f"torch.nn.modules.container.ModuleList, {USER_MODULE}.Block"
        )
    ]


def test_pyproject_table_gives_the_cli_its_model_and_an_unknown_key_is_exit_2(
    user_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        f'[tool.fsdp_conformance]\nmodel = "{USER_MODULE}:build"\n'
        'block_cls = "Block"\nworld_sizes = [2, 4]\n'
    )
    code, out, err = main(["run", "--list", "--checks", "init.meta_build"], capsys)
    assert code == cli.EXIT_OK, err
    assert out.split()[0] == f"init.meta_build[{USER_MODULE}:build]"
    pyproject.write_text('[tool.fsdp_conformance]\nmodel = "x:y"\nblock-cls = "Block"\n')
    code, out, err = main(["run", "--list"], capsys)
    assert_one_line_error(
        code,
        out,
        err,
        "run",
        "unknown key(s) block-cls",
        "known keys: world_sizes, backend, timeout, model, block_cls",
    )


# --------------------------------------------------------------------------------------------
# compare through the CLI (hand-built reports)
# --------------------------------------------------------------------------------------------


def _entry(check: str, outcome: str = "passed", **figures: Any) -> dict[str, Any]:
    return gate_report.check_entry(
        check=check,
        claim="memory",
        lane="cpu",
        world_size=2,
        variant="fsdp2,massive",
        outcome=outcome,
        message="why: " + outcome,
        figures=figures,
        data={},
        seconds=0.1,
        warnings=(),
    )


def _write_report(path: Path, *entries: dict[str, Any], torch_version: str) -> str:
    report = gate_report.build_report(list(entries), Settings(), 1.0)
    report["environment"]["torch"] = torch_version
    gate_report.write_json_report(str(path), report)
    return str(path)


@pytest.fixture
def pair(tmp_path: Path) -> tuple[str, str, str]:
    """(old, new with one memory move of +6% and a fail->pass, new identical to old)."""
    old = [_entry("memory.peak", peak_bytes=100 * 2**20), _entry("wrap.mixed", "failed")]
    new = [_entry("memory.peak", peak_bytes=106 * 2**20), _entry("wrap.mixed", "passed")]
    return (
        _write_report(tmp_path / "old.json", *old, torch_version="2.13.0"),
        _write_report(tmp_path / "new.json", *new, torch_version="2.14.1"),
        _write_report(tmp_path / "same.json", *copy.deepcopy(old), torch_version="2.14.1"),
    )


def test_compare_exit_1_on_a_regression_and_lists_every_difference(
    pair: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    old, new, _ = pair
    code, out, _ = main(["compare", old, new], capsys)
    assert code == cli.EXIT_FAILED
    assert out.splitlines() == [
        "safe to upgrade: no (torch 2.13.0 -> 2.14.1)",
        "  regressions 1, drift 0, known defects 0, deprecations 0, rollback 0, "
        "fixed upstream 0, other changes 1",
        "regressions:",
        (
            "  [BLOCKS] memory.peak[cpu,ws2,fsdp2,massive]: memory: peak_bytes: 100.00 MiB -> "
            "106.00 MiB (+6.0%; tolerance 5%, floor 1.00 MiB)"
        ),
        "other changes:",
        "  [said] wrap.mixed[cpu,ws2,fsdp2,massive]: outcome: failed -> passed",
    ]


def test_compare_memory_tolerance_flag_turns_the_move_into_no_regression(
    pair: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    old, new, _ = pair
    code, out, _ = main(["compare", old, new, "--memory-tolerance", "0.1"], capsys)
    assert code == cli.EXIT_OK  # the remaining difference (fail -> pass) is not a regression
    assert out.startswith("safe to upgrade: yes") and "regressions 0," in out
    assert "other changes 1" in out
    code, out, _ = main(
        ["compare", old, new, "--memory-tolerance", "0.1", "--fail-on-change"], capsys
    )
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
        assert out.splitlines()[0] == "safe to upgrade: yes (torch 2.13.0 -> 2.14.1)"
        assert out.splitlines()[-1] == "no differences"


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
        report = gate_report.build_report([], Settings(), 0.0)
        report["schema_version"] = 99
        path.write_text(json.dumps(report))
    return str(path)


@pytest.mark.parametrize(
    ("kind", "part"),
    [
        ("missing", "does not exist"),
        ("not-json", "is not valid JSON"),
        ("schema", "is not an fsdp-conformance report"),
        ("version", "has schema version 99"),
    ],
)
def test_compare_bad_report_is_one_line_and_exit_2(
    pair: tuple[str, str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    part: str,
) -> None:
    bad = _bad_report(tmp_path, kind)
    for args in ([pair[0], bad], [bad, pair[0]]):
        code, out, err = main(["compare", *args], capsys)
        assert_one_line_error(code, out, err, "compare", repr(bad), part)


def _good_report() -> dict[str, Any]:
    """A small report with every documented field: a unit list, warnings, a memory figure."""
    units = [
        {
            "fqn": "",
            "cls": "MassiveModel",
            "numel": 10,
            "local_numel": 5,
            "parent": None,
            "params": ["embed.weight"],
            "flat_numel": 16,
        },
        {
            "fqn": "layers.0",
            "cls": "DecoderLayer",
            "numel": 100,
            "local_numel": 50,
            "parent": "",
            "params": ["layers.0.fc.weight"],
            "flat_numel": 112,
        },
    ]
    wrap = gate_report.check_entry(
        check="wrap.units.exact",
        claim="wrap",
        lane="cpu",
        world_size=2,
        variant="fsdp1,massive",
        outcome="passed",
        message="ok",
        figures={"units": 2},
        data={"actual": units},
        seconds=0.2,
        warnings=["FutureWarning: NO_SHARD is deprecated", "UserWarning: y"],
    )
    peak = _entry("memory.peak", peak_bytes=100 * 2**20, working_set_bytes=[1, 2])
    return gate_report.build_report([wrap, peak], Settings(), 1.0)


def _damage(report: dict[str, Any], where: str, value: Any) -> None:
    """Set (or with ``value`` DELETE, remove) the field at a JSON path like ``checks[0].data``."""
    parts = [
        int(p) if p.isdigit() else p for p in where.replace("[", ".").replace("]", "").split(".")
    ]
    target: Any = report
    for part in parts[:-1]:
        target = target[part]
    if value is DELETE:
        del target[parts[-1]]
    else:
        target[parts[-1]] = value


DELETE = object()

#: (JSON path, damage, what the message says is expected, what it says was found)
DAMAGED_REPORTS = [
    ("checks[0].figures", [1, 2], "an object", "a list ([1, 2])"),
    ("checks[0].data", [], "an object", "a list ([])"),
    ("checks[0].warnings", "UserWarning: y", "a list of strings", 'a string ("UserWarning: y")'),
    ("schema_version", True, "the integer 1", "a boolean (true)"),
    ("schema_version", "1", "the integer 1", 'a string ("1")'),
    ("environment", DELETE, "an object", "nothing (the field is missing)"),
    ("environment.torch", 2.13, "a non-empty string", "a number (2.13)"),
    ("checks", {}, "a list", "an object ({})"),
    ("checks[1]", "memory.peak", "an object (a check entry)", 'a string ("memory.peak")'),
    ("checks[0].outcome", "ok", "one of passed, failed, skipped, error", 'a string ("ok")'),
    ("checks[0].world_size", True, "an integer >= 1", "a boolean (true)"),
    ("checks[0].lane", "tpu", "one of cpu, gpu", 'a string ("tpu")'),
    ("checks[1].seconds", "fast", "a finite number >= 0", 'a string ("fast")'),
    ("checks[1].message", None, "a string", "null"),
    (
        "checks[1].figures.peak_bytes",
        {"rank0": 1},
        "a number, string, boolean, null or a list",
        'an object ({"rank0": 1})',
    ),
    (
        "checks[1].figures.working_set_bytes",
        [[1], [2]],
        "a number, string, boolean, null or a list",
        "a list ([[1], [2]])",
    ),
    ("checks[0].data.actual[1].numel", "100", "an integer >= 0", 'a string ("100")'),
    ("checks[0].data.actual[1].params", "layers.0.fc.weight", "a list of strings", "a string"),
    (
        "checks[0].deprecations[0]",
        "FutureWarning: other",
        "one of the entry's warnings",
        'a string ("FutureWarning: other")',
    ),
    (
        "checks[1].id",
        "memory.peak[cpu,ws4,fsdp2,massive]",
        "'memory.peak[cpu,ws2,fsdp2,massive]' (from check, lane, world_size, variant)",
        'a string ("memory.peak[cpu,ws4,fsdp2,massive]")',
    ),
    ("summary.passed", 5, "2 (the checks with outcome 'passed')", "an integer (5)"),
    ("summary", [], "an object", "a list ([])"),
    ("settings.world_sizes", "2", "a list of integers >= 1", 'a string ("2")'),
    ("settings.world_sizes", [True], "a list of integers >= 1", "a list ([true])"),
    ("duration_s", float("nan"), "a finite number >= 0", "a number (NaN)"),
]


@pytest.mark.parametrize(
    ("where", "value", "expected", "found"),
    DAMAGED_REPORTS,
    ids=[f"{w}={'<deleted>' if v is DELETE else repr(v)}"[:50] for w, v, *_ in DAMAGED_REPORTS],
)
def test_compare_a_damaged_report_is_one_line_naming_the_field_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    where: str,
    value: Any,
    expected: str,
    found: str,
) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_good_report()))
    code, out, err = main(["compare", str(good), str(good)], capsys)
    assert code == cli.EXIT_OK, err  # the undamaged report is valid: the damage is the cause
    damaged = _good_report()
    _damage(damaged, where, value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(damaged))
    for args in ([str(good), str(bad)], [str(bad), str(good)]):
        code, out, err = main(["compare", *args], capsys)
        assert_one_line_error(
            code,
            out,
            err,
            "compare",
            f"{str(bad)!r} is damaged: {where}: ",
            f"expected {expected}",
            f"found {found}",
            "re-run",
        )


def test_compare_a_duplicated_check_id_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = _good_report()
    damaged["checks"].append(copy.deepcopy(damaged["checks"][0]))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(damaged))
    code, out, err = main(["compare", str(bad), str(bad)], capsys)
    assert_one_line_error(
        code,
        out,
        err,
        "compare",
        "checks[2].id: expected an id unique",
        "appears twice (also checks[0])",
    )


def test_compare_a_folder_or_a_binary_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "out" / "report.json"
    good.parent.mkdir()
    good.write_text(json.dumps(_good_report()))
    code, out, err = main(["compare", str(good.parent), str(good)], capsys)
    assert_one_line_error(
        code, out, err, "compare", f"{str(good.parent)!r} is a folder", f"({str(good)!r} is there)"
    )
    binary = tmp_path / "report.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    code, out, err = main(["compare", str(good), str(binary)], capsys)
    assert_one_line_error(code, out, err, "compare", f"{str(binary)!r} is not text")


def _model_report(path: Path, model: str | None, world_size: int = 2) -> str:
    variant = f"fsdp2,{model or 'massive'}"
    entries = [
        gate_report.check_entry(
            check=name,
            claim="memory",
            lane="cpu",
            world_size=world_size,
            variant=variant,
            outcome="passed",
            message="ok",
            figures={},
            data={},
            seconds=0.1,
            warnings=(),
        )
        for name in ("memory.peak", "memory.sawtooth")
    ]
    settings = Settings(
        world_sizes=(world_size,), model=model, block_cls="Block" if model else None
    )
    report = gate_report.build_report(entries, settings, 1.0)
    gate_report.write_json_report(str(path), report)
    return str(path)


def test_compare_reports_of_different_models_are_not_comparable_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _model_report(tmp_path / "old.json", None)
    new = _model_report(tmp_path / "new.json", "pkg.mod:build")
    code, out, err = main(["compare", old, new], capsys)
    assert_one_line_error(
        code,
        out,
        err,
        "compare",
        f"{old!r} and {new!r} are not comparable: ",
        "settings.model None vs 'pkg.mod:build'",
        "settings.block_cls None vs 'Block'",
        "no check in common (2 checks vs 2)",
        "pass --force to compare them anyway",
    )
    code, out, err = main(["compare", old, new, "--force"], capsys)
    assert code == cli.EXIT_FAILED  # compared: every old check is missing from the new report
    assert "warning: the reports are not comparable" in err and "(--force)" in err
    assert out.splitlines()[0].startswith("safe to upgrade: no")
    assert "regressions 2," in out.splitlines()[1]
    assert "[BLOCKS] memory.peak[cpu,ws2,fsdp2,massive]: missing" in out


def test_compare_reports_with_no_check_in_common_are_not_comparable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = _model_report(tmp_path / "old.json", None, world_size=2)
    new = _model_report(tmp_path / "new.json", None, world_size=4)
    code, out, err = main(["compare", old, new], capsys)
    assert_one_line_error(
        code,
        out,
        err,
        "compare",
        "are not comparable: no check in common (2 checks vs 2; settings world_sizes [2] vs [4])",
        "--force",
    )
    empty = tmp_path / "empty.json"
    gate_report.write_json_report(str(empty), gate_report.build_report([], Settings(), 0.0))
    code, out, err = main(["compare", str(empty), str(empty)], capsys)
    assert_one_line_error(code, out, err, "compare", "no check in common (0 checks vs 0)")
    # the same model with one check in common is comparable: the other is missing, a regression
    partial = json.loads(Path(old).read_text())
    partial["checks"].pop()
    partial["summary"]["passed"] = 1
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    code, out, err = main(["compare", old, str(tmp_path / "partial.json")], capsys)
    assert code == cli.EXIT_FAILED, err
    assert "[BLOCKS] memory.sawtooth[cpu,ws2,fsdp2,massive]: missing" in out


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
    """A project folder with the user's model module, importable by the inner sessions.

    The inner sessions run in this process (``runpytest_inprocess``: a fresh config, the plugin
    loaded by its entry point): the folder goes on ``sys.path``. (A session that runs checks on
    a user model takes one the warm ranks can import: :data:`RANK_MODELS`.)
    """
    pytester.makepyfile(**{USER_MODULE: USER_MODEL})
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    pytester.syspathinsert()
    return pytester


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--fsdp-model", "fsdpc_no_such_pkg:build"],
            "ERROR: --fsdp-model: cannot import module 'fsdpc_no_such_pkg'*",
        ),
        (
            ["--fsdp-model", f"{USER_MODULE}:build", "--fsdp-block-cls", "TransformerBlock"],
            (
                "ERROR: --fsdp-model: block class 'TransformerBlock' matches no module class in the "
                f"model Net; its module classes are: {USER_MODULE}.Net, *{USER_MODULE}.Block"
            ),
        ),
        # As `fsdp-conformance run --block-cls` without --model: not silently ignored.
        (
            ["--fsdp-block-cls", "Block"],
            (
                "ERROR: --fsdp-block-cls is set but no --fsdp-model: give the model factory too "
                "(e.g. --fsdp-model mypkg.model:build_model)"
            ),
        ),
    ],
    ids=["import-path", "block-not-in-model", "block-without-model"],
)
def test_pytest_fsdp_model_bad_input_is_a_usage_error(
    user_project: pytest.Pytester, args: list[str], message: str
) -> None:
    result = user_project.runpytest_inprocess("-m", "cpu", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "Traceback" not in result.stderr.str()


class LendPools:
    """A plugin for an inner pytest session: its ``rank_pools`` are the outer session's warm
    pools, lent to its harness session (whose close leaves them warm)."""

    def __init__(self, lent: PoolManager) -> None:
        self.manager = lent

    @pytest.hookimpl(trylast=True)  # after the plugin's, which opens the harness session
    def pytest_configure(self, config: pytest.Config) -> None:
        config.stash[plugin.HARNESS_KEY].pools = self.manager


def test_pytest_runs_the_checks_on_the_model_from_the_pyproject_table(
    pytester: pytest.Pytester,
    rank_pools: PoolManager,
) -> None:
    # model from [tool.fsdp_conformance], block class from the command line: both sources at once
    pytester.makepyprojecttoml(
        f'[tool.fsdp_conformance]\nmodel = "{RANK_MODELS}:build"\nworld_sizes = [2]\n'
    )
    result = pytester.runpytest_inprocess(
        "-m",
        "cpu",
        "-k",
        "wrap.units",
        "-v",
        "-p",
        "no:cacheprovider",
        "--fsdp-block-cls",
        "Block",
        plugins=[LendPools(rank_pools)],
    )
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(
        [
            f"fsdp-conformance: torch {torch.__version__}*model {RANK_MODELS}:build*",
            f"*test_conformance?wrap.units.exact?fsdp1,{RANK_MODELS}:build?-ws2-cpu? PASSED*",
        ],
        consecutive=False,
    )


class RecordPlan:
    """A plugin for an inner pytest session: the session's suite plan and the
    ``conformance_check`` parameter of each collected test."""

    def __init__(self) -> None:
        self.plan: suite.SuitePlan | None = None
        self.params: list[Any] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.plan = session.config.stash[plugin.PLAN_KEY]
        self.params = [item.callspec.params["conformance_check"] for item in session.items]


def test_pytest_decides_the_model_and_the_checks_once_and_parametrizes_from_that_plan(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One plan per session (``plugin.suite_plan``): made in ``pytest_configure`` with
    ``--fsdp-model`` (its preflight reads it), kept in ``config.stash``, read by
    ``pytest_generate_tests``; every collected check is one of its (check, params) pairs."""
    calls: list[str] = []
    _count_calls(monkeypatch, suite, "user_spec", calls)
    _count_calls(monkeypatch, suite, "select_checks", calls)
    recorded = RecordPlan()
    result = pytester.runpytest_inprocess(
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "--fsdp-world-sizes",
        "1,2",
        "--fsdp-model",
        f"{RANK_MODELS}:build",
        "--fsdp-block-cls",
        "Block",
        plugins=[recorded],
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert sorted(calls) == ["select_checks", "user_spec"]
    plan = recorded.plan
    assert (
        plan is not None and plan.spec is not None and plan.spec.factory == f"{RANK_MODELS}:build"
    )
    # each pair at both world sizes on both lanes, the very objects of the plan
    assert len(recorded.params) == 4 * len(plan.selected) > 0
    assert all(any(p is pair for pair in plan.selected) for p in recorded.params)


def test_pytest_unknown_pyproject_key_is_a_usage_error_naming_the_known_keys(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyprojecttoml("[tool.fsdp_conformance]\nworld_size = [2, 4]\n")
    result = pytester.runpytest_inprocess("-m", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            (
                "ERROR: unknown key(s) world_size in [[]tool.fsdp_conformance[]] of *pyproject.toml; "
                "known keys: world_sizes, backend, timeout, model, block_cls, min_params, input, "
                "max_world_size, init_fn, model_init"
            )
        ]
    )


def test_unwritable_report_folder_is_exit_2_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(suite, "all_checks", lambda: [PASSING])
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, out, err = main(["run", "--out", str(blocker / "out")], capsys)
    assert_one_line_error(
        code, out, err, "run", f"cannot write the report to {blocker / 'out'}", "--out"
    )
    code, out, err = main(
        ["run", "--out", str(tmp_path / "ok"), "--markdown", str(blocker / "summary.md")], capsys
    )
    assert_one_line_error(code, out, err, "run", "cannot write the report to", "--markdown")


def test_progress_shows_a_skip_s_reason_whole_and_an_error_as_one_line_and_a_pointer() -> None:
    stream = io.StringIO()
    progress = suite.Progress(2, stream, report_path="out/report.json")
    reason = "memory.sawtooth: below the meters' resolution at this width; " * 3
    progress.start("memory.sawtooth [cpu, ws2, fsdp1,pkg:build]")
    progress.finish(CheckRun("memory.sawtooth", "skipped", None, reason.strip(), 0.5))
    story = "check failed on 2 ranks\nTraceback (most recent call last):\n" + "  frame\n" * 60
    progress.start("wrap.train.fp32 [cpu, ws2, fsdp2,pkg:build]")
    progress.finish(
        CheckRun(
            "wrap.train.fp32", "error", None, "ranks 0, 1: ValueError in x: y", 1.0, (), None, story
        )
    )
    assert stream.getvalue().splitlines() == [
        "[1/2] memory.sawtooth [cpu, ws2, fsdp1,pkg:build] ... skipped (0.50s)",
        f"      {reason.strip()}",
        "[2/2] wrap.train.fp32 [cpu, ws2, fsdp2,pkg:build] ... error (1.00s)",
        "      ranks 0, 1: ValueError in x: y",
        "      (its traceback: out/report.json, this check's 'traceback')",
    ]
