"""Launch parity_worker.py under torchrun and read back the losses (and what ran),
one run per launch (`losses`) or many (`run_cases`). Every native-engine run also
checks the memory estimator: each rank's model-state bytes must equal, exactly,
those of the tensors it really allocated.

A table's launches need neither Ray nor anything another test makes, so the suite
starts them at its beginning in a thread of their own, their processes at the idle
scheduling class (`run_in_background`): they run on the cores the other tests leave
idle, and the tests that read them run last (tests/conftest.py)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ports import free_port

WORKER = Path(__file__).with_name("parity_worker.py")
# A JSD + cross-entropy logits distillation into a student of another seed, online or
# from the teacher cache's top-8 (parity_worker.CachedTargets scores each batch as the
# cache builder would).
DISTILL_LOGITS = ["distill.loss=jsd", "distill.beta=0.3", "distill.temperature=2", "distill.ce_weight=0.5", "distill.chunk_tokens=16", "train.seed=1"]
FROM_CACHE = ["distill.top_k=8", "distill.cache=scored-by-the-worker"]
# Every family's parts in one model: Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
# a head_dim that is not dim / n_heads, a sliding window on all layers but the first,
# and Gemma 3's (1 + w) norms after each branch too, GeGLU, scaled embeddings, its
# attention scale and the sliding layers' own RoPE base.
FAMILY_PARTS = [
    *("model.qkv_bias=true", "model.qk_norm=true", "model.head_dim=24", "model.sliding_window=8", "model.full_attention_layers=[0]"),
    *("model.unit_offset_norms=true", "model.sandwich_norms=true", "model.activation=gelu_tanh", "model.embed_scale=true"),
    *("model.query_pre_attn_scalar=20", "model.local_rope_theta=5000"),
]
# A mixture of experts (Qwen3-MoE's routing): FSDP shards the experts like any parameter.
MOE = ["model.n_experts=4", "model.experts_per_token=2", "model.expert_ffn_hidden=48", "model.normalize_top_k=true", "model.dense_layers=[1]"]


def check_state_bytes(result: dict) -> None:
    from lmforge.distill.teacher import teacher_shapes
    from lmforge.memory.states import native_states
    from lmforge.spec import JobSpec

    if all(measured is None for measured in result["states"]):
        return  # DeepSpeed: compared with its own estimators in tests/unit
    spec = JobSpec.model_validate(result["spec"])
    for rank, measured in enumerate(result["states"]):
        estimated = native_states(spec, rank, teacher_shapes(spec.distill))
        if spec.parallel.cpu_offload:
            assert estimated.host == sum(measured.values()), (rank, measured, estimated)
        else:
            assert {
                "params": estimated.params,
                "grads": estimated.grads,
                "optimizer": estimated.optimizer,
                "teacher": estimated.teacher,
            } == measured, (rank, spec.parallel)


def result(tmp_path, nproc, *overrides, extra=()) -> dict:
    """One run in a torchrun launch of its own: what the worker wrote (losses, loss
    scales, held-out losses, the engine as its library reports it, ...)."""
    key = hashlib.sha1(repr((overrides, tuple(extra))).encode()).hexdigest()[:12]
    out = tmp_path / f"{nproc}-{key}.json"
    cmd = [*_torchrun(nproc), "--out", str(out)]
    for item in overrides:
        cmd += ["--set", item]
    _launch(cmd + list(extra), timeout_s=180)
    ran = json.loads(out.read_text())
    check_state_bytes(ran)
    return ran


def losses(tmp_path, nproc, *overrides, extra=(), describe=False):
    ran = result(tmp_path, nproc, *overrides, extra=extra)
    return (ran["losses"], ran["engine"]) if describe else ran["losses"]


def run_cases(tmp_path, nproc, cases: dict[str, dict], tag: str = "", idle: bool = False) -> dict[str, dict]:
    """Several runs in one torchrun launch (the start-up of torch in every rank is
    most of a tiny run's time): {name: {"overrides": [...], "save": ..., "load": ...}}
    -> {name: result}, each state-checked. A failing case fails the launch. `idle`:
    at the idle scheduling class, bounded only by `IDLE_TIMEOUT_S` (it waits on the rest)."""
    listed = [case | {"out": str(tmp_path / f"{name}.json")} for name, case in cases.items()]
    path = tmp_path / f"cases-{tag or nproc}.json"
    path.write_text(json.dumps(listed))
    _launch([*_torchrun(nproc), "--cases", str(path)], timeout_s=IDLE_TIMEOUT_S if idle else 120 + 60 * len(cases), idle=idle)
    results = {name: json.loads(Path(case["out"]).read_text()) for name, case in zip(cases, listed)}
    for result in results.values():
        check_state_bytes(result)
    return results


class Launches:
    """A table of cases, {name: (ranks, --set items, options)}, run in as few torchrun
    launches as their dependencies allow, each launch when a test first asks for one
    of its cases. Options: `steps`, `save_at` (save a checkpoint after that step),
    `load` (continue from the named case's checkpoint), `export` (start from the named
    case's checkpoint exported by the real `lmforge export` CLI, in `export_format`,
    lmforge's by default; with `skip_steps`), `teacher` (distil from the named case's
    checkpoint, exported the same way), `exported_as` (formats a saving case is also
    exported in, for tests that read its export), `masked` (learn only the tokens of a
    loss mask shaped as an instruction dataset's: see parity_worker.loss_masks).
    A saving case's exports are made in its launch, by rank 0 right after the save.
    The cases of one world size share a launch, except that a case which needs
    another case's checkpoint runs in a launch after the one that saves it."""

    def __init__(self, table: dict, tmp: Path):
        self.table, self.tmp = table, tmp
        self.results: dict[str, dict] = {}
        self.failed: dict[tuple, str] = {}
        self._running: set[tuple] = set()
        # Held for a whole launch: a test asking for a case the background thread is
        # running waits for it; one it has not reached yet, the test runs itself.
        self._lock = threading.RLock()

    def __call__(self, name: str) -> dict:
        with self._lock:
            launch = self._launch_of(name)
            if launch in self.failed:
                raise AssertionError(f"the launch of {launch[0]} ranks holding {name} failed earlier: {self.failed[launch]}")
            if name not in self.results:
                self._launch(launch)
            return self.results[name]

    def run_all(self) -> None:
        """Every case, launch by launch (a failed launch is kept in `failed` for the
        test that asks for one of its cases)."""
        for name in self.table:
            if _STOPPING.is_set():
                return
            try:
                self(name)
            except Exception:  # noqa: BLE001 - kept in `failed`, or raised again when a test asks for the case
                pass

    def checkpoint(self, name: str) -> Path:
        return self.tmp / f"{name}-ckpt"

    def _needs(self, name: str) -> list[str]:
        options = self.table[name][2]
        return [options[key] for key in ("load", "export", "teacher") if key in options]

    def _all_needs(self, name: str) -> set[str]:
        return {found for need in self._needs(name) for found in (need, *self._all_needs(need))}

    def _launch_of(self, name: str) -> tuple[int, int]:
        """(ranks, level): a case goes one level above the cases of its own world size
        that it needs, directly or not, so it never waits on its own launch."""
        ranks = self.table[name][0]
        return ranks, max((self._launch_of(need)[1] + 1 for need in self._all_needs(name) if self.table[need][0] == ranks), default=0)

    def _launch(self, launch: tuple[int, int]) -> None:
        if launch in self._running:
            raise RuntimeError(f"the {launch[0]}-rank launch {launch[1]} waits on itself through another launch: give a case its own level")
        self._running.add(launch)
        try:
            group = [name for name in self.table if self._launch_of(name) == launch]
            for needed in sorted({need for name in group for need in self._needs(name)}):
                self(needed)  # its checkpoint first
            cases = {name: self._case(name) for name in group}
            self.results.update(run_cases(self.tmp, launch[0], cases, tag=f"{launch[0]}-{launch[1]}", idle=_in_background()))
        except AssertionError as err:
            self.failed[launch] = str(err)[-3000:]
            raise
        finally:
            self._running.discard(launch)

    def _case(self, name: str) -> dict:
        _, overrides, options = self.table[name]
        case = {"overrides": list(overrides)} | {k: options[k] for k in ("steps", "save_at", "skip_steps", "masked") if k in options}
        if "save_at" in options:
            case["save"] = str(self.checkpoint(name))
            case["exports"] = [self._export_request(name, fmt) for fmt in self._formats(name)]
        if "load" in options:
            case["load"] = str(self.checkpoint(options["load"]))
        if "export" in options:
            case["overrides"].append(f"model.init_from={self.export(options['export'], options.get('export_format', 'lmforge'))}")
        if "teacher" in options:
            case["overrides"].append(f"distill.teacher={self.export(options['teacher'], 'lmforge')}")
        return case

    def export(self, name: str, fmt: str) -> Path:
        """The named case's checkpoint as `lmforge export` wrote it in `fmt`: in the case's
        own launch, right after saving (an interpreter per export cost ~5 CPU-seconds)."""
        self(name)
        out = self._export_dir(name, fmt)
        if fmt not in self._formats(name) or not out.is_dir():
            raise AssertionError(f"case {name} is not exported as {fmt}: name it in the case's `exported_as`")
        return out

    def _formats(self, name: str) -> list[str]:
        """Formats a saving case is exported in: those the cases starting from it or
        distilling from it need, and those its `exported_as` names for the tests."""
        wanted = set(self.table[name][2].get("exported_as", ()))
        for _, _, options in self.table.values():
            if options.get("export") == name:
                wanted.add(options.get("export_format", "lmforge"))
            if options.get("teacher") == name:
                wanted.add("lmforge")
        return sorted(wanted)

    def _export_dir(self, name: str, fmt: str) -> Path:
        return self.tmp / f"{name}-export-{fmt}"

    def _export_request(self, name: str, fmt: str) -> dict:
        # The runs' batches are synthetic: a Hugging Face directory still ships a tokenizer.
        return {"format": fmt, "out": str(self._export_dir(name, fmt)), "tokenizer": str(self._tokenizer()) if fmt == "hf" else None}

    def _tokenizer(self) -> Path:
        """Words that fit the tiny model's 256 rows (a byte-level BPE cannot: it needs 257)."""
        from hf_models import word_level_tokenizer

        path = self.tmp / "tokenizer.json"
        if not path.exists():
            word_level_tokenizer(path, 100)
        return path


_SESSION: dict[str, Launches] = {}
_BACKGROUND: list[threading.Thread] = []
_STOPPING = threading.Event()


def launches_of(module, tmp_path_factory) -> Launches:
    """The session's one `Launches` of a test module's `CASES`: the one the background
    runs, when it runs them."""
    if module.__name__ not in _SESSION:
        _SESSION[module.__name__] = Launches(module.CASES, tmp_path_factory.mktemp(module.__name__.removeprefix("test_")))
    return _SESSION[module.__name__]


def run_in_background(tables: list[Launches]) -> None:
    """Every case of `tables`, in order, in one thread whose processes run at the idle
    scheduling class: only on CPU time nothing else wants."""
    thread = threading.Thread(target=lambda: [launches.run_all() for launches in tables], name="parity-launches", daemon=True)
    _BACKGROUND.append(thread)
    thread.start()


def stop_background() -> None:
    """At the session's end: no further launch, the one running killed."""
    _STOPPING.set()
    for proc in list(_RUNNING):
        os.killpg(proc.pid, signal.SIGKILL)
    for thread in _BACKGROUND:
        thread.join(timeout=30)


def _in_background() -> bool:
    return threading.current_thread() in _BACKGROUND


def _torchrun(nproc: int) -> list[str]:
    port = free_port()
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port), str(WORKER)]


IDLE_TIMEOUT_S = 1800  # a launch at the idle class runs only when the rest of the suite waits
_RUNNING: set[subprocess.Popen] = set()


# `cmd` run at the idle scheduling class (its children inherit it), by a small
# interpreter that execs it: a `preexec_fn` is not safe in this threaded process.
# Where there is no such class (not Linux) or it is refused, at the lowest priority.
_IDLE_THEN_EXEC = """
import os, sys
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
os.execv(sys.argv[1], sys.argv[1:])
"""
AT_IDLE = [sys.executable, "-c", _IDLE_THEN_EXEC]


def _launch(cmd: list[str], timeout_s: float, idle: bool = False) -> None:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*AT_IDLE, *cmd] if idle else cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    _RUNNING.add(proc)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        _, stderr = proc.communicate()
        raise AssertionError(
            f"the torchrun launch did not finish within {timeout_s:.0f}s ({' '.join(cmd[-4:])}); the end of its stderr:\n{stderr[-3000:]}"
        ) from None
    finally:
        _RUNNING.discard(proc)
    assert proc.returncode == 0, stderr[-3000:]
