"""`lmforge quantize MODEL --method int8|int4 --out DIR`: check everything first, measure
the source's held-out perplexity, quantize, measure again on the same samples, write
the directory and record sizes and perplexities (the command's output and MLflow)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lmforge.checkpoint.consolidate import committed_state
from lmforge.checkpoint.export import open_source
from lmforge.checkpoint.store import is_checkpoint
from lmforge.credentials import redact_uri
from lmforge.errors import UserError
from lmforge.evaluation.perplexity import held_out_samples, mean_nll, perplexity
from lmforge.models.build import build_model
from lmforge.models.quantized import (
    GROUP_SIZES,
    METHODS,
    byte_counts,
    is_quantized,
    linear_weight_names,
    quantize_blocks,
    stored_tensors,
    write_quantized,
)
from lmforge.tracking.command_run import log_command_run, tracking_uri

REPORT = "quantization_report.json"


@dataclass
class QuantizeOptions:
    model: str
    method: str
    out: str
    group_size: int = 128
    eval_data: Optional[str] = None  # a prepared dataset with a held-out split; default: the one the model was trained on
    eval_samples: int = 256
    tokenizer: Optional[str] = None
    device: str = "cpu"
    tracking_uri: Optional[str] = None
    tracking: bool = True

    def check(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"--method: {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method == "int4" and self.group_size not in GROUP_SIZES:
            raise UserError(f"--group-size: {self.group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
        if self.eval_samples < 1:
            raise UserError(f"--eval-samples: must be at least 1, got {self.eval_samples}")
        if Path(self.out).exists():
            raise UserError(f"--out: {self.out} already exists")
        if is_quantized(self.model):
            raise UserError(f"MODEL: {self.model} is already quantized; quantize its source")


def _trained_on(source) -> Optional[str]:
    """The dataset a model was trained on, when its checkpoint says so."""

    step = source.record.get("checkpoint")
    config = source.path / "config.json"
    if step is None and config.is_file():
        step = json.loads(config.read_text()).get("source", {}).get("checkpoint")
    if step and Path(step).exists() and is_checkpoint(Path(step)):
        return committed_state(Path(step)).data_path
    return None


def quantize_model(opts: QuantizeOptions, say=print) -> dict:

    opts.check()
    source = open_source(opts.model, opts.tokenizer)
    dataset = opts.eval_data or _trained_on(source)
    if dataset is None:
        raise UserError(
            f"MODEL: {opts.model} does not say what it was trained on; pass --eval-data DATASET (a prepared dataset with a held-out split)"
        )
    tokens, mask = held_out_samples(dataset, opts.eval_samples, "--eval-data" if opts.eval_data else f"{opts.model}'s dataset")
    if tokens.shape[1] > source.cfg.max_seq_len + 1:
        raise UserError(f"--eval-data: samples of {tokens.shape[1] - 1} tokens exceed the model's context of {source.cfg.max_seq_len}")
    vocab = source.tokenizer().get_vocab_size() if source.tokenizer_json else source.cfg.vocab_size
    model = build_model(source.cfg, opts.device, weights=source.read_tensors()).eval()
    numels = {name: t.numel() for name, t in model.state_dict().items()}
    linears = linear_weight_names(model)
    say(f"measuring {opts.model} on {len(tokens)} held-out samples of {dataset}")
    source_nll = mean_nll(model, tokens, mask, vocab)
    quantize_blocks(model, opts.method, opts.group_size)
    quantized_nll = mean_nll(model, tokens, mask, vocab)
    record = write_quantized(Path(opts.out), source, model, opts.method, opts.group_size)
    sizes = byte_counts(model, stored_tensors(model), linears, numels)
    result = {
        "out": opts.out,
        "source": opts.model,
        **record,
        "eval_data": str(dataset),
        "eval_samples": len(tokens),
        "source_nll": source_nll,
        "quantized_nll": quantized_nll,
        "source_perplexity": perplexity(source_nll),
        "quantized_perplexity": perplexity(quantized_nll),
        "perplexity_ratio": perplexity(quantized_nll) / perplexity(source_nll),
        **sizes,
    }
    (Path(opts.out) / REPORT).write_text(json.dumps(result, indent=2) + "\n")
    if opts.tracking:
        result["mlflow_run_id"] = _log(opts, result)
    return result


def _log(opts: QuantizeOptions, result: dict) -> str:

    uri = tracking_uri(opts.tracking_uri)
    params = {key: result[key] for key in ("source", "method", "group_size", "library", "device_type", "eval_data", "eval_samples", "out")}
    metrics = {
        key: result[key]
        for key in (
            "source_perplexity",
            "quantized_perplexity",
            "perplexity_ratio",
            "linear_bytes",
            "linear_bytes_bf16",
            "linear_ratio_vs_bf16",
            "model_bytes",
            "model_bytes_bf16",
            "model_ratio_vs_bf16",
        )
    }
    result["mlflow_tracking_uri"] = redact_uri(uri)
    return log_command_run(
        uri, "lmforge-quantize", f"quantize-{opts.method}-{Path(opts.out).name}", "quantize", params, metrics, [Path(opts.out) / REPORT]
    )
