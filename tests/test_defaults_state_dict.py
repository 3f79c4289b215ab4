"""``defaults.state_dict`` on real ranks, FSDP1 and FSDP2: what the state-dict APIs and the
loaders do with their options left unset, observed; a default changed in torch on the ranks
(``fault``) fails the check, naming each moved observable, expected vs observed."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.claims.check import Verdict
from fsdp_conformance.claims.defaults import CHECKS
from fsdp_conformance.claims.defaults.state_dict import (
    EXPECTED,
    FAULTS,
    StateDictDefaults,
    verdict_state_dict,
)
from fsdp_conformance.gate import report as gate_report
from fsdp_conformance.gate.compare import compare_reports
from fsdp_conformance.harness import Ranks
from fsdp_conformance.settings import Settings

pytestmark = pytest.mark.cpu

STATE_DICT = {c.params["version"]: c for c in CHECKS if c.name == "defaults.state_dict"}

#: Per version, the figures each fault must move (expected on torch 2.13 -> under the fault).
MOVED: dict[str, dict[str, tuple[Any, Any]]] = {
    "fsdp1": {
        "get_model_state_dict.value_type": ("ShardedTensor", "Tensor"),
        "get_model_state_dict.layout": ("sharded", "full"),
        "get_optimizer_state_dict.layout": ("sharded", "full"),
        "full_state_dict_type.ranks_holding": ("every rank", "rank 0 only"),
        "summon_full_params.change_inside": ("kept", "discarded"),
        "torch_load.foreign_object": ("refused (UnpicklingError)", "read"),
        "torch_load.get_model_state_dict": ("refused (UnpicklingError)", "read"),
    },
    "fsdp2": {
        "get_model_state_dict.value_type": ("DTensor", "Tensor"),
        "get_model_state_dict.layout": ("sharded", "full"),
        "get_model_state_dict.shares_storage": (True, False),
        "get_optimizer_state_dict.layout": ("sharded", "full"),
        "get_model_state_dict.submodule_keys": (
            ["layers.1.bias", "layers.1.weight"],
            ["bias", "weight"],
        ),
        "set_model_state_dict.missing_key": ("raises RuntimeError", "returned []"),
        "torch_load.foreign_object": ("refused (UnpicklingError)", "read"),
    },
}
#: The faults each version's run injects at once (FSDP1 has no faults of FSDP2's alone).
VERSION_FAULTS = {
    "fsdp1": tuple(FAULTS),
    "fsdp2": (
        "full_state_dict_default",
        "keep_submodule_prefixes_default",
        "strict_default",
        "torch_load_weights_only_default",
    ),
}


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[str, bool], list[StateDictDefaults]]:
    """Every rank's values of one clean and one faulted run per version."""
    return {}


def _values(
    ranks: Ranks, runs: dict[tuple[str, bool], list[StateDictDefaults]], version: str, faulted: bool
) -> list[StateDictDefaults]:
    key = (version, faulted)
    if key not in runs:
        check = STATE_DICT[version]
        faults = VERSION_FAULTS[version] if faulted else ()
        runs[key] = ranks.run(check.rank_fn, **{**check.params, "fault": faults})
    return runs[key]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("version", ["fsdp1", "fsdp2"])
def test_state_dict_defaults_match_torch_and_a_changed_default_fails_naming_it(
    ranks: Ranks, shared_runs: dict[tuple[str, bool], list[StateDictDefaults]], version: str
) -> None:
    check = STATE_DICT[version]
    clean = check.verdict(_values(ranks, shared_runs, version, False), check.params)
    assert clean.passed, clean.message
    assert {k: clean.figures[k] for k in EXPECTED[version]} == EXPECTED[version]
    changed = check.verdict(_values(ranks, shared_runs, version, True), check.params)
    assert not changed.passed
    head, *lines = changed.message.splitlines()
    assert head.startswith(f"{version} state-dict defaults differ from the pinned torch's: ")
    for key, (want, got) in MOVED[version].items():
        line = f"  {key}: expected {want!r} (torch 2.13, options unset), observed {got!r}"
        assert line in lines, (line, changed.message)
        assert key in head
    # compare between the two reports: the outcome a regression, each moved figure a difference
    diffs = compare_reports(_report(version, clean), _report(version, changed))
    [outcome] = [d for d in diffs if d.kind == "outcome"]
    assert outcome.regression and outcome.text.startswith("passed -> failed: "), outcome
    figures = {d.text.split(":", 1)[0] for d in diffs if d.kind == "figure"}
    assert set(MOVED[version]) <= figures, figures


def _report(version: str, verdict: Verdict) -> dict[str, Any]:
    entry = gate_report.check_entry(
        check="defaults.state_dict",
        claim="defaults",
        lane="cpu",
        world_size=2,
        variant=version,
        outcome="passed" if verdict.passed else "failed",
        message=verdict.message,
        figures=verdict.figures,
        data=verdict.data,
        seconds=1.0,
        warnings=(),
    )
    return gate_report.build_report([entry], Settings(), 1.0)


def _verdict(version: str, **changes: Any) -> Verdict:
    figures = {**EXPECTED[version], **changes}
    values: list[StateDictDefaults] = [{"rank": r, "figures": dict(figures)} for r in range(2)]
    return verdict_state_dict(values, {"version": version})


def test_the_verdict_names_a_moved_figure_and_ranks_that_disagree() -> None:
    # Parent side: the 2.13 figures pass; one moved fails naming it; ranks that disagree fail.
    assert _verdict("fsdp2").passed
    moved = _verdict("fsdp1", **{"summon_full_params.ranks_whole": "rank 0 only"})
    assert not moved.passed
    assert moved.message.splitlines() == [
        "fsdp1 state-dict defaults differ from the pinned torch's: summon_full_params.ranks_whole",
        "  summon_full_params.ranks_whole: expected 'every rank' (torch 2.13, options unset), "
        "observed 'rank 0 only'",
    ]
    values: list[StateDictDefaults] = [
        {"rank": 0, "figures": dict(EXPECTED["fsdp2"])},
        {"rank": 1, "figures": {**EXPECTED["fsdp2"], "dcp_load.in_place": False}},
    ]
    split = verdict_state_dict(values, {"version": "fsdp2"})
    assert not split.passed
    assert "rank 1 observed other figures than rank 0: dcp_load.in_place" in split.message
