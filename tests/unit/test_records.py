"""The typed records lmforge writes and reads back: a dataset's manifest (read in one
place, its shards checked, a bad field one line naming the file and the field), a
mixture built from two, and the run summary's JSON (absent extras stay absent)."""

import json

import pytest

from lmforge.data.config import MixtureSource
from lmforge.data.manifest import DatasetManifest, MixtureManifest, Shard, TokenizerRecord, mixture_manifest, read_manifest, write_manifest
from lmforge.errors import UserError
from lmforge.tracking.summary import RunSummary


def dataset(tmp_path, name="d", tokenizer_sha="aa", shards=2, seq_len=8):
    """A dataset directory of `shards` full shards of 4 samples (empty files of the recorded size)."""
    directory = tmp_path / name
    directory.mkdir()
    entries = []
    for index in range(shards):
        (directory / f"shard-{index}.parquet").write_bytes(b"x" * 10)
        entries.append(Shard(file=f"shard-{index}.parquet", first_sample_id=4 * index, num_samples=4, bytes=10, sha256=f"s{index}"))
    manifest = DatasetManifest(
        seq_len=seq_len,
        num_samples=4 * shards,
        num_tokens=4 * shards * (seq_len + 1),
        shard_samples=4,
        corpus_tokens=4 * shards * (seq_len + 1),
        documents=3,
        skipped_documents=0,
        tokenizer=TokenizerRecord(file="tokenizer.json", sha256=tokenizer_sha, vocab_size=64, eos_id=0),
        shards=entries,
    )
    write_manifest(directory, manifest)
    return directory, manifest


def test_a_manifest_reads_back_as_written_and_its_shards_are_checked(tmp_path):
    directory, written = dataset(tmp_path)
    assert read_manifest(directory) == written and not written.masked and written.eval_samples == 0
    (directory / "shard-1.parquet").write_bytes(b"x" * 11)
    with pytest.raises(UserError, match=r"shard .*shard-1.parquet has 11 bytes, the manifest says 10"):
        read_manifest(directory)
    assert read_manifest(directory, check_shards=False) == written  # only its record: an export's tokenizer


def test_a_manifest_missing_a_field_is_one_line_naming_the_file_and_the_field(tmp_path):
    directory, _ = dataset(tmp_path)
    raw = json.loads((directory / "manifest.json").read_text())
    del raw["seq_len"]
    (directory / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"manifest.json: not a readable lmforge dataset manifest \(seq_len: Field required\)"):
        read_manifest(directory)


def test_a_mixture_sums_its_sources_and_refuses_another_tokenizer(tmp_path):
    (a, first), (b, second) = dataset(tmp_path, "a"), dataset(tmp_path, "b", shards=1)
    mixed = mixture_manifest([MixtureSource(path=str(a), weight=3), MixtureSource(path=str(b), weight=1)], [first, second])
    assert isinstance(mixed, MixtureManifest) and mixed.num_samples == 12 and mixed.tokenizer.file == str(a / "tokenizer.json")
    assert [(s.path, s.weight, s.manifest) for s in mixed.sources] == [(str(a), 3.0, first), (str(b), 1.0, second)]
    (c, third) = dataset(tmp_path, "c", tokenizer_sha="bb")
    with pytest.raises(UserError, match=r"^data.sources\[1\].path: .*c was tokenized with another tokenizer"):
        mixture_manifest([MixtureSource(path=str(a), weight=1), MixtureSource(path=str(c), weight=1)], [first, third])


def test_the_summary_json_leaves_out_what_the_run_did_not_have():
    summary = RunSummary(
        job="j",
        final_step=4,
        final_loss=2.5,
        eval_loss=None,
        eval_ppl=None,
        eval_step=None,
        start_step=0,
        tokens=1024,
        wall_seconds=3.0,
        first_step_data_wait_seconds=0.1,
        data_wait_fraction=None,
        world_size=2,
        dp=2,
        data_bytes_read=None,
        failures=0,
        ranks=[],
        run_dir="/r",
        latest_checkpoint="/r/checkpoints/step_00000004",
        mlflow_tracking_uri=None,
        mlflow_run_id=None,
    )
    written = summary.as_json()
    assert written["eval_loss"] is None and "eval_kl" not in written and "student_answers" not in written
    assert RunSummary.model_validate(json.loads(json.dumps(written))) == summary
