"""Raw corpora as Ray Datasets of documents: text files, JSONL, Parquet, or the
built-in `builtin:python-stdlib` (this interpreter's standard library sources).

Every reader yields a `text` column and a `bad` flag for documents that could not
be decoded, so the pipeline can count and skip them instead of crashing.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import ray

from lmforge.errors import UserError

BUILTIN_STDLIB = "builtin:python-stdlib"
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text"}
JSON_SUFFIXES = {".jsonl", ".json"}
PARQUET_SUFFIXES = {".parquet"}


def stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(str(p) for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def list_files(source: str) -> list[str]:
    """Expand a file, directory, glob-free URI or the builtin name into a sorted file list."""
    if source == BUILTIN_STDLIB:
        return stdlib_files()
    if source.startswith("builtin:"):
        raise UserError(f"data.source: unknown built-in corpus {source!r}; available: {BUILTIN_STDLIB}")
    try:
        fs, path = pafs.FileSystem.from_uri(source) if "://" in source else (pafs.LocalFileSystem(), str(Path(source).resolve()))
        info = fs.get_file_info(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for bad URIs
        raise UserError(f"data.source: cannot open {source} ({err})") from None
    prefix = source.split("://")[0] + "://" if "://" in source else ""
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"data.source: {source} does not exist")
    if info.type == pafs.FileType.File:
        files = [path]
    else:
        selector = pafs.FileSelector(path, recursive=True)
        files = sorted(i.path for i in fs.get_file_info(selector) if i.type == pafs.FileType.File and not Path(i.path).name.startswith("."))
    files = [prefix + f if prefix and not f.startswith(prefix) else f for f in files]
    if not files:
        raise UserError(f"data.source: {source} is empty")
    return files


def _decode(batch: pa.Table) -> pa.Table:
    """Bytes -> text as Arrow strings (checked as UTF-8 by Arrow; row by row only when
    a batch holds a file that is not). Arrow, not numpy: numpy turns a batch of long
    strings into one fixed-width array as wide as the longest, which costs seconds."""
    raw = batch.column("bytes")
    try:
        return pa.table({"text": pc.cast(raw, pa.large_string()), "bad": pa.array(np.zeros(len(raw), dtype=bool))})
    except pa.ArrowInvalid:
        pass
    texts, bad = [], []
    for data in raw.to_pylist():
        try:
            texts.append(data.decode("utf-8"))
            bad.append(False)
        except UnicodeDecodeError:
            texts.append("")
            bad.append(True)
    return pa.table({"text": pa.array(texts, type=pa.large_string()), "bad": pa.array(bad)})


def source_kind(files: list[str]) -> str:
    """`text`, `json` or `parquet`; a `UserError` for anything else or a mix."""
    suffixes = {Path(f).suffix.lower() for f in files}
    for kind, known in (("text", TEXT_SUFFIXES), ("json", JSON_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if suffixes <= known:
            return kind
    raise UserError(f"data.source: mixed or unsupported file types {sorted(suffixes)}; use text files (.txt/.md/.py), JSON lines (.jsonl) or Parquet")


def parquet_dataset(files: list[str], **options) -> ray.data.Dataset:
    """`ray.data.read_parquet` through Ray Data's first Parquet datasource: the second
    (Ray 2.60's default) starts a few footer-reading actors for every read, a process
    and ~1.5 CPU-seconds each, where the first reads the footers in its read tasks."""
    context = ray.data.DataContext.get_current()
    chosen, context.use_datasource_v2 = context.use_datasource_v2, False
    try:
        return ray.data.read_parquet(files, **options)
    finally:
        context.use_datasource_v2 = chosen


def read_documents(files: list[str], text_column: str, num_cpus: float = 0.25) -> ray.data.Dataset:
    """One document per text file, per JSON line, or per Parquet row, in file order
    (`num_cpus` a task: a map asking for as many fuses with the read)."""
    kind = source_kind(files)
    if kind == "text":
        raw = ray.data.read_binary_files(files, num_cpus=num_cpus)
        return raw.map_batches(_decode, batch_format="pyarrow", num_cpus=num_cpus)
    if kind == "json":
        ds = ray.data.read_json(files, lines=True, num_cpus=num_cpus)
    else:
        ds = parquet_dataset(files, num_cpus=num_cpus)
    if text_column not in ds.schema().names:
        raise UserError(f"data.text_column: {text_column!r} is not a column of {files[0]} (has {ds.schema().names})")

    def _texts(batch: pa.Table) -> pa.Table:
        values = batch.column(text_column).to_pylist()
        return pa.table(
            {
                "text": pa.array([t if isinstance(t, str) else "" for t in values], type=pa.large_string()),
                "bad": pa.array([not isinstance(t, str) for t in values]),
            }
        )

    return ds.map_batches(_texts, batch_format="pyarrow", num_cpus=num_cpus)
