"""Packing and shard writing as Ray tasks, so that the driver of `data prepare` does
no per-token work and the work spreads over the cluster's nodes.

Each block of tokenized documents becomes its piece of each split's token stream
(documents in order, each followed by the end-of-document token, routed to the
training or the held-out split by index). The coordinator adds up the pieces'
lengths, and as soon as the stream holds a group of whole shards, one task cuts
their samples out of the pieces that overlap them and writes the Parquet files.
The result is the same, byte for byte, as packing
the whole stream in one process.
"""

from __future__ import annotations

import bisect
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from lmforge.data import storage
from lmforge.data.packing import write_shard

TRAIN, HELD_OUT = 0, 1


def held_out_mask(first: int, count: int, fraction: float) -> np.ndarray:
    """`packing.held_out` for documents first..first+count-1, at once (the same floats)."""
    if fraction <= 0:
        return np.zeros(count, dtype=bool)
    index = np.arange(first, first + count, dtype=np.float64)
    return np.floor((index + 1) * fraction) > np.floor(index * fraction)


def join_documents(values: np.ndarray, lengths: np.ndarray, chosen: np.ndarray, eos: int) -> np.ndarray:
    """The chosen documents' tokens in order, each followed by `eos` (int32)."""
    kept = np.repeat(chosen, lengths)
    tokens = values[kept]
    ends = np.cumsum(lengths[chosen] + 1) - 1
    stream = np.empty(len(tokens) + len(ends), dtype=np.int32)
    is_token = np.ones(len(stream), dtype=bool)
    is_token[ends] = False
    stream[is_token] = tokens
    stream[ends] = eos
    return stream


# SPREAD, as Ray Data's own tasks: over every node with room, not piled where the data is.
@ray.remote(num_returns=3, num_cpus=0.5, scheduling_strategy="SPREAD")
def block_streams(block: pa.Table, first_doc: int, fraction: float, all_held_out: bool, eos: int):
    """(counts, training stream, held-out stream) of one block of tokenized documents
    (`ids`: list<int32>, `bad`: undecodable). `first_doc`: the index of its first
    document in the source; `all_held_out`: the block is of the held-out source."""
    ids = block.column("ids").combine_chunks()
    bad = block.column("bad").to_numpy(zero_copy_only=False).astype(bool)
    lengths = np.diff(ids.offsets.to_numpy()).astype(np.int64)
    values = ids.values.to_numpy(zero_copy_only=False)
    held = np.ones(len(bad), dtype=bool) if all_held_out else held_out_mask(first_doc, len(bad), fraction)
    documents = [~bad & ~held, ~bad & held]
    streams = [join_documents(values, lengths, chosen & (lengths > 0), eos) for chosen in documents]
    counts = {
        "documents": [int(d.sum()) for d in documents],
        "skipped": int(bad.sum()),
        "tokens": [len(s) for s in streams],
        "chars": int(pc.sum(block.column("chars")).as_py() or 0),
        "node": ray.get_runtime_context().get_node_id(),
    }
    return counts, streams[TRAIN], streams[HELD_OUT]


@ray.remote(num_cpus=0.5, scheduling_strategy="SPREAD")
def write_shards_from_pieces(
    directory: str, first_sample: int, num_samples: int, shard_samples: int, width: int, starts: list[int], *pieces: np.ndarray
) -> list[tuple[dict, str]]:
    """Consecutive shards holding samples first_sample.. (`num_samples` of `width` tokens,
    `shard_samples` a shard), cut from the stream pieces that overlap them (`starts`:
    where each begins in its split's stream): each shard's manifest entry, and the node."""
    lo = first_sample * width
    tokens = np.concatenate([piece[max(lo - start, 0) : lo + num_samples * width - start] for start, piece in zip(starts, pieces)])
    samples = tokens.reshape(num_samples, width)
    node = ray.get_runtime_context().get_node_id()
    written = []
    for offset in range(0, num_samples, shard_samples):
        first = first_sample + offset
        path = storage.join(directory, f"shard-{first // shard_samples:05d}.parquet")
        written.append((write_shard(path, first, {"tokens": samples[offset : offset + shard_samples]}), node))
    return written


class SplitStream:
    """One split's stream, as the pieces of its blocks in order, and its shards: written
    by tasks of `SHARDS_A_TASK` shards as soon as the stream holds them, so writing
    overlaps tokenizing and written pieces can be freed."""

    SHARDS_A_TASK = 8

    def __init__(self, directory, width: int, shard_samples: int):
        self.directory, self.width, self.shard_samples = directory, width, shard_samples
        self.starts: list[int] = []  # where each piece not yet wholly written begins in the stream, ascending
        self.pieces: list[ray.ObjectRef] = []
        self.tokens = self.documents = 0
        self.issued = 0  # samples whose shards are being written
        self.tasks: list[ray.ObjectRef] = []

    def add(self, piece: ray.ObjectRef, tokens: int, documents: int) -> None:
        if tokens:
            self.starts.append(self.tokens)
            self.pieces.append(piece)
        self.tokens += tokens
        self.documents += documents
        self._write(final=False)

    @property
    def num_samples(self) -> int:
        return self.tokens // self.width  # the tail shorter than a sample is dropped

    def _write(self, final: bool) -> None:
        """Start writing every group of whole shards the stream holds (and, if `final`,
        the rest), then drop the pieces wholly written."""
        group = self.SHARDS_A_TASK * self.shard_samples
        while self.issued < self.num_samples:
            count = min(group, self.num_samples - self.issued)
            if count < group and not final:
                break
            lo, hi = self.issued * self.width, (self.issued + count) * self.width
            overlapping = slice(bisect.bisect_right(self.starts, lo) - 1, bisect.bisect_left(self.starts, hi))
            self.tasks.append(
                write_shards_from_pieces.remote(
                    self.directory, self.issued, count, self.shard_samples, self.width, self.starts[overlapping], *self.pieces[overlapping]
                )
            )
            self.issued += count
        # A piece is done with when the next one starts before the first unwritten token.
        done = bisect.bisect_right(self.starts, self.issued * self.width) - 1
        if done > 0:
            del self.starts[:done], self.pieces[:done]

    def write(self) -> list[ray.ObjectRef]:
        """Every shard's task (started now, if not yet); each resolves to a list of
        (the shard's manifest entry, its node)."""
        self._write(final=True)
        return self.tasks


@contextmanager
def settled(*splits: "SplitStream | None"):
    """On a failure inside, waits for the splits' write tasks before it goes on (to the
    removal of what they were writing into)."""
    try:
        yield
    except BaseException:
        tasks = [task for split in splits if split is not None for task in split.tasks]
        if tasks:
            ray.wait(tasks, num_returns=len(tasks), timeout=120)
        raise
