"""Instruction samples two ways: one sample per row (what `lmforge distill generate`
writes: prompt, answer, end-of-text padding; plain causal attention) against several
samples packed per row with document masking (a block-diagonal causal mask, positions
restarting at each sample, so no answer attends to another's prompt). Both learn the
same samples; the bench times forward and backward over all of them, the sides taking
turns, in this process's CPU time (one thread), and prints samples/s and the ratio
packed / one-per-row, repeating until the ratios' spread is smaller than their distance
from 1 (at most `--max-repeats`): which layout is faster here, settled or not.

Sample lengths: a dataset's (`--dataset`, e.g. the one jobs/distill-instruct.yaml
generates), else prompts of 8-24 tokens and answers of 8-48 (that job's limits). The
packed side is first checked to give each sample the logits it has alone in a row.

    python bench/sft_packing.py [--dataset .lmforge/data/python-tasks-answers] [--samples 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from lmforge.data.manifest import read_manifest
from lmforge.models import PRESETS
from lmforge.models.build import build_model
from lmforge.ray_runtime import tune_process


class DocumentMask:
    """The model's KV-cache interface (per-sequence positions, an attention mask) used
    for a training forward: nothing cached, each position sees the earlier positions
    of its own document only, and its position counts from its document's start."""

    def __init__(self, documents: torch.Tensor):  # (rows, seq): each position's document; padding its own
        seq = documents.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        self.mask = ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
        starts = torch.cat([torch.ones_like(documents[:, :1], dtype=torch.bool), documents[:, 1:] != documents[:, :-1]], dim=1)
        index = torch.arange(seq).expand_as(documents)
        self.positions = index - torch.cummax(torch.where(starts, index, 0), dim=1).values

    def layer(self, _index: int) -> "DocumentMask":
        return self

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


def sample_lengths(dataset: str | None, count: int, seq_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) of each sample."""
    if dataset:
        manifest = read_manifest(dataset)
        table = pq.read_table([str(Path(dataset) / s.file) for s in manifest.shards], columns=["loss_mask"]).to_pydict()
        lengths = []
        for mask in table["loss_mask"][:count]:
            mask = np.asarray(mask, dtype=bool)
            lengths.append((int(np.argmax(mask)) + 1, int(mask.sum())))
        return lengths
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(8, 25)), int(rng.integers(8, 49))) for _ in range(count)]


def one_per_row(lengths, seq_len: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = torch.zeros(len(lengths), seq_len + 1, dtype=torch.long)
    labels = torch.full((len(lengths), seq_len), -100, dtype=torch.long)
    docs = []
    for row, (prompt, answer) in enumerate(lengths):
        doc = torch.from_numpy(rng.integers(1, vocab, prompt + answer))
        tokens[row, : len(doc)] = doc
        labels[row, prompt - 1 : prompt - 1 + answer] = doc[prompt:]
        docs.append(doc)
    return tokens[:, :-1], labels, docs


def packed(lengths, docs, seq_len: int):
    """First fit, in order: each sample goes to the first row it fits in."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, (prompt, answer) in enumerate(lengths):
        size = prompt + answer
        slot = next((r for r, free in enumerate(room) if free >= size), None)
        if slot is None:
            rows.append([]), room.append(seq_len)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= size
    tokens = torch.zeros(len(rows), seq_len, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), -100, dtype=torch.long)
    documents = torch.full((len(rows), seq_len), -1, dtype=torch.long)
    where = {}
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            prompt, answer = lengths[i]
            doc = docs[i]
            tokens[r, at : at + len(doc)] = doc
            labels[r, at + prompt - 1 : at + prompt - 1 + answer] = doc[prompt:]  # its last token predicts no other sample's
            documents[r, at : at + len(doc)] = i
            where[i] = (r, at)
            at += len(doc)
        documents[r, at:] = len(lengths) + r  # the padding: a document of its own
    return tokens, labels, documents, where


def check_boundaries(model, single, labels_single, packed_tokens, documents, where, lengths) -> float:
    """Largest difference between a sample's logits alone in a row and packed with others."""
    with torch.no_grad():
        alone = model(single[:8])
        together = model(packed_tokens, DocumentMask(documents))
    worst = 0.0
    for i in range(8):
        r, at = where[i]
        n = sum(lengths[i])
        worst = max(worst, (alone[i, :n] - together[r, at : at + n]).abs().max().item())
    return worst


def step(model, tokens, labels, micro_batch: int, documents=None) -> None:
    for start in range(0, len(tokens), micro_batch):
        cache = DocumentMask(documents[start : start + micro_batch]) if documents is not None else None
        logits = model(tokens[start : start + micro_batch], cache)
        F.cross_entropy(logits.flatten(0, 1), labels[start : start + micro_batch].flatten(), ignore_index=-100).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--max-repeats", type=int, default=8)
    args = parser.parse_args()
    tune_process(1)
    cfg = PRESETS[args.preset].with_overrides(vocab_size=args.vocab, max_seq_len=max(args.seq_len, 256))
    model = build_model(cfg, seed=0)
    lengths = [(p, a) for p, a in sample_lengths(args.dataset, args.samples, args.seq_len) if p + a <= args.seq_len]
    single, single_labels, docs = one_per_row(lengths, args.seq_len, args.vocab)
    packed_tokens, packed_labels, documents, where = packed(lengths, docs, args.seq_len)
    worst = check_boundaries(model, single, single_labels, packed_tokens, documents, where, lengths)
    used = sum(p + a for p, a in lengths)
    print(
        f"{len(lengths)} samples, {used / len(lengths):.1f} tokens each on average; one per row: {len(single)} rows "
        f"({used / single.numel():.0%} of their positions used); packed: {len(packed_tokens)} rows ({used / packed_tokens.numel():.0%}); "
        f"packed logits vs alone: max difference {worst:.2e}"
    )
    assert worst < 1e-4, "document masking let a sample see another"
    sides = {
        "one per row": lambda: step(model, single, single_labels, args.micro_batch),
        "packed": lambda: step(model, packed_tokens, packed_labels, args.micro_batch, documents),
    }
    for run in sides.values():
        run()  # warm up
    times = {name: [] for name in sides}
    ratios = []
    for repeat in range(args.max_repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            model.zero_grad(set_to_none=True)
            began = time.process_time()
            sides[name]()
            times[name].append(time.process_time() - began)
        ratios.append(times["one per row"][-1] / times["packed"][-1])  # > 1: packing is faster
        print(
            f"repeat {repeat + 1}: "
            + ", ".join(f"{name} {len(lengths) / times[name][-1]:.1f} samples/s" for name in sides)
            + f"; packed / one per row speed {ratios[-1]:.3f}"
        )
        spread = max(ratios) - min(ratios)
        if repeat >= 3 and spread < abs(statistics.median(ratios) - 1.0):
            break
    median = statistics.median(ratios)
    settled = max(ratios) - min(ratios) < abs(median - 1.0)
    faster = "packing with document masking" if median > 1 else "one sample per row"
    print(
        f"packed / one per row speed: median {median:.3f} over {len(ratios)} repeats (spread {max(ratios) - min(ratios):.3f}): "
        f"{faster} is faster here" + ("" if settled else " (unsettled)")
    )


if __name__ == "__main__":
    main()
