"""Packing documents into fixed samples, and the tokenizer it uses."""

import numpy as np
import pytest

from lmforge.data.packing import ShardWriter, held_out
from lmforge.data.streams import held_out_mask, join_documents
from lmforge.data.tokenizer import EOS_TOKEN, eos_id, train_bpe


def joined(documents, eos, chosen=None):
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    values = np.concatenate([np.asarray(d, dtype=np.int32) for d in documents])
    return join_documents(values, lengths, np.ones(len(documents), bool) if chosen is None else np.asarray(chosen), eos)


def test_documents_are_joined_with_eos():
    assert joined([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], eos=0).tolist() == [1, 2, 3, 0, 4, 5, 0, 6, 7, 8, 9, 10, 0]
    assert joined([[1, 2, 3], [4, 5], [6]], eos=0, chosen=[True, False, True]).tolist() == [1, 2, 3, 0, 6, 0]


def test_every_token_lands_once_in_order():
    """Against the plain way: each chosen document's tokens, then EOS, concatenated."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, size=rng.integers(1, 20)).astype(np.int32) for _ in range(50)]
    chosen = rng.random(50) < 0.7
    stream = np.concatenate([np.append(d, 0) for d, keep in zip(docs, chosen) if keep])
    assert np.array_equal(joined(docs, eos=0, chosen=chosen), stream)


def test_held_out_mask_is_held_out_for_every_document():
    for fraction in (0.0, 0.1, 0.25, 0.37, 1 / 3):
        assert held_out_mask(1000, 500, fraction).tolist() == [held_out(i, fraction) for i in range(1000, 1500)]


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
    from lmforge.data.manifest import DatasetManifest, HeldOutSplit, InstructRecord, Shard
    from lmforge.data.order import BatchLayout

    writer = ShardWriter(tmp_path / "eval", seq_len=3, shard_samples=5)
    (tmp_path / "eval").mkdir()
    rows = np.arange(23 * 4, dtype=np.int32).reshape(23, 4)
    masks = (np.arange(23 * 3).reshape(23, 3) % 4 != 0).astype(np.uint8)
    writer.add(rows, **({"loss_mask": masks} if masked else {}))
    writer.close()
    # Only what held-out reading uses; an instruction dataset's record marks its samples masked.
    held = HeldOutSplit.model_construct(dir="eval", shards=[Shard(**s) for s in writer.shards], num_samples=23)
    manifest = DatasetManifest.model_construct(shard_samples=5, seq_len=3, eval=held, instruct=InstructRecord.model_construct() if masked else None)
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
