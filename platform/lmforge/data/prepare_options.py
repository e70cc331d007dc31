"""What `lmforge data prepare` is asked to do: a corpus, where its dataset goes, and
how it is tokenized and cut; from flags or from a job's data section. Light: the CLI
builds it before Ray or torch load."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lmforge.data.precheck import JOB_FIELDS
from lmforge.errors import UserError


@dataclass
class PrepareOptions:
    source: str
    out: str
    seq_len: int
    tokenizer: Optional[str] = None
    vocab_size: int = 8192
    text_column: str = "text"
    shard_samples: int = 256
    eval_fraction: float = 0.0  # documents of `source` held out of training
    eval_source: Optional[str] = None  # or: a corpus of its own as the held-out split
    show_progress: bool = True
    model_vocab_size: Optional[int] = None  # the tokenizer's vocabulary must fit the model's
    names: dict = field(default_factory=dict)  # option -> the flag the user typed, for messages
    skipped: int = field(default=0, init=False)

    @classmethod
    def for_job(cls, spec, **given) -> "PrepareOptions":
        """The job's data section (and `given` values, e.g. from flags)."""
        if spec.data.sources is not None:
            raise UserError(
                "data.sources: a mixture blends datasets prepared already; prepare each with "
                "`lmforge data prepare --source CORPUS --out PATH --seq-len N`"
            )
        values = {
            "source": spec.data.source,
            "out": spec.data.path,
            "seq_len": spec.train.seq_len,
            "tokenizer": spec.data.tokenizer or _model_tokenizer(spec),
            "vocab_size": spec.data.vocab_size,
            "text_column": spec.data.text_column,
            "shard_samples": spec.data.shard_samples,
            "eval_fraction": spec.data.eval_fraction,
            "eval_source": spec.eval.source if spec.eval else None,
            "model_vocab_size": spec.model_arch.vocab_size,
        }
        return cls(**values | {key: value for key, value in given.items() if value is not None})

    def name(self, key: str) -> str:
        """What the user typed for option `key`: its flag, or else its job field."""

        return self.names.get(key, JOB_FIELDS[key])


def _model_tokenizer(spec) -> Optional[str]:
    """The tokenizer.json of the model the job starts from (`model.init_from`), or of
    its (first) teacher, if the directory has one."""
    teachers = [t.path for t in spec.distill.sources] if spec.distill else []
    for directory in (spec.model.init_from, *teachers):
        found = directory and Path(directory) / "tokenizer.json"
        if found and found.is_file():
            return str(found)
    return None
