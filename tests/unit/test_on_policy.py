"""On-policy distillation against independent references: the student's continuations,
from a KV cache or whole-row forwards, are the inference module's generation of each
row alone token for token, greedy and sampled, stopping at end-of-text; an on-policy step's loss is the reverse
KL on those tokens computed with plain torch; the steps chosen follow the fraction."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmforge.distill.loss import DistillInputs
from lmforge.distill.on_policy import OnPolicy, Rollout
from lmforge.engines.native import NativeEngine
from lmforge.inference.generate import generate_ids
from lmforge.inference.sampling import SamplingParams
from lmforge.models.build import build_model
from lmforge.models.weights import write_model_dir
from lmforge.parallel.mesh import build_mesh
from lmforge.parallel.shape import MeshShape
from lmforge.spec import spec_from_dict
from lmforge.trainer import job_loss

SEQ, VOCAB, NEW = 16, 96, 5
MODEL = {"preset": "tiny", "vocab_size": VOCAB, "n_layers": 2}


def student(context: int = 256):
    """`context` below a row plus its new tokens: the rollout takes whole-row forwards
    (its way under tensor parallelism) instead of the KV cache."""
    cfg = spec_from_dict({"name": "t", "data": {"path": "d"}, "model": MODEL}).model_arch
    return build_model(dataclasses.replace(cfg, max_seq_len=context), seed=3).eval()


def batches(rows: int = 6) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, rows // 2, SEQ + 1), generator=torch.Generator().manual_seed(5))


def masks(rows: int = 6) -> torch.Tensor:
    """Prompts of 2-9 tokens (the first learnt position is the prompt's last); the
    last row learns nothing, so it has no room to continue."""
    mask = torch.zeros(rows, SEQ, dtype=torch.bool)
    for row, prompt in enumerate([2, 9, 4, 13, 7]):
        mask[row, prompt - 1 :] = True
    return mask.view(2, rows // 2, SEQ)


def reference_continuation(model, prompt: list[int], seed: int, temperature: float, eos: int) -> list[int]:
    room = min(NEW, SEQ + 1 - len(prompt))
    if room <= 0:
        return []
    params = SamplingParams(max_new_tokens=room, temperature=temperature)
    return generate_ids(model, [prompt], params, frozenset({eos}), vocab=VOCAB, row_seeds=[seed])[0].tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("context", [256, SEQ + NEW], ids=["kv-cache", "whole-rows"])
def test_continuations_are_the_inference_modules_generation(temperature, masked, context):
    model, tokens = student(context), batches()
    loss_mask = masks() if masked else None
    seeds = np.arange(100, 106)
    # End-of-text: the first row's first greedy token, so that at least one row stops early.
    first_prompt = tokens[0, 0, :2] if masked else tokens[0, 0, : SEQ + 1 - NEW]
    eos = int(model(first_prompt[None])[0, -1, :VOCAB].argmax()) if temperature == 0 else 7
    out, mask = Rollout(seeds, NEW, temperature, eos).continue_prompts(model, tokens, loss_mask, VOCAB)
    stopped = 0
    for row in range(6):
        given, got, learnt = tokens.view(6, -1)[row], out.view(6, -1)[row], mask.view(6, -1)[row]
        prompt_len = (
            int(masks().view(6, -1)[row].long().argmax()) + 1 if masked and masks().view(6, -1)[row].any() else (SEQ + 1 if masked else SEQ + 1 - NEW)
        )
        want = reference_continuation(model, given[:prompt_len].tolist(), int(seeds[row]), temperature, eos)
        assert torch.equal(got[:prompt_len], given[:prompt_len])
        assert got[prompt_len : prompt_len + len(want)].tolist() == want, row
        assert (got[prompt_len + len(want) :] == eos).all()  # padding after the continuation
        # The positions learnt are exactly those whose next token the student wrote.
        assert got[1:][learnt].tolist() == want
        stopped += bool(want) and want[-1] == eos and len(want) < min(NEW, SEQ + 1 - prompt_len)
    if temperature == 0:
        assert stopped >= 1
    if masked:
        assert not mask.view(6, -1)[5].any()  # no room: nothing learnt


def test_the_steps_chosen_follow_the_fraction_and_the_seed():
    base = {"name": "t", "data": {"path": "d"}, "model": MODEL, "distill": {"teacher": "t", "on_policy": {"fraction": 0.25}}}
    chosen = [OnPolicy(spec_from_dict(base), eos=0).chooses(step) for step in range(1, 801)]
    assert 0.2 < np.mean(chosen) < 0.3
    assert chosen == [OnPolicy(spec_from_dict(base), eos=0).chooses(step) for step in range(1, 801)]
    other = [OnPolicy(spec_from_dict(base, ["train.seed=9"]), eos=0).chooses(step) for step in range(1, 801)]
    assert other != chosen
    rollout = OnPolicy(spec_from_dict(base), eos=0).for_step(next(s for s in range(1, 801) if chosen[s - 1]), np.array([4, 4, 5]))
    assert rollout.row_seeds[0] == rollout.row_seeds[1] != rollout.row_seeds[2]  # a row's seed: the step and its sample id


def teacher_dir(path):
    """A seeded teacher of the student's shape written as a model directory; returns it."""
    teacher_model = build_model(student().cfg, seed=11)
    write_model_dir(path, "lmforge", teacher_model.cfg, teacher_model.state_dict())
    return teacher_model


def on_policy_spec(distill: dict):
    """The one-process job of these steps: 6 rows of SEQ + 1 in two micro-batches."""
    return spec_from_dict(
        {
            "name": "t",
            "data": {"path": "d"},
            "model": MODEL,
            "optim": {"lr": 1e-2, "warmup_steps": 1},
            "train": {"global_batch": 6, "micro_batch": 3, "seq_len": SEQ, "seed": 3},
            "distill": distill,
        }
    )


def test_an_on_policy_step_learns_reverse_kl_on_the_students_own_tokens(one_rank, tmp_path):
    """One process, the native engine: the step's loss equals the reverse KL at T=2,
    summed over the positions whose next token the student sampled (its own greedy
    generation from a copy of its weights), divided by their count, scaled by T^2."""
    teacher_model = teacher_dir(tmp_path / "teacher")
    temperature, eos = 2.0, 7
    spec = on_policy_spec(
        {
            "teacher": str(tmp_path / "teacher"),
            "temperature": temperature,
            "ce_weight": 0.5,
            "on_policy": {"fraction": 1.0, "max_new_tokens": NEW, "temperature": 0},
        }
    )
    engine = NativeEngine(spec, build_mesh("cpu", MeshShape.for_spec(spec.parallel)), torch.device("cpu"), job_loss(spec, VOCAB, eos))
    copy = build_model(spec.model_arch, weights={k: v.clone() for k, v in engine.parts[0].state_dict().items()}).eval()
    tokens, loss_mask = batches(), masks()
    rollout = OnPolicy(spec, eos).for_step(1, np.arange(6))
    stats = engine.train_step(tokens, loss_mask=loss_mask, loss_inputs=DistillInputs(rollout=rollout))

    total, count = 0.0, 0
    for row in range(5):  # the sixth has no room
        prompt_len = int(loss_mask.view(6, -1)[row].long().argmax()) + 1
        prompt = tokens.view(6, -1)[row, :prompt_len].tolist()
        sequence = torch.tensor([prompt + reference_continuation(copy, prompt, 0, 0.0, eos)])
        with torch.no_grad():
            log_q = F.log_softmax(copy(sequence)[0, :-1, :VOCAB] / temperature, dim=-1)
            log_p = F.log_softmax(teacher_model(sequence)[0, :-1, :VOCAB] / temperature, dim=-1)
        generated = slice(prompt_len - 1, sequence.shape[1] - 1)
        total += (log_q.exp() * (log_q - log_p))[generated].sum().item()
        count += generated.stop - generated.start
    assert set(stats.terms) == {"kd_loss"}  # no cross-entropy on the student's own tokens
    assert stats.terms["kd_loss"] == pytest.approx(temperature**2 * total / count, rel=1e-5)
    assert stats.loss == pytest.approx(stats.terms["kd_loss"], rel=1e-6)
    assert stats.grad_norm > 0


def test_an_on_policy_step_across_one_tokenizer_is_todays_step(one_rank, tmp_path):
    """`distill.cross_tokenizer` with the teacher's tokenizer the student's: the
    continuations read through it, every position aligned, the projection the identity:
    the on-policy step's loss and gradient norm are today's top-k ones to 1e-6."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    teacher_dir(tmp_path / "teacher")
    words.save(str(tmp_path / "teacher" / "tokenizer.json"))
    stats = []
    for cross in ({}, {"cross_tokenizer": {"method": "projection"}}):
        distill = {"teacher": str(tmp_path / "teacher"), "temperature": 2.0, "top_k": 16, "on_policy": {"fraction": 1.0, "max_new_tokens": NEW}}
        spec = on_policy_spec(distill | cross)
        loss = job_loss(spec, VOCAB, 7, str(tmp_path / "teacher" / "tokenizer.json"))
        engine = NativeEngine(spec, build_mesh("cpu", MeshShape.for_spec(spec.parallel)), torch.device("cpu"), loss)
        rollout = OnPolicy(spec, 7).for_step(1, np.arange(6))
        stats.append(engine.train_step(batches(), loss_mask=masks(), loss_inputs=DistillInputs(rollout=rollout)))
    assert loss.aligned and stats[1].terms["kd_loss"] > 0
    assert stats[1].terms["kd_loss"] == pytest.approx(stats[0].terms["kd_loss"], rel=1e-6)
    assert stats[1].grad_norm == pytest.approx(stats[0].grad_norm, rel=1e-6)
