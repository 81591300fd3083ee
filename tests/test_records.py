"""bert_core/corpus/records.py through the real corpus job (beam_jobs/clean_corpus.py): JSON lines
(plain, .gz, .zst) and Parquet records on real news articles, every kind of bad record, the CLI,
and the vocab and instances stages on such a corpus."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from test_clean_corpus import read_all

from beam_jobs import clean_corpus
from bert_core import storage
from bert_core.config import CorpusConfig
from bert_core.corpus.records import file_keys
from bert_core.corpus.sentences import split_sentences


@pytest.fixture(scope="module")
def news(samples_dir) -> list[str]:
    """Real news articles (one per line in the sample), each a distinct document."""
    return (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").splitlines()[:80]


def jsonl(records: list[dict | str]) -> bytes:
    """JSON lines; a str is written as it is (a blank line, broken JSON)."""
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode("utf-8")


def sentences_of(article: str) -> list[str]:
    return [s for s in split_sentences(article) if len(s) >= CorpusConfig().min_chars_per_sentence]


def assert_counts_add_up(manifest: dict) -> None:
    c = manifest["counts"]["text"]
    assert c["kept"] + c["rejected"] == c["read"]
    assert c["rejected"] == sum(c["rejected_by_reason"].values())


# --------------------------------------------------------------------------- every kind of file


@pytest.fixture(scope="module")
def text_run(news, tmp_path_factory) -> tuple[Path, str]:
    """12 articles in each of web.jsonl (with blank lines), news.jsonl.gz, feed.jsonl.zst (two
    zstd frames) and table.parquet (row groups of 5 rows)."""
    src = tmp_path_factory.mktemp("text")
    web = [{"text": a} for a in news[0:6]] + [""] + [{"text": a} for a in news[6:12]] + [""]
    (src / "web.jsonl").write_bytes(jsonl(web))
    (src / "news.jsonl.gz").write_bytes(gzip.compress(jsonl([{"text": a} for a in news[12:24]])))
    zstd = zstandard.ZstdCompressor()
    (src / "feed.jsonl.zst").write_bytes(zstd.compress(jsonl([{"text": a} for a in news[24:30]]))
                                         + zstd.compress(jsonl([{"text": a} for a in news[30:36]])))
    pq.write_table(pa.table({"text": news[36:48], "n": list(range(12))}), src / "table.parquet", row_group_size=5)
    out = str(tmp_path_factory.mktemp("text_out"))
    clean_corpus.run(CorpusConfig(text=[str(src / "*")]), out, workers=1)
    return src, out


def expected_ids() -> list[str]:
    web = [f"text:web:{n}" for n in list(range(1, 7)) + list(range(8, 14))]  # line 7 is blank
    return (web + [f"text:news:{n}" for n in range(1, 13)] + [f"text:feed:{n}" for n in range(1, 13)]
            + [f"text:table:{n}" for n in range(1, 13)])


def test_jsonl_gz_zst_and_parquet_records_become_documents(news, text_run) -> None:
    src, out = text_run
    docs, rejects, manifest = read_all(out)
    assert rejects == []
    by_id = {d["doc_id"]: d for d in docs}
    ids = expected_ids()
    assert sorted(by_id) == sorted(ids)
    for doc_id, article in zip(ids, news[:48], strict=True):
        doc = by_id[doc_id]
        assert doc["source"] == "text" and doc["sentences"] == sentences_of(article)
    # the title says where the record came from; Parquet rows count on across row groups
    assert by_id["text:web:8"]["title"] == "web line 8"
    assert by_id["text:table:7"]["title"] == "table row 7"
    assert by_id["text:table:7"]["sentences"] == sentences_of(news[42])
    assert manifest["counts"]["text"] == {"read": 48, "kept": 48, "rejected": 0, "rejected_by_reason": {}}
    assert manifest["input_files"]["text"] == sorted(str(p) for p in src.iterdir())
    # the corpus flow's table has the text rows
    from flows.corpus import count_rows

    rows = count_rows(manifest)
    assert {"source": "text", "what": "read", "records": 48} in rows
    assert {"source": "text", "what": "kept", "records": 48} in rows


@pytest.mark.slow
def test_same_bytes_when_row_groups_and_files_spread_over_two_workers(text_run, tmp_path) -> None:
    src, out = text_run
    clean_corpus.run(CorpusConfig(text=[str(src / "*")]), str(tmp_path), workers=2)

    def digest(folder: str) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(Path(folder).iterdir()) if p.name != storage.MANIFEST}

    assert digest(out) == digest(str(tmp_path))


def test_file_keys_stay_distinct_when_stems_collide() -> None:
    keys = file_keys(["/d/a/web.jsonl", "/d/b/web.jsonl.gz", "/d/b/web.parquet", "/d/c/news.jsonl",
                      "/d/c/x.jsonl", "/d/e/x.jsonl"])
    assert keys == {"/d/a/web.jsonl": "web.jsonl", "/d/b/web.jsonl.gz": "web.jsonl.gz",
                    "/d/b/web.parquet": "web.parquet", "/d/c/news.jsonl": "news",
                    "/d/c/x.jsonl": "c/x.jsonl", "/d/e/x.jsonl": "e/x.jsonl"}


# --------------------------------------------------------------------------- bad records


@pytest.fixture(scope="module")
def bad_run(news, tmp_path_factory) -> tuple[Path, dict[str, list[dict]], dict, dict]:
    """One file per kind of bad record, each bad record between two good ones (line 2)."""
    src = tmp_path_factory.mktemp("bad_text")
    good = iter(news)

    def around(bad: bytes) -> bytes:
        return jsonl([{"text": next(good)}]) + bad + b"\n" + jsonl([{"text": next(good)}])

    (src / "broken.jsonl").write_bytes(around(b'{"text": "The river runs'))
    (src / "missing.jsonl").write_bytes(around(json.dumps({"body": next(good)}).encode()))
    (src / "number.jsonl").write_bytes(around(b'{"text": 42}'))
    (src / "latin1.jsonl").write_bytes(around('{"text": "Caf\u00e9 au lait. Bien s\u00fbr."}'.encode("latin-1"))
                                       + b'{"text": "A lone \\ud800 surrogate. It is not text."}\n')
    (src / "blank.jsonl").write_bytes(around(b'{"text": "  \\n\\n  "}'))
    pq.write_table(pa.table({"text": pa.array([next(good).encode(), b"Caf\xe9 au lait. Bien s\xfbr."],
                                              type=pa.binary())}), src / "latin1.parquet")
    # whole files: cut, empty, not records, a Parquet file without the column
    (src / "cut.jsonl.gz").write_bytes(gzip.compress(jsonl([{"text": a} for a in news[60:70]]))[:-40])
    (src / "empty.jsonl").write_bytes(b"\n\n")
    (src / "notes.txt").write_text("not records")
    pq.write_table(pa.table({"body": [news[70]]}), src / "other.parquet")
    out = str(tmp_path_factory.mktemp("bad_text_out"))
    counters: dict[str, int] = {}
    # allow_truncated: the cut file's reject is checked here beside the others
    clean_corpus.run(CorpusConfig(text=[str(src / "*")], dedup_near=False, allow_truncated=True), out, workers=1,
                     counters=counters)
    docs, rejects, manifest = read_all(out)
    reasons: dict[str, list[dict]] = {}
    for r in rejects:
        reasons.setdefault(r["reason"], []).append(r)
    return src, reasons, manifest, {"docs": docs, "counters": counters}


def test_bad_json_line_is_one_reject_naming_file_and_line(bad_run) -> None:
    src, reasons, manifest, _ = bad_run
    (r,) = reasons["bad_json"]
    assert r["source"] == "text" and r["id"] == "text:broken:2"
    assert r["detail"].startswith(f"{src / 'broken.jsonl'} line 2: not JSON")
    assert_counts_add_up(manifest)


def test_missing_field_is_one_reject_naming_file_and_line(bad_run) -> None:
    src, reasons, manifest, _ = bad_run
    by_id = {r["id"]: r for r in reasons["missing_field"]}
    assert by_id["text:missing:2"]["detail"].startswith(f"{src / 'missing.jsonl'} line 2: field 'text' is missing")
    # a Parquet file without the column is one reject naming the columns it has
    assert "has no column(s) ['text']; its columns are ['body']" in by_id["text:other"]["detail"]
    assert len(by_id) == 2
    assert_counts_add_up(manifest)


def test_non_string_field_is_one_reject_naming_file_and_line(bad_run) -> None:
    src, reasons, manifest, _ = bad_run
    (r,) = reasons["not_a_string"]
    assert r["id"] == "text:number:2"
    assert r["detail"] == f"{src / 'number.jsonl'} line 2: field 'text' is a number, not a string"
    assert_counts_add_up(manifest)


def test_bad_utf8_is_one_reject_naming_file_and_line_or_row(bad_run) -> None:
    src, reasons, manifest, extra = bad_run
    by_id = {r["id"]: r for r in reasons["invalid_utf8"]}
    assert sorted(by_id) == ["text:latin1.jsonl:2", "text:latin1.jsonl:4", "text:latin1.parquet:2"]
    assert by_id["text:latin1.jsonl:2"]["detail"].startswith(f"{src / 'latin1.jsonl'} line 2: invalid UTF-8 at byte")
    assert "lone surrogate" in by_id["text:latin1.jsonl:4"]["detail"]
    assert by_id["text:latin1.parquet:2"]["detail"].startswith(f"{src / 'latin1.parquet'} row 2: field 'text'")
    kept = {d["doc_id"] for d in extra["docs"]}
    assert {"text:latin1.jsonl:1", "text:latin1.jsonl:3", "text:latin1.parquet:1"} <= kept
    assert_counts_add_up(manifest)


def test_empty_text_is_one_reject_naming_file_and_line(bad_run) -> None:
    src, reasons, manifest, _ = bad_run
    (r,) = reasons["empty_text"]
    assert r["id"] == "text:blank:2" and r["detail"] == f"{src / 'blank.jsonl'} line 2: field 'text' is empty"
    assert_counts_add_up(manifest)


def test_broken_files_keep_what_they_hold_and_add_one_reject(bad_run) -> None:
    src, reasons, manifest, extra = bad_run
    (cut,) = reasons["truncated_input"]
    assert cut["id"] == "text:cut" and str(src / "cut.jsonl.gz") in cut["detail"]
    assert any(d.startswith("text:cut:") for d in {d["doc_id"] for d in extra["docs"]})
    assert [r["id"] for r in reasons["empty_file"]] == ["text:empty"]
    assert [r["id"] for r in reasons["not_a_record_file"]] == ["text:notes.txt"]
    # every good record around a bad one is kept; one Beam counter per reason
    c = manifest["counts"]["text"]
    cut_kept = sum(d.startswith("text:cut:") for d in {d["doc_id"] for d in extra["docs"]})
    assert c["kept"] == 2 * 5 + 1 + cut_kept  # lines 1 and 3 of 5 files, latin1.parquet row 1
    assert c["read"] == 5 * 3 + 1 + 2 + (cut_kept + 1) + 1 + 1 + 1
    assert extra["counters"] == {f"rejected_{reason}": len(rs) for reason, rs in reasons.items()}
    assert_counts_add_up(manifest)


# --------------------------------------------------------------------------- CLI


def test_cli_reads_text_records_with_named_fields(news, tmp_path) -> None:
    from typer.testing import CliRunner

    from flows.cli.main import app

    records = [{"uid": 100 + i, "headline": f"Story {i}", "body": a} for i, a in enumerate(news[:3])]
    (tmp_path / "stories.jsonl").write_bytes(jsonl(records + [{"uid": 7, "headline": "No body"}]))
    out = tmp_path / "o"
    done = CliRunner().invoke(app, ["corpus", "--text", str(tmp_path / "*.jsonl"), "--text-field", "body",
                                    "--id-field", "uid", "--title-field", "headline", "--workers", "1",
                                    "--output", str(out)])
    assert done.exit_code == 0, done.output
    assert "text: read 4, kept 3, rejected 1" in done.output and "missing_field: 1" in done.output
    docs, rejects, _ = read_all(str(out))
    assert {(d["doc_id"], d["title"]) for d in docs} == {("text:100", "Story 0"), ("text:101", "Story 1"),
                                                         ("text:102", "Story 2")}
    assert rejects[0]["id"] == "text:7" and "line 4: field 'body' is missing" in rejects[0]["detail"]
    # the fields come from --set too
    done = CliRunner().invoke(app, ["corpus", "--text", str(tmp_path / "*.jsonl"), "--output", str(tmp_path / "r"),
                                    "--workers", "1", "--set", "corpus.text_field=body"])
    manifest = storage.read_manifest(str(tmp_path / "r"))
    assert manifest["counts"]["text"]["kept"] == 3 and set(manifest["counts"]) >= {"text", "documents"}
    missing = CliRunner().invoke(app, ["corpus", "--text", str(tmp_path / "none/*.parquet"),
                                       "--output", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "text input" in missing.output and "matched no files" in missing.output


# --------------------------------------------------------------------------- downstream


def test_vocab_and_instances_run_on_a_text_corpus(text_run, tmp_path) -> None:
    from beam_jobs import build_vocab, create_instances
    from bert_core.config import InstanceConfig, SequenceSpec, VocabConfig

    _, corpus = text_run
    vocab = str(tmp_path / "vocab")
    build_vocab.run(VocabConfig(vocab_size=600, num_unused=0), corpus, vocab, workers=1)
    assert len(storage.read_text(storage.join(vocab, "vocab.txt")).splitlines()) == 600
    out = str(tmp_path / "instances")
    config = InstanceConfig(lengths=[SequenceSpec(max_seq_length=64, max_predictions_per_seq=10)],
                            dupe_factor=1, num_shards=1, seed=3)
    manifest = create_instances.run(config, corpus, vocab, out, workers=1, min_docs_per_bucket=8)
    rows = sum(pq.ParquetFile(storage.join(out, "seq64", s["path"])).metadata.num_rows
               for s in storage.read_manifest(storage.join(out, "seq64"))["shards"])
    assert rows > 48  # every article is longer than one 64-token instance
    assert manifest["stage"] == "instances"
