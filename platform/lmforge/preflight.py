"""Pre-flight: everything about a job that can be checked before any cluster work.

The dataset (prepared, or a source to prepare; its held-out split for `eval`),
vocabulary and sequence length against the model, the estimated memory against
`resources.memory_per_worker`, the checkpoint directory and what it already holds
(a resume must continue the same model, batch, engine and data order). A job that
cannot run stops here with one message naming the field or file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer

from lmforge.checkpoint.export import open_source
from lmforge.checkpoint.store import CheckpointStore, CheckpointUnreadable, CommittedCheckpoint
from lmforge.data import storage
from lmforge.data.heldout import check_held_out
from lmforge.data.identity import describe, order_changes, order_inputs
from lmforge.data.manifest import (
    MANIFEST,
    DatasetManifest,
    Manifest,
    MixtureManifest,
    has_manifest,
    mixture_manifest,
    read_manifest,
    tokenizer_location,
)
from lmforge.data.precheck import check_before_ray
from lmforge.data.prepare_options import PrepareOptions
from lmforge.data.tokenizer import load_tokenizer
from lmforge.distill.cache_manifest import is_built, read_cache
from lmforge.distill.cross_tokenizer import TokenAligner, aligned_share
from lmforge.distill.served_teacher import ServedTeacher
from lmforge.errors import UserError
from lmforge.models.weights import open_model_dir
from lmforge.planner.fit import check_fits
from lmforge.spec import JobSpec
from lmforge.spec_rules import check_hidden_layers
from lmforge.tracking.tensorboard import check_tensorboard


@dataclass
class Plan:
    spec: JobSpec
    manifest: Optional[Manifest]  # None: the dataset must be prepared from data.source first
    resume_from: Optional[CommittedCheckpoint]
    order_changes: dict = field(default_factory=dict)  # allowed by checkpoint.allow_data_change

    @property
    def start_step(self) -> int:
        return self.resume_from.step if self.resume_from else 0


def check_dataset(spec: JobSpec, manifest: Manifest) -> None:
    path = storage.join(spec.data.path, MANIFEST) if spec.data.path else "data.sources"
    if manifest.seq_len != spec.train.seq_len:
        raise UserError(f"train.seq_len: {spec.train.seq_len} does not match the dataset's seq_len {manifest.seq_len} ({path})")
    vocab = manifest.tokenizer.vocab_size
    if vocab > spec.model_arch.vocab_size:
        raise UserError(f"model.vocab_size: {spec.model_arch.vocab_size} is smaller than the tokenizer's vocabulary ({vocab}) in {path}")
    if manifest.num_samples < spec.train.global_batch:
        raise UserError(f"train.global_batch: {spec.train.global_batch} exceeds the dataset's {manifest.num_samples} samples ({path})")
    if isinstance(manifest, DatasetManifest):
        check_held_out(spec, manifest, spec.data.path)


def latest_checkpoint(store: CheckpointStore) -> Optional[CommittedCheckpoint]:
    try:
        return store.latest()
    except CheckpointUnreadable as err:
        raise UserError(f"checkpoint.dir: could not read {err}; nothing was changed, try again once the storage answers") from None


def check_fresh_start(spec: JobSpec, store: CheckpointStore) -> None:
    """`checkpoint.resume: false` starts at step 0, and a fresh start never writes over
    committed checkpoints silently: the user resumes, moves elsewhere, or discards them."""
    if spec.checkpoint.resume or spec.checkpoint.discard_existing:
        return
    steps = store.committed()
    if steps:
        raise UserError(
            f"checkpoint.dir: {spec.checkpoint_dir} holds {len(steps)} committed checkpoints (steps {steps[0]}..{steps[-1]}) "
            "and checkpoint.resume is false: resume them (checkpoint.resume: true), give another checkpoint.dir, "
            "or set checkpoint.discard_existing: true to delete them"
        )


def check_resume(spec: JobSpec, ckpt: CommittedCheckpoint) -> None:
    state = ckpt.state
    saved_job = state.job
    if saved_job and saved_job != spec.name:
        raise UserError(
            f"checkpoint.dir: {ckpt.path} was written by job {saved_job}, not {spec.name}; "
            "give this job a checkpoint directory of its own (or its init_from a checkpoint to start from)"
        )
    saved_model = state.model
    if saved_model and saved_model != spec.model_arch.as_dict():
        changed = sorted(k for k in saved_model if saved_model.get(k) != spec.model_arch.as_dict().get(k))
        raise UserError(f"checkpoint.dir: {ckpt.path} holds a model of a different shape (differs in {', '.join(changed)})")
    if state.global_batch != spec.train.global_batch:
        raise UserError(
            f"train.global_batch: {spec.train.global_batch} differs from the {state.global_batch} "
            f"the checkpoint {ckpt.path} was trained with; the data order would not continue exactly"
        )
    saved_format, wanted = state.format, "deepspeed" if spec.engine == "deepspeed" else "dcp"
    if saved_format != wanted:
        raise UserError(f"engine: {spec.engine} cannot resume {ckpt.path}, a {saved_format} checkpoint of the other engine")
    if ckpt.step > spec.train.max_steps:
        raise UserError(f"train.max_steps: {spec.train.max_steps} is before the latest checkpoint's step {ckpt.step}")


def check_resume_order(spec: JobSpec, manifest: Manifest, ckpt: CommittedCheckpoint) -> dict[str, list]:
    """The order inputs that changed since the checkpoint ({input: [saved, now]}),
    allowed only by `checkpoint.allow_data_change`: otherwise "exactly where it
    stopped" would go on in a different order without a word."""
    changes = order_changes(ckpt.state.order, order_inputs(spec, manifest))
    if changes and not spec.checkpoint.allow_data_change:
        key, (saved, now) = next(iter(changes.items()))
        raise UserError(
            f"{describe(key, saved, now)} ({ckpt.path}); the data order would not continue exactly "
            "(checkpoint.allow_data_change: true resumes on the new order)"
        )
    return changes


def check_init_from(spec: JobSpec, manifest: Optional[Manifest]) -> None:
    """The directory's weights are whole and of the job's shape; a dataset for a model
    that brings its tokenizer was tokenized with that vocabulary."""
    try:
        model_dir = open_model_dir(spec.model.init_from)
    except ValueError as err:
        raise UserError(f"model.init_from: {err}") from None
    saved, wanted = model_dir.cfg.as_dict(), spec.model_arch.as_dict()
    changed = sorted(k for k in wanted if saved.get(k) != wanted[k])
    if changed:
        raise UserError(f"model.init_from: {spec.model.init_from} holds a model of a different shape (differs in {', '.join(changed)})")
    dataset_tokenizer = _dataset_tokenizer(spec, manifest)
    if dataset_tokenizer and model_dir.tokenizer_file is not None:
        if _vocabulary(dataset_tokenizer) != _vocabulary(model_dir.tokenizer_file):
            raise UserError(
                f"data.path: {spec.data.path or dataset_tokenizer} was tokenized with another vocabulary than model.init_from's "
                f"{model_dir.tokenizer_file}; prepare the dataset with data.tokenizer: {model_dir.tokenizer_file}"
            )


def _dataset_tokenizer(spec: JobSpec, manifest: Optional[Manifest]) -> Optional[str]:
    """The dataset's tokenizer.json, or the one preparing it will use (None: a BPE trained then)."""
    if manifest is not None:
        return tokenizer_location(spec.data.path, manifest)
    return PrepareOptions.for_job(spec).tokenizer


def _vocabulary(tokenizer) -> dict:
    """The token -> id map of a tokenizer.json path, or of a loaded tokenizer."""
    return (load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer).get_vocab()


def check_distill(spec: JobSpec, manifest: Optional[DatasetManifest]) -> None:
    """The teachers can teach this student, and a teacher cache it names (or the
    instruction dataset it trains on) is this job's; a teacher served to train straight
    from answers now."""
    check_teachers(spec, manifest)
    if spec.distill.served is not None and spec.distill.cache is None:
        ServedTeacher.of(spec.distill.served, spec.distill.top_k).check()
    if spec.distill.instruct is not None:
        check_instruct_dataset(spec, manifest)
    elif manifest is not None and manifest.masked and spec.distill.hidden is not None:
        raise UserError(
            f"distill.hidden: {spec.data.path} is an instruction dataset, whose loss mask hidden-state distillation does not take; distill its logits"
        )
    if spec.distill.cache:
        if manifest is None:
            raise UserError(
                f"distill.cache: {spec.data.path} is not prepared yet, so no cache can match it; "
                "prepare the data (lmforge data prepare JOB), then build the cache (lmforge distill cache JOB)"
            )
        read_cache(spec, manifest)


def check_teachers(spec: JobSpec, manifest: Optional[DatasetManifest], tokenizer=None) -> None:
    """Every teacher opens, shares the dataset's tokenizer (or `tokenizer`, an instruction
    distillation's), and splits as the student does. A served teacher's are the server's
    to know: `lmforge distill cache` asks it before scoring."""
    if spec.distill.served is not None:
        return
    dataset_tokenizer = tokenizer or _dataset_tokenizer(spec, manifest)
    if spec.distill.cross_tokenizer is not None:
        for number, source in enumerate(spec.distill.sources):
            name = "distill.teacher" if spec.distill.teacher else f"distill.teachers[{number}]"
            _check_alignment(open_source(source.path, name=name), name, dataset_tokenizer, _sample_rows(spec, manifest))
        return
    if dataset_tokenizer is None:
        raise UserError(
            "data.tokenizer: not set, so preparing the data would train a new BPE, not the teacher's tokenizer; "
            "set it to the teacher's tokenizer.json"
        )
    vocabulary = _vocabulary(dataset_tokenizer)
    for number, source in enumerate(spec.distill.sources):
        name = "distill.teacher" if spec.distill.teacher else f"distill.teachers[{number}]"
        _check_teacher(spec, open_source(source.path, name=name), name, vocabulary, dataset_tokenizer)


# Below this share of the student's tokens with a teacher position, the pair does not
# read the text alike (a byte-level and a word-level vocabulary; another normalization).
MIN_ALIGNED_SHARE = 0.25
PROBE_TEXT = "The student's text, as the teacher reads it: 42 tokens, café, naïve.\ndef f(x):\n    return x + 1\n"


def _check_alignment(teacher, name: str, dataset_tokenizer, rows: list[list[int]]) -> None:
    """`distill.cross_tokenizer`: the teacher reads the student's text through its own
    tokenizer, and the two end tokens at the same characters often enough to learn from.
    Unknown before a new BPE is trained for the data (a byte-level one reads any text)."""
    if teacher.tokenizer_json is None:
        raise UserError(f"{name}: {teacher.path} has no tokenizer to read the student's text with (lmforge export --tokenizer ships one)")
    if dataset_tokenizer is None:
        return
    student = (
        dataset_tokenizer
        if not isinstance(dataset_tokenizer, (str, Path))
        else Tokenizer.from_str(storage.read_text(str(dataset_tokenizer), "data.tokenizer"))
    )
    rows = rows or [student.encode(PROBE_TEXT, add_special_tokens=False).ids]
    share = aligned_share(TokenAligner(student, teacher.tokenizer()), rows)
    if share < MIN_ALIGNED_SHARE:
        raise UserError(
            f"{name}: its tokenizer ({teacher.path}) and the student's end a token at the same character at only {share:.0%} of "
            f"{sum(map(len, rows))} sample tokens (distill.cross_tokenizer needs {MIN_ALIGNED_SHARE:.0%}): they do not read the text alike"
        )


def _sample_rows(spec: JobSpec, manifest: Optional[DatasetManifest], rows: int = 8) -> list[list[int]]:
    """The dataset's first rows of tokens (none before it is prepared)."""
    if manifest is None or not isinstance(manifest, DatasetManifest) or not manifest.shards:
        return []
    table = storage.read_parquet([storage.join(spec.data.path, manifest.shards[0].file)], ["tokens"])
    return table.slice(0, rows).column("tokens").to_pylist()


def _check_teacher(spec: JobSpec, teacher, name: str, vocabulary: dict, dataset_tokenizer: str) -> None:
    if teacher.tokenizer_json is None:
        raise UserError(
            f"{name}: {teacher.path} has no tokenizer to compare with the dataset's; teacher and student must share one "
            "(lmforge export --tokenizer ships one)"
        )
    if _vocabulary(teacher.tokenizer()) != vocabulary:
        theirs = "the first teacher's" if not isinstance(dataset_tokenizer, (str, Path)) else f"the dataset's ({dataset_tokenizer})"
        raise UserError(f"{name}: its tokenizer ({teacher.path}) is not {theirs}; teacher and student must share one")
    tp = spec.parallel.tp
    online = spec.distill.online  # from a cache, or an instruction distillation's answers, no teacher is built, so none is split
    if online and tp > 1 and teacher.cfg.vocab_size != spec.model_arch.vocab_size:
        raise UserError(
            f"{name}: its vocab_size {teacher.cfg.vocab_size} differs from model.vocab_size {spec.model_arch.vocab_size}; "
            "with parallel.tp > 1 an online teacher's vocabulary is split like the student's, so they must be equal "
            "(an offline cache, distill.cache, has no such limit)"
        )
    if online and tp > 1 and (teacher.cfg.n_kv_heads % tp or teacher.cfg.n_heads % tp):
        raise UserError(f"{name}: its {teacher.cfg.n_heads} heads ({teacher.cfg.n_kv_heads} key/value) do not split over parallel.tp {tp}")
    if spec.distill.hidden is not None:
        try:
            check_hidden_layers(spec.distill.hidden.layers, teacher.cfg.n_layers, "teacher", "values")
        except ValueError as err:
            raise UserError(f"{err} ({teacher.path})") from None


def check_instruct_dataset(spec: JobSpec, manifest: Optional[DatasetManifest]) -> None:
    """`data.path` holds the answers of this job's teachers, with the soft targets its
    KD term learns (the same k and temperature)."""
    made = manifest.instruct if manifest else None
    if made is None:
        raise UserError(
            f"data.path: {spec.data.path} is not an instruction dataset (no answers to learn); write one with "
            "`lmforge distill generate JOB` into another data.path"
        )
    d = spec.distill
    if [(t.path, t.weight) for t in made.teachers] != [(str(s.path), s.weight) for s in d.sources]:
        raise UserError(
            f"data.path: {spec.data.path} holds answers of other teachers ({', '.join(t.path for t in made.teachers)}); "
            "generate it again for this job's, or name those"
        )
    stored = made.soft_targets
    if d.top_k and stored is None:
        raise UserError(
            f"distill.top_k: {spec.data.path} holds no soft targets (it was generated without distill.top_k); "
            "generate it again with top_k, or remove top_k and set kd_weight: 0"
        )
    if d.top_k and stored is not None and (stored.k, stored.temperature) != (d.top_k, d.temperature):
        raise UserError(
            f"distill.top_k: {spec.data.path} holds the teachers' top {stored.k} at temperature {stored.temperature:g}, "
            f"not top_k {d.top_k} at distill.temperature {d.temperature:g}; generate it again, or match them"
        )


def check_deepspeed(spec: JobSpec) -> None:
    if "://" in spec.checkpoint_dir:
        raise UserError(f"checkpoint.dir: the deepspeed engine writes checkpoints to a filesystem path, not {spec.checkpoint_dir}")
    if spec.train.precision == "fp16" and spec.resources.gpus_per_worker == 0 and not cpu_supports_fp16():
        raise UserError("train.precision: fp16 on CPU ranks needs AVX512-FP16, which this machine lacks; use bf16 or fp32")


def cpu_supports_fp16() -> bool:
    """What DeepSpeed's CPU accelerator asks before it agrees to fp16."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def read_mixture(spec: JobSpec) -> MixtureManifest:
    """The mixture's manifest (`data.sources`), each source's read and checked."""
    manifests = [read_manifest(source.path, f"data.sources[{i}].path") for i, source in enumerate(spec.data.sources)]
    return mixture_manifest(spec.data.sources, manifests)


def preflight(spec: JobSpec) -> Plan:
    manifest = None
    if spec.data.sources is not None:
        manifest = read_mixture(spec)
        check_dataset(spec, manifest)
    elif has_manifest(spec.data.path):
        manifest = read_manifest(spec.data.path)
        check_dataset(spec, manifest)
    elif spec.distill is not None and spec.distill.instruct is not None:
        raise UserError(
            f"data.path: {spec.data.path} holds no instruction dataset yet; write it with `lmforge distill generate JOB` "
            "(the teachers answer distill.instruct.prompts)"
        )
    elif spec.data.source is None:
        raise UserError(f"data.path: {spec.data.path} holds no prepared dataset and data.source is not set")
    else:
        check_before_ray(PrepareOptions.for_job(spec))  # the source and tokenizer, before a cluster starts
        if spec.eval is not None and not (spec.data.eval_fraction or spec.eval.source):
            raise UserError("eval: measures a held-out split, and preparing data.source makes none; set data.eval_fraction or eval.source")
        if spec.data.tokenizer is None and spec.data.vocab_size > spec.model_arch.vocab_size:
            raise UserError(f"data.vocab_size: {spec.data.vocab_size} is larger than model.vocab_size {spec.model_arch.vocab_size}")
    if spec.engine == "deepspeed":
        check_deepspeed(spec)
    if spec.tracking.tensorboard:
        check_tensorboard(spec.tracking.tensorboard)
    if spec.resources.memory_per_worker:
        check_fits(spec, spec.resources.memory_per_worker, "resources.memory_per_worker")
    if spec.model.init_from:
        check_init_from(spec, manifest)
    if spec.distill:
        check_distill(spec, manifest if isinstance(manifest, DatasetManifest) else None)  # a mixture is not distilled (spec rules)
    store = CheckpointStore(spec.checkpoint_dir)
    store.check_usable()
    check_fresh_start(spec, store)
    ckpt = latest_checkpoint(store) if spec.checkpoint.resume else None
    changes = {}
    if ckpt is not None:
        check_resume(spec, ckpt)
        if manifest is not None:
            changes = check_resume_order(spec, manifest, ckpt)
    return Plan(spec=spec, manifest=manifest, resume_from=ckpt, order_changes=changes)


def check_cache_build(spec: JobSpec) -> None:
    """`lmforge distill cache`, before anything starts: the job names where the cache
    goes, nothing is there yet, and a served teacher answers with its top-k."""
    if spec.distill is None:
        raise UserError("distill: the job has no distill section, so no teacher to cache")
    if not spec.distill.cache:
        raise UserError("distill.cache: not set; name the directory the teacher cache goes to")
    if is_built(spec.distill.cache):
        raise UserError(f"distill.cache: {spec.distill.cache} already holds a teacher cache; remove it or choose another path")
    if spec.distill.served is not None:
        ServedTeacher.of(spec.distill.served, spec.distill.top_k).check()


def check_generation(spec: JobSpec) -> None:
    """`lmforge distill generate`, before anything starts: the job names prompts, and
    its data.path holds no dataset yet."""
    if spec.distill is None or spec.distill.instruct is None:
        raise UserError("distill.instruct: the job names no prompts to answer; add a distill.instruct section (prompts, generate, select)")
    if has_manifest(spec.data.path):
        raise UserError(f"data.path: {spec.data.path} already holds a dataset; remove it or choose another data.path")
