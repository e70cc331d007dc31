"""A committed checkpoint of either engine as one process's full fp32 weights, for
export, generation and teachers.

Native checkpoints are read with DCP (no process group needed); DeepSpeed ones
with DeepSpeed's zero_to_fp32. Either is read only after every file's checksum is
verified against the commit record: a flipped byte must not export, and DCP's
metadata and DeepSpeed's files are pickles.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError

from lmforge.checkpoint.deepspeed_files import CHECKPOINT_TAG, skip_shared_memory_op
from lmforge.checkpoint.safe_metadata import MetadataRefused, SafeFileSystemReader
from lmforge.checkpoint.state import TrainerState
from lmforge.checkpoint.store import COMMIT, STATE, CheckpointStore, CheckpointUnreadable
from lmforge.errors import UserError
from lmforge.jsonfile import member, read_object
from lmforge.models import ModelConfig, Transformer
from lmforge.models.config import config_from_dict
from lmforge.models.lora import apply_lora, merged, quantize_nf4
from lmforge.models.lora_config import LoraSpec, adapter_shapes, quantized_weights
from lmforge.models.weights import clean_name, open_model_dir, weight_names, weight_shapes


def read_checkpoint(step_dir: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor], TrainerState]:
    """(the model's shape, its full fp32 weights in lmforge's names, the checkpoint's
    state.json); a LoRA job's adapters folded into the weights."""
    cfg, tensors, state = read_trained_tensors(step_dir)
    return cfg, merged(tensors, state.lora) if state.lora else tensors, state


def read_trained_tensors(step_dir: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor], TrainerState]:
    """As `read_checkpoint`, with a LoRA job's adapters beside the weights, not folded in."""
    step_dir = Path(step_dir)
    state = committed_state(step_dir)
    cfg = config_from_dict(state.model, str(step_dir / STATE))
    _verify(step_dir, state.step)
    names = weight_names(cfg)
    adapters = list(adapter_shapes(weight_shapes(cfg), state.lora)) if state.lora else []
    names += adapters
    in_nf4 = quantized_weights(adapters, state.lora)
    saved = set(names) - in_nf4
    tensors = _read_dcp(step_dir, cfg, state.lora, saved) if state.format == "dcp" else _read_deepspeed(step_dir)
    if in_nf4:
        tensors |= _quantized_base(step_dir, state, cfg, in_nf4)
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise UserError(f"{step_dir}: the checkpoint lacks {', '.join(missing[:3])} for its model")
    return cfg, {name: tensors[name] for name in names}, state


def committed_state(step_dir: Path) -> TrainerState:
    """A committed step's state.json, with the model and step an export needs; UserError
    naming the file for anything else."""
    if not (step_dir / COMMIT).is_file():
        raise UserError(f"{step_dir}: not a committed checkpoint (no {COMMIT}); pass a step_XXXXXXXX directory")
    where = str(step_dir / STATE)
    try:
        values = read_object(step_dir / STATE)
        config_from_dict(member(values, "model", dict, where), where)
        member(values, "step", int, where)
        return TrainerState.model_validate(values)
    except ValidationError as err:
        first = err.errors()[0]
        raise UserError(f"{where}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    except ValueError as err:
        raise UserError(str(err)) from None


def _read_dcp(step_dir: Path, cfg: ModelConfig, lora: LoraSpec | None, names: set[str]) -> dict[str, torch.Tensor]:
    model = Transformer(cfg)  # a template on CPU: DCP fills its tensors in place
    if lora is not None:
        apply_lora(model, lora.model_copy(update={"quantize": None}), seed=0)
    template = {name: tensor for name, tensor in model.state_dict().items() if name in names}
    with warnings.catch_warnings():  # DCP warns that no process group is up: reading in one process is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        reader = SafeFileSystemReader(str(step_dir))
        try:
            reader.read_metadata()  # first on its own: DCP would bury the refusal in its collective's error
        except MetadataRefused as err:
            raise UserError(str(err)) from None
        dcp.load({"model": template}, storage_reader=reader, no_dist=True)
    return template


def _quantized_base(step_dir: Path, state: TrainerState, cfg: ModelConfig, names: set[str]) -> dict[str, torch.Tensor]:
    """A QLoRA checkpoint's NF4 weights, which it does not hold: its base's, quantized as
    the job quantized them, in fp32 (what the adapters were trained against)."""
    base = state.init_from
    try:
        model_dir = open_model_dir(base or "")
    except ValueError as err:
        raise UserError(f"{step_dir}: a QLoRA checkpoint holds its adapters, not its NF4 base; the base ({base}) cannot be read ({err})") from None
    theirs, ours = weight_shapes(model_dir.cfg), weight_shapes(cfg)
    if any(theirs.get(name) != ours[name] for name in names):
        raise UserError(f"{step_dir}: its base {base} is no longer the model it was trained on (another shape)")
    return {name: quantize_nf4(model_dir.tensor(name)).get_original_weight() for name in names}


def _verify(step_dir: Path, step: int) -> None:
    """Every file against the commit record, as a restore checks them (same store code)."""
    store = CheckpointStore(str(step_dir.parent))
    if store.step_path(step) != str(step_dir).rstrip("/"):
        raise UserError(f"{step_dir}: its state.json is for step {step}; pass the step_XXXXXXXX directory as written")
    try:
        names = sorted(store.manifest(step))
        bad = store.mismatches(step, names)
    except (OSError, ValueError, CheckpointUnreadable) as err:
        raise UserError(f"{step_dir / COMMIT}: cannot be checked ({err})") from None
    if bad:
        raise UserError(f"{step_dir / bad[0]}: does not match its checksum in {COMMIT}; refusing to read the checkpoint")


def _read_deepspeed(step_dir: Path) -> dict[str, torch.Tensor]:
    skip_shared_memory_op()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = step_dir / CHECKPOINT_TAG
    if any(tag_dir.glob("zero_pp_rank_*")):
        tensors = get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=CHECKPOINT_TAG)
    else:  # ZeRO stage 0 keeps whole fp32 weights in the model states
        tensors = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    return {clean_name(k): v for k, v in tensors.items()}
