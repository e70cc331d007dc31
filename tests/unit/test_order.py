"""The global sample order: deterministic, one permutation per epoch, the same
global batches for any number of DP ranks, resumable from a step."""

import numpy as np
import pytest

from lmforge.data.order import BatchLayout, GlobalOrder


@pytest.mark.parametrize("n, block, window", [(50, 4, 3), (1000, 256, 16), (7, 256, 16), (999, 10, 1)])
def test_each_epoch_is_a_permutation_and_epochs_differ(n, block, window):
    order = GlobalOrder(num_samples=n, seed=7, block=block, window=window)
    first, second = order.ids(0, n), order.ids(n, n)
    assert sorted(first.tolist()) == list(range(n)) == sorted(second.tolist())
    assert not np.array_equal(first, second)


def test_a_span_touches_few_blocks_so_reads_stay_local():
    order = GlobalOrder(num_samples=100_000, seed=0, block=256, window=4)
    ids = order.ids(5_000, 512)
    assert len(np.unique(ids // 256)) <= 2 * 4
    assert len(np.unique(order.ids(0, 100_000) // 256)) == -(-100_000 // 256)


def test_order_is_a_pure_function_of_seed():
    assert np.array_equal(GlobalOrder(100, 3).ids(30, 90), GlobalOrder(100, 3).ids(30, 90))
    assert not np.array_equal(GlobalOrder(100, 3).ids(0, 20), GlobalOrder(100, 4).ids(0, 20))


def test_window_across_epoch_boundary_matches_pieces():
    order = GlobalOrder(10, 0)
    assert np.array_equal(order.ids(7, 6), np.concatenate([order.ids(7, 3), order.ids(10, 3)]))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_global_batch_is_independent_of_dp(dp):
    order, global_batch = GlobalOrder(1000, 1), 16
    reference = BatchLayout(global_batch, micro_batch=2, dp=1)
    layout = BatchLayout(global_batch, micro_batch=2, dp=dp)
    for step in range(5):
        ranks = [order.ids(*layout.rank_positions(step, r)) for r in range(dp)]
        assert np.array_equal(np.concatenate(ranks), order.ids(*reference.rank_positions(step, 0)))


def test_resuming_at_a_step_continues_the_uninterrupted_sequence():
    order = GlobalOrder(97, 5)
    layout = BatchLayout(8, micro_batch=4, dp=2)
    uninterrupted = [order.ids(*layout.rank_positions(s, 1)) for s in range(30)]
    resumed = GlobalOrder(97, 5)  # a fresh process after a restart
    assert all(np.array_equal(resumed.ids(*layout.rank_positions(s, 1)), uninterrupted[s]) for s in range(12, 30))


def test_accumulation_count():
    layout = BatchLayout(global_batch=32, micro_batch=4, dp=2)
    assert (layout.per_rank, layout.accum) == (16, 4)


def test_mesh_coordinates_put_tp_innermost():
    from lmforge.parallel.shape import MeshShape

    shape = MeshShape.for_layout(pp=2, dp=2, tp=2, zero=3)
    coords = [shape.coordinates(r) for r in range(8)]
    assert coords[0] == {"pp": 0, "dp": 0, "tp": 0}
    assert coords[1] == {"pp": 0, "dp": 0, "tp": 1}
    assert coords[2] == {"pp": 0, "dp": 1, "tp": 0}
    assert coords[7] == {"pp": 1, "dp": 1, "tp": 1}


def test_pipeline_split_is_contiguous_and_balanced():
    from lmforge.models import PRESETS
    from lmforge.parallel.pipeline import split_layers

    cfg = PRESETS["7b"]
    ranges = split_layers(cfg, 4096, 4)
    assert [i for r in ranges for i in r] == list(range(32))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 2 and sizes[-1] <= sizes[0], sizes  # the head weighs on the last stage
    big_head = cfg.with_overrides(vocab_size=1_000_000)
    assert len(split_layers(big_head, 4096, 4)[-1]) < len(ranges[-1])


def test_stage_assignment_per_schedule():
    from lmforge.parallel.pipeline import stage_indices

    assert stage_indices(1, pp=4, virtual=1, schedule="1f1b") == [1]
    assert stage_indices(1, pp=4, virtual=2, schedule="interleaved-1f1b") == [1, 5]
    assert stage_indices(1, pp=4, virtual=2, schedule="zero-bubble") == [1, 6]


def test_hsdp_mesh_splits_dp_into_replicate_and_shard():
    from lmforge.parallel.shape import MeshShape

    assert MeshShape.for_layout(pp=1, dp=8, tp=1, zero=3, replicate=2).dims == (1, 2, 4, 1)
    assert MeshShape.for_layout(pp=1, dp=8, tp=1, zero=0).dims == (1, 8, 1, 1)


def test_mixture_counts_round_by_largest_remainder_and_positions_are_consecutive():
    from lmforge.data.mixture import CHUNK, Mixture, chunk_counts

    assert chunk_counts([1, 1, 1]).tolist() == [86, 85, 85]
    assert chunk_counts([0.7, 0.2, 0.1], chunk=10).tolist() == [7, 2, 1]
    assert chunk_counts([2, 0, 1], chunk=9).tolist() == [6, 0, 3]  # a zero weight is never read
    mix = Mixture([5, 3, 0, 1], seed=11)
    sources, positions = mix.locate(0, 3 * CHUNK + 17)
    assert 2 not in sources
    for source in (0, 1, 3):
        assert positions[sources == source].tolist() == list(range(int((sources == source).sum())))  # its own order, in turn
    # Any window of positions (a resumed step) maps as the whole run did, and per chunk the counts are exact.
    again = Mixture([5, 3, 0, 1], seed=11)
    window = again.locate(CHUNK + 40, 300)
    assert np.array_equal(window[0], sources[CHUNK + 40 : CHUNK + 340]) and np.array_equal(window[1], positions[CHUNK + 40 : CHUNK + 340])
    assert mix.taken(2 * CHUNK, CHUNK).tolist() == chunk_counts([5, 3, 0, 1]).tolist()
    assert not np.array_equal(Mixture([5, 3, 0, 1], seed=12).locate(0, CHUNK)[0], sources[:CHUNK])  # the seed decides the interleaving
