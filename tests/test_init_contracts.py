"""Meta init's three contracts: reset_parameters(), --init-fn, transformers' own init.

A transformers ``PreTrainedModel`` is initialized by its own per-module ``_init_weights`` (norms
to one, GPT-2's scaled residual projections, the rotary buffers recomputed); any other model by
the user's ``--init-fn`` when named, else by each module's ``reset_parameters()``. Every contract
keeps the init checks' property: the same seed gives bitwise the same full weights on any world
size. Negative controls: an init that leaves the norms uninitialized, ranks seeded differently on
a model with dropout, a bad init-function path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fsdp_conformance.claims import init
from fsdp_conformance.claims.check import Check, execute, run_check
from fsdp_conformance.claims.init import weights
from fsdp_conformance.fsdp import meta_init, tensors
from fsdp_conformance.gate.report import environment_summary
from fsdp_conformance.harness import Ranks
from fsdp_conformance.models.model_spec import ModelSpec, ModelSpecError
from fsdp_conformance.models.user_model import user_spec, validate_user_model
from fsdp_conformance.settings import SettingsError, pyproject_settings, resolve_settings

VERSIONS = ("fsdp1", "fsdp2")


# transformers is imported by the tests that build these models, not when this file is
# collected (about 3 s on the 2-core machine, a cost only these tests should pay).


def tiny_llama() -> nn.Module:
    from fsdp_conformance import hf_models

    return hf_models.llama(num_layers=2)


def tiny_gpt2() -> nn.Module:
    from fsdp_conformance import hf_models

    return hf_models.gpt2(num_layers=2)


def tiny_mixtral() -> nn.Module:
    from fsdp_conformance import hf_models

    return hf_models.mixtral(num_layers=2)


def _hf(factory: str, block: str, init_fn: str | None = None) -> ModelSpec:
    return ModelSpec(
        reference=None, factory=f"{__name__}:{factory}", block_cls=(block,), init_fn=init_fn
    )


LLAMA = _hf("tiny_llama", "LlamaDecoderLayer")
GPT2 = _hf("tiny_gpt2", "GPT2Block")  # tied embeddings, dropout 0.1
MIXTRAL = _hf("tiny_mixtral", "MixtralDecoderLayer")
#: The negative control: the user's init forgets the norms.
LLAMA_SKIPPING_NORMS = _hf("tiny_llama", "LlamaDecoderLayer", f"{__name__}:init_skipping_norms")
LLAMA_NORMS = [
    "model.layers.0.input_layernorm",
    "model.layers.0.post_attention_layernorm",
    "model.layers.1.input_layernorm",
    "model.layers.1.post_attention_layernorm",
    "model.norm",
]


def init_skipping_norms(module: nn.Module) -> None:
    """A user's per-module init: linears, embeddings and the rotary buffers, but no norms."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    elif hasattr(module, "original_inv_freq"):
        inv_freq, _ = module.compute_default_rope_parameters(module.config)
        module.inv_freq.copy_(inv_freq)
        module.original_inv_freq.copy_(inv_freq)


class _RawParam(nn.Module):
    """Owns a parameter, has no reset_parameters(): needs --init-fn."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def raw_param_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), _RawParam(), nn.Linear(8, 8))


def init_raw(module: nn.Module) -> None:
    """The user's per-module init for raw_param_model."""
    if isinstance(module, _RawParam):
        nn.init.ones_(module.scale)
    elif isinstance(module, nn.Linear):
        module.reset_parameters()


RAW_WITH_INIT = ModelSpec(
    reference=None,
    factory=f"{__name__}:raw_param_model",
    block_cls=("Linear",),
    init_fn=f"{__name__}:init_raw",
)


def check(name: str, version: str | None = None) -> Check:
    (found,) = [c for c in init.CHECKS if c.name == name and c.params.get("version") == version]
    return found


# ------------------------------------------------------------------------------------------
# Pure: the single-process reference under each contract (no ranks)
# ------------------------------------------------------------------------------------------


def test_a_transformers_model_is_initialized_by_its_own_init_weights() -> None:
    model = meta_init.reference_model(LLAMA, 0)
    # Each module's values are exactly its _init_weights on the module's seeded generator.
    q_proj = nn.Linear(64, 64, bias=False)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(meta_init.module_seed(0, "model.layers.0.self_attn.q_proj"))
        model._init_weights(q_proj)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, q_proj.weight)
    for name in LLAMA_NORMS:
        assert torch.equal(model.get_submodule(name).weight, torch.ones(64)), name
    # The non-persistent rotary buffers are recomputed as an eager build computes them.
    eager = tiny_llama()
    for buffer in ("inv_freq", "original_inv_freq"):
        assert torch.equal(
            getattr(model.model.rotary_emb, buffer), getattr(eager.model.rotary_emb, buffer)
        ), buffer


def test_an_ancestors_init_weights_reaches_its_childs_tensors() -> None:
    # GPT-2's attention and MLP rescale their child c_proj (std 0.02 / sqrt(2 * layers)) after
    # c_proj's own init: transformers walks children first, and so does the reference.
    model = meta_init.reference_model(GPT2, 0).requires_grad_(False)
    block = model.transformer.h[0]
    assert float(block.attn.c_proj.weight.std()) < 0.75 * float(block.attn.c_attn.weight.std())
    assert float(block.mlp.c_proj.weight.std()) < 0.75 * float(block.mlp.c_fc.weight.std())
    assert torch.equal(block.ln_1.weight, torch.ones(64))
    assert torch.equal(block.ln_1.bias, torch.zeros(64))
    experts = meta_init.reference_model(MIXTRAL, 0).model.layers[0].mlp.experts
    assert 0.015 < float(experts.gate_up_proj.detach().std()) < 0.025  # 3-D expert weights too


def test_a_transformers_reference_is_reproducible_and_keeps_its_tie() -> None:
    assert meta_init.reference_digest(GPT2, 0) == meta_init.reference_digest(GPT2, 0)
    assert meta_init.reference_digest(GPT2, 0) != meta_init.reference_digest(GPT2, 1)
    model = meta_init.reference_model(GPT2, 0)
    # to_empty alone unties lm_head from wte: the reference re-binds it (one tensor, as the
    # sharded model keeps it).
    assert model.lm_head.weight is model.transformer.wte.weight


def test_an_init_fn_that_skips_the_norms_is_named_for_every_module() -> None:
    with pytest.raises(meta_init.InitError) as info:
        meta_init.reference_model(LLAMA_SKIPPING_NORMS, 0)
    message = str(info.value)
    assert message.startswith(
        f"init function '{__name__}:init_skipping_norms' leaves tensors of 5 modules uninitialized"
    )
    for name in LLAMA_NORMS:
        assert f"{name} (LlamaRMSNorm: weight)" in message
    assert "\n" not in message


def test_an_init_fn_initializes_a_model_without_reset_parameters() -> None:
    model = meta_init.reference_model(RAW_WITH_INIT, 3)
    assert torch.equal(model[1].scale, torch.ones(8))
    linear = nn.Linear(8, 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(meta_init.module_seed(3, "0"))
        linear.reset_parameters()
    assert torch.equal(model[0].weight, linear.weight)


def test_the_no_contract_error_names_all_three_ways_out() -> None:
    with torch.device("meta"):
        model = raw_param_model()
    with pytest.raises(meta_init.InitError) as info:
        meta_init.check_initializable(model)
    message = str(info.value)
    assert (
        "1 module(s) own parameters or buffers but have no reset_parameters(): 1 (_RawParam)"
        in message
    )
    assert "define reset_parameters() on those classes" in message
    assert "--init-fn pkg.module:fn" in message and "init_fn in [tool.fsdp_conformance]" in message
    assert "transformers PreTrainedModel whose _init_weights covers them" in message


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (
            "no_such_module_xyz:fn",
            "cannot import module 'no_such_module_xyz' for init function 'no_such_module_xyz:fn'",
        ),
        (
            f"{__name__}:no_such_fn",
            f"module '{__name__}' has no attribute 'no_such_fn' (init "
            f"function '{__name__}:no_such_fn')",
        ),
        ("justaname", "init function 'justaname' is not of the form 'pkg.module:name'"),
    ],
)
def test_a_bad_init_fn_path_is_one_clear_error_before_any_rank(path: str, expected: str) -> None:
    spec = ModelSpec(
        reference=None, factory=f"{__name__}:raw_param_model", block_cls=("Linear",), init_fn=path
    )
    with pytest.raises(ModelSpecError) as info:
        validate_user_model(spec, ["cpu"], [2])
    assert str(info.value).startswith(expected)


def test_init_fn_is_a_setting_from_every_source(tmp_path: Path) -> None:
    given = resolve_settings({"model": "p.m:f", "init_fn": " p.m:init "}, {}, {})
    assert given.init_fn == "p.m:init"
    assert user_spec(given) == ModelSpec(reference=None, factory="p.m:f", init_fn="p.m:init")
    env = resolve_settings({"model": "p.m:f"}, {"FSDP_CONFORMANCE_INIT_FN": "p.m:e"}, {})
    assert env.init_fn == "p.m:e"
    assert env.sources["init_fn"] == "environment variable FSDP_CONFORMANCE_INIT_FN"
    (tmp_path / "pyproject.toml").write_text(
        '[tool.fsdp_conformance]\nmodel = "p.m:f"\ninit_fn = "p.m:t"\n'
    )
    table = resolve_settings({}, {}, {}, pyproject_settings(str(tmp_path)))
    assert table.init_fn == "p.m:t"
    assert environment_summary(given).endswith(", model p.m:f, init fn p.m:init")
    with pytest.raises(SettingsError, match=r"^--init-fn is set but no --model"):
        resolve_settings({"init_fn": "p.m:init"}, {}, {}, flag_style="cli")


# ------------------------------------------------------------------------------------------
# On ranks: FSDP1 (param_init_fn) and FSDP2 (to_empty + init) against that reference
# ------------------------------------------------------------------------------------------


@pytest.mark.world_size(2)
def test_transformers_models_meta_init_to_the_reference_on_both_versions(ranks: Ranks) -> None:
    # GPT-2 also proves the tie: FSDP1 reaches lm_head (a holder) before transformer.wte (the
    # owner) breadth-first, and the owner's values must still be the ones written.
    for spec in (LLAMA, GPT2, MIXTRAL):
        expected = meta_init.reference_digest(spec, 0)
        for version in VERSIONS:
            values = ranks.run(weights.rank_weights, spec=spec, version=version)
            for verdict in (
                weights.verdict_no_meta(values, {}),
                weights.verdict_weights(values, {}),
            ):
                assert verdict.passed, f"{spec.factory} {version}: {verdict.message}"
            assert {v["digest"] for v in values} == {expected}, (spec.factory, version)


@pytest.mark.world_size(2)
def test_an_init_that_leaves_the_norms_uninitialized_fails_naming_them(ranks: Ranks) -> None:
    for name, version in (("init.no_meta", "fsdp1"), ("init.weights", "fsdp2")):
        verdict = run_check(ranks, check(name, version), spec=LLAMA_SKIPPING_NORMS)
        assert not verdict.passed, name
        assert verdict.message.startswith("all ranks: init function"), verdict.message
        assert all(norm in verdict.message for norm in LLAMA_NORMS), verdict.message
        assert "Traceback" not in verdict.message


@pytest.mark.world_size(2)
def test_an_init_fn_meta_initializes_a_model_without_reset_parameters(ranks: Ranks) -> None:
    for version in VERSIONS:
        verdict = run_check(ranks, check("init.weights", version), spec=RAW_WITH_INIT)
        assert verdict.passed, f"{version}: {verdict.message}"
        assert verdict.data["digest"] == meta_init.reference_digest(RAW_WITH_INIT, 0)


@pytest.mark.world_size(2)
def test_train_step_on_a_dropout_model_compares_like_with_like(ranks: Ranks) -> None:
    verdict = run_check(ranks, check("init.train_step", "fsdp2"), spec=GPT2)
    assert verdict.passed, verdict.message
    assert "dropout disabled for the comparison" in verdict.message
    # Negative control on the same dropout model: ranks initialized differently.
    bad = run_check(
        ranks, check("init.train_step", "fsdp2"), spec=GPT2, fault="ranks_seeded_differently"
    )
    assert not bad.passed
    assert "weights differ from the reference" in bad.message


@pytest.mark.world_size(2)
def test_fsdp1_default_path_skips_a_transformers_model_with_the_reason(ranks: Ranks) -> None:
    run = execute(ranks, check("init.weights.default_path", "fsdp1"), spec=LLAMA)
    assert run.outcome == "skipped", run.detail
    assert "calls reset_parameters() on every module that owns state" in run.detail
    assert "model.layers.0.input_layernorm (LlamaRMSNorm)" in run.detail
    assert "transformers' _init_weights" in run.detail


def test_an_eager_transformers_model_reinitializes_to_the_reference_without_a_spec() -> None:
    # No spec: the shadow is a meta copy of the unsharded model (no storage copied).
    model = meta_init.deterministic_init_(tiny_gpt2(), 0)
    assert tensors.state_digest(meta_init.canonical_state(model)) == meta_init.reference_digest(
        GPT2, 0
    )
