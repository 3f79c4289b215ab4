"""The GPU lane's scripts and tox env, and the lint script, proved on a CPU machine.

``ci/gpu-check.sh``, ``ci/gpu-lane.sh`` and ``ci/lint.sh`` run here with a stand-in ``python``
(first on PATH and given as ``PYTHON``): it logs every call, runs ``-c`` probes on the real
interpreter, where a fake ``torch`` on ``PYTHONPATH`` can claim CUDA devices, and only pretends
to run pip, venv, pytest, ruff, mypy, pylint, the report and torchrun. Nothing is installed or
downloaded, and no test lane runs.
"""

from __future__ import annotations

import configparser
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

#: Each test but the tox ones runs a script (bash and the stand-in python): the process lane.
process = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("ci/gpu-check.sh", "ci/gpu-lane.sh", "ci/lint.sh", "ci/upgrade-gate.sh")

STUB = r"""#!/usr/bin/env bash
# Stand-in for python, pip and the tools the GPU scripts call: logs the call, then pretends.
if [ "${1:-}" = -c ]; then echo "$0 -c" >>"$STUB_LOG"; else echo "$0 $*" >>"$STUB_LOG"; fi
# A call with the word STUB_FAIL in it fails (a lint tool that finds something).
if [ -n "${STUB_FAIL:-}" ] && [[ " $* " == *" $STUB_FAIL "* ]]; then exit 1; fi
name=$(basename "$0")
case "$name" in
  pip | pip3) set -- -m pip "$@" ;;
  fsdp-conformance) exit "${STUB_REPORT_RC:-0}" ;;
  nvidia-smi)
    for ((i = 0; i < ${STUB_GPUS:-0}; i++)); do echo "GPU $i: Fake GPU (UUID: GPU-$i)"; done
    [ "${STUB_GPUS:-0}" -gt 0 ] || { echo "No devices were found"; exit 6; }
    exit 0 ;;
  python | python3) ;;
  *) exit 0 ;;
esac
case "${1:-} ${2:-}" in
  "-c "*) exec "$REAL_PYTHON" "$@" ;;
  "-m pip")
    if [ "${STUB_PIP:-ok}" = offline ]; then
      case " $* " in *" --no-deps "*) exit 0 ;; *) echo "ERROR: no network" >&2; exit 1 ;; esac
    fi
    exit 0 ;;
  "-m venv")
    dir="${!#}"
    mkdir -p "$dir/bin"
    ln -sf "$STUB_SELF" "$dir/bin/python"
    echo "PATH=\"$dir/bin:\$PATH\"" >"$dir/bin/activate"
    exit 0 ;;
  "-m pytest") exit "${STUB_PYTEST_RC:-0}" ;;
  "-m fsdp_conformance.cli") exit "${STUB_REPORT_RC:-0}" ;;
esac
exit 0
"""

FAKE_TORCH = """import os

__version__ = "9.9.9+fake"


class version:
    cuda = "12.8"


class cuda:
    @staticmethod
    def device_count():
        return int(os.environ.get("FAKE_CUDA_DEVICES", "0"))

    @staticmethod
    def is_available():
        return cuda.device_count() > 0

    @staticmethod
    def get_device_name(index=0):
        return "Fake GPU"

    class nccl:
        @staticmethod
        def version():
            return (2, 0, 0)
"""


class Stubs:
    """A PATH of stand-ins, the fake modules, and the log of what the scripts called."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.fake = tmp / "fake"
        self.log = tmp / "calls.log"
        self.out = tmp / "out"
        self.venvs = tmp / "venvs"
        self.bin.mkdir()
        self.fake.mkdir()
        self.log.touch()
        self.python = self.bin / "python"
        for name in (
            "python",
            "python3",
            "pip",
            "pip3",
            "fsdp-conformance",
            "torchrun",
            "nvidia-smi",
        ):
            (self.bin / name).write_text(STUB)
            (self.bin / name).chmod(0o755)

    def fake_torch(self, devices: int) -> dict[str, str]:
        """A torch that sees ``devices`` CUDA devices (on PYTHONPATH, before the real one)."""
        (self.fake / "torch").mkdir(exist_ok=True)
        (self.fake / "torch" / "__init__.py").write_text(FAKE_TORCH)
        return {"PYTHONPATH": str(self.fake), "FAKE_CUDA_DEVICES": str(devices)}

    def missing(self, module: str) -> None:
        """Make ``import module`` fail as a module that is not installed does."""
        (self.fake / f"{module}.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{module}'\", name={module!r})\n"
        )

    def run(self, script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("FSDP_CONFORMANCE_", "TORCH_", "GPU_", "STUB_", "FAKE_"))
            and k not in ("PYTHON", "PYTHONPATH", "OUT", "CUDA_VISIBLE_DEVICES", "VIRTUAL_ENV")
        }
        base.update(
            {
                "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHON": str(self.python),
                "OUT": str(self.out),
                "GPU_VENV_ROOT": str(self.venvs),
                "STUB_LOG": str(self.log),
                "STUB_SELF": str(self.python),
                "REAL_PYTHON": sys.executable,
            }
        )
        base.update(env)
        return subprocess.run(
            ["bash", str(ROOT / script), *args],
            env=base,
            text=True,
            capture_output=True,
            timeout=180,
            stdin=subprocess.DEVNULL,
        )

    def calls(self, needle: str = "") -> list[str]:
        return [line for line in self.log.read_text().splitlines() if needle in line]


@pytest.fixture
def stubs(tmp_path: Path) -> Stubs:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    return Stubs(tmp_path)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    return lines[0]


def after(args: str, flag: str) -> str:
    """The word after ``flag`` in a logged command line."""
    match = re.search(rf"(?:^| ){re.escape(flag)} (\S+)", args)
    assert match, f"{flag} is not in {args!r}"
    return match.group(1)


def nothing_ran(stubs: Stubs) -> None:
    """No pip, venv, pytest, report or torchrun: only ``-c`` probes were called."""
    others = [line for line in stubs.calls() if not line.endswith(" -c")]
    assert others == [], f"the script ran more than probes: {others}"


@pytest.mark.parametrize("script", SCRIPTS)
@process
def test_script_parses(script: str) -> None:
    result = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@process
def test_gpu_check_refuses_without_a_gpu_and_writes_nothing(stubs: Stubs) -> None:
    result = stubs.run("ci/gpu-check.sh", {"CUDA_VISIBLE_DEVICES": ""})  # the real torch
    assert result.returncode != 0, f"exit 0 without a GPU:\n{result.stdout}{result.stderr}"
    line = one_line(result.stderr)
    assert "no GPU visible" in line and "torch.cuda.device_count() is 0" in line, line
    assert not stubs.out.exists(), f"wrote {sorted(p.name for p in stubs.out.iterdir())}"
    nothing_ran(stubs)


@process
def test_gpu_check_refuses_without_torch(stubs: Stubs) -> None:
    stubs.missing("torch")
    result = stubs.run("ci/gpu-check.sh", {"PYTHONPATH": str(stubs.fake)})
    assert result.returncode != 0, f"exit 0 without torch:\n{result.stdout}{result.stderr}"
    line = one_line(result.stderr)
    assert "cannot import torch" in line and str(stubs.python) in line, line
    assert not stubs.out.exists()
    nothing_ran(stubs)


@process
def test_gpu_check_names_a_missing_pytest_timeout(stubs: Stubs) -> None:
    """Offline: the full install fails, the --no-deps one succeeds, pytest-timeout is absent."""
    stubs.missing("pytest_timeout")
    result = stubs.run("ci/gpu-check.sh", {**stubs.fake_torch(1), "STUB_PIP": "offline"})
    assert result.returncode != 0, f"exit 0 without pytest-timeout:\n{result.stdout}"
    line = one_line(result.stderr)
    assert "pytest-timeout" in line and f"{stubs.python} -m pip install" in line, line
    assert stubs.calls(" -m pip install"), "the install did not go through $PYTHON -m pip"
    assert not stubs.calls("/pip "), f"bare pip called: {stubs.calls('/pip ')}"
    assert not stubs.calls(" -m pytest"), "the tests ran without their dependencies"


@pytest.mark.parametrize(
    ("devices", "sizes", "launched", "pytest_rc", "report_rc"),
    [
        (1, "1", "1", 1, 0),
        (3, "1,2", "2", 0, 4),
        (8, "1,2,4,8", "8", 1, 0),
    ],
)
@process
def test_gpu_check_runs_every_world_size_and_keeps_the_artifacts_and_the_worst_status(
    stubs: Stubs, devices: int, sizes: str, launched: str, pytest_rc: int, report_rc: int
) -> None:
    env = {
        **stubs.fake_torch(devices),
        "GPU_CHECK_INSTALL": "0",
        "STUB_PYTEST_RC": str(pytest_rc),
        "STUB_REPORT_RC": str(report_rc),
    }
    result = stubs.run("ci/gpu-check.sh", env)
    assert result.returncode == max(pytest_rc, report_rc), result.stdout + result.stderr
    tests = [c for c in stubs.calls(" -m pytest -m gpu") if "torch.distributed.run" not in c]
    assert len(tests) == 1, stubs.calls()
    assert after(tests[0], "--fsdp-world-sizes") == sizes
    assert after(tests[0], "--junitxml") == str(stubs.out / "junit-gpu.xml")
    reports = stubs.calls(" run --lane gpu")
    assert len(reports) == 1, f"no report after the tests: {stubs.calls()}"
    assert reports[0].startswith(f"{stubs.python} -m fsdp_conformance.cli "), reports[0]
    assert after(reports[0], "--world-sizes") == sizes
    assert after(reports[0], "--out") == str(stubs.out / "report")
    torchrun = stubs.calls(" -m torch.distributed.run ")
    assert len(torchrun) == 1 and after(torchrun[0], "--nproc-per-node") == launched, torchrun
    assert after(torchrun[0], "--log-dir") == str(stubs.out / "torchrun")
    steps = (stubs.out / "steps.txt").read_text()
    assert f"== pytest-gpu: exit {pytest_rc}" in steps and f"== report: exit {report_rc}" in steps


@process
def test_gpu_lane_refuses_without_a_cuda_torch_and_installs_nothing(stubs: Stubs) -> None:
    result = stubs.run("ci/gpu-lane.sh", {"CUDA_VISIBLE_DEVICES": ""})  # the real torch
    assert result.returncode != 0, f"exit 0 without a GPU:\n{result.stdout}{result.stderr}"
    nothing_ran(stubs)
    assert not stubs.venvs.exists() and not stubs.out.exists()
    line = one_line(result.stderr)
    assert "sees no CUDA device" in line and "TORCH_SPEC" in line, line


@process
def test_gpu_lane_uses_the_runners_torch_and_writes_the_report_when_tests_fail(
    stubs: Stubs,
) -> None:
    result = stubs.run("ci/gpu-lane.sh", {**stubs.fake_torch(2), "STUB_PYTEST_RC": "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    venvs = stubs.calls(" -m venv ")
    assert len(venvs) == 1 and str(stubs.venvs) in venvs[0], venvs
    # The venv sees the runner's torch through its site-packages, also a venv's (this one's).
    runner_site = sysconfig.get_paths()["purelib"]
    pth = list(stubs.venvs.glob("*/lib/python*/site-packages/*.pth"))
    assert len(pth) == 1 and runner_site in pth[0].read_text().splitlines(), pth
    installs = stubs.calls(" -m pip install")
    assert installs and all("torch" not in c.split(" -m pip ")[1] for c in installs), installs
    assert all(c.startswith(str(stubs.venvs)) for c in installs), installs
    tests = [c for c in stubs.calls(" -m pytest -m gpu") if "torch.distributed.run" not in c]
    assert len(tests) == 1 and after(tests[0], "--fsdp-world-sizes") == "1,2", tests
    assert after(tests[0], "--junitxml").startswith(str(stubs.out)), tests
    reports = stubs.calls(" run --lane gpu")
    assert len(reports) == 1, f"no report after the failed tests: {stubs.calls()}"
    assert after(reports[0], "--out").startswith(str(stubs.out)), reports


@process
def test_gpu_lane_installs_a_pinned_torch_once_into_a_kept_venv(stubs: Stubs) -> None:
    env = {**stubs.fake_torch(1), "STUB_GPUS": "1", "TORCH_SPEC": "torch==2.13.0"}
    for _ in range(2):
        result = stubs.run("ci/gpu-lane.sh", env)
        assert result.returncode == 0, result.stdout + result.stderr
    venvs = stubs.calls(" -m venv ")
    assert len(venvs) == 1, f"the venv is not kept between runs: {venvs}"
    assert "--system-site-packages" not in venvs[0] and str(stubs.venvs) in venvs[0], venvs
    installs = stubs.calls(" -m pip install")
    assert len(installs) == 2 and all("torch==2.13.0" in c for c in installs), installs


@process
def test_gpu_lane_with_torch_spec_refuses_before_downloading_without_a_gpu(stubs: Stubs) -> None:
    result = stubs.run("ci/gpu-lane.sh", {"STUB_GPUS": "0", "TORCH_SPEC": "torch==2.13.0"})
    assert result.returncode != 0, result.stdout + result.stderr
    assert not stubs.calls(" -m pip") and not stubs.calls("/pip "), stubs.calls()
    assert "nvidia-smi lists no GPU" in one_line(result.stderr)


def tox_gpu_env() -> configparser.SectionProxy:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini", encoding="utf-8")
    assert tox.has_section("testenv:gpu"), "tox.ini has no [testenv:gpu]"
    return tox["testenv:gpu"]


def test_tox_gpu_env_passes_the_gpu_variables() -> None:
    gpu = tox_gpu_env()
    passenv = gpu.get("passenv", fallback=None)
    if passenv is None:  # tox: an env without its own passenv takes [testenv]'s
        passenv = gpu.parser.get("testenv", "passenv", fallback="")
    patterns = [p.strip() for p in re.split(r"[,\n]", passenv) if p.strip()]
    needed = [
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_NCCL_BLOCKING_WAIT",
        "TORCH_DISTRIBUTED_DEBUG",
        "PYTORCH_CUDA_ALLOC_CONF",
        "CUDA_VISIBLE_DEVICES",
        "NCCL_DEBUG",
        "NCCL_SOCKET_IFNAME",
        "FSDP_CONFORMANCE_WORLD_SIZES",
    ]
    dropped = [name for name in needed if not any(fnmatch.fnmatchcase(name, p) for p in patterns)]
    assert dropped == [], f"tox -e gpu drops {dropped} (passenv: {patterns})"


def test_tox_gpu_env_takes_its_world_sizes_from_the_devices() -> None:
    """Through ci/gpu-check.sh with the env's own python: world sizes from the device count,
    not the suite's default of 2, which skips every test on one GPU."""
    gpu = tox_gpu_env()
    commands = gpu.get("commands", fallback="")
    assert "ci/gpu-check.sh" in commands, f"tox -e gpu runs {commands!r}"
    setenv = gpu.get("setenv", fallback="")
    assert re.search(r"^\s*PYTHON\s*=\s*\{envpython\}\s*$", setenv, re.MULTILINE), setenv


#: ci/lint.sh's steps, in order: what .ci/run (the README's test command) and tox -e lint run.
LINT_STEPS = [
    "ruff check fsdp_conformance tests benchmarks conftest.py",
    "ruff format --check fsdp_conformance tests benchmarks conftest.py",
    "mypy fsdp_conformance",
    "pylint fsdp_conformance",
]


def lint_steps(stubs: Stubs) -> list[str]:
    calls = stubs.calls(" -m ")
    assert all(c.startswith(f"{stubs.python} -m ") for c in calls), calls
    return [c.split(" -m ", 1)[1] for c in calls]


@process
def test_lint_runs_its_four_steps_with_the_given_python(stubs: Stubs) -> None:
    result = stubs.run("ci/lint.sh", {})
    assert result.returncode == 0, result.stdout + result.stderr
    assert lint_steps(stubs) == LINT_STEPS


@process
def test_lint_runs_every_step_when_one_fails_and_names_the_failed_ones(stubs: Stubs) -> None:
    result = stubs.run("ci/lint.sh", {"STUB_FAIL": "--check"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert lint_steps(stubs) == LINT_STEPS, "a failed step stopped the ones after it"
    assert one_line(result.stderr) == "lint failed: ruff-format"
    stubs.log.write_text("")
    result = stubs.run("ci/lint.sh", {"STUB_FAIL": "fsdp_conformance"})
    assert result.returncode == 1 and len(lint_steps(stubs)) == 4, result.stdout
    assert one_line(result.stderr) == "lint failed: ruff-check ruff-format mypy repetition"


def test_tox_lint_env_runs_the_lint_script_with_its_own_python() -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini", encoding="utf-8")
    lint = tox["testenv:lint"]
    assert lint.get("commands", fallback="").split() == ["bash", "{toxinidir}/ci/lint.sh"], (
        f"tox -e lint runs {lint.get('commands')!r}, not ci/lint.sh (the list .ci/run runs)"
    )
    setenv = lint.get("setenv", fallback="")
    assert re.search(r"^\s*PYTHON\s*=\s*\{envpython\}\s*$", setenv, re.MULTILINE), setenv
    assert "lint" in lint.get("extras", fallback="").split(), "tox -e lint lacks the lint extra"


# --------------------------------------------------------------------------------------------
# ci/upgrade-gate.sh: both directions, the user's project, the noise, one verdict
# --------------------------------------------------------------------------------------------


def gate_calls(stubs: Stubs, project: Path) -> list[str]:
    """The fsdp-conformance calls the gate made, with the gate folder written as GATE."""
    gate = str(project / "fsdp-conformance-report" / "gate")
    return [
        c.split(" -m fsdp_conformance.cli ", 1)[1].replace(gate, "GATE")
        for c in stubs.calls(" -m fsdp_conformance.cli ")
    ]


@process
def test_upgrade_gate_runs_both_directions_on_the_users_project_with_its_noise(
    stubs: Stubs, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.fsdp_conformance]\nblock_cls = 'Block'\n")
    (tmp_path / "old.txt").write_text("torch==2.13.0\n")
    (tmp_path / "new.txt").write_text("torch==2.15.0\n")
    result = stubs.run(
        "ci/upgrade-gate.sh",
        {"GATE_PROJECT": str(project), "STUB_REPORT_RC": "1"},
        str(tmp_path / "old.txt"),
        str(tmp_path / "new.txt"),
        "--model",
        "mypkg.model:build",
    )
    # compare's status is the gate's: 1, not safe to upgrade
    assert result.returncode == 1, result.stdout + result.stderr
    # each side installs the suite and the user's project, with its own constraints
    installs = stubs.calls(" -m pip install")
    for side, pin in (("old", "old.txt"), ("new", "new.txt")):
        mine = [c for c in installs if f".venv-{side}/" in c]
        assert len(mine) == 2 and all(pin in c for c in mine), installs
        assert mine[1].endswith(f"-e {project}"), mine
    run = "run --lane auto --no-plot --out"
    assert gate_calls(stubs, project) == [
        f"{run} GATE/old --save-checkpoint GATE/checkpoint-old --model mypkg.model:build",
        f"{run} GATE/old-2 --model mypkg.model:build",
        "noise GATE/old/report.json GATE/old-2/report.json --out GATE/noise.json",
        f"{run} GATE/new --load-checkpoint GATE/checkpoint-old --save-checkpoint "
        "GATE/checkpoint-new --model mypkg.model:build",
        f"{run} GATE/new-resharded --checks state.checkpoint --world-sizes 4 --load-checkpoint "
        "GATE/checkpoint-old --model mypkg.model:build",
        f"{run} GATE/rollback --checks state.checkpoint --load-checkpoint GATE/checkpoint-new "
        "--model mypkg.model:build",
        *(
            "compare GATE/old/report.json GATE/new/report.json --loads "
            f"GATE/new-resharded/report.json --rollback GATE/rollback/report.json{fmt}"
            for fmt in ("", " --markdown", " --json")
        ),
    ]
    # the stand-in's noise command failed (exit 1): the gate went on without it, and said so
    assert "the noise was not measured" in result.stderr
    # with the noise measured, compare judges drift with it; safe: exit 0
    stubs.log.write_text("")
    result = stubs.run(
        "ci/upgrade-gate.sh",
        {"GATE_PROJECT": str(project)},
        str(tmp_path / "old.txt"),
        str(tmp_path / "new.txt"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    compares = [c for c in gate_calls(stubs, project) if c.startswith("compare ")]
    assert len(compares) == 3 and all("--noise GATE/noise.json" in c for c in compares)
