"""A transformers model needs no flag beyond ``--model``.

* Block classes come from the model's ``_no_split_modules`` when ``--block-cls`` is not given;
  the default input from its config (``input_ids``, plus ``decoder_input_ids`` for an
  encoder-decoder), passed as keyword arguments; an input builder may return a mapping too.
* Depth invariance runs on a factory whose depth can be set (a depth keyword, or a transformers
  config's ``num_hidden_layers``) and says which depths it measured.
* ``module:attr`` resolves from the current folder first, as ``python -m`` does.

The models are the reference factories of :mod:`fsdp_conformance.hf_models` at one or two
layers (built from configs, nothing downloaded).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance import cli, hf_models
from fsdp_conformance.claims.check import Check, run_check
from fsdp_conformance.claims.memory import CHECKS as MEMORY_CHECKS
from fsdp_conformance.claims.memory.common import MemoryCheckError
from fsdp_conformance.claims.memory.depth_invariance import with_depth
from fsdp_conformance.claims.wrap import CHECKS as WRAP_CHECKS
from fsdp_conformance.harness import CheckSkipped, Ranks
from fsdp_conformance.measure.meters import resident_tensor_bytes
from fsdp_conformance.measure.profile import plan_step
from fsdp_conformance.models.model_spec import (
    ModelSpec,
    ModelSpecError,
    batch_rows,
    call_model,
    default_loss,
    depth_keyword,
    load_object,
    make_batch,
)
from fsdp_conformance.models.policies import PolicyError

HF = "fsdp_conformance.hf_models"


# ------------------------------------------------------------------------------------------
# Factories the ranks import by path (this module)
# ------------------------------------------------------------------------------------------


def gpt2_fixed() -> nn.Module:
    """A transformers model from a factory with no depth keyword: rebuilt from its config."""
    return hf_models.gpt2(num_layers=2)


def llama_ignoring_depth(num_layers: int = 2) -> nn.Module:
    """Takes the depth keyword but always builds two layers: depth invariance must fail."""
    return hf_models.llama(num_layers=2)


class KeywordNet(nn.Module):
    """A plain model; its input builder returns a mapping (forward takes keywords only)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, *, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x)) * scale
        return x


def keyword_net() -> nn.Module:
    return KeywordNet()


def keyword_inputs(model: nn.Module, batch_size: int, device: Any) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(batch_size, 4, 16, generator=g).to(device),
        "scale": torch.full((batch_size, 1, 1), 0.5).to(device),
    }


def _spec(factory: str, **kwargs: Any) -> ModelSpec:
    return ModelSpec(reference=None, factory=factory, **kwargs)


# ------------------------------------------------------------------------------------------
# Inputs, the loss on a ModelOutput, block classes
# ------------------------------------------------------------------------------------------


def test_default_loss_of_a_model_output_is_its_logits_mean_square_even_with_labels() -> None:
    torch.manual_seed(0)
    model = hf_models.gpt2(num_layers=1).eval()
    ids = torch.randint(0, hf_models.VOCAB, (2, 6))
    out = model(input_ids=ids, labels=ids)
    assert next(iter(out.keys())) == "loss"  # the first value is transformers' own loss
    torch.testing.assert_close(default_loss(out), out.logits.float().pow(2).mean())
    plain = default_loss(model(input_ids=ids))
    torch.testing.assert_close(plain, out.logits.float().pow(2).mean())


def test_a_transformers_model_gets_token_ids_from_its_config_as_keywords() -> None:
    model = hf_models.llama(num_layers=1)
    batch = make_batch(model, batch_size=3, seq_len=5)
    assert set(batch) == {"input_ids"}
    ids = batch["input_ids"]
    assert ids.shape == (3, 5) and ids.dtype == torch.long
    assert 0 <= int(ids.min()) and int(ids.max()) < model.config.vocab_size
    out = call_model(model, batch)
    assert out.logits.shape == (3, 5, model.config.vocab_size)


def test_an_encoder_decoder_also_gets_decoder_input_ids() -> None:
    import transformers

    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config)
    batch = make_batch(model, batch_size=2, seq_len=4)
    assert set(batch) == {"input_ids", "decoder_input_ids"}
    assert all(int(t.max()) < 64 for t in batch.values())
    loss = default_loss(call_model(model, batch))  # without decoder ids T5 refuses to run
    loss.backward()
    assert torch.isfinite(loss)
    # Its blocks (encoder and decoder alike) resolve from _no_split_modules as well.
    blocks = _spec(f"{__name__}:gpt2_fixed").block_classes(model)
    assert [c.__name__ for c in blocks] == ["T5Block"]


def test_batch_rows_splits_every_tensor_of_a_mapping_and_names_a_bad_batch() -> None:
    batch = {"input_ids": torch.arange(8).view(4, 2), "mask": torch.ones(4, 2)}
    mine = batch_rows(batch, 2, 4)
    assert mine["input_ids"].tolist() == [[4, 5], [6, 7]] and mine["mask"].shape == (2, 2)
    assert [t.tolist() for t in batch_rows((torch.arange(4),), 1, 2)] == [[1]]
    with pytest.raises(ModelSpecError, match="holds a str; the input builder must return"):
        batch_rows("tokens", 0, 1)


def test_resident_bytes_count_the_tensors_of_a_mapping_batch() -> None:
    model = nn.Linear(2, 2)
    alone = resident_tensor_bytes(model)
    assert resident_tensor_bytes(model, None, [{"x": torch.zeros(1000)}]) == alone + 4000


@pytest.mark.parametrize(
    "name, block",
    [("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block"), ("mixtral", "MixtralDecoderLayer")],
)
def test_block_classes_of_a_transformers_model_come_from_no_split_modules(
    name: str, block: str
) -> None:
    spec = _spec(f"{HF}:{name}")
    model = spec.build("meta")
    assert [c.__name__ for c in spec.block_classes(model)] == [block]


def test_no_split_names_missing_from_the_model_are_skipped_only_if_one_is_found() -> None:
    spec = _spec(f"{HF}:llama")
    model = spec.build("meta")
    model._no_split_modules = {"LlamaDecoderLayer", "SomeVisionBlock"}
    assert [c.__name__ for c in spec.block_classes(model)] == ["LlamaDecoderLayer"]
    model._no_split_modules = {"SomeVisionBlock"}
    with pytest.raises(PolicyError) as info:
        spec.block_classes(model)
    message = str(info.value)
    assert "lists SomeVisionBlock in _no_split_modules, none of which is in the model" in message
    assert "pass --fsdp-block-cls" in message and "LlamaDecoderLayer" in message
    model._no_split_modules = None
    with pytest.raises(PolicyError, match="lists no class in _no_split_modules; pass"):
        spec.block_classes(model)


def test_an_explicit_wrong_block_class_on_a_transformers_model_is_still_an_error() -> None:
    spec = _spec(f"{HF}:llama", block_cls=("GPT2Block",))
    with pytest.raises(PolicyError, match="'GPT2Block' matches no module class in the model"):
        spec.block_classes(spec.build("meta"))


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_an_input_builder_returning_a_mapping_trains_under_fsdp(ranks: Ranks) -> None:
    """rank_train slices a mapping batch per rank and calls the model with keywords."""
    check = next(
        c for c in WRAP_CHECKS if c.name == "wrap.train.fp32" and c.params["version"] == "fsdp2"
    )
    spec = _spec(
        f"{__name__}:keyword_net", block_cls=("Linear",), input_builder=f"{__name__}:keyword_inputs"
    )
    verdict = run_check(ranks, check, spec=spec)
    assert verdict.passed, verdict.message


# ------------------------------------------------------------------------------------------
# Depth invariance on factories
# ------------------------------------------------------------------------------------------


def _depth_check(version: str = "fsdp2") -> Check:
    return next(
        c
        for c in MEMORY_CHECKS
        if c.name == "memory.depth_invariance" and c.params["version"] == version
    )


def test_depth_keywords_and_how_a_depth_is_set() -> None:
    def kw_only(*, n_layer: int = 2) -> None: ...
    def only_kwargs(**kwargs: Any) -> None: ...

    assert depth_keyword(hf_models.llama) == "num_layers"
    assert depth_keyword(kw_only) == "n_layer"
    assert depth_keyword(only_kwargs) is None  # not guessed at
    assert _spec(f"{HF}:gpt2").depth_setting() == "the factory's num_layers= keyword"
    assert _spec(f"{__name__}:gpt2_fixed").depth_setting() == (
        "config.num_hidden_layers of its GPT2LMHeadModel"
    )
    assert _spec(f"{__name__}:keyword_net").depth_setting() is None


def test_a_factory_spec_builds_at_the_depth_asked() -> None:
    by_keyword = with_depth(_spec(f"{HF}:mixtral"), 3).build("meta")
    assert by_keyword.config.num_hidden_layers == 3 and len(by_keyword.model.layers) == 3
    by_config = with_depth(_spec(f"{__name__}:gpt2_fixed"), 3).build("meta")
    assert by_config.config.n_layer == 3 and len(by_config.transformer.h) == 3


def test_a_spec_depth_is_for_factories_and_positive() -> None:
    with pytest.raises(ModelSpecError, match="must be >= 1, got 0"):
        _spec(f"{HF}:llama", depth=0)
    with pytest.raises(ModelSpecError, match="set a reference model's depth in its config"):
        ModelSpec(reference="massive", depth=2)


def test_depth_of_a_factory_that_cannot_set_it_names_both_ways() -> None:
    with pytest.raises(MemoryCheckError) as info:
        with_depth(_spec(f"{__name__}:keyword_net"), 4)
    assert "give the factory a depth keyword (num_layers=" in str(info.value)
    assert "a transformers model whose config has num_hidden_layers" in str(info.value)


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_depth_invariance_skips_a_factory_without_a_settable_depth(ranks: Ranks) -> None:
    spec = _spec(f"{__name__}:keyword_net", block_cls=("Linear",))
    with pytest.raises(CheckSkipped, match="give the factory a depth keyword"):
        run_check(ranks.configured(skip=None), _depth_check(), spec=spec)


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_depth_invariance_measures_a_transformers_factory_at_three_depths(ranks: Ranks) -> None:
    verdict = run_check(
        ranks, _depth_check(), spec=_spec(f"{__name__}:gpt2_fixed"), depths=(1, 2, 4)
    )
    assert verdict.passed, verdict.message
    assert verdict.figures["depths"] == [1, 2, 4]
    assert (
        "depths 1, 2, 4 (set by config.num_hidden_layers of its GPT2LMHeadModel)" in verdict.message
    )


@pytest.mark.cpu
@pytest.mark.world_size(2)
def test_depth_invariance_fails_a_factory_that_ignores_its_depth_keyword(ranks: Ranks) -> None:
    verdict = run_check(
        ranks, _depth_check(), spec=_spec(f"{__name__}:llama_ignoring_depth"), depths=(1, 2, 3)
    )
    assert not verdict.passed
    assert "the model did not get deeper" in verdict.message
    assert "set by the factory's num_layers= keyword" in verdict.message


def test_a_mixture_of_experts_model_profiles_on_meta() -> None:
    """torch's meta kernel of aten._grouped_mm takes bf16 only; the CPU kernel (and so the
    real step of transformers' MoE experts) runs fp32: the plan must not refuse the model."""
    units, config = plan_step(_spec(f"{HF}:mixtral", depth=1), 2, "fsdp2")
    assert config.activations is not None
    assert [u.cls for u in units].count("MixtralDecoderLayer") == 1
    assert sum(config.activations.saved_bytes.values()) > 0


# ------------------------------------------------------------------------------------------
# module:attr from the current folder
# ------------------------------------------------------------------------------------------

USER_FACTORY = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return torch.relu(self.fc(x))


def build():
    return nn.Sequential(nn.Linear(32, 32), Block(), Block(), nn.Linear(32, 32))
"""


@pytest.fixture
def model_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current folder holds ``fsdpc_cwd_models.py`` and is not on ``sys.path``."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "fsdpc_cwd_models.py").write_text(USER_FACTORY)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder))])
    monkeypatch.delitem(sys.modules, "fsdpc_cwd_models", raising=False)
    for name in [k for k in os.environ if k.startswith("FSDP_CONFORMANCE_")]:
        monkeypatch.delenv(name)
    return folder


def test_a_factory_resolves_from_the_current_folder(model_folder: Path) -> None:
    build = load_object("fsdpc_cwd_models:build", "model factory")
    assert isinstance(build(), nn.Sequential)
    assert sys.path[0] == str(model_folder)  # first, as under python -m


def test_the_pyproject_model_resolves_from_the_current_folder(
    model_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (model_folder / "pyproject.toml").write_text(
        '[tool.fsdp_conformance]\nmodel = "fsdpc_cwd_models:build"\nblock_cls = "Block"\n'
    )
    code = cli.main(["run", "--list", "--checks", "init.meta_build"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_OK, err
    assert out.split()[0] == "init.meta_build[fsdpc_cwd_models:build]"


@pytest.mark.process
def test_cli_run_from_the_model_folder_needs_no_pythonpath(tmp_path: Path) -> None:
    """The console script's sys.path starts with its own folder, not the current one: run
    the CLI the same way (a launcher script elsewhere), from the folder of the factory."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "fsdpc_cwd_models.py").write_text(USER_FACTORY)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    launcher = bindir / "fsdp-conformance"
    launcher.write_text(
        textwrap.dedent("""
        import sys
        from fsdp_conformance.cli import main
        sys.exit(main())
    """)
    )
    package_root = str(Path(cli.__file__).resolve().parents[1])  # this checkout, not the model
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FSDP_CONFORMANCE_", "PYTEST_")) and k != "GITHUB_STEP_SUMMARY"
    }
    env["PYTHONPATH"] = package_root
    result = subprocess.run(
        [
            sys.executable,
            str(launcher),
            "run",
            "--model",
            "fsdpc_cwd_models:build",
            "--block-cls",
            "Block",
            "--checks",
            "wrap.units.plan",
            "--world-sizes",
            "2",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == cli.EXIT_OK, result.stdout + result.stderr
    assert "2 passed, 0 failed" in result.stdout


def llama_naming_its_root() -> nn.Module:
    model = hf_models.llama(num_layers=1)
    model._no_split_modules = {"LlamaForCausalLM"}  # the root: the plan wraps nothing else
    return model


def test_an_empty_plan_from_no_split_modules_says_where_the_blocks_came_from() -> None:
    from fsdp_conformance.models.user_model import validate_user_model

    spec = _spec(f"{__name__}:llama_naming_its_root", min_params=10**12)
    with pytest.raises(PolicyError) as info:
        validate_user_model(spec, ["cpu"], [2])
    assert "block classes LlamaForCausalLM (from the model's _no_split_modules), threshold" in str(
        info.value
    )


# --------------------------------------------------------------------------------------------
# The whole suite on each reference transformers model, with no flag beyond --model
# --------------------------------------------------------------------------------------------

#: A skip either says the check does not apply to this model, and why (FSDP1's mixed
#: configuration on tied embeddings), or names what to do ("...; use a larger config of the
#: model", "define reset_parameters() on those classes").
SKIP_KINDS = ("does not apply", "use ", "define ", "pass ", "set ", "run ")


@pytest.mark.process  # a whole run: the process lane, beside the CLI runs in subprocesses
@pytest.mark.parametrize("name", sorted(hf_models.FACTORIES))
def test_the_whole_run_passes_on_a_reference_transformers_model_with_only_model(
    name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`fsdp-conformance run --model fsdp_conformance.hf_models:<name>`: every check of the
    cpu lane at the default world size; 0 failed, 0 errors."""
    from fsdp_conformance.gate.report import load_report

    for variable in [k for k in os.environ if k.startswith("FSDP_CONFORMANCE_")]:
        monkeypatch.delenv(variable)
    monkeypatch.chdir(tmp_path)  # no pyproject table of this repository applies
    code = cli.main(
        [
            "run",
            "--model",
            f"fsdp_conformance.hf_models:{name}",
            "--out",
            str(tmp_path / "out"),
            "--no-plot",
        ]
    )
    out, err = capsys.readouterr()
    report = load_report(str(tmp_path / "out" / "report.json"))
    bad = [
        f"{e['id']}: {e['outcome']}: {e['message'][:600]}"
        for e in report["checks"]
        if e["outcome"] in ("failed", "error")
    ]
    assert bad == [], "\n".join(bad)
    assert code == cli.EXIT_OK, out + err
    summary = report["summary"]
    assert summary["passed"] >= 30 and summary["failed"] == summary["error"] == 0, summary
    for entry in report["checks"]:
        if entry["outcome"] == "skipped":
            assert any(kind in entry["message"] for kind in SKIP_KINDS), entry["message"]
