"""A checkpoint's state.json, declared once: what rank 0 writes beside the tensors and
what a resume, an export and a consolidation read (as JSON, so nothing of ours is
unpickled). Fields a checkpoint of an older lmforge lacks have defaults; a file that
is not this shape reads as no state (the store passes over it)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

from lmforge.models.lora_config import LoraSpec


class MlflowRef(BaseModel):
    """Where `lmforge export --register` logs a model made from this checkpoint."""

    tracking_uri: Optional[str] = None
    run_id: str


class TrainerState(BaseModel):
    model_config = ConfigDict(extra="ignore")

    step: Optional[int] = None
    samples_consumed: Optional[int] = None
    global_batch: Optional[int] = None
    seed: Optional[int] = None
    dp: Optional[int] = None  # the data-parallel size it was written on (DeepSpeed reshards from it)
    model: Optional[dict[str, Any]] = None  # the ModelConfig's fields (`config_from_dict` checks them)
    lora: Optional[LoraSpec] = None  # `model.lora`: the checkpoint holds adapters beside the frozen weights
    init_from: Optional[str] = None  # the model directory it started from (a LoRA adapter's base)
    data_path: Optional[str] = None  # the dataset it trained on: where export finds the tokenizer
    order: dict[str, Any] = {}  # what decides the data order (`data.identity.order_inputs`)
    job: Optional[str] = None
    mlflow: Optional[MlflowRef] = None
    records: list[dict[str, Any]] = []  # the step and eval lines since the previous checkpoint (`events.Event.as_dict`)
    engine: dict[str, Any] = {}  # the engine's JSON-safe rest (the LR schedule)
    format: Literal["dcp", "deepspeed"] = "dcp"

    def as_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)
