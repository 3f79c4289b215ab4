"""Whether a lane can run here: asked of torch once per process, decided in one place, and
said with the flag of the front end in use (``--fsdp-world-sizes`` under pytest,
``--world-sizes`` under ``fsdp-conformance run``).

The machine's CUDA devices are faked (torch.cuda patched: one device) so that the gpu lane's
"too few devices" reason is reached on the CPU build machines too. The pytest front end is an
inner session in this process (``runpytest_inprocess``), which sees the same patched torch.
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


@pytest.fixture
def one_fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """torch.cuda reports one device (so world size 2 is one too many); yields the list of
    torch's device-count queries."""
    import torch

    queries: list[int] = []

    def device_count() -> int:
        queries.append(1)
        return 1

    cuda_device_count.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: "Fake GPU")
    try:
        yield queries
    finally:
        cuda_device_count.cache_clear()  # the next test sees the real machine


def test_torch_is_asked_for_the_devices_once_per_process(one_fake_gpu: list[int]) -> None:
    reasons = {lane_unavailable("gpu", n) for n in (1, 2, 2, 4)}
    assert len(one_fake_gpu) == 1, "every lane decision asked torch again"
    assert None in reasons and len(reasons) == 3  # the answers still follow the world size
    cuda_device_count.cache_clear()  # what a test faking the devices does: torch is asked again
    assert lane_unavailable("gpu", 1) is None and len(one_fake_gpu) == 2


@pytest.mark.parametrize(("flag_style", "flag", "other"), [
    ("pytest", "--fsdp-world-sizes", "--world-sizes"),
    ("cli", "--world-sizes", "--fsdp-world-sizes"),
])
def test_the_reason_names_the_world_size_flag_of_the_front_end(
    one_fake_gpu: list[int], flag_style: str, flag: str, other: str
) -> None:
    reason = lane_unavailable("gpu", 2, flag_style)  # type: ignore[arg-type]
    assert reason == (
        "gpu lane: world size 2 needs 2 CUDA devices, found 1 (one rank per device); run it on a "
        f"machine with 2 GPUs (tests without a world_size marker follow {flag}, e.g. 1)")
    assert f" {other}," not in reason


def test_fsdp_conformance_run_names_its_own_flag(
    one_fake_gpu: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for option in OPTIONS:
        monkeypatch.delenv(option.env, raising=False)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", "--lane", "gpu", "--world-sizes", "2", "--checks",
                     "wrap.units.exact", "--out", "out", "--no-plot"])
    capsys.readouterr()
    assert code == cli.EXIT_OK
    checks = json.loads((tmp_path / "out" / "report.json").read_text())["checks"]
    assert checks and {c["outcome"] for c in checks} == {"skipped"}
    for entry in checks:
        assert entry["message"].endswith(
            "(tests without a world_size marker follow --world-sizes, e.g. 1)"), entry["message"]


def test_pytest_names_its_own_flag(one_fake_gpu: list[int], pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_gpu="""
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
        """)
    result = pytester.runpytest_inprocess("-m", "gpu", "-rs", "--fsdp-world-sizes", "2")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines([
        "SKIPPED [[]2[]] *gpu lane: world size 2 needs 2 CUDA devices, found 1 (one rank per "
        "device); run it on a machine with 2 GPUs (tests without a world_size marker follow "
        "--fsdp-world-sizes, e.g. 1)"])
