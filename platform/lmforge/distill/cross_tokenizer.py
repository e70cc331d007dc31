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

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from lmforge.distill.losses import LOG_ZERO, TopK

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
        _, teacher_ends = token_ends(self.teacher, teacher_ids)
        last_of = {}  # the last teacher token ending at each character (an empty token ends where its neighbour does)
        for position, end in enumerate(teacher_ends):
            last_of[end] = position
        pairs, used = [], set()
        for position, end in enumerate(student_ends):
            nxt = student_ends[position + 1] if position + 1 < len(student_ends) else None
            if end in last_of and end not in used and nxt != end:
                pairs.append((position, last_of[end]))
                used.add(end)
        return Alignment(text, list(student_ids), teacher_ids, student_ends, teacher_ends, pairs)


class VocabularyMap:
    """Teacher token id -> the student token id spelled the same: the text a token
    decodes to alone, or, for one holding part of a character (a byte of a byte-level
    BPE) or a special token, its raw form in the vocabulary. One tokenizer: the identity."""

    def __init__(self, student: Tokenizer, teacher: Tokenizer):
        self.student_size = student.get_vocab_size()
        if student.to_str() == teacher.to_str():
            self.target = torch.arange(teacher.get_vocab_size())
        else:
            spelled: dict[tuple[str, str], int] = {}
            for token in range(student.get_vocab_size()):
                spelled.setdefault(spelling(student, token), token)
            self.target = torch.tensor([spelled.get(spelling(teacher, token), -1) for token in range(teacher.get_vocab_size())])
        self.shared = int((self.target >= 0).sum())

    def project(self, teacher_log_probs: torch.Tensor) -> torch.Tensor:
        """[..., teacher vocabulary] log-probabilities -> [..., student vocabulary]: each
        student token gets the summed probability of the teacher tokens spelled as it;
        one the teacher cannot spell gets LOG_ZERO."""
        mapped = self.target.to(teacher_log_probs.device)
        kept = mapped >= 0
        probs = teacher_log_probs[..., kept].float().exp()
        out = torch.zeros(*teacher_log_probs.shape[:-1], self.student_size, device=teacher_log_probs.device)
        out.index_add_(-1, mapped[kept], probs)
        return torch.where(out > 0, out.log(), torch.full_like(out, LOG_ZERO))

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
