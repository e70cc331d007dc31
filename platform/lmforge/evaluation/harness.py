"""`lmforge eval harness`: lm-evaluation-harness's tasks on lmforge's own model, in this
process (any directory `Generator.load` opens: a committed checkpoint, an export, a
Hugging Face or quantized directory) or on a tp x pp layout of Ray ranks, scored as lm-eval's `hf` backend scores; the
results and samples written as `lm-eval run` writes them, and logged to MLflow (under
the checkpoint's training run when it has one). lm-eval is the optional extra `eval`."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
from lm_eval import simple_evaluate, utils
from lm_eval.api.model import TemplateLM
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager
from pydantic import BaseModel
from tokenizers import Tokenizer

from lmforge.checkpoint.export import ModelSource, open_source
from lmforge.checkpoint.state import TrainerState
from lmforge.errors import UserError
from lmforge.evaluation.scoring import ContinuationScore, continuation_scores, right_padded
from lmforge.evaluation.sharded import Layout, ShardedModel, ShardPlan
from lmforge.inference.generate import Generator, generate_ids, stop_checker
from lmforge.inference.sampling import SamplingParams
from lmforge.models.quantized import is_quantized
from lmforge.ray_runtime import joined
from lmforge.spec_rules import tensor_parallel_refusal
from lmforge.tracking.command_run import log_command_run, tracking_uri

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend's, when a task names none
ShardedSource = tuple[ModelSource, Tokenizer, frozenset[int]]  # a layout's model as read here: no weights


class HarnessOptions(BaseModel):
    model: str
    tasks: list[str]
    include_path: Optional[str] = None
    num_fewshot: Optional[int] = None
    limit: Optional[float] = None
    batch_size: int = 8
    out: Optional[str] = None
    seed: int = 0
    tracking: bool = True
    tracking_uri: Optional[str] = None
    layout: Layout = Layout()  # tp x pp > 1: on that many Ray ranks
    address: Optional[str] = None  # the Ray cluster for them (default: RAY_ADDRESS, else an embedded one)


class HarnessReport(BaseModel):
    model: str
    results: dict  # per task: lm-eval's metrics ("acc,none", ...)
    out: Optional[str]
    mlflow_run_id: Optional[str]


class LocalScorer:
    """The model in this process: a right-padded forward per batch, and generation
    through its KV cache."""

    def __init__(self, generator: Generator):
        self.model, self.eos_ids, self.vocab = generator.model, generator.eos_ids, generator.tokenizer.get_vocab_size()
        self.stop_checker = generator.stop_checker

    @torch.no_grad()
    def score(self, inputs: list[list[int]], continuations: list[list[int]]) -> list[ContinuationScore]:
        on = next(self.model.parameters()).device
        return continuation_scores(self.model(right_padded(inputs, on)), inputs, continuations)

    def greedy(self, prompt: list[int], max_new_tokens: int, until: list[str]) -> list[int]:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, stop=until)
        stopped = self.stop_checker(until) if until else None
        return generate_ids(self.model, [prompt], params, self.eos_ids, self.vocab, stopped=stopped)[0].tokens


class ShardedScorer:
    """The model on Ray ranks (`ShardedModel`): each batch scored on its last stage;
    generation one recomputed forward per token (a layout's ranks keep no KV cache)."""

    def __init__(self, model: ShardedModel, tokenizer: Tokenizer, eos_ids: frozenset[int]):
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, eos_ids

    def score(self, inputs: list[list[int]], continuations: list[list[int]]) -> list[ContinuationScore]:
        return self.model.score(inputs, continuations)

    def greedy(self, prompt: list[int], max_new_tokens: int, until: list[str]) -> list[int]:
        stopped = stop_checker(self.tokenizer, until) if until else None
        new: list[int] = []
        for _ in range(max_new_tokens):
            new.append(self.model.next_token(prompt + new))
            if new[-1] in self.eos_ids or (stopped is not None and stopped(0, new)):
                break
        return new


class LmforgeLM(TemplateLM):
    """lm-eval's model interface over a scorer (local or sharded): scores as its `hf`
    backend does (the same token split of context and continuation, inputs cut to the
    context from the left, greedy generation up to the stop strings)."""

    def __init__(self, scorer: LocalScorer | ShardedScorer, tokenizer: Tokenizer, eos_ids: frozenset[int], max_length: int, batch_size: int):
        super().__init__()
        self.scorer, self.tokenizer, self.eos_ids, self.batch_size = scorer, tokenizer, eos_ids, batch_size
        self._max_length = max_length

    @property
    def eot_token_id(self) -> int:
        return min(self.eos_ids)

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: Optional[int] = None) -> list[tuple[float, bool]]:
        answers: list[tuple[float, bool]] = []
        size = override_bs or self.batch_size
        for first in range(0, len(requests), size):
            batch = requests[first : first + size]
            inputs = [(context + continuation)[-(self.max_length + 1) :][:-1] for _, context, continuation in batch]
            answers += self.scorer.score(inputs, [continuation for _, _, continuation in batch])
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for (text,) in [request.args for request in requests]:
            windows = utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
            )
            scored = self._loglikelihood_tokens([(None, *utils.make_disjoint_window(window)) for window in windows])
            totals.append(sum(score for score, _ in scored))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        answers = []
        for context, settings in [request.args for request in requests]:
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(settings.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            ids = self.tok_encode(context)[-max(1, self.max_length - new) :]
            generated = self.scorer.greedy(ids, min(new, self.max_length - len(ids)), until)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            cuts = [text.find(stop) for stop in until if stop in text]
            answers.append(text[: min(cuts)] if cuts else text)
        return answers


def run_harness(options: HarnessOptions, say=print) -> HarnessReport:
    """Check the tasks, load the model (here, or on its layout's Ray ranks), evaluate,
    write and log."""
    sharded = _sharded_source(options) if options.layout.world_size > 1 else None
    tasks = _checked_tasks(options)
    torch.manual_seed(options.seed)
    with _model(options, sharded, say) as lm:
        try:
            results = simple_evaluate(
                model=lm,
                tasks=options.tasks,
                num_fewshot=options.num_fewshot,
                limit=options.limit,
                task_manager=tasks,
                log_samples=True,
                random_seed=options.seed,
                numpy_random_seed=options.seed,
                torch_random_seed=options.seed,
                fewshot_random_seed=options.seed,
            )
        except (ConnectionError, OSError) as err:  # a task whose data is on the hub, with no network
            raise UserError(f"--tasks: a task's data could not be read ({type(err).__name__}: {str(err).splitlines()[0][:300]})") from None
    assert results is not None
    samples = results.pop("samples")
    if options.out:
        tracker = EvaluationTracker(output_path=options.out)
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    metrics = {task: {k: v for k, v in values.items() if isinstance(v, (int, float))} for task, values in results["results"].items()}
    run_id = _log(options, metrics, results) if options.tracking else None
    return HarnessReport(model=options.model, results=metrics, out=options.out, mlflow_run_id=run_id)


def _checked_tasks(options: HarnessOptions) -> TaskManager:
    if options.include_path and not Path(options.include_path).is_dir():
        raise UserError(f"--include-path: {options.include_path} is not a directory")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    tasks = TaskManager(include_path=options.include_path)
    unknown = [name for name in options.tasks if name not in tasks.all_tasks]
    if unknown:
        raise UserError(f"--tasks: no task named {', '.join(unknown)} in lm-eval's tasks{' or under --include-path' if options.include_path else ''}")
    return tasks


@contextmanager
def _model(options: HarnessOptions, sharded: Optional[ShardedSource], say) -> Iterator[LmforgeLM]:
    """lm-eval's model: in this process, or (tp x pp > 1) on Ray ranks, stopped after."""
    layout = options.layout
    if sharded is None:
        generator = Generator.load(options.model)
        say(f"evaluating {options.model} on {', '.join(options.tasks)} (lm-evaluation-harness, in this process)")
        cfg = generator.model.cfg
        yield LmforgeLM(LocalScorer(generator), generator.tokenizer, generator.eos_ids, cfg.max_seq_len, options.batch_size)
        return
    source, tokenizer, eos_ids = sharded
    with joined(options.address):
        model = ShardedModel(ShardPlan(model=options.model, layout=layout, vocab=tokenizer.get_vocab_size()))
        try:
            say(f"evaluating {options.model} on {', '.join(options.tasks)} (lm-evaluation-harness, tp {layout.tp} x pp {layout.pp} ranks)")
            yield LmforgeLM(ShardedScorer(model, tokenizer, eos_ids), tokenizer, eos_ids, source.cfg.max_seq_len, options.batch_size)
        finally:
            model.close()


def _sharded_source(options: HarnessOptions) -> ShardedSource:
    """The model's shape and tokenizer, read here without its weights; a layout it cannot take is refused."""
    layout = options.layout
    if is_quantized(Path(options.model)):
        raise UserError("--set parallel: a quantized directory is evaluated in one process (parallel.tp and parallel.pp 1)")
    source = open_source(options.model)
    if source.tokenizer_json is None:
        raise UserError(f"MODEL: {options.model} has no tokenizer to turn tasks into tokens")
    refusal = tensor_parallel_refusal(source.cfg, layout.tp)
    if refusal:
        raise UserError(f"--set parallel.tp: {refusal}")
    if layout.pp > source.cfg.n_layers:
        raise UserError(f"--set parallel.pp: {source.cfg.n_layers} layers cannot fill {layout.pp} pipeline stages")
    tokenizer = source.tokenizer()
    return source, tokenizer, frozenset({tokenizer.token_to_id(source.eos_token)})


def _log(options: HarnessOptions, metrics: dict, results: dict) -> str:
    """Under the checkpoint's training run (its step as the metrics' step), else a run of its own."""
    flat = {f"harness/{task}/{name.replace(',', '/')}": value for task, values in metrics.items() for name, value in values.items()}
    state_file = Path(options.model) / "state.json"
    trained = TrainerState.model_validate_json(state_file.read_text()) if state_file.is_file() else TrainerState()
    if trained.mlflow is not None:
        from mlflow.tracking import MlflowClient

        run_id, step = trained.mlflow.run_id, trained.step or 0
        client = MlflowClient(tracking_uri=trained.mlflow.tracking_uri or tracking_uri(options.tracking_uri))
        for name, value in flat.items():
            client.log_metric(run_id, name, float(value), step=step)
        client.log_text(run_id, json.dumps(results, indent=2, default=utils.handle_non_serializable), f"harness/results-step{step}.json")
        return run_id
    params = {"model": options.model, "tasks": ",".join(options.tasks), "num_fewshot": options.num_fewshot, "limit": options.limit}
    return log_command_run(tracking_uri(options.tracking_uri), "lmforge-eval", f"harness {Path(options.model).name}", "harness", params, flat, [])
