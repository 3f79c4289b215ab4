"""Training state across runs: ``state.checkpoint.optimizer`` (model
and AdamW state through ``get_state_dict`` and ``torch.distributed.checkpoint``) and
``state.checkpoint.torch_save`` (FSDP1's full, sharded and local state dicts written with
``torch.save``, read with ``torch.load``'s defaults), saved by one run and loaded by another; and
a load that torch refuses, which is a failure of one line, never an error.

The CPU lane saves each family once (one module-wide folder) and loads it; the negative controls
(each a run of its own: optimizer state not loaded, a value changed on read, ``torch.load``
refusing the file, the next step perturbed) run in the process lane (``pytest -m process``), as
the cross-version measurement does in docs/state.md (it needs a second torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_conformance.claims import state
from fsdp_conformance.claims.check import FAILED, Check, execute, run_check
from fsdp_conformance.claims.state import across_versions, common
from fsdp_conformance.harness import Ranks

#: The families' variants the tests run: (check name, FSDP version).
VARIANTS = (("state.checkpoint.optimizer", "fsdp2"), ("state.checkpoint.torch_save", "fsdp1"))


def the_check(name: str, version: str) -> Check:
    return next(c for c in state.CHECKS if c.name == name and c.params["version"] == version)


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One folder the module's saves write (each variant once, on the first test that needs
    it) and their verdicts."""
    return {"root": tmp_path_factory.mktemp("training-state"), "verdicts": {}}


def saved(ranks: Ranks, saved_root: dict[str, Any], name: str, version: str) -> Any:
    """The variant saved (once per module and world size) into the module's folder: its
    verdict."""
    key = (name, version, ranks.world_size)
    if key not in saved_root["verdicts"]:
        check = the_check(name, version)
        saved_root["verdicts"][key] = run_check(
            ranks, check, **{**check.params, "save_to": str(saved_root["root"])}
        )
    return saved_root["verdicts"][key]


def manifest_of(root: Path, name: str, version: str, world_size: int) -> dict[str, Any]:
    check = the_check(name, version)
    family = check.params["family"]
    folder = across_versions.family_folder(
        str(root), family, version, check.params["spec"], world_size
    )
    return json.loads((Path(folder) / across_versions.MANIFEST).read_text())  # type: ignore[no-any-return]


def test_the_training_state_checks_run_only_in_a_run_that_gives_a_folder(tmp_path: Path) -> None:
    from fsdp_conformance.gate import suite

    names = {c.name for c, _ in suite.select_checks(state.CHECKS, None)}
    assert not {n for n in names if n.startswith("state.checkpoint")}
    chosen = suite.select_checks(
        state.CHECKS, None, "state.checkpoint.", {"save_to": None, "load_from": str(tmp_path)}
    )
    assert sorted((c.name, p["version"]) for c, p in chosen) == [
        ("state.checkpoint.optimizer", "fsdp1"),
        ("state.checkpoint.optimizer", "fsdp2"),
        ("state.checkpoint.torch_save", "fsdp1"),
        ("state.checkpoint.torch_save.shared_step", "fsdp1"),
    ]


@pytest.mark.cpu
@pytest.mark.parametrize(("name", "version"), VARIANTS)
def test_training_state_saved_by_one_run_loads_and_steps_as_the_unbroken_run(
    ranks: Ranks, saved_root: dict[str, Any], name: str, version: str
) -> None:
    n = ranks.world_size
    save = saved(ranks, saved_root, name, version)
    assert save.passed, save.message
    manifest = manifest_of(saved_root["root"], name, version, n)
    assert (manifest["torch"], manifest["world_size"]) == (torch.__version__, n)
    # Every saved value: the model's and AdamW's state (one step: step, exp_avg, exp_avg_sq).
    optim_keys = [k for k in manifest["saved"] if k.startswith("optim/")]
    assert {k.rsplit("/", 1)[1] for k in optim_keys} == {"step", "exp_avg", "exp_avg_sq"}
    assert manifest["unbroken"]["digests"].keys() == manifest["saved"].keys()
    check = the_check(name, version)
    loaded = run_check(ranks, check, **{**check.params, "load_from": str(saved_root["root"])})
    assert loaded.passed, loaded.message
    f, d = loaded.figures, loaded.data
    assert f["checkpoint_torch"] == torch.__version__ and d["checkpoint_world_sizes"] == [n]
    sharded = version if name.endswith("optimizer") else "full:fsdp1"
    unsharded = "unsharded" if name.endswith("optimizer") else "full:unsharded"
    # At the saved world size on the saver's torch: the unbroken run's step, bitwise; in one
    # process (resharded to 1): within tolerances of the reference step from the loaded values.
    assert f"ws{n}->ws{n} {sharded}" in d["next_step_bitwise"]
    # FSDP1's full optimizer dict in one process: its next step is left to the shared_step
    # check where parameters share one step tensor (a known torch defect, measured).
    left = d["next_step_left_to_shared_step"]
    assert d["next_step_within_tolerance"] + left == [f"ws{n}->ws1 {unsharded}"]
    # Flat figures, as a report holds them (compare refuses a nested one).
    scalar = (str, int, float, bool, type(None))
    for key, value in f.items():
        assert isinstance(value, scalar) or all(isinstance(v, scalar) for v in value), key

    assert f["failed"] == [] and d["not_resharded"] == []
    if name.endswith("torch_save"):
        # What torch.load's defaults refuse is what the saver's read-back recorded: a figure
        # (this torch refuses a ShardedTensor with weights_only=True), not a failure.
        refused = {k for k, why in manifest["read_back"].items() if why}
        assert set(f["torch_load_refused"]) == refused
        assert {t.split()[1].split(":")[0] for t in d["torch_load_refused"]} == refused
        assert "full" not in refused
    # The save's read-back is the same work, with the same figures.
    assert save.figures == f and save.data == d


@pytest.mark.cpu
def test_a_refused_load_is_a_failure_of_one_line_not_an_error(
    ranks: Ranks, saved_root: dict[str, Any]
) -> None:
    # torch.load refusing the file (as weights_only=True refuses a class it does not allow):
    # the full file, which the saver's torch read with its defaults, fails in one line naming
    # both torches, torch's reason and the fix; the tracebacks stay in the data.
    name, version = VARIANTS[1]
    saved(ranks, saved_root, name, version)
    check = the_check(name, version)
    run = execute(
        ranks,
        check,
        **{**check.params, "load_from": str(saved_root["root"]), "fault": "torch_load_refused"},
    )
    assert run.outcome == FAILED and run.verdict is not None, run.detail
    first, second = run.detail.splitlines()[:2]
    v = torch.__version__
    assert first == (
        f"checkpoints written by torch {v} cannot be read by torch {v}: UnpicklingError: Weights "
        "only load failed. This file can still be loaded, to do so you have two options "
        "(simulated by the fault torch_load_refused)"
    )
    assert "weights_only=False" in second and "add_safe_globals" in second
    n = ranks.world_size
    figures = run.verdict.figures
    assert figures["unreadable"] == [f"ws{n}->ws{n} full:fsdp1", f"ws{n}->ws1 full:unsharded"]
    assert (figures["checkpoint_torch"], figures["load_torch"]) == (v, v)
    assert "Traceback" in run.verdict.data["tracebacks"][f"ws{n}->ws{n} full:fsdp1"]
    assert "Traceback" not in run.detail


@pytest.mark.cpu
def test_fsdp1s_full_optimizer_dict_in_one_process_steps_as_the_unbroken_run(
    ranks: Ranks,
) -> None:
    # Where FSDP1 shares one step tensor among a flat parameter's parameters and the optimizer
    # keeps the sharing, the step counts run ahead: the check fails (an expected failure on the
    # torch versions expectations.toml names), naming the shared tensor.
    check = the_check("state.checkpoint.torch_save.shared_step", "fsdp1")
    values = ranks.run(check.rank_fn, **{**check.params, "load_from": "unused"})
    verdict = check.verdict(values, check.params)
    steps = values[0]["unbroken_steps"]
    assert steps == [s + 1 for s in values[0]["saved_steps"]]
    if values[0]["shared"]:
        assert not verdict.passed and "one shared AdamW step tensor" in verdict.message
        assert max(verdict.figures["steps_after"]) > steps[0]
    else:
        assert verdict.passed, verdict.message
    # The verdict against a rank whose counts ran ahead, and one whose did not.
    ahead = [{**v, "steps_after": {k: steps[0] + 5 for k in v["steps_after"]}} for v in values]
    assert not check.verdict(ahead, check.params).passed
    right = [{**v, "steps_after": {k: steps[0] for k in v["steps_after"]}} for v in values]
    assert check.verdict(right, check.params).passed


@pytest.mark.cpu
def test_a_dcp_checkpoint_torch_cannot_read_is_a_failure_of_one_line(
    ranks: Ranks, tmp_path: Path
) -> None:
    # state.checkpoint: files whose metadata this torch cannot read (as torch 2.13 reads 2.15's:
    # docs/state.md) fail in one line, every target named; never an error with a traceback.
    check = the_check("state.checkpoint", "fsdp2")
    assert run_check(ranks, check, **{**check.params, "save_to": str(tmp_path)}).passed
    folder = Path(common.checkpoint_folder(str(tmp_path), "fsdp2", check.params["spec"]))
    (folder / ".metadata").write_bytes(b"not a checkpoint's metadata")
    run = execute(ranks, check, **{**check.params, "load_from": str(tmp_path)})
    assert run.outcome == FAILED and run.verdict is not None, run.detail
    v = torch.__version__
    assert run.detail.splitlines()[0].startswith(
        f"checkpoints written by torch {v} cannot be read by torch {v}: "
    )
    assert run.verdict.figures["unreadable"] == list(common.DCP_TARGETS)
    assert run.verdict.figures["load_torch"] == v
    assert set(run.verdict.data["tracebacks"]) == set(common.DCP_TARGETS)


#: Per fault, what it fails in each family (``n``: the world size).
NEGATIVE_CONTROLS = {
    "optimizer_not_loaded": {
        "optimizer": lambda n: [f"ws{n}->ws1 unsharded", f"ws{n}->ws{n} fsdp2"],
        "torch_save": lambda n: [f"ws{n}->ws1 full:unsharded", f"ws{n}->ws{n} full:fsdp1"],
    },
    "wrong_value_read": {
        "optimizer": lambda n: [f"ws{n}->ws1 unsharded", f"ws{n}->ws{n} fsdp2"],
        "torch_save": lambda n: [f"ws{n}->ws1 full:unsharded", f"ws{n}->ws{n} full:fsdp1"],
    },
    "next_step_perturbed": {
        "optimizer": lambda n: [f"ws{n}->ws1 unsharded", f"ws{n}->ws{n} fsdp2"],
        "torch_save": lambda n: [f"ws{n}->ws1 full:unsharded", f"ws{n}->ws{n} full:fsdp1"],
    },
}


@pytest.mark.process  # a run per fault: the process lane
@pytest.mark.parametrize("fault", sorted(NEGATIVE_CONTROLS))
@pytest.mark.parametrize(("name", "version"), VARIANTS)
def test_each_fault_fails_the_targets_it_touches(
    ranks: Ranks, saved_root: dict[str, Any], name: str, version: str, fault: str
) -> None:
    saved(ranks, saved_root, name, version)
    check = the_check(name, version)
    family = check.params["family"]
    verdict = execute(
        ranks, check, **{**check.params, "load_from": str(saved_root["root"]), "fault": fault}
    ).verdict
    assert verdict is not None
    # A target whose next step another check judges (state.checkpoint.torch_save.shared_step)
    # fails a fault only through its loaded values.
    left = verdict.data["next_step_left_to_shared_step"] if fault == "next_step_perturbed" else []
    expected = [t for t in NEGATIVE_CONTROLS[fault][family](ranks.world_size) if t not in left]
    assert verdict.figures["failed"] == expected, verdict.message
    shown = {
        "optimizer_not_loaded": ["loaded: optim/"],
        "wrong_value_read": ["loaded: "],
        # bitwise against the unbroken run at the saved world size; against the reference
        # step in one process
        "next_step_perturbed": ["after the next step: ", "next step's update (AdamW's rule"],
    }
    for line in shown[fault][: 1 if left else None]:
        assert line in verdict.message, verdict.message
