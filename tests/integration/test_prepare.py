"""`prepare` on Ray Data: text files, JSON lines and Parquet holding the same
documents give identical shards, and the same held-out split; a given
tokenizer.json is used as is; fsspec URIs work; undecodable files are counted,
not fatal; a separate held-out corpus."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.data.manifest import DatasetManifest, read_manifest
from lmforge.data.prepare import prepare_dataset
from lmforge.data.prepare_options import PrepareOptions

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def documents(tiny_corpus):
    return [p.read_text() for p in sorted(tiny_corpus.iterdir())][:10]


def shard_tokens(path):
    table = pq.read_table(sorted(str(p) for p in path.glob("shard-*.parquet")))
    return table.column("sample_id").to_pylist(), table.column("tokens").to_pylist()


def packed(tokenizer_path, documents, width):
    """Independent of lmforge's packer: documents joined with EOS, cut into rows."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = read_manifest(tokenizer_path.parent).tokenizer.eos_id
    stream = [t for doc in documents for t in tokenizer.encode(doc).ids + [eos]]
    return [stream[i : i + width] for i in range(0, len(stream) - width + 1, width)]


def test_formats_and_uris_agree(ray_session, tiny_dataset, documents, tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, doc in enumerate(documents):
        (texts / f"{i:02d}.txt").write_text(doc)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in documents))
    pq.write_table(pa.table({"content": documents}), tmp_path / "docs.parquet")
    tokenizer = str(tiny_dataset / "tokenizer.json")
    results = {}
    for name, source in {"text": f"file://{texts}", "jsonl": str(tmp_path / "docs.jsonl"), "parquet": str(tmp_path / "docs.parquet")}.items():
        out = tmp_path / f"out-{name}"
        manifest = prepare_dataset(
            PrepareOptions(
                source=source,
                out=str(out),
                seq_len=16,
                tokenizer=tokenizer,
                text_column="content",
                shard_samples=64,
                eval_fraction=0.2,
                show_progress=False,
            )
        )
        assert manifest.tokenizer.sha256 == read_manifest(tiny_dataset).tokenizer.sha256
        assert read_manifest(out).num_samples == manifest.num_samples > 64
        assert manifest.eval and manifest.eval.documents == 2 and manifest.eval.fraction == 0.2
        results[name] = shard_tokens(out), shard_tokens(out / "eval")
    assert results["text"] == results["jsonl"] == results["parquet"]
    (ids, tokens), (held_ids, held) = results["text"]
    assert ids == list(range(len(ids))) and held_ids == list(range(len(held_ids)))
    # One document in five held out, evenly (the 5th and the 10th), never trained on.
    reference = tiny_dataset / "tokenizer.json"
    assert held == packed(reference, [documents[4], documents[9]], 17)
    assert tokens == packed(reference, [d for i, d in enumerate(documents) if i not in (4, 9)], 17)


def test_undecodable_files_are_skipped_and_counted(ray_session, tiny_dataset, documents, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("\n".join(documents[:3]))
    (src / "b.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \xc3\x28")
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[5:7]))
    manifest = prepare_dataset(
        PrepareOptions(
            source=str(src),
            out=str(tmp_path / "out"),
            seq_len=16,
            tokenizer=str(tiny_dataset / "tokenizer.json"),
            eval_source=str(tmp_path / "held.jsonl"),
            show_progress=False,
        )
    )
    assert manifest.skipped_documents == 1 and manifest.documents == 2
    # A corpus of its own as the held-out split, tokenized with the dataset's tokenizer.
    assert manifest.eval and manifest.eval.source == str(tmp_path / "held.jsonl") and manifest.eval.documents == 2
    assert shard_tokens(tmp_path / "out" / "eval")[1] == packed(tiny_dataset / "tokenizer.json", documents[5:7], 17)


def test_wrong_text_column_names_the_field(ray_session, tmp_path):
    from lmforge.errors import UserError

    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match=r"data.text_column: 'text' is not a field of .*d.jsonl \(it has \['body'\]\)"):
        prepare_dataset(PrepareOptions(source=str(tmp_path / "d.jsonl"), out=str(tmp_path / "o"), seq_len=8, show_progress=False))
    assert not (tmp_path / "o").exists()


def test_shards_are_byte_for_byte_those_of_packing_in_one_process(ray_session, tiny_corpus, tiny_dataset, tmp_path):
    """The session's dataset, packed and written by Ray tasks block by block, against the
    one-process way (the documents in order, one in ten held out, joined with EOS, cut,
    written 256 samples a shard by pyarrow): the same shard files, hash for hash."""
    import hashlib

    import numpy as np

    from lmforge.data.packing import held_out

    manifest = read_manifest(tiny_dataset)
    documents = [p.read_text() for p in sorted(tiny_corpus.iterdir())]
    reference = tiny_dataset / "tokenizer.json"
    for split, chosen, directory in (
        ("train", [d for i, d in enumerate(documents) if not held_out(i, 0.1)], tiny_dataset),
        ("eval", [d for i, d in enumerate(documents) if held_out(i, 0.1)], tiny_dataset / "eval"),
    ):
        rows = np.asarray(packed(reference, chosen, 33), dtype=np.int32)
        entries = manifest.shards if split == "train" else manifest.eval.shards
        assert sum(entry.num_samples for entry in entries) == len(rows), split
        for index, entry in enumerate(entries):
            block = rows[index * 256 : (index + 1) * 256]
            path = tmp_path / f"{split}-{index}.parquet"
            pq.write_table(
                pa.table(
                    {
                        "sample_id": np.arange(index * 256, index * 256 + len(block), dtype=np.int64),
                        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(block.reshape(-1)), 33),
                    }
                ),
                path,
            )
            assert entry.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256((directory / entry.file).read_bytes()).hexdigest()


def test_on_several_nodes_the_work_spreads_and_the_dataset_is_the_same(multinode, tiny_dataset):
    """The same corpus prepared on the shared multi-node cluster (tests/multinode_scenarios.py):
    more than one node packed it, and every shard is the one-node dataset's, byte for byte."""
    results, _ = multinode
    manifest, single = DatasetManifest.model_validate(results["prepare"]), read_manifest(tiny_dataset)
    assert manifest.nodes and manifest.nodes > 1
    for key in ("num_samples", "corpus_tokens", "skipped_documents"):
        assert getattr(manifest, key) == getattr(single, key), key
    assert [s.sha256 for s in manifest.shards] == [s.sha256 for s in single.shards]
    assert manifest.eval and single.eval and [s.sha256 for s in manifest.eval.shards] == [s.sha256 for s in single.eval.shards]


def test_a_failed_write_to_an_object_store_removes_only_its_own_files(s3_bucket):
    """No rename on an object store: the files a failure leaves go one by one, and
    nothing else, not a neighbour sharing the prefix's name nor the bucket itself."""
    import fsspec

    from lmforge.data import storage
    from lmforge.data.staging import staged

    s3 = fsspec.filesystem("s3")
    s3.mkdir("s3://lmforge-empty-bucket")
    theirs = {f"{s3_bucket}/staged-neighbour/keep.txt": b"theirs", f"{s3_bucket}/stagedX": b"theirs"}
    s3.pipe(theirs)
    for out in (f"{s3_bucket}/staged", "s3://lmforge-empty-bucket"):
        with pytest.raises(RuntimeError, match="the pipeline failed"):
            with staged(out) as where:
                storage.write_bytes(storage.join(where, "shard-00000.parquet"), b"x")
                storage.write_bytes(storage.join(where, "eval", "shard-00000.parquet"), b"x")
                raise RuntimeError("the pipeline failed")
        assert not s3.find(out)
    assert s3.exists("s3://lmforge-empty-bucket")
    assert all(s3.cat(path) == data for path, data in theirs.items())
