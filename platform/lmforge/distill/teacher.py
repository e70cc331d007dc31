"""The online teacher on a training rank: built on the meta device like the student,
given its weights, then parallelized by the engine's own path (the same TP split;
FSDP-sharded when the student is). Frozen: eval mode, no gradients, no optimizer
state, never checkpointed.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional

import torch
from tokenizers import Tokenizer
from torch import nn

from lmforge.checkpoint.export import open_source
from lmforge.distill.config import DistillSpec
from lmforge.distill.cross_tokenizer import AlignedTeacher
from lmforge.distill.losses import TopK, stored_top_k
from lmforge.models import ModelConfig, Transformer, materialize
from lmforge.models.build import build_model


def build_teacher(path: str, device: torch.device, parallelize: Callable[[nn.Module], nn.Module]) -> nn.Module:
    source = open_source(path, name="distill.teacher")
    # A model directory is read tensor by tensor; a checkpoint is consolidated first.
    weights = source.read_tensors() if source.kind == "checkpoint" else str(source.path)
    with torch.device("meta"):
        teacher = Transformer(source.cfg)
    teacher = materialize(teacher, device, seed=0, weights=weights)
    teacher.requires_grad_(False)
    return parallelize(teacher).eval()


def aligned_teachers(models: list[nn.Module], distill: DistillSpec, student: Tokenizer) -> list[AlignedTeacher]:
    """The teachers (in `sources` order) reading the student's text through their own
    tokenizers (`distill.cross_tokenizer`)."""
    names = ["distill.teacher"] if distill.teacher is not None else [f"distill.teachers[{i}]" for i in range(len(models))]
    return [
        AlignedTeacher(model, student, open_source(source.path, name=name).tokenizer(), model.cfg.vocab_size, source.weight)
        for model, source, name in zip(models, distill.sources, names)
    ]


def load_whole(paths: list[str], device: torch.device) -> list[nn.Module]:
    """Teachers whole on one device, in eval mode: an inference actor's (the teacher
    cache's scorer, instruction distillation's answers)."""

    teachers = []
    for path in paths:
        source = open_source(path, name="distill.teacher")
        weights = source.read_tensors() if source.kind == "checkpoint" else str(source.path)
        teachers.append(build_model(source.cfg, device, weights=weights).eval())
    return teachers


Cached = Optional[tuple[torch.Tensor, torch.Tensor]]  # a step's cache targets: top-k ids and log-probabilities


def micro_batch(cached: Cached, index: int) -> Cached:
    """Micro-batch `index` of a step's cached teacher targets (None without a cache)."""
    return None if cached is None else (cached[0][index], cached[1][index])


def teacher_targets(teachers: list[nn.Module], inputs: torch.Tensor, cached: Cached, device: torch.device) -> list[torch.Tensor] | TopK:
    """What one micro-batch learns from: the online teachers' logits for its inputs, or
    its top-k targets from the offline cache."""
    if cached is not None:
        return stored_top_k(cached[0].to(device, non_blocking=True), cached[1].to(device, non_blocking=True))
    with torch.no_grad():
        return [teacher(inputs) for teacher in teachers]


def teacher_shapes(distill: Optional[DistillSpec]) -> tuple[ModelConfig, ...]:
    """The shapes of a job's online teachers (its `distill` section), in `sources`
    order (none for another job, or one from the offline cache): what memory
    estimates count beside the student."""
    if not distill or not distill.online:
        return ()
    return _shapes(tuple(source.path for source in distill.sources), distill.teacher is not None)


@lru_cache(maxsize=32)  # a planner search estimates hundreds of layouts of one job
def _shapes(paths: tuple[str, ...], single: bool) -> tuple[ModelConfig, ...]:
    names = ["distill.teacher"] if single else [f"distill.teachers[{i}]" for i in range(len(paths))]
    return tuple(open_source(path, name=name).cfg for path, name in zip(paths, names))
