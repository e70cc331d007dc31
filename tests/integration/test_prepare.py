"""`prepare` on Ray Data: text files, JSON lines and Parquet holding the same
documents give identical shards; a given tokenizer.json is used as is; fsspec
URIs work; undecodable files are counted, not fatal."""

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
        manifest = prepare_dataset(PrepareOptions(source=source, out=str(out), seq_len=16, tokenizer=tokenizer, text_column="content", shard_samples=64, show_progress=False))
        assert manifest["tokenizer"]["sha256"] == read_manifest(tiny_dataset)["tokenizer"]["sha256"]
        assert read_manifest(out)["num_samples"] == manifest["num_samples"] > 64
        results[name] = shard_tokens(out)
    assert results["text"] == results["jsonl"] == results["parquet"]
    ids, tokens = results["text"]
    assert ids == list(range(len(ids))) and all(len(t) == 17 for t in tokens)


def test_undecodable_files_are_skipped_and_counted(ray_session, tiny_dataset, documents, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("\n".join(documents[:3]))
    (src / "b.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \xc3\x28")
    manifest = prepare_dataset(PrepareOptions(source=str(src), out=str(tmp_path / "out"), seq_len=16, tokenizer=str(tiny_dataset / "tokenizer.json"), show_progress=False))
    assert manifest["skipped_documents"] == 1 and manifest["documents"] == 2


def test_wrong_text_column_names_the_field(ray_session, tmp_path):
    from lmforge.errors import UserError

    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match=r"data.text_column: 'text' is not a field of .*d.jsonl \(it has \['body'\]\)"):
        prepare_dataset(PrepareOptions(source=str(tmp_path / "d.jsonl"), out=str(tmp_path / "o"), seq_len=8, show_progress=False))
    assert not (tmp_path / "o").exists()
