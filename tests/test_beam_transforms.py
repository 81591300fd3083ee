"""Each composite PTransform of beam_jobs/ alone, on real Beam (TestPipeline on the local
runner chosen by beam_jobs/job.py) with assert_that/equal_to, on tiny real inputs."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from xml.sax.saxutils import escape

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_jobs.build_vocab import CountWords, plan_parts
from beam_jobs.clean_corpus import (
    CleanDocuments,
    FindDuplicates,
    ReadBooks,
    ReadWikipediaDump,
    WriteDocuments,
)
from beam_jobs.create_instances import CreateInstanceShards
from beam_jobs.job import ReadSentences, pipeline_options
from bert_core import storage
from bert_core.config import CorpusConfig, InstanceConfig, SequenceSpec
from bert_core.corpus import documents as D
from bert_core.corpus.sentences import split_sentences
from bert_core.instances.pairs import VocabIds
from bert_core.sorted_runs import SPILL_DIR, read_run, write_run
from bert_core.vocab.tokenization import load_tokenizer
from bert_core.vocab.wordcount import count_key, count_words, read_counts

PROSE = ("The river runs through the old town. It was first mapped in 1820 by Dr. Hale, who "
         "walked its banks for three years. Today it feeds two lakes and a canal. ")


def pipeline() -> test_pipeline.TestPipeline:
    """One in-process worker on the jobs' own local runner (never a runner that needs the network)."""
    return test_pipeline.TestPipeline(options=pipeline_options(workers=1))


def page_xml(page_id: int, title: str, text: str, ns: int = 0) -> str:
    return (f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n    <id>{page_id}</id>\n"
            f"    <revision><id>1</id><text xml:space=\"preserve\">{escape(text)}</text></revision>\n"
            "  </page>\n")


def write_documents_shard(uri: str, docs: list[tuple[str, list[str]]]) -> None:
    table = pa.table({"doc_id": [d for d, _ in docs], "source": ["news"] * len(docs),
                      "title": [d for d, _ in docs],
                      "sentences": pa.array([s for _, s in docs], type=pa.list_(pa.string()))})
    with storage.open_file(uri, "wb") as f:
        pq.write_table(table, f)


# --------------------------------------------------------------------------- clean_corpus


def test_read_wikipedia_dump_gives_documents_rejects_and_read_counts(tmp_path) -> None:
    dump = tmp_path / "tiny.xml"
    dump.write_text(
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
        + page_xml(1, "River", PROSE) + page_xml(2, "Moved", "#REDIRECT [[River]]")
        + page_xml(3, "Talk:River", PROSE, ns=1) + "</mediawiki>\n")
    with pipeline() as p:
        out = p | ReadWikipediaDump([str(dump)])
        docs = out["docs"] | "Ids" >> beam.Map(lambda d: (d["doc_id"], d["title"], len(d["sentences"])))
        assert_that(docs, equal_to([("wiki:1", "River", 3)]), label="CheckDocs")
        reasons = out["rejects"] | "Reasons" >> beam.Map(lambda r: (r["id"], r["reason"]))
        assert_that(reasons, equal_to([("wiki:2", D.REDIRECT), ("wiki:3", D.NOT_ARTICLE)]),
                    label="CheckRejects")
        assert_that(out["read"], equal_to([(D.WIKIPEDIA, 3)]), label="CheckRead")


def test_read_books_gives_one_document_per_book_or_a_reject(tmp_path) -> None:
    (tmp_path / "tale.txt").write_text(PROSE * 4)
    (tmp_path / "empty.txt").write_bytes(b"")
    files = [str(tmp_path / "empty.txt"), str(tmp_path / "tale.txt")]
    with pipeline() as p:
        out = p | ReadBooks(files)
        docs = out["docs"] | "Ids" >> beam.Map(lambda d: (d["doc_id"], d["source"], d["sentences"][0]))
        assert_that(docs, equal_to([("book:tale", D.BOOKS, "The river runs through the old town.")]),
                    label="CheckDocs")
        reasons = out["rejects"] | "Reasons" >> beam.Map(lambda r: (r["id"], r["reason"]))
        assert_that(reasons, equal_to([("book:empty", D.EMPTY_FILE)]), label="CheckRejects")
        assert_that(out["read"], equal_to([(D.BOOKS, 1), (D.BOOKS, 1)]), label="CheckRead")


def long_book(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = PROSE.replace(".", "").replace(",", "").split()
    return [" ".join(rng.choice(words) for _ in range(12)).capitalize() + "." for _ in range(60)]


def holds(predicate):
    """An assert_that matcher from a predicate on the whole PCollection."""
    def match(got):
        assert predicate(got), got
    return match


def spilled(output: str, kind: str) -> list:
    """Every record of the runs of one kind that a step spilled under ``output``."""
    return [r for uri in storage.glob(storage.join(output, SPILL_DIR, f"{kind}-*.pkl")) for r in read_run(uri)]


def test_clean_documents_filters_and_finds_exact_and_near_duplicates(tmp_path) -> None:
    book = long_book(1)
    edited = [*book[:-2], "An edited line that was not in the original book at all.", book[-1]]
    docs = [
        D.make_document("wiki:1", D.WIKIPEDIA, "River", split_sentences(PROSE), "a.xml"),
        D.make_document("wiki:9", D.WIKIPEDIA, "Copy", split_sentences(PROSE), "b.xml"),
        D.make_document("wiki:5", D.WIKIPEDIA, "Stub", ["Too short."], "a.xml"),
        D.make_document("book:a", D.BOOKS, "A", book, "a.txt"),
        D.make_document("book:b", D.BOOKS, "B", edited, "b.txt"),
    ]
    output = str(tmp_path)
    with pipeline() as p:
        runs = {"docs": p | "Docs" >> beam.Create(docs), "rejects": p | "Rejects" >> beam.Create([])} | CleanDocuments(
            CorpusConfig(), output, num_shards=1)
        verdicts = runs | FindDuplicates(CorpusConfig(), output, num_shards=1)
        # only (shard or bucket, run file) pairs leave these steps
        for kind, pcoll in {**runs, **verdicts}.items():
            assert_that(pcoll | f"Check{kind}" >> beam.MapTuple(lambda bucket, uri: (bucket, ".pkl" in uri)),
                        holds(lambda got: all(x == (0, True) for x in got)), label=f"Runs{kind}")
    assert sorted(d["doc_id"] for d in spilled(output, "docs")) == ["book:a", "book:b", "wiki:1", "wiki:9"]
    assert [(r["id"], r["reason"]) for r in spilled(output, "rejects")] == [("wiki:5", D.TOO_FEW_SENTENCES)]
    # the smallest (doc_id, origin) of the same text is kept
    assert spilled(output, "dup") == [(("wiki:9", "b.xml"), ("wiki:1", "a.xml"))]
    assert {(doc_id, match[0]) for doc_id, match in spilled(output, "near")} == {("book:b", "book:a")}


def test_write_documents_applies_verdicts_and_writes_every_shard(tmp_path) -> None:
    output = str(tmp_path / "corpus")
    docs = [D.make_document(f"wiki:{i}", D.WIKIPEDIA, f"T{i}", split_sentences(PROSE), "a.xml")
            for i in (3, 1, 2)]
    early = D.make_reject(D.WIKIPEDIA, "wiki:7", D.REDIRECT, "'Moved' is a redirect")
    runs = {kind: str(tmp_path / f"{kind}.pkl") for kind in ("docs", "rejects", "exact")}
    write_run(runs["docs"], docs, key=lambda d: (d["doc_id"], d["origin"]))
    write_run(runs["rejects"], [early], key=D.reject_sort_key)
    write_run(runs["exact"], [(("wiki:2", "a.xml"), ("wiki:1", "b.xml"))])
    with pipeline() as p:
        summaries = {
            "docs": p | "Docs" >> beam.Create([(0, runs["docs"])]),
            "rejects": p | "Rejects" >> beam.Create([(0, runs["rejects"])]),
            "exact": p | "Dups" >> beam.Create([(0, runs["exact"])]),
            "near": p | "Near" >> beam.Create([]),
        } | WriteDocuments(output, num_shards=2, text_format="none")
        counts = summaries | beam.MapTuple(lambda kind, acc: (kind, acc["kept"], acc["rejected"]))
        # one partial summary per shard, the empty shard too
        assert_that(counts, equal_to([("partial", {D.WIKIPEDIA: 2}, {"wikipedia/duplicate": 1, "wikipedia/redirect": 1}),
                                      ("partial", {}, {})]))
    rows = D.read_documents(storage.join(output, storage.shard_name("docs", 0, 2, "parquet")))
    assert [r["doc_id"] for r in rows] == ["wiki:1", "wiki:3"]  # sorted, the duplicate dropped
    rejects = storage.read_text(storage.join(output, storage.shard_name("rejects", 0, 2, "jsonl")))
    assert '"duplicate_of": "wiki:1"' in rejects and "wiki:7" in rejects
    assert D.read_documents(storage.join(output, storage.shard_name("docs", 1, 2, "parquet"))) == []
    assert storage.read_text(storage.join(output, storage.shard_name("rejects", 1, 2, "jsonl"))) == ""


# --------------------------------------------------------------------------- shared reading


def test_read_sentences_streams_every_row_of_every_shard(tmp_path) -> None:
    first, second = str(tmp_path / "docs-00000-of-00002.parquet"), str(tmp_path / "docs-00001-of-00002.parquet")
    write_documents_shard(first, [("a", ["One.", "Two."]), ("b", [])])
    write_documents_shard(second, [("c", ["Three."])])
    with pipeline() as p:
        rows = p | ReadSentences([first, second]) | beam.MapTuple(lambda doc_id, s: (doc_id, tuple(s)))
        assert_that(rows, equal_to([("a", ("One.", "Two.")), ("b", ()), ("c", ("Three.",))]))


def test_read_sentences_names_a_shard_that_is_not_documents(tmp_path) -> None:
    uri = str(tmp_path / "docs-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ["hello"]}), uri)
    with pytest.raises(Exception, match="docs-00000-of-00001.parquet has no column"), pipeline() as p:
        _ = p | ReadSentences([uri])


# --------------------------------------------------------------------------- build_vocab


def test_count_words_sums_basic_tokens_over_documents_into_sorted_files(tmp_path) -> None:
    docs = [("d1", ["The cat sat.", "A dog."]), ("d2", ["the Cat ran!"]), ("d3", ["The end."])]
    shard = str(tmp_path / "docs-00000-of-00001.parquet")
    write_documents_shard(shard, docs)
    expected = count_words([s for _, sentences in docs for s in sentences])
    scratch = str(tmp_path / "scratch")
    with pipeline() as p:
        # two readers share the one shard; four buckets of words
        buckets = p | beam.Create(plan_parts([shard], 2)) | CountWords(True, True, scratch, buckets=4)
        assert_that(buckets, holds(lambda got: len(got) == len(set(got)) and set(got) <= {0, 1, 2, 3}))
    assert read_counts(scratch) == sorted(expected.items(), key=count_key)
    assert expected["the"] == 3 and expected["cat"] == 2


# --------------------------------------------------------------------------- create_instances


def test_create_instance_shards_writes_balanced_shards_and_rejects(samples_dir, tmp_path) -> None:
    vocab = str(samples_dir / "models" / "minilm" / "vocab.txt")
    lines = (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").splitlines()
    docs = [(f"news:{i}", split_sentences(line)) for i, line in enumerate(lines[:12])]
    docs.append(("news:empty", ["\u200b"]))
    config = InstanceConfig(lengths=[SequenceSpec(max_seq_length=64, max_predictions_per_seq=10)],
                            dupe_factor=2, num_shards=3, seed=7, eval_fraction=0)
    output = str(tmp_path / "instances")
    vocab_ids = VocabIds.from_tokenizer(load_tokenizer(vocab))
    with pipeline() as p:
        out = p | beam.Create(docs) | CreateInstanceShards(
            config, vocab, vocab_ids, output, documents_read=len(docs), min_docs_per_bucket=4)
        written = out["results"] | "Shards" >> beam.Map(lambda r: (r["length"], r["index"]))
        assert_that(written, equal_to([(64, 0), (64, 1), (64, 2)]), label="CheckShards")
        reasons = out["rejects"] | "Reasons" >> beam.FlatMap(
            lambda f: [(r["id"], r["reason"]) for r in map(json.loads, storage.read_text(f[0]).splitlines())])
        assert_that(reasons, equal_to([("news:empty", "no_tokens")]), label="CheckRejects")
        assert_that(out["documents"], equal_to([12]), label="CheckDocuments")
        train = (64, "train")  # the layout is per (length, split)
        shards = out["layout"] | "Layout" >> beam.Map(lambda lay: (lay[train]["shards"], len(lay[train]["offsets"])))
        assert_that(shards, equal_to([(3, 9)]), label="CheckLayout")  # 3 pools x 3 groups
    sizes = [pq.read_metadata(str(f)).num_rows for f in sorted(Path(output, "seq64").iterdir())]
    assert len(sizes) == 3 and max(sizes) - min(sizes) <= 1 and sum(sizes) > 12


# --------------------------------------------------------------------------- the job skeleton


def test_local_runner_is_the_in_process_fn_api_runner_never_prism() -> None:
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    for workers, mode in ((1, "in_memory"), (3, "multi_processing")):
        options = pipeline_options(workers, beam_args=["--", "--direct_num_workers=7"])
        assert options.view_as(StandardOptions).runner == "FnApiRunner"
        direct = options.view_as(DirectOptions)
        assert (direct.direct_num_workers, direct.direct_running_mode) == (workers, mode)
        assert isinstance(beam.Pipeline(options=options).runner, FnApiRunner)
    dataflow = pipeline_options(4, "DataflowRunner", ["--project=p", "--region=r"])
    assert dataflow.view_as(StandardOptions).runner == "DataflowRunner"
    assert dataflow.get_all_options()["project"] == "p"
    assert dataflow.view_as(DirectOptions).direct_num_workers == 1  # Beam's default: not ours to set


def test_local_worker_processes_take_arrow_buffers_from_the_system_allocator(tmp_path) -> None:
    """Each worker process of a local job reports its Arrow pool; this process has its own Arrow
    pool and environment back afterwards."""
    import os

    from beam_jobs.job import WORKER_MEMORY_ENV, run_pipeline

    out = tmp_path / "allocators"
    before = (pa.default_memory_pool().backend_name, {k: os.environ.get(k) for k in WORKER_MEMORY_ENV})

    def allocators(_) -> tuple[int, str]:  # defined here: pickled by value for the workers
        import os

        import pyarrow

        return os.getpid(), pyarrow.default_memory_pool().backend_name

    def build(p):
        (p | beam.Create(range(8)) | beam.Reshuffle() | beam.Map(allocators) | beam.Distinct()
         | beam.Map(json.dumps) | beam.io.WriteToText(str(out)))

    run_pipeline(build, workers=2)
    seen = {tuple(json.loads(line)) for f in tmp_path.glob("allocators*") for line in f.read_text().splitlines()}
    assert os.getpid() not in {pid for pid, *_ in seen}  # reported by the worker processes
    assert {pool for _, pool in seen} == {"system"}
    assert (pa.default_memory_pool().backend_name, {k: os.environ.get(k) for k in WORKER_MEMORY_ENV}) == before


@pytest.mark.parametrize("job, command", [("clean_corpus", "corpus"), ("build_vocab", "vocab"),
                                          ("create_instances", "instances")])
def test_a_job_module_run_as_a_script_is_its_bertpipe_command(job, command) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", f"beam_jobs.{job}", "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert f"Usage: bertpipe {command} [OPTIONS]" in done.stdout
    if command == "vocab":
        assert "--vocab-size" in done.stdout and "--cased" in done.stdout
    if command == "corpus":
        assert "--bytes-per-worker" in done.stdout
