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
from lmforge.distill.cross_tokenizer import AlignedTeacher, TokenAligner, VocabularyMap, aligned_share, aligned_top_k, spelling
from lmforge.distill.losses import Divergence, kd_loss_sum, stored_top_k, teacher_log_probs, top_k
from lmforge.models import ModelConfig, build_model

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


def _teacher(vocab_size: int, seed: int):
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, ffn_hidden=64, max_seq_len=256)
    return build_model(cfg, seed=seed).eval()


def _rows(tokenizer, length: int = 24) -> torch.Tensor:
    """Rows cut from the texts at fixed lengths, as a packed dataset cuts documents."""
    ids = [i for text in TEXTS for i in tokenizer.encode(text).ids]
    return torch.tensor([ids[start : start + length] for start in (0, 17, 40)])


def test_one_tokenizer_online_targets_are_todays_bit_for_bit(tokenizers):
    """The wired path with the student's own tokenizer: the teacher reads the same ids,
    every position is aligned and the targets and loss are today's top-k ones exactly."""
    student, _ = tokenizers
    size = student.get_vocab_size()
    teacher = _teacher(size + 12, seed=3)  # padded embedding rows, as exports have: not compared
    rows = _rows(student)
    targets = aligned_top_k([AlignedTeacher(teacher, student, student, teacher.cfg.vocab_size)], rows, 2.0, 8, size)
    with torch.no_grad():
        todays = top_k(teacher_log_probs(teacher(rows), 2.0, size), 8)
    assert bool(targets.aligned.all())
    assert torch.equal(targets.ids, todays.ids) and torch.equal(targets.logprobs, todays.logprobs)
    student_logits = torch.randn(*rows.shape, size, generator=torch.Generator().manual_seed(2))
    for name in ("forward_kl", "reverse_kl", "jsd"):
        ours = kd_loss_sum(student_logits, targets, None, Divergence(name), 2.0, size)
        assert ours.item() == pytest.approx(kd_loss_sum(student_logits, todays, None, Divergence(name), 2.0, size).item(), rel=1e-6)


def test_another_tokenizers_targets_are_its_own_prediction_at_each_aligned_position(tokenizers):
    """Reference, position by position: the teacher run alone on its tokens up to the
    aligned one (no padding, no batch), its tempered distribution summed onto the
    student's tokens by spelling, the top k of that. Unaligned positions are flagged
    and learn nothing: changing their targets leaves the loss as it is."""
    student, teacher_tokenizer = tokenizers
    size, k, temperature = student.get_vocab_size(), 6, 1.5
    teacher = _teacher(teacher_tokenizer.get_vocab_size(), seed=4)
    rows = _rows(student)
    targets = aligned_top_k([AlignedTeacher(teacher, student, teacher_tokenizer, teacher.cfg.vocab_size)], rows, temperature, k, size)
    student_of = {}
    for token in range(size):
        student_of.setdefault(spelling(student, token), token)
    aligner = TokenAligner(student, teacher_tokenizer)
    for row, ids in enumerate(rows.tolist()):
        pairs = dict(aligner.align(ids).pairs)
        assert targets.aligned[row].tolist() == [s in pairs for s in range(len(ids))]
        teacher_ids = aligner.align(ids).teacher_ids
        for s, t in pairs.items():
            with torch.no_grad():
                log_p = (teacher(torch.tensor([teacher_ids[: t + 1]]))[0, -1].double() / temperature).log_softmax(-1)
            reference = torch.zeros(size, dtype=torch.float64)
            for token, p in enumerate(log_p.exp().tolist()):
                mapped = student_of.get(spelling(teacher_tokenizer, token))
                if mapped is not None:
                    reference[mapped] += p
            values, ids_ref = reference.topk(k)
            assert targets.ids[row, s].tolist() == ids_ref.tolist()
            assert targets.logprobs[row, s].double() == pytest.approx(values.log(), abs=1e-5)
    assert 0.3 < float(targets.aligned.float().mean()) < 1
    student_logits = torch.randn(*rows.shape, size, generator=torch.Generator().manual_seed(5))
    loss = kd_loss_sum(student_logits, targets, None, Divergence("forward_kl"), temperature, size)
    scrambled = targets.logprobs.clone()
    scrambled[~targets.aligned] = -0.01
    other = kd_loss_sum(student_logits, type(targets)(targets.ids, scrambled, targets.aligned), None, Divergence("forward_kl"), temperature, size)
    assert other.item() == loss.item()
    everywhere = kd_loss_sum(student_logits, type(targets)(targets.ids, targets.logprobs), None, Divergence("forward_kl"), temperature, size)
    assert everywhere.item() > loss.item()


def test_two_teachers_mix_in_the_students_vocabulary_where_both_align(tokenizers):
    """Teachers of two tokenizers (the student's own and another): their projected
    distributions mixed by weight before the top k, learnt where both are aligned."""
    student, other = tokenizers
    size, k = student.get_vocab_size(), 5
    own, foreign = _teacher(size, seed=6), _teacher(other.get_vocab_size(), seed=7)
    sides = [AlignedTeacher(own, student, student, size, 0.25), AlignedTeacher(foreign, student, other, foreign.cfg.vocab_size, 0.75)]
    rows = _rows(student)
    mixed = aligned_top_k(sides, rows, 1.0, k, size)
    parts = [side.log_probs(rows, 1.0) for side in sides]
    reference = (0.25 * parts[0][0].double().exp() + 0.75 * parts[1][0].double().exp()).log()
    values, ids = reference.topk(k)
    assert torch.equal(mixed.aligned, parts[0][1] & parts[1][1]) and torch.equal(mixed.aligned, parts[1][1])
    assert torch.equal(mixed.ids[mixed.aligned], ids[mixed.aligned])
    assert torch.allclose(mixed.logprobs[mixed.aligned].double(), values[mixed.aligned], atol=1e-5)


def test_a_cache_marks_a_position_without_a_target_with_id_minus_one():
    ids = torch.tensor([[[4, 2], [-1, -1], [7, 1]]])
    stored = stored_top_k(ids, torch.zeros(1, 3, 2))
    assert stored.aligned.tolist() == [[True, False, True]] and int(stored.ids.min()) == 0


def test_a_word_level_teacher_does_not_read_a_byte_level_students_text(tokenizers):
    """What pre-flight refuses: a vocabulary that spells the text otherwise (a word-level
    one drops the spaces and knows few words) leaves almost no position aligned."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    student, _ = tokenizers
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "def": 1, "return": 2, "x": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    rows = [student.encode(text).ids for text in TEXTS]
    assert aligned_share(TokenAligner(student, words), rows) < 0.1 < 0.5 < aligned_share(TokenAligner(student, tokenizers[1]), rows)
