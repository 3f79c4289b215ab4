"""The preflight on the user's model: before any rank starts, one line each,
exit 2 on the CLI and a usage error in the plugin.

* the model builds on meta (else the factory, the meta device and torch's reason);
* one batch can be made and the forward takes it on meta (else the input the forward wants and
  ``--input pkg:builder``);
* the default block classes (``_no_split_modules``) do not split a tied weight: where one would,
  the run goes on with the classes that keep it whole and says so; where every one would, exit 2;
* the depth rebuild works (the suite's own rebuild is named as the suite's, never the factory's).

Every model is built here from a transformers config at hidden 32 or by hand; the CLI runs in
process with ``run --list`` (the preflight runs, no check does). Each case is a failure seen
without the preflight: ViT's batch made on every rank ("no attribute vocab_size"), BERT run with
``BertEmbeddings`` as a block, the keyword-input model passed to the ranks, and "fix the
factory" said of the suite's own rebuild.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn

from fsdp_conformance import cli, hf_models
from fsdp_conformance.claims.memory.depth_invariance import DEFAULT_DEPTHS
from fsdp_conformance.models import user_model
from fsdp_conformance.models.block_classes import no_split_block_classes, split_ties
from fsdp_conformance.models.model_spec import ModelSpec, call_model
from fsdp_conformance.models.policies import PolicyError
from fsdp_conformance.settings import OPTIONS

HERE = __name__
ERROR = "fsdp-conformance run: error: "
NOTE = "fsdp-conformance run: note: "

# --------------------------------------------------------------------------------------------
# The models (factories the CLI imports by path: this module)
# --------------------------------------------------------------------------------------------


def vit() -> nn.Module:
    """An image model: its forward's main input is pixel_values, its config has no vocab."""
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=16,
        patch_size=8,
    )
    return transformers.ViTForImageClassification(config)


def vit_pixels(model: nn.Module, batch_size: int, device: Any) -> dict[str, torch.Tensor]:
    """ViT's input builder: images of the config's size."""
    size = model.config.image_size
    return {"pixel_values": torch.randn(batch_size, 3, size, size, device=device)}


def vit_token_ids(model: nn.Module, batch_size: int, device: Any) -> dict[str, torch.Tensor]:
    """A wrong builder for ViT: token ids (its forward takes them through **kwargs, then fails
    on pixel_values=None)."""
    return {"input_ids": torch.zeros(batch_size, 8, dtype=torch.long, device=device)}


def _bert_config() -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )


def bert_mlm() -> nn.Module:
    """BERT's masked LM: the word embedding (in BertEmbeddings) is tied to the decoder."""
    return transformers.BertForMaskedLM(_bert_config())


def bert_embeddings_only() -> nn.Module:
    """BERT's masked LM whose _no_split_modules names only the class that splits the tie."""
    model = transformers.BertForMaskedLM(_bert_config())
    model._no_split_modules = ["BertEmbeddings"]
    return model


def bert_no_split() -> nn.Module:
    """BERT's masked LM whose _no_split_modules names nothing (as wav2vec2's and MobileNet's)."""
    model = transformers.BertForMaskedLM(_bert_config())
    model._no_split_modules = []
    return model


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class MaskedNet(nn.Module):
    """A hand-written model whose forward needs a keyword input beside the features."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x * mask


def masked_net() -> nn.Module:
    return MaskedNet()


def masked_inputs(model: nn.Module, batch_size: int, device: Any) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(batch_size, 8, 32, device=device),
        "mask": torch.ones(batch_size, 8, 1, device=device),
    }


class TaggedLlama(transformers.LlamaForCausalLM):
    """A transformers model built from its config and one argument more: the suite's rebuild
    (``type(model)(config)``) cannot build it at another depth."""

    def __init__(self, config: transformers.LlamaConfig, tag: str) -> None:
        super().__init__(config)
        self.tag = tag


def tagged_llama() -> nn.Module:
    return TaggedLlama(hf_models.llama(num_layers=2).config, tag="mine")


def shallow_only(num_layers: int = 2) -> nn.Module:
    """A factory whose own depth keyword refuses the depth check's deepest depth."""
    if num_layers > 4:
        raise ValueError(f"this model has at most 4 layers, got {num_layers}")
    return hf_models.llama(num_layers=num_layers)


class ScaledNet(MaskedNet):
    """Reads a parameter's value while building: works on the CPU, not on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = float(self.inp.weight.abs().max().item())


def scaled_net() -> nn.Module:
    return ScaledNet()


def mixtral() -> nn.Module:
    """torch has no fp32 meta kernel for Mixtral's grouped matmul: its forward fails on meta,
    not on real tensors (the preflight must not refuse it)."""
    return hf_models.mixtral(num_layers=1)


class BrokenNet(MaskedNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("forward is broken on purpose")


def broken_net() -> nn.Module:
    return BrokenNet()


class SmallCNN(nn.Module):
    """A CNN: its forward takes a float image; its first nn.Linear is the head, so the default
    batch is features of the head's width, which the first convolution refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), nn.ReLU())
            for i in range(3)
        )
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        out: torch.Tensor = self.head(x.mean((2, 3)))
        return out


def small_cnn() -> nn.Module:
    return SmallCNN()


def images(model: nn.Module, batch_size: int, device: Any) -> torch.Tensor:
    return torch.randn(batch_size, 3, 8, 8, device=device)


class OwnNorm(nn.Module):
    """A norm with no reset_parameters(): a model holding it has no per-module init."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class NormedNet(MaskedNet):
    def __init__(self) -> None:
        super().__init__()
        self.norm = OwnNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for block in self.blocks:
            x = block(self.inp(x))
        return self.norm(x)


def normed_net() -> nn.Module:
    return NormedNet()


class InitWeightsNet(NormedNet):
    """The same model with a model-level init_weights() on its root: it has an init."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        nn.init.ones_(self.norm.weight)


def init_weights_net() -> nn.Module:
    return InitWeightsNet()


# --------------------------------------------------------------------------------------------
# The CLI, in process
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_outer_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.chdir(tmp_path)
    for option in OPTIONS:
        monkeypatch.delenv(option.env, raising=False)


def run_list(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, list[str]]:
    """``fsdp-conformance run --list`` on the user's model: the preflight, then the listing."""
    code = cli.main(["run", "--list", "--world-sizes", "2", *args])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def assert_exit_2(code: int, out: str, err: list[str], line: str) -> None:
    assert (code, out, err) == (cli.EXIT_USAGE, "", [ERROR + line])


def test_an_image_model_without_input_names_pixel_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:vit")
    assert_exit_2(
        code,
        out,
        err,
        "cannot make a default batch for ViTForImageClassification: the default input is token "
        "ids below config.vocab_size, and its forward's main input is pixel_values (ViTConfig "
        "has no vocab_size); pass an input builder (--input pkg.module:builder, called as "
        "builder(model, batch_size, device), returning e.g. {'pixel_values': ...}; a mapping it "
        "returns is passed as keyword arguments)",
    )
    # With the builder the forward wants, the preflight passes.
    code, out, err = run_list(capsys, "--model", f"{HERE}:vit", "--input", f"{HERE}:vit_pixels")
    assert code == cli.EXIT_OK, err
    assert err == [] and out


def test_a_builder_whose_batch_the_forward_refuses_on_meta_is_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:vit", "--input", f"{HERE}:vit_token_ids")
    assert_exit_2(
        code,
        out,
        err,
        f"the forward of ViTForImageClassification on the batch of input builder "
        f"'{HERE}:vit_token_ids' (keywords input_ids) raised AttributeError: 'NoneType' object "
        "has no attribute 'dtype'; it needs pixel_values, which the batch does not give; make "
        f"input builder '{HERE}:vit_token_ids' return what the forward takes (a mapping is "
        "passed as keyword arguments)",
    )


def test_a_forward_needing_a_keyword_input_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:masked_net", "--block-cls", "Block")
    assert_exit_2(
        code,
        out,
        err,
        "the forward of MaskedNet does not take the default batch (one tensor of features, "
        "shape (2, 8, 32)): missing a required argument: 'mask'; its forward needs x, mask "
        "(keyword-only); pass an input builder (--input pkg.module:builder, called as "
        "builder(model, batch_size, device), returning e.g. {'x': ..., 'mask': ...}; a mapping "
        "it returns is passed as keyword arguments)",
    )
    code, out, err = run_list(
        capsys,
        "--model",
        f"{HERE}:masked_net",
        "--block-cls",
        "Block",
        "--input",
        f"{HERE}:masked_inputs",
    )
    assert code == cli.EXIT_OK, err


def test_bert_goes_on_with_the_block_classes_that_keep_its_tie_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:bert_mlm", "--checks", "wrap.units")
    assert code == cli.EXIT_OK, err
    assert err == [
        NOTE + "the default block classes of BertForMaskedLM (its _no_split_modules: "
        "BertEmbeddings, BertLayer) would split a tied weight: BertEmbeddings holds "
        "bert.embeddings.word_embeddings.weight, the same tensor as "
        "cls.predictions.decoder.weight outside it; FSDP cannot shard one tensor in two units, "
        "so the run goes on with --block-cls BertLayer, the classes that keep every tie whole "
        "(pass it to choose them yourself; wrapping _no_split_modules as it is, as accelerate's "
        "FSDP plugin does, splits the tie)"
    ]
    assert out  # the listing: the run goes on
    # Given explicitly, the classes are the user's: no note.
    code, out, err = run_list(
        capsys, "--model", f"{HERE}:bert_mlm", "--block-cls", "BertLayer", "--checks", "wrap."
    )
    assert (code, err) == (cli.EXIT_OK, [])


def test_bert_resolves_the_same_safe_block_classes_wherever_they_are_resolved() -> None:
    """The ranks resolve the block classes themselves: the same classes as the note's."""
    built = ModelSpec(reference=None, factory=f"{HERE}:bert_mlm").instantiate("meta")
    assert [c.__name__ for c in built.blocks] == ["BertLayer"]
    assert {c.__name__ for c in split_ties(built.model, built.blocks)} == set()


def test_every_default_block_class_splitting_a_tie_is_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:bert_embeddings_only")
    assert_exit_2(
        code,
        out,
        err,
        f"no block class given for '{HERE}:bert_embeddings_only', and every class its "
        "transformers model BertForMaskedLM lists in _no_split_modules would split a tied "
        "weight (BertEmbeddings holds bert.embeddings.word_embeddings.weight, the same tensor "
        "as cls.predictions.decoder.weight outside it): FSDP cannot shard one tensor in two "
        "units; pass --block-cls with the class of its transformer block, one that holds "
        "every alias of a tied weight or none",
    )


def test_the_suites_own_depth_rebuild_failing_is_named_as_the_suites(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:tagged_llama")
    assert_exit_2(
        code,
        out,
        err,
        "the suite's own rebuild of TaggedLlama at 8 layers failed: TypeError: "
        "TaggedLlama.__init__() missing 1 required positional argument: 'tag' "
        "(memory.depth_invariance rebuilds a transformers model from a copy of its config with "
        "num_hidden_layers set; the factory is not called and not at fault); give the factory a "
        "depth keyword (num_layers=, n_layers=, num_hidden_layers=, n_layer=) and the suite "
        "builds each depth through it instead",
    )
    assert "fix the factory" not in err[0]
    # Without the depth check among the checks, no rebuild: the run goes on.
    code, out, err = run_list(capsys, "--model", f"{HERE}:tagged_llama", "--checks", "wrap.")
    assert (code, err) == (cli.EXIT_OK, [])


def test_a_factory_refusing_its_own_depth_keyword_is_the_factorys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:shallow_only")
    assert_exit_2(
        code,
        out,
        err,
        f"model factory '{HERE}:shallow_only' raised ValueError: this model has at most 4 "
        "layers, got 8; fix the factory (it is called with num_layers=8); "
        "memory.depth_invariance builds the model at 2, 4 and 8 layers through its num_layers= "
        "keyword",
    )


def test_a_factory_that_cannot_build_on_meta_names_the_meta_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:scaled_net", "--block-cls", "Block")
    assert_exit_2(
        code,
        out,
        err,
        f"model factory '{HERE}:scaled_net' raised RuntimeError: Tensor.item() cannot be called "
        "on meta tensors when built on the meta device (under `with torch.device('meta')`, "
        "where the suite builds every model first: meta init and planning); fix the factory "
        "(it is called with no arguments) so that it builds there too",
    )


# --------------------------------------------------------------------------------------------
# No false alarm: what the data does not blame on the input goes on to the checks
# --------------------------------------------------------------------------------------------


def test_a_forward_failing_on_meta_only_is_left_to_the_checks() -> None:
    """Mixtral's forward fails on meta (a meta kernel torch lacks), not on the CPU, where the
    preflight runs it once: not the input's fault, the checks run it on real tensors."""
    spec = ModelSpec(reference=None, factory=f"{HERE}:mixtral")
    built = spec.instantiate("meta")
    batch = built.batch()  # the default batch: token ids
    if isinstance(batch, dict):
        batch = {k: v.to("meta") for k, v in batch.items()}
    else:
        batch = batch.to("meta")
    with pytest.raises(RuntimeError), torch.no_grad():  # the forward does fail on meta
        call_model(built.model, batch)
    assert user_model.validate_user_model(spec, ["cpu"], [2]) == []


def test_the_reference_transformers_models_pass_the_preflight_without_a_note() -> None:
    for name in sorted(hf_models.FACTORIES):
        spec = ModelSpec(reference=None, factory=f"fsdp_conformance.hf_models:{name}")
        assert user_model.validate_user_model(spec, ["cpu"], [2]) == [], name


def test_the_rebuild_depth_is_the_depth_checks_deepest() -> None:
    assert user_model.REBUILD_DEPTH == max(DEFAULT_DEPTHS)


# --------------------------------------------------------------------------------------------
# The plugin: the same preflight, as a usage error and a header note
# --------------------------------------------------------------------------------------------


def test_the_plugin_refuses_the_same_input_with_its_own_flag(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "--co", "--fsdp-model", f"{HERE}:vit"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --fsdp-model: cannot make a default batch for ViTForImageClassification: *"
            "pass an input builder (--fsdp-input pkg.module:builder, *"
        ]
    )


def test_split_ties_names_each_splitting_class_once() -> None:
    with torch.device("meta"):
        model = bert_mlm()
        only_embeddings = bert_embeddings_only()
    assert [c.__name__ for c in no_split_block_classes(model, "bert")] == ["BertLayer"]
    listed = tuple({type(m) for m in model.modules() if type(m).__name__ == "BertEmbeddings"})
    assert {c.__name__: pair for c, pair in split_ties(model, listed).items()} == {
        "BertEmbeddings": (
            "bert.embeddings.word_embeddings.weight",
            "cls.predictions.decoder.weight",
        )
    }
    with pytest.raises(PolicyError, match="would split a tied weight"):
        no_split_block_classes(only_embeddings, "bert")


def test_the_plugin_states_the_block_classes_it_goes_on_with_in_its_header(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest_inprocess(
        "-p",
        "no:cacheprovider",
        "--co",
        "-k",
        "wrap.units.exact",
        "--fsdp-model",
        f"{HERE}:bert_mlm",
    )
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "fsdp-conformance: note: the default block classes of BertForMaskedLM (its "
            "_no_split_modules: BertEmbeddings, BertLayer) would split a tied weight: *so the run "
            "goes on with --fsdp-block-cls BertLayer, *",
            "*test_conformance?wrap.units.exact?fsdp1,*bert_mlm?*",
        ]
    )


# --------------------------------------------------------------------------------------------
# A CNN without --input, a model without an init, a model without --block-cls
# --------------------------------------------------------------------------------------------


def test_a_cnn_without_input_stops_before_any_rank_naming_the_input_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:small_cnn", "--block-cls", "Sequential")
    assert_exit_2(
        code,
        out,
        err,
        "the forward of SmallCNN does not take the default batch (one tensor of features, "
        "shape (2, 8, 8)): it raised RuntimeError: Given groups=1, weight of size [8, 3, 3, 3], "
        "expected input[1, 2, 8, 8] to have 3 channels, but got 2 channels instead on the meta "
        "device and on the CPU, so every check would fail with it; pass an input builder "
        "(--input pkg.module:builder, called as builder(model, batch_size, device); a mapping "
        "it returns is passed as keyword arguments) (a forward that fails on any input fails "
        "here too: fix it first)",
    )
    code, out, err = run_list(
        capsys,
        "--model",
        f"{HERE}:small_cnn",
        "--block-cls",
        "Sequential",
        "--input",
        f"{HERE}:images",
    )
    assert code == cli.EXIT_OK, err


def test_a_forward_broken_on_every_input_stops_before_any_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_list(capsys, "--model", f"{HERE}:broken_net", "--block-cls", "Block")
    assert code == cli.EXIT_USAGE
    assert err[0].startswith(
        ERROR + "the forward of BrokenNet does not take the default batch (one tensor of "
        "features, shape (2, 8, 32)): it raised RuntimeError: forward is broken on purpose on "
        "the meta device and on the CPU"
    )


def test_a_model_without_an_init_stops_before_any_rank_when_init_checks_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_list(capsys, "--model", f"{HERE}:normed_net", "--block-cls", "Block")
    assert_exit_2(
        code,
        out,
        err,
        "1 module(s) of NormedNet own parameters or buffers but have no reset_parameters(), and "
        "the model has no init_weights(): meta init (the init checks) cannot recreate their "
        "values (norm (OwnNorm)); name its init: --model-init pkg.module:fn (fn(model), the "
        "whole model after to_empty) or --init-fn pkg.module:fn (fn(module), per module), or "
        "define reset_parameters() on those classes; or run the other claims alone (--checks "
        "wrap. and so on)",
    )
    # Without init checks the model runs; with a root init_weights() it has an init.
    code, out, err = run_list(
        capsys, "--model", f"{HERE}:normed_net", "--block-cls", "Block", "--checks", "wrap."
    )
    assert code == cli.EXIT_OK, err
    code, out, err = run_list(capsys, "--model", f"{HERE}:init_weights_net", "--block-cls", "Block")
    assert code == cli.EXIT_OK, err


def test_the_plugin_names_a_model_without_an_init_in_its_header(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess(
        "-p",
        "no:cacheprovider",
        "--co",
        "--fsdp-model",
        f"{HERE}:normed_net",
        "--fsdp-block-cls",
        "Block",
    )
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "*1 module(s) of NormedNet own parameters or buffers but have no reset_parameters()*"
            "name its init: --fsdp-model-init pkg.module:fn*deselect the init checks*"
        ]
    )


@pytest.mark.parametrize(
    ("flags", "flag"), [((), "--block-cls"), (("--fsdp",), "--fsdp-block-cls")]
)
def test_a_model_without_block_cls_names_the_front_ends_flag_and_candidates(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], flag: str
) -> None:
    spec = ModelSpec(reference=None, factory=f"{HERE}:small_cnn")
    style = "pytest" if flags else "cli"
    with pytest.raises(Exception) as info:
        user_model.validate_user_model(spec, ["cpu"], [2], flag_style=style)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"no block class given for '{HERE}:small_cnn': pass {flag} with the class of its "
        "transformer block (a class name found in the model or a dotted path); candidates, the "
        "module classes it repeats: Sequential (x3, up to 584 params)"
    )
    code, _, err = run_list(capsys, "--model", f"{HERE}:masked_net")
    assert err == [
        ERROR + f"no block class given for '{HERE}:masked_net': pass --block-cls with the class "
        "of its transformer block (a class name found in the model or a dotted path); "
        "candidates, the module classes it repeats: Block (x2, up to 1,056 params)"
    ]


def test_a_transformers_model_without_no_split_modules_names_the_flag_and_candidates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Under the CLI the line names the CLI's flag (not the pytest plugin's) and the classes the
    # model repeats, not every module class it has.
    code, _, err = run_list(capsys, "--model", f"{HERE}:bert_no_split")
    assert code == 2
    assert len(err) == 1 and err[0].startswith(
        ERROR + f"no block class given for '{HERE}:bert_no_split', and its transformers model "
        "BertForMaskedLM lists no class in _no_split_modules; pass --block-cls with the class "
        "of its transformer block; candidates, the module classes it repeats: BertLayer (x2"
    ), err
    assert "--fsdp-block-cls" not in err[0] and "Dropout" not in err[0]
