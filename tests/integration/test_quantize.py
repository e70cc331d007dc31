"""`lmforge quantize` on the reference run's trained model: int8 per channel and int4
group-wise (torchao on CPU), byte counts against bf16 computed here from the model's
shapes, perplexity against the unquantized model on the held-out split, recomputed
here from the reloaded directory; the directory loads without unpickling and
generates in `lmforge generate` as in `sdk.generate` (as do a checkpoint and an
export: one path); bad input is refused before anything is written."""

import json
import math
from pathlib import Path

import pytest
import torch

from cli import assert_clean_error, run_cli
from conftest import REFERENCE_STEPS, SESSION_MLFLOW
from lmforge import sdk
from lmforge.checkpoint.export import open_source
from lmforge.evaluation.perplexity import held_out_samples, mean_nll
from lmforge.inference.generate import Generator
from lmforge.models.build import build_model


def last_step(reference_run) -> Path:
    return Path(reference_run.run_dir) / "checkpoints" / f"step_{REFERENCE_STEPS:08d}"


@pytest.fixture(scope="module")
def source(reference_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quantize") / "fp32"
    assert run_cli("export", str(last_step(reference_run)), "--out", str(out), cwd=out.parent).returncode == 0
    return out


def assert_cli_and_sdk_generate_alike(model: Path) -> None:
    """`lmforge generate` and `sdk.generate` open the same model kinds through one path:
    greedy, both write the same tokens."""
    generated = run_cli("generate", str(model), "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "8", "--json", cwd=model.parent)
    assert generated.returncode == 0, generated.stderr
    from_cli = json.loads(generated.stdout)
    [from_sdk] = sdk.generate(str(model), "def ", temperature=0, max_new_tokens=8)
    assert len(from_cli["tokens"]) >= 1 and from_cli["tokens"] == from_sdk["tokens"] and from_cli["text"] == from_sdk["text"]


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
def test_the_cli_and_the_sdk_generate_from_every_model_kind(source, reference_run, kind):
    """The quantized kind is checked where it is made, below."""
    assert_cli_and_sdk_generate_alike(last_step(reference_run) if kind == "checkpoint" else source)


def up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def expected_linear_bytes(cfg, method: str, group: int | None) -> int:
    """int8: a byte per weight, an fp32 scale and an int8 zero point per output row.
    int4: half a byte per weight and fp32 (scale, zero) per group of a row, rows
    padded to 16s and columns to whole groups of at least 128 (the CPU packing)."""
    shapes = [
        (cfg.n_heads * cfg.head_dim, cfg.dim),
        (cfg.n_kv_heads * cfg.head_dim, cfg.dim),
        (cfg.n_kv_heads * cfg.head_dim, cfg.dim),
        (cfg.dim, cfg.n_heads * cfg.head_dim),
        (cfg.ffn_hidden, cfg.dim),
        (cfg.ffn_hidden, cfg.dim),
        (cfg.dim, cfg.ffn_hidden),
    ]
    if method == "int8":
        return cfg.n_layers * sum(n * k + 5 * n for n, k in shapes)
    padded = [(up(n, 16), up(k, max(group, 128))) for n, k in shapes]
    return cfg.n_layers * sum(n * k // 2 + (k // group) * n * 8 for n, k in padded)


@pytest.mark.parametrize("method, group, nll_bound", [("int8", None, 0.01), ("int4", 32, 0.10)])
def test_quantized_model_is_smaller_close_and_loads_without_unpickling(source, tiny_dataset, method, group, nll_bound, monkeypatch):
    out = source.parent / method
    args = [
        "quantize",
        str(source),
        "--method",
        method,
        "--out",
        str(out),
        "--eval-data",
        str(tiny_dataset),
        "--eval-samples",
        "32",
        "--tracking-uri",
        SESSION_MLFLOW,
        "--json",
    ] + (["--group-size", str(group)] if group else [])
    result = run_cli(*args, cwd=source.parent)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)

    # Sizes from the shapes: the blocks' Linear weights as bf16, and what the file holds.
    cfg = open_source(source).cfg
    per_block = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.dim * cfg.ffn_hidden
    assert report["linear_bytes_bf16"] == 2 * cfg.n_layers * per_block
    assert report["linear_bytes"] == expected_linear_bytes(cfg, method, group)
    assert report["linear_ratio_vs_bf16"] == report["linear_bytes"] / report["linear_bytes_bf16"]
    assert not list(out.glob("*.pt")) and not list(out.glob("*.bin")), "nothing pickled"

    # Reloaded (safetensors parts into a model quantized the same way; torch.load is
    # never called): the perplexity the report gives, within its bound of the source's.
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a quantized directory must not be unpickled"))
    generator = Generator.load(str(out))
    tokens, mask = held_out_samples(tiny_dataset, 32)
    vocab = generator.tokenizer.get_vocab_size()
    quantized = mean_nll(generator.model, tokens, mask, vocab)
    unquantized = mean_nll(build_model(cfg, weights=open_source(source).read_tensors()).eval(), tokens, mask, vocab)
    assert quantized == pytest.approx(report["quantized_nll"], abs=1e-5)
    assert unquantized == pytest.approx(report["source_nll"], abs=1e-5)
    assert math.exp(quantized) / math.exp(unquantized) - 1 <= nll_bound
    assert quantized != unquantized, "the weights were not quantized"
    kind = "Int8Tensor" if method == "int8" else "WeightOnlyInt4Linear"
    assert kind in {type(m).__name__ for m in generator.model.modules()} | {type(p).__name__ for p in generator.model.parameters()}
    assert type(generator.model.tok_embeddings.weight) is torch.nn.Parameter and generator.model.tok_embeddings.weight.dtype == torch.float32

    assert_cli_and_sdk_generate_alike(out)

    from mlflow.tracking import MlflowClient

    run = MlflowClient(SESSION_MLFLOW).get_run(report["mlflow_run_id"])
    assert run.data.metrics["linear_ratio_vs_bf16"] == pytest.approx(report["linear_ratio_vs_bf16"])
    assert run.data.params["method"] == method


def test_bad_quantize_input_is_refused_before_anything_is_written(source, tmp_path):
    out = tmp_path / "q"
    cases = [
        (["--method", "int3"], "--method: 'int3' is not one of int8, int4"),
        (["--method", "int4", "--group-size", "100"], "--group-size: 100 is not one of"),
        (["--method", "int8", "--eval-data", str(tmp_path)], "--eval-data", "not a prepared dataset"),
        (["--method", "int8"], "does not say what it was trained on"),  # an export of an export: no checkpoint to follow
    ]
    bare = tmp_path / "bare"
    assert run_cli("export", str(source), "--out", str(bare), cwd=tmp_path).returncode == 0
    assert_clean_error(run_cli("quantize", "absent", "--method", "int8", "--out", str(out), cwd=tmp_path), "MODEL: absent does not exist")
    for flags, *fragments in cases:
        assert_clean_error(run_cli("quantize", str(bare), *flags, "--out", str(out), "--no-tracking", cwd=tmp_path), *fragments)
        assert not out.exists()
