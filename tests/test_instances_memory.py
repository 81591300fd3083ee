"""bert_core/instances/pool_files.py and the instances job's spill steps: what crosses a shuffle is
file names and row ranges, and the rows read back are the rows the in-memory algorithm makes.
Real tokenizer (the sample MiniLM vocab), real sentences, real Parquet, real Beam."""

from __future__ import annotations

import json
import random

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing import test_pipeline

from beam_jobs.create_instances import TokenizeDocuments, read_parts
from bert_core import storage
from bert_core.config import InstanceConfig, SequenceSpec
from bert_core.instances.batch import InstanceBatch, create_instance_batch
from bert_core.instances.pairs import DocumentPool, VocabIds
from bert_core.instances.pool_files import (
    InstanceShardWriter,
    RowRange,
    merge_rejects,
    read_pool,
    spill_rejects,
    spill_tokenized_documents,
    write_pool_instances,
)
from bert_core.instances.sharding import TRAIN, assign_shards, make_layout, pieces_by_group
from bert_core.instances.stats import InstanceStats
from bert_core.vocab.tokenization import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(samples_dir):
    return load_tokenizer(str(samples_dir / "models" / "minilm" / "vocab.txt"), True)


@pytest.fixture(scope="module")
def marked_docs(samples_dir, tokenizer) -> list[tuple[str, bytes]]:
    """30 real news articles, tokenized with end marks; one has an empty sentence."""
    from bert_core.corpus.sentences import split_sentences

    lines = (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").splitlines()
    docs = [(f"news:{i:02d}", split_sentences(line)) for i, line in enumerate(lines[:30])]
    docs[3][1].insert(1, "\u200b")  # a sentence without a token: dropped, like the reference's empty lines
    return [(doc_id, tokenizer.encode_document_bytes(s)) for doc_id, s in docs]


def test_read_pool_is_from_marked_whatever_the_files(marked_docs, tokenizer, tmp_path) -> None:
    shuffled = marked_docs[:]
    random.Random(1).shuffle(shuffled)
    uris = []
    for i, part in enumerate((shuffled[:7], shuffled[7:8], shuffled[8:])):
        uris.append(str(tmp_path / f"d{i}.arrow"))
        spill_tokenized_documents(uris[-1], part)
    pool, doc_ids = read_pool(uris[::-1], tokenizer.vocab_size)
    want = DocumentPool.from_marked([m for _, m in marked_docs])
    assert doc_ids == [d for d, _ in marked_docs]  # sorted by doc_id, whatever the files
    assert pool.tokens.dtype == np.uint16  # a 30k vocab fits
    assert pool.tokens.tolist() == want.tokens.tolist()
    assert list(pool.sentence_offsets) == want.sentence_offsets and list(pool.doc_first) == want.doc_first


def test_spilled_pieces_are_the_pieces_of_the_whole_batch(marked_docs, tokenizer, tmp_path) -> None:
    pool = DocumentPool.from_marked([m for _, m in marked_docs])
    doc_ids = [d for d, _ in marked_docs]
    vocab = VocabIds.from_tokenizer(tokenizer)
    kwargs = dict(seed=3, dupe_factor=2, max_seq_length=64, max_predictions_per_seq=10, masked_lm_prob=0.15,
                  short_seq_prob=0.1, vocab=vocab)
    whole = create_instance_batch(pool, doc_ids, **kwargs)
    uri = str(tmp_path / "seq64-train-00000.arrow")
    pieces = write_pool_instances(uri, pool, doc_ids, 3, window=37, **kwargs)  # many windows
    want = dict(pieces_by_group(whole, 3))
    assert [g for g, _, _ in pieces] == sorted(want) and pieces[-1][2] == len(whole) > 100
    with pa.ipc.open_file(uri) as spill:
        assert spill.num_record_batches == -(-len(whole) // 37)
    for g, start, stop in pieces:
        rows = InstanceBatch.concat(list(RowRange(uri, start, stop).batches()))
        assert rows.rows() == want[g].rows()


def test_shards_get_the_same_bytes_however_their_rows_arrive(marked_docs, tokenizer, tmp_path) -> None:
    pool = DocumentPool.from_marked([m for _, m in marked_docs])
    vocab = VocabIds.from_tokenizer(tokenizer)
    batch = create_instance_batch(pool, [d for d, _ in marked_docs], seed=5, dupe_factor=1, max_seq_length=64,
                                  max_predictions_per_seq=10, masked_lm_prob=0.15, short_seq_prob=0.1,
                                  vocab=vocab)
    digests = set()
    for i, cuts in enumerate(([], [5, 6, 50], [1, 2, 3, 70])):
        writer = InstanceShardWriter(str(tmp_path / f"s{i}.parquet"), 64, vocab.mask_id, rows_per_group=16)
        bounds = [0, *cuts, len(batch)]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            writer.write(batch.slice(lo, hi))
        entry = writer.close()
        digests.add(entry["sha256"])
        assert entry["count"] == len(batch)
        assert pq.read_table(tmp_path / f"s{i}.parquet").to_pylist() == [
            dict(zip(["input_ids", "len_a", "masked_lm_positions", "masked_lm_ids", "next_sentence_label"], r,
                     strict=True)) for r in batch.rows()]
    assert len(digests) == 1
    assert {pq.ParquetFile(tmp_path / "s0.parquet").metadata.row_group(0).num_rows} == {16}
    stats = InstanceStats(max_seq_length=64)
    stats.add_columns(batch.input_ids, batch.offsets, batch.len_a, batch.masked_lm_positions,
                      batch.masked_lm_ids, batch.mask_offsets, batch.next_sentence_label, vocab.mask_id)
    assert writer.stats.to_dict() == stats.to_dict()


def test_an_empty_shard_is_a_valid_file(tmp_path) -> None:
    writer = InstanceShardWriter(str(tmp_path / "empty.parquet"), 64, 103)
    assert writer.close()["count"] == 0
    assert pq.read_table(tmp_path / "empty.parquet").num_rows == 0


def test_row_ranges_are_cut_at_shard_boundaries_like_batches() -> None:
    config = InstanceConfig(lengths=[SequenceSpec(max_seq_length=64, max_predictions_per_seq=10)], num_shards=3)
    train = (64, TRAIN)
    sizes = {(0, 0): 4, (0, 1): 3, (1, 0): 5}
    layout = make_layout([((train, piece), n) for piece, n in sizes.items()], config)
    for piece, n in sizes.items():
        rows = np.arange(n, dtype=np.int32)
        batch = InstanceBatch(np.zeros(n, np.uint64), rows, np.arange(n + 1), np.ones(n, np.int32),
                              rows[:0], rows[:0], np.zeros(n + 1, np.int64), np.zeros(n, np.int8))
        as_batch = [(key, first, len(b), int(b.input_ids[0]))
                    for key, (first, b) in assign_shards(((train, piece), batch), layout)]
        as_range = [(key, first, len(r), r.start - 10)
                    for key, (first, r) in assign_shards(((train, piece), RowRange("spill", 10, 10 + n)), layout)]
        assert as_range == as_batch


def test_rejects_merge_sorted_by_id(tmp_path) -> None:
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert spill_rejects(a, [{"id": "news:9", "reason": "no_tokens"}, {"id": "news:1", "reason": "no_tokens"}]) == 2
    assert spill_rejects(b, [{"id": "news:5", "reason": "no_tokens"}]) == 1
    out = str(tmp_path / "rejects.jsonl")
    assert merge_rejects([b, a], out) == 3
    assert [json.loads(x)["id"] for x in storage.read_text(out).splitlines()] == ["news:1", "news:5", "news:9"]
    assert merge_rejects([], out) == 0 and storage.read_text(out) == ""


def test_a_one_shard_corpus_is_read_in_a_part_per_worker() -> None:
    assert read_parts(["s0"], 2) == [("s0", 0, 2), ("s0", 1, 2)]
    assert read_parts(["s0", "s1", "s2"], 2) == [("s0", 0, 1), ("s1", 0, 1), ("s2", 0, 1)]


def test_tokenized_documents_cross_the_shuffle_as_file_names(samples_dir, marked_docs, tmp_path) -> None:
    """What TokenizeDocuments passes on is ``(pool, (spill file, documents))``: every document
    is in exactly one file of its pool, and the rejected one is in a rejects file."""
    from bert_core.corpus.sentences import split_sentences

    lines = (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").splitlines()
    docs = [(f"news:{i:02d}", split_sentences(line)) for i, line in enumerate(lines[:30])]
    docs.append(("news:empty", ["   "]))
    output = str(tmp_path / "out")
    pools = {TRAIN: 3}
    vocab = str(samples_dir / "models" / "minilm" / "vocab.txt")
    with test_pipeline.TestPipeline(runner="FnApiRunner") as p:
        out = (p | beam.Create(docs)
               | beam.ParDo(TokenizeDocuments(vocab, True, 7, 0.0, pools, output)).with_outputs("rejects", main="docs"))
        _ = out.docs | "Docs" >> beam.Map(lambda kv: storage.write_text(
            storage.join(output, "seen", kv[1][0].rsplit("/", 1)[-1] + ".json"), json.dumps(kv)))
        _ = out.rejects | "Rejects" >> beam.Map(lambda kv: storage.write_text(
            storage.join(output, "seen", "rejects.json"), json.dumps(kv)))
    seen = [json.loads(storage.read_text(u)) for u in storage.list_files(storage.join(output, "seen"))]
    rejects = [s for s in seen if not isinstance(s[0], list)]
    files = [s for s in seen if isinstance(s[0], list)]
    by_id = {}
    for (split, b), (uri, n) in files:
        assert uri.startswith(storage.join(output, "_spill", "documents")) and split == TRAIN
        with pa.ipc.open_file(uri) as spill:
            ids = spill.read_all().column("doc_id").to_pylist()
        assert len(ids) == n
        for doc_id in ids:
            assert doc_id not in by_id
            by_id[doc_id] = b
    assert sorted(by_id) == [d for d, _ in docs[:-1]]
    [(uri, count)] = rejects
    assert count == 1 and json.loads(storage.read_text(uri))["id"] == "news:empty"


# Steps whose outputs are small whatever the corpus: file names, row ranges, counts, the layout.
SMALL = ("ListParts", "/TokenizeDocuments", "/CreateInstances", "/EveryShard", "/WriteShards", "/MakeLayout",
         "/DocumentsPerFile", "/EvalDocumentsPerFile", "/CountDocuments", "/CountEvalDocuments")
READERS = ("ReadSentences",)  # its outputs are documents


def sources_of_held_data(p: beam.Pipeline) -> list[tuple[str, str]]:
    """For each input of a GroupByKey, of a Flatten of several inputs and of a side input (all
    held whole by the local runner), the first step upstream that makes its elements."""
    from apache_beam.portability import common_urns
    from apache_beam.portability.api import beam_runner_api_pb2

    proto = p.to_runner_api()
    transforms = {tid: t for tid, t in proto.components.transforms.items() if not t.subtransforms}
    producer = {pcoll: (tid, tag) for tid, t in transforms.items() for tag, pcoll in t.outputs.items()}
    found = []

    def walk(pcoll: str) -> None:
        tid, tag = producer[pcoll]
        t = transforms[tid]
        if any(s in t.unique_name for s in SMALL + READERS):
            found.append((t.unique_name, tag))
        else:  # a step that passes its input on (keys, windows, combiner plumbing): look further up
            for upstream in t.inputs.values():
                walk(upstream)

    gbk, flatten = common_urns.primitives.GROUP_BY_KEY.urn, common_urns.primitives.FLATTEN.urn
    for t in transforms.values():
        if t.spec.urn == gbk or (t.spec.urn == flatten and len(t.inputs) > 1):
            for pcoll in t.inputs.values():
                walk(pcoll)
        if t.spec.urn == common_urns.primitives.PAR_DO.urn:
            for tag in beam_runner_api_pb2.ParDoPayload.FromString(t.spec.payload).side_inputs:
                walk(t.inputs[tag])
    return found


def test_no_shuffle_or_side_input_holds_documents_or_instances(samples_dir, tmp_path) -> None:
    from test_create_instances import CONFIG, write_corpus

    from beam_jobs.create_instances import build_pipeline
    from beam_jobs.job import pipeline_options

    corpus = write_corpus(str(tmp_path / "corpus"), [("news:0", ["One sentence.", "Two sentences."])], "news")
    vocab = str(samples_dir / "models" / "minilm" / "vocab.txt")
    p = beam.Pipeline(options=pipeline_options(2))
    build_pipeline(p, storage.shard_uris(corpus), str(tmp_path / "out"), CONFIG, vocab,
                   VocabIds.from_tokenizer(load_tokenizer(vocab)), workers=2)
    sources = sources_of_held_data(p)
    names = {name for name, _ in sources}
    assert not any(r in name for name in names for r in READERS), sources
    for step in ("/TokenizeDocuments", "/CreateInstances", "/WriteShards", "/MakeLayout"):
        assert any(step in name for name in names), (step, sources)  # the walk reaches each of them


def test_pools_are_bounded_in_tokens_as_well_as_documents(samples_dir, tmp_path) -> None:
    import pyarrow as pa

    from beam_jobs.create_instances import CreateInstanceShards
    from bert_core.instances.sharding import (
        BYTES_PER_TOKEN,
        estimated_tokens,
        num_random_doc_buckets,
    )

    cfg = InstanceConfig(eval_fraction=0)
    assert num_random_doc_buckets(5_000, cfg) == num_random_doc_buckets(5_000, cfg, n_tokens=10**6) == 5
    # long documents: the token bound wins over the floor of MIN_DOCS_PER_BUCKET documents a pool
    assert num_random_doc_buckets(5_000, cfg, n_tokens=40 * cfg.max_pool_tokens) == 40
    assert num_random_doc_buckets(300, cfg, n_tokens=cfg.max_pool_tokens + 1) == 2
    assert num_random_doc_buckets(3, cfg, n_tokens=10**12) == 3  # never more pools than documents

    # the estimate comes from the Parquet footers: about the text's bytes over BYTES_PER_TOKEN
    lines = (samples_dir / "news" / "lee_background.cor").read_text(encoding="utf-8").splitlines()
    shard = str(tmp_path / "docs-00000-of-00001.parquet")
    sentences = [[line] for line in lines]
    pq.write_table(pa.table({"doc_id": [f"news:{i}" for i in range(len(lines))],
                             "sentences": pa.array(sentences, pa.list_(pa.string()))}), shard)
    text = sum(len(line.encode()) for line in lines)
    assert 0.95 < estimated_tokens([shard]) * BYTES_PER_TOKEN / text < 1.2

    vocab = str(samples_dir / "models" / "minilm" / "vocab.txt")
    ids = VocabIds.from_tokenizer(load_tokenizer(vocab, True))
    tokens = estimated_tokens([shard])
    small = cfg.model_copy(update={"max_pool_tokens": tokens // 4 + 1})
    assert CreateInstanceShards(cfg, vocab, ids, str(tmp_path), len(lines), tokens_read=tokens).pools == {"train": 1}
    assert CreateInstanceShards(small, vocab, ids, str(tmp_path), len(lines), tokens_read=tokens).pools == {
        "train": 4}
