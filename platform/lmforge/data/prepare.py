"""`lmforge data prepare`: a corpus becomes a prepared dataset (Parquet shards of
packed samples and a manifest) through `data.pipeline`, which runs as a task on the
cluster; this side checks the input before Ray starts, shows progress, and reads
manifests back.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import ray
from rich.progress import Progress, TimeElapsedColumn

from lmforge.console import text_column
from lmforge.data.manifest import DatasetManifest
from lmforge.data.precheck import JOB_FIELDS, check_before_ray
from lmforge.data.prepare_task import Prepared, run_pipeline
from lmforge.errors import UserError


@dataclass
class PrepareOptions:
    source: str
    out: str
    seq_len: int
    tokenizer: Optional[str] = None
    vocab_size: int = 8192
    text_column: str = "text"
    shard_samples: int = 256
    eval_fraction: float = 0.0  # documents of `source` held out of training
    eval_source: Optional[str] = None  # or: a corpus of its own as the held-out split
    show_progress: bool = True
    model_vocab_size: Optional[int] = None  # the tokenizer's vocabulary must fit the model's
    names: dict = field(default_factory=dict)  # option -> the flag the user typed, for messages
    skipped: int = field(default=0, init=False)

    @classmethod
    def for_job(cls, spec, **given) -> "PrepareOptions":
        """The job's data section (and `given` values, e.g. from flags)."""
        if spec.data.sources is not None:
            raise UserError(
                "data.sources: a mixture blends datasets prepared already; prepare each with "
                "`lmforge data prepare --source CORPUS --out PATH --seq-len N`"
            )
        values = {
            "source": spec.data.source,
            "out": spec.data.path,
            "seq_len": spec.train.seq_len,
            "tokenizer": spec.data.tokenizer or _model_tokenizer(spec),
            "vocab_size": spec.data.vocab_size,
            "text_column": spec.data.text_column,
            "shard_samples": spec.data.shard_samples,
            "eval_fraction": spec.data.eval_fraction,
            "eval_source": spec.eval.source if spec.eval else None,
            "model_vocab_size": spec.model_arch.vocab_size,
        }
        return cls(**values | {key: value for key, value in given.items() if value is not None})

    def name(self, key: str) -> str:
        """What the user typed for option `key`: its flag, or else its job field."""

        return self.names.get(key, JOB_FIELDS[key])


def _model_tokenizer(spec) -> Optional[str]:
    """The tokenizer.json of the model the job starts from (`model.init_from`), or of
    its (first) teacher, if the directory has one."""
    teachers = [t.path for t in spec.distill.sources] if spec.distill else []
    for directory in (spec.model.init_from, *teachers):
        found = directory and Path(directory) / "tokenizer.json"
        if found and found.is_file():
            return str(found)
    return None


def prepare_dataset(opts: PrepareOptions) -> DatasetManifest:
    """Check the input, then run the pipeline on the cluster, beside this process (the
    same filesystem), showing its progress; returns the manifest. Requires an
    initialized Ray session."""
    files, eval_files = check_before_ray(opts)
    here = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    run = run_pipeline.options(scheduling_strategy=here).remote(opts, files, eval_files)
    tasks: dict[str, object] = {}
    try:
        with _progress(opts.show_progress) as progress:
            for ref in run:
                update = ray.get(ref)
                if isinstance(update, Prepared):
                    manifest = update.manifest
                elif progress is not None:
                    if update.phase not in tasks:
                        tasks[update.phase] = progress.add_task(update.phase, total=None, tokens=0, mb_per_s=0.0)
                    progress.update(tasks[update.phase], advance=update.documents, tokens=update.tokens, mb_per_s=update.mb_per_s)
    except ray.exceptions.RayTaskError as err:
        raise (err.cause if isinstance(err.cause, UserError) else err) from None
    except KeyboardInterrupt:
        ray.cancel(run)  # the pipeline removes what it wrote
        raise
    opts.skipped = manifest.skipped_documents
    return manifest


def _progress(enabled: bool):
    if not enabled:
        return nullcontext()  # enters as None: no bar
    return Progress(
        text_column("{task.description}", bold=True),
        text_column("{task.completed:,.0f} documents"),
        text_column("{task.fields[tokens]:,} tokens"),
        text_column("{task.fields[mb_per_s]:.1f} MB/s of text"),
        TimeElapsedColumn(),
    )
