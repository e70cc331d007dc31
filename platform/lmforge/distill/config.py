"""The job file's `distill:` section: the teacher (or several, mixed), the divergence
and its settings, the weights of each loss term, sparse (top-k) targets, the
intermediate layers to match, instruction distillation's prompts, generation and
selection, and on-policy steps. Torch-free, like the rest of the spec; the rules
between it and other sections are in `spec_rules.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from lmforge.paths import LocalPath

Loss = Literal["forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl"]
HiddenLoss = Literal["mse", "cosine"]


class TeacherSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: LocalPath = Field(..., description="a committed checkpoint, an lmforge export or a Hugging Face Llama directory")
    weight: float = Field(1.0, gt=0, description="its share of the mixture (weights are normalized to sum to 1)")


class ServedTeacherSpec(BaseModel):
    """A teacher behind an OpenAI-compatible server (`lmforge serve`, vLLM)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(..., pattern=r"^https?://", description="the server's base URL, e.g. http://host:8000/v1")
    model: str = Field(..., min_length=1, description="the served model's name (`model` in requests)")
    top_k: Optional[int] = Field(None, gt=0, description="alternatives asked per token (sets distill.top_k)")
    max_retries: int = Field(
        5,
        ge=0,
        description="retries of a failed request, with exponential backoff, before the training attempt fails (it resumes as after any failure)",
    )
    api_key_env: Optional[str] = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="the environment variable holding the server's key (the key stays out of job files)"
    )

    @property
    def name(self) -> str:
        """How records and messages name it."""
        return f"{self.url.rstrip('/')}#{self.model}"


def _teacher_kind(value) -> str:
    return "served" if isinstance(value, (dict, ServedTeacherSpec)) else "path"


# A path, or a server's mapping: told apart by shape, so an error names the right fields.
Teacher = Annotated[Union[Annotated[LocalPath, Tag("path")], Annotated[ServedTeacherSpec, Tag("served")]], Discriminator(_teacher_kind)]


class CrossTokenizerSpec(BaseModel):
    """Teachers whose tokenizer is not the student's: aligned on the text both cover."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["projection"] = Field(
        "projection",
        description="projection: at every position where both tokenizations end a token at the same character, the teacher's "
        "next-token distribution mapped onto the student's vocabulary through the tokens both spell alike (GOLD's exact "
        "matches, NeMo-RL's vocabulary projection); the mass the student cannot spell goes to the top-k tail",
    )


class HiddenSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    layers: dict[int, int] = Field(..., min_length=1, description="student block -> teacher block whose outputs are matched")
    loss: HiddenLoss = Field("mse", description="mse: mean squared error per token; cosine: 1 - cosine similarity per token")

    @model_validator(mode="after")
    def _indices(self) -> "HiddenSpec":
        negative = [f"{s}: {t}" for s, t in self.layers.items() if s < 0 or t < 0]
        if negative:
            raise ValueError(f"distill.hidden.layers: block indices count from 0, not {negative[0]}")
        return self


class GenerateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(64, gt=0, description="tokens a teacher may write per answer")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens holding this much probability")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens (0: all)")
    n: int = Field(1, gt=0, le=64, description="answers each teacher writes per prompt")
    seed: int = Field(0, description="answers are a function of it, the prompt and the answer's index: the same on any rerun")
    batch_size: int = Field(16, gt=0, description="sequences a teacher generates at once (one KV cache)")


class SelectSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    drop_truncated: bool = Field(True, description="drop answers cut off by max_new_tokens (finish reason 'length')")
    min_tokens: int = Field(1, ge=1, description="drop answers with fewer tokens")
    max_tokens: Optional[int] = Field(None, gt=0, description="drop answers with more tokens")
    min_mean_logprob: Optional[float] = Field(None, le=0, description="drop answers whose mean token log-probability under their teacher is lower")
    dedupe: bool = Field(True, description="drop an answer identical to one kept before for the same prompt")
    teachers: Literal["best", "all"] = Field(
        "best", description="several teachers: keep, per prompt and answer index, the answer with the best mean log-probability, or all of them"
    )


class InstructSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: LocalPath = Field(..., description="JSONL or Parquet of prompts (a local path or an fsspec URI)")
    prompt_column: str = Field("prompt", description="the column holding a prompt's text")
    messages_column: str = Field("messages", description="or the column holding a chat: a list of {role, content}")
    chat_template: Optional[LocalPath] = Field(
        None, description="a Jinja chat template file; default: the teacher's tokenizer_config.json, else lmforge's"
    )
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="share of the prompts held out: their answers are the dataset's held-out split")
    prompts_per_shard: int = Field(32, gt=0, description="prompts per unit of work: each unit's answers are written once, and kept across a rerun")
    actors: Optional[int] = Field(None, gt=0, description="teacher actors answering at once; default: a GPU each, else up to two single-CPU ones")
    eval_answers: int = Field(
        32,
        ge=0,
        description="held-out prompts the trained student answers (greedy) after training, for the table of prompt, "
        "teacher answer and student answer (0: none)",
    )
    generate: GenerateSpec = Field(default_factory=GenerateSpec)
    select: SelectSpec = Field(default_factory=SelectSpec)


class OnPolicySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="share of the steps on which the student continues the batch's prompts and learns the teachers' distributions on its own tokens",
    )
    max_new_tokens: int = Field(32, gt=0, description="tokens the student writes per prompt (fewer when the row ends first)")
    temperature: float = Field(1.0, ge=0, description="the student's sampling temperature (0: greedy)")
    loss: Loss = Field("reverse_kl", description="the divergence on the student's tokens (reverse KL: mode-seeking, as in GKD)")


class DistillSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    teacher: Optional[Teacher] = Field(
        None,
        description="the teacher: a committed checkpoint, an lmforge export or a Hugging Face Llama directory; "
        "or {url, model, top_k} of a server whose top-k log-probabilities the student learns (asked as the data is read, or into the offline cache)",
    )
    teachers: Optional[list[TeacherSpec]] = Field(
        None, min_length=1, description="several teachers instead, their distributions mixed in probability space by weight"
    )
    loss: Loss = Field("forward_kl", description="the divergence of the student's next-token distribution from the teacher's")
    beta: float = Field(0.5, ge=0, le=1, description="jsd: the teacher's share of the mixture (0: forward KL, 1: reverse KL)")
    skew: float = Field(0.1, ge=0, lt=1, description="skew_kl / skew_reverse_kl: the share of the first distribution in the mixture")
    temperature: float = Field(1.0, gt=0, description="both distributions are softened by it; the loss is scaled by its square")
    ce_weight: float = Field(0.0, ge=0, description="weight of the cross-entropy on the data's next tokens")
    kd_weight: float = Field(1.0, ge=0, description="weight of the divergence from the teacher")
    hidden_weight: float = Field(1.0, ge=0, description="weight of the intermediate-layer loss (with `hidden`)")
    hidden: Optional[HiddenSpec] = Field(None, description="match student blocks' outputs, through learned adapters, to teacher blocks'")
    top_k: Optional[int] = Field(None, gt=0, description="sparse targets: the teacher's k most likely tokens, the rest of its mass as one bucket")
    cache: Optional[LocalPath] = Field(
        None, description="an offline teacher cache (`lmforge distill cache JOB` builds it) instead of online teachers"
    )
    chunk_tokens: int = Field(1024, gt=0, description="tokens whose fp32 log-probabilities are alive at once in the loss")
    instruct: Optional[InstructSpec] = Field(
        None, description="instruction distillation: the teachers answer these prompts (`lmforge distill generate JOB`) into data.path"
    )

    cross_tokenizer: Optional[CrossTokenizerSpec] = Field(
        None, description="teachers with another tokenizer than the student's (default: teachers must share the dataset's)"
    )

    on_policy: Optional[OnPolicySpec] = Field(
        None,
        description="on-policy distillation (GKD): on a share of the steps the student writes continuations and learns the "
        "online teachers' distributions on them",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "DistillSpec":
        if (self.teacher is None) == (self.teachers is None):
            raise ValueError("distill: name one teacher (distill.teacher: PATH) or several (distill.teachers: [{path, weight}]), not both")
        if self.ce_weight == 0 and self.kd_weight == 0 and (self.hidden is None or self.hidden_weight == 0):
            raise ValueError(
                "distill: the weights of every loss term are 0 (ce_weight, kd_weight, and hidden_weight with hidden); the student would learn nothing"
            )
        if self.served is not None:
            self._served_consistent()
        if self.cache is not None and self.hidden is not None:
            raise ValueError("distill.hidden: the teacher cache holds next-token targets, not hidden states; match layers with an online teacher")
        if self.cache is not None and self.top_k is None:
            raise ValueError("distill.cache: the cache keeps the teacher's k most likely tokens per position; set distill.top_k (e.g. 128)")
        if self.instruct is not None:
            self._instruct_consistent()
        if self.hidden is not None and self.teachers is not None and len(self.teachers) > 1:
            raise ValueError("distill.hidden: matches one teacher's layers; with several teachers distill their logits only")
        if self.on_policy is not None:
            self._on_policy_consistent()
        if self.cross_tokenizer is not None:
            self._cross_tokenizer_consistent()
        return self

    def _cross_tokenizer_consistent(self) -> None:
        """The projected targets are sparse: the tail bucket takes what the student cannot
        spell. Hidden states and answers stored in a teacher's tokens have no aligned form."""
        if self.top_k is None:
            raise ValueError(
                "distill.cross_tokenizer: targets projected onto the student's vocabulary are top-k ones (the rest of the "
                "teacher's mass, spellable or not, in one bucket); set distill.top_k (e.g. 32)"
            )
        if self.hidden is not None:
            raise ValueError(
                "distill.cross_tokenizer: a teacher of another tokenizer has other positions; match layers (distill.hidden) with one that shares the student's"
            )
        if self.instruct is not None:
            raise ValueError(
                "distill.cross_tokenizer: instruction answers are written in the teachers' tokens; generate them with teachers of the student's tokenizer"
            )
        if self.served is not None:
            raise ValueError("distill.cross_tokenizer: a served teacher scores the student's own token ids; serve one with the student's tokenizer")

    def _served_consistent(self) -> None:
        """A served teacher gives top-k log-probabilities at temperature 1 (a server has no
        temperature for a prompt's) of the data's rows: read into the offline cache, or
        asked for as the feed reads each chunk."""
        served = self.served
        if served.top_k is not None and self.top_k is not None and served.top_k != self.top_k:
            raise ValueError(f"distill.teacher.top_k: {served.top_k} differs from distill.top_k {self.top_k}; give one")
        self.top_k = self.top_k or served.top_k
        if self.top_k is None:
            raise ValueError("distill.teacher.top_k: a served teacher gives its k most likely tokens per position; set it (e.g. 20)")
        if self.temperature != 1:
            raise ValueError("distill.temperature: a server gives a prompt's log-probabilities at temperature 1; a served teacher needs 1")
        if self.instruct is not None:
            raise ValueError("distill.instruct: answers are generated by local teachers; a served teacher gives top-k targets of the data")
        if self.hidden is not None:
            raise ValueError("distill.hidden: a server gives next-token log-probabilities, not hidden states; match layers with a local teacher")
        if self.on_policy is not None:
            raise ValueError("distill.on_policy: the student's continuations are scored by local teachers; a served teacher scores the data")

    def _on_policy_consistent(self) -> None:
        """The teachers score tokens the student has just written: they run online."""
        if self.cache is not None:
            raise ValueError(
                "distill.on_policy: the teachers score the student's own continuations online; an offline cache cannot "
                "hold them (remove distill.cache)"
            )
        if self.hidden is not None:
            raise ValueError("distill.on_policy: learns the teachers' token distributions; match layers (distill.hidden) in a job without it")
        if self.kd_weight == 0:
            raise ValueError("distill.on_policy: its steps learn the divergence from the teachers; distill.kd_weight must be above 0")

    def _instruct_consistent(self) -> None:
        """The student learns the teachers' answers and, with kd_weight, their top-k
        distributions stored beside them: no online teacher, no other cache."""
        if self.cache is not None:
            raise ValueError("distill.cache: an instruction distillation's dataset holds its teachers' top-k targets itself; remove distill.cache")
        if self.hidden is not None:
            raise ValueError("distill.hidden: an instruction distillation learns from stored answers, not from a teacher's layers")
        if self.kd_weight and self.top_k is None and self.on_policy is None:
            raise ValueError(
                "distill.kd_weight: learning the teachers' distributions on their answers needs them stored; "
                "set distill.top_k (e.g. 16), or kd_weight: 0 for answers alone"
            )

    @property
    def online(self) -> bool:
        """Whether the teachers run beside the student on every rank: not from a cache, nor
        (unless on-policy) from an instruction distillation's stored answers."""
        return self.served is None and self.cache is None and (self.instruct is None or self.on_policy is not None)

    @property
    def served(self) -> Optional[ServedTeacherSpec]:
        return self.teacher if isinstance(self.teacher, ServedTeacherSpec) else None

    @property
    def sources(self) -> list[TeacherSpec]:
        """Every local teacher, its weight normalized so that the weights sum to 1 (none
        for a served teacher: its targets are in the cache)."""
        if self.served is not None:
            return []
        given = self.teachers or [TeacherSpec(path=self.teacher)]
        total = sum(t.weight for t in given)
        return [TeacherSpec(path=t.path, weight=t.weight / total) for t in given]
