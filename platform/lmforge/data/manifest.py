"""A prepared dataset's manifest.json, and a mixture's, as typed records: what the
shards hold and what they were made from. Written by the preparation and the
instruction builder, read and checked here only (`read_manifest`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from lmforge.data import storage
from lmforge.errors import UserError, first_error

MANIFEST = "manifest.json"
EVAL_DIR = "eval"  # the held-out split's shards, inside the dataset directory
PACKED = "lmforge.packed.v1"
MIXTURE = "lmforge.mixture.v1"


class Record(BaseModel):
    # A manifest written by a later lmforge may carry more: read what this one knows.
    model_config = ConfigDict(extra="ignore")


class Shard(Record):
    file: str
    first_sample_id: int
    num_samples: int
    bytes: Optional[int] = None
    sha256: Optional[str] = None


class TokenizerRecord(Record):
    file: str  # beside the manifest; a mixture's names the first source's in full
    sha256: str
    vocab_size: int
    eos_id: int


class HeldOutSplit(Record):
    dir: str = EVAL_DIR
    source: Optional[str] = None
    fraction: Optional[float] = None
    documents: int
    num_samples: int
    corpus_tokens: int
    shards: list[Shard]


class TeacherRecord(Record):
    path: str
    weight: float
    sha256: str


class SoftTargets(Record):
    k: int
    temperature: float


class PromptsRecord(Record):
    uri: str
    sha256: str


class InstructIdentity(Record):
    """Everything an instruction dataset's answers depend on: a rerun keeps the
    answers it has only where this is equal."""

    prompts: PromptsRecord
    teachers: list[TeacherRecord]
    tokenizer_sha256: str
    generate: dict
    eval_fraction: float
    prompts_per_shard: int
    seq_len: int
    soft_targets: Optional[SoftTargets] = None


class InstructCounts(Record):
    prompts: int
    held_out_prompts: int
    prompt_too_long: int
    answers: int
    dropped: dict[str, int]
    kept: int
    answer_tokens: int


class InstructRecord(InstructIdentity):
    select: dict
    counts: InstructCounts


class DatasetManifest(Record):
    format: Literal["lmforge.packed.v1"] = PACKED
    source: Optional[str] = None
    seq_len: int
    num_samples: int
    num_tokens: int
    shard_samples: int
    corpus_tokens: int
    documents: int
    skipped_documents: int
    tokenizer: TokenizerRecord
    shards: list[Shard]
    seconds: float = 0.0
    nodes: Optional[int] = None  # that packed and wrote it
    coordinator_cpu_seconds: Optional[float] = None
    eval: Optional[HeldOutSplit] = None
    instruct: Optional[InstructRecord] = None  # an instruction dataset: the teachers' answers

    @property
    def masked(self) -> bool:
        """Whether its samples learn only some tokens (an instruction dataset's answers)."""
        return self.instruct is not None

    @property
    def eval_samples(self) -> int:
        return self.eval.num_samples if self.eval else 0


class MixtureSource(Record):
    path: str
    weight: float
    manifest: DatasetManifest


class MixtureManifest(Record):
    """What the trainer reads of a mixture (`data.sources`): the shared seq_len and
    tokenizer, and each source's path, weight and manifest."""

    format: Literal["lmforge.mixture.v1"] = MIXTURE
    seq_len: int
    tokenizer: TokenizerRecord
    num_samples: int
    num_tokens: int
    sources: list[MixtureSource]


Manifest = Union[DatasetManifest, MixtureManifest]


def tokenizer_location(data_path: str, manifest: Manifest) -> str:
    """Where the tokenizer.json a prepared dataset's ids come from is (a mixture's
    manifest names it in full)."""
    if isinstance(manifest, MixtureManifest):
        return manifest.tokenizer.file
    return storage.join(str(data_path), manifest.tokenizer.file)


def has_manifest(path: str | Path, field: str = "data.path") -> bool:
    """Whether a prepared dataset is complete at `path` (a directory or a URI)."""
    return storage.exists(storage.join(path, MANIFEST), field)


def write_manifest(directory: str | Path, manifest: DatasetManifest) -> None:
    """Last: on an object store its presence is what marks the dataset complete."""
    storage.write_bytes(storage.join(directory, MANIFEST), manifest.model_dump_json(indent=2, exclude_none=True).encode())


def read_manifest(path: str | Path, field: str = "data.path", check_shards: bool = True) -> DatasetManifest:
    """A prepared dataset's manifest, its shards checked against the files there
    (unless only its record is wanted); `UserError` names the file."""
    manifest_path = storage.join(path, MANIFEST)
    if not storage.exists(manifest_path, field):
        raise UserError(f"{field}: {path} holds no prepared dataset ({MANIFEST} missing); set data.source to prepare one")
    raw = storage.read_json(manifest_path, field)
    if raw.get("format") != PACKED or not raw.get("shards"):
        raise UserError(f"{manifest_path}: not an lmforge dataset manifest")
    try:
        manifest = DatasetManifest.model_validate(raw)
    except ValidationError as err:
        raise UserError(f"{manifest_path}: not a readable lmforge dataset manifest ({first_error(err)})") from None
    if not check_shards:
        return manifest
    _check_shards(str(path), manifest_path, manifest.shards, manifest.shard_samples, field)
    if manifest.eval is not None:
        _check_shards(storage.join(path, manifest.eval.dir), manifest_path, manifest.eval.shards, manifest.shard_samples, field)
    return manifest


def _check_shards(directory: str, manifest_path: str, shards: list[Shard], size: int, field: str) -> None:
    present = storage.file_sizes(directory, field)
    for index, shard in enumerate(shards):
        if shard.file not in present:
            raise UserError(f"{manifest_path}: shard {storage.join(directory, shard.file)} is missing")
        if shard.bytes is not None and present[shard.file] != shard.bytes:
            raise UserError(
                f"{manifest_path}: shard {storage.join(directory, shard.file)} has {present[shard.file]} bytes, the manifest "
                f"says {shard.bytes}: it was replaced or damaged since it was prepared; prepare the dataset again"
            )
        # The feed shuffles whole shards, so every shard but the last is full.
        if shard.first_sample_id != index * size or (shard.num_samples != size and index < len(shards) - 1):
            raise UserError(f"{manifest_path}: shard {shard.file} does not hold samples {index * size}..{(index + 1) * size - 1}")


def mixture_manifest(sources: list, manifests: list[DatasetManifest]) -> MixtureManifest:
    """The mixture of `data.sources` (each with `path` and `weight`), refused with one
    line naming the source when they cannot be read as one stream."""
    first = manifests[0]
    for i, (source, manifest) in enumerate(zip(sources, manifests)):
        where = f"data.sources[{i}].path: {source.path}"
        if manifest.masked:
            raise UserError(f"{where} is an instruction dataset; a mixture blends prepared pretraining datasets")
        if manifest.seq_len != first.seq_len:
            raise UserError(f"{where} has seq_len {manifest.seq_len}, data.sources[0] {first.seq_len}; a mixture needs one")
        if manifest.tokenizer.sha256 != first.tokenizer.sha256:
            raise UserError(f"{where} was tokenized with another tokenizer than data.sources[0] ({sources[0].path}); a mixture needs one")
    return MixtureManifest(
        seq_len=first.seq_len,
        tokenizer=first.tokenizer.model_copy(update={"file": storage.join(sources[0].path, first.tokenizer.file)}),
        num_samples=sum(m.num_samples for m in manifests),
        num_tokens=sum(m.num_tokens for m in manifests),
        sources=[MixtureSource(path=str(s.path), weight=s.weight, manifest=m) for s, m in zip(sources, manifests)],
    )
