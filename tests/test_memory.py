"""Memory conformance: the per-layer bound, peaks, depth invariance, the sawtooth, the meters.

Each rank run is shared by several verdicts where it can be (one step feeds the peak and the
sawtooth verdicts), to keep the CPU lane quick. Every claim has a negative control: the seeds'
naive wrappings (monolithic, top-level only) and a per-layer wrapping that never reshards.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Sequence
from typing import Any

import pytest

from fsdp_conformance.claims.check import Check, run_check
from fsdp_conformance.claims.memory import CHECKS
from fsdp_conformance.claims.memory.common import DEFAULT_SPEC, MemoryCheckError
from fsdp_conformance.claims.memory.depth_invariance import verdict_depth_invariance, with_depth
from fsdp_conformance.claims.memory.meter_agrees import rank_meter_agrees, verdict_meter_agrees
from fsdp_conformance.claims.memory.peak_within_bound import (
    rank_peak_within_bound,
    verdict_peak_within_bound,
)
from fsdp_conformance.claims.memory.sawtooth import verdict_sawtooth
from fsdp_conformance.harness import Ranks
from fsdp_conformance.measure.bound import (
    ActivationProfile,
    Bound,
    BoundTerm,
    MeasureError,
    StepConfig,
    per_layer_bound,
)
from fsdp_conformance.measure.meters import MALLOC_ENV, OSMeter, choose_meter
from fsdp_conformance.measure.profile import plan_step
from fsdp_conformance.measure.step import measure_step
from fsdp_conformance.models.llama import LLAMA_PRESETS
from fsdp_conformance.models.model_spec import ModelSpec
from fsdp_conformance.models.reference_models import ModelConfig
from fsdp_conformance.models.units import UnitInfo

VERSIONS = ("fsdp1", "fsdp2")
#: Each memory check's variants, one per FSDP version (fsdp1, fsdp2).
SAWTOOTH_CHECKS, DEPTH_CHECKS, METER_CHECKS = (
    tuple(c for c in CHECKS if c.name == name)
    for name in ("memory.sawtooth", "memory.depth_invariance", "memory.meter_agrees")
)


# ------------------------------------------------------------------------------------------
# The bound: a pure function of plain data
# ------------------------------------------------------------------------------------------


def _units() -> list[UnitInfo]:
    return [
        UnitInfo(fqn="", cls="M", numel=100, params=("embed.weight",)),
        UnitInfo(fqn="layers.0", cls="Block", numel=1000, params=("a", "b")),
        UnitInfo(fqn="layers.1", cls="Block", numel=1000, params=("c", "d")),
        UnitInfo(fqn="head", cls="Linear", numel=801, params=("e",)),
    ]


def test_bound_terms_follow_from_the_plan_and_config_term_by_term() -> None:
    acts = ActivationProfile(
        input_bytes=64,
        saved_bytes={"": 8, "layers.0": 40},
        produced_bytes={"layers.0": 96, "head": 32},
    )
    config = StepConfig(
        world_size=4, version="fsdp2", optimizer="adam", buffer_bytes=16, activations=acts
    )
    bound = per_layer_bound(_units(), config)
    shard = 25 + 250 + 250 + 201  # ceil(numel / 4) per unit
    assert bound.term("sharded params").bytes == shard * 4
    assert bound.term("sharded grads").bytes == shard * 4
    assert bound.term("optimizer state").bytes == (2 * shard + 6) * 4  # exp_avg(_sq) + 6 steps
    assert bound.term("unsharded params").bytes == (100 + 1000) * 4  # fsdp2: the current unit
    assert bound.term("unsharded grads").bytes == 1000 * 4
    assert bound.term("all-gather buffers").bytes == (250 + 1000) * 4
    assert bound.term("reduce-scatter buffers").bytes == (250 + 1000) * 4
    assert bound.term("buffers").bytes == 16
    assert bound.term("input batch").bytes == 64
    assert bound.term("saved activations").bytes == 48
    assert bound.term("activation working set").bytes == 96
    assert bound.total == sum(t.bytes for t in bound.terms)
    assert bound.limit == int(bound.total * 1.10)
    assert Bound.from_dict(bound.to_dict()) == bound


def test_bound_fsdp1_gathers_in_place_and_pads_only_when_needed() -> None:
    bound = per_layer_bound(_units(), StepConfig(world_size=4, version="fsdp1"))
    assert bound.term("all-gather buffers").bytes == 0
    assert bound.term("reduce-scatter buffers").bytes == 250 * 4  # 1000 % 4 == 0: no padded copy
    odd = per_layer_bound(_units(), StepConfig(world_size=3, version="fsdp1"))
    assert odd.term("reduce-scatter buffers").bytes == (334 + 334 * 3) * 4


def test_step_config_rejects_bad_values_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        StepConfig(world_size=0)
    with pytest.raises(ValueError, match="optimizer 'lion'"):
        StepConfig(world_size=2, optimizer="lion")
    with pytest.raises(ValueError, match="version must be"):
        StepConfig(world_size=2, version="fsdp3")


def test_bound_of_70b_on_1024_ranks_is_planned_on_meta_without_allocating() -> None:
    spec = ModelSpec(reference="llama", config=LLAMA_PRESETS["70b"])
    start = time.perf_counter()
    units, config = plan_step(spec, 1024, "fsdp2", optimizer="adamw", batch_size=1, compute_bytes=2)
    bound = per_layer_bound(units, config)
    elapsed = time.perf_counter() - start
    total = sum(u.numel for u in units)
    assert 68e9 < total < 71e9, total  # it is the 70B shape
    # Sharded state per rank is the whole model / 1024 (params + grads + 2 Adam states, fp32).
    assert bound.term("sharded params").bytes == pytest.approx(total / 1024 * 4, rel=1e-3)
    c = LLAMA_PRESETS["70b"]
    kv = c.kv_heads * c.head_dim
    block = c.dim * (2 * c.dim + 2 * kv) + 3 * c.dim * c.hidden + 2 * c.dim  # attn, mlp, norms
    root = c.dim  # the final norm stays in the root; embeddings and output are units of their own
    assert bound.term("unsharded params").bytes == (root + block) * 2  # bf16, fsdp2
    assert elapsed < 60, f"planning 70B took {elapsed:.1f}s"


def test_activation_profile_counts_saved_tensors_per_unit_on_meta() -> None:
    spec = ModelSpec(reference="massive", config=ModelConfig(num_layers=2, dim=32))
    units, config = plan_step(spec, 2, "fsdp1", batch_size=2)
    acts = config.activations
    assert acts is not None
    # Each DecoderLayer saves the inputs of attn (dim) and mlp.0 (dim), and the ReLU output
    # (4 dim), which is also mlp.2's input: one storage, counted once. 2x8 tokens, fp32.
    tokens = 2 * 8
    per_layer = tokens * (32 + 32 + 4 * 32) * 4
    assert acts.saved_bytes["layers.0"] == per_layer
    assert acts.saved_bytes["layers.1"] == per_layer
    assert acts.input_bytes == tokens * 32 * 4


def test_a_model_is_profiled_once_per_batch_size_and_each_step_gets_its_own_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fsdp_conformance.measure import profile

    profiled: list[tuple[str, int]] = []
    real = profile._profile_on_meta

    def counting(spec: ModelSpec, batch_size: int) -> Any:
        profiled.append((spec.name, batch_size))
        return real(spec, batch_size)

    monkeypatch.setattr(profile, "_PLANS", {})
    monkeypatch.setattr(profile, "_profile_on_meta", counting)
    spec = ModelSpec(reference="massive", config=ModelConfig(num_layers=2, dim=32))
    units1, fsdp1 = plan_step(spec, 2, "fsdp1")
    units2, fsdp2 = plan_step(spec, 4, "fsdp2", optimizer="adamw", compute_bytes=2)
    assert len(profiled) == 1  # the world size, version, optimizer and dtype are the step's
    assert units1 == units2 and fsdp1.activations is fsdp2.activations
    assert (fsdp1.world_size, fsdp1.version, fsdp1.optimizer) == (2, "fsdp1", None)
    assert (fsdp2.world_size, fsdp2.version, fsdp2.optimizer) == (4, "fsdp2", "adamw")
    plan_step(spec, 2, "fsdp1", batch_size=4)  # another input: profiled anew
    deeper = ModelSpec(reference="massive", config=ModelConfig(num_layers=3, dim=32))
    plan_step(deeper, 2, "fsdp1")  # another model
    assert len(profiled) == 3
    # A factory's model is keyed by the factory object: a module imported anew is another.
    from fsdp_conformance import hf_models

    key = profile._plan_key(
        ModelSpec(reference=None, factory="fsdp_conformance.hf_models:llama", depth=1), 2
    )
    assert any(part is hf_models.llama for part in key)


# ------------------------------------------------------------------------------------------
# Peak and sawtooth: one measured step per (version, wrapping), both verdicts
# ------------------------------------------------------------------------------------------


def _step(ranks: Ranks, version: str, fault: str | None = None) -> tuple[list, dict]:
    params = {"spec": DEFAULT_SPEC, "version": version, "fault": fault}
    return ranks.run(rank_peak_within_bound, **params), params


@pytest.fixture(scope="module")
def shared_runs() -> dict[tuple[Any, ...], list]:
    """Rank values of runs that several tests here read, by (what ran, device type, world
    size, version); the first test to need one runs it (see :func:`_shared_check_run`)."""
    return {}


def _shared_check_run(
    ranks: Ranks, shared: dict, checks: Sequence[Check], version: str
) -> tuple[list, dict]:
    """The check of ``checks`` for ``version`` as ``fsdp-conformance run`` runs it, once per
    module (rank values and params). Read, for ``SAWTOOTH_CHECKS`` (a per-layer step
    plus the monolithic one for the picture), by
    test_per_layer_peak_is_under_the_bound_and_the_timeline_is_a_sawtooth[fsdp2] and
    test_sawtooth_check_records_the_monolithic_timeline_for_the_picture; for
    ``DEPTH_CHECKS`` (per-layer and monolithic steps at 2, 4 and 8 layers), by
    test_per_layer_working_set_is_constant_over_three_depths_monolithic_grows and
    test_depth_check_fails_on_monolithic_wrapping (its monolithic steps)."""
    check = next(c for c in checks if c.params["version"] == version)
    key = (check.name, ranks.device_type, ranks.world_size, version)
    if key not in shared:
        shared[key] = ranks.run(check.rank_fn, **check.params)
    return shared[key], dict(check.params)


@pytest.mark.parametrize("version", VERSIONS)
def test_per_layer_peak_is_under_the_bound_and_the_timeline_is_a_sawtooth(
    ranks: Ranks, version: str, shared_runs: dict
) -> None:
    # FSDP2's per-layer step is the sawtooth check's own (its monolithic "compare" step is the
    # picture's, read by test_sawtooth_check_records_the_monolithic_timeline_for_the_picture).
    values, params = (
        _shared_check_run(ranks, shared_runs, SAWTOOTH_CHECKS, version)
        if version == "fsdp2"
        else _step(ranks, version)
    )
    peak = verdict_peak_within_bound(values, params)
    assert peak.passed, peak.message
    assert all(v["meters"][0]["peak"] <= peak.figures["limit_bytes"] for v in values)
    saw = verdict_sawtooth(values, params)
    assert saw.passed, saw.message
    assert saw.figures["teeth"] == 9  # 8 layers and the head; the root stays gathered
    assert saw.data["timeline"] and {"unit", "phase", "bytes"} <= set(saw.data["timeline"][0])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("fault", ["monolithic", "top_level"])
def test_seeds_naive_wrappings_exceed_the_per_layer_bound_and_show_no_sawtooth(
    ranks: Ranks, version: str, fault: str
) -> None:
    values, params = _step(ranks, version, fault)
    # At one rank (the single-GPU lane) the sharded state is the whole model, so a monolithic
    # peak (measured 63.8 MB) stays under the per-layer limit (69.3 MB) at this size: the
    # bound's negative control needs >= 2 ranks; the sawtooth's holds at one rank too.
    if ranks.world_size >= 2:
        peak = verdict_peak_within_bound(values, params)
        assert not peak.passed
        every_rank = ", ".join(str(r) for r in range(ranks.world_size))
        assert f"peak exceeds the per-layer bound on rank(s) {every_rank}" in peak.message
        assert "expected (per-layer bound, term by term)" in peak.message
        assert "sharded params" in peak.message and "actual units:" in peak.message
    saw = verdict_sawtooth(values, params)
    assert not saw.passed
    assert "unit (root) gathered" in saw.message


@pytest.mark.parametrize("version", VERSIONS)
def test_sawtooth_check_catches_units_that_keep_their_parameters_after_forward(
    ranks: Ranks, version: str
) -> None:
    values, params = _step(ranks, version, "no_reshard")
    saw = verdict_sawtooth(values, params)
    assert not saw.passed
    assert "unit layers.0 kept its parameters after forward" in saw.message


def test_sawtooth_check_records_the_monolithic_timeline_for_the_picture(
    ranks: Ranks, shared_runs: dict
) -> None:
    check = SAWTOOTH_CHECKS[1]
    values, params = _shared_check_run(ranks, shared_runs, SAWTOOTH_CHECKS, check.params["version"])
    verdict = check.verdict(values, params)
    assert verdict.passed, verdict.message
    compare = verdict.data["compare"]
    assert compare["wrapping"] == "monolithic"
    # The picture's data only: that monolithic exceeds the bound is verdict_peak_within_bound's
    # to say (test_seeds_naive_wrappings_exceed_the_per_layer_bound_and_show_no_sawtooth).
    assert compare["timeline"] and compare["peak"] > 0


# ------------------------------------------------------------------------------------------
# Depth invariance
# ------------------------------------------------------------------------------------------


def _as_measured_with(values: list, wrapping: str) -> list:
    """What ``rank_depth_invariance`` returns when the wrapping under test is its reference
    wrapping W (``fault=W``): the same rows with only that wrapping's peaks (it measures each
    wrapping once per depth)."""
    out = []
    for v in values:
        assert v["reference"] == wrapping  # otherwise the steps were never measured
        rows = [{k: x for k, x in row.items() if k != v["wrapping"]} for row in v["rows"]]
        out.append({**v, "wrapping": wrapping, "rows": rows})
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_per_layer_working_set_is_constant_over_three_depths_monolithic_grows(
    ranks: Ranks, version: str, shared_runs: dict
) -> None:
    check = next(c for c in DEPTH_CHECKS if c.params["version"] == version)
    values, params = _shared_check_run(ranks, shared_runs, DEPTH_CHECKS, version)
    verdict = check.verdict(values, params)
    assert verdict.passed, verdict.message
    assert verdict.figures["depths"] == [2, 4, 8]
    # A pass also means the monolithic reference grew by the added layers on every rank (the
    # verdict's own condition); nothing stricter is asserted here.
    assert sorted(verdict.data["rows_by_rank"]) == list(range(ranks.world_size))
    assert all(len(rows) == 3 for rows in verdict.data["rows_by_rank"].values())


def _late_release_peaks(ctx: Any, hold_s: float = 0.5) -> dict[str, Any]:
    """measure_step's FSDP2 peak with gloo's worker thread modelled twice: it lets go of a
    reduce-scatter's tensors (and of the flat copy it made of the input, as gloo's does) before
    the call returns, or ``hold_s`` later on another thread (fault injection: a worker
    descheduled under CPU load; 0.5 s outlasts the next unit's gather even on a busy machine).
    Program order is the same; only the timing differs."""
    import threading

    import torch
    import torch.distributed as dist

    spec = with_depth(DEFAULT_SPEC, 2)
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def worker(fn: Any, hold: float) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
            held = [t.detach() for t in tensors] + [t.clone() for t in tensors]
            out = fn(*args, **kwargs)
            if hold:
                threading.Timer(hold, held.clear).start()  # the last references, dropped late
            else:
                held.clear()
            return out

        return call

    peaks, waited = {}, 0
    for label, hold in (("clean", 0.0), ("late", hold_s)):
        try:
            for n, fn in originals.items():
                setattr(dist, n, worker(fn, hold))
            m = measure_step(ctx, spec, "fsdp2", timeline=False)
        finally:
            for n, fn in originals.items():
                setattr(dist, n, fn)
        peaks[label] = m["meters"][0]["peak"]
        waited = m.get("collectives", {}).get("waited", 0)
    return {"rank": ctx.rank, **peaks, "waited": waited}


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_peak_does_not_depend_on_when_gloo_workers_let_go_of_collective_tensors(
    ranks: Ranks,
) -> None:
    # Under CPU load gloo's worker thread frees a finished collective's buffers late, and the
    # FSDP2 working set read 7.08 or 8.54 MB at the same depth. The measured step waits for
    # the release, so the peak is the program-order one whatever the worker does.
    values = ranks.run(_late_release_peaks)
    for v in values:
        assert v["late"] == v["clean"], (
            f"rank {v['rank']}: peak {v['late']:,} B with late releases, {v['clean']:,} B without"
        )
        assert v["waited"] > 0  # the injected late releases were seen and waited for


@pytest.mark.parametrize("version", VERSIONS)
def test_depth_check_fails_on_monolithic_wrapping(
    ranks: Ranks, version: str, shared_runs: dict
) -> None:
    # The depth check judging monolithic wrapping (against itself as the reference): its
    # monolithic steps at 2, 4 and 8 layers are the reference steps of the check's own run.
    check = next(c for c in DEPTH_CHECKS if c.params["version"] == version)
    values, params = _shared_check_run(ranks, shared_runs, DEPTH_CHECKS, version)
    verdict = check.verdict(
        _as_measured_with(values, "monolithic"), {**params, "wrapping": "monolithic"}
    )
    assert not verdict.passed
    assert "the monolithic working set grows with depth" in verdict.message


def test_depth_check_refuses_fewer_than_three_depths(ranks: Ranks) -> None:
    check = DEPTH_CHECKS[0]
    with pytest.raises(Exception, match="at least three depths"):
        run_check(ranks, check, depths=(2, 4))


def test_depth_needs_a_model_whose_depth_can_be_set() -> None:
    # MassiveModel(config=None) takes no depth keyword and is no transformers model.
    spec = ModelSpec(
        reference=None, factory="fsdp_conformance.models.reference_models:MassiveModel"
    )
    with pytest.raises(MemoryCheckError, match="its depth cannot be set"):
        with_depth(spec, 4)


# ------------------------------------------------------------------------------------------
# The meters: tracker vs ground truth (fresh ranks with the allocator setting)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_tracker_agrees_with_ground_truth_within_five_percent(ranks: Ranks, version: str) -> None:
    check = next(c for c in METER_CHECKS if c.params["version"] == version)
    assert check.env == MALLOC_ENV  # the OS figure is valid only with it
    verdict = run_check(ranks, check)
    assert verdict.passed, verdict.message
    # The verdict allows max(5 %, the OS figure's 2 MB resolution): no stricter ratio here.
    assert len(verdict.figures["tracker_over_truth"]) == ranks.world_size
    assert verdict.figures["truth"] == "os"


def test_meter_check_catches_a_tracker_blind_to_fsdp1_gather_buffers(ranks: Ranks) -> None:
    # Entered only for the step, MemTracker never saw FSDP1 allocate its flat parameters and
    # gather buffers: its figure is not the step's memory, and the cross-check says so.
    verdict = run_check(ranks, METER_CHECKS[0], fault="untracked_construction")
    assert not verdict.passed
    assert "the tracker disagrees with the" in verdict.message


def _blind_meter_values(ctx: Any) -> dict[str, Any]:
    """Fault injection in the ranks: torch's trackers read 0 (FSDP2, ``FSDPMemTracker``) or a
    tenth of what they track (FSDP1, ``MemTracker``); each version's meter cross-check and
    peak check run on the faulty meter, all in this one rank call."""
    from fsdp_conformance.measure import meters

    spec = with_depth(DEFAULT_SPEC, 2)
    original = meters.TrackerMeter._snapshot
    out: dict[str, Any] = {}
    for version, scale in (("fsdp2", 0.0), ("fsdp1", 0.1)):

        def scaled(self: Any, kind: str, scale: float = scale) -> dict[str, int]:
            return {k: int(v * scale) for k, v in original(self, kind).items()}

        meters.TrackerMeter._snapshot = scaled  # type: ignore[method-assign]
        try:
            out[version] = {
                "meter": rank_meter_agrees(ctx, spec, version),
                "peak": rank_peak_within_bound(ctx, spec, version),
            }
        finally:
            meters.TrackerMeter._snapshot = original  # type: ignore[method-assign]
    return out


@pytest.mark.world_size(2)
def test_a_meter_reading_less_than_the_sharded_parameters_fails_both_checks(
    ranks: Ranks,
) -> None:
    # Without the floor a tracker reading 0 passes the peak check (0 is under any bound); the
    # cross-check covers FSDPMemTracker too, the source of FSDP2's figures.
    values = ranks.configured(env=MALLOC_ENV).run(_blind_meter_values)
    for version, tracker in (("fsdp2", "FSDPMemTracker"), ("fsdp1", "MemTracker")):
        params = {"spec": with_depth(DEFAULT_SPEC, 2), "version": version}
        agrees = verdict_meter_agrees([v[version]["meter"] for v in values], params)
        peak = verdict_peak_within_bound([v[version]["peak"] for v in values], params)
        for verdict in (agrees, peak):
            assert not verdict.passed, (version, verdict.message)
            for rank in range(ranks.world_size):
                assert (
                    f"rank {rank}: {tracker} reads start " in verdict.message
                    and "less than the" in verdict.message
                ), verdict.message
        assert "the meter reads less than the parameter shards" in peak.message
        assert agrees.figures["tracker"] == tracker


def test_os_meter_refuses_without_the_allocator_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    why = OSMeter.available()
    assert why is not None and "MALLOC_MMAP_THRESHOLD_=65536" in why


def test_unknown_wrapping_and_meter_are_named() -> None:
    from fsdp_conformance.harness import RankContext
    from fsdp_conformance.models.policies import PolicyError

    ctx = RankContext(0, 1, 0, "gloo", "cpu")
    # The wrapping is resolved before anything is built, so this needs no process group.
    with pytest.raises(PolicyError, match="unknown wrapping 'flat'"):
        measure_step(ctx, DEFAULT_SPEC, "fsdp1", "flat")
    with pytest.raises(MeasureError, match="unknown meter 'gauge'"):
        choose_meter(ctx, "gauge", "fsdp1")


# ------------------------------------------------------------------------------------------
# Registration and the picture
# ------------------------------------------------------------------------------------------


def test_checks_cover_every_claim_for_both_versions() -> None:
    names = {(c.name, c.params["version"]) for c in CHECKS}
    for name in (
        "memory.peak_within_bound",
        "memory.sawtooth",
        "memory.depth_invariance",
        "memory.meter_agrees",
    ):
        assert {(name, v) for v in VERSIONS} <= names
    assert all(c.claim == "memory" and isinstance(c.params["spec"], ModelSpec) for c in CHECKS)


def test_plot_writes_a_png_of_sawtooth_against_monolithic(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib", reason="plots are an optional extra (pip install matplotlib)")
    from fsdp_conformance.gate import plots

    def tl(levels: list[int]) -> list[dict]:
        return [{"i": i, "unit": "u", "phase": "forward", "bytes": b} for i, b in enumerate(levels)]

    path = plots.plot_timelines(
        {"per_layer": tl([10, 13, 10, 13, 10]), "monolithic": tl([10, 50, 50, 30])},
        str(tmp_path / "t.png"),
        limit_bytes=20,
        title="test",
    )
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    report = {
        "checks": [
            {
                "id": "memory.sawtooth[cpu,ws2,fsdp2]",
                "check": "memory.sawtooth",
                "data": {
                    "timeline": tl([1, 2, 1]),
                    "wrapping": "per_layer",
                    "limit_bytes": 3,
                    "compare": {"wrapping": "monolithic", "timeline": tl([1, 5])},
                },
            }
        ]
    }
    out = plots.plot_report_timelines(report, str(tmp_path / "r.png"))
    assert out is not None and (tmp_path / "r.png").stat().st_size > 0
    assert plots.plot_report_timelines({"checks": []}, str(tmp_path / "none.png")) is None


# ---------------------------------------------------------------------------------------------
# verdict_depth_invariance on hand-made readings: growth means deeper > shallower, not any spread
# ---------------------------------------------------------------------------------------------


def _depth_values(
    per_layer_mb: list[float], rank: int = 0, unit_mb: tuple[float, ...] = (0, 0, 0)
) -> dict[str, object]:
    """Rows as rank_depth_invariance returns them: sharded state 1 MB per layer, monolithic
    + 4 MB/layer; ``unit_mb``: the bound's gathered unit at each depth (a term that does not
    scale with depth; larger where a deeper build adds a larger kind of layer)."""
    rows = []
    for depth, per_layer, unit in zip((2, 4, 8), per_layer_mb, unit_mb):
        sharded = BoundTerm("sharded params", depth * 10**6, "test", scales_with_depth=True)
        gathered = BoundTerm("gathered unit", int(unit * 10**6), "test")
        bound = Bound((sharded, gathered), 0.1)
        rows.append(
            {
                "depth": depth,
                "bound": bound.to_dict(),
                "layer_bytes": 4 * 10**6,
                "per_layer": int((per_layer + depth) * 10**6),
                "monolithic": int((5 * depth + 1) * 10**6),
            }
        )
    return {"rank": rank, "rows": rows, "wrapping": "per_layer", "reference": "monolithic"}


def test_depth_verdict_catches_a_shallow_outlier_and_growth() -> None:
    params = {"spec": DEFAULT_SPEC, "version": "fsdp2"}
    # One rank ~1.2 MB more at the smallest depth only (what a late free on gloo's worker
    # thread once produced, before frees were put in program order): not constant, a failure.
    outlier = verdict_depth_invariance(
        [_depth_values([7.0, 7.0, 7.0]), _depth_values([8.2, 7.0, 7.0], rank=1)], params
    )
    assert not outlier.passed
    assert (
        "rank 1: the per_layer working set is not constant over depth (larger at fewer layers)"
    ) in outlier.message
    assert "at 2 layers at least 8.20 MB" in outlier.message
    grows = verdict_depth_invariance(
        [_depth_values([7.0, 7.0, 7.0]), _depth_values([7.0, 7.0, 8.2], rank=1)], params
    )
    assert not grows.passed
    assert "rank 1: the per_layer working set grows with depth" in grows.message
    assert "at 8 layers" in grows.message and grows.message.count("rank 1:") >= 2
    # Within the tolerance (10 %) either way: constant.
    within = verdict_depth_invariance(
        [_depth_values([7.0, 7.6, 7.0]), _depth_values([7.6, 7.0, 7.0], rank=1)], params
    )
    assert within.passed, within.message


def test_depth_verdict_allows_what_a_deeper_builds_larger_layers_add_to_its_bound() -> None:
    # DeepSeek-V3's first layers are dense and the rest mixtures of experts: the 2-layer build
    # has no expert layer, the deeper ones do, and their bound gathers a larger unit (+3 MB).
    params = {"spec": DEFAULT_SPEC, "version": "fsdp2"}
    larger = (4.0, 7.0, 7.0)
    kinds = verdict_depth_invariance([_depth_values([7.0, 10.0, 10.0], unit_mb=larger)], params)
    assert kinds.passed, kinds.message
    # The control: the same growth where the bound's layers stay the same size is a failure,
    # and growth beyond the larger layers still is.
    same = verdict_depth_invariance([_depth_values([7.0, 10.0, 10.0])], params)
    assert not same.passed and "grows with depth" in same.message
    beyond = verdict_depth_invariance([_depth_values([7.0, 10.0, 12.0], unit_mb=larger)], params)
    assert not beyond.passed and "(its bound's larger layers)" in beyond.message


def test_meter_verdict_cannot_pass_when_the_step_is_below_the_meters_resolution() -> None:
    # A tracker that saw nothing (0) against a truth of 1.5 MB differs by less than the
    # resolution: without a guard it would "agree". Too small a step cannot be judged.
    def value(rank: int, tracker: int, truth: int) -> dict[str, Any]:
        return {
            "rank": rank,
            "meters": [
                {"source": "MemTracker", "start": 0, "peak": tracker},
                {"source": "os", "start": 0, "peak": truth},
            ],
        }

    small = [value(r, 0, int(1.5e6)) for r in range(2)]
    verdict = verdict_meter_agrees(small, {})
    assert not verdict.passed
    assert "below the meters' resolution" in verdict.message
    big = [value(r, 50 * 10**6, 51 * 10**6) for r in range(2)]
    assert verdict_meter_agrees(big, {}).passed


@pytest.mark.world_size(2)
def test_meter_check_skips_on_every_rank_when_the_step_is_too_small_to_resolve(
    ranks: Ranks,
) -> None:
    from fsdp_conformance.harness import CheckSkipped

    tiny = ModelSpec(reference="massive", config=ModelConfig(num_layers=2, dim=16))
    check = METER_CHECKS[1]
    with pytest.raises(CheckSkipped, match="within the meters' resolution"):
        run_check(ranks.configured(skip=None), check, spec=tiny)
