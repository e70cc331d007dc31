"""`lmforge eval harness`: lm-evaluation-harness's tasks on lmforge's own model in this
process (any directory `Generator.load` opens: a committed checkpoint, an export, a
Hugging Face or quantized directory), scored as lm-eval's `hf` backend scores; the
results and samples written as `lm-eval run` writes them, and logged to MLflow (under
the checkpoint's training run when it has one). lm-eval is the optional extra `eval`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch
from lm_eval import simple_evaluate, utils
from lm_eval.api.model import TemplateLM
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager
from pydantic import BaseModel

from lmforge.checkpoint.state import TrainerState
from lmforge.errors import UserError
from lmforge.inference.generate import Generator, generate_ids
from lmforge.inference.sampling import SamplingParams
from lmforge.tracking.command_run import log_command_run, tracking_uri

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend's, when a task names none


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


class HarnessReport(BaseModel):
    model: str
    results: dict  # per task: lm-eval's metrics ("acc,none", ...)
    out: Optional[str]
    mlflow_run_id: Optional[str]


class LmforgeLM(TemplateLM):
    """lm-eval's model interface over a `Generator`: scores as its `hf` backend does
    (the same token split of context and continuation, inputs cut to the context from
    the left, greedy generation up to the stop strings)."""

    def __init__(self, generator: Generator, batch_size: int):
        super().__init__()
        self.generator, self.batch_size = generator, batch_size
        self.on = next(generator.model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return min(self.generator.eos_ids)

    @property
    def max_length(self) -> int:
        return self.generator.model.cfg.max_seq_len

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        return self.generator.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: Optional[int] = None) -> list[tuple[float, bool]]:
        answers: list[tuple[float, bool]] = []
        size = override_bs or self.batch_size
        for first in range(0, len(requests), size):
            answers += self._score_batch(requests[first : first + size])
        return answers

    @torch.no_grad()
    def _score_batch(self, batch) -> list[tuple[float, bool]]:
        """One right-padded forward (causal: padding after a row changes nothing in it)."""
        inputs = [(context + continuation)[-(self.max_length + 1) :][:-1] for _, context, continuation in batch]
        width = max(map(len, inputs))
        tokens = torch.zeros(len(inputs), width, dtype=torch.long, device=self.on)
        for row, ids in enumerate(inputs):
            tokens[row, : len(ids)] = torch.tensor(ids)
        logprobs = self.generator.model(tokens).float().log_softmax(dim=-1)
        answers = []
        for row, ((_, _, continuation), ids) in enumerate(zip(batch, inputs)):
            wanted = torch.tensor(continuation, device=self.on)
            scores = logprobs[row, len(ids) - len(continuation) : len(ids)]
            answers.append((float(scores.gather(1, wanted[:, None]).sum()), bool((scores.argmax(dim=-1) == wanted).all())))
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
            params = SamplingParams(max_new_tokens=min(new, self.max_length - len(ids)), temperature=0, stop=until)
            stopped = self.generator.stop_checker(until) if until else None
            vocab = self.generator.tokenizer.get_vocab_size()
            generated = generate_ids(self.generator.model, [ids], params, self.generator.eos_ids, vocab, stopped=stopped)[0]
            text = self.generator.tokenizer.decode(generated.tokens, skip_special_tokens=True)
            cuts = [text.find(stop) for stop in until if stop in text]
            answers.append(text[: min(cuts)] if cuts else text)
        return answers


def run_harness(options: HarnessOptions, say=print) -> HarnessReport:
    """Check the tasks, load the model, evaluate, write and log."""
    if options.include_path and not Path(options.include_path).is_dir():
        raise UserError(f"--include-path: {options.include_path} is not a directory")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    tasks = TaskManager(include_path=options.include_path)
    unknown = [name for name in options.tasks if name not in tasks.all_tasks]
    if unknown:
        raise UserError(f"--tasks: no task named {', '.join(unknown)} in lm-eval's tasks{' or under --include-path' if options.include_path else ''}")
    torch.manual_seed(options.seed)
    generator = Generator.load(options.model)
    say(f"evaluating {options.model} on {', '.join(options.tasks)} (lm-evaluation-harness, in this process)")
    try:
        results = simple_evaluate(
            model=LmforgeLM(generator, options.batch_size),
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
    run_id = _log(options, generator, metrics, results) if options.tracking else None
    return HarnessReport(model=options.model, results=metrics, out=options.out, mlflow_run_id=run_id)


def _log(options: HarnessOptions, generator: Generator, metrics: dict, results: dict) -> str:
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
