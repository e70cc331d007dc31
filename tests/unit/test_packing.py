"""Packing documents into fixed samples, and the tokenizer it uses."""

import numpy as np
import pytest

from lmforge.data.packing import Packer, ShardWriter, held_out
from lmforge.data.tokenizer import EOS_TOKEN, eos_id, train_bpe


def test_documents_are_joined_with_eos_and_cut_exactly():
    packer = Packer(eos=0, width=4)
    first = packer.add([np.array([1, 2, 3]), np.array([4, 5])])  # 1 2 3 0 | 4 5 0
    assert first.tolist() == [[1, 2, 3, 0]]
    second = packer.add([np.array([6, 7, 8, 9, 10])])  # 4 5 0 6 | 7 8 9 10 | 0
    assert second.tolist() == [[4, 5, 0, 6], [7, 8, 9, 10]]
    assert packer.carry.tolist() == [0]
    assert packer.tokens == 3 + 1 + 2 + 1 + 5 + 1


def test_empty_documents_add_nothing():
    packer = Packer(eos=9, width=3)
    assert packer.add([np.array([], dtype=np.int32)]).shape == (0, 3)
    assert packer.tokens == 0


def test_every_token_lands_once_in_order():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, size=rng.integers(0, 20)) for _ in range(50)]
    packer = Packer(eos=0, width=7)
    samples = np.concatenate([packer.add(docs[i : i + 5]) for i in range(0, 50, 5)])
    stream = np.concatenate([np.append(d, 0) for d in docs if len(d)])
    assert np.array_equal(samples.reshape(-1), stream[: samples.size])


def test_trained_bpe_round_trips_and_has_eos():
    text = "def add(a, b):\n    return a + b\n" * 50
    tok = train_bpe([text], vocab_size=300)
    assert tok.get_vocab_size() <= 300
    assert tok.token_to_id(EOS_TOKEN) == eos_id(tok)
    ids = tok.encode("def add(a, b):").ids
    assert tok.decode(ids) == "def add(a, b):"


def test_held_out_documents_are_spread_evenly():
    assert [i for i in range(40) if held_out(i, 0.1)] == [9, 19, 29, 39]
    assert [i for i in range(10) if held_out(i, 0.25)] == [3, 7]
    assert not any(held_out(i, 0.0) for i in range(100))
    assert sum(held_out(i, 0.37) for i in range(1000)) == 370


@pytest.mark.parametrize("masked", [False, True])
def test_held_out_batches_split_over_ranks_like_a_step(tmp_path, masked):
    """Batch b is held-out samples b*G.. in id order; ranks take a step's slices, and
    a batch may straddle two shards. An instruction dataset's loss masks come with
    their samples."""
    from lmforge.data.heldout import HeldOutBatches
    from lmforge.data.order import BatchLayout

    writer = ShardWriter(tmp_path / "eval", seq_len=3, shard_samples=5)
    (tmp_path / "eval").mkdir()
    rows = np.arange(23 * 4, dtype=np.int32).reshape(23, 4)
    masks = (np.arange(23 * 3).reshape(23, 3) % 4 != 0).astype(np.uint8)
    writer.add(rows, **({"loss_mask": masks} if masked else {}))
    writer.close()
    manifest = {"shard_samples": 5, "seq_len": 3, "eval": {"dir": "eval", "shards": writer.shards, "num_samples": 23}}
    if masked:
        manifest["instruct"] = {}
    for dp in (1, 2, 4):
        layout = BatchLayout(global_batch=8, micro_batch=2 if dp < 4 else 1, dp=dp)
        read = [list(HeldOutBatches(str(tmp_path), manifest, layout, rank, batches=2)) for rank in range(dp)]
        assert all(targets is None for batches in read for _, targets, _ in batches)  # no teacher cache
        for column, (width, want) in enumerate([(4, rows), (3, masks if masked else None)]):
            per_rank = [[batch[column * 2] for batch in batches] for batches in read]
            if want is None:
                assert all(b is None for batches in per_rank for b in batches)
                continue
            assert all(b.shape == (layout.accum, layout.micro_batch, width) for batches in per_rank for b in batches)
            for batch in range(2):
                joined = np.concatenate([per_rank[rank][batch].reshape(-1, width) for rank in range(dp)])
                assert (joined == want[batch * 8 : (batch + 1) * 8]).all(), (dp, batch)
