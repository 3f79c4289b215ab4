"""Whether a lane can run here: asked of torch once per process, decided in one place, and
said with the flag of the front end in use (``--fsdp-world-sizes`` under pytest,
``--world-sizes`` under ``fsdp-conformance run``).

The machine's CUDA devices are faked (torch.cuda patched: one device, or two) so that the gpu
lane's "too few devices" reason is reached on the CPU build machines too. The pytest front end
is an inner session in this process (``runpytest_inprocess``), which sees the same patched
torch. Under an external launcher (its variables set here) the ranks of this node are what the
devices must hold, not the launch's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_conformance import cli
from fsdp_conformance.harness import cuda_device_count, lane_unavailable
from fsdp_conformance.settings import OPTIONS

pytestmark = pytest.mark.cpu


LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "SLURM_LOCALID",
    "CUDA_VISIBLE_DEVICES",
)


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> Iterator[list[int]]:
    """torch.cuda reports ``count`` devices, and this process is no launched rank (until a
    test says so); yields the list of torch's device-count queries."""
    import torch

    queries: list[int] = []

    def device_count() -> int:
        queries.append(1)
        return count

    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cuda_device_count.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: "Fake GPU")
    try:
        yield queries
    finally:
        cuda_device_count.cache_clear()  # the next test sees the real machine


@pytest.fixture
def one_fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """torch.cuda reports one device (so world size 2 is one too many)."""
    yield from _fake_gpus(monkeypatch, 1)


@pytest.fixture
def two_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """torch.cuda reports two devices (one node of two GPUs)."""
    yield from _fake_gpus(monkeypatch, 2)


def _launched(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    """This process is rank RANK of a launch (torchrun, srun) with these variables."""
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "node0",
        **variables,
    }.items():
        monkeypatch.setenv(name, value)


def test_torch_is_asked_for_the_devices_once_per_process(one_fake_gpu: list[int]) -> None:
    reasons = {lane_unavailable("gpu", n) for n in (1, 2, 2, 4)}
    assert len(one_fake_gpu) == 1, "every lane decision asked torch again"
    assert None in reasons and len(reasons) == 3  # the answers still follow the world size
    cuda_device_count.cache_clear()  # what a test faking the devices does: torch is asked again
    assert lane_unavailable("gpu", 1) is None and len(one_fake_gpu) == 2


@pytest.mark.parametrize(
    ("flag_style", "flag", "other"),
    [
        ("pytest", "--fsdp-world-sizes", "--world-sizes"),
        ("cli", "--world-sizes", "--fsdp-world-sizes"),
    ],
)
def test_the_reason_names_the_world_size_flag_of_the_front_end(
    one_fake_gpu: list[int], flag_style: str, flag: str, other: str
) -> None:
    reason = lane_unavailable("gpu", 2, flag_style)  # type: ignore[arg-type]
    assert reason == (
        "gpu lane: world size 2 needs 2 CUDA devices, found 1 (one rank per device); run it on a "
        f"machine with 2 GPUs (tests without a world_size marker follow {flag}, e.g. 1)"
    )
    assert f" {other}," not in reason


def test_fsdp_conformance_run_names_its_own_flag(
    one_fake_gpu: list[int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for option in OPTIONS:
        monkeypatch.delenv(option.env, raising=False)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.chdir(tmp_path)
    code = cli.main(
        [
            "run",
            "--lane",
            "gpu",
            "--world-sizes",
            "2",
            "--checks",
            "wrap.units.exact",
            "--out",
            "out",
            "--no-plot",
        ]
    )
    capsys.readouterr()
    assert code == cli.EXIT_OK
    checks = json.loads((tmp_path / "out" / "report.json").read_text())["checks"]
    assert checks and {c["outcome"] for c in checks} == {"skipped"}
    for entry in checks:
        assert entry["message"].endswith(
            "(tests without a world_size marker follow --world-sizes, e.g. 1)"
        ), entry["message"]


def test_pytest_names_its_own_flag(one_fake_gpu: list[int], pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_gpu="""
        import pytest


        def _rank(ctx):
            return ctx.rank


        @pytest.mark.gpu
        def test_with_ranks(ranks):
            ranks.run(_rank)


        @pytest.mark.gpu
        @pytest.mark.world_size(2)
        def test_without_ranks(world_size):
            pass
        """
    )
    result = pytester.runpytest_inprocess("-m", "gpu", "-rs", "--fsdp-world-sizes", "2")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]2[]] *gpu lane: world size 2 needs 2 CUDA devices, found 1 (one rank per "
            "device); run it on a machine with 2 GPUs (tests without a world_size marker follow "
            "--fsdp-world-sizes, e.g. 1)"
        ]
    )


def test_a_two_node_launch_of_two_ranks_per_node_runs_on_two_gpus_per_node(
    two_fake_gpus: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rank 3 of 4: the second node's second rank. Its node holds 2 ranks on 2 devices.
    _launched(monkeypatch, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    assert lane_unavailable("gpu", 4) is None
    assert lane_unavailable("gpu", 4, "cli") is None  # fsdp-conformance run decides alike


def test_more_ranks_on_a_node_than_its_gpus_skip_naming_the_node_and_the_fix(
    two_fake_gpus: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _launched(monkeypatch, WORLD_SIZE="8", LOCAL_WORLD_SIZE="4")
    assert lane_unavailable("gpu", 8) == (
        "gpu lane: this node runs 4 ranks of the launch (LOCAL_WORLD_SIZE=4) and this process "
        "sees 2 CUDA devices (one rank per device); launch at most 2 ranks per node (torchrun "
        "--nproc-per-node 2), or give each rank its own GPU (srun --gpus-per-task=1)"
    )


def test_without_local_world_size_the_launch_is_taken_as_one_node(
    two_fake_gpus: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _launched(monkeypatch, WORLD_SIZE="2")
    assert lane_unavailable("gpu", 2) is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    reason = lane_unavailable("gpu", 4)
    assert reason is not None and reason.startswith(
        "gpu lane: this node runs 4 ranks of the launch (WORLD_SIZE=4, LOCAL_WORLD_SIZE unset) "
        "and this process sees 2 CUDA devices"
    )


def test_an_srun_task_given_its_own_gpu_runs_though_it_sees_one(
    one_fake_gpu: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # srun --ntasks-per-node=4 --gpus-per-task=1: each task sees its one GPU as cuda:0.
    _launched(monkeypatch, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4")
    assert lane_unavailable("gpu", 8) is not None  # a torchrun of 4 ranks on one GPU: no
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert lane_unavailable("gpu", 8) is None
