"""Hugging Face interchange against transformers itself: a random model of each family
(`hf_models.LAYOUTS`) made and saved by transformers, imported by lmforge (logits within 1e-5, fp32, max abs); exported
back through the CLI and loaded by `AutoModelForCausalLM`/`AutoTokenizer` with no
custom code; export -> import -> export byte-identical; bad directories refused."""

import json
import shutil

import numpy as np
import pytest
import torch

from cli import assert_clean_error, run_cli
from hf_models import VOCAB, make_hf_model
from lmforge.models.build import build_model
from lmforge.models.weights import open_model_dir


def batch(rows=3, length=40, vocab=320):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(7))


def test_an_imported_model_gives_transformers_logits(hf_llama):
    model, path = hf_llama
    source = open_model_dir(path)
    assert source.format == "hf" and source.cfg.tie_embeddings == model.config.tie_word_embeddings
    ours = build_model(source.cfg, weights=str(path)).eval()
    tokens = batch()
    with torch.no_grad():
        diff = (ours(tokens) - model(tokens).logits).abs().max().item()
    assert diff < 1e-5


def test_a_directory_teaches_as_transformers_scores_it(hf_llama):
    """A teacher cache's scoring of a Hugging Face directory, every family (the mixture
    of experts among them): the top 8 of transformers' log-probabilities at
    temperature 2, ids in order, log-probabilities within fp16's rounding."""
    from lmforge.distill_jobs.teacher_cache import TeacherTopK

    model, path = hf_llama
    tokens = batch()
    scored = TeacherTopK([str(path)], [1.0], 8, 2.0, VOCAB, threads=1)({"tokens": tokens.numpy(), "sample_id": [0, 1, 2]})
    with torch.no_grad():
        want = torch.log_softmax(model(tokens[:, :-1]).logits / 2.0, dim=-1).topk(8, dim=-1)
    assert torch.equal(torch.from_numpy(scored["topk_ids"]).long(), want.indices.reshape(3, -1))
    assert torch.allclose(torch.from_numpy(scored["topk_logprobs"]).float(), want.values.reshape(3, -1), atol=4e-3)
    # A batch scored a micro-batch at a time (the cache builder's) is, bit for bit, its
    # micro-batches scored each alone.
    chunked = TeacherTopK([str(path)], [1.0], 8, 2.0, VOCAB, threads=1, rows_per_forward=2)({"tokens": tokens.numpy(), "sample_id": [0, 1, 2]})
    alone = [TeacherTopK([str(path)], [1.0], 8, 2.0, VOCAB, threads=1)({"tokens": rows.numpy(), "sample_id": [0]}) for rows in tokens.split(2)]
    for column in ("topk_ids", "topk_logprobs"):
        assert np.array_equal(chunked[column], np.concatenate([part[column] for part in alone])), column


def test_a_sharded_directory_imports_the_same_weights(hf_llama, tmp_path, hf_tokenizer):
    model, _ = hf_llama
    model.save_pretrained(tmp_path, max_shard_size="60KB")  # transformers' own index and shards
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_tokenizer / name, tmp_path / name)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    source = open_model_dir(tmp_path)
    ours = build_model(source.cfg, weights=str(tmp_path)).eval()
    tokens = batch()
    with torch.no_grad():
        assert (ours(tokens) - model(tokens).logits).abs().max().item() < 1e-5


def test_the_end_of_text_token_is_the_tokenizer_configs(tmp_path):
    from lmforge.data.tokenizer import EOS_TOKEN, end_of_text_token

    tokenizer = tmp_path / "tokenizer.json"
    assert end_of_text_token(tokenizer) == EOS_TOKEN  # no tokenizer_config.json beside it
    for saved in ("</s>", {"content": "</s>", "special": True}):  # as a string, or as transformers' AddedToken
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": saved}))
        assert end_of_text_token(tokenizer) == "</s>"


def test_export_import_export_through_the_cli(hf_llama, tmp_path, hf_tokenizer):
    """HF -> lmforge format -> HF: transformers loads the result with no custom code and
    its logits and tokenizer ids are the original's; once more round, the same bytes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmforge.data.tokenizer import load_tokenizer

    model, path = hf_llama
    steps = [
        (path, tmp_path / "lmforge", "lmforge"),
        (tmp_path / "lmforge", tmp_path / "hf", "hf"),
        (tmp_path / "hf", tmp_path / "lmforge2", "lmforge"),
        (tmp_path / "lmforge2", tmp_path / "hf2", "hf"),
    ]
    for source, out, fmt in steps:
        result = run_cli("export", str(source), "--out", str(out), "--format", fmt, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is type(model)  # the family it came as
    tokens = batch()
    with torch.no_grad():
        assert (loaded(tokens).logits - model(tokens).logits).abs().max().item() < 1e-5
    text = "def generate(prompt):\n    return [token for token in prompt]  # ünïcode"
    loaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded_tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    if type(loaded_tokenizer).__name__ == "TokenizersBackend":  # tokenizer.json as it is (for qwen2,
        # transformers builds its own pre-tokenizer, which this test's tokenizer was not trained with)
        assert loaded_tokenizer(text)["input_ids"] == load_tokenizer(hf_tokenizer / "tokenizer.json").encode(text).ids
    assert loaded_tokenizer.eos_token == "<|endoftext|>"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__] and config["torch_dtype"] == "float32"
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "hf2").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in files:
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes(), name


def test_a_bf16_export_is_the_weights_rounded_once(hf_llama, tmp_path):
    model, path = hf_llama
    result = run_cli("export", str(path), "--out", str(tmp_path / "bf16"), "--format", "hf", "--dtype", "bf16", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    for name, param in model.state_dict().items():
        if name in saved:
            assert torch.equal(saved[name], param.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _hf_dir(tmp_path, hf_tokenizer, change=None, **config_changes):
    """A valid HF directory made by transformers, then broken by `change(dir)` or by
    `config_changes` to its config.json."""
    out = tmp_path / "broken"
    make_hf_model(out, "untied-gqa", hf_tokenizer)
    if config_changes:
        config = json.loads((out / "config.json").read_text()) | config_changes
        (out / "config.json").write_text(json.dumps(config))
    if change:
        change(out)
    return out


def _pickle_only(path):
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"never unpickled")


def _sharded_with_a_missing_shard(path):
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _index_naming(shard: str):
    """A sharded directory whose index names `shard` (outside the directory, say) for one tensor."""

    def change(path):
        outside = path.parent / "elsewhere.safetensors"
        (path / "model.safetensors").rename(outside)
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": shard}}))

    return change


def _tokens_added(special: bool):
    """Two tokens added to the directory's tokenizer, past the model's vocabulary."""

    def change(path):
        from tokenizers import AddedToken, Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        tokenizer.add_tokens([AddedToken(f"<extra_{i}>", special=special) for i in range(2)])
        tokenizer.save(str(path / "tokenizer.json"))

    return change


def _config_text(text: str):
    return lambda path: (path / "config.json").write_text(text)


BAD_DIRECTORIES = {
    "an index naming a shard by absolute path": (
        {"change": _index_naming("/etc/passwd")},
        "names the shard '/etc/passwd', which is not a file of its own directory",
    ),
    "an index naming a shard above its directory": (
        {"change": _index_naming("../elsewhere.safetensors")},
        "names the shard '../elsewhere.safetensors', which is not a file of its own directory",
    ),
    "an index that is a list": (
        {"change": lambda p: (p / "model.safetensors.index.json").write_text("[1, 2]")},
        "model.safetensors.index.json: holds a JSON list, where an object belongs",
    ),
    "a weight map that is a list": (
        {"change": lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": []}')},
        "`weight_map` is a JSON list, where an object belongs",
    ),
    "a config that is a list": ({"change": _config_text("[]")}, "config.json: holds a JSON list, where an object belongs"),
    "zero attention heads": ({"num_attention_heads": 0}, "num_attention_heads is 0, not a positive whole number"),
    "heads given as text": ({"num_attention_heads": "4"}, "num_attention_heads is '4', not a positive whole number"),
    "a pickle": ({"change": _pickle_only}, "pytorch_model.bin: a pickle, which lmforge never loads; convert it to safetensors"),
    "a missing shard": ({"change": _sharded_with_a_missing_shard}, "lists the shard model-00002-of-00002.safetensors, which is not there"),
    "no tokenizer": ({"change": lambda p: (p / "tokenizer.json").unlink()}, "a Hugging Face directory without its tokenizer.json"),
    "a tokenizer with more tokens than the model": (
        {"change": _tokens_added(special=False)},
        f"adds tokens of ids {VOCAB}, {VOCAB + 1}, past the model's vocabulary of {VOCAB}",
    ),
    "no weights": ({"change": lambda p: (p / "model.safetensors").unlink()}, "holds neither model.safetensors nor model.safetensors.index.json"),
    "shapes": ({"intermediate_size": 128}, "model.layers.0.mlp.gate_proj.weight has shape [160, 64], config.json implies [128, 64]"),
    "a family lmforge lacks": ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type is 'gpt2'"),
    "its own code": ({"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}, "auto_map asks for the model's own code"),
    "attention bias": ({"attention_bias": True}, "attention_bias is true"),
    "mlp bias": ({"mlp_bias": True}, "mlp_bias is true"),
    "rope scaling": ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling is of type 'yarn'"),
    "llama3 scaling without its factors": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling has low_freq_factor None"),
    "a head_dim rotary cannot turn": ({"head_dim": 15}, "head_dim is 15, not even"),
    "head_dim against the weights": ({"head_dim": 32}, "q_proj.weight has shape [64, 64], config.json implies [128, 64]"),
    "an attention kind lmforge lacks": (
        {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "use_sliding_window": True,
            "sliding_window": 8,
            "layer_types": ["chunked_attention"] * 2,
        },
        "layer_types is ['chunked_attention', 'chunked_attention'], not full_attention or sliding_attention",
    ),
}


@pytest.mark.parametrize("case", BAD_DIRECTORIES)
def test_a_directory_lmforge_cannot_represent_is_refused(case, tmp_path, hf_tokenizer):
    options, message = dict(BAD_DIRECTORIES[case][0]), BAD_DIRECTORIES[case][1]
    path = _hf_dir(tmp_path, hf_tokenizer, options.pop("change", None), **options)
    result = run_cli("export", str(path), "--out", str(tmp_path / "out"), "--format", "hf", cwd=tmp_path)
    assert_clean_error(result, message)
    assert not (tmp_path / "out").exists()
    result = run_cli("generate", str(path), "--prompt", "x", cwd=tmp_path)
    assert_clean_error(result, "MODEL:", message)


def test_special_tokens_added_past_the_vocabulary_are_let_be(tmp_path, hf_tokenizer):
    """As transformers lets them be (a placeholder of another modality, say): text does not hold them."""
    from lmforge.checkpoint.export import open_source

    source = open_source(_hf_dir(tmp_path, hf_tokenizer, _tokens_added(special=True)))
    assert source.tokenizer().get_vocab_size() == VOCAB + 2 and source.cfg.vocab_size == VOCAB


def test_export_options_are_checked_before_anything_is_written(hf_llama, tmp_path):
    _, path = hf_llama
    for args, message in ((["--format", "gguf"], "--format: 'gguf' is not one of lmforge, hf"), (["--dtype", "fp8"], "--dtype: 'fp8'")):
        result = run_cli("export", str(path), "--out", str(tmp_path / "out"), *args, cwd=tmp_path)
        assert_clean_error(result, message)
        assert not (tmp_path / "out").exists()
    shutil.copytree(path, tmp_path / "taken")
    assert_clean_error(run_cli("export", str(path), "--out", str(tmp_path / "taken"), cwd=tmp_path), "--out:", "already exists")


def test_a_job_started_from_a_hugging_face_directory_takes_its_shape_and_tokenizer(hf_llama, tmp_path, hf_tokenizer):
    """No preset: the directory's shape. Its tokenizer prepares the dataset, and a
    dataset tokenized with another vocabulary is refused naming both."""
    from lmforge.data.manifest import DatasetManifest, TokenizerRecord
    from lmforge.data.prepare_options import PrepareOptions
    from lmforge.data.tokenizer import train_bpe
    from lmforge.errors import UserError
    from lmforge.preflight import check_init_from
    from lmforge.spec import spec_from_dict

    model, path = hf_llama
    job = {"name": "from-hf", "data": {"path": str(tmp_path / "data"), "source": str(tmp_path)}, "model": {"init_from": str(path)}}
    spec = spec_from_dict(job)
    assert spec.model_arch == open_model_dir(path).cfg and spec.model_arch.vocab_size == model.config.vocab_size
    assert PrepareOptions.for_job(spec).tokenizer == str(path / "tokenizer.json")
    check_init_from(spec, None)
    (tmp_path / "data").mkdir()
    train_bpe(["another corpus, another vocabulary"], 300).save(str(tmp_path / "data" / "tokenizer.json"))
    with pytest.raises(UserError, match="data.path: .* was tokenized with another vocabulary than model.init_from's"):
        check_init_from(spec, DatasetManifest.model_construct(tokenizer=TokenizerRecord.model_construct(file="tokenizer.json")))
    spec_from_dict(job | {"model": {"init_from": str(path), "preset": "tiny"}})  # a preset given: its shape, checked at pre-flight
    with pytest.raises(UserError, match="model.init_from: .* holds a model of a different shape"):
        check_init_from(spec_from_dict(job | {"model": {"init_from": str(path), "preset": "tiny"}}), None)
    with pytest.raises(UserError, match="model.init_from: .*nowhere: not a model directory"):
        spec_from_dict(job | {"model": {"init_from": str(tmp_path / "nowhere")}})
