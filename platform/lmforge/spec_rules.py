"""Cross-field rules of a job: what one section requires of another (layouts that
divide, an engine's own settings, elastic bounds). Each raises ValueError naming
the field; `JobSpec` runs them all after parsing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from lmforge.deepspeed_config import reconcile as reconcile_deepspeed
from lmforge.models.config import ModelConfig
from lmforge.models.lora_config import nf4_refusal, rank_refusal

if TYPE_CHECKING:
    from lmforge.spec import JobSpec


def check_model(model: ModelConfig) -> None:
    if model.dim % model.n_heads:
        raise ValueError(f"model.n_heads: dim {model.dim} is not divisible by n_heads {model.n_heads}")
    if model.n_heads % model.n_kv_heads:
        raise ValueError(f"model.n_kv_heads: n_heads {model.n_heads} is not divisible by n_kv_heads {model.n_kv_heads}")
    if model.head_dim % 2:
        raise ValueError(f"model.dim: head_dim {model.head_dim} must be even for rotary embeddings")


def check_engine(spec: "JobSpec") -> None:
    if spec.engine == "native":
        if spec.deepspeed is not None:
            raise ValueError("deepspeed: set engine: deepspeed to use a DeepSpeed config")
        return
    if spec.deepspeed is None:
        raise ValueError("deepspeed: engine: deepspeed needs a deepspeed.config (a mapping or a JSON file)")
    if spec.checkpoint.in_memory:
        raise ValueError(
            "checkpoint.in_memory: snapshots are DCP files of the native engine's state; the deepspeed engine checkpoints to storage only"
        )
    p = spec.parallel
    if p.tp > 1 or p.pp > 1:
        raise ValueError("parallel.tp: the deepspeed engine runs data parallelism only; use engine: native for tp or pp")
    if "compile" in p.model_fields_set:
        raise ValueError("parallel.compile: the deepspeed engine does not compile the model; use engine: native to compile")
    for field in ("zero", "dp_replicate", "cpu_offload"):
        if field in p.model_fields_set:
            raise ValueError(f"parallel.{field}: a native-engine setting; with deepspeed it belongs in deepspeed.config")
    if isinstance(spec.deepspeed.config, str):
        raise ValueError(f"deepspeed.config: {spec.deepspeed.config} was not read; load the job with load_spec or spec_from_dict")
    spec.deepspeed.config = reconcile_deepspeed(spec)


def check_elastic(spec: "JobSpec") -> None:
    """Every dp the job may shrink or grow to must keep the global batch whole."""
    e, p, train = spec.elastic, spec.parallel, spec.train
    if e is None:
        return
    if spec.engine != "native":
        raise ValueError("elastic: resizing is supported with engine: native only (so far)")
    if e.min_dp > e.max_dp:
        raise ValueError(f"elastic.min_dp: {e.min_dp} is larger than elastic.max_dp {e.max_dp}")
    if not e.min_dp <= p.dp <= e.max_dp:
        raise ValueError(f"parallel.dp: {p.dp} is outside elastic.min_dp..max_dp = {e.min_dp}..{e.max_dp}")
    if p.dp_replicate > 1:
        raise ValueError("elastic: not combined with parallel.dp_replicate (HSDP) yet")
    _elastic_failure_budget(spec.fault_tolerance)
    for dp in range(e.min_dp, e.max_dp + 1):
        if train.global_batch % (train.micro_batch * dp):
            raise ValueError(
                f"elastic.max_dp: at dp {dp} train.global_batch {train.global_batch} is not divisible by "
                f"micro_batch x dp = {train.micro_batch} x {dp}; every dp in {e.min_dp}..{e.max_dp} must keep it whole"
            )
        accum = train.global_batch // (train.micro_batch * dp)
        if p.pp > 1 and p.schedule != "gpipe" and accum < p.pp:
            raise ValueError(f"elastic.max_dp: at dp {dp} there are {accum} micro-batches per step, fewer than pp {p.pp}")


ELASTIC_MAX_FAILURES = 3


def _elastic_failure_budget(budget) -> None:
    """An elastic range is written to survive lost nodes: without restarts it could
    not, so an elastic job gets a budget unless it sets one, and may not set none."""
    if "max_failures" not in budget.model_fields_set:
        budget.max_failures = ELASTIC_MAX_FAILURES
    elif budget.max_failures == 0:
        raise ValueError(
            "fault_tolerance.max_failures: 0 with elastic fails the job at the first lost node instead of shrinking it; "
            f"set at least 1, or leave it out (elastic jobs default to {ELASTIC_MAX_FAILURES})"
        )


def check_sharding(spec: "JobSpec") -> None:
    p = spec.parallel
    if p.dp % p.dp_replicate:
        raise ValueError(f"parallel.dp_replicate: {p.dp_replicate} does not divide dp {p.dp}")
    if p.dp_replicate > 1 and p.zero == 0:
        raise ValueError("parallel.dp_replicate: zero 0 already replicates every DP rank; use zero 2 or 3 for HSDP")
    if p.cpu_offload and spec.resources.gpus_per_worker == 0:
        raise ValueError("parallel.cpu_offload: offloads from GPU memory; it needs resources.gpus_per_worker > 0")


def check_tensor_parallel(spec: "JobSpec", model: ModelConfig) -> None:
    tp = spec.parallel.tp
    refusal = tensor_parallel_refusal(model, tp)
    if refusal:
        raise ValueError(refusal)
    if tp > 1 and spec.parallel.sequence_parallel and spec.train.seq_len % tp:
        raise ValueError(f"train.seq_len: {spec.train.seq_len} is not divisible by parallel.tp {tp} (sequence parallel)")


def tensor_parallel_refusal(model: ModelConfig, tp: int) -> Optional[str]:
    """Why `model` cannot be split over `tp` tensor-parallel ranks (the field first), or None."""
    if tp > 1 and model.n_experts:
        return "model.n_experts: a mixture of experts trains with data and pipeline parallelism (FSDP shards the experts); parallel.tp must be 1"
    if tp == 1:
        return None
    for field, value in (
        ("n_heads", model.n_heads),
        ("n_kv_heads", model.n_kv_heads),
        ("ffn_hidden", model.ffn_hidden),
        ("vocab_size", model.vocab_size),
    ):
        if value % tp:
            return f"model.{field}: {value} is not divisible by parallel.tp {tp}"
    if model.tie_embeddings:
        return "model.tie_embeddings: not supported with parallel.tp > 1 (embedding and head are sharded differently)"
    return None


def check_pipeline(spec: "JobSpec", model: ModelConfig) -> None:
    p = spec.parallel
    looped = p.schedule in ("interleaved-1f1b", "zero-bubble")
    if looped and p.pp == 1:
        raise ValueError(f"parallel.schedule: {p.schedule} needs pp > 1")
    if not looped and p.virtual_stages > 1:
        raise ValueError(f"parallel.virtual_stages: {p.schedule} runs one stage per rank; use interleaved-1f1b or zero-bubble")
    if p.schedule == "interleaved-1f1b" and p.virtual_stages < 2:
        raise ValueError("parallel.virtual_stages: interleaved-1f1b needs at least 2 stages per rank")
    if p.schedule == "zero-bubble" and p.virtual_stages != 2:
        raise ValueError("parallel.virtual_stages: zero-bubble (ZBV) runs exactly 2 stages per rank")
    if p.pp == 1:
        return
    if model.tie_embeddings:
        # Each stage is its own module: the first stage's embedding and the last's head
        # would train as two separate weights, silently untied.
        raise ValueError(
            "model.tie_embeddings: not supported with parallel.pp > 1 (the embedding and the head are on different stages); set it to false"
        )
    stages = p.pp * p.virtual_stages
    if model.n_layers < stages:
        raise ValueError(f"model.n_layers: {model.n_layers} layers cannot fill pp x virtual_stages = {stages} stages")
    micro = spec.grad_accum
    if p.schedule != "gpipe" and micro < p.pp:
        raise ValueError(f"train.micro_batch: {micro} micro-batches per step are fewer than the {p.pp} pipeline stages ({p.schedule})")
    if looped and micro % p.pp:
        raise ValueError(f"train.micro_batch: {micro} micro-batches per step must be a multiple of pp {p.pp} for {p.schedule}")


def check_spares(spec: "JobSpec") -> None:
    spares, tp = spec.fault_tolerance.spares, spec.parallel.tp
    if spares and spares % tp:
        raise ValueError(f"fault_tolerance.spares: {spares} is not a multiple of parallel.tp {tp} (a spare replaces a whole tensor-parallel group)")
    if spares and spec.fault_tolerance.max_failures == 0:
        raise ValueError("fault_tolerance.spares: spares only serve a restart; set fault_tolerance.max_failures too")


def check_slow_rank(spec: "JobSpec") -> None:
    slow = spec.debug.slow_rank
    if slow is not None and slow >= spec.world_size:
        raise ValueError(f"debug.slow_rank: {slow} is not a rank of the job's {spec.world_size}")


def check_mixture(spec: "JobSpec") -> None:
    """A mixture trains a model on blended pretraining data; measuring and distilling
    read one dataset's own splits and shards."""
    if spec.data.sources is None:
        return
    if spec.eval is not None:
        raise ValueError("eval: measures one dataset's held-out split; a mixture (data.sources) has none: drop eval, or train on data.path")
    if spec.data.eval_fraction:
        raise ValueError("data.eval_fraction: a setting for preparing data.source; a mixture (data.sources) reads datasets prepared already")
    if spec.distill is not None:
        raise ValueError("distill: reads one dataset (its teacher cache mirrors its shards); give data.path instead of data.sources")


def check_eval(spec: "JobSpec") -> None:
    if spec.eval is not None and spec.eval.source and spec.data.eval_fraction:
        raise ValueError("eval.source: a separate held-out corpus and data.eval_fraction both make the held-out split; keep one")


def check_distill(spec: "JobSpec", model: ModelConfig) -> None:
    distill = spec.distill
    if distill is None:
        return
    if distill.top_k is not None and distill.top_k > model.vocab_size:
        raise ValueError(f"distill.top_k: {distill.top_k} is larger than the vocabulary ({model.vocab_size})")
    if spec.engine == "deepspeed" and distill.hidden is not None:
        raise ValueError("distill.hidden: the deepspeed engine distills logits only; use engine: native for hidden-state distillation")
    if distill.hidden is not None:
        check_hidden_layers(distill.hidden.layers, model.n_layers, "student", "keys")
    if distill.on_policy is not None:
        check_on_policy(spec)
    if distill.cross_tokenizer is not None and distill.online and spec.parallel.tp > 1:
        raise ValueError(
            "distill.cross_tokenizer: an online teacher of another vocabulary is not split like the student's; "
            "use parallel.tp: 1, or train from an offline cache (distill.cache), which has no such limit"
        )
    if spec.parallel.pp > 1 and distill.cache is None and distill.instruct is None and distill.served is None:
        raise ValueError(
            "distill.cache: with parallel.pp > 1 the teacher's targets come from an offline cache "
            "(build it with `lmforge distill cache JOB`, then set distill.cache and distill.top_k)"
        )


def check_lora(spec: "JobSpec", model: ModelConfig) -> None:
    lora = spec.model.lora
    if lora is None:
        return
    refusal = rank_refusal(model, lora)
    if refusal:
        raise ValueError(f"model.lora.rank: {refusal}")
    if lora.quantize:
        check_quantized_base(spec, model)


def check_quantized_base(spec: "JobSpec", model: ModelConfig) -> None:
    """QLoRA: a base model read from a directory, held in NF4 by the native engine's FSDP2."""
    if spec.model.init_from is None:
        raise ValueError("model.lora.quantize: nf4 holds a trained base in 4 bits; set model.init_from to its directory")
    if spec.engine != "native" or spec.parallel.tp > 1:
        raise ValueError("model.lora.quantize: an NF4 base trains with the native engine under data and pipeline parallelism (tp 1)")
    refusal = nf4_refusal(model, spec.model.lora)
    if refusal:
        raise ValueError(f"model.lora.quantize: {refusal}")


def check_on_policy(spec: "JobSpec") -> None:
    """The student generates with whole-model forwards: every rank holds every layer."""
    if spec.parallel.pp > 1:
        raise ValueError(
            "distill.on_policy: the student writes its continuations with the whole model on each rank, which "
            "pipeline parallelism splits; use parallel.pp: 1 (data and tensor parallelism work)"
        )
    new_tokens = spec.distill.on_policy.max_new_tokens
    if new_tokens >= spec.train.seq_len:
        raise ValueError(f"distill.on_policy.max_new_tokens: {new_tokens} leaves no prompt in a row of train.seq_len {spec.train.seq_len}; use fewer")


def check_hidden_layers(layers: dict[int, int], n_layers: int, whose: str, side: str) -> None:
    """Every block `distill.hidden.layers` names on one side exists in that model."""
    named = layers.keys() if side == "keys" else layers.values()
    missing = sorted(i for i in named if i >= n_layers)
    if missing:
        raise ValueError(f"distill.hidden.layers: {whose} block {missing[0]} does not exist; the {whose} has {n_layers} blocks (0-{n_layers - 1})")
