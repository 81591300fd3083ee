"""Memory that does not grow with the corpus, in the corpus and vocab jobs (beam_jobs/clean_corpus.py,
beam_jobs/build_vocab.py, bert_core/sorted_runs.py): what the local runner holds is only what
passes between steps, so only run file names, work items and summaries may pass; no side input
grows with the corpus; the driver plans a dump from its head; a shard is written a row group at
a time. Real Beam graphs, real files."""

from __future__ import annotations

import bz2
import random

import apache_beam as beam
import psutil
import pyarrow.parquet as pq
import pytest
from apache_beam.portability import common_urns
from apache_beam.portability.api import beam_runner_api_pb2

from beam_jobs import clean_corpus, sorted_runs
from beam_jobs.build_vocab import CountWords, plan_parts
from beam_jobs.job import pipeline_options
from bert_core import storage
from bert_core.config import CorpusConfig
from bert_core.corpus import documents as D
from bert_core.corpus.dumps import plan_reads, read_pages
from bert_core.sorted_runs import group_sorted, merge_runs, read_run, write_run

SAMPLE_DUMP = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.xml.bz2"
# Steps whose outputs are small whatever the corpus: run file names, work items, counts.
SMALL = ("Spill", "WriteShards", "CountPartWords", "SumPerWord", "TagRead", "Impulse",
         "ListWorkItems", "ListBooks", "ListRecordItems", "EveryShard", "Once")
READERS = ("ParsePages", "ReadBooks/ParDo", "ReadRecords")


def _leaves(proto) -> tuple[dict, dict]:
    transforms = {tid: t for tid, t in proto.components.transforms.items() if not t.subtransforms}
    producer = {pcoll: (tid, tag) for tid, t in transforms.items() for tag, pcoll in t.outputs.items()}
    return transforms, producer


def shuffled_sources(p: beam.Pipeline) -> list[tuple[str, str]]:
    """For each input of a GroupByKey or of a Flatten of several inputs (both held whole by the
    local runner), the first step upstream that makes its elements: (step, output tag)."""
    transforms, producer = _leaves(p.to_runner_api())
    shuffles = {common_urns.primitives.GROUP_BY_KEY.urn, common_urns.primitives.FLATTEN.urn}
    found = []

    def walk(pcoll: str) -> None:
        tid, tag = producer[pcoll]
        t = transforms[tid]
        if any(s in t.unique_name for s in SMALL) or any(r in t.unique_name for r in READERS):
            found.append((t.unique_name, tag))
        else:  # a step that passes its input on (tags, keys, reshuffle plumbing): look further up
            for upstream in t.inputs.values():
                walk(upstream)

    for t in transforms.values():
        if t.spec.urn in shuffles and (t.spec.urn != common_urns.primitives.FLATTEN.urn or len(t.inputs) > 1):
            for pcoll in t.inputs.values():
                walk(pcoll)
    return found


def side_inputs(p: beam.Pipeline) -> list[str]:
    transforms, _ = _leaves(p.to_runner_api())
    names = []
    for t in transforms.values():
        if t.spec.urn == common_urns.primitives.PAR_DO.urn:
            if beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload).side_inputs:
                names.append(t.unique_name)
    return names


def test_clean_job_shuffles_no_documents_and_has_no_growing_side_input(samples_dir, tmp_path) -> None:
    p = beam.Pipeline(options=pipeline_options(1))
    inputs = {"wikipedia": [str(samples_dir / SAMPLE_DUMP)], "books": [str(samples_dir / "books" / "botchan.txt")],
              "text": []}
    clean_corpus.build_pipeline(p, CorpusConfig(), str(tmp_path), inputs, num_shards=2)
    sources = shuffled_sources(p)
    # READ and CUTS: one small element per work item
    assert sources and all(any(s in name for s in SMALL) or tag in (clean_corpus.READ, clean_corpus.CUTS)
                           for name, tag in sources), sources
    # the summary (counts and histograms) is the only side input
    assert side_inputs(p) == ["WriteManifest"]


def test_vocab_job_shuffles_only_work_items_and_count_files(tmp_path) -> None:
    p = beam.Pipeline(options=pipeline_options(1))
    _ = (p | "ListWorkItems" >> beam.Create(plan_parts(["a.parquet"], 2), reshuffle=False)
         | CountWords(True, True, str(tmp_path), 16))
    sources = shuffled_sources(p)
    assert all(name.startswith(("ListWorkItems", "CountWords/CountPartWords")) for name, _ in sources), sources
    assert any("CountPartWords" in name for name, _ in sources)
    assert side_inputs(p) == []


def test_planning_a_big_dump_reads_only_its_head(samples_dir, tmp_path) -> None:
    """Planning a multistream dump with no index needs its size and first block, not a scan."""
    xml = bz2.decompress((samples_dir / SAMPLE_DUMP).read_bytes())
    start, end = xml.index(b"<page>"), xml.rindex(b"</page>") + len(b"</page>")
    pages = [p + b"</page>\n" for p in xml[start:end].split(b"</page>") if p.strip()]
    streams = [xml[:start]] + [b"".join(pages[i:i + 50]) for i in range(0, len(pages), 50)] * 4 + [xml[end:]]
    path = tmp_path / "big-multistream.xml.bz2"
    path.write_bytes(b"".join(bz2.compress(s) for s in streams))
    me = psutil.Process()
    before = me.io_counters().read_chars
    items = plan_reads(str(path))
    read = me.io_counters().read_chars - before
    assert path.stat().st_size > 6_000_000 and read < 1_000_000
    assert len(items) > 4 and {i.kind for i in items} == {"blocks"}
    # the items find their blocks and streams themselves: every page once, in file order
    ids = [r["doc_id"] for item in items for kind, r in read_pages(item) if kind == "page"]
    assert len(ids) == 4 * len(pages) and ids[:len(pages)] == ids[len(pages):2 * len(pages)]


def test_sorted_runs_merge_as_streams(tmp_path) -> None:
    rng = random.Random(3)
    records = [(rng.choice("abcdef"), rng.randrange(1000)) for _ in range(3000)]
    uris = [str(tmp_path / f"run-{k}.pkl") for k in range(3)]
    for k, uri in enumerate(uris):
        write_run(uri, records[k::3], key=lambda r: r)
    first = next(read_run(uris[0]))
    assert first == min(records[0::3])
    merged = list(merge_runs(uris, key=lambda r: r))
    assert merged == sorted(records)
    groups = list(group_sorted(merged, key=lambda r: r[0]))
    assert [g for g, _ in groups] == sorted(set(r[0] for r in records))
    assert sum(len(members) for _, members in groups) == len(records)


@pytest.mark.slow
def test_a_big_shard_is_written_a_row_group_at_a_time(samples_dir, tmp_path, monkeypatch) -> None:
    """With a small row-group budget the shard has several row groups and the same rows."""
    cfg = CorpusConfig(wikipedia=[str(samples_dir / SAMPLE_DUMP)], books=[], num_shards=1)
    whole = tmp_path / "whole"
    monkeypatch.setattr(clean_corpus, "ROW_GROUP_CHARS", 1 << 30)
    clean_corpus.run(cfg, str(whole), workers=1)
    monkeypatch.setattr(clean_corpus, "ROW_GROUP_CHARS", 200_000)
    monkeypatch.setattr(sorted_runs, "RUN_CHARS", 300_000)  # several runs per shard to merge
    groups = tmp_path / "groups"
    clean_corpus.run(cfg, str(groups), workers=1)
    name = storage.shard_name("docs", 0, 1, "parquet")
    assert pq.ParquetFile(str(whole / name)).num_row_groups == 1
    assert pq.ParquetFile(str(groups / name)).num_row_groups > 5
    assert D.read_documents(str(whole / name)) == D.read_documents(str(groups / name))
    for folder in (whole, groups):
        assert not storage.exists(storage.join(str(folder), clean_corpus.SPILL_DIR))
    reject = storage.shard_name("rejects", 0, 1, "jsonl")
    assert (whole / reject).read_bytes() == (groups / reject).read_bytes()
