"""Distillation between models that tokenize differently (`distill.cross_tokenizer`).

The student's tokens are decoded to text and the teacher tokenizes that text; the two
tokenizations are aligned where both end a token at the same character (so each span
between such boundaries is the same text on both sides). At each shared boundary the
teacher's next-token distribution is projected onto the student's vocabulary through
the tokens both vocabularies spell alike, the exact-match part of GOLD (Patiño et al.
2025, TRL's GOLDTrainer) and NeMo-RL's vocabulary projection: mass on a teacher token
the student cannot spell is left to the top-k loss's tail. With one tokenizer on both
sides every position is aligned and the projection is the identity: today's KD.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from torch import nn

from lmforge.distill.losses import LOG_ZERO, TopK, log_softmax, top_k, within_vocab

UNREADABLE = "\ufffd"  # what a token holding part of a character decodes to alone


@dataclass
class Alignment:
    """One text in both tokenizations. `pairs`: (student position, teacher position) of
    tokens that end at the same character, in order; each consecutive pair bounds a span
    that is the same text on both sides."""

    text: str
    student_ids: list[int]
    teacher_ids: list[int]
    student_ends: list[int]  # the character each student token ends at
    teacher_ends: list[int]
    pairs: list[tuple[int, int]]


def token_ends(tokenizer: Tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The text `ids` decode to and where in it each token ends. A token that completes
    no character yet (part of a multi-byte one) ends where the next readable one does."""
    stream, text, ends = DecodeStream(skip_special_tokens=False), "", []
    for token in ids:
        piece = stream.step(tokenizer, token)
        text += piece or ""
        ends.append(-1 if piece is None else len(text))
    for i in range(len(ends) - 2, -1, -1):  # an unfinished token ends with the token that finishes it
        if ends[i] == -1:
            ends[i] = ends[i + 1]
    return text, [len(text) if end == -1 else end for end in ends]


def spelling(tokenizer: Tokenizer, token: int) -> tuple[str, str]:
    text = tokenizer.decode([token], skip_special_tokens=False)
    if text and UNREADABLE not in text:
        return ("text", text)
    return ("raw", tokenizer.id_to_token(token) or "")


class TokenAligner:
    def __init__(self, student: Tokenizer, teacher: Tokenizer):
        self.student, self.teacher = student, teacher
        # One tokenizer on both sides: the teacher reads the student's own tokens (encoding
        # the decoded text again could tokenize a row cut mid-word otherwise).
        self.same = student.to_str() == teacher.to_str()

    def align(self, student_ids: list[int]) -> Alignment:
        text, student_ends = token_ends(self.student, student_ids)
        if self.same:
            positions = list(range(len(student_ids)))
            return Alignment(text, list(student_ids), list(student_ids), student_ends, student_ends, list(zip(positions, positions)))
        teacher_ids = self.teacher.encode(text, add_special_tokens=False).ids
        teacher_text, teacher_ends = token_ends(self.teacher, teacher_ids)
        # Characters are compared only as far as the teacher's tokens give the text back (a
        # tokenizer that normalizes, or knows no such character, spells another text after).
        same_text = len(os.path.commonprefix([text, teacher_text]))
        last_of = {}  # the last teacher token ending at each character (an empty token ends where its neighbour does)
        for position, end in enumerate(teacher_ends):
            if end <= same_text:
                last_of[end] = position
        pairs, used = [], set()
        for position, end in enumerate(student_ends):
            nxt = student_ends[position + 1] if position + 1 < len(student_ends) else None
            if end in last_of and end not in used and nxt != end:
                pairs.append((position, last_of[end]))
                used.add(end)
        return Alignment(text, list(student_ids), teacher_ids, student_ends, teacher_ends, pairs)


def aligned_share(aligner: TokenAligner, rows: list[list[int]]) -> float:
    """The share of the rows' student tokens that have an aligned teacher position."""
    tokens = sum(len(row) for row in rows)
    return sum(len(aligner.align(row).pairs) for row in rows) / max(1, tokens)


class VocabularyMap:
    """Teacher token id -> the student token id spelled the same: the text a token
    decodes to alone, or, for one holding part of a character (a byte of a byte-level
    BPE) or a special token, its raw form in the vocabulary. One tokenizer: the identity."""

    def __init__(self, student: Tokenizer, teacher: Tokenizer):
        self.student_size = student.get_vocab_size()
        self.identity = student.to_str() == teacher.to_str()
        if self.identity:
            self.target = torch.arange(teacher.get_vocab_size())
        else:
            spelled: dict[tuple[str, str], int] = {}
            for token in range(student.get_vocab_size()):
                spelled.setdefault(spelling(student, token), token)
            self.target = torch.tensor([spelled.get(spelling(teacher, token), -1) for token in range(teacher.get_vocab_size())])
        self.shared = int((self.target >= 0).sum())
        # Projection as gathers in log space: each student token's first teacher token,
        # then rounds of the rest (two teacher tokens spelled alike), each student token
        # at most once a round. No exp and log over the vocabulary.
        self.source = torch.full((self.student_size,), -1, dtype=torch.int64)
        rounds: list[list[tuple[int, int]]] = []
        for teacher_token, student_token in enumerate(self.target.tolist()):
            if student_token < 0:
                continue
            if self.source[student_token] < 0:
                self.source[student_token] = teacher_token
                continue
            free = next((r for r in rounds if all(s != student_token for s, _ in r)), None)
            if free is None:
                rounds.append(free := [])
            free.append((student_token, teacher_token))
        self.rounds = [torch.tensor(r, dtype=torch.int64).unbind(-1) for r in rounds]

    def project(self, teacher_log_probs: torch.Tensor, missing: float = LOG_ZERO) -> torch.Tensor:
        """[..., teacher vocabulary] log-probabilities (or logits) -> [..., student
        vocabulary]: each student token gets the summed probability of the teacher tokens
        spelled as it; one the teacher cannot spell gets `missing`."""
        if self.identity:  # as they are: one tokenizer's KD is today's, bit for bit
            return teacher_log_probs
        device = teacher_log_probs.device
        source = self.source.to(device)
        out = teacher_log_probs.index_select(-1, source.clamp(min=0)).masked_fill_(source < 0, missing)
        for student_ids, teacher_ids in self.rounds:
            student_ids, teacher_ids = student_ids.to(device), teacher_ids.to(device)
            out[..., student_ids] = torch.logaddexp(out[..., student_ids], teacher_log_probs[..., teacher_ids])
        return out

    def project_top_k(self, targets: TopK) -> TopK:
        """Top-k targets in teacher ids -> the same in student ids: an unspellable id's
        log-probability is LOG_ZERO (its mass goes to the tail); two spelled alike keep
        their summed probability on the first and LOG_ZERO on the second."""
        ids = self.target.to(targets.ids.device)[targets.ids]
        logprobs = torch.where(ids >= 0, targets.logprobs, torch.full_like(targets.logprobs, LOG_ZERO))
        ids = ids.clamp(min=0)
        # Duplicates (two teacher tokens, one student spelling): summed on the first occurrence.
        same = ids[..., :, None] == ids[..., None, :]
        earlier = torch.tril(same, diagonal=-1).any(-1)
        summed = torch.logsumexp(torch.where(same, logprobs[..., None, :], torch.full_like(same, LOG_ZERO, dtype=logprobs.dtype)), dim=-1)
        return TopK(ids, torch.where(earlier, torch.full_like(logprobs, LOG_ZERO), torch.maximum(summed, logprobs)))


@dataclass
class TeacherRows:
    """A micro-batch re-tokenized for one teacher: its input ids (right-padded: causal
    attention leaves the earlier positions as they are), and for each student position
    the teacher position read at it and whether there is one."""

    inputs: torch.Tensor  # [batch, teacher length] int64
    positions: torch.Tensor  # [batch, student length] int64
    aligned: torch.Tensor  # [batch, student length] bool


class AlignedTeacher:
    """One teacher of another tokenizer, as a rank uses it: the student's rows in its
    tokens, and its next-token distributions at the aligned positions in the student's
    vocabulary."""

    def __init__(self, model: nn.Module, student: Tokenizer, teacher: Tokenizer, teacher_vocab: int, weight: float = 1.0):
        self.model, self.weight = model, weight
        self.aligner, self.vocabulary = TokenAligner(student, teacher), VocabularyMap(student, teacher)
        self.teacher_vocab = min(teacher_vocab, teacher.get_vocab_size())  # its tokenizer's real ids, not the padding rows

    def rows(self, student_ids: torch.Tensor) -> TeacherRows:
        """The student position s learns, if aligned, the teacher's prediction at the
        teacher token ending at the same character as student token s: both predict what
        follows the same text."""
        batch, length = student_ids.shape
        alignments = [self.aligner.align(row) for row in student_ids.tolist()]
        width = max(1, *(len(a.teacher_ids) for a in alignments))
        inputs = torch.zeros(batch, width, dtype=torch.int64)
        positions = torch.zeros(batch, length, dtype=torch.int64)
        aligned = torch.zeros(batch, length, dtype=torch.bool)
        for row, alignment in enumerate(alignments):
            inputs[row, : len(alignment.teacher_ids)] = torch.tensor(alignment.teacher_ids, dtype=torch.int64)
            if alignment.pairs:
                student_at, teacher_at = torch.tensor(alignment.pairs, dtype=torch.int64).unbind(-1)
                positions[row, student_at], aligned[row, student_at] = teacher_at, True
        return TeacherRows(inputs, positions, aligned)

    @torch.no_grad()
    def _tempered_logits(self, student_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """([batch, student length, teacher vocabulary] the teacher's logits over the
        temperature at the position aligned with each student one, [batch, student length] aligned)."""
        rows = self.rows(student_ids.cpu())
        device = student_ids.device
        logits = within_vocab(self.model(rows.inputs.to(device)), self.teacher_vocab)
        at_student = logits[torch.arange(len(logits), device=device)[:, None], rows.positions.to(device)]
        return at_student.div_(temperature), rows.aligned.to(device)

    def log_probs(self, student_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """([batch, student length, student vocabulary] log-probabilities at the
        temperature, [batch, student length] aligned)."""
        scaled, aligned = self._tempered_logits(student_ids, temperature)
        return self.vocabulary.project(log_softmax(scaled)), aligned

    def top_k(self, student_ids: torch.Tensor, temperature: float, k: int, vocab: int) -> TopK:
        """This teacher alone: its k most likely student tokens at the temperature.
        The ranking is the logits', so the vocabulary-wide normalizer is subtracted from
        the k kept alone (one tokenizer: today's log-softmax, for the same bits)."""
        scaled, aligned = self._tempered_logits(student_ids, temperature)
        if self.vocabulary.identity:
            targets = top_k(log_softmax(scaled)[..., :vocab], k)
            return TopK(targets.ids, targets.logprobs, aligned)
        normalizer = torch.logsumexp(scaled, dim=-1, keepdim=True)
        values, ids = self.vocabulary.project(scaled, missing=-math.inf)[..., :vocab].topk(k, dim=-1)
        return TopK(ids, (values - normalizer).clamp(min=LOG_ZERO), aligned)


def aligned_top_k(teachers: list[AlignedTeacher], student_ids: torch.Tensor, temperature: float, k: int, vocab: int) -> TopK:
    """The teachers' mixture (weights summing to 1) in the student's vocabulary of
    `vocab` tokens, as top-k targets at the temperature; a position learns from them
    where every teacher is aligned."""
    if len(teachers) == 1:
        return teachers[0].top_k(student_ids, temperature, k, vocab)
    parts, aligned = [], None
    for teacher in teachers:
        log_p, where = teacher.log_probs(student_ids, temperature)
        parts.append(log_p[..., :vocab] + math.log(teacher.weight))
        aligned = where if aligned is None else aligned & where
    targets = top_k(torch.logsumexp(torch.stack(parts), dim=0), k)
    return TopK(targets.ids, targets.logprobs, aligned)
