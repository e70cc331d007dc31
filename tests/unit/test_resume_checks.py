"""A resume is refused when what decides the data order changed since the
checkpoint (seed, shuffle window, shard size, the dataset), unless the job allows it."""

import json

import pytest

from lmforge.checkpoint.state import TrainerState
from lmforge.checkpoint.store import CommittedCheckpoint
from lmforge.data.identity import order_inputs
from lmforge.data.manifest import DatasetManifest, Shard, TokenizerRecord
from lmforge.errors import UserError
from lmforge.preflight import check_resume_order
from lmforge.spec import spec_from_dict

BASE = {"name": "t", "data": {"path": "d"}, "train": {"seed": 3}}


def manifest(num_samples=512, shard_samples=256, tokenizer="aa", shards=("s0", "s1")) -> DatasetManifest:
    return DatasetManifest(
        seq_len=8,
        num_samples=num_samples,
        num_tokens=num_samples * 9,
        shard_samples=shard_samples,
        corpus_tokens=num_samples * 9,
        documents=1,
        skipped_documents=0,
        tokenizer=TokenizerRecord(file="tokenizer.json", sha256=tokenizer, vocab_size=64, eos_id=0),
        shards=[
            Shard(file=f"shard-{i}.parquet", first_sample_id=i * shard_samples, num_samples=shard_samples, sha256=sha) for i, sha in enumerate(shards)
        ],
    )


def checkpoint_of(overrides=(), **dataset) -> CommittedCheckpoint:
    return CommittedCheckpoint(
        step=10, path="ckpt/step_10", state=TrainerState(order=order_inputs(spec_from_dict(BASE, list(overrides)), manifest(**dataset)))
    )


@pytest.mark.parametrize(
    "saved_overrides, saved_dataset, message",
    [
        (["train.seed=4"], {}, "train.seed: 3 differs from the 4 the checkpoint was trained with"),
        (["data.shuffle_window=8"], {}, "data.shuffle_window: 16 differs from the 8"),
        ([], {"shard_samples": 128}, "data.shard_samples: 256 differs from the 128"),
        ([], {"tokenizer": "bb"}, "data.path: the dataset's tokenizer_sha256 aa differs from the bb"),
        ([], {"num_samples": 500}, "data.path: the dataset's num_samples 512 differs from the 500"),
        ([], {"shards": ("s0", "other")}, "data.path: the dataset's shards_sha256"),
    ],
)
def test_a_changed_order_input_is_refused_naming_its_field(saved_overrides, saved_dataset, message):
    ckpt = checkpoint_of(saved_overrides, **saved_dataset)
    with pytest.raises(UserError, match="checkpoint.allow_data_change") as err:
        check_resume_order(spec_from_dict(BASE), manifest(), ckpt)
    assert str(err.value).startswith(message) and "ckpt/step_10" in str(err.value)


def test_an_allowed_change_is_returned_for_the_record():
    spec = spec_from_dict(BASE, ["checkpoint.allow_data_change=true"])
    changes = check_resume_order(spec, manifest(), checkpoint_of(["train.seed=4"], num_samples=500))
    assert changes == {"seed": [4, 3], "num_samples": [500, 512]}


def test_the_same_inputs_and_an_older_checkpoint_pass():
    assert check_resume_order(spec_from_dict(BASE), manifest(), checkpoint_of()) == {}
    older = CommittedCheckpoint(step=10, path="ckpt/step_10", state=TrainerState(global_batch=16))  # written before the order was kept
    assert check_resume_order(spec_from_dict(BASE), manifest(), older) == {}


def test_a_resume_restores_the_lines_its_checkpoint_carries_and_the_run_dir_lacks(tmp_path):
    """A driver killed after step 4 committed but before step 3's and 4's lines arrived:
    the resumed run appends them from the checkpoint, once, and keeps history."""
    from lmforge.tracking.run_dir import RunDir

    run_dir = RunDir(str(tmp_path))
    for step in (1, 2):
        run_dir.append_step({"event": "step", "step": step, "loss": float(step), "sample_ids": [step]})
    run_dir.append_event({"event": "failure", "step": 2, "error": "x"})
    records = [{"event": "step", "step": s, "loss": float(s), "sample_ids": [s]} for s in (1, 2, 3, 4)] + [
        {"event": "eval", "step": 4, "eval_loss": 1.0}
    ]
    run_dir.rewind(4)
    assert run_dir.restore_records(records) == 3
    assert run_dir.restore_records(records) == 0
    assert [row["step"] for row in run_dir.steps()] == [1, 2, 3, 4]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row.get("event") for row in lines] == [None, None, "failure", None, None, "eval"]
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
