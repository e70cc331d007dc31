"""The job's `data` section: one prepared dataset (`path`, prepared from `source`
when missing) or a weighted mixture of several (`sources`), and how they are read.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lmforge.paths import CorpusPath, LocalPath


class MixtureSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: LocalPath = Field(..., description="a prepared dataset (directory or URI)")
    weight: float = Field(..., ge=0, allow_inf_nan=False, description="its share of the samples, relative to the others' weights")


class DataSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: Optional[LocalPath] = Field(None, description="prepared dataset directory or URI (holds manifest.json); or give `sources`")
    sources: Optional[list[MixtureSource]] = Field(
        None, min_length=1, description="a mixture instead of `path`: prepared datasets blended by weight in one deterministic order"
    )
    source: Optional[CorpusPath] = Field(None, description="raw corpus to prepare into `path` when it is missing")
    tokenizer: Optional[LocalPath] = Field(None, description="tokenizer.json to use; default: train a byte-level BPE")
    vocab_size: int = Field(8192, ge=256, description="vocabulary of the BPE trained when no tokenizer is given")
    text_column: str = "text"
    shard_samples: int = Field(256, gt=0, description="samples per Parquet shard: the unit the feed shuffles and reads")
    prefetch_steps: int = Field(64, gt=0, description="optimizer steps of samples each rank reads ahead")
    shuffle_window: int = Field(16, gt=0, description="shards whose samples are shuffled together")
    record_sample_ids: bool = Field(False, description="write every step's sample ids to <run_dir>/samples.jsonl")
    eval_fraction: float = Field(
        0.0, ge=0, lt=1, description="prepare: hold this share of the source's documents out of training, as the held-out split that `eval` measures"
    )

    @field_validator("path")
    @classmethod
    def _non_empty(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    @model_validator(mode="after")
    def _one_dataset(self) -> "DataSpec":
        if (self.path is None) == (self.sources is None):
            raise ValueError("data.path: give a prepared dataset here, or a mixture as data.sources (not both)")
        if self.sources is not None:
            if sum(source.weight for source in self.sources) <= 0:
                raise ValueError("data.sources: the weights are all 0; give at least one a positive weight")
            if self.source is not None:
                raise ValueError("data.source: a mixture reads prepared datasets; prepare each with `lmforge data prepare` first")
        return self

    @property
    def paths(self) -> list[str]:
        """Every prepared dataset the job reads: `path`, or the mixture's."""
        return [self.path] if self.sources is None else [source.path for source in self.sources]
