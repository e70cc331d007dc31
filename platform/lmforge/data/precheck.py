"""What `data prepare` can refuse before Ray starts and before anything is written:
the sequence length, the source and the held-out source (there, supported, their
text column, large enough for one sample), the held-out share, and a given
tokenizer (readable, an end-of-document token, a vocabulary the model can hold).
Messages name the flag the user typed, or else the job field.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from lmforge.data import storage
from lmforge.data.corpus import list_files, source_kind
from lmforge.data.manifest import has_manifest
from lmforge.data.tokenizer import beyond_the_model, end_of_text_token, eos_id, load_tokenizer
from lmforge.errors import UserError

JOB_FIELDS = {
    "source": "data.source",
    "seq_len": "train.seq_len",
    "tokenizer": "data.tokenizer",
    "text_column": "data.text_column",
    "eval_fraction": "data.eval_fraction",
    "eval_source": "eval.source",
    "out": "data.path",
    "shard_samples": "data.shard_samples",
    "vocab_size": "data.vocab_size",
}
FLAGS = {
    "source": "--source",
    "seq_len": "--seq-len",
    "tokenizer": "--tokenizer",
    "text_column": "--text-column",
    "eval_fraction": "--eval-fraction",
    "eval_source": "--eval-source",
    "out": "--out",
    "shard_samples": "--shard-samples",
    "vocab_size": "--vocab-size",
}
MIN_VOCAB = 257
RECORDS_CHECKED = 16  # files whose first record must hold the text column
FIRST_RECORD_BYTES = 1 << 20


def check_before_ray(opts) -> tuple[list[str], list[str]]:
    """Refuse what would fail later (`opts`: PrepareOptions); returns the files of the
    source and of the held-out source (none without one)."""
    name = opts.name
    if opts.seq_len <= 0:
        raise UserError(f"{name('seq_len')}: must be > 0, got {opts.seq_len}")
    if not 0 <= opts.eval_fraction < 1:
        raise UserError(f"{name('eval_fraction')}: a share of the documents, at least 0 and below 1; got {opts.eval_fraction}")
    if opts.eval_fraction and opts.eval_source:
        raise UserError(f"{name('eval_source')}: a separate held-out corpus and {name('eval_fraction')} both make the held-out split; keep one")
    if opts.shard_samples <= 0:
        raise UserError(f"{name('shard_samples')}: must be > 0, got {opts.shard_samples}")
    if not opts.tokenizer and opts.vocab_size < MIN_VOCAB:
        raise UserError(
            f"{name('vocab_size')}: the BPE trained here needs at least {MIN_VOCAB} tokens (256 bytes and end-of-document), got {opts.vocab_size}"
        )
    storage.check_bucket(opts.out, name("out"))
    if has_manifest(opts.out, name("out")):
        raise UserError(f"{name('out')}: {opts.out} already holds a prepared dataset; remove it or choose another")
    storage.require_empty(opts.out, name("out"))
    files = _check_source(opts.source, opts, name("source"), name("text_column"))
    eval_files = _check_source(opts.eval_source, opts, name("eval_source"), name("text_column")) if opts.eval_source else []
    if opts.tokenizer:
        with _named("data.tokenizer", name("tokenizer")):
            tokenizer = load_tokenizer(opts.tokenizer)
            eos_id(tokenizer, end_of_text_token(opts.tokenizer))
        beyond = opts.model_vocab_size is not None and beyond_the_model(tokenizer, opts.model_vocab_size)
        if beyond:
            raise UserError(f"{name('tokenizer')}: {opts.tokenizer} {beyond} (model.vocab_size)")
    return files, eval_files


def _check_source(source: str, opts, source_name: str, column_name: str) -> list[str]:
    with _named("data.source", source_name):
        files = list_files(source)
        kind = source_kind(files)
    if kind != "text":
        _check_text_column(files[:RECORDS_CHECKED], kind, opts.text_column, column_name, source_name)
    _check_large_enough(files, kind, opts.seq_len, source_name)
    return files


@contextmanager
def _named(field: str, name: str):
    """The shared readers name the job field; say the flag instead when one was typed."""
    try:
        yield
    except UserError as err:
        message = str(err)
        raise UserError(name + message[len(field) :] if message.startswith(field + ":") else message) from None


def _check_text_column(files: list[str], kind: str, column: str, name: str, source_name: str) -> None:
    for path in files:
        fs, inner = pafs.FileSystem.from_uri(path)  # list_files gives URIs or absolute paths
        if kind == "parquet":
            try:
                names = pq.read_schema(inner, filesystem=fs).names
            except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a file that is not Parquet
                raise UserError(f"{source_name}: {path} is not a readable Parquet file ({err})") from None
        else:
            with fs.open_input_stream(inner) as stream:
                head = stream.read(FIRST_RECORD_BYTES)
            lines = [line for line in head.decode("utf-8", errors="replace").split("\n") if line.strip()]
            if not lines or (b"\n" not in head and len(head) == FIRST_RECORD_BYTES):
                continue  # empty (no documents), or a first record too long to judge here: Ray Data's read checks it
            try:
                record = json.loads(lines[0])
            except json.JSONDecodeError as err:
                raise UserError(f"{source_name}: the first record of {path} is not JSON ({err.msg})") from None
            names = sorted(record) if isinstance(record, dict) else []
        if column not in names:
            raise UserError(f"{name}: {column!r} is not a field of {path} (it has {names})")


def _check_large_enough(files: list[str], kind: str, seq_len: int, name: str) -> None:
    """A token covers at least one byte, and each document adds one end-of-document
    token (a JSON record takes more than one byte): fewer bytes than that bound
    allows cannot make one sample. Parquet is compressed, and remote sizes cost a
    request each: both are left to the count after tokenizing."""
    if kind == "parquet" or any("://" in path for path in files):
        return
    size = sum(Path(path).stat().st_size for path in files)
    most_tokens = size + (len(files) if kind == "text" else size)
    if most_tokens < seq_len + 1:
        raise UserError(
            f"{name}: {files[0] if len(files) == 1 else 'the corpus'} holds {size} bytes, fewer than one "
            f"sample of seq_len+1 = {seq_len + 1} tokens could be made of; the corpus is empty or too small"
        )
