"""JobSpec validation: every contradiction is one line naming the field."""

import pytest
import yaml

from conftest import REPO
from lmforge.distill_jobs.pipeline_file import load_pipeline
from lmforge.errors import UserError
from lmforge.spec import flatten, load_spec, spec_from_dict

BASE = {"name": "t", "data": {"path": "d"}}


def test_quickstart_loads_with_defaults_filled():
    spec = load_spec(REPO / "jobs" / "quickstart.yaml")
    assert spec.parallel.dp == 2 and spec.world_size == 2
    assert spec.grad_accum == spec.train.global_batch // (spec.train.micro_batch * 2)
    assert spec.model_arch.vocab_size >= spec.data.vocab_size


def test_overrides_are_parsed_as_yaml_values():
    spec = spec_from_dict(BASE, ["train.max_steps=7", "train.precision=bf16", "optim.betas=[0.8, 0.9]"])
    assert spec.train.max_steps == 7 and spec.train.precision == "bf16"
    assert spec.optim.betas == (0.8, 0.9)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["train.bogus=1"], "train.bogus: unknown field"),
        (["train.global_batch=10", "train.micro_batch=4"], "train.global_batch"),
        (["train.seq_len=0"], "train.seq_len"),
        (["model.n_heads=3"], "model.n_heads"),
        (["model.n_kv_heads=3"], "model.n_kv_heads"),
        (["model.preset=huge"], "model.preset"),
        (["train.precision=fp8"], "train.precision"),
        (["resources.workers=3"], "resources.workers"),
        (["train.seq_len=4096"], "train.seq_len"),
        (["data.path= "], "data.path: must not be empty"),
        (["data.path=null", "data.sources=[{path: a, weight: -1}]"], "data.sources.0.weight: Input should be greater than or equal to 0"),
        (["data.path=null", "data.sources=[{path: a, weight: 0}, {path: b, weight: 0}]"], "data.sources: the weights are all 0"),
        (["data.sources=[{path: a, weight: 1}]"], "data.path: give a prepared dataset here, or a mixture as data.sources (not both)"),
        (["data.path=null"], "data.path: give a prepared dataset here, or a mixture as data.sources"),
        (["data.path=null", "data.sources=[{path: a, weight: 1}]", "data.source=corpus"], "data.source: a mixture reads prepared datasets"),
        (["data.path=null", "data.sources=[{path: a, weight: 1}]", "eval.interval=2"], "eval: measures one dataset's held-out split"),
        (["parallel.tp=3", "model.n_heads=6", "model.dim=96"], "model.n_kv_heads: 2 is not divisible by parallel.tp 3"),
        (["parallel.tp=8"], "model.n_heads: 4 is not divisible by parallel.tp 8"),
        (["parallel.tp=2", "train.seq_len=33"], "train.seq_len: 33 is not divisible by parallel.tp 2"),
        (["parallel.tp=2", "model.tie_embeddings=true"], "model.tie_embeddings"),
        (["parallel.pp=2", "model.tie_embeddings=true"], "model.tie_embeddings: not supported with parallel.pp > 1"),
        (["parallel.pp=4", "model.n_layers=2"], "model.n_layers: 2 layers cannot fill pp x virtual_stages = 4"),
        (["parallel.pp=2", "parallel.schedule=interleaved-1f1b"], "parallel.virtual_stages: interleaved-1f1b needs at least 2"),
        (["parallel.schedule=zero-bubble", "parallel.virtual_stages=2"], "parallel.schedule: zero-bubble needs pp > 1"),
        (["parallel.pp=2", "train.micro_batch=16"], "train.micro_batch: 1 micro-batches per step are fewer than the 2 pipeline stages"),
        (["parallel.pp=2", "parallel.virtual_stages=2"], "parallel.virtual_stages: 1f1b runs one stage per rank"),
        (
            [
                "parallel.pp=2",
                "model.n_layers=4",
                "parallel.schedule=interleaved-1f1b",
                "parallel.virtual_stages=2",
                "train.micro_batch=16",
                "train.global_batch=48",
            ],
            "train.micro_batch: 3 micro-batches per step must be a multiple of pp 2",
        ),
        (["parallel.activation_checkpointing=some"], "parallel.activation_checkpointing"),
        (["parallel.dp=auto"], "parallel.dp: auto needs resources.workers"),
        (["parallel.dp=auto", "parallel.tp=2", "resources.workers=3"], "parallel.dp: auto cannot split 3 workers"),
        (["parallel.dp=0"], "parallel.dp: must be >= 1"),
        (["parallel.dp=4", "parallel.dp_replicate=3"], "parallel.dp_replicate: 3 does not divide dp 4"),
        (["parallel.dp=4", "parallel.dp_replicate=2", "parallel.zero=0"], "parallel.dp_replicate: zero 0 already replicates"),
        (["parallel.cpu_offload=true"], "parallel.cpu_offload: offloads from GPU memory"),
        (["parallel.dp=2", "elastic.min_dp=3", "elastic.max_dp=2"], "elastic.min_dp: 3 is larger than elastic.max_dp 2"),
        (["parallel.dp=4", "elastic.min_dp=1", "elastic.max_dp=2"], "parallel.dp: 4 is outside elastic.min_dp..max_dp = 1..2"),
        (
            ["parallel.dp=2", "elastic.min_dp=1", "elastic.max_dp=3"],
            "elastic.max_dp: at dp 3 train.global_batch 16 is not divisible by micro_batch x dp = 4 x 3",
        ),
        (["parallel.dp=2", "elastic.min_dp=2"], "elastic.max_dp: Field required"),
        (
            ["parallel.dp=2", "elastic.min_dp=1", "elastic.max_dp=2", "fault_tolerance.max_failures=0"],
            "fault_tolerance.max_failures: 0 with elastic fails the job at the first lost node",
        ),
        (
            ["parallel.tp=2", "fault_tolerance.max_failures=1", "fault_tolerance.spares=1"],
            "fault_tolerance.spares: 1 is not a multiple of parallel.tp 2",
        ),
        (["fault_tolerance.spares=1"], "fault_tolerance.spares: spares only serve a restart"),
        (["checkpoint.keep_every=0"], "checkpoint.keep_every: Input should be greater than 0"),
        (["checkpoint.max_failed_writes=0"], "checkpoint.max_failed_writes: Input should be greater than 0"),
        (["checkpoint.every_minutes=0"], "checkpoint.every_minutes: Input should be greater than 0"),
        (["fault_tolerance.max_failures=-1"], "fault_tolerance.max_failures"),
        (["data.eval_fraction=1"], "data.eval_fraction: Input should be less than 1"),
        (["eval.interval=0"], "eval.interval: Input should be greater than 0"),
        (["eval.source=held", "data.eval_fraction=0.1"], "eval.source: a separate held-out corpus and data.eval_fraction"),
        (["distill.loss=jsd"], "distill: name one teacher (distill.teacher: PATH) or several"),
        (["distill.teacher=t", "distill.teachers=[{path: u}]"], "distill: name one teacher"),
        (["distill.teachers=[]"], "distill.teachers: List should have at least 1 item"),
        (["distill.teachers=[{path: u, weight: 0}]"], "distill.teachers.0.weight: Input should be greater than 0"),
        (["distill.teacher=t", "distill.loss=kl"], "distill.loss: Input should be 'forward_kl'"),
        (["distill.teacher=t", "distill.temperature=0"], "distill.temperature: Input should be greater than 0"),
        (["distill.teacher=t", "distill.beta=1.5"], "distill.beta: Input should be less than or equal to 1"),
        (["distill.teacher=t", "distill.skew=1"], "distill.skew: Input should be less than 1"),
        (["distill.teacher=t", "distill.kd_weight=0"], "distill: the weights of every loss term are 0"),
        (
            ["distill.teacher=t", "distill.kd_weight=0", "distill.hidden={layers: {0: 0}}", "distill.hidden_weight=0"],
            "distill: the weights of every loss term are 0",
        ),
        (
            ["distill.teacher=t", "distill.hidden={layers: {7: 0}}"],
            "distill.hidden.layers: student block 7 does not exist; the student has 2 blocks (0-1)",
        ),
        (["distill.teacher=t", "distill.hidden={layers: {0: -1}}"], "distill.hidden.layers: block indices count from 0, not 0: -1"),
        (["distill.teacher=t", "distill.hidden={layers: {}}"], "distill.hidden.layers: Dictionary should have at least 1 item"),
        (["distill.teacher=t", "distill.hidden={layers: {0: 1}, loss: l1}"], "distill.hidden.loss: Input should be 'mse' or 'cosine'"),
        (["distill.teachers=[{path: a}, {path: b}]", "distill.hidden={layers: {0: 1}}"], "distill.hidden: matches one teacher's layers"),
        (["distill.teacher=t", "distill.hidden={layers: {0: 1}}", "parallel.pp=2"], "distill.cache: with parallel.pp > 1"),
        (
            ["distill.teacher=t", "distill.cache=c"],
            "distill.cache: the cache keeps the teacher's k most likely tokens per position; set distill.top_k",
        ),
        (
            ["distill.teacher=t", "distill.cache=c", "distill.top_k=8", "distill.hidden={layers: {0: 1}}"],
            "distill.hidden: the teacher cache holds next-token targets",
        ),
        (["distill.teacher=t", "distill.top_k=5000"], "distill.top_k: 5000 is larger than the vocabulary (1024)"),
        (
            ["distill.teacher=t", "parallel.pp=2"],
            "distill.cache: with parallel.pp > 1 the teacher's targets come from an offline cache (build it with `lmforge distill cache JOB`",
        ),
        (["engine=deepspeed", "deepspeed.config={}", "checkpoint.in_memory=true"], "checkpoint.in_memory: snapshots are DCP files"),
        (
            ["distill.teacher=t", "engine=deepspeed", "deepspeed.config={}", "distill.hidden={layers: {0: 1}}"],
            "distill.hidden: the deepspeed engine distills logits only; use engine: native",
        ),
        (
            ["distill.teacher=t", "distill.on_policy={}", "parallel.pp=2"],
            "distill.on_policy: the student writes its continuations with the whole model",
        ),
        (
            ["distill.teacher=t", "distill.on_policy={}", "distill.cache=c", "distill.top_k=8"],
            "distill.on_policy: the teachers score the student's own",
        ),
        (
            ["distill.teacher=t", "distill.on_policy={}", "distill.hidden={layers: {0: 1}}"],
            "distill.on_policy: learns the teachers' token distributions",
        ),
        (
            ["distill.teacher=t", "distill.on_policy={}", "distill.kd_weight=0", "distill.ce_weight=1"],
            "distill.on_policy: its steps learn the divergence",
        ),
        (
            ["distill.teacher=t", "distill.on_policy={max_new_tokens: 256}"],
            "distill.on_policy.max_new_tokens: 256 leaves no prompt in a row of train.seq_len 128",
        ),
        (["distill.teacher=t", "distill.on_policy={fraction: 0}"], "distill.on_policy.fraction: Input should be greater than 0"),
        (
            ["distill.teacher={url: 'http://h:1/v1', model: m, top_k: 4}", "distill.hidden={layers: {0: 1}}"],
            "distill.hidden: a server gives next-token log-probabilities, not hidden states",
        ),
        (
            ["distill.teacher={url: 'http://h:1/v1', model: m, top_k: 4}", "distill.on_policy={}"],
            "distill.on_policy: the student's continuations are scored by local teachers",
        ),
        (["distill.teacher={url: 'http://h:1/v1', model: m, top_k: 4}", "distill.temperature=2"], "distill.temperature: a server gives"),
        (["distill.teacher={url: 'http://h:1/v1', model: m}"], "distill.teacher.top_k: a served teacher gives its k most likely"),
        (["distill.teacher=t", "distill.cross_tokenizer={}"], "distill.cross_tokenizer: targets projected onto the student's vocabulary are top-k"),
        (["distill.teacher=t", "distill.cross_tokenizer={method: uld}"], "distill.cross_tokenizer.method: Input should be 'projection'"),
        (
            ["distill.teacher=t", "distill.cross_tokenizer={}", "distill.top_k=8", "distill.hidden={layers: {0: 1}}"],
            "distill.cross_tokenizer: a teacher of another tokenizer has other positions",
        ),
        (
            ["distill.teacher=t", "distill.cross_tokenizer={}", "distill.top_k=8", "parallel.tp=2"],
            "distill.cross_tokenizer: an online teacher of another vocabulary is not split like the student's",
        ),
    ],
)
def test_contradictions_name_the_field(overrides, field):
    with pytest.raises(UserError) as err:
        spec_from_dict(BASE, overrides)
    message = str(err.value)
    assert message.startswith(field), message
    assert "\n" not in message


def test_missing_required_section():
    with pytest.raises(UserError, match=r"^data: Field required"):
        spec_from_dict({"name": "t"})


def test_bad_override_syntax():
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        spec_from_dict(BASE, ["train.max_steps"])


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(UserError, match="cannot read job file"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(UserError, match=rf"^{bad}: not valid YAML"):
        load_spec(bad)


def test_absolute_paths_resolve_against_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = spec_from_dict({"name": "t", "data": {"path": "d", "source": "builtin:python-stdlib"}, "eval": {"source": "held"}}).with_absolute_paths()
    assert spec.data.path == str(tmp_path / "d") and spec.eval.source == str(tmp_path / "held")
    assert spec.data.source == "builtin:python-stdlib"
    assert spec.checkpoint_dir == str(tmp_path / "runs" / "t" / "checkpoints")
    assert spec.tracking_uri == f"sqlite:///{tmp_path}/runs/mlflow.db"


def test_every_path_field_resolves_and_a_uri_stays(tmp_path, monkeypatch):
    """Fields typed as paths in any section (lists of teachers and sources included)
    resolve, whatever section they sit in; a URI is left as it is."""
    monkeypatch.chdir(tmp_path)
    teachers = [{"path": "a"}, {"path": "s3://bucket/b"}]
    cached = spec_from_dict(
        {
            "name": "t",
            "data": {"path": "d", "tokenizer": "tok.json"},
            "distill": {"teachers": teachers, "cache": "c", "top_k": 4},
            "output_dir": "out",
        }
    ).with_absolute_paths()
    assert [t.path for t in cached.distill.teachers] == [str(tmp_path / "a"), "s3://bucket/b"]
    assert (cached.distill.cache, cached.data.tokenizer, cached.output_dir) == (
        str(tmp_path / "c"),
        str(tmp_path / "tok.json"),
        str(tmp_path / "out"),
    )
    instruct = {"prompts": "p.jsonl", "chat_template": "chat.jinja"}
    answered = spec_from_dict(
        {"name": "t", "data": {"path": "sft"}, "distill": {"teacher": "a", "instruct": instruct, "top_k": 4}}
    ).with_absolute_paths()
    assert (answered.distill.teacher, answered.distill.instruct.prompts, answered.distill.instruct.chat_template) == (
        str(tmp_path / "a"),
        str(tmp_path / "p.jsonl"),
        str(tmp_path / "chat.jinja"),
    )
    mixture = spec_from_dict({"name": "t", "data": {"sources": [{"path": "x", "weight": 1}, {"path": "gs://b/y", "weight": 1}]}})
    assert [m.path for m in mixture.with_absolute_paths().data.sources] == [str(tmp_path / "x"), "gs://b/y"]


def test_evaluation_defaults_to_the_checkpoint_interval():
    assert spec_from_dict(BASE).eval_interval is None
    assert spec_from_dict(BASE, ["eval.batches=2", "checkpoint.interval=7"]).eval_interval == 7
    assert spec_from_dict(BASE, ["eval.interval=3"]).eval_interval == 3


def test_flatten_for_params():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}


def test_dp_auto_fills_the_workers():
    spec = spec_from_dict(BASE, ["parallel.dp=auto", "parallel.tp=2", "resources.workers=8", "train.global_batch=16", "train.micro_batch=2"])
    assert spec.parallel.dp == 4 and spec.world_size == 8 and spec.grad_accum == 2


@pytest.mark.parametrize("job", sorted((REPO / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_job_files_are_valid(job):
    if "stages" in yaml.safe_load(job.read_text()):  # a distillation pipeline: every stage's job is checked
        _, stages = load_pipeline(job)
        specs = [stage.job for stage in stages]
    else:
        specs = [load_spec(job)]
    for spec in specs:
        assert spec.world_size == spec.parallel.pp * spec.parallel.dp * spec.parallel.tp


def test_with_dp_resizes_and_keeps_the_global_batch():
    spec = spec_from_dict(BASE, ["parallel.dp=2", "elastic.min_dp=1", "elastic.max_dp=2", "train.global_batch=16", "train.micro_batch=2"])
    small = spec.with_dp(1)
    assert small.parallel.dp == 1 and small.train.global_batch == 16 and small.grad_accum == 8
    assert spec.grad_accum == 4 and small.elastic == spec.elastic


def test_an_elastic_job_gets_a_failure_budget_unless_it_sets_one():
    elastic = ["parallel.dp=2", "elastic.min_dp=1", "elastic.max_dp=2", "train.global_batch=16", "train.micro_batch=2"]
    assert spec_from_dict(BASE, elastic).fault_tolerance.max_failures == 3
    assert spec_from_dict(BASE, elastic).with_dp(1).fault_tolerance.max_failures == 3
    assert spec_from_dict(BASE, [*elastic, "fault_tolerance.max_failures=1"]).fault_tolerance.max_failures == 1
    assert spec_from_dict(BASE).fault_tolerance.max_failures == 0  # not elastic: unchanged


def test_several_teachers_are_mixed_by_their_normalized_weights():
    spec = spec_from_dict(BASE, ["distill.teachers=[{path: a, weight: 3}, {path: b}]"])
    assert [(t.path, t.weight) for t in spec.distill.sources] == [("a", 0.75), ("b", 0.25)]
    assert [(t.path, t.weight) for t in spec_from_dict(BASE, ["distill.teacher=a"]).distill.sources] == [("a", 1.0)]


def test_an_on_policy_instruction_distillation_runs_its_teachers_online():
    """Stored answers alone need no teacher at training time; on-policy steps score the
    student's tokens, so the teachers are built online, and soft targets become optional."""
    instruct = ["distill.teacher=t", "distill.instruct={prompts: p}", "distill.kd_weight=1"]
    with pytest.raises(UserError, match="distill.kd_weight: learning the teachers' distributions on their answers needs them stored"):
        spec_from_dict(BASE, instruct)
    on_policy = spec_from_dict(BASE, [*instruct, "distill.on_policy={}"]).distill
    assert on_policy.online and on_policy.top_k is None and on_policy.on_policy.loss == "reverse_kl"
    assert not spec_from_dict(BASE, [*instruct, "distill.top_k=4"]).distill.online
