"""One rank of a parity run, launched by torchrun: trains the tiny model for a few
steps on fixed batches with the native engine and (rank 0) writes the losses, and
the held-out losses before, during and after (`Engine.eval_loss`).

    torchrun --nproc-per-node 2 parity_worker.py --out losses.json --set parallel.zero=2
    torchrun --nproc-per-node 4 parity_worker.py --out a.json --set parallel.tp=2 --save ck --save-at 3
    torchrun --nproc-per-node 1 parity_worker.py --out b.json --load ck   # steps 4.. only
    torchrun --nproc-per-node 2 parity_worker.py --cases cases.json   # [{"out": ..., "overrides": [...]}, ...]
"""

import argparse
import gc
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from lmforge.checkpoint.config import CheckpointSpec
from lmforge.checkpoint.sharded import load_checkpoint
from lmforge.checkpoint.state import TrainerState
from lmforge.checkpoint.store import CheckpointStore
from lmforge.checkpoint.writer import CheckpointWriter
from lmforge.cli import main as cli_main
from lmforge.distill.loss import DistillInputs
from lmforge.distill.on_policy import OnPolicy
from lmforge.engines import create_engine
from lmforge.guards.inject import FaultInjector
from lmforge.parallel.mesh import build_mesh
from lmforge.parallel.shape import MeshShape
from lmforge.ray_runtime import tune_process
from lmforge.spec import spec_from_dict
from lmforge.trainer import job_loss

STEPS = 6
EVAL_AFTER = (0, 3)  # and after the last step: held-out losses at these step counts


def held_out_batches(count: int = 2) -> list[torch.Tensor]:
    """Global batches the runs never train on (another generator), as in the held-out split."""
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 256, (8, 1), generator=gen) + torch.randint(1, 4, (8, 1), generator=gen) * torch.arange(17)) % 256 for _ in range(count)
    ]


def loss_masks(gen: torch.Generator, rows: int = 8, seq: int = 16) -> torch.Tensor:
    """An instruction dataset's shape of loss mask: each sample's prompt (its first 1-6
    targets) and padding (its last 0-5) not learnt."""
    prompt, padding = torch.randint(1, 7, (rows, 1), generator=gen), torch.randint(0, 6, (rows, 1), generator=gen)
    position = torch.arange(seq)
    return (position >= prompt) & (position < seq - padding)


def _device(offload) -> str | None:
    device = getattr(offload, "device", None)
    return None if device is None else str(getattr(device, "value", device))


def describe(engine) -> dict:
    """What actually ran, as the engine's library reports it."""
    info = {"class": type(engine).__name__}
    if hasattr(engine, "parts"):  # native
        modules = [m for part in engine.parts for m in part.modules()]
        info["compiled_modules"] = sum(getattr(m, "_compiled_call_impl", None) is not None for m in modules)
        groups = [m._get_fsdp_state()._fsdp_param_group for m in modules if isinstance(m, FSDPModule)]
        info["fsdp_units"] = len(groups)
        info["offloaded_units"] = sum(isinstance(group.offload_policy, CPUOffloadPolicy) for group in groups if group is not None)
        states = [p for part in engine.parts for p in part.parameters()]
        states += [v for opt in engine.optimizers for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        info["state_devices"] = sorted({_local(t).device.type for t in states if _local(t).numel() > 1})  # not the step scalars
    if hasattr(engine, "engine"):  # DeepSpeed
        ds = engine.engine
        info.update(
            zero_stage=ds.zero_optimization_stage(),
            offload_optimizer=_device(ds.zero_offload_optimizer()),
            offload_param=_device(ds.zero_offload_param()),
            optimizer=type(ds.basic_optimizer).__name__,
            # What DeepSpeed swaps to NVMe (ZeRO-Infinity), as its own swappers say.
            nvme_swapped=[
                part
                for part, swapped in (
                    ("optimizer", getattr(ds.optimizer, "optimizer_swapper", None) is not None),
                    ("params", any(getattr(p, "nvme_swapper", None) is not None for p in ds.module.parameters())),
                )
                if swapped
            ],
        )
    return info


def state_bytes(engine) -> dict | None:
    """This rank's model-state bytes as allocated (local shards), taken just before
    the optimizer step, when gradients exist; native engine only."""
    if not hasattr(engine, "parts"):
        return None
    params = list({id(p): p for part in engine.parts for p in part.parameters()}.values())
    size = lambda t: sum(map(size, _inner(_local(t)))) if _inner(_local(t)) else _local(t).numel() * _local(t).element_size()
    moments = [v for opt in engine.optimizers for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    teacher = sum(size(p) for t in getattr(engine.loss, "teachers", ()) for p in t.parameters())
    return {
        "params": sum(map(size, params)),
        "grads": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(map(size, moments)),
        "teacher": teacher,
    }


class CachedTargets:
    """What the offline teacher cache would hold for a batch (the cache builder's own
    scoring of it, fp16 log-probabilities included), this rank's share of it, as the
    trainer passes it: a distillation from `distill.cache` without a dataset."""

    def __init__(self, spec):
        from lmforge.distill_jobs.teacher_cache import TeacherTopK

        d = spec.distill
        self.score = TeacherTopK(
            [s.path for s in d.sources], [s.weight for s in d.sources], d.top_k, d.temperature, spec.model_arch.vocab_size, threads=1
        )
        self.k = d.top_k

    def __call__(self, global_batch: torch.Tensor, share) -> tuple[torch.Tensor, torch.Tensor]:
        scored = self.score({"tokens": global_batch.numpy(), "sample_id": list(range(len(global_batch)))})
        rows, seq = global_batch.shape[0], global_batch.shape[1] - 1
        ids = torch.from_numpy(scored["topk_ids"].astype("int64")).view(rows, seq, self.k)
        logprobs = torch.from_numpy(scored["topk_logprobs"].astype("float32")).view(rows, seq, self.k)
        return share(ids), share(logprobs)


def _inner(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a tensor subclass (a QLoRA base's NF4 weight) really holds; [] for a plain one."""
    if type(tensor) is torch.Tensor or not hasattr(tensor, "__tensor_flatten__"):
        return []
    return [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def export(step_dir: Path, exports: list[dict]) -> None:
    """Rank 0 exports the checkpoint just saved through `lmforge export` (the CLI's entry
    point, in this process: torch and lmforge are loaded already), once per format asked."""
    if dist.get_rank() == 0:
        for request in exports:
            argv = ["export", str(step_dir), "--out", request["out"], "--format", request["format"]]
            if request.get("tokenizer"):
                argv += ["--tokenizer", request["tokenizer"]]
            if cli_main(argv) != 0:
                raise RuntimeError(f"lmforge {' '.join(argv)} failed")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="where rank 0 writes the result")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--save", help="checkpoint directory to save into after --save-at steps")
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--load", help="checkpoint directory to resume from")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--skip-steps", type=int, default=0, help="skip this many steps' batches (with model.init_from)")
    parser.add_argument("--masked", action="store_true", help="learn only the tokens of a loss mask per sample (loss_masks)")
    parser.add_argument(
        "--exports",
        type=json.loads,
        default=[],
        help='after saving, `lmforge export` the checkpoint: [{"format": ..., "out": ..., "tokenizer": ...}]',
    )
    parser.add_argument("--cases", help="a JSON list of runs, each a dict of the options above: run one after another in this launch")
    args = parser.parse_args()
    tune_process(1)  # as a rank process is
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    defaults = {k: v for k, v in vars(args).items() if k not in ("cases", "device")}
    cases = json.loads(Path(args.cases).read_text()) if args.cases else [{}]
    for case in cases:
        # One launch runs many cases: the interpreter and torch start once, not per case.
        run_case(argparse.Namespace(**(defaults | case)), device)
        dist.barrier()
        torch._dynamo.reset()  # compiled cases leave their graphs behind
        gc.collect()
    # Exit without destroy_process_group: under heavy load gloo's teardown has
    # aborted a rank now and then ("terminate called without an active exception")
    # after all work was done, which would fail a correct run.
    os._exit(0)


def run_case(args: argparse.Namespace, device: torch.device) -> None:
    began = time.perf_counter()
    world = dist.get_world_size()
    base = {
        "name": "parity",
        "model": {"preset": "tiny", "vocab_size": 256, "n_layers": 4},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "train": {"global_batch": 8, "micro_batch": 2, "seq_len": 16, "max_steps": args.steps},
        "data": {"path": "unused"},
    }
    degree = {key: int(value) for key, _, value in (o.partition("=") for o in args.overrides) if key in ("parallel.tp", "parallel.pp")}
    dp = world // (degree.get("parallel.tp", 1) * degree.get("parallel.pp", 1))
    # Two micro-batches per rank whatever the layout, so accumulation is exercised.
    spec = spec_from_dict(base, [*args.overrides, f"parallel.dp={dp}", f"train.micro_batch={8 // dp // 2}"])
    p = spec.parallel
    dims = build_mesh(device.type, MeshShape.for_spec(p))
    engine = create_engine(spec, dims, device, job_loss(spec))
    inject = FaultInjector(spec, engine, dist.get_rank())  # the job's `debug` faults, as a trainer's
    start = args.skip_steps
    if args.load:
        store = CheckpointStore(args.load)
        ckpt = store.latest()
        load_checkpoint(store, ckpt, engine)
        start = ckpt.step
    gen = torch.Generator().manual_seed(0)
    losses, terms, states, evals, against_teacher, loss_scales = [], [], {}, {}, {}, []
    share = lambda batch: batch.view(dp, -1, 17)[dims.dp_rank].reshape(spec.grad_accum, spec.train.micro_batch, 17)

    # On-policy steps: the row's sample id is its place in the global batch, counted over the steps.
    on_policy = OnPolicy(spec, eos=0) if spec.distill and spec.distill.on_policy else None
    rollout = lambda step: on_policy and on_policy.for_step(step + 1, (torch.arange(8) + 8 * step).view(dp, -1)[dims.dp_rank].numpy())

    cache = CachedTargets(spec) if spec.distill and spec.distill.cache else None
    targets = lambda batch: (
        None
        if cache is None
        else cache(
            batch,
            lambda t: t.view(dp, -1, *t.shape[1:])[dims.dp_rank].reshape(spec.grad_accum, spec.train.micro_batch, *t.shape[1:]),
        )
    )
    loss_inputs = lambda batch, rollout=None: DistillInputs(targets(batch), rollout or None) if spec.distill else None

    # The masks come from a generator of their own: the batches stay those of the other cases.
    masks = torch.Generator().manual_seed(7)
    held_out_masks = [loss_masks(masks) for _ in held_out_batches()]
    mask_of = lambda mask: mask.view(dp, -1, 16)[dims.dp_rank].reshape(spec.grad_accum, spec.train.micro_batch, 16) if args.masked else None

    def evaluate(done: int) -> None:
        if done in (*EVAL_AFTER, args.steps) and done >= start:
            measured = [
                engine.evaluate(share(batch), loss_mask=mask_of(mask), loss_inputs=loss_inputs(batch))
                for batch, mask in zip(held_out_batches(), held_out_masks)
            ]
            evals[done] = sum(m["eval_loss"] for m in measured) / 2
            if "eval_kl" in measured[0]:  # a distillation: its agreement with the teacher too
                against_teacher[done] = {k: sum(m[k] for m in measured) / 2 for k in ("eval_kl", "eval_top1")}

    evaluate(start)
    for step in range(args.steps):
        # Learnable sequences (arithmetic progressions) so the loss visibly falls.
        start_tok = torch.randint(0, 256, (8, 1), generator=gen)
        stride = torch.randint(1, 4, (8, 1), generator=gen)
        mask = loss_masks(masks)
        if step < start:
            continue  # the batch was drawn so the generator stays in step
        global_batch = (start_tok + stride * torch.arange(17)) % 256
        inject.before_step(step + 1)
        stats = engine.train_step(
            share(global_batch),
            before_update=lambda: states.update(measured=state_bytes(engine)),
            loss_mask=mask_of(mask),
            loss_inputs=loss_inputs(global_batch, rollout(step)),
        )
        losses.append(stats.loss)
        terms.append(stats.terms)
        loss_scales.append(stats.loss_scale)
        evaluate(step + 1)
        if args.save and step + 1 == args.save_at:
            writer = CheckpointWriter(
                CheckpointStore(args.save), CheckpointSpec(keep=1, async_save=False), dist.new_group(backend="gloo"), lambda event: None
            )
            writer.save(
                step + 1,
                engine,
                TrainerState(step=step + 1, dp=p.dp, model=spec.model_arch.as_dict(), lora=spec.model.lora, init_from=spec.model.init_from),
            )
            writer.close()
            export(Path(args.save) / f"step_{step + 1:08d}", args.exports)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, states.get("measured"))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "terms": terms,
                    "loss_scales": loss_scales,
                    "eval": evals,
                    "against_teacher": against_teacher,
                    "engine": describe(engine),
                    "states": per_rank,
                    "spec": spec.model_dump(mode="json", exclude_unset=True),
                    "seconds": round(time.perf_counter() - began, 2),
                },
                f,
            )
    dist.barrier()  # results are written; no rank leaves while a peer still sends


if __name__ == "__main__":
    main()
