"""An instruction distillation's generation killed midway and run again: every prompt
answered once, and the same dataset as a run that nothing interrupted."""

import subprocess
import sys
from pathlib import Path

import yaml

from chaos import Condition, wait_until
from conftest import INSTRUCT_PROMPTS, instruct_job, write_prompts


def test_a_killed_generation_rerun_answers_the_rest_and_writes_the_same_bytes(instruct_dataset, reference_run, tiny_corpus, ray_session, tmp_path):
    """`lmforge distill generate` is SIGKILLed once its first units are written; run
    again, it keeps those (their files untouched) and answers only the rest, and the
    dataset is byte for byte the one an uninterrupted run with the same seed wrote."""
    from lmforge import sdk
    from lmforge.distill.instruct.build import answers_dir
    from lmforge.spec import spec_from_dict

    job = instruct_job(tmp_path, Path(reference_run["run_dir"]), write_prompts(tmp_path / "prompts.jsonl", tiny_corpus))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    work = answers_dir(spec_from_dict(job).with_absolute_paths())
    command = [sys.executable, "-m", "lmforge", "distill", "generate", str(job_file), "--no-progress", "--address", ray_session.get_runtime_context().gcs_address]
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
    assert files and files == sorted(p.relative_to(Path(job["data"]["path"])) for p in Path(job["data"]["path"]).rglob("*.parquet") if "answers" not in p.parts)
    for name in files:
        assert (Path(job["data"]["path"]) / name).read_bytes() == (want / name).read_bytes(), name
    assert manifest["instruct"]["counts"] == instruct_dataset[1]["instruct"]["counts"]
