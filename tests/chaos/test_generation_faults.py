"""An instruction distillation's generation killed midway and run again: every prompt
answered once, and the same dataset as a run that nothing interrupted. A distillation
pipeline killed in its second stage and run again: it resumes there."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from chaos import Condition, actor_processes, committed, wait_until
from conftest import INSTRUCT_OPTIM, INSTRUCT_PROMPTS, instruct_job, tiny_job, with_sections, write_prompts
from lm_eval_tasks import HARNESS, HARNESS_TASKS, harness_output, offline
from lmforge.distill_jobs.stages import PipelineRecord


def test_a_killed_generation_rerun_answers_the_rest_and_writes_the_same_bytes(instruct_dataset, reference_run, tiny_corpus, ray_session, tmp_path):
    """`lmforge distill generate` is SIGKILLed once its first units are written; run
    again, it keeps those (their files untouched) and answers only the rest, and the
    dataset is byte for byte the one an uninterrupted run with the same seed wrote."""
    from lmforge import sdk
    from lmforge.distill_jobs.instruct.build import answers_dir
    from lmforge.spec import spec_from_dict

    job = instruct_job(tmp_path, Path(reference_run.run_dir), write_prompts(tmp_path / "prompts.jsonl", tiny_corpus))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    work = answers_dir(spec_from_dict(job).with_absolute_paths())
    command = [
        sys.executable,
        "-m",
        "lmforge",
        "distill",
        "generate",
        str(job_file),
        "--no-progress",
        "--address",
        ray_session.get_runtime_context().gcs_address,
    ]
    generating = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(Condition(lambda: any(work.glob("unit-*.parquet")) or generating.poll() is not None, "a first unit of answers"), timeout_s=120)
    finally:
        generating.kill()
        _, stderr = generating.communicate()
    done = {f.name: f.stat().st_mtime_ns for f in work.glob("unit-*.parquet")}
    units = INSTRUCT_PROMPTS // job["distill"]["instruct"]["prompts_per_shard"]
    assert 0 < len(done) < units, (len(done), stderr[-2000:])
    manifest = sdk.generate_answers(spec_from_dict(job), show_progress=False)
    assert {f: (Path(job["data"]["path"]) / "answers" / f).stat().st_mtime_ns for f in done} == done
    want = Path(instruct_dataset[0]["data"]["path"])
    files = sorted(p.relative_to(want) for p in want.rglob("*.parquet") if "answers" not in p.parts)
    assert files and files == sorted(
        p.relative_to(Path(job["data"]["path"])) for p in Path(job["data"]["path"]).rglob("*.parquet") if "answers" not in p.parts
    )
    for name in files:
        assert (Path(job["data"]["path"]) / name).read_bytes() == (want / name).read_bytes(), name
    assert manifest.instruct and manifest.instruct.counts == instruct_dataset[1].instruct.counts


def _answers_nll(model_dir: Path, dataset: Path) -> float:
    """A model's mean NLL per answer token over every held-out answer, by plain torch."""
    import pyarrow.parquet as pq

    from lmforge.checkpoint.export import open_source
    from lmforge.models.build import build_model

    source = open_source(model_dir)
    model = build_model(source.cfg, "cpu", weights=source.read_tensors()).eval()
    held = pq.read_table(sorted(str(f) for f in (dataset / "eval").glob("shard-*.parquet"))).to_pydict()
    tokens, mask = torch.tensor(held["tokens"], dtype=torch.long), torch.tensor(held["loss_mask"], dtype=torch.bool)
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    return losses[mask.flatten()].mean().item()


def test_a_pipeline_killed_in_its_second_stage_resumes_there(instruct_dataset, tiny_dataset, ray_session, tmp_path, monkeypatch):
    """Three stages: the tiny student on the raw corpus, then on the teachers' answers
    (kind instruct, its dataset already generated), then evaluated on the held-out
    prompts. `lmforge distill run` is SIGKILLed once the second stage committed step 4;
    run again, it leaves the first stage alone, resumes the second from step 4 with the
    first stage's student under it (on-policy steps chosen by step, before and after the
    restart), evaluates, and runs lm-evaluation-harness's tasks on the student (a harness
    stage: what `eval harness` gives on that student). One MLflow run holds the stages'."""
    from mlflow.tracking import MlflowClient

    from lmforge import sdk
    from lmforge.distill.on_policy import OnPolicy
    from lmforge.spec import spec_from_dict
    from lmforge.tracking.mlflow_run import PARENT_TAG, ROLE_TAG

    general = tiny_job(tmp_path, tiny_dataset, train={"max_steps": 4, "seed": 2}, optim=INSTRUCT_OPTIM)
    # The task stage also has on-policy steps (1-6 of 8 at its seed): the student continues the prompts, the teachers online.
    task = with_sections(
        json.loads(json.dumps(instruct_dataset[0])),
        {"train": {"max_steps": 8}, "checkpoint": {"interval": 4, "keep": 3}, "eval": {"interval": 4, "batches": 1}},
    )
    task["distill"]["on_policy"] = {"fraction": 0.5, "max_new_tokens": 8}
    (tmp_path / "general.yaml").write_text(yaml.safe_dump(general))
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(
        yaml.safe_dump(
            {
                "name": "progressive",
                "output_dir": str(tmp_path / "runs"),
                "tracking": {"experiment": "pipeline"},
                "stages": [
                    {"name": "general", "kind": "train", "job": "general.yaml"},
                    {"name": "task", "kind": "instruct", "job": "task.yaml"},
                    {"name": "check", "kind": "evaluate", "job": "task.yaml"},
                    {"name": "bench", "kind": "harness", "job": "task.yaml", "harness": {"tasks": list(HARNESS_TASKS), "include_path": str(HARNESS)}},
                ],
            }
        )
    )
    runs = tmp_path / "runs"
    command = [
        sys.executable,
        "-m",
        "lmforge",
        "distill",
        "run",
        str(pipeline),
        "--no-progress",
        "--address",
        ray_session.get_runtime_context().gcs_address,
    ]
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(committed(runs / "progressive-task", 4) | Condition(lambda: driver.poll() is not None, "the driver to exit"), timeout_s=240)
    finally:
        driver.kill()
        _, stderr = driver.communicate()
    state = PipelineRecord.model_validate_json((runs / "progressive" / "pipeline.json").read_text())
    assert list(state.stages) == ["general"], stderr[-3000:]
    saved = json.loads((runs / "progressive-task" / "checkpoints" / "step_00000004" / "state.json").read_text())
    assert [(row["event"], row["step"]) for row in saved["records"]] == [("step", 1), ("step", 2), ("step", 3), ("step", 4), ("eval", 4)]
    wait_until(
        Condition(lambda: not actor_processes("Worker") and not actor_processes("Controller"), "the killed driver's actors to exit"), timeout_s=60
    )
    first = (runs / "progressive-general" / "metrics.jsonl").read_text()

    for name, value in offline(tmp_path / "harness-home").items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(HARNESS)  # the shipped tasks name their data files relative to it
    result = sdk.run_pipeline(pipeline, show_progress=False)
    assert (runs / "progressive-general" / "metrics.jsonl").read_text() == first  # not run again
    stages = result.stages
    assert stages["task"] and stages["task"].summary and (stages["task"].summary["start_step"], stages["task"].summary["final_step"]) == (4, 8)
    steps = {
        row["step"]: row
        for row in map(json.loads, (runs / "progressive-task" / "metrics.jsonl").read_text().splitlines())
        if "loss" in row and row.get("event") is None
    }
    on_policy = OnPolicy(spec_from_dict(task), eos=0)
    assert sorted(steps) == list(range(1, 9)) and {s for s, row in steps.items() if row["on_policy"]} == {
        s for s in steps if on_policy.chooses(s)
    } == set(range(1, 7))
    assert all(("ce_loss" in row) != bool(row["on_policy"]) and row["kd_loss"] > 0 for row in steps.values())
    student = runs / "progressive" / "students"
    assert stages["check"] and stages["check"].metrics and stages["check"].answers
    check = stages["check"].metrics
    assert stages["check"].model == str(student / "task")
    assert check["answers_nll"] == pytest.approx(_answers_nll(student / "task", Path(task["data"]["path"])), rel=1e-5)
    assert check["answers_nll"] < _answers_nll(student / "general", Path(task["data"]["path"]))
    table = [json.loads(line) for line in Path(stages["check"].answers).read_text().splitlines()]
    held = {i for i in range(INSTRUCT_PROMPTS) if i % 4 == 3}
    assert len(table) == check["held_out_prompts"] and {row["prompt_index"] for row in table} <= held and table[0]["teacher_answer"]

    # The harness stage scored the last student: its samples are those of the same tasks on that student.
    bench = stages["bench"]
    assert bench and bench.model == str(student / "task") and bench.answers and bench.metrics
    alone = sdk.evaluate_harness(str(student / "task"), list(HARNESS_TASKS), include_path=str(HARNESS), out=str(tmp_path / "alone"), tracking=False)
    assert bench.metrics == {f"harness/{t}/{m.replace(',', '/')}": float(v) for t, values in alone.results.items() for m, v in values.items()}
    staged, direct = harness_output(Path(bench.answers), HARNESS_TASKS)[0], harness_output(tmp_path / "alone", HARNESS_TASKS)[0]
    assert {t: {d: row["resps"] for d, row in rows.items()} for t, rows in staged.items()} == {
        t: {d: row["resps"] for d, row in rows.items()} for t, rows in direct.items()
    }

    client = MlflowClient(result.mlflow_tracking_uri)
    runs_of = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("pipeline").experiment_id])}
    top = runs_of[result.mlflow_run_id]
    assert top.info.status == "FINISHED" and top.data.tags[ROLE_TAG] == "pipeline"
    assert top.data.metrics["bench.harness/lmforge_tiny_choice/acc/none"] == bench.metrics["harness/lmforge_tiny_choice/acc/none"]
    nested = {(r.data.tags[ROLE_TAG], r.info.run_name) for r in runs_of.values() if r.data.tags.get(PARENT_TAG) == top.info.run_id}
    assert nested == {("train", "progressive-general"), ("job", "progressive-task"), ("evaluation", "progressive-check evaluation")}, nested
    task_job = next(r for r in runs_of.values() if r.info.run_name == "progressive-task" and r.data.tags[ROLE_TAG] == "job")
    under_task = {r.data.tags[ROLE_TAG] for r in runs_of.values() if r.data.tags.get(PARENT_TAG) == task_job.info.run_id}
    assert under_task == {"train", "evaluation"}, under_task
    train_run = next(r for r in runs_of.values() if r.data.tags.get(PARENT_TAG) == task_job.info.run_id and r.data.tags[ROLE_TAG] == "train")
    assert train_run.data.params["model.init_from"] == str(student / "general")
    evaluation = next(r for r in runs_of.values() if r.info.run_name == "progressive-check evaluation")
    assert "student_answers.json" in {a.path for a in client.list_artifacts(evaluation.info.run_id)}
