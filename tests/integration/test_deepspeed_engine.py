"""The DeepSpeed engine trains like the native one.

Real DeepSpeed 0.19 on CPU with gloo, launched by torchrun: each ZeRO stage, with
and without CPU or NVMe offload, against the native engine's data-parallel run
(fp32, 10 steps, 1e-4 relative). What ran is read back from DeepSpeed itself, so a
silently ignored setting fails the test.
"""

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import DISTILL_LOGITS, FAMILY_PARTS, FROM_CACHE, MOE, launches_of, losses
from parity_worker import held_out_batches

from lmforge.models import build_model
from lmforge.models.weights import open_model_dir

STEPS = ["--steps", "10"]
OFFLOAD_OPT = "deepspeed.config.zero_optimization.offload_optimizer.device=cpu"
OFFLOAD_PARAM = "deepspeed.config.zero_optimization.offload_param.device=cpu"
# ZeRO-Infinity: both offloads to NVMe (a directory here), through DeepSpeed's async
# I/O op, which make setup builds where Debian's libaio is to be had (tools/aio.py).
AIO_READY = Path("/usr/include/libaio.h").exists()
NVME_DIR = Path(tempfile.mkdtemp(prefix="lmforge-nvme-"))
atexit.register(shutil.rmtree, NVME_DIR, True)
OFFLOAD_NVME = [f"deepspeed.config.zero_optimization.offload_{part}={{device: nvme, nvme_path: {NVME_DIR}}}" for part in ("optimizer", "param")]


STAGES = {
    "zero0": (0, []),
    "zero1": (1, []),
    "zero2": (2, []),
    "zero3": (3, []),
    "zero1-offload": (1, [OFFLOAD_OPT]),
    "zero2-offload": (2, [OFFLOAD_OPT]),
    "zero3-offload-all": (3, [OFFLOAD_OPT, OFFLOAD_PARAM]),
    "zero3-offload-nvme": (3, OFFLOAD_NVME),
}
ZERO = "deepspeed.config.zero_optimization.stage"


def zero(stage: int) -> list[str]:
    return ["engine=deepspeed", f"{ZERO}={stage}"]


# name: (ranks, --set items, options): see parity.Launches. Starting torch and
# DeepSpeed in each rank costs more than these runs, so all 2-rank runs that need no
# checkpoint share one launch, and the runs that continue them share a few more.
TEN = {"steps": 10}
LORA = ["model.lora={rank: 4, alpha: 8}", "optim.lr=1e-2"]
ENGINES = {"native": [], "deepspeed": zero(3)}
ON_POLICY = "distill.on_policy={fraction: 0.5, max_new_tokens: 6}"  # steps 3 and 6 of 6 at this seed
CASES = {
    "native": (2, [], TEN),
    **{name: (2, [*zero(stage), *offload], TEN) for name, (stage, offload) in STAGES.items() if AIO_READY or offload != OFFLOAD_NVME},
    "zero3-ac": (2, [*zero(3), "parallel.activation_checkpointing=full"], TEN),
    "zero2-bf16": (2, [*zero(2), "train.precision=bf16"], TEN),
    # A LoRA student: ZeRO partitions the frozen base and optimizes the adapters alone.
    # ZeRO-2's saved after 3 steps: DeepSpeed's checkpoint exported with its frozen base.
    **{
        f"{engine}-lora": (2, [*items, *LORA], TEN | save)
        for engine, items, save in (("native", [], {}), ("zero2", zero(2), {"save_at": 3, "exported_as": ("lmforge",)}), ("zero3", zero(3), {}))
    },
    # Every model family's parts, and a mixture of experts, on both engines.
    **{f"{engine}-families": (2, [*items, *FAMILY_PARTS], TEN) for engine, items in (("native", []), ("zero3", zero(3)))},
    **{f"{engine}-moe": (2, [*items, *MOE], TEN) for engine, items in (("native", []), ("zero3", zero(3)))},
    # Saved by dp 2 after 3 of 6 steps ...
    "native-save": (2, ENGINES["native"], {"save_at": 3}),
    **{f"zero{stage}-save": (2, zero(stage), {"save_at": 3}) for stage in (0, 2, 3)},
    # ... continued on another dp size (ZeRO partitions through DeepSpeed's universal checkpoint) ...
    **{f"zero{stage}-on-dp{dp}": (dp, zero(stage), {"load": f"zero{stage}-save"}) for stage, dp in ((0, 1), (2, 1), (3, 4))},
    # ... or exported by the CLI (native's as a Hugging Face directory), and the other
    # engine started from the export on step 4's batch.
    "deepspeed-from-native": (2, ENGINES["deepspeed"], {"export": "native-save", "export_format": "hf", "skip_steps": 3}),
    "native-from-deepspeed": (2, ENGINES["native"], {"export": "zero3-save", "skip_steps": 3}),
    # Logits distillation from native-save's step-3 weights: online teachers, and the cache's top-k.
    **{
        f"{engine}-distill{kind}": (2, [*items, *DISTILL_LOGITS, *extra], {"teacher": "native-save"})
        for engine, items in (("native", []), ("zero3", zero(3)), ("zero2", zero(2)))
        for kind, extra in (("", []), ("-cache", FROM_CACHE))
        if (engine, kind) != ("zero2", "")
    },
    # Online, with on-policy steps (the student's continuations scored by the teacher).
    **{
        f"{engine}-distill-on-policy": (2, [*items, *DISTILL_LOGITS, ON_POLICY], {"teacher": "native-save"})
        for engine, items in (("native", []), ("zero3", zero(3)))
    },
    # The same from the cache, learning only the tokens of an instruction dataset's loss mask.
    **{
        f"{engine}-distill-cache-masked": (2, [*items, *DISTILL_LOGITS, *FROM_CACHE], {"teacher": "native-save", "masked": True})
        for engine, items in (("native", []), ("zero2", zero(2)))
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launches_of(sys.modules[__name__], tmp_path_factory)


@pytest.fixture(scope="module")
def native_dp2(runs):
    return runs("native")["losses"]


@pytest.mark.parametrize("name", STAGES)
def test_zero_stages_match_native_data_parallel(native_dp2, runs, name):
    stage, offload = STAGES[name]
    if offload == OFFLOAD_NVME and not AIO_READY:
        pytest.skip("libaio-dev is not installed, so DeepSpeed's async I/O op cannot be built (make setup installs it where apt-get can)")
    got, ran = runs(name)["losses"], runs(name)["engine"]
    device = "nvme" if offload == OFFLOAD_NVME else "cpu"
    assert ran["class"] == "DeepSpeedEngine" and ran["zero_stage"] == stage
    assert ran["offload_optimizer"] in ((device,) if offload else (None, "none"))
    assert ran["offload_param"] in ((device,) if OFFLOAD_PARAM in offload or device == "nvme" else (None, "none"))
    assert ran["nvme_swapped"] == (["optimizer", "params"] if device == "nvme" else [])
    assert ran["optimizer"] == "AdamW", "torch's AdamW: no compiled DeepSpeed Adam in the suite"
    assert got == pytest.approx(native_dp2, rel=1e-4)
    assert got[-1] < got[0]


@pytest.mark.parametrize("model", ["families", "moe"])
def test_zero3_trains_the_families_parts_as_the_native_engine(runs, model):
    """q/k/v biases, q/k norms, sliding windows, Gemma's norms and GeGLU; and, apart
    (its routing turns ZeRO's last-bit differences into another expert choice when
    combined with all of those), experts as ordinary parameters to ZeRO's partitioning."""
    native = runs(f"native-{model}")["losses"]
    assert runs(f"zero3-{model}")["engine"]["zero_stage"] == 3
    assert runs(f"zero3-{model}")["losses"] == pytest.approx(native, rel=1e-4)
    assert native != runs("native")["losses"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_lora_student_under_zero(runs, stage):
    """Adapters alone in DeepSpeed's optimizer, the frozen base partitioned by ZeRO-3:
    the native engine's LoRA losses (which train nothing else: its state check), not
    those of training in full."""
    native = runs("native-lora")["losses"]
    assert runs(f"zero{stage}-lora")["engine"]["zero_stage"] == stage
    assert runs(f"zero{stage}-lora")["losses"] == pytest.approx(native, rel=1e-4)
    assert native != pytest.approx(runs("native")["losses"], rel=1e-3)
    if stage == 2:  # `lmforge export` of its checkpoint: the frozen base with the adapters folded in, the job's model at step 3
        exported = runs.export("zero2-lora", "lmforge")
        model = build_model(open_model_dir(exported).cfg, weights=str(exported)).eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).item() for batch in held_out_batches()]
        assert sum(losses) / len(losses) == pytest.approx(runs("zero2-lora")["eval"]["3"], rel=1e-5)


def test_activation_checkpointing_under_zero3(native_dp2, runs):
    assert runs("zero3-ac")["losses"] == pytest.approx(native_dp2, rel=1e-4)


@pytest.mark.parametrize("name", [*STAGES, "zero3-ac"])
def test_held_out_loss_matches_native(runs, name):
    """Forward only under each stage (ZeRO-3 gathering parameters for it), before,
    during and after training."""
    got = runs(name)["eval"]
    assert sorted(got, key=int) == ["0", "3", "10"]
    assert got == pytest.approx(runs("native")["eval"], rel=1e-4)


def _cpu_adam_build_cached() -> bool:
    import os
    import sys
    from pathlib import Path

    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        get_default_build_root(),
        f"py{sys.version_info.major}{sys.version_info.minor}_{'cu' + torch.version.cuda.replace('.', '') if torch.version.cuda else 'cpu'}",
    )
    return any(Path(root, "cpu_adam").glob("cpu_adam*.so"))


@pytest.mark.skipif(not _cpu_adam_build_cached(), reason="DeepSpeedCPUAdam is not built in the torch extensions cache; building it takes minutes")
def test_compiled_cpu_adam_with_offload(native_dp2, tmp_path):
    got, ran = losses(
        tmp_path,
        2,
        "engine=deepspeed",
        "deepspeed.config.zero_optimization.stage=2",
        OFFLOAD_OPT,
        "deepspeed.config.optimizer.type=AdamW",
        "deepspeed.config.optimizer.params.torch_adam=false",
        extra=STEPS,
        describe=True,
    )
    assert ran["optimizer"] == "DeepSpeedCPUAdam"
    assert got == pytest.approx(native_dp2, rel=1e-4)


def test_bf16_is_close_to_fp32(native_dp2, runs):
    got = runs("zero2-bf16")["losses"]
    assert got == pytest.approx(native_dp2, rel=2e-2)
    assert got != pytest.approx(native_dp2, rel=1e-7), "bf16 produced fp32 numbers"


@pytest.mark.parametrize("source, target", [("native", "deepspeed"), ("deepspeed", "native")])
def test_exported_weights_move_between_engines(runs, source, target):
    """Trained 6 steps saving at 3; step 3 exported with the CLI (native's as a Hugging
    Face directory: the q/k rows permuted there and back); the other engine started
    from the export on step 4's batch computes step 4's loss."""
    saved, fmt = ("native-save", "hf") if source == "native" else ("zero3-save", "lmforge")
    continued = runs(f"{target}-from-{source}")["losses"]
    # No dataset behind these runs, so only the Hugging Face export (given --tokenizer) ships one.
    hf_only = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"] if fmt == "hf" else []
    files = sorted(["config.json", "model.safetensors", *hf_only])
    assert sorted(p.name for p in runs.export(saved, fmt).iterdir()) == files
    assert continued[0] == pytest.approx(runs(saved)["losses"][3], rel=1e-5)


@pytest.mark.parametrize(
    "name", ["zero3-distill", "zero3-distill-cache", "zero2-distill-cache", "zero2-distill-cache-masked", "zero3-distill-on-policy"]
)
def test_distillation_matches_native(runs, name):
    """A JSD + cross-entropy distillation under ZeRO (the online teacher whole on each
    rank): the total, each term, and the held-out loss, KL and top-1 agreement of the
    native engine's same run; also learning only an instruction dataset's masked-in
    tokens, and with on-policy steps (the kd term alone, on the student's continuations)."""
    want, got = runs("native-" + name.split("-", 1)[1]), runs(name)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-4)
    on_policy = {2, 5} if name.endswith("on-policy") else set()
    assert [sorted(t) for t in got["terms"]] == [["kd_loss"] if i in on_policy else ["ce_loss", "kd_loss"] for i in range(len(want["losses"]))]
    for term in ("ce_loss", "kd_loss"):
        assert [t.get(term, 0.0) for t in got["terms"]] == pytest.approx([t.get(term, 0.0) for t in want["terms"]], rel=1e-4, abs=2e-6)
    assert want["eval"][str(len(want["losses"]))] < want["eval"]["0"]
    assert got["eval"] == pytest.approx(want["eval"], rel=1e-4) and len(want["eval"]) >= 2
    assert sorted(got["against_teacher"]) == sorted(want["against_teacher"])
    for step, measured in want["against_teacher"].items():
        assert got["against_teacher"][step]["eval_kl"] == pytest.approx(measured["eval_kl"], rel=1e-4, abs=2e-6)
        assert got["against_teacher"][step]["eval_top1"] == pytest.approx(measured["eval_top1"], abs=1e-6)


@pytest.mark.parametrize("stage, dp", [(0, 1), (2, 1), (3, 4)])
def test_resume_on_another_dp_size(runs, stage, dp):
    """Saved on dp 2 after 3 steps, continued on dp 1 or 4: the remaining steps'
    losses are those of dp 2."""
    continued, saved = runs(f"zero{stage}-on-dp{dp}"), runs(f"zero{stage}-save")
    assert continued["losses"] == pytest.approx(saved["losses"][3:], rel=1e-4)
    assert sorted(continued["eval"], key=int) == ["3", "6"]  # held-out loss just after loading, and at the end
    assert continued["eval"] == pytest.approx({step: saved["eval"][step] for step in ("3", "6")}, rel=1e-4)
    assert (runs.checkpoint(f"zero{stage}-save") / "step_00000003" / "universal").is_dir() == (stage > 0)
