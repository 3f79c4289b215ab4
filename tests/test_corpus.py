"""The architecture corpus of benchmarks/ (docs/corpus.md): its models module enumerates every
architecture transformers builds from a config across the kinds, the probed survivors number at
least 45 and span the kinds, a decoder, a vision model and a hand-written style build and train
at tiny size, the probe catches a model that does not train, the runner's commands carry the
flags each model needs, and a failed row is named by its cause."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import run_corpus  # noqa: E402
from corpus import causes, models  # noqa: E402 - found through benchmarks/ on the path

pytestmark = pytest.mark.process

KINDS = {"decoder", "moe", "seq2seq", "encoder", "vision", "audio"}


def test_the_models_module_enumerates_every_kind_and_45_survivors() -> None:
    assert {e.kind for e in models.architectures().values()} >= KINDS - {"moe"}
    survivors = models.load_survivors()["survivors"]
    assert len(survivors) >= 45
    assert {row["kind"] for row in survivors.values()} >= KINDS
    assert set(survivors) <= set(models.architectures())
    assert set(models.hand_written()) == {"mingpt", "titan_llama", "small_resnet", "frozen_gpt"}


@pytest.mark.parametrize("name", ["llama", "vit", "titan_llama", "small_resnet"])
def test_a_decoder_a_vision_model_and_hand_written_styles_build_and_train(name: str) -> None:
    assert models.probe(name) is None


def test_a_factory_is_found_by_name_and_takes_the_depth() -> None:
    factory = models.llama
    assert factory.__name__ == "llama"
    assert factory(num_layers=3).config.num_hidden_layers == 3
    with pytest.raises(AttributeError, match="no corpus model 'gpt9'"):
        _ = models.gpt9


def test_the_probe_names_a_model_that_gets_no_nonzero_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.embed.requires_grad_(False)
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.embed(ids) + 0 * self.scale  # the one trainable parameter gets zeros

    monkeypatch.setattr(models, "build", lambda name, num_layers=2: Frozen())
    monkeypatch.setattr(models, "input_flag", lambda name: None)
    assert models.probe("llama") == "no parameter got a nonzero gradient"


def test_the_runner_gives_input_and_block_flags_where_needed() -> None:
    assert "--input" not in run_corpus.command("llama", Path("out"), "python")
    assert run_corpus.command("vit", Path("out"), "python")[-2:] == [
        "--input",
        "corpus.models:inputs",
    ]
    resnet = run_corpus.command("small_resnet", Path("out"), "python")
    assert resnet[-4:] == ["--input", "corpus.models:inputs", "--block-cls", "BasicBlock"]


def _report(*checks: dict[str, Any]) -> dict[str, Any]:
    outcomes = [c["outcome"] for c in checks]
    summary = {k: outcomes.count(k) for k in ("passed", "failed", "skipped", "error", "xfailed")}
    return {"summary": summary, "checks": list(checks)}


def test_a_row_is_clean_only_without_failures_and_errors(tmp_path: Path) -> None:
    clean = _report({"id": "wrap.units[cpu,ws2,fsdp2]", "outcome": "passed", "message": "ok"})
    (tmp_path / "report.json").write_text(json.dumps(clean))
    assert run_corpus.row_of("llama", tmp_path, 0, 1.0)["status"] == "clean"
    bad = _report(
        {
            "id": "a[cpu,ws2,fsdp1]",
            "outcome": "error",
            "message": "Must flatten tensors with uniform requires_grad",
        },
        {"id": "b[cpu,ws2,fsdp2]", "outcome": "failed", "message": "something new\nmore"},
    )
    (tmp_path / "report.json").write_text(json.dumps(bad))
    row = run_corpus.row_of("llama", tmp_path, 1, 1.0)
    assert row["status"] == "not clean"
    assert row["causes"] == {"FSDP1 frozen flat param": 1, "other: something new": 1}


def test_a_model_refused_before_any_rank_is_a_row_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "run.log").write_text("fsdp-conformance run: error: no block class given\n")
    row = run_corpus.row_of("llama", tmp_path, 2, 1.0)
    assert row["status"] == "refused"
    assert "no block class given" in row["cause"]


@pytest.mark.parametrize(
    ("message", "cause"),
    [
        ("no reduction for unit layers.0", "collective matching"),
        ("'abs' not implemented for 'Bool'", "non-float buffer"),
        ("prefetched layers.1, expected layers.2", "prefetch order"),
        ("running_mean differs after the step", "BatchNorm stats"),
        ("RuntimeError: value cannot be converted to type int64_t", "non-float buffer"),
        (
            "RuntimeError in torch/nn/functional.py:batch_norm: expected scalar type Half",
            "BatchNorm under low-precision parameters",
        ),
        ("ranks 0, 1: KeyError in fsdp_conformance/x.py:f: 'a'", "the suite's own code raised"),
    ],
)
def test_a_failed_row_is_named_by_its_cause(message: str, cause: str) -> None:
    assert causes.cause_of({"id": "x[cpu,ws2,fsdp2]", "message": message}) == cause
