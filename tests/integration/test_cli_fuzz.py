"""Generated input to the `lmforge` command line (hypothesis): flags and `--set` values,
job files, and the files a model directory holds. Each is answered by exit 0 or by
one `lmforge: error:` line and exit 2 (never a traceback, never a hang), or gets as
far as starting Ray, which this test stops at the door: whatever a command checks
before a cluster starts, it checks for every input here."""

import json
import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli import run_cli
from conftest import tiny_job

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)


class ReachedRay(BaseException):
    """Raised where the command would start or join Ray: the input passed every check
    made before (a BaseException, so the CLI's own handlers do not take it)."""


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    import lmforge.ray_runtime

    def reached(*args, **kwargs):
        raise ReachedRay()

    monkeypatch.setattr(lmforge.ray_runtime, "connect", reached)  # what every command joins or starts Ray through


def answered(*args: str, cwd: Path) -> None:
    try:
        result = run_cli(*args, cwd=cwd)
    except ReachedRay:
        return
    assert "Traceback" not in result.stderr, (args, result.stderr[-2000:])
    assert result.returncode in (0, 2), (args, result.returncode, result.stderr[-2000:])
    if result.returncode == 2:
        errors = [line for line in result.stderr.splitlines() if line.startswith(("lmforge: error:", "usage:"))]
        assert errors and len([line for line in errors if line.startswith("lmforge: error:")]) <= 1, (args, result.stderr)


TEXT = st.text(alphabet=string.printable + "[]/\\:{}é\u2028\x00", max_size=24)
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "-1", "1e999", "nan", "inf", "2**64", "18446744073709551616"]),
)
VALUES = st.one_of(NUMBERS.map(str), TEXT, st.sampled_from(["[/x]", "{a: [", "[" * 2000 + "]" * 2000, "~", "null", "true", "[1, 2]", "{}"]))
FIELDS = [
    "train.seed",
    "train.max_steps",
    "train.global_batch",
    "train.micro_batch",
    "train.seq_len",
    "parallel.dp",
    "parallel.tp",
    "optim.lr",
    "checkpoint.interval",
    "checkpoint.keep",
    "checkpoint.dir",
    "checkpoint.resume",
    "model.dim",
    "model.n_heads",
    "model.vocab_size",
    "data.path",
    "data.shard_samples",
    "data.eval_fraction",
    "output_dir",
    "name",
    "eval.interval",
    "resources.cpus_per_worker",
    "fault_tolerance.max_failures",
    "engine",
    "data.sources",
    "tracking.uri",
    "unknown.field",
]


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_dataset):
    out = tmp_path_factory.mktemp("fuzz-job")
    (out / "job.yaml").write_text(yaml.safe_dump(tiny_job(out, tiny_dataset)))
    return out


@FUZZ
@given(assignments=st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), min_size=1, max_size=3))
def test_train_with_generated_set_values(job_dir, assignments):
    sets = [arg for field, value in assignments for arg in ("--set", f"{field}={value}")]
    answered("train", "job.yaml", *sets, cwd=job_dir)


JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)
JOB_TREES = st.one_of(
    JSONISH,
    st.fixed_dictionaries(
        {"name": st.one_of(TEXT, JSONISH), "data": st.one_of(JSONISH, st.just({"path": "d"}))},
        optional={key: JSONISH for key in ("train", "model", "parallel", "checkpoint", "eval")},
    ),
)


@FUZZ
@given(tree=JOB_TREES)
def test_train_with_generated_job_files(tmp_path_factory, tree):
    where = tmp_path_factory.mktemp("fuzz-file")
    (where / "job.yaml").write_text(yaml.safe_dump(tree))
    answered("train", "job.yaml", cwd=where)


PREPARE_FLAGS = st.fixed_dictionaries(
    {},
    optional={
        "--seq-len": NUMBERS,
        "--shard-samples": NUMBERS,
        "--vocab-size": NUMBERS,
        "--eval-fraction": NUMBERS,
        "--out": st.sampled_from(["prepared", "corpus", "corpus/a.txt", "s3://no-such-bucket/x", "[/x]"]),
        "--text-column": TEXT,
    },
)


@FUZZ
@given(flags=PREPARE_FLAGS)
def test_data_prepare_with_generated_flags(s3_bucket, tmp_path_factory, flags):
    where = tmp_path_factory.mktemp("fuzz-prepare")
    (where / "corpus").mkdir()
    (where / "corpus" / "a.txt").write_text("def f(x):\n    return x\n" * 50)
    given = {"--out": "prepared", "--seq-len": "16"} | {flag: str(value) for flag, value in flags.items()}
    answered("data", "prepare", "--source", "corpus", *[arg for pair in given.items() for arg in pair], "--no-progress", cwd=where)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, hf_tokenizer):
    from hf_models import make_hf_model

    out = tmp_path_factory.mktemp("fuzz-model")
    make_hf_model(out, "untied-gqa", hf_tokenizer, seed=2)
    return out


GENERATE_FLAGS = st.fixed_dictionaries(
    {},
    optional={
        "--temperature": NUMBERS,
        "--top-p": NUMBERS,
        "--top-k": NUMBERS,
        "--repetition-penalty": NUMBERS,
        "--seed": NUMBERS,
        "--max-new-tokens": st.integers(-3, 4).map(str),
        "--stop": TEXT,
    },
)


@FUZZ
@given(flags=GENERATE_FLAGS, prompt=TEXT)
def test_generate_with_generated_flags(model_dir, flags, prompt):
    args = [arg for flag, value in flags.items() for arg in (flag, str(value))]
    answered("generate", str(model_dir), "--prompt", prompt or "x", "--max-new-tokens", "2", *args, cwd=model_dir.parent)


@FUZZ
@given(
    config=st.one_of(
        JSONISH,
        st.fixed_dictionaries(
            {"model_type": st.just("llama")},
            optional={
                key: st.one_of(st.integers(-2, 128), TEXT, JSONISH)
                for key in (
                    "hidden_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "num_hidden_layers",
                    "intermediate_size",
                    "vocab_size",
                    "head_dim",
                    "max_position_embeddings",
                )
            },
        ),
    ),
    index=st.one_of(st.none(), JSONISH, st.fixed_dictionaries({"weight_map": st.dictionaries(TEXT, st.one_of(TEXT, JSONISH), max_size=3)})),
)
def test_model_directories_with_generated_files(model_dir, tmp_path_factory, config, index):
    """A model directory whose config.json (and weight index) are generated: `generate`
    and `export` refuse it in one line or load it."""
    import shutil

    where = tmp_path_factory.mktemp("fuzz-dir") / "model"
    shutil.copytree(model_dir, where)
    (where / "config.json").write_text(json.dumps(config))
    if index is not None:
        (where / "model.safetensors.index.json").write_text(json.dumps(index))
    answered("generate", str(where), "--prompt", "x", "--max-new-tokens", "1", cwd=where.parent)
    answered("export", str(where), "--out", str(where.parent / "out"), cwd=where.parent)
