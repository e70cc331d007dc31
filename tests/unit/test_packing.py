"""Packing documents into fixed samples, and the tokenizer it uses."""

import numpy as np

from lmforge.data.prepare import Packer
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
