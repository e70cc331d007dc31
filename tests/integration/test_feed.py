"""The Ray Data feed against real shards: each rank gets exactly its slice of the
global order, the tokens are the shard rows of those ids, and a feed started at
a later step (a restart) continues the same sequence."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from lmforge.data.feed import BatchFeed
from lmforge.data.order import BatchLayout, GlobalOrder

pytestmark = pytest.mark.ray


def all_rows(path):
    table = pq.read_table(sorted(str(p) for p in path.glob("shard-*.parquet")))
    ids = table.column("sample_id").to_numpy()
    tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(len(ids), -1)
    return dict(zip(ids.tolist(), tokens))


def make_feed(path, manifest, dp, rank, start, prefetch=3):
    order = GlobalOrder(manifest["num_samples"], seed=4, block=manifest["shard_samples"], window=2)
    layout = BatchLayout(global_batch=8, micro_batch=2, dp=dp)
    return order, layout, BatchFeed(str(path), manifest, order, layout, rank, start, prefetch)


def test_ranks_get_their_slices_across_an_epoch(ray_session, tiny_dataset):
    manifest = json.loads((tiny_dataset / "manifest.json").read_text())
    rows = all_rows(tiny_dataset)
    steps = manifest["num_samples"] // 8 + 3  # crosses into the second epoch
    seen = []
    for rank in range(2):
        order, layout, feed = make_feed(tiny_dataset, manifest, dp=2, rank=rank, start=0)
        for step in range(steps):
            got_step, ids, tokens, _ = feed.next()
            assert got_step == step
            assert np.array_equal(ids, order.ids(*layout.rank_positions(step, rank)))
            assert tokens.shape == (2, 2, manifest["seq_len"] + 1)
            assert np.array_equal(tokens.reshape(len(ids), -1), np.stack([rows[i] for i in ids.tolist()]))
            seen.extend(ids.tolist() if step < manifest["num_samples"] // 8 else [])
        feed.close()
    assert len(seen) == len(set(seen)), "a sample appeared twice within one epoch"


def test_restart_at_a_step_continues_the_sequence(ray_session, tiny_dataset):
    manifest = json.loads((tiny_dataset / "manifest.json").read_text())
    _, _, full = make_feed(tiny_dataset, manifest, dp=1, rank=0, start=0)
    reference = [full.next()[1] for _ in range(12)]
    full.close()
    _, _, resumed = make_feed(tiny_dataset, manifest, dp=1, rank=0, start=7)
    for step in range(7, 12):
        got_step, ids, _, _ = resumed.next()
        assert got_step == step and np.array_equal(ids, reference[step])
    resumed.close()
