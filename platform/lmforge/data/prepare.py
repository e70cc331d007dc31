"""`lmforge data prepare`: a corpus becomes a prepared dataset (Parquet shards of
packed samples and a manifest) through `data.prepare_task`, which runs as a task on the
cluster; this side checks the input before Ray starts, shows progress, and reads
manifests back.
"""

from __future__ import annotations

from contextlib import nullcontext

import ray
from rich.progress import Progress, TimeElapsedColumn

from lmforge.console import text_column
from lmforge.data.manifest import DatasetManifest
from lmforge.data.precheck import check_before_ray
from lmforge.data.prepare_options import PrepareOptions
from lmforge.data.prepare_task import Prepared, run_pipeline
from lmforge.errors import UserError


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
