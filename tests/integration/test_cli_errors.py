"""Bad input through the `lmforge` CLI: one line naming the field or file, exit
code 2, no traceback, nothing written. Commands run through the CLI's entry point
in the test's process; those that start Ray, and one more, as real processes."""

import json
from pathlib import Path

import pytest
import yaml

from cli import assert_clean_error, run_cli, run_cli_process
from conftest import tiny_job, with_sections
from hf_models import word_level_tokenizer
from lmforge.checkpoint.state import TrainerState
from lmforge.data.manifest import read_manifest


def write_job(tmp_path: Path, job: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def nothing_written(tmp_path: Path) -> bool:
    return not (tmp_path / "runs").exists()


def test_unknown_field(tmp_path):
    job = tiny_job(tmp_path, tmp_path / "data")
    job["train"]["learning_rate"] = 1
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "job.yaml", "train.learning_rate: unknown field")
    assert nothing_written(tmp_path)


def test_bad_override(tmp_path):
    job_file = write_job(tmp_path, tiny_job(tmp_path, tmp_path / "data"))
    result = run_cli("train", str(job_file), "--set", "train.global_batch=7", cwd=tmp_path)
    assert_clean_error(result, "train.global_batch: 7 is not divisible by micro_batch x dp = 2 x 2")


def test_missing_job_file(tmp_path):
    assert_clean_error(run_cli_process("train", "nope.yaml", cwd=tmp_path), "nope.yaml: cannot read job file")


def test_data_path_without_dataset_or_source(tmp_path):
    result = run_cli("train", str(write_job(tmp_path, tiny_job(tmp_path, tmp_path / "nodata"))), cwd=tmp_path)
    assert_clean_error(result, "data.path", "nodata", "data.source is not set")
    assert nothing_written(tmp_path)


def test_missing_source(tmp_path):
    job = tiny_job(tmp_path, tmp_path / "data", data={"source": str(tmp_path / "absent")})
    assert_clean_error(run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path), "data.source", "absent", "does not exist")
    assert nothing_written(tmp_path)


def test_empty_source_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    job = tiny_job(tmp_path, tmp_path / "data", data={"source": str(tmp_path / "empty")})
    assert_clean_error(run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path), "data.source", "is empty")


def test_tokenizer_vocab_larger_than_model(tmp_path):
    job = tiny_job(tmp_path, tmp_path / "data", data={"source": "builtin:python-stdlib", "vocab_size": 4096})
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "data.vocab_size: 4096 is larger than model.vocab_size 512")


def test_prepared_vocab_larger_than_model(tmp_path, tiny_dataset):
    job = tiny_job(tmp_path, tiny_dataset, model={"vocab_size": 256})
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "model.vocab_size: 256 is smaller than the tokenizer's vocabulary", "manifest.json")
    assert nothing_written(tmp_path)


def test_seq_len_differs_from_dataset(tmp_path, tiny_dataset):
    job = tiny_job(tmp_path, tiny_dataset, train={"seq_len": 64})
    assert_clean_error(run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path), "train.seq_len: 64 does not match the dataset's seq_len 32")


def test_unusable_checkpoint_dir(tmp_path, tiny_dataset):
    (tmp_path / "blocker").write_text("a file, not a directory")
    job = tiny_job(tmp_path, tiny_dataset, checkpoint={"dir": str(tmp_path / "blocker" / "ck")})
    assert_clean_error(run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path), "checkpoint.dir", "blocker")
    assert nothing_written(tmp_path)


@pytest.mark.ray
def test_world_larger_than_cluster_says_so_with_numbers(tmp_path, tiny_dataset):
    job = tiny_job(tmp_path, tiny_dataset, parallel={"dp": 16}, train={"global_batch": 32})
    result = run_cli_process("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    # The embedded cluster it would start (max(4, cores) + 1 CPUs), refused before starting it.
    assert_clean_error(result, "resources: 16 workers", "1 CPU for reading data", "need 17 CPUs", "the cluster has 5 CPUs")
    assert nothing_written(tmp_path)


@pytest.mark.ray
def test_world_larger_than_a_joined_cluster_names_elastic_min_dp(ray_session, tmp_path, tiny_dataset):
    """In this process the CLI joins the session's cluster (6 CPUs) instead of starting one."""
    job = tiny_job(
        tmp_path,
        tiny_dataset,
        parallel={"dp": 8},
        train={"global_batch": 16},
        elastic={"min_dp": 8, "max_dp": 8},
        fault_tolerance={"max_failures": 1},
    )
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "elastic.min_dp: 8 workers", "need 9 CPUs", "even dp 8 does not fit")
    assert nothing_written(tmp_path)


@pytest.mark.ray
def test_in_memory_checkpoints_the_nodes_cannot_hold_say_so_with_numbers(ray_session, tmp_path, tiny_dataset):
    """A 1.6B-parameter model's weights and AdamW state, four copies per rank, on the session's one node."""
    job = tiny_job(
        tmp_path,
        tiny_dataset,
        model={"preset": "tiny", "dim": 4096, "n_layers": 8, "n_heads": 32, "n_kv_heads": 32, "ffn_hidden": 16384},
        checkpoint={"in_memory": True},
    )
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "checkpoint.in_memory: each rank's snapshot is", "kept 4 times over", "may hold 2 ranks", "of host memory for Ray")
    assert nothing_written(tmp_path)


@pytest.mark.ray
def test_a_corpus_too_small_once_tokenized_leaves_nothing_behind(ray_session, s3_bucket, tmp_path):
    """Enough bytes to pass the check before Ray, too few tokens once BPE merged them;
    on a filesystem and on an object store (where no rename makes a dataset whole)."""
    import fsspec

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a" * 40)
    for out in (str(tmp_path / "prepared"), f"{s3_bucket}/too-small"):
        result = run_cli(
            "data", "prepare", "--source", str(corpus), "--out", out, "--seq-len", "32", "--vocab-size", "300", "--no-progress", cwd=tmp_path
        )
        assert_clean_error(result, "--source: ", "yields 2 tokens, fewer than one sample")
    assert [p.name for p in tmp_path.iterdir()] == ["corpus"]
    assert not fsspec.filesystem("s3").find(f"{s3_bucket}/too-small")


def test_a_denied_request_names_the_uri(tmp_path):
    """A store that refuses these credentials (moto checking them, knowing none)."""
    from s3_server import free_endpoint, s3_server

    endpoint = free_endpoint()
    with s3_server(tmp_path / "s3.log", endpoint, deny_all=True) as bucket:
        result = run_cli_process(
            "data",
            "prepare",
            "--source",
            f"{bucket}/corpus",
            "--seq-len",
            "32",
            "--out",
            "prepared",
            "--no-progress",
            cwd=tmp_path,
            env={"AWS_ENDPOINT_URL": endpoint},
        )
    assert_clean_error(result, f"--source: cannot open {bucket}/corpus", "ACCESS_DENIED")
    assert not (tmp_path / "prepared").exists()


def altered_copy(dataset: Path, out: Path, change) -> Path:
    """`dataset` with its manifest changed by `change` (its shards linked, not copied)."""
    out.mkdir()
    for item in dataset.iterdir():
        (out / item.name).symlink_to(item)
    (out / "manifest.json").unlink()
    manifest = json.loads((dataset / "manifest.json").read_text())
    change(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


# Mixtures (`data.sources`) whose datasets cannot be read as one stream: (second source, fragments).
MIXTURE_REFUSALS = {
    "a source not prepared": (lambda tmp, data: tmp / "absent", ["data.sources[1].path: ", "absent holds no prepared dataset"]),
    "another seq_len": (
        lambda tmp, data: altered_copy(data, tmp / "long", lambda m: m.update(seq_len=64)),
        ["data.sources[1].path: ", "has seq_len 64, data.sources[0] 32; a mixture needs one"],
    ),
    "another tokenizer": (
        lambda tmp, data: altered_copy(data, tmp / "other", lambda m: m["tokenizer"].update(sha256="0" * 64)),
        ["data.sources[1].path: ", "was tokenized with another tokenizer than data.sources[0]"],
    ),
}


@pytest.mark.parametrize("case", MIXTURE_REFUSALS)
def test_a_mixture_that_cannot_be_one_stream_is_refused(case, tmp_path, tiny_dataset, monkeypatch):
    import lmforge.ray_runtime

    monkeypatch.setattr(lmforge.ray_runtime, "connect", lambda *a, **k: pytest.fail("Ray was started (or joined) before the refusal"))
    second, fragments = MIXTURE_REFUSALS[case]
    sources = [{"path": str(tiny_dataset), "weight": 3}, {"path": str(second(tmp_path, tiny_dataset)), "weight": 1}]
    write_job(tmp_path, tiny_job(tmp_path, tiny_dataset, data={"path": None, "sources": sources}))
    assert_clean_error(run_cli("train", "job.yaml", cwd=tmp_path), *fragments)
    assert nothing_written(tmp_path)


# Object-store URIs that cannot serve: refused with the URI named, before anything starts.
OBJECT_STORE_REFUSALS = {
    "a source in a bucket that does not exist": (
        ["data", "prepare", "--source", "s3://no-such-bucket/corpus", "--seq-len", "32", "--out", "prepared", "--no-progress"],
        ["--source: s3://no-such-bucket/corpus does not exist"],
    ),
    "an output in a bucket that does not exist": (
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", "--out", "s3://no-such-bucket/prepared", "--no-progress"],
        ["--out: s3://no-such-bucket/prepared: the bucket no-such-bucket does not exist"],
    ),
    "a dataset URI with nothing there": (["train", "job.yaml"], ["data.path: s3://lmforge-tests/nothing-here", "data.source is not set"]),
    "an output prefix holding objects": (
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", "--out", "s3://lmforge-tests/occupied", "--no-progress"],
        ["--out: s3://lmforge-tests/occupied is not empty (1 files, e.g. theirs.txt)"],
    ),
}


def test_checkpoints_on_object_storage_are_guarded_as_on_disk(s3_bucket, tmp_path, monkeypatch):
    """On the S3 server: a fresh start over committed checkpoints and another job's
    checkpoints are refused, naming checkpoint.dir, and a corrupt step is set aside
    (copied under another name, its files kept), not deleted."""
    import lmforge.ray_runtime

    monkeypatch.setattr(lmforge.ray_runtime, "connect", lambda *a, **k: pytest.fail("Ray was started (or joined) before the refusal"))
    where = f"{s3_bucket}/guarded-checkpoints"
    store = job_over_checkpoints(tmp_path, dir=where, resume=False)
    assert_clean_error(run_cli("train", "job.yaml", cwd=tmp_path), f"checkpoint.dir: {where} holds 1 committed checkpoints")
    (tmp_path / "other").mkdir()
    job_over_checkpoints(tmp_path / "other", written_by="other", dir=f"{where}-other")
    assert_clean_error(run_cli("train", "job.yaml", cwd=tmp_path / "other"), "step_00000004 was written by job other, not tiny")
    assert store.clear_after(0) == {"set_aside": [4], "removed": []} and store.committed() == []
    assert store.fs.exists(f"{where.removeprefix('s3://')}/corrupt_step_00000004/commit.json")


@pytest.mark.parametrize("case", OBJECT_STORE_REFUSALS)
def test_object_store_uris_that_cannot_serve_are_named(case, s3_bucket, tmp_path, monkeypatch):
    import fsspec

    import lmforge.ray_runtime

    monkeypatch.setattr(lmforge.ray_runtime, "connect", lambda *a, **k: pytest.fail("Ray was started (or joined) before the refusal"))
    corpus(tmp_path, a_txt="x " * 100)
    write_job(tmp_path, tiny_job(tmp_path, f"{s3_bucket}/nothing-here"))
    s3 = fsspec.filesystem("s3")
    s3.pipe(f"{s3_bucket}/occupied/theirs.txt", b"not lmforge's")
    command, fragments = OBJECT_STORE_REFUSALS[case]
    assert_clean_error(run_cli(*command, cwd=tmp_path), *fragments)
    assert nothing_written(tmp_path) and not (tmp_path / "prepared").exists()
    assert s3.cat(f"{s3_bucket}/occupied/theirs.txt") == b"not lmforge's"


def corpus(tmp_path: Path, **files: str) -> str:
    (tmp_path / "corpus").mkdir()
    for name, text in files.items():
        (tmp_path / "corpus" / name.replace("_", ".")).write_text(text)
    return str(tmp_path / "corpus")


def job_with_tokenizer(tmp_path: Path, tokenizer: Path, in_job: bool = True) -> None:
    data = {"source": corpus(tmp_path, a_txt="x " * 100)} | ({"tokenizer": str(tokenizer)} if in_job else {})
    write_job(tmp_path, tiny_job(tmp_path, tmp_path / "data", data=data))


PREPARE = ["--out", "prepared", "--no-progress"]


def job_over_checkpoints(tmp_path: Path, written_by: str = "tiny", **checkpoint):
    """A job whose checkpoint directory (`checkpoint.dir`, else the run's) holds a
    committed step of `written_by`; returns its store."""
    from lmforge.checkpoint.store import CheckpointStore

    data = {"source": corpus(tmp_path, a_txt="x " * 100), "vocab_size": 300}
    write_job(tmp_path, tiny_job(tmp_path, tmp_path / "data", data=data, checkpoint=checkpoint))
    store = CheckpointStore(checkpoint.get("dir") or str(tmp_path / "runs" / "tiny" / "checkpoints"))
    store.fs.makedirs(store.fs_path(store.step_path(4)), exist_ok=True)
    store.write_state(4, TrainerState(step=4, job=written_by, global_batch=8))
    store.commit(4, store.digest(4, store.files(4)))
    return store


def checkpoint_without_adapters(tmp_path: Path) -> None:
    from lmforge.checkpoint.store import CheckpointStore
    from lmforge.models import PRESETS

    store = CheckpointStore(str(tmp_path / "checkpoints"))
    store.fs.makedirs(store.fs_path(store.step_path(4)), exist_ok=True)
    store.write_state(4, TrainerState(step=4, job="tiny", model=PRESETS["tiny"].as_dict()))
    store.commit(4, store.digest(4, store.files(4)))


# Each is refused before Ray starts and before anything is written: (set-up, command, fragments).
EARLY_REFUSALS = {
    "LoRA targets that match no layer": (
        lambda tmp: write_job(tmp, tiny_job(tmp, tmp / "data", model={"preset": "tiny", "vocab_size": 512, "lora": {"targets": ["q_proj", "qkv"]}})),
        ["train", "job.yaml"],
        ["model.lora.targets: 'qkv' matches no linear layer of the blocks; choose from wq"],
    ),
    "a LoRA rank larger than a layer": (
        lambda tmp: write_job(tmp, tiny_job(tmp, tmp / "data", model={"preset": "tiny", "vocab_size": 512, "lora": {"rank": 48}})),
        ["train", "job.yaml"],
        ["model.lora.rank: 48 is larger than the wk layers (32 on their smaller side); use a rank of at most 32"],
    ),
    "an NF4 base that is not a trained model": (
        lambda tmp: write_job(tmp, tiny_job(tmp, tmp / "data", model={"preset": "tiny", "vocab_size": 512, "lora": {"quantize": "nf4"}})),
        ["train", "job.yaml"],
        ["model.lora.quantize: nf4 holds a trained base in 4 bits; set model.init_from"],
    ),
    "a served teacher that does not answer": (
        lambda tmp: write_job(
            tmp, tiny_job(tmp, tmp / "data", distill={"teacher": {"url": "http://127.0.0.1:9/v1", "model": "t", "top_k": 4}, "cache": "cache"})
        ),
        ["distill", "cache", "job.yaml"],
        ["distill.teacher.url: http://127.0.0.1:9/v1/ cannot teach: Connection error"],
    ),
    "adapters exported from a checkpoint that has none": (
        checkpoint_without_adapters,
        ["export", "checkpoints/step_00000004", "--out", "adapter", "--format", "peft"],
        ["--format peft: checkpoints/step_00000004 was trained without model.lora (it holds no adapters)"],
    ),
    "corrupt tokenizer": (
        lambda tmp: job_with_tokenizer(tmp, tmp / "tok.json") or (tmp / "tok.json").write_text("{not json"),
        ["train", "job.yaml"],
        ["data.tokenizer:", "tok.json is not a tokenizer.json"],
    ),
    "tokenizer larger than the model": (
        lambda tmp: job_with_tokenizer(tmp, word_level_tokenizer(tmp / "tok.json", 600)),
        ["train", "job.yaml"],
        ["data.tokenizer:", "has 602 tokens, more than the model's vocabulary of 512 (model.vocab_size)"],
    ),
    "tokenizer larger than the job's model, given as a flag": (
        lambda tmp: job_with_tokenizer(tmp, word_level_tokenizer(tmp / "tok.json", 600), in_job=False),
        ["data", "prepare", "job.yaml", "--tokenizer", "tok.json", *PREPARE],
        ["--tokenizer: tok.json has 602 tokens, more than the model's vocabulary of 512"],
    ),
    "negative sequence length": (
        lambda tmp: corpus(tmp, a_txt="x " * 100),
        ["data", "prepare", "--source", "corpus", "--seq-len", "-5", *PREPARE],
        ["--seq-len: must be > 0, got -5"],
    ),
    "JSONL without the text column": (
        lambda tmp: corpus(tmp, a_jsonl=json.dumps({"body": "x " * 100}) + "\n"),
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", *PREPARE],
        ["--text-column: 'text' is not a field of", "a.jsonl", "['body']"],
    ),
    "held-out share out of range": (
        lambda tmp: corpus(tmp, a_txt="x " * 100),
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", "--eval-fraction", "1.5", *PREPARE],
        ["--eval-fraction: a share of the documents", "got 1.5"],
    ),
    "held-out corpus missing": (
        lambda tmp: corpus(tmp, a_txt="x " * 100),
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", "--eval-source", "absent", *PREPARE],
        ["--eval-source: ", "absent does not exist"],
    ),
    "evaluation with no held-out split to prepare": (
        lambda tmp: write_job(tmp, tiny_job(tmp, tmp / "data", data={"source": corpus(tmp, a_txt="x " * 100)}, eval={"interval": 2})),
        ["train", "job.yaml"],
        ["eval: measures a held-out split", "set data.eval_fraction or eval.source"],
    ),
    "no samples per shard": (
        lambda tmp: corpus(tmp, a_txt="x " * 100),
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", "--shard-samples", "0", *PREPARE],
        ["--shard-samples: must be > 0, got 0"],
    ),
    "a negative vocabulary": (
        lambda tmp: corpus(tmp, a_txt="x " * 100),
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", "--vocab-size", "-1", *PREPARE],
        ["--vocab-size: the BPE trained here needs at least 257", "got -1"],
    ),
    "an output that is a file": (
        lambda tmp: corpus(tmp, a_txt="x " * 100) and (tmp / "prepared").write_text("mine"),
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", *PREPARE],
        ["--out: prepared is a file"],
    ),
    "an output folder holding files": (
        lambda tmp: corpus(tmp, a_txt="x " * 100) and (tmp / "prepared").mkdir() or (tmp / "prepared" / "notes.txt").write_text("mine"),
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", *PREPARE],
        ["--out: prepared is not empty (1 files, e.g. notes.txt)"],
    ),
    "a fresh start over committed checkpoints": (
        lambda tmp: job_over_checkpoints(tmp, resume=False),
        ["train", "job.yaml"],
        ["checkpoint.dir: ", "holds 1 committed checkpoints (steps 4..4) and checkpoint.resume is false", "discard_existing"],
    ),
    "checkpoints another job wrote": (
        lambda tmp: job_over_checkpoints(tmp, written_by="other"),
        ["train", "job.yaml"],
        ["checkpoint.dir: ", "step_00000004 was written by job other, not tiny"],
    ),
    "a password in the tracking URI of a submitted job": (
        lambda tmp: write_job(tmp, tiny_job(tmp, tmp / "data", tracking={"uri": "http://alice:pa55@mlflow:5000"})),
        ["submit", "job.yaml", "--address", "http://127.0.0.1:9"],
        ["tracking.uri: holds a credential", "MLFLOW_TRACKING_PASSWORD"],
    ),
    "a DeepSpeed comet key in a submitted job": (
        lambda tmp: write_job(tmp, tiny_job(tmp, tmp / "data", engine="deepspeed", deepspeed={"config": {"comet": {"api_key": "k"}}})),
        ["submit", "job.yaml", "--address", "http://127.0.0.1:9"],
        ["deepspeed.config.comet.api_key: holds a credential", "COMET_API_KEY"],
    ),
    "corpus too small for one sample": (
        lambda tmp: corpus(tmp, a_txt="", b_txt="tiny"),
        ["data", "prepare", "--source", "corpus", "--seq-len", "32", *PREPARE],
        ["--source: the corpus holds 4 bytes", "fewer than one sample of seq_len+1 = 33"],
    ),
}


@pytest.mark.parametrize("case", EARLY_REFUSALS)
def test_refused_before_ray_starts(case, tmp_path, monkeypatch):
    import lmforge.ray_runtime

    def no_cluster(*args, **kwargs):
        raise AssertionError("Ray was started (or joined) before the refusal")

    monkeypatch.setattr(lmforge.ray_runtime, "connect", no_cluster)
    set_up, command, fragments = EARLY_REFUSALS[case]
    set_up(tmp_path)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert_clean_error(run_cli(*command, cwd=tmp_path), *fragments)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing written


# An evaluation the prepared dataset (one document in ten held out) cannot serve.
HELD_OUT_REFUSALS = {
    "more batches than held out": (
        {"eval": {"interval": 2, "batches": 1000}},
        ["eval.batches: 1000 batches of 8 samples need 8000 held-out samples", "at most"],
    ),
    "another held-out share than prepared": (
        {"data": {"eval_fraction": 0.3}, "eval": {"interval": 2}},
        ["data.eval_fraction: 0.3, but", "was prepared with data.eval_fraction 0.1"],
    ),
    "a held-out corpus and a share": (
        {"data": {"eval_fraction": 0.1}, "eval": {"source": "elsewhere"}},
        ["eval.source: a separate held-out corpus and data.eval_fraction"],
    ),
}


@pytest.mark.parametrize("case", HELD_OUT_REFUSALS)
def test_evaluation_the_dataset_cannot_serve(case, tmp_path, tiny_dataset):
    sections, fragments = HELD_OUT_REFUSALS[case]
    result = run_cli("train", str(write_job(tmp_path, tiny_job(tmp_path, tiny_dataset, **sections))), cwd=tmp_path)
    assert_clean_error(result, *fragments)
    assert nothing_written(tmp_path)


def test_a_tensorboard_directory_that_is_a_file(tmp_path, tiny_dataset):
    (tmp_path / "board").write_text("the user's notes")
    job = tiny_job(tmp_path, tiny_dataset, tracking={"tensorboard": "board"})
    assert_clean_error(run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path), f"tracking.tensorboard: {tmp_path / 'board'} is a file")
    assert nothing_written(tmp_path) and (tmp_path / "board").read_text() == "the user's notes"


def test_deepspeed_config_contradicting_the_job(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 4096, "zero_optimization": {"stage": 3}}))
    job = tiny_job(tmp_path, tmp_path / "data", engine="deepspeed", deepspeed={"config": "ds.json"})
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "job.yaml", "deepspeed.config.train_batch_size: 4096 contradicts train.global_batch 8")
    assert nothing_written(tmp_path)


def test_deepspeed_fp16_on_a_cpu_without_fp16_units(tmp_path, tiny_dataset):
    from lmforge.preflight import cpu_supports_fp16

    if cpu_supports_fp16():
        pytest.skip("this CPU has AVX512-FP16: DeepSpeed accepts fp16 here")
    job = tiny_job(tmp_path, tiny_dataset, engine="deepspeed", deepspeed={"config": {"fp16": {"enabled": True}}})
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "train.precision: fp16 on CPU ranks needs AVX512-FP16")
    assert nothing_written(tmp_path)


def test_export_of_an_uncommitted_directory(tmp_path):
    (tmp_path / "step_00000004").mkdir()
    result = run_cli("export", str(tmp_path / "step_00000004"), "--out", str(tmp_path / "model"), cwd=tmp_path)
    assert_clean_error(result, "step_00000004: not a committed checkpoint")
    assert not (tmp_path / "model").exists()


def test_init_from_a_directory_that_is_not_an_export(tmp_path, tiny_dataset):
    job = tiny_job(tmp_path, tiny_dataset, model={"preset": "tiny", "vocab_size": 512, "init_from": str(tmp_path)})
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "model.init_from:", "not a model directory (no config.json)")
    assert nothing_written(tmp_path)


@pytest.fixture(scope="module")
def hf_teacher(tmp_path_factory, hf_tokenizer):
    """A Hugging Face Llama with its own tokenizer (not the tiny dataset's)."""
    from hf_models import make_hf_model

    out = tmp_path_factory.mktemp("hf-teacher")
    make_hf_model(out, "untied-gqa", hf_tokenizer)
    return out


def _teacher_without_a_tokenizer(tmp_path, hf_teacher):
    out = tmp_path / "teacher"
    result = run_cli("export", str(hf_teacher), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink()
    return out


def _teacher_with_the_datasets_tokenizer(tmp_path, hf_teacher, dataset):
    """A Hugging Face Llama with the dataset's tokenizer.json, its vocabulary padded
    otherwise than the student's (520 rows, not 512)."""
    import shutil

    from hf_models import make_hf_model

    out = tmp_path / "teacher"
    make_hf_model(out, "untied-gqa", hf_teacher, vocab_size=520)
    shutil.copy(dataset / read_manifest(dataset).tokenizer.file, out / "tokenizer.json")
    return out


def _teacher_reading_words(tmp_path, hf_teacher, dataset):
    """The Hugging Face Llama with a word-level tokenizer: it cannot spell the dataset's
    byte-level text (no spaces, unknown words)."""
    out = tmp_path / "teacher"
    result = run_cli("export", str(hf_teacher), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (out / "tokenizer_config.json").unlink()
    word_level_tokenizer(out / "tokenizer.json", 100)
    return out


CROSS = {"distill": {"cross_tokenizer": {"method": "projection"}, "top_k": 8}}

# name: (the teacher made from the Hugging Face one, more job settings, what the message says)
TEACHER_REFUSALS = {
    "a tokenizer that cannot read the text, across tokenizers": (
        _teacher_reading_words,
        CROSS,
        "distill.teacher: its tokenizer",
        "and the student's end a token at the same character at only",
        "do not read the text alike",
    ),
    "no tokenizer, across tokenizers": (
        lambda tmp_path, hf_teacher, data: _teacher_without_a_tokenizer(tmp_path, hf_teacher),
        CROSS,
        "distill.teacher:",
        "has no tokenizer to read the student's text with",
    ),
    "missing": (lambda tmp_path, hf_teacher, data: tmp_path / "nowhere", {}, "distill.teacher:", "does not exist"),
    "another tokenizer": (lambda tmp_path, hf_teacher, data: hf_teacher, {}, "distill.teacher: its tokenizer", "is not the dataset's"),
    "no tokenizer": (
        lambda tmp_path, hf_teacher, data: _teacher_without_a_tokenizer(tmp_path, hf_teacher),
        {},
        "distill.teacher:",
        "has no tokenizer to compare with the dataset's",
    ),
    "a block it lacks": (
        _teacher_with_the_datasets_tokenizer,
        {"distill": {"hidden": {"layers": {0: 1, 1: 5}}}},
        "distill.hidden.layers: teacher block 5 does not exist; the teacher has 2 blocks (0-1)",
    ),
    "another padded vocabulary under tp": (
        _teacher_with_the_datasets_tokenizer,
        {"parallel": {"dp": 1, "tp": 2}},
        "distill.teacher: its vocab_size 520 differs from model.vocab_size 512",
        "distill.cache",
    ),
}


@pytest.mark.parametrize("case", TEACHER_REFUSALS)
def test_a_teacher_that_cannot_teach_this_student_is_refused(case, tmp_path, tiny_dataset, hf_teacher):
    """Before anything starts: a teacher that is not there, does not share the
    dataset's tokenizer (a Hugging Face Llama with its own), lacks a block the layer
    map names, or pads the vocabulary otherwise than a TP-split student."""
    teacher, sections, *fragments = TEACHER_REFUSALS[case]
    job = with_sections(tiny_job(tmp_path, tiny_dataset, distill={"teacher": str(teacher(tmp_path, hf_teacher, tiny_dataset))}), sections)
    assert_clean_error(run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path), *fragments)
    assert nothing_written(tmp_path)


def test_a_served_teacher_that_does_not_answer_is_refused_before_training(tmp_path, tiny_dataset):
    """Training straight from a server: it is asked before anything starts."""
    job = tiny_job(tmp_path, tiny_dataset, distill={"teacher": {"url": "http://127.0.0.1:9/v1", "model": "t", "top_k": 4}})
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "distill.teacher.url: http://127.0.0.1:9/v1/ cannot teach: Connection error")
    assert nothing_written(tmp_path)


# name: (what the job changes of the cache's job, what the message says)
CACHE_REFUSALS = {
    "no cache there": (lambda job, tmp: {"distill": {"cache": str(tmp / "nowhere")}}, "holds no teacher cache (manifest.json missing)"),
    "another k": (lambda job, tmp: {"distill": {"top_k": 16}}, "holds the top 32, not distill.top_k 16"),
    "another temperature": (lambda job, tmp: {"distill": {"temperature": 2.0}}, "was built at temperature 1.5, not distill.temperature 2.0"),
    "other teachers": (lambda job, tmp: {"distill": {"teachers": job["distill"]["teachers"][:1]}}, "was built from other teachers"),
    "another dataset": (lambda job, tmp: {"data": {"path": _copied_dataset(job, tmp)}}, "was built for another dataset"),
}


def _copied_dataset(job: dict, tmp_path: Path) -> str:
    import shutil

    return str(shutil.copytree(job["data"]["path"], tmp_path / "moved-data"))


@pytest.mark.parametrize("case", CACHE_REFUSALS)
def test_a_teacher_cache_made_for_another_job_is_refused(case, tmp_path, distill_cache):
    import copy

    job, _ = distill_cache
    change, fragment = CACHE_REFUSALS[case]
    job = with_sections(copy.deepcopy(job), change(job, tmp_path))
    job["output_dir"] = str(tmp_path / "runs")
    assert_clean_error(run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path), "distill.cache:", fragment)
    assert nothing_written(tmp_path)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"cache": None}, "distill.cache: not set"),
        ({}, "already holds a teacher cache; remove it or choose another path"),
        ({"top_k": None}, "distill.cache: the cache keeps the teacher's k most likely tokens per position; set distill.top_k"),
    ],
)
def test_a_teacher_cache_that_cannot_be_built_is_refused(change, fragment, tmp_path, distill_cache):
    import copy

    job, _ = distill_cache
    job = with_sections(copy.deepcopy(job), {"distill": change})
    assert_clean_error(run_cli("distill", "cache", str(write_job(tmp_path, job)), cwd=tmp_path), fragment)


# name: (the job's sections changed, given the instruct job and a tmp dir; the command; what the message says)
INSTRUCT_REFUSALS = {
    "a missing prompts file": (
        lambda job, tmp: {"instruct": {"prompts": str(tmp / "none.jsonl")}},
        "generate",
        "distill.instruct.prompts: ",
        "none.jsonl does not exist",
    ),
    "an empty prompts file": (lambda job, tmp: {"instruct": {"prompts": _file(tmp / "empty.jsonl", "")}}, "generate", "holds no prompts"),
    "no prompt column": (
        lambda job, tmp: {"instruct": {"prompts": _file(tmp / "p.jsonl", '{"question": "x"}\n')}},
        "generate",
        "has neither a 'prompt' nor a 'messages' column",
    ),
    "messages not pairs": (
        lambda job, tmp: {"instruct": {"prompts": _file(tmp / "p.jsonl", '{"messages": [{"role": "user"}]}\n')}},
        "generate",
        "distill.instruct.messages_column:",
        "{role, content} pairs",
    ),
    "a chat template that fails to render": (
        lambda job, tmp: {"instruct": {"chat_template": _file(tmp / "chat.jinja", "{{ raise_exception('roles must alternate') }}")}},
        "generate",
        "distill.instruct.chat_template: ",
        "chat.jinja failed to render a chat (roles must alternate) at ",
        "prompt 3",
    ),
    "every prompt too long": (
        lambda job, tmp: {"instruct": {"generate": {"max_new_tokens": 40}}},
        "generate",
        "none of the 24 prompts fits",
        "train.seq_len + 1 = 33",
    ),
    "a dataset already there": (lambda job, tmp: {}, "generate", "data.path:", "already holds a dataset"),
    "trained before generating": (
        lambda job, tmp: {"data": {"path": str(tmp / "nothing-yet")}},
        "train",
        "holds no instruction dataset yet; write it with `lmforge distill generate JOB`",
    ),
    "other soft targets": (lambda job, tmp: {"top_k": 2}, "train", "distill.top_k:", "holds the teachers' top 4 at temperature 1, not top_k 2"),
    "other teachers": (lambda job, tmp: {"teachers": job["distill"]["teachers"][:1]}, "train", "data.path:", "holds answers of other teachers"),
}


def _file(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", INSTRUCT_REFUSALS)
def test_an_instruction_distillation_that_cannot_run_is_refused(case, tmp_path, instruct_dataset):
    import copy

    job, _ = instruct_dataset
    change, command, *fragments = INSTRUCT_REFUSALS[case]
    job = copy.deepcopy(job)
    changed = change(job, tmp_path)
    data = changed.pop("data", None)
    instruct = changed.pop("instruct", {})
    for key, value in instruct.items():
        job["distill"]["instruct"][key] = value if not isinstance(value, dict) else {**job["distill"]["instruct"][key], **value}
    job["distill"].update(changed)
    if data:
        job["data"].update(data)
    elif command == "generate" and case != "a dataset already there":
        job["data"]["path"] = str(tmp_path / "new")  # not the dataset that is there
    job["output_dir"] = str(tmp_path / "runs")
    args = ("distill", "generate") if command == "generate" else ("train",)
    assert_clean_error(run_cli(*args, str(write_job(tmp_path, job)), cwd=tmp_path), *fragments)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "new").exists() and not any(tmp_path.glob(".*answers*"))


def test_job_larger_than_memory_per_worker_is_refused_with_an_alternative(tmp_path, tiny_dataset):
    from lmforge.memory.estimate import worst_rank
    from lmforge.planner.cluster import assumed_cluster
    from lmforge.planner.search import search
    from lmforge.spec import spec_from_dict

    job = tiny_job(tmp_path, tiny_dataset)
    spec = spec_from_dict(job)
    needs = worst_rank(spec).device_total
    smallest = min(c.memory.device_total for c in search(spec, assumed_cluster(2, gpu_mem=10**12)))
    limit = int((needs + smallest) / 2 / 0.9)  # the job does not fit, a leaner layout does
    best = search(spec, assumed_cluster(2, gpu_mem=limit))[0]
    job["resources"]["memory_per_worker"] = limit
    result = run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path)
    assert_clean_error(result, "resources.memory_per_worker: rank 0 needs an estimated", "activations", f"the best layout that fits: {best.layout}")
    assert nothing_written(tmp_path)
    job["resources"]["memory_per_worker"] = "1KiB"
    assert_clean_error(run_cli("train", str(write_job(tmp_path, job)), cwd=tmp_path), "no layout of 2 workers fits")


def _stage(name: str, kind: str, job: str = "general.yaml", **more) -> dict:
    return {"name": name, "kind": kind, "job": job, **more}


# name: (the pipeline's stages; what the message says). Jobs: general.yaml (the tiny
# student), wide.yaml (a wider one), task.yaml (an instruction distillation).
PIPELINE_REFUSALS = {
    "an unknown kind": (
        [_stage("a", "train"), _stage("b", "finetune")],
        "stages.1.kind: Input should be 'train', 'instruct', 'evaluate' or 'harness'",
    ),
    "a student unlike the previous": (
        [_stage("a", "train"), _stage("b", "train", "wide.yaml")],
        "stages[1] (b): its student is not the previous stage's (a): model differs in dim (96 vs 64)",
    ),
    "an evaluation first": ([_stage("a", "evaluate", "task.yaml")], "stages[0] (a): kind evaluate: judges the previous stage's student"),
    "a harness stage first": (
        [_stage("a", "harness", harness={"tasks": ["t"]})],
        "stages[0] (a): kind harness: evaluates the previous stage's student",
    ),
    "harness tasks on a train stage": (
        [_stage("a", "train", harness={"tasks": ["t"]})],
        "stages.0: harness: a stage of kind harness names its tasks under harness",
    ),
    "a harness include_path missing": (
        [_stage("a", "train"), _stage("b", "harness", harness={"tasks": ["t"], "include_path": "no-tasks"})],
        "stages[1] (b): harness.include_path: no-tasks is not a directory",
    ),
    "instruct without prompts": ([_stage("a", "instruct")], "stages[0] (a): kind instruct: its job (general.yaml) has no distill.instruct"),
    "instructions as kind train": ([_stage("a", "train", "task.yaml")], "give the stage kind: instruct"),
    "a later stage's own init_from": (
        [_stage("a", "train"), _stage("b", "train", set=["model.init_from=elsewhere"])],
        "stages[1] (b): model.init_from: a stage starts from the previous stage's student",
    ),
    "a missing job file": ([_stage("a", "train", "none.yaml")], "stages[0] (a):", "none.yaml: cannot read job file"),
    "a bad override": ([_stage("a", "train", set=["train.max_stepz=3"])], "stages[0] (a):", "train.max_stepz: unknown field"),
    "two stages of one name": ([_stage("a", "train"), _stage("a", "train")], "stages: two stages are named 'a'"),
    "a finished stage changed": ([_stage("a", "train", set=["train.max_steps=3"])], "stages[0] (a) changed since it finished"),
}


@pytest.mark.parametrize("case", PIPELINE_REFUSALS)
def test_a_pipeline_that_cannot_run_is_refused(case, tmp_path):
    """Every stage's job is read and checked against the stage before it before
    anything runs: one line naming the pipeline file and the stage, exit 2."""
    from conftest import instruct_job

    stages, *fragments = PIPELINE_REFUSALS[case]
    general = tiny_job(tmp_path, tmp_path / "data")
    write_job(tmp_path, general).rename(tmp_path / "general.yaml")
    write_job(tmp_path, tiny_job(tmp_path, tmp_path / "data", model={"preset": "tiny", "vocab_size": 512, "dim": 96})).rename(tmp_path / "wide.yaml")
    write_job(tmp_path, instruct_job(tmp_path, tmp_path / "teacher", tmp_path / "prompts.jsonl")).rename(tmp_path / "task.yaml")
    if case == "a finished stage changed":  # the state a run of it with other settings left
        (tmp_path / "runs" / "p").mkdir(parents=True)
        (tmp_path / "runs" / "p" / "pipeline.json").write_text(json.dumps({"stages": {"a": {"identity": "another", "kind": "train"}}}))
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump({"name": "p", "output_dir": str(tmp_path / "runs"), "stages": stages}))
    assert_clean_error(run_cli("distill", "run", str(tmp_path / "pipeline.yaml"), cwd=tmp_path), "pipeline.yaml: ", *fragments)
    assert sorted(p.name for p in (tmp_path / "runs").rglob("*")) == (["p", "pipeline.json"] if case == "a finished stage changed" else [])


SERVE_REFUSALS = {
    "a missing model": (["absent"], "MODEL: absent does not exist"),
    "a directory of no known format": (["empty"], "MODEL: empty", "config.json"),
    "a partial model": (["partial"], "partial", "model.safetensors"),
    "an unknown batching": (["partial", "--batching", "dynamic"], "--batching: 'dynamic' is not one of continuous, request, off"),
    "no replicas": (["partial", "--replicas", "0"], "--replicas: a number of at least 1 or auto"),
    "a bad route prefix": (["partial", "--route-prefix", "v1"], "--route-prefix: must start with /"),
    "a route prefix ending in /": (["partial", "--route-prefix", "/x/"], "--route-prefix: a path like /name, not ending in /"),
    "a port out of range": (["partial", "--port", "70000"], "--port: must be at most 65535, got 70000"),
    "a gRPC port out of range": (["partial", "--grpc-port", "70000"], "--grpc-port: must be at most 65535, got 70000"),
    "gRPC on the HTTP port": (["partial", "--grpc-port", "8000"], "--grpc-port: 8000 is the HTTP port too"),
    "gRPC routed by length": (["partial", "--grpc-port", "9000", "--long-prompt-tokens", "512"], "--grpc-port: gRPC calls are not routed by length"),
    "a length threshold of 0": (["partial", "--long-prompt-tokens", "0"], "--long-prompt-tokens: must be at least 1, got 0"),
    "a replica memory that is no size": (["partial", "--memory-per-replica", "lots"], "--memory-per-replica: 'lots' is not a size"),
    "negative CPUs per replica": (["partial", "--cpus-per-replica", "-1"], "--cpus-per-replica: must be > 0, got -1.0"),
    "a stream interval of 0": (["partial", "--stream-interval", "0"], "--stream-interval: must be at least 1, got 0"),
    "an unknown backend": (["partial", "--backend", "tensorrt"], "--backend: 'tensorrt' is not one of torch, onnxruntime"),
    "ONNX Runtime on lmforge's model": (["partial", "--backend", "onnxruntime"], "MODEL: partial is not an ONNX Runtime model directory"),
    "an ONNX model without its backend": (["onnx"], "MODEL: onnx is an ONNX Runtime model; serve it with --backend onnxruntime"),
    "ONNX Runtime with request batching": (["onnx", "--backend", "onnxruntime", "--batching", "request"], "--batching: request-level batching"),
    "ONNX Runtime on a GPU": (["onnx", "--backend", "onnxruntime", "--device", "cuda"], "--device: cuda is not the CPU"),
    "an adapter without a name": (["partial", "--adapter", "empty"], "--adapter: expected NAME=DIR, got 'empty'"),
    "an adapter named as the base": (["partial", "--name", "m", "--adapter", "m=empty"], "--adapter: m is the base model's name"),
    "adapters with request batching": (
        ["partial", "--batching", "request", "--adapter", "a=empty"],
        "--adapter: adapters join lmforge's continuous batch",
    ),
    "an adapter that is not a PEFT directory": (["partial", "--adapter", "a=empty"], "--adapter a: ", "empty is not a PEFT adapter directory"),
}


@pytest.mark.parametrize("case", SERVE_REFUSALS)
def test_a_model_that_cannot_be_served_is_refused(case, tmp_path):
    """Before Ray or the model load: one line naming the flag or the model, exit 2."""
    args, *fragments = SERVE_REFUSALS[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text(
        json.dumps({"model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512, "ffn_hidden": 172}})
    )
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "genai_config.json").write_text("{}")  # what marks onnxruntime-genai's model directory
    assert_clean_error(run_cli("serve", *args, cwd=tmp_path), *fragments)


def test_serve_sizes_its_slots_by_the_replicas_memory(reference_run, tmp_path):
    """The reference model's replica (fp32): as many full-context sequences as fit beside
    its weights, at most --max-running; one that holds none is refused before anything starts."""
    from lmforge.checkpoint.export import open_source
    from lmforge.memory.serving import serving_memory
    from lmforge.serve.app import sized_slots
    from lmforge.serve.options import ServerOptions

    step = reference_run.latest_checkpoint
    plan = serving_memory(open_source(step, None).cfg, "fp32", 16)
    room_for_three = int((plan.weights + 3.5 * plan.kv_per_sequence) / 0.9)
    assert sized_slots(ServerOptions(model=step, name="m", memory_per_replica=room_for_three)) == 3
    assert sized_slots(ServerOptions(model=step, name="m", max_running=2, memory_per_replica=room_for_three)) == 2
    refused = run_cli("serve", step, "--memory-per-replica", str(plan.weights), cwd=tmp_path)
    assert_clean_error(refused, "--memory-per-replica:", "cannot hold the weights", "and one sequence's KV cache over the model's")


def test_serve_refuses_a_replica_larger_than_any_node(tmp_path, monkeypatch):
    """The cluster this command would start has so many CPUs: a replica that needs more
    would wait forever, so it is refused before that cluster starts."""
    import ray

    from ports import free_port

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as a fresh process: it would start its own cluster
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "m").mkdir()
    assert_clean_error(
        run_cli("serve", "m", "--cpus-per-replica", "512", "--port", str(free_port()), cwd=tmp_path),
        "--cpus-per-replica: 512, but the largest node of the cluster has",
    )


def test_serve_refuses_a_port_in_use(tmp_path):
    """As its own process (no Ray in it yet): the port is checked before a cluster starts."""
    import socket

    (tmp_path / "m").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli_process("serve", "m", "--port", str(port), cwd=tmp_path, timeout_s=120)
    assert_clean_error(result, f"127.0.0.1:{port} is in use")
