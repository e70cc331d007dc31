"""End to end on a real local Ray cluster: 2 worker actors, gloo, FSDP2, real
Parquet shards, DCP checkpoints, a real MLflow SQLite store."""

import copy
import hashlib
import json
import math
import os
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors import safe_open
from tokenizers import Tokenizer

from cli import run_cli
from conftest import DISTILL_STEPS, DISTILL_TOP_K, reference_job, tensorboard_scalars, tiny_job, with_sections
from conftest import REFERENCE_STEPS as STEPS
from lmforge import sdk
from lmforge.checkpoint.consolidate import read_checkpoint, read_trained_tensors
from lmforge.checkpoint.export import open_source
from lmforge.data.manifest import read_manifest
from lmforge.data.order import GlobalOrder
from lmforge.distill.cross_tokenizer import AlignedTeacher, aligned_top_k
from lmforge.errors import UserError
from lmforge.models import build_model
from lmforge.models.weights import weight_names
from lmforge.spec import spec_from_dict
from lmforge.tracking.summary import RunSummary

pytestmark = pytest.mark.ray


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _step_rows(run_dir):
    """metrics.jsonl's step lines (event lines, such as "restored", have an `event` key)."""
    return [row for row in _rows(run_dir) if "event" not in row]


def _losses(run_dir):
    return {row["step"]: row["loss"] for row in _step_rows(run_dir)}


def _eval_losses(run_dir):
    evals = [row for row in _rows(run_dir) if row.get("event") == "eval"]
    assert len({row["step"] for row in evals}) == len(evals), "a step evaluated twice in metrics.jsonl"
    return {row["step"]: row["eval_loss"] for row in evals}


@pytest.fixture(scope="module")
def uninterrupted(reference_run):
    """(run directory, summary) of the reference job run straight through."""
    return Path(reference_run.run_dir), reference_run


def test_two_workers_train_and_loss_decreases(uninterrupted):
    run_dir, summary = uninterrupted
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert (losses[STEPS - 1] + losses[STEPS]) / 2 < losses[1] - 0.3, losses
    assert summary.final_step == STEPS and summary.world_size == 2
    assert summary.final_loss == pytest.approx(losses[STEPS])
    assert 0 <= summary.data_wait_fraction < 0.5


def test_run_dir_files_and_checkpoints(uninterrupted):
    run_dir, summary = uninterrupted
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert RunSummary.model_validate(on_disk) == summary and on_disk == summary.as_json()
    assert summary.tokens == STEPS * 8 * 32
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    assert summary.latest_checkpoint == str(ckpt)
    files = json.loads((ckpt / "commit.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.json"} <= set(files)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == STEPS and state["samples_consumed"] == STEPS * 8
    row = _step_rows(run_dir)[-1]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time", "data_wait"} <= set(row)
    assert 0 < row["mfu"] < 1


def test_mlflow_run_has_params_metrics_and_spec(uninterrupted):
    _, summary = uninterrupted
    client = MlflowClient(tracking_uri=summary.mlflow_tracking_uri)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.global_batch"] == "8"
    assert run.data.params["parallel.dp"] == "2"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu", "step_time", "data_wait"):
        assert len(client.get_metric_history(run.info.run_id, key)) == STEPS
    assert "job.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]
    # Artifacts beside the SQLite store, not in the driver's working directory.
    store_dir = Path(summary.mlflow_tracking_uri.removeprefix("sqlite:///")).parent
    assert run.info.artifact_uri.removeprefix("file://").startswith(str(store_dir / "mlartifacts"))
    # The prepared dataset is the run's input; its digest is the identity of its contents.
    (data_input,) = run.inputs.dataset_inputs
    data_path = Path(run.data.params["data.path"])
    manifest = read_manifest(data_path)
    identity = "\n".join([manifest.tokenizer.sha256, str(manifest.num_samples)] + [shard.sha256 or "" for shard in manifest.shards])
    assert data_input.dataset.digest == hashlib.sha256(identity.encode()).hexdigest()[:16] == run.data.params["data.digest"]
    assert (data_input.dataset.name, json.loads(data_input.dataset.source)["uri"]) == (data_path.name, str(data_path))
    assert [(tag.key, tag.value) for tag in data_input.tags] == [("mlflow.data.context", "train")]


def test_held_out_loss_every_interval(uninterrupted):
    """Every 3 steps (the reference job's eval section), on 2 batches of the held-out
    split: in metrics.jsonl, MLflow and the summary; held-out code gets easier too."""
    run_dir, summary = uninterrupted
    rows = [row for row in _rows(run_dir) if row.get("event") == "eval"]
    assert [row["step"] for row in rows] == list(range(3, STEPS + 1, 3))
    assert all(row["batches"] == 2 and row["eval_ppl"] == pytest.approx(math.exp(row["eval_loss"])) for row in rows)
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.3
    assert (summary.eval_step, summary.eval_loss, summary.eval_ppl) == (STEPS, rows[-1]["eval_loss"], rows[-1]["eval_ppl"])
    client = MlflowClient(tracking_uri=summary.mlflow_tracking_uri)
    history = client.get_metric_history(summary.mlflow_run_id, "eval_loss")
    assert {m.step: m.value for m in history} == pytest.approx({row["step"]: row["eval_loss"] for row in rows})
    assert len(client.get_metric_history(summary.mlflow_run_id, "eval_ppl")) == len(rows)


def test_resume_continues_with_identical_losses(uninterrupted, ray_session, s3_dataset, s3_bucket, tiny_dataset, tmp_path):
    """Also the object-storage run: the dataset (made from the corpus there) and the
    checkpoints live on an S3 server, the credentials in the environment only."""
    reference = _losses(uninterrupted[0])
    checkpoints = f"{s3_bucket}/resume-checkpoints"
    board = tmp_path / "tensorboard"  # written by both drivers
    job = reference_job(tmp_path, s3_dataset, train={"max_steps": 20}, checkpoint={"dir": checkpoints}, tracking={"tensorboard": str(board)})
    assert read_manifest(s3_dataset).shards == read_manifest(tiny_dataset).shards  # byte for byte, by sha256
    first = sdk.train(spec_from_dict(job, ["train.max_steps=10"]), show_progress=False)
    assert first.final_step == 10
    second = sdk.train(spec_from_dict(job), show_progress=False)
    assert second.start_step == 10 and second.final_step == 20
    assert {"step_00000010", "step_00000020"} <= {p.rsplit("/", 1)[-1] for p in fsspec.filesystem("s3").ls(checkpoints, refresh=True)}
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    assert not [p for p in (tmp_path / "runs").rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert second.mlflow_run_id == first.mlflow_run_id
    resumed = _losses(tmp_path / "runs" / "tiny")
    assert sorted(resumed) == list(range(1, 21))
    for step in range(1, 21):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step
    # Held out at 3, 6, 9, the first run's last step 10, then on: each step once.
    evals, reference_evals = _eval_losses(tmp_path / "runs" / "tiny"), _eval_losses(uninterrupted[0])
    assert sorted(evals) == [3, 6, 9, 10, 12, 15, 18, 20]
    for step in (3, 6, 9, 12, 15, 18):
        assert evals[step] == pytest.approx(reference_evals[step], rel=1e-6), step
    client = MlflowClient(tracking_uri=second.mlflow_tracking_uri)
    assert sorted(m.step for m in client.get_metric_history(second.mlflow_run_id, "loss")) == list(range(1, 21))
    scalars = tensorboard_scalars(board)
    assert [step for step, _ in scalars["loss"]] == list(range(1, 21))
    assert all(value == pytest.approx(resumed[step], rel=1e-6) for step, value in scalars["loss"])
    assert {"lr", "grad_norm", "tokens_per_s", "eval_loss"} <= scalars.keys()

    # Another seed would continue on another order: refused before anything starts,
    # unless the job says so, and then it is on the record.
    reseeded = ["train.max_steps=21", f"train.seed={job['train']['seed'] + 1}"]
    with pytest.raises(UserError, match=r"^train.seed: \d+ differs from the \d+ the checkpoint was trained with .*checkpoint.allow_data_change"):
        sdk.train(spec_from_dict(job, reseeded), show_progress=False)
    third = sdk.train(spec_from_dict(job, [*reseeded, "checkpoint.allow_data_change=true"]), show_progress=False)
    assert third.start_step == 20 and third.final_step == 21
    [changed] = [row for row in _rows(tmp_path / "runs" / "tiny") if row.get("event") == "data_changed"]
    assert changed["step"] == 20 and changed["changes"] == {"seed": [job["train"]["seed"], job["train"]["seed"] + 1]}
    assert "seed" in client.get_run(third.mlflow_run_id).data.tags["lmforge.data_changed.step_20"]


def test_a_failing_rank_tears_the_group_down_with_one_message(ray_session, tiny_dataset, tmp_path):
    """Shards replaced since they were prepared, at their sizes (so past pre-flight's
    check): their reader refuses them, naming one, and the job ends at once."""
    import shutil

    from lmforge.errors import UserError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dataset, broken)
    for shard in broken.glob("shard-*.parquet"):
        shard.write_bytes(b"x" * shard.stat().st_size)  # the manifest's sizes, not its checksums: caught as read
    with pytest.raises(UserError, match=r"^data.path: shard .*/broken/shard-\d+.parquet does not match its sha256 in manifest.json") as err:
        sdk.train(spec_from_dict(tiny_job(tmp_path, broken)), show_progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "runs" / "tiny" / "summary.json").exists()


def test_3d_run_through_the_controller_matches_data_parallel(uninterrupted, ray_session, tiny_dataset, tmp_path):
    reference = _losses(uninterrupted[0])
    job = reference_job(
        tmp_path,
        tiny_dataset,
        parallel={"dp": 2, "tp": 2, "pp": 2},
        train={"max_steps": 3},
        checkpoint={"interval": 3},
        resources={"cpus_per_worker": 0.5},
    )
    spec = spec_from_dict(job)
    summary = sdk.train(spec, show_progress=False)
    assert summary.world_size == 8
    # One reader for the job: the 8 ranks (and the reference's 2) read each shard of the
    # first window (all their steps lie in it) once between them.
    manifest = read_manifest(tiny_dataset)
    first_window = GlobalOrder(manifest.num_samples, spec.train.seed, block=manifest.shard_samples, window=spec.data.shuffle_window).blocks(0)[
        : spec.data.shuffle_window
    ]
    assert summary.data_bytes_read == uninterrupted[1].data_bytes_read == sum(manifest.shards[int(b)].bytes or 0 for b in first_window)
    assert {(r["pp"], r["dp"], r["tp"]) for r in summary.ranks} == {(p, d, t) for p in (0, 1) for d in (0, 1) for t in (0, 1)}
    losses = _losses(tmp_path / "runs" / "tiny")
    for step in (1, 2, 3):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step
    # The held-out loss is one number whatever the layout: pp2 x dp2 x tp2 gives dp 2's.
    assert _eval_losses(tmp_path / "runs" / "tiny")[3] == pytest.approx(_eval_losses(uninterrupted[0])[3], rel=1e-5)
    # Each step logs its measured pipeline bubble next to 1F1B's (p-1)/(m+p-1).
    rows = _step_rows(tmp_path / "runs" / "tiny")
    assert all(0 < row["bubble"] < 1 for row in rows)
    assert all(row["bubble_theory"] == pytest.approx(1 / (spec.grad_accum + 1)) for row in rows)


def test_deepspeed_documentation_config_trains_resumes_and_matches_native(uninterrupted, ray_session, tiny_dataset, tmp_path):
    """jobs/zero3-offload.json as written (ZeRO-3, optimizer offloaded to CPU) with the
    batch and learning rate overridden to the tiny job's: 4 steps, then a resume to
    8, equal to the native engine's uninterrupted run. The resumed run runs out of
    memory at step 6 (injected, as in the native guard's test) and goes on with half
    the micro-batch: DeepSpeed's config moves with it."""
    reference = _losses(uninterrupted[0])
    config = Path(__file__).parents[2] / "jobs" / "zero3-offload.json"
    job = reference_job(
        tmp_path, tiny_dataset, engine="deepspeed", deepspeed={"config": str(config)}, train={"max_steps": 8}, checkpoint={"interval": 4}
    )
    del job["optim"]["lr"]  # the config sets it: the job must not say otherwise
    overrides = ["deepspeed.config.train_batch_size=8", "deepspeed.config.optimizer.params.lr=0.003"]
    first = sdk.train(spec_from_dict(job, [*overrides, "train.max_steps=4"]), show_progress=False)
    second = sdk.train(spec_from_dict(job, [*overrides, "debug.oom_at_step=6", "debug.oom_above_micro_batch=1"]), show_progress=False)
    assert first.final_step == 4 and second.start_step == 4 and second.final_step == 8
    ooms = [row for row in _rows(tmp_path / "runs" / "tiny") if row.get("event") == "out_of_memory"]
    assert [(e["micro_batch"], e["retry_micro_batch"]) for e in ooms] == [(2, 1)] and second.failures == 0
    losses = _losses(tmp_path / "runs" / "tiny")
    for step in range(1, 9):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step
    evals, reference_evals = _eval_losses(tmp_path / "runs" / "tiny"), _eval_losses(uninterrupted[0])
    assert sorted(evals) == [3, 4, 6, 8]
    for step in (3, 6):
        assert evals[step] == pytest.approx(reference_evals[step], rel=1e-4), step
    ckpt = tmp_path / "runs" / "tiny" / "checkpoints" / "step_00000008"
    assert json.loads((ckpt / "state.json").read_text())["format"] == "deepspeed"
    files = json.loads((ckpt / "commit.json").read_text())["files"]
    assert any(name.startswith("deepspeed/") and "optim_states" in name for name in files), files
    params = MlflowClient(tracking_uri=second.mlflow_tracking_uri).get_run(second.mlflow_run_id).data.params
    assert params["engine"] == "deepspeed"
    assert params["deepspeed.config.zero_optimization.stage"] == "3"
    assert params["deepspeed.config.zero_optimization.offload_optimizer.device"] == "cpu"


def test_a_distillation_job_trains_through_the_controller(distill_run, tmp_path):
    """The reference run's last two committed checkpoints, read in place and mixed 3:1,
    teach a student of another seed on 2 ranks: every step records its terms in
    metrics.jsonl and MLflow, the loss is their weighted sum, and the student moves
    towards the teachers; the held-out KL to them and top-1 agreement every 6 steps,
    the KL lower than the same student's on cross-entropy alone."""
    job, summary = distill_run
    rows = _step_rows(Path(summary.run_dir))
    assert [row["step"] for row in rows] == list(range(1, DISTILL_STEPS + 1))
    for row in rows:
        assert row["loss"] == pytest.approx(0.5 * row["ce_loss"] + row["kd_loss"], rel=1e-6)
    assert rows[-1]["kd_loss"] < rows[0]["kd_loss"]
    evals = [row for row in _rows(Path(summary.run_dir)) if row.get("event") == "eval"]
    assert [row["step"] for row in evals] == [6, 12] and all(0 <= row["eval_top1"] <= 1 for row in evals)
    assert evals[-1]["eval_kl"] < evals[0]["eval_kl"]  # closer to the teachers on text it never trained on
    assert (summary.eval_kl, summary.eval_top1) == (evals[-1]["eval_kl"], evals[-1]["eval_top1"])
    client = MlflowClient(tracking_uri=summary.mlflow_tracking_uri)
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.params["distill.loss"] == "reverse_kl" and job["distill"]["teachers"][0]["path"] in run.data.params["distill.teachers"]
    commits = [hashlib.sha256((Path(t["path"]) / "commit.json").read_bytes()).hexdigest() for t in job["distill"]["teachers"]]
    assert run.data.params["distill.teachers_sha256"] == ",".join(commits)  # a checkpoint's weights: its commit record
    assert [m.value for m in sorted(client.get_metric_history(run.info.run_id, "kd_loss"), key=lambda m: m.step)] == pytest.approx(
        [row["kd_loss"] for row in rows]
    )
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_kl")] == [6, 12]
    # One parent run for the job: the training and the final evaluation nested under it.
    parent, children = _job_runs(client, summary)
    assert parent.info.status == "FINISHED" and parent.data.params["distill.teachers_sha256"] == ",".join(commits)
    assert sorted(children) == ["evaluation", "train"] and children["train"].info.run_id == run.info.run_id
    final = children["evaluation"]
    assert {k: final.data.metrics[k] for k in ("eval_kl", "eval_top1")} == {"eval_kl": summary.eval_kl, "eval_top1": summary.eval_top1}
    assert "summary.json" in {a.path for a in client.list_artifacts(final.info.run_id)}
    # Exported, the student is logged to its training run and registered under the job's name, its teachers in a tag.
    registered = sdk.export(summary.latest_checkpoint, tmp_path / "student", register=True).registered
    assert registered is not None
    version = client.get_model_version(job["name"], str(registered.version))
    assert (version.run_id, version.source) == (run.info.run_id, f"runs:/{run.info.run_id}/model")
    assert job["distill"]["teachers"][0]["path"] in version.tags["lmforge.teacher"] and version.tags["lmforge.step"] == str(DISTILL_STEPS)
    assert {"model/model.safetensors", "model/config.json"} <= {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    # The same student on cross-entropy alone (the teachers only measured): farther from them.
    alone = sdk.train(
        spec_from_dict(with_sections(copy.deepcopy(job), {"name": "ce-only", "distill": {"kd_weight": 0.0, "ce_weight": 1.0}})), show_progress=False
    )
    assert summary.eval_kl < alone.eval_kl


def test_a_lora_student_distils_through_the_cli(distill_run, tmp_path):
    """The distillation job with `model.lora`, through `lmforge train` with its progress
    shown: the checkpoint's frozen weights are the seeded start's, bit for bit, the
    adapters moved and the KD term falls; MLflow has the LoRA fields; `lmforge export
    --format peft` writes the adapters alone, and the default export a plain model."""
    job, _ = distill_run
    job = with_sections(copy.deepcopy(job), {"name": "lora-student", "model": {"lora": {"rank": 4, "alpha": 16}}, "optim": {"lr": 2e-2}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = run_cli("train", "job.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run_dir = Path(job["output_dir"]) / "lora-student"
    rows = _step_rows(run_dir)
    assert len(rows) == DISTILL_STEPS and rows[-1]["kd_loss"] < rows[0]["kd_loss"]
    checkpoint = run_dir / "checkpoints" / f"step_{DISTILL_STEPS:08d}"
    cfg, tensors, state = read_trained_tensors(checkpoint)
    start = build_model(cfg, seed=job["train"]["seed"]).state_dict()
    assert state.lora is not None and state.lora.rank == 4
    assert all(torch.equal(tensors[name], start[name]) for name in weight_names(cfg)), "a frozen weight moved"
    assert all(tensors[name].abs().max() > 0 for name in tensors if name.endswith("lora_b"))  # B starts at 0: it learnt
    summary = json.loads((run_dir / "summary.json").read_text())
    params = MlflowClient(tracking_uri=summary["mlflow_tracking_uri"]).get_run(summary["mlflow_run_id"]).data.params
    assert (params["model.lora.rank"], params["model.lora.targets"]) == ("4", str(state.lora.targets))
    exported = run_cli("export", str(checkpoint), "--format", "peft", "--out", "adapter", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 16)
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as adapter:
        assert len(list(adapter.keys())) == 2 * 7 * cfg.n_layers
    assert run_cli("export", str(checkpoint), "--out", "merged", cwd=tmp_path).returncode == 0
    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as merged:
        assert sorted(merged.keys()) == sorted(weight_names(cfg))


def _job_runs(client, summary: RunSummary):
    """A distillation job's parent run, and its child runs by role."""
    parent = client.get_run(summary.mlflow_parent_run_id)
    children = client.search_runs([parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, {child.data.tags["lmforge.role"]: child for child in children}


def _teacher_top_k(job: dict, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teachers' mixture's top k for one sample, by plain torch: the reference for the cache."""
    from lmforge.models.build import build_model

    d = job["distill"]
    total = sum(t["weight"] for t in d["teachers"])
    parts = []
    for teacher in d["teachers"]:
        cfg, weights, _ = read_checkpoint(teacher["path"])
        with torch.no_grad():
            logits = build_model(cfg, weights=weights).eval()(tokens[None, :-1])[0]
        parts.append(torch.log_softmax(logits.double() / d["temperature"], dim=-1) + math.log(teacher["weight"] / total))
    return torch.logsumexp(torch.stack(parts), dim=0).topk(d["top_k"], dim=-1)


def test_training_from_the_teacher_cache_matches_the_online_teachers(distill_run, distill_cache, tiny_dataset):
    """`lmforge distill cache` (through the SDK) mirrors the dataset's shards row for row,
    both splits, holding the teachers' mixed top-k at the temperature; the same job
    trained from it on one rank gives the two-rank online run's losses, terms and top-1
    agreement (the cache keeps log-probabilities in fp16: within 2e-3, and a token)."""
    job, manifest = distill_cache
    cache, dataset = Path(job["distill"]["cache"]), read_manifest(tiny_dataset)
    assert dataset.eval is not None
    for split, shards in (("", dataset.shards), ("eval", dataset.eval.shards)):
        for shard in shards:
            ids = pq.read_table(cache / split / shard.file, columns=["sample_id"]).column("sample_id").to_pylist()
            assert ids == list(range(shard.first_sample_id, shard.first_sample_id + shard.num_samples))
    first = pq.read_table(cache / dataset.shards[0].file).slice(0, 1).to_pylist()[0]
    tokens = torch.tensor(pq.read_table(tiny_dataset / dataset.shards[0].file).slice(0, 1).column("tokens")[0].as_py())
    values, top = _teacher_top_k(job, tokens)
    got_ids = torch.tensor(first["topk_ids"]).view(dataset.seq_len, -1)
    assert (got_ids == top).float().mean() > 0.99  # fp32 against float64: a near-tie may swap neighbours
    assert torch.tensor(first["topk_logprobs"]).view_as(values).double() == pytest.approx(values, abs=2e-2)
    size = sum((cache / s.file).stat().st_size for s in dataset.shards)
    assert manifest.bytes == size and manifest.bytes_per_token == round(size / (dataset.num_samples * dataset.seq_len), 2)
    assert manifest.bytes_per_token < manifest.dense_bf16_bytes_per_token / 4
    assert manifest.k == 32 and [t.weight for t in manifest.teachers] == [0.75, 0.25]

    online_job, online = distill_run
    cached = sdk.train(spec_from_dict(with_sections(copy.deepcopy(job), {"parallel": {"dp": 1}})), show_progress=False)
    want, got = _step_rows(Path(online.run_dir)), _step_rows(Path(cached.run_dir))
    assert [row["step"] for row in got] == list(range(1, DISTILL_STEPS + 1))
    for term in ("loss", "ce_loss", "kd_loss"):
        assert [row[term] for row in got] == pytest.approx([row[term] for row in want], rel=2e-3)
    # Top-1 agreement over the 512 held-out tokens: a student trained on the fp16 targets
    # may take the other side of a near-tie at a token (seen: 33 of 512 against 34).
    assert cached.eval_top1 == pytest.approx(online.eval_top1, abs=1.5 / 512) and cached.eval_kl > 0
    client = MlflowClient(tracking_uri=cached.mlflow_tracking_uri)
    params = client.get_run(cached.mlflow_run_id).data.params
    assert params["distill.cache.k"] == "32" and float(params["distill.cache.bytes_per_token"]) == manifest.bytes_per_token
    assert json.loads(params["distill.cache.teachers"]) == [t.model_dump() for t in manifest.teachers]
    # The cache's build is a child run of the same job as the training from it.
    _, children = _job_runs(client, cached)
    assert sorted(children) == ["cache", "evaluation", "train"]
    build = children["cache"]
    assert build.info.status == "FINISHED" and build.data.metrics["bytes_per_token"] == manifest.bytes_per_token
    assert build.data.params["distill.cache.k"] == "32" and build.data.metrics["tokens_per_s"] > 0


@pytest.fixture(scope="module")
def other_tokenizer_dataset(reference_run, ray_session, tiny_corpus, tmp_path_factory) -> Path:
    """The teacher's own writing in a byte-level BPE of its own (384 tokens against the
    teacher's 512, so cut into other tokens): 160 continuations of 96 tokens it sampled
    at temperature 1 from lines of the corpus, one document each, one in ten held out."""
    from lmforge.data.prepare import prepare_dataset
    from lmforge.data.prepare_options import PrepareOptions
    from lmforge.inference.generate import Generator
    from lmforge.inference.sampling import SamplingParams

    teacher = Generator.load(str(Path(reference_run.run_dir) / "checkpoints" / f"step_{STEPS:08d}"))
    lines = [line.strip()[:24] for f in sorted(tiny_corpus.iterdir()) for line in f.read_text().splitlines() if len(line.strip()) > 8]
    prompts = lines[:: max(1, len(lines) // 160)][:160]
    answers = teacher.generate(prompts, SamplingParams(max_new_tokens=96, temperature=1.0, seed=0))
    corpus = tmp_path_factory.mktemp("teacher-text")
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        (corpus / f"{i:03d}.txt").write_text(prompt + answer.text)
    out = tmp_path_factory.mktemp("data") / "teacher-text-32"
    prepare_dataset(PrepareOptions(source=str(corpus), out=str(out), seq_len=32, vocab_size=384, eval_fraction=0.1, show_progress=False))
    return out


def _cross_tokenizer_job(job: dict, dataset: Path, **distill) -> dict:
    """The distillation job on `dataset`, its first teacher alone read through its own tokenizer."""
    teacher = job["distill"]["teachers"][0]["path"]
    settings = {"teacher": teacher, "cross_tokenizer": {"method": "projection"}, "loss": "forward_kl", "ce_weight": 1.0, "temperature": 1.0}
    job = with_sections(copy.deepcopy(job), {"name": "cross-tokenizer", "data": {"path": str(dataset)}})
    job["distill"] = {key: value for key, value in job["distill"].items() if key != "teachers"} | settings | distill
    return job


@pytest.fixture(scope="module")
def cross_tokenizer_run(distill_run, other_tokenizer_dataset, tmp_path_factory) -> tuple[dict, Path]:
    """(the job, its run directory) of the cross-tokenizer job run through `lmforge train`."""
    job, tmp = _cross_tokenizer_job(distill_run[0], other_tokenizer_dataset), tmp_path_factory.mktemp("cross-tokenizer")
    (tmp / "job.yaml").write_text(yaml.safe_dump(job))
    result = run_cli("train", "job.yaml", cwd=tmp)
    assert result.returncode == 0, result.stderr
    return job, Path(job["output_dir"]) / job["name"]


def test_a_student_of_another_tokenizer_learns_from_the_teacher_through_the_cli(cross_tokenizer_run):
    """`distill.cross_tokenizer` through `lmforge train`: a student whose 384-token BPE
    cuts the teacher's writing otherwise than the teacher's own tokenizer learns the
    teacher's projected top-k where the two align, and ends with a lower held-out NLL
    on the teacher's text than the same student trained on that text alone (the teacher
    only measured)."""
    job, run_dir = cross_tokenizer_run
    rows = _step_rows(run_dir)
    assert len(rows) == DISTILL_STEPS and rows[-1]["kd_loss"] < rows[0]["kd_loss"]
    distilled = json.loads((run_dir / "summary.json").read_text())
    alone = sdk.train(
        spec_from_dict(with_sections(copy.deepcopy(job), {"name": "cross-tokenizer-ce", "distill": {"kd_weight": 0.0}})), show_progress=False
    )
    assert 0 < distilled["eval_top1"] and distilled["eval_kl"] < alone.eval_kl
    assert distilled["eval_loss"] < alone.eval_loss, (distilled["eval_loss"], alone.eval_loss)


def test_a_cross_tokenizer_cache_holds_the_projected_targets_and_trains_as_online(cross_tokenizer_run, other_tokenizer_dataset):
    """The same job's offline cache: each row's targets are the teacher's projected top-k
    in the student's ids, -1 where the two tokenizations do not align (computed again
    here in-process); trained from it on one rank, the two-rank online run's losses
    (the cache keeps fp16 log-probabilities: within 2e-3)."""
    online_job, online_dir = cross_tokenizer_run
    job = with_sections(copy.deepcopy(online_job), {"name": "cross-tokenizer-cached", "parallel": {"dp": 1}})
    job["distill"]["cache"] = str(Path(job["output_dir"]) / "cross-tokenizer-cache")
    manifest = sdk.build_cache(spec_from_dict(job), show_progress=False)
    dataset = read_manifest(other_tokenizer_dataset)
    assert manifest.cross_tokenizer == "projection" and manifest.vocab == dataset.tokenizer.vocab_size
    rows = pq.read_table(Path(job["distill"]["cache"]) / dataset.shards[0].file).slice(0, 2).to_pylist()
    tokens = torch.tensor(pq.read_table(other_tokenizer_dataset / dataset.shards[0].file).slice(0, 2).column("tokens").to_pylist())
    student = Tokenizer.from_file(str(other_tokenizer_dataset / dataset.tokenizer.file))
    teacher_path = job["distill"]["teacher"]
    cfg, weights, _ = read_checkpoint(teacher_path)
    teacher = build_model(cfg, weights=weights).eval()
    side = AlignedTeacher(teacher, student, open_source(teacher_path).tokenizer(), teacher.cfg.vocab_size)
    want = aligned_top_k([side], tokens[:, :-1], 1.0, DISTILL_TOP_K, dataset.tokenizer.vocab_size)
    got_ids = torch.tensor([row["topk_ids"] for row in rows]).view_as(want.ids)
    assert torch.equal(got_ids[..., 0] >= 0, want.aligned) and 0.3 < float(want.aligned.float().mean()) < 1
    assert (got_ids[want.aligned] == want.ids[want.aligned]).float().mean() > 0.99
    got_logprobs = torch.tensor([row["topk_logprobs"] for row in rows]).view_as(want.logprobs).float()
    assert got_logprobs[want.aligned] == pytest.approx(want.logprobs[want.aligned], abs=2e-2)
    cached = sdk.train(spec_from_dict(job), show_progress=False)
    want_rows, got_rows = _step_rows(online_dir), _step_rows(Path(cached.run_dir))
    for term in ("loss", "ce_loss", "kd_loss"):
        assert [row[term] for row in got_rows] == pytest.approx([row[term] for row in want_rows], rel=2e-3)
