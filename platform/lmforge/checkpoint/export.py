"""`lmforge export`: a model from a committed checkpoint of either engine, an lmforge
model directory or a Hugging Face Llama directory, written as a model directory in
lmforge's format (the default) or Hugging Face's, with its tokenizer.

`open_source` is also how generation and teachers find a model and its tokenizer.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from pydantic import BaseModel

from lmforge.checkpoint.consolidate import committed_state, read_checkpoint, read_trained_tensors
from lmforge.checkpoint.store import is_checkpoint
from lmforge.data import storage
from lmforge.data.manifest import MANIFEST, has_manifest, read_manifest
from lmforge.data.tokenizer import beyond_the_model, end_of_text_token, tokenizer_files
from lmforge.errors import UserError
from lmforge.models import ModelConfig
from lmforge.models.config import config_from_dict
from lmforge.models.hf import DTYPES
from lmforge.models.lora_config import is_adapter
from lmforge.models.peft_format import write_peft_dir
from lmforge.models.weights import open_model_dir, write_model_dir

FORMATS = ("lmforge", "hf", "peft")
log = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """A model found at a path: its shape, a way to read its weights (lmforge's names
    and layout) and, when it has one, its tokenizer."""

    path: Path
    kind: str  # "checkpoint", "lmforge" or "hf"
    cfg: ModelConfig
    read_tensors: Callable[[], dict[str, torch.Tensor]]
    tokenizer_json: Optional[str] = None  # the tokenizer.json text
    eos_token: Optional[str] = None
    record: dict = field(default_factory=dict)  # what an lmforge export says it came from

    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.tokenizer_json) if self.tokenizer_json else None


def open_source(path: str | os.PathLike, tokenizer: Optional[str] = None, name: str = "MODEL") -> ModelSource:
    """`name` is what the user typed the path as, for messages; `tokenizer` a
    tokenizer.json that replaces the one found beside the model."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{name}: {path} does not exist")
    if is_checkpoint(path):
        source = _checkpoint_source(path)
    else:
        try:
            model_dir = open_model_dir(path)
        except ValueError as err:
            raise UserError(f"{name}: {err}") from None
        source = ModelSource(path, model_dir.format, model_dir.cfg, model_dir.tensors, record={"model_dir": str(path), "format": model_dir.format})
        if model_dir.tokenizer_file:
            source.tokenizer_json, source.eos_token = model_dir.tokenizer_file.read_text(), end_of_text_token(model_dir.tokenizer_file)
            _check_tokenizer(source, name, str(model_dir.tokenizer_file))
    if tokenizer:
        if not Path(tokenizer).is_file():
            raise UserError(f"--tokenizer: {tokenizer} does not exist")
        source.tokenizer_json, source.eos_token = Path(tokenizer).read_text(), end_of_text_token(tokenizer)
        _check_tokenizer(source, "--tokenizer", "the tokenizer")
    return source


def _check_tokenizer(source: ModelSource, name: str, subject: str) -> None:
    """A tokenizer whose ids the model has no rows for would index past its embedding."""
    try:
        tokenizer = source.tokenizer()
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own types for a file that is not one
        raise UserError(f"{name}: not a tokenizer.json ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    beyond = beyond_the_model(tokenizer, source.cfg.vocab_size)
    if beyond:
        raise UserError(f"{name}: {subject} {beyond}")


def _checkpoint_source(step_dir: Path) -> ModelSource:
    state = committed_state(step_dir)
    if state.format == "deepspeed":
        log.warning(
            "warning: %s is a DeepSpeed checkpoint, whose files Python unpickles (they can run code): open only checkpoints "
            "your own jobs wrote, and share models as exports (safetensors and JSON)",
            step_dir,
        )
    source = ModelSource(
        step_dir,
        "checkpoint",
        config_from_dict(state.model, str(step_dir / "state.json")),
        lambda: read_checkpoint(step_dir)[1],
        record={
            "checkpoint": str(step_dir.absolute()),
            "step": state.step,
            "format": state.format,
            **{key: value for key, value in state.as_json().items() if key in ("job", "mlflow")},
        },
    )
    dataset = state.data_path or "."
    if has_manifest(dataset, "data_path"):  # the tokenizer of the dataset it was trained on (a directory or a URI)
        try:
            entry = read_manifest(dataset, "data_path", check_shards=False).tokenizer
            source.tokenizer_json = storage.read_text(storage.join(dataset, entry.file), "data_path")
        except UserError as err:
            raise UserError(
                f"{storage.join(dataset, MANIFEST)}: the dataset the checkpoint was trained on has no readable tokenizer ({err})"
            ) from None
        source.eos_token = source.tokenizer().id_to_token(entry.eos_id)
    return source


class RegisteredModel(BaseModel):
    """A version of the MLflow registered model named after the job, and the run that holds its files."""

    name: str
    version: int
    run_id: str


class ExportResult(BaseModel):
    """What an export wrote, and from what."""

    out: str
    format: str
    source_kind: str  # checkpoint, lmforge or hf
    step: Optional[int]  # a checkpoint's
    parameters: int
    tokenizer: bool  # whether it ships one
    source: dict[str, Any]  # the source's record: its checkpoint, job and MLflow run
    registered: Optional[RegisteredModel] = None  # `sdk.export(register=True)`: where MLflow keeps it


def export_model(
    source_path: str | os.PathLike, out: str | os.PathLike, fmt: str = "lmforge", dtype: str = "fp32", tokenizer: Optional[str] = None
) -> ExportResult:
    """A model directory of `fmt` from any model source; returns what was written."""
    if fmt not in FORMATS:
        raise UserError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if Path(out).exists():
        raise UserError(f"--out: {out} already exists")
    if fmt == "peft":
        return _export_adapters(Path(source_path), Path(out), dtype)
    source = open_source(source_path, tokenizer, name="CHECKPOINT")
    if fmt == "hf" and source.tokenizer_json is None:
        raise UserError(
            f"{source_path}: no tokenizer found (the dataset it was trained on is gone?); --format hf needs one: pass --tokenizer tokenizer.json"
        )
    tensors = source.read_tensors()
    files, eos_id = {}, None
    if source.tokenizer_json is not None:
        files = tokenizer_files(source.tokenizer_json, source.eos_token, source.cfg.max_seq_len)
        eos_id = source.tokenizer().token_to_id(source.eos_token)
    write_model_dir(out, fmt, source.cfg, tensors, dtype=DTYPES[dtype], eos_id=eos_id, source=source.record, files=files)
    return ExportResult(
        out=str(out),
        format=fmt,
        source_kind=source.kind,
        step=source.record.get("step"),
        parameters=sum(t.numel() for t in tensors.values()),
        tokenizer=bool(files),
        source=source.record,
    )


def _export_adapters(step_dir: Path, out: Path, dtype: str) -> ExportResult:
    """A LoRA job's adapters alone, as a PEFT adapter directory for the model it started from."""
    if not is_checkpoint(step_dir):
        raise UserError(f"--format peft: {step_dir} is not a committed checkpoint; adapters come from a checkpoint of a job with model.lora")
    state = committed_state(step_dir)
    if state.lora is None:
        raise UserError(f"--format peft: {step_dir} was trained without model.lora (it holds no adapters); export it as lmforge or hf")
    cfg = config_from_dict(state.model, str(step_dir))
    if cfg.n_experts and {"w1", "w2", "w3"} & set(state.lora.targets):
        raise UserError(
            "--format peft: Hugging Face fuses a mixture of experts' MLPs, which peft cannot target by name; export the merged model (lmforge or hf)"
        )
    record = _checkpoint_source(step_dir).record
    _, tensors, _ = read_trained_tensors(step_dir)
    adapters = {name: tensor for name, tensor in tensors.items() if is_adapter(name)}
    write_peft_dir(out, cfg, state.lora, adapters, DTYPES[dtype], state.init_from)
    return ExportResult(
        out=str(out),
        format="peft",
        source_kind="checkpoint",
        step=state.step,
        parameters=sum(t.numel() for t in adapters.values()),
        tokenizer=False,
        source=record,
    )
