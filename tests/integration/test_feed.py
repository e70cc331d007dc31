"""The Ray Data feed against real shards: each rank gets exactly its slice of the
global order, the tokens are the shard rows of those ids, and a feed started at
a later step (a restart) continues the same sequence."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from lmforge.data.feed import BatchFeed
from lmforge.data.order import BatchLayout, GlobalOrder

pytestmark = pytest.mark.ray


def all_rows(path):
    table = pq.read_table(sorted(str(p) for p in path.glob("shard-*.parquet")))
    ids = table.column("sample_id").to_numpy()
    tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(len(ids), -1)
    return dict(zip(ids.tolist(), tokens))


def make_feed(path, manifest, dp, rank, start, prefetch=3, cache=None):
    order = GlobalOrder(manifest["num_samples"], seed=4, block=manifest["shard_samples"], window=2)
    layout = BatchLayout(global_batch=8, micro_batch=2, dp=dp)
    return order, layout, BatchFeed(str(path), manifest, order, layout, rank, start, prefetch, cache=cache)


K = 3


def fake_cache(directory, dataset, manifest):
    """Teacher-cache shards named as the dataset's whose targets are a function of the
    sample id, so that a target read beside the wrong sample shows."""
    directory.mkdir()
    seq_len = manifest["seq_len"]
    for shard in manifest["shards"]:
        ids = pq.read_table(dataset / shard["file"], columns=["sample_id"]).column("sample_id").to_numpy()
        top = [(i * 7 + np.arange(seq_len * K)).astype(np.int32) for i in ids]
        logprobs = [np.full(seq_len * K, -(i % 50) / 8, dtype=np.float16) for i in ids]
        pq.write_table(pa.table({"sample_id": ids, "topk_ids": pa.array(top, type=pa.list_(pa.int32())),
                                 "topk_logprobs": pa.array(logprobs, type=pa.list_(pa.float16()))}), directory / shard["file"])
    return str(directory), {"k": K}


@pytest.mark.parametrize("with_cache", [False, True])
def test_ranks_get_their_slices_across_an_epoch(ray_session, tiny_dataset, tmp_path, with_cache):
    """Each rank's samples in the global order over an epoch boundary; with a teacher
    cache, each sample's targets beside it."""
    manifest = json.loads((tiny_dataset / "manifest.json").read_text())
    rows = all_rows(tiny_dataset)
    cache = fake_cache(tmp_path / "cache", tiny_dataset, manifest) if with_cache else None
    steps = manifest["num_samples"] // 8 + 3  # crosses into the second epoch
    seen = []
    for rank in range(2):
        order, layout, feed = make_feed(tiny_dataset, manifest, dp=2, rank=rank, start=0, cache=cache)
        for step in range(steps):
            fed = feed.next()
            assert fed.step == step
            assert np.array_equal(fed.ids, order.ids(*layout.rank_positions(step, rank)))
            assert fed.tokens.shape == (2, 2, manifest["seq_len"] + 1)
            assert np.array_equal(fed.tokens.reshape(len(fed.ids), -1), np.stack([rows[i] for i in fed.ids.tolist()]))
            if with_cache:
                top, logprobs = fed.targets
                assert top.shape == logprobs.shape == (2, 2, manifest["seq_len"], K)
                flat_ids = fed.ids.tolist()
                assert np.array_equal(top.reshape(len(flat_ids), -1), np.stack([i * 7 + np.arange(manifest["seq_len"] * K) for i in flat_ids]))
                assert np.array_equal(logprobs.reshape(len(flat_ids), -1)[:, 0], np.array([-(i % 50) / 8 for i in flat_ids], dtype=np.float16))
            else:
                assert fed.targets is None
            seen.extend(fed.ids.tolist() if step < manifest["num_samples"] // 8 else [])
        feed.close()
    assert len(seen) == len(set(seen)), "a sample appeared twice within one epoch"


@pytest.mark.parametrize("with_cache", [False, True])
def test_restart_at_a_step_continues_the_sequence(ray_session, tiny_dataset, tmp_path, with_cache):
    """A feed started at step 7 (a restart) continues the sequence, teacher targets too."""
    manifest = json.loads((tiny_dataset / "manifest.json").read_text())
    cache = fake_cache(tmp_path / "cache", tiny_dataset, manifest) if with_cache else None
    _, _, full = make_feed(tiny_dataset, manifest, dp=1, rank=0, start=0, cache=cache)
    reference = [full.next() for _ in range(12)]
    full.close()
    _, _, resumed = make_feed(tiny_dataset, manifest, dp=1, rank=0, start=7, cache=cache)
    for step in range(7, 12):
        fed = resumed.next()
        assert fed.step == step and np.array_equal(fed.ids, reference[step].ids)
        if with_cache:
            assert all(np.array_equal(a, b) for a, b in zip(fed.targets, reference[step].targets))
    resumed.close()


def test_a_resume_near_the_end_reads_only_its_window(ray_session, tiny_dataset):
    """Starting at a step near the end of the epoch reads the shards of the windows
    that step's samples lie in, as many as starting at step 0 reads: the cost of a
    resume does not grow with the step (the reader starts its stream at the window)."""
    manifest = json.loads((tiny_dataset / "manifest.json").read_text())
    steps_per_epoch = manifest["num_samples"] // 8
    reads = {}
    for start in (0, steps_per_epoch - 8):
        order, layout, feed = make_feed(tiny_dataset, manifest, dp=1, rank=0, start=start, prefetch=2)
        for _ in range(2):
            feed.next()  # the reader has been asked for steps start..start+5 by now: 3 chunks of 2
        positions = range(start * 8, (start + 6) * 8)
        windows = {order.locate(p) for p in positions}
        expected = {int(b) for epoch, w in windows for b in order.blocks(epoch)[w * order.window:(w + 1) * order.window]}
        reads[start] = ray.get(feed.reader.shards_read.remote())  # answered after those chunks: calls run in order
        assert reads[start] == len(expected), (start, reads[start], sorted(expected))
        feed.close()
    assert reads[steps_per_epoch - 8] == reads[0] < len(manifest["shards"])
