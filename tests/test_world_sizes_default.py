"""World sizes left unset: 2, and 4 where the machine has a core per rank.

The rule lives in ``settings.default_world_sizes``; the run plans every selected check at each
resolved world size, and its header says which default size was left out and how to run it.
"""

from __future__ import annotations

import pytest

from fsdp_conformance.gate.report import environment_summary
from fsdp_conformance.settings import (
    DEFAULT_WORLD_SIZES,
    default_world_sizes,
    resolve_settings,
    world_sizes_left_out,
)

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize(
    ("cores", "expected"), [(1, (2,)), (2, (2,)), (3, (2,)), (4, (2, 4)), (64, (2, 4))]
)
def test_default_world_sizes_follow_the_cores(cores: int, expected: tuple[int, ...]) -> None:
    assert DEFAULT_WORLD_SIZES == (2, 4)
    assert default_world_sizes(cores) == expected
    s = resolve_settings({}, {}, {}, cores=lambda: cores)
    assert s.world_sizes == expected and s.sources["world_sizes"] == "default"


def test_world_sizes_that_are_set_are_kept_whatever_the_cores() -> None:
    for cli, env in (({"world_sizes": "2,4"}, {}), ({}, {"FSDP_CONFORMANCE_WORLD_SIZES": "2,4"})):
        s = resolve_settings(cli, env, {}, cores=lambda: 2)
        assert s.world_sizes == (2, 4)
        assert world_sizes_left_out(s) == ""
    assert resolve_settings({"world_sizes": "2"}, {}, {}, cores=lambda: 64).world_sizes == (2,)


def test_the_header_says_which_default_size_was_left_out_and_how_to_run_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fsdp_conformance import settings as settings_module

    monkeypatch.setattr(settings_module, "usable_cores", lambda: 2)
    two = resolve_settings({}, {}, {})
    assert two.world_sizes == (2,)
    header = environment_summary(two)
    assert (
        "world sizes 2 (4 left out of the default 2,4: 2 core(s) here, one per rank "
        "needed; set world sizes 2,4 (--world-sizes / --fsdp-world-sizes) to run it)" in header
    ), header
    monkeypatch.setattr(settings_module, "usable_cores", lambda: 8)
    eight = resolve_settings({}, {}, {})
    assert eight.world_sizes == (2, 4)
    assert "world sizes 2,4," in environment_summary(eight)
    assert "left out" not in environment_summary(eight)


def test_a_run_on_a_four_core_machine_plans_every_check_at_2_and_4(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The run's plan, not only the setting: each selected check once per default world size.
    from fsdp_conformance import settings as settings_module
    from fsdp_conformance.gate.suite import plan_suite

    monkeypatch.setattr(settings_module, "usable_cores", lambda: 4)
    plan = plan_suite(resolve_settings({}, {}, {}), ["cpu"], pattern="init.weights").runs
    assert sorted({ws for _, ws, _, _ in plan}) == [2, 4]
    assert len([p for p in plan if p[1] == 2]) == len([p for p in plan if p[1] == 4]) > 0
