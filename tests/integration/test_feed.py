"""The Ray Data feed against real shards: each rank gets exactly its slice of the
global order, the tokens are the shard rows of those ids, and a feed started at
a later step (a restart) continues the same sequence."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from lmforge.data.columns import TopKTargets
from lmforge.data.feed import BatchFeed, Dataset
from lmforge.data.manifest import read_manifest
from lmforge.data.order import BatchLayout, GlobalOrder

pytestmark = pytest.mark.ray


def all_rows(path):
    table = pq.read_table(sorted(str(p) for p in path.glob("shard-*.parquet")))
    ids = table.column("sample_id").to_numpy()
    tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(len(ids), -1)
    return dict(zip(ids.tolist(), tokens))


def make_feed(path, manifest, dp, rank, start, prefetch=3, cache=None):
    order = GlobalOrder(manifest.num_samples, seed=4, block=manifest.shard_samples, window=2)
    layout = BatchLayout(global_batch=8, micro_batch=2, dp=dp)
    return order, layout, BatchFeed([Dataset(str(path), manifest, order)], None, layout, rank, start, prefetch, cache=cache)


K = 3


def fake_cache(directory, dataset, manifest):
    """Teacher-cache shards named as the dataset's whose targets are a function of the
    sample id, so that a target read beside the wrong sample shows."""
    directory.mkdir()
    seq_len = manifest.seq_len
    for shard in manifest.shards:
        ids = pq.read_table(dataset / shard.file, columns=["sample_id"]).column("sample_id").to_numpy()
        top = [(i * 7 + np.arange(seq_len * K)).astype(np.int32) for i in ids]
        logprobs = [np.full(seq_len * K, -(i % 50) / 8, dtype=np.float16) for i in ids]
        pq.write_table(
            pa.table(
                {
                    "sample_id": ids,
                    "topk_ids": pa.array(top, type=pa.list_(pa.int32())),
                    "topk_logprobs": pa.array(logprobs, type=pa.list_(pa.float16())),
                }
            ),
            directory / shard.file,
        )
    return TopKTargets(directory=str(directory), k=K)


@pytest.mark.parametrize("with_cache", [False, True])
def test_ranks_get_their_slices_across_an_epoch(ray_session, tiny_dataset, tmp_path, with_cache):
    """Each rank's samples in the global order over an epoch boundary; with a teacher
    cache, each sample's targets beside it."""
    manifest = read_manifest(tiny_dataset)
    rows = all_rows(tiny_dataset)
    cache = fake_cache(tmp_path / "cache", tiny_dataset, manifest) if with_cache else None
    steps = manifest.num_samples // 8 + 3  # crosses into the second epoch
    seen = []
    for rank in range(2):
        order, layout, feed = make_feed(tiny_dataset, manifest, dp=2, rank=rank, start=0, cache=cache)
        for step in range(steps):
            fed = feed.next()
            assert fed.step == step
            assert np.array_equal(fed.ids, order.ids(*layout.rank_positions(step, rank)))
            assert fed.tokens.shape == (2, 2, manifest.seq_len + 1)
            assert np.array_equal(fed.tokens.reshape(len(fed.ids), -1), np.stack([rows[i] for i in fed.ids.tolist()]))
            if with_cache:
                top, logprobs = fed.targets
                assert top.shape == logprobs.shape == (2, 2, manifest.seq_len, K)
                flat_ids = fed.ids.tolist()
                assert np.array_equal(top.reshape(len(flat_ids), -1), np.stack([i * 7 + np.arange(manifest.seq_len * K) for i in flat_ids]))
                assert np.array_equal(logprobs.reshape(len(flat_ids), -1)[:, 0], np.array([-(i % 50) / 8 for i in flat_ids], dtype=np.float16))
            else:
                assert fed.targets is None
            seen.extend(fed.ids.tolist() if step < manifest.num_samples // 8 else [])
        feed.close()
    assert len(seen) == len(set(seen)), "a sample appeared twice within one epoch"


@pytest.mark.parametrize("with_cache", [False, True])
def test_restart_at_a_step_continues_the_sequence(ray_session, tiny_dataset, tmp_path, with_cache):
    """A feed started at step 7 (a restart) continues the sequence, teacher targets too."""
    manifest = read_manifest(tiny_dataset)
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
    manifest = read_manifest(tiny_dataset)
    steps_per_epoch = manifest.num_samples // 8
    reads = {}
    for start in (0, steps_per_epoch - 8):
        order, layout, feed = make_feed(tiny_dataset, manifest, dp=1, rank=0, start=start, prefetch=2)
        for _ in range(2):
            feed.next()  # the reader has been asked for steps start..start+5 by now: 3 chunks of 2
        positions = range(start * 8, (start + 6) * 8)
        windows = {order.locate(p) for p in positions}
        expected = {int(b) for epoch, w in windows for b in order.blocks(epoch)[w * order.window : (w + 1) * order.window]}
        reads[start] = ray.get(feed.reader.shards_read.remote())  # answered after those chunks: calls run in order
        assert reads[start] == len(expected), (start, reads[start], sorted(expected))
        feed.close()
    assert reads[steps_per_epoch - 8] == reads[0] < len(manifest.shards)


def test_a_mixture_reads_each_source_in_its_own_order_in_the_weights_proportions(ray_session, tiny_dataset, second_dataset):
    """Two sources 3:1 over a chunk of steps, at dp 1 and dp 2 and from a restart: the
    same global order; each source's samples come in that source's own order (the
    small one on into its next epochs); per chunk, exactly the rounded weights."""
    from lmforge.data.mixture import CHUNK, ID_STRIDE, Mixture, chunk_counts

    manifests = [read_manifest(d) for d in (tiny_dataset, second_dataset)]
    orders = [GlobalOrder(m.num_samples, seed=4, block=m.shard_samples, window=2) for m in manifests]
    rows = [all_rows(tiny_dataset), all_rows(second_dataset)]
    steps = 2 * CHUNK // 8 + 3
    assert manifests[1].num_samples < steps * 8 // 4, "the small source must wrap into another epoch"

    def run(dp: int, start: int) -> list[list[int]]:
        """Each step's global batch of (encoded) ids, the ranks' slices side by side."""
        layout = BatchLayout(global_batch=8, micro_batch=2, dp=dp)
        feeds = [
            BatchFeed(
                [Dataset(str(d), m, o) for d, m, o in zip((tiny_dataset, second_dataset), manifests, orders)],
                Mixture([3, 1], seed=4),
                layout,
                rank,
                start,
                4,
            )
            for rank in range(dp)
        ]
        batches = []
        for _ in range(start, steps):
            fed = [feed.next() for feed in feeds]
            ids = np.concatenate([f.ids for f in fed])
            tokens = np.concatenate([f.tokens.reshape(len(f.ids), -1) for f in fed])
            assert np.array_equal(tokens, np.stack([rows[i // ID_STRIDE][i % ID_STRIDE] for i in ids.tolist()]))
            batches.append(ids.tolist())
        for feed in feeds:
            feed.close()
        return batches

    whole = run(dp=1, start=0)
    assert run(dp=2, start=0) == whole
    assert run(dp=2, start=steps - 5) == whole[-5:]
    flat = [i for batch in whole for i in batch]
    for source, order in enumerate(orders):
        mine = [i % ID_STRIDE for i in flat if i // ID_STRIDE == source]
        assert mine == order.ids(0, len(mine)).tolist()
    for chunk in range(2):
        counts = np.bincount([i // ID_STRIDE for i in flat[chunk * CHUNK : (chunk + 1) * CHUNK]], minlength=2)
        assert counts.tolist() == chunk_counts([3, 1]).tolist() == [CHUNK * 3 // 4, CHUNK // 4]


def test_one_reader_serves_every_rank_reading_each_shard_once(ray_session, tiny_dataset):
    """dp 2 x tp 2: four ranks on one shared reader get their slices, and it reads the
    bytes one rank reading alone reads: each shard once per window (before, every rank
    read every shard), and nothing past `end_step`. The reader first reads ahead the
    chunks the feeds will ask for first, as a fresh job's controller has it do while
    the ranks start: the feeds are handed those, nothing is read twice."""
    from lmforge.data.feed import first_chunks, start_reader

    manifest = read_manifest(tiny_dataset)
    steps = manifest.num_samples // 8 + 3  # into the second epoch
    order = GlobalOrder(manifest.num_samples, seed=4, block=manifest.shard_samples, window=2)
    layout = BatchLayout(global_batch=8, micro_batch=2, dp=2)
    datasets = [Dataset(str(tiny_dataset), manifest, order)]
    reader = start_reader(datasets, None, layout, [0, 1], 2, None, ray.get_runtime_context().get_node_id())
    ray.get(reader.prefetch.remote(first_chunks(0, 3, steps)))
    assert ray.get(reader.shards_read.remote()) > 0  # read before any rank asked
    feeds = [BatchFeed(datasets, None, layout, dp_rank, 0, 3, reader=reader, end_step=steps) for dp_rank in (0, 0, 1, 1)]
    for step in range(steps):
        for feed in feeds:
            fed = feed.next()
            assert np.array_equal(fed.ids, order.ids(*layout.rank_positions(step, feed.dp_rank)))
    shared = ray.get(reader.bytes_read.remote())
    assert ray.get(reader.chunks_held.remote()) == 0  # each chunk read ahead was one a feed asked for
    alone = BatchFeed(datasets, None, layout, 0, 0, 3, end_step=steps)
    for _ in range(steps):
        alone.next()
    assert shared == ray.get(alone.reader.bytes_read.remote())
    # The windows trained on, and at most a shard beyond (Ray Data may hand a block of two files).
    windows = {order.locate(p) for p in range(steps * 8)}
    needed = sum((manifest.shards[int(b)].bytes or 0) for epoch, w in windows for b in order.blocks(epoch)[w * 2 : (w + 1) * 2])
    assert needed <= shared <= needed + max(shard.bytes or 0 for shard in manifest.shards)
    alone.close()
    ray.kill(reader)
