"""The pytest plugin, end to end: each test runs a separate pytest session (``pytester``) that
loads the plugin through its ``pytest11`` entry point, and asserts on its outcome and output.

The sessions run in this process (``runpytest_inprocess``: a fresh config and plugin manager,
the entry point loaded as in any session), except where the test is about a fresh process:
there a subprocess would cost a second or two of importing torch for nothing. One session
(the markers) runs as a subprocess: the plugin reaches a new interpreter by its entry point.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path

import pytest

# Imported before any inner session: an in-process session's newly imported modules are dropped
# after it, and torch cannot be imported a second time (the model checks' sessions import them).
import fsdp_conformance.claims
import fsdp_conformance.models.user_model  # noqa: F401
from fsdp_conformance import plugin
from fsdp_conformance.harness import cuda_device_count

LANES = """
import pytest


def _rank(ctx):
    return ctx.rank


def test_unmarked():
    pass


@pytest.mark.gpu
def test_gpu_with_ranks(ranks):
    ranks.run(_rank)


@pytest.mark.gpu
def test_gpu_without_ranks():
    import torch

    assert torch.cuda.is_available()
"""


@pytest.fixture(autouse=True)
def _no_outer_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner sessions see only the settings a test gives them."""
    for name in list(os.environ):
        if name.startswith("FSDP_CONFORMANCE_"):
            monkeypatch.delenv(name)


@pytest.mark.process
def test_markers_are_registered_and_listed(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.cpu: runs on gloo on any machine*",
            "@pytest.mark.gpu: needs CUDA and NCCL*",
            "@pytest.mark.process: starts processes of its own*",
            "@pytest.mark.world_size(*sizes): run this test once per world size*",
        ],
        consecutive=False,
    )
    assert result.ret == pytest.ExitCode.OK


def test_unmarked_test_is_in_the_cpu_lane(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_lanes=LANES)
    result = pytester.runpytest_inprocess("-m", "cpu", "-rA")
    result.assert_outcomes(passed=1, deselected=2)
    result.stdout.fnmatch_lines(["PASSED test_lanes.py::test_unmarked"])


def test_every_test_carries_a_lane_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_lanes=LANES)
    result = pytester.runpytest_inprocess("-m", "not cpu and not gpu")
    result.assert_outcomes(deselected=3)
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


PROCESS_LANE = """
import os

import pytest


def _pid(ctx):
    return os.getpid()


@pytest.mark.process
def test_starts_a_process():
    pass


@pytest.mark.process
def test_process_with_ranks(ranks):
    assert os.getpid() not in ranks.run(_pid)


@pytest.mark.gpu
@pytest.mark.process
def test_gpu_process():
    pass


def test_unmarked():
    pass
"""


def test_a_process_test_is_in_the_process_lane_only_and_its_ranks_are_gloo_ranks(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_process_lane=PROCESS_LANE)
    cpu = pytester.runpytest_inprocess("-m", "cpu", "-rA")
    cpu.assert_outcomes(passed=1, deselected=3)
    cpu.stdout.fnmatch_lines(["PASSED test_process_lane.py::test_unmarked"])
    process = pytester.runpytest_inprocess(
        "-m", "process and not gpu", "-rA", "--fsdp-world-sizes", "2"
    )
    process.assert_outcomes(passed=2, deselected=2)
    process.stdout.fnmatch_lines(
        ["PASSED test_process_lane.py::test_process_with_ranks[[]ws2-cpu[]]"], consecutive=False
    )
    # A GPU test that starts processes stays in the GPU lane.
    gpu = pytester.runpytest_inprocess("-m", "gpu", "--co", "-q")
    gpu.stdout.fnmatch_lines(["test_process_lane.py::test_gpu_process"])
    lanes = pytester.runpytest_inprocess("-m", "not cpu and not gpu and not process")
    lanes.assert_outcomes(deselected=4)  # every test is in a lane


def test_a_process_test_under_a_cpu_module_mark_is_a_usage_error_naming_it(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_both="""
import pytest

pytestmark = pytest.mark.cpu


@pytest.mark.process
def test_starts_a_process():
    pass
"""
    )
    result = pytester.runpytest_inprocess("-m", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: 1 test(s) carry both the process and the cpu marker: "
            "test_both.py::test_starts_a_process. A process test is not in the CPU lane*"
        ]
    )


@pytest.mark.skipif(cuda_device_count() > 0, reason="needs a machine without CUDA")
def test_gpu_lane_on_a_cpu_machine_skips_with_the_reason_and_exits_0(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_lanes=LANES)
    result = pytester.runpytest_inprocess("-m", "gpu", "-rA")
    result.assert_outcomes(skipped=2, deselected=1)
    result.stdout.fnmatch_lines(
        ["SKIPPED [[]2[]] *gpu lane: no CUDA device (torch.cuda.is_available() is False)"]
    )
    assert result.ret == pytest.ExitCode.OK


def test_bad_setting_from_the_environment_is_a_usage_error_naming_the_variable(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_lanes=LANES)
    monkeypatch.setenv("FSDP_CONFORMANCE_WORLD_SIZES", "x")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            (
                "ERROR: invalid world_sizes 'x' from environment variable "
                "FSDP_CONFORMANCE_WORLD_SIZES: 'x' is not a positive integer; "
                "expected N[[],N...[]]*"
            )
        ]
    )


def test_bad_setting_on_the_command_line_is_a_usage_error_naming_the_flag(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest_inprocess("--fsdp-timeout=-1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: invalid timeout '-1' from command line --fsdp-timeout*"])


def test_report_header_shows_torch_version_and_world_sizes(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_lanes=LANES)
    monkeypatch.setenv("FSDP_CONFORMANCE_WORLD_SIZES", "2,4")
    result = pytester.runpytest_inprocess("--co")
    torch_version = importlib.metadata.version("torch")
    result.stdout.fnmatch_lines(
        [f"fsdp-conformance: torch {torch_version} (*), *world sizes 2,4, *ranks: warm pool*"]
    )


# The inner sessions run in process: a module name of theirs must not be one of this
# folder's (tests/test_sizes.py), or the second import of that name is refused.
WORLD_SIZES = """
import pytest


@pytest.mark.world_size(1, 3)
def test_marked(world_size):
    pass


def test_default(world_size):
    pass


def test_uses_ranks(ranks):
    pass
"""

PRINT_TIMEOUTS = """
import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    for item in items:
        marker = item.get_closest_marker("timeout")
        print(f"TIMEOUT {item.name}: {marker.args if marker else None}")
"""


def test_world_size_marker_parametrizes_and_ranks_tests_get_an_outer_timeout(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_marked_sizes=WORLD_SIZES)
    pytester.makeconftest(PRINT_TIMEOUTS)
    result = pytester.runpytest_inprocess("--co", "-q", "-s", "--fsdp-timeout=10")
    for line in [
        "test_marked_sizes.py::test_marked[[]ws1[]]",
        "test_marked_sizes.py::test_marked[[]ws3[]]",
        "test_marked_sizes.py::test_default[[]ws2[]]",
        "test_marked_sizes.py::test_uses_ranks[[]ws2-cpu[]]",
        "test_marked_sizes.py::test_uses_ranks[[]ws2-gpu[]]",
        # pytest-timeout guards every test that runs ranks: several checks' worth of time.
        "TIMEOUT test_uses_ranks[[]ws2-cpu[]]: (110.0,)",
        "TIMEOUT test_marked[[]ws1[]]: None",
    ]:
        result.stdout.fnmatch_lines([line])


def test_bad_world_size_marker_names_the_test_and_the_fix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.world_size(0)
        def test_zero(world_size):
            pass
        """
    )
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            (
                "*test_bad.py::test_zero: world_size marker takes positive integers, got (0,); "
                "write e.g. @pytest.mark.world_size(2, 4)"
            )
        ]
    )


# --------------------------------------------------------------------------------------------
# Bounds: world sizes the machine can hold; check timeouts inside pytest-timeout
# --------------------------------------------------------------------------------------------


def test_world_size_over_the_machine_limit_is_a_usage_error_before_any_rank_starts(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_marked_sizes=WORLD_SIZES)
    result = pytester.runpytest_inprocess("--fsdp-world-sizes=2,100000", "-p", "no:randomly")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: world size 100000 from command line --fsdp-world-sizes is more than this "
            "machine can hold: at most * ranks (the smaller of memory: * GiB available x 0.8 / "
            "220 MiB per idle rank = *, cores: * x 8 = *); use a smaller world size, or set "
            "--fsdp-max-world-size N (env FSDP_CONFORMANCE_MAX_WORLD_SIZE, or max_world_size "
            "in [[]tool.fsdp_conformance[]]) to allow N ranks"
        ]
    )
    result.stdout.no_fnmatch_line("*passed*")


def test_world_size_marker_over_the_limit_names_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_big="""
        import pytest

        @pytest.mark.world_size(1000)
        def test_big(ranks):
            pass
        """
    )
    result = pytester.runpytest_inprocess("--fsdp-max-world-size=64")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "*world size 1000 from the world_size marker of test_big.py::test_big is more than "
            "this machine can hold: at most 64 ranks (set by command line "
            "--fsdp-max-world-size); use a smaller world size*"
        ]
    )


PRINT_DEADLINE = """
def test_note(ranks):
    print("NOTE", ranks.deadline_note)
"""


def test_a_users_timeout_is_respected_and_checks_fit_inside_it(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_marked_sizes=WORLD_SIZES, test_note=PRINT_DEADLINE)
    pytester.makeconftest(PRINT_TIMEOUTS)
    # The user's --timeout stands: the plugin adds no outer marker over it...
    result = pytester.runpytest_inprocess("-s", "-m", "cpu", "--timeout=30", "--fsdp-timeout=10")
    result.stdout.fnmatch_lines(["TIMEOUT test_uses_ranks[[]ws2-cpu[]]: None"])
    # ...and the checks' deadline is taken from it (no rank starts: no check runs here).
    result.stdout.fnmatch_lines(
        [
            "*NOTE this test's pytest-timeout of 30s (--timeout), less 5s for the stack dump and "
            "teardown"
        ]
    )
    result.assert_outcomes(passed=5)


def test_without_a_users_timeout_checks_fit_inside_the_outer_guard(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_note=PRINT_DEADLINE)
    result = pytester.runpytest_inprocess("-s", "-m", "cpu", "--fsdp-timeout=10")
    result.stdout.fnmatch_lines(
        [
            "*NOTE this test's pytest-timeout of 110s (the plugin's outer guard), less 5s for the "
            "stack dump and teardown"
        ]
    )


# --------------------------------------------------------------------------------------------
# The model's checks: node ids with a file part, collected from any folder; a clone of the
# suite inside a user's project is not the project's tests
# --------------------------------------------------------------------------------------------

REPOSITORY = Path(__file__).resolve().parent.parent
USER_FILES = {
    "fsdpc_plugin_model": (
        "from torch import nn\n\n\ndef build():\n"
        "    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))\n"
    ),
    "test_users_own": "def test_users_own():\n    pass\n",
}
MODEL_ARGS = ("--fsdp-model", "fsdpc_plugin_model:build", "--fsdp-block-cls", "Linear")


@pytest.fixture
def user_repository(pytester: pytest.Pytester) -> pytest.Pytester:
    """A user's project: a model module and a test of the user's own, importable by the inner
    sessions."""
    pytester.makepyfile(**USER_FILES)
    pytester.syspathinsert()
    return pytester


def _clone_of_the_suite(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *, installed: bool
) -> Path:
    """A clone of this repository in ``project``'s folder: its pytest configuration, its
    conftests and a test of its own; ``installed``: the package imported from the clone (an
    editable install of it), so model_tests.py lies inside the folder pytest runs in."""
    clone = project.path / "fsdp-conformance"
    for name in ("pyproject.toml", "conftest.py", "tests/conftest.py"):
        if (REPOSITORY / name).exists():  # (copied where this checkout has it)
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPOSITORY / name, clone / name)
    (clone / "tests").mkdir(parents=True, exist_ok=True)
    (clone / "tests" / "test_suite_own.py").write_text("def test_suite_own():\n    pass\n")
    if installed:
        import fsdp_conformance.model_tests as model_tests

        package = clone / "fsdp_conformance"
        package.mkdir()
        (package / "__init__.py").write_text("")
        shutil.copy(model_tests.__file__, package / "model_tests.py")
        # the module's file as an editable install of the clone has it (main's plugin read it
        # from the module, this one from beside itself)
        monkeypatch.setattr(model_tests, "__file__", str(package / "model_tests.py"))
        monkeypatch.setattr(plugin, "MODEL_TESTS_PATH", package / "model_tests.py", raising=False)
    return clone


def _collected(result: pytest.RunResult) -> list[str]:
    return [line for line in result.stdout.lines if "::" in line]


@pytest.mark.process
def test_the_model_checks_have_node_ids_with_a_file_part(
    user_repository: pytest.Pytester,
) -> None:
    result = user_repository.runpytest_inprocess(
        *MODEL_ARGS, "--co", "-q", "-m", "cpu", "-k", "wrap.units.exact or users_own"
    )
    assert _collected(result) == [
        "test_users_own.py::test_users_own",
        *(
            "fsdp_conformance/model_tests.py::test_conformance[wrap.units.exact"
            f"[{v},fsdpc_plugin_model:build]-ws2-cpu]"
            for v in ("fsdp1", "fsdp2")
        ),
    ]
    # the reference suite by --pyargs (the README's command): pytest collects the module itself
    reference = user_repository.runpytest_inprocess(
        "--co", "-q", "-m", "cpu", "-k", "wrap.units.exact", "--pyargs", plugin.MODEL_TESTS
    )
    assert _collected(reference) == [
        f"fsdp_conformance/model_tests.py::test_conformance[wrap.units.exact[{v},{m}]-ws2-cpu]"
        for v in ("fsdp1", "fsdp2")
        for m in ("massive", "tied")
    ]
    # both: the module once
    both = user_repository.runpytest_inprocess(
        *MODEL_ARGS,
        "--co",
        "-q",
        "-m",
        "cpu",
        "-k",
        "wrap.units.exact",
        "--pyargs",
        plugin.MODEL_TESTS,
    )
    assert _collected(both) == _collected(result)[1:]


@pytest.mark.process
def test_from_a_folder_holding_a_clone_of_the_suite_the_model_checks_are_collected(
    user_repository: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clone_of_the_suite(user_repository, monkeypatch, installed=True)
    result = user_repository.runpytest_inprocess(
        *MODEL_ARGS, "--co", "-q", "-m", "cpu", "-k", "wrap.units.exact or own"
    )
    assert _collected(result) == [
        "test_users_own.py::test_users_own",
        *(
            "fsdp-conformance/fsdp_conformance/model_tests.py::test_conformance[wrap.units.exact"
            f"[{v},fsdpc_plugin_model:build]-ws2-cpu]"
            for v in ("fsdp1", "fsdp2")
        ),
    ]


@pytest.mark.process
def test_a_clone_of_the_suite_in_a_users_project_is_not_collected_as_the_projects_tests(
    user_repository: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    user_repository.makepyprojecttoml(
        "[tool.pytest.ini_options]\naddopts = '-p no:cacheprovider'\n"
    )
    _clone_of_the_suite(user_repository, monkeypatch, installed=False)
    result = user_repository.runpytest_inprocess("--co", "-q")
    assert _collected(result) == ["test_users_own.py::test_users_own"]
    # the control: the clone's tests, asked for, are collected (the clone is their rootdir)
    result = user_repository.runpytest_inprocess("--co", "-q", "fsdp-conformance/tests")
    assert _collected(result) == ["tests/test_suite_own.py::test_suite_own"]
