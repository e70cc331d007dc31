"""The job's `deepspeed` section: a DeepSpeed config reconciled with the job.

Each setting the job and DeepSpeed both know (batch sizes, precision, clipping,
AdamW's hyper-parameters) has one value: set in one place it fills the other,
set in both it must agree. What DeepSpeed would silently accept but not use (an
unknown top-level key) is refused. Importing this module does not import DeepSpeed.
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

from lmforge.jsonfile import read_object

# DeepSpeed's top-level config keys (each is read somewhere in deepspeed 0.19).
KNOWN_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "bfloat16",
        "amp",
        "torch_autocast",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "sparse_gradients",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "aio",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "memory_breakdown",
        "flops_profiler",
        "activation_checkpointing",
        "sparse_attention",
        "data_efficiency",
        "curriculum_learning",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "elasticity",
        "autotuning",
        "checkpoint",
        "data_types",
        "compression_training",
        "pipeline",
        "eigenvalue",
        "progressive_layer_drop",
        "quantize_training",
        "hybrid_engine",
        "nebula",
        "weight_quantization",
        "compile",
        "dataloader_drop_last",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "graph_harvesting",
        "timers",
        "disable_allgather",
        "use_data_before_expert_parallelism",
        "tensor_parallel",
        "sequence_parallel_size",
        "expert_parallel",
        "zenflow",
    }
)
# Sections DeepSpeed reads but that take effect only with what lmforge does not do
# (a model built from DeepSpeed's modules, its launcher, its data loader, a call to
# `engine.compile()`), or that would re-shard ranks lmforge feeds as data-parallel:
# asked for, each is refused with the reason, instead of accepted and not applied.
NOT_APPLIED = {
    "activation_checkpointing": "works only in a model that calls deepspeed.checkpointing; set parallel.activation_checkpointing",
    "pipeline": "needs a DeepSpeed PipelineModule; the deepspeed engine runs data parallelism only (engine: native for parallel.pp)",
    "elasticity": "elastic batch sizes for DeepSpeed's own launcher; lmforge's elastic training is the job's `elastic` section",
    "autotuning": "runs through the deepspeed launcher, not a training job",
    "sparse_attention": "needs DeepSpeed's sparse attention modules in the model",
    "curriculum_learning": "schedules DeepSpeed's data sampler; lmforge's feed decides the data order",
    "data_efficiency": "schedules DeepSpeed's data sampler; lmforge's feed decides the data order",
    "dataloader_drop_last": "applies to DeepSpeed's data loader; lmforge's feed reads the data",
    "progressive_layer_drop": "needs a model that takes DeepSpeed's layer-drop arguments",
    "eigenvalue": "serves progressive layer drop and quantized training, which lmforge does not run",
    "quantize_training": "needs DeepSpeed's compression applied to the model; `lmforge quantize` quantizes a trained one",
    "compression_training": "needs DeepSpeed's compression applied to the model; `lmforge quantize` quantizes a trained one",
    "weight_quantization": "needs DeepSpeed's compression applied to the model; `lmforge quantize` quantizes a trained one",
    "hybrid_engine": "DeepSpeed-Chat's generation engine for RLHF, which lmforge does not run",
    "compile": "lmforge does not call DeepSpeed's engine.compile(); use engine: native with parallel.compile",
    "tensor_parallel": "AutoTP would shard the model across ranks lmforge feeds as data-parallel; use engine: native with parallel.tp",
    "sequence_parallel_size": "needs the model's attention wrapped for Ulysses; lmforge feeds every rank whole sequences",
    "expert_parallel": "AutoEP would shard experts across ranks lmforge feeds as data-parallel; engine: native trains experts under FSDP",
    "use_data_before_expert_parallelism": "belongs to expert parallelism, which lmforge does not run with DeepSpeed",
}
OFFLOAD_DEVICES = ("cpu", "nvme", "none")
ADAM_TYPES = ("adam", "adamw")
FIELD = "deepspeed.config"


def inline_config_file(tree: dict, base_dir: str | os.PathLike) -> None:
    """Replace `deepspeed.config: <file.json>` by the file's mapping (so `--set
    deepspeed.config.key=value` reaches it), remembering the file in `config_file`."""
    section = tree.get("deepspeed")
    if not isinstance(section, dict) or not isinstance(section.get("config"), str):
        return
    path = Path(base_dir, section["config"]).resolve()
    try:
        config = read_object(path)
    except ValueError as err:
        raise ValueError(f"{FIELD}: {err}") from None
    section["config"], section["config_file"] = config, str(path)


def _unset(value: Any) -> bool:
    return value is None or value == "auto"  # "auto": the Hugging Face convention for "fill me in"


def _one_value(config: dict, key: str, section: Any, field: str, where: str, label: str | None = None) -> None:
    """Make config[key] and section.field one value; a contradiction names both."""
    explicit = field in section.model_fields_set
    ours = getattr(section, field)
    theirs = config.get(key)
    if _unset(theirs):
        config[key] = ours
    elif explicit and theirs != ours:
        raise ValueError(f"{FIELD}.{label or key}: {theirs!r} contradicts {where}.{field} {ours!r} (set it in one place)")
    else:
        setattr(section, field, theirs)


def reconcile(spec) -> dict:
    """The DeepSpeed config to run with; updates the job's fields that DeepSpeed set."""
    config = copy.deepcopy(spec.deepspeed.config)
    _check_keys(config)
    _batch(config, spec.train, spec.parallel.dp)
    _precision(config, spec.train)
    _clipping(config, spec.optim)
    _optimizer(config, spec.optim)
    _zero(config)
    return config


def _check_keys(config: dict) -> None:
    for key in sorted(config):
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ValueError(f"{FIELD}.{key}: not a DeepSpeed setting (DeepSpeed would ignore it silently){hint}")
        if key in NOT_APPLIED and _asked_for(config[key]):
            raise ValueError(f"{FIELD}.{key}: not applied by lmforge ({NOT_APPLIED[key]})")


def _asked_for(value: Any) -> bool:
    """Whether a section asks for anything: not off (`enabled: false`), and holding more
    than falsy values and sizes of 1."""
    if isinstance(value, dict):
        if value.get("enabled") is False:
            return False
        return value.get("enabled") is True or any(_asked_for(v) for k, v in value.items() if k != "enabled")
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value not in (0, 1)
    return value not in (None, "auto", "", [])


def _batch(config: dict, train, dp: int) -> None:
    _one_value(config, "train_batch_size", train, "global_batch", "train")
    accum = config.get("gradient_accumulation_steps")
    micro_given = not _unset(config.get("train_micro_batch_size_per_gpu")) or "micro_batch" in train.model_fields_set
    if not _unset(accum) and not micro_given and train.global_batch % (accum * dp) == 0:
        train.micro_batch = train.global_batch // (accum * dp)  # DeepSpeed's rule: two of the three fix the third
    _one_value(config, "train_micro_batch_size_per_gpu", train, "micro_batch", "train")
    micro = train.micro_batch
    if train.global_batch % (micro * dp):
        raise ValueError(f"{FIELD}.train_batch_size: {train.global_batch} is not divisible by micro batch x dp = {micro} x {dp}")
    derived = train.global_batch // (micro * dp)
    if _unset(accum):
        config["gradient_accumulation_steps"] = derived
    elif accum != derived:
        raise ValueError(
            f"{FIELD}.train_batch_size: {train.global_batch} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accum} x dp {dp}"
        )


def _enabled(section: Any) -> bool | None:
    if not isinstance(section, dict) or _unset(section.get("enabled")):
        return None
    return bool(section["enabled"])


def _precision(config: dict, train) -> None:
    if "bfloat16" in config:  # DeepSpeed's older spelling of bf16
        config["bf16"] = {**config.pop("bfloat16"), **config.get("bf16", {})}
    flags = {name: _enabled(config.get(name)) for name in ("fp16", "bf16")}
    on = [name for name, flag in flags.items() if flag]
    if len(on) == 2:
        raise ValueError(f"{FIELD}: fp16 and bf16 are both enabled; choose one")
    said = on[0] if on else ("fp32" if any(flag is False for flag in flags.values()) else None)
    explicit = "precision" in train.model_fields_set
    if said is not None and explicit and said != train.precision:
        raise ValueError(f"{FIELD}: its fp16/bf16 sections mean {said}, train.precision is {train.precision} (set it in one place)")
    if said is not None:
        train.precision = said
    for name in ("fp16", "bf16"):
        section = config.get(name) if isinstance(config.get(name), dict) else {}
        config[name] = {**section, "enabled": train.precision == name}


def _clipping(config: dict, optim) -> None:
    _one_value(config, "gradient_clipping", optim, "grad_clip", "optim")


def _optimizer(config: dict, optim) -> None:
    section = config.setdefault("optimizer", {"type": "AdamW"})
    kind = str(section.get("type", "")).lower()
    if not kind:
        raise ValueError(f"{FIELD}.optimizer.type: missing (e.g. AdamW)")
    params = section.setdefault("params", {})
    if kind not in ADAM_TYPES:
        return
    for key, field in (("lr", "lr"), ("betas", "betas"), ("eps", "eps"), ("weight_decay", "weight_decay")):
        if key == "betas" and isinstance(params.get(key), list):
            params[key] = tuple(params[key])
        _one_value(params, key, optim, field, "optim", label=f"optimizer.params.{key}")
    params["betas"] = list(params["betas"])
    # torch.optim.AdamW instead of DeepSpeed's compiled Adam kernels (minutes of build
    # at start); a config may still ask for those with "torch_adam": false.
    params.setdefault("torch_adam", True)


def _zero(config: dict) -> None:
    zero = config.get("zero_optimization") or {}
    where = f"{FIELD}.zero_optimization"
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"{where}.stage: unknown stage {stage!r} (0, 1, 2 or 3)")
    for kind, stages in (("offload_optimizer", (1, 2, 3)), ("offload_param", (3,))):
        section = zero.get(kind)
        if section is None:
            continue
        device = section.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            raise ValueError(f"{where}.{kind}.device: {device!r} is not one of {', '.join(OFFLOAD_DEVICES)}")
        if device == "nvme" and not section.get("nvme_path"):
            raise ValueError(f"{where}.{kind}.nvme_path: offloading to nvme needs a path")
        if device != "none" and stage not in stages:
            raise ValueError(f"{where}.{kind}: needs stage {' or '.join(map(str, stages))}, not {stage}")
