"""`prepare` on Ray Data: text files, JSON lines and Parquet holding the same
documents give identical shards, and the same held-out split; a given
tokenizer.json is used as is; fsspec URIs work; undecodable files are counted,
not fatal; a separate held-out corpus."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.data.prepare import PrepareOptions, prepare_dataset, read_manifest

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
    eos = json.loads((tokenizer_path.parent / "manifest.json").read_text())["tokenizer"]["eos_id"]
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
        manifest = prepare_dataset(PrepareOptions(source=source, out=str(out), seq_len=16, tokenizer=tokenizer, text_column="content", shard_samples=64,
                                                  eval_fraction=0.2, show_progress=False))
        assert manifest["tokenizer"]["sha256"] == read_manifest(tiny_dataset)["tokenizer"]["sha256"]
        assert read_manifest(out)["num_samples"] == manifest["num_samples"] > 64
        assert manifest["eval"]["documents"] == 2 and manifest["eval"]["fraction"] == 0.2
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
    manifest = prepare_dataset(PrepareOptions(source=str(src), out=str(tmp_path / "out"), seq_len=16, tokenizer=str(tiny_dataset / "tokenizer.json"),
                                              eval_source=str(tmp_path / "held.jsonl"), show_progress=False))
    assert manifest["skipped_documents"] == 1 and manifest["documents"] == 2
    # A corpus of its own as the held-out split, tokenized with the dataset's tokenizer.
    assert manifest["eval"]["source"] == str(tmp_path / "held.jsonl") and manifest["eval"]["documents"] == 2
    assert shard_tokens(tmp_path / "out" / "eval")[1] == packed(tiny_dataset / "tokenizer.json", documents[5:7], 17)


def test_wrong_text_column_names_the_field(ray_session, tmp_path):
    from lmforge.errors import UserError

    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match=r"data.text_column: 'text' is not a field of .*d.jsonl \(it has \['body'\]\)"):
        prepare_dataset(PrepareOptions(source=str(tmp_path / "d.jsonl"), out=str(tmp_path / "o"), seq_len=8, show_progress=False))
    assert not (tmp_path / "o").exists()
