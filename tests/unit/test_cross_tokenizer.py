"""Cross-tokenizer distillation's parts: two byte-level BPEs trained here on the same
files (300 and 700 tokens: they cut text differently) aligned at shared character
boundaries, each aligned span the same text on both sides and no student token left
out; the teacher's distribution projected onto the student's vocabulary by spelling;
with one tokenizer on both sides, today's KD loss to 1e-6."""

from pathlib import Path

import pytest
import torch

from lmforge.data.corpus import stdlib_files
from lmforge.data.tokenizer import train_bpe
from lmforge.distill.cross_tokenizer import TokenAligner, VocabularyMap
from lmforge.distill.losses import Divergence, kd_loss_sum, teacher_log_probs, top_k

TEXTS = [
    "def naïve_café(x):\n    return x ** 2  # ünïcode — “quoted”\n",
    "class Foo:\n    def __init__(self):\n        self.items = [1, 2, 3]\n",
    "for i in range(10):\n\tprint(f'{i:>4}')\n\n\n",
    "日本語のテキスト and emoji 🙂 mixed in",
]


@pytest.fixture(scope="module")
def tokenizers():
    texts = [Path(f).read_text(errors="replace") for f in stdlib_files()[:6]]
    return train_bpe(texts, 300), train_bpe(texts, 700)


@pytest.mark.parametrize("text", TEXTS)
def test_every_aligned_span_is_the_same_text_on_both_sides(tokenizers, text):
    student, teacher = tokenizers
    ids = student.encode(text).ids
    alignment = TokenAligner(student, teacher).align(ids)
    assert alignment.text == text and alignment.teacher_ids == teacher.encode(text).ids
    assert alignment.teacher_ids != ids  # two tokenizations, not one
    assert alignment.pairs[-1] == (len(ids) - 1, len(alignment.teacher_ids) - 1)  # the text's end is shared
    previous = (-1, -1)
    for s, t in alignment.pairs:
        span_s, span_t = ids[previous[0] + 1 : s + 1], alignment.teacher_ids[previous[1] + 1 : t + 1]
        assert span_s and span_t, "an empty span"
        assert (
            student.decode(span_s)
            == teacher.decode(span_t)
            == text[alignment.student_ends[previous[0]] if previous[0] >= 0 else 0 : alignment.student_ends[s]]
        )
        previous = (s, t)
    # Every student token lies in exactly one span: the spans cover the row.
    assert previous[0] == len(ids) - 1
    assert len(alignment.pairs) > len(ids) / 3, "almost nothing aligned"


def test_the_vocabulary_map_pairs_tokens_spelled_alike(tokenizers):
    student, teacher = tokenizers
    vocab = VocabularyMap(student, teacher)
    pairs = [(t, int(s)) for t, s in enumerate(vocab.target.tolist()) if s >= 0]
    assert student.get_vocab_size() * 0.9 < vocab.shared == len(pairs) < teacher.get_vocab_size()  # the smaller vocabulary is mostly in the larger
    assert all(student.decode([s]) == teacher.decode([t]) and student.id_to_token(s) == teacher.id_to_token(t) for t, s in pairs)
    logits = torch.randn(3, teacher.get_vocab_size(), generator=torch.Generator().manual_seed(0))
    projected = vocab.project(logits.log_softmax(-1))
    assert projected.shape == (3, student.get_vocab_size())
    mass = logits.softmax(-1)[:, vocab.target >= 0].sum(-1)
    assert projected.exp().sum(-1) == pytest.approx(mass, rel=1e-5)  # what the student can spell, no more


def test_one_tokenizer_on_both_sides_is_todays_distillation(tokenizers):
    """Every position aligned, the projection the identity: the same top-k targets and
    the same loss as distillation from the teacher's own top-k log-probabilities (the
    dense projection's exp and log round trip included)."""
    student, _ = tokenizers
    ids = student.encode(TEXTS[0]).ids
    alignment = TokenAligner(student, student).align(ids)
    assert alignment.pairs == [(i, i) for i in range(len(ids))]
    vocab, size = VocabularyMap(student, student), student.get_vocab_size()
    gen = torch.Generator().manual_seed(1)
    teacher_logits, student_logits = torch.randn(len(ids), size, generator=gen), torch.randn(len(ids), size, generator=gen)
    div, temperature = Divergence("forward_kl"), 2.0
    tempered = teacher_log_probs(teacher_logits, temperature, size)
    own, projected = top_k(tempered, 16), vocab.project_top_k(top_k(tempered, 16))
    assert torch.equal(own.ids, projected.ids) and torch.equal(own.logprobs, projected.logprobs)
    todays = kd_loss_sum(student_logits, top_k(tempered, size), None, div, temperature, size)
    every = kd_loss_sum(student_logits, top_k(vocab.project(tempered), size), None, div, temperature, size)
    assert every.item() == pytest.approx(todays.item(), rel=1e-6)
