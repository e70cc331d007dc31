"""A teacher cache's manifest.json as a typed record: what the cache holds and what
it was made from (the dataset, its tokenizer, each teacher's weights, k and the
temperature). Written by the cache build, read and checked here only."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ValidationError

from lmforge.checkpoint.store import COMMIT, is_checkpoint
from lmforge.data.columns import TopKTargets
from lmforge.data.manifest import EVAL_DIR, MANIFEST, DatasetManifest, Record, TeacherRecord, read_manifest
from lmforge.distill.config import DistillSpec
from lmforge.errors import UserError, first_error
from lmforge.jsonfile import read_object

FORMAT = "lmforge.teacher-topk.v1"

SERVED = "served"  # a served teacher's record in place of a weight hash


class CachedDataset(Record):
    path: str
    num_samples: int
    seq_len: int
    shard_samples: int
    eval_samples: int = 0

    def describe(self) -> str:
        return f"{self.path}: {self.num_samples} samples of {self.seq_len}+1"


class CacheIdentity(Record):
    """What a cache for a job is made from; a cache whose manifest says otherwise is not
    that job's."""

    dataset: CachedDataset
    tokenizer_sha256: str
    teachers: list[TeacherRecord]
    k: int
    temperature: float
    cross_tokenizer: Optional[str] = None  # the method: its targets are in the student's ids, -1 where none aligned


class CachedHeldOut(BaseModel):
    dir: str = EVAL_DIR
    shards: list[str]


class CacheManifest(CacheIdentity):
    format: Literal["lmforge.teacher-topk.v1"] = FORMAT
    vocab: int
    shards: list[str]  # named as the dataset's
    bytes: int
    bytes_per_token: float
    dense_bf16_bytes_per_token: int
    seconds: float
    eval: Optional[CachedHeldOut] = None


def weights_sha256(path: str | os.PathLike) -> str:
    """A model directory's weight files, or a checkpoint's commit record (which holds
    the checksum of every file it committed), hashed."""
    path = Path(path)
    files = [path / COMMIT] if is_checkpoint(path) else sorted(path.glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def teacher_records(distill: DistillSpec) -> list[TeacherRecord]:
    """Each of the job's teachers (its `distill` section's): path, weight and weight hash;
    a served teacher's URL and model (its weights are the server's: no hash)."""
    if distill.served is not None:
        return [TeacherRecord(path=distill.served.name, weight=1.0, sha256=SERVED)]
    return [TeacherRecord(path=str(s.path), weight=s.weight, sha256=weights_sha256(s.path)) for s in distill.sources]


def made_from(spec, dataset: DatasetManifest) -> CacheIdentity:
    """What a cache for this job is made from."""
    d = spec.distill
    return CacheIdentity(
        dataset=CachedDataset(
            path=str(spec.data.path),
            num_samples=dataset.num_samples,
            seq_len=dataset.seq_len,
            shard_samples=dataset.shard_samples,
            eval_samples=dataset.eval_samples,
        ),
        tokenizer_sha256=dataset.tokenizer.sha256,
        teachers=teacher_records(d),
        k=d.top_k,
        temperature=d.temperature,
        cross_tokenizer=d.cross_tokenizer.method if d.cross_tokenizer else None,
    )


def is_built(cache: str | os.PathLike) -> bool:
    """Whether a complete cache is at `cache` (its manifest is written last)."""
    return (Path(cache) / MANIFEST).is_file()


def write_cache_manifest(directory: Path, manifest: CacheManifest) -> None:
    (directory / MANIFEST).write_text(manifest.model_dump_json(indent=2, exclude_none=True))


def read_cache(spec, dataset: DatasetManifest) -> CacheManifest:
    """The manifest of `distill.cache`, refused (naming the field and what differs)
    unless it was made from this job's dataset, tokenizer, teachers, k and temperature."""
    path = Path(spec.distill.cache)
    file = path / MANIFEST
    if not file.is_file():
        raise UserError(f"distill.cache: {path} holds no teacher cache ({MANIFEST} missing); build it with `lmforge distill cache JOB`")
    try:
        raw = read_object(file)
    except ValueError as err:
        raise UserError(f"distill.cache: {err}") from None
    if raw.get("format") != FORMAT:
        raise UserError(f"{file}: not an lmforge teacher cache")
    try:
        manifest = CacheManifest.model_validate(raw)
    except ValidationError as err:
        raise UserError(f"{file}: not a readable lmforge teacher cache ({first_error(err)})") from None
    for problem in _differences(manifest, made_from(spec, dataset)):
        raise UserError(f"distill.cache: {path} {problem}; build it again for this job (`lmforge distill cache JOB`)")
    for directory, shards in [(path, manifest.shards), *([(path / manifest.eval.dir, manifest.eval.shards)] if manifest.eval else [])]:
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            raise UserError(f"distill.cache: shard {directory / missing[0]} is missing")
    return manifest


def _differences(have: CacheIdentity, want: CacheIdentity):
    if have.dataset != want.dataset:
        yield f"was built for another dataset ({have.dataset.describe()}, not {want.dataset.describe()})"
    if have.tokenizer_sha256 != want.tokenizer_sha256:
        yield "was built with another tokenizer (its sha256 differs from the dataset's)"
    have_teachers = [(t.path, t.weight) for t in have.teachers]
    if have_teachers != [(t.path, t.weight) for t in want.teachers]:
        yield f"was built from other teachers ({', '.join(f'{p} x {w:g}' for p, w in have_teachers)})"
    for had, wanted in zip(have.teachers, want.teachers):
        if had.sha256 != wanted.sha256:
            yield f"was built from other weights of {had.path} (their sha256 differs)"
    if have.k != want.k:
        yield f"holds the top {have.k}, not distill.top_k {want.k}"
    if have.temperature != want.temperature:
        yield f"was built at temperature {have.temperature}, not distill.temperature {want.temperature}"
    if have.cross_tokenizer != want.cross_tokenizer:
        yield f"was built with distill.cross_tokenizer {have.cross_tokenizer or 'unset'}, not {want.cross_tokenizer or 'unset'}"


def teacher_cache(spec) -> Optional[TopKTargets]:
    """Where the job's top-k targets lie, as checked before launch: `distill.cache`, or
    for an instruction distillation with stored soft targets, the dataset itself (its
    samples carry their teachers' top-k); None without either."""
    d = spec.distill
    if d is not None and d.instruct is not None and d.top_k:
        held = read_manifest(spec.data.path, check_shards=False).eval  # every rank asks: its shards were checked at pre-flight
        return TopKTargets(directory=str(spec.data.path), k=d.top_k, eval_directory=str(Path(spec.data.path) / held.dir) if held else None)
    if not (d and d.cache):
        return None
    manifest = _load(d.cache)
    held_dir = str(Path(d.cache) / manifest.eval.dir) if manifest.eval else None
    return TopKTargets(directory=str(d.cache), k=manifest.k, eval_directory=held_dir)


def cache_params(manifest: CacheManifest) -> dict[str, str]:
    """A teacher cache's manifest as MLflow params: what it holds and was made from."""
    held = {"k": manifest.k, "temperature": manifest.temperature, "vocab": manifest.vocab, "bytes_per_token": manifest.bytes_per_token}
    params = {f"distill.cache.{key}": str(value) for key, value in held.items()}
    params["distill.cache.tokenizer_sha256"] = manifest.tokenizer_sha256
    return params | {"distill.cache.teachers": json.dumps([t.model_dump() for t in manifest.teachers])}


def tracking_params(spec) -> dict[str, str]:
    """What MLflow records of a distillation beyond its spec: each teacher's weight hash
    and, training from a cache, what its manifest says it holds and was made from."""
    if not spec.distill:
        return {}
    params = {"distill.teachers_sha256": ",".join(t.sha256 for t in teacher_records(spec.distill))}
    if not (spec.distill.cache and is_built(spec.distill.cache)):  # not while it is being built
        return params
    return params | cache_params(_load(spec.distill.cache))


def _load(cache: str | os.PathLike) -> CacheManifest:
    """A cache's manifest, once `read_cache` has checked it before launch."""
    return CacheManifest.model_validate(read_object(Path(cache) / MANIFEST))
