"""Beam job: documents -> masked-LM (and next-sentence) instances in balanced Parquet shards, per length.

    bertpipe instances --corpus CORPUS_URI --vocab VOCAB_URI --output OUT_URI [--set instances.dupe_factor=5]

The rows are the "instances" contract (``bert_core/instances/batch.py``), the folder and its
manifests are ``bert_core/instances/manifest.py``'s, and the eval split by document is
``bert_core/instances/sharding.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from beam_jobs.job import (
    LOCAL_RUNNER,
    EmptyResultError,
    check_produced,
    check_shared_storage,
    forward_to_cli,
    item_key,
    progress_folder,
    resolve_runner,
    run_pipeline,
)
from bert_core import lease, storage
from bert_core.config import InstanceConfig
from bert_core.corpus.documents import count_documents, read_sentences
from bert_core.instances.batch import instance_shard_name
from bert_core.instances.manifest import prepare_output, vocab_record, write_manifests
from bert_core.instances.pairs import VocabIds
from bert_core.instances.pool_files import (
    InstanceShardWriter,
    RowRange,
    read_pool,
    spill_rejects,
    spill_tokenized_documents,
    write_pool_instances,
)
from bert_core.instances.sharding import (
    EVAL,
    MIN_DOCS_PER_BUCKET,
    assign_shards,
    estimated_tokens,
    eval_threshold,
    every_shard,
    make_layout,
    pool_of,
    set_folder,
    split_pools,
)
from bert_core.progress import OnProgress, Phase, Tally, Watch, report
from bert_core.sorted_runs import spill_folder
from bert_core.vocab.tokenization import VocabError, load_tokenizer

# How it stays streaming, bounded and deterministic:
#
# - Random-next B segments come from the document's *pool* (keyed ``(split, bucket)``), not from
#   the whole corpus, so a worker holds one pool, never the corpus; the eval threshold and how
#   many pools each split has, and how big (in documents and in tokens,
#   ``instances.max_pool_tokens``), follow from the documents and text read (Parquet footers,
#   before the pipeline: ``bert_core.instances.sharding.split_pools``), so no step waits for a
#   count.
# - Every draw comes from ``rng_for(seed, doc_id, dupe_index, max_seq_length)`` (pairs, and a
#   64-bit key per instance that seeds its masking; see ``bert_core.instances.batch``) and the
#   documents of a pool are sorted by ``doc_id``: nothing depends on the runner, the workers or
#   bundle order.
# - Balanced shards: a pool's instances (per length) are cut into *pieces* by ``key % pools``,
#   pieces get consecutive global ranks, and shard ``f`` takes a contiguous rank range, so shard
#   sizes differ by at most one and a shard holds a random share of every pool, written in rank
#   order (``bert_core/instances/sharding.py``; our loader shuffles each shard's rows every
#   epoch). Every shard index is written, empty ones too, so a loader can always split them
#   evenly.
#
# Memory: no shuffle and no side input carries text or instances. Workers write tokenized
# documents and instances to spill files under ``OUT/_spill/`` (``bert_core.instances.pool_files``,
# through fsspec, so workers need not share a disk) and pass on only their names and sizes: the
# pool shuffle ("GroupBuckets") carries a few file names per pool, the shard shuffle
# ("GroupShards") a row range of a spill file per piece and shard, the layout a count per piece,
# the rejects a file name per bundle. A runner that keeps shuffled data in memory (the local
# FnApiRunner does) therefore holds kilobytes, whatever the corpus. A documents shard is read in
# parts (row ``i`` in part ``i % parts``) when there are fewer shards than workers, so even a
# one-shard corpus spreads over the workers without shuffling its documents. A worker holds at
# most one pool's tokens (uint16 when the vocab fits) and pairs (a few dozen bytes per instance),
# a window of assembled rows, or a row group of the shard it writes. ``OUT/_spill/`` is removed
# before the top-level manifest is written.
#
# Why this shape (speed): Beam charges per element and per shuffle, so elements are spill files
# of many tokenized documents of one pool and whole pieces, never one document or instance.
# Instances are made a pool at a time (pairs as token ranges, then numpy assembly and masking of
# a window of rows: ``bert_core.instances.pool_files.write_pool_instances``), shards are written from
# the arrays and their stats are counted without a Python loop per row.

NAMESPACE = "instances"


# --------------------------------------------------------------------------- DoFns


def read_part(part: tuple[str, int, int]) -> Iterator[tuple[str, list[str] | None]]:
    """``(shard, k, parts)`` -> the documents of rows ``k, k + parts, ...`` of that shard."""
    uri, k, parts = part
    for i, doc in enumerate(read_sentences(uri)):
        if i % parts == k:
            yield doc


# Progress phases (``bert_core/progress.py``): documents read, pools turned into instances,
# shards written; each work item writes its count under the output's ``_progress/<phase>/``.
READ_PHASE, POOLS_PHASE, SHARDS_PHASE = "read", "pools", "shards"


class ReadPart(beam.DoFn):
    """:func:`read_part`, writing the documents read to ``progress`` (none if None)."""

    def __init__(self, progress: str | None = None):
        self.progress = progress

    def process(self, part: tuple[str, int, int]) -> Iterator[tuple[str, list[str] | None]]:
        tally = Tally(self.progress, READ_PHASE, item_key(part))
        for doc in read_part(part):
            tally.add(1)
            yield doc
        tally.close()


class TokenizeDocuments(beam.DoFn):
    """(doc_id, sentences) -> ((split, pool), (spill file, documents)): each document's ids as
    the bytes of a C int array, each sentence's ids followed by an end mark
    (``Tokenizer.encode_documents_bytes``, TOKENIZE_CHARS of text at a time), gathered by
    random-next pool (of the document's split: ``bert_core.instances.sharding.pool_of``) and
    written to a spill file of its pool when SPILL_BYTES are buffered (the largest pool first)
    and at the end of the bundle. Documents without a token go to the 'rejects' output, as a
    spill file of them per bundle; sentences without tokens are dropped later, with the marks
    (as the reference drops empty lines)."""

    SPILL_BYTES = 4 << 20
    TOKENIZE_CHARS = 4 << 20  # text tokenized at once: each distinct chunk of it is looked up once
    REJECTS_PER_FILE = 100_000

    def __init__(self, vocab: str, lowercase: bool, seed: int, threshold: float, pools: dict[str, int],
                 output: str) -> None:
        self.vocab, self.lowercase, self.pools = vocab, lowercase, pools
        self.seed, self.threshold, self.output = seed, threshold, output
        self.rejected = Metrics.counter(NAMESPACE, "rejected_no_tokens")
        self.documents = Metrics.counter(NAMESPACE, "documents")

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.vocab, self.lowercase)

    def start_bundle(self) -> None:
        self.pending: list[tuple[str, list[str]]] = []  # documents not tokenized yet
        self.pending_chars = 0
        self.buffers: dict[tuple[str, int], list[tuple[str, bytes]]] = {}
        self.sizes: dict[tuple[str, int], int] = {}
        self.buffered = 0
        self.rejects: list[dict] = []

    def process(self, doc: tuple[str, list[str] | None]) -> Iterator[Any]:
        doc_id, sentences = doc
        sentences = sentences or []
        if None in sentences:
            sentences = [s for s in sentences if isinstance(s, str)]  # a null sentence is no text
        self.pending.append((doc_id, sentences))
        self.pending_chars += sum(map(len, sentences))
        if self.pending_chars >= self.TOKENIZE_CHARS:
            yield from self.tokenize_pending()

    def tokenize_pending(self) -> Iterator[Any]:
        """The pending documents tokenized at once, each buffered in its pool or rejected."""
        docs, self.pending, self.pending_chars = self.pending, [], 0
        marked_docs = self.tokenizer.encode_documents_bytes([sentences for _, sentences in docs])
        for (doc_id, sentences), marked in zip(docs, marked_docs, strict=True):
            if len(marked) // 4 == len(sentences):  # nothing but the end marks
                self.rejected.inc()
                self.rejects.append({
                    "source": "documents", "id": doc_id, "reason": "no_tokens",
                    "detail": f"{len(sentences)} sentences, none with a token in this vocab",
                })
                if len(self.rejects) >= self.REJECTS_PER_FILE:
                    yield self.spill_rejects()
                continue
            self.documents.inc()
            pool = pool_of(doc_id, self.seed, self.threshold, self.pools)
            self.buffers.setdefault(pool, []).append((doc_id, marked))
            self.sizes[pool] = self.sizes.get(pool, 0) + len(marked)
            self.buffered += len(marked)
            if self.buffered >= self.SPILL_BYTES:
                yield self.spill(max(self.sizes, key=self.sizes.__getitem__))

    def spill(self, pool: tuple[str, int]) -> tuple[tuple[str, int], tuple[str, int]]:
        docs = self.buffers.pop(pool)
        self.buffered -= self.sizes.pop(pool)
        split, b = pool
        uri = storage.join(spill_folder(self.output, "documents"), storage.unique_name(f"{split}-{b:05d}", "arrow"))
        spill_tokenized_documents(uri, docs)
        return pool, (uri, len(docs))

    def spill_rejects(self) -> beam.pvalue.TaggedOutput:
        uri = storage.join(spill_folder(self.output, "rejects"), storage.unique_name("rejects", "jsonl"))
        count = spill_rejects(uri, self.rejects)
        self.rejects = []
        return beam.pvalue.TaggedOutput("rejects", (uri, count))

    def finish_bundle(self) -> Iterator[Any]:
        from apache_beam.transforms.window import GlobalWindows

        for out in self.tokenize_pending():
            if isinstance(out, beam.pvalue.TaggedOutput):
                yield beam.pvalue.TaggedOutput(out.tag, GlobalWindows.windowed_value(out.value))
            else:
                yield GlobalWindows.windowed_value(out)
        for pool in sorted(self.buffers):
            yield GlobalWindows.windowed_value(self.spill(pool))
        if self.rejects:
            tagged = self.spill_rejects()
            yield beam.pvalue.TaggedOutput(tagged.tag, GlobalWindows.windowed_value(tagged.value))


class CreateInstances(beam.DoFn):
    """One random-next pool (bucket ``b`` of ``split``: its spill files of documents) -> for
    every length, its instances in a spill file, as pieces keyed ``((length, split), (g, b))``:
    piece ``g`` holds the instances whose key is ``g`` modulo the split's number of pools,
    sorted by key (rows of the file: :class:`bert_core.instances.pool_files.RowRange`); and each
    piece's size on the 'sizes' output. Eval pools make one pass (dupe_factor 1)."""

    def __init__(self, config: InstanceConfig, vocab_ids: VocabIds, pools: dict[str, int], output: str,
                 progress: str | None = None) -> None:
        self.config, self.vocab_ids, self.pools, self.output = config, vocab_ids, pools, output
        self.progress = progress
        self.instances = Metrics.counter(NAMESPACE, "instances")
        self.eval_instances = Metrics.counter(NAMESPACE, "eval_instances")

    def process(self, bucket: tuple[tuple[str, int], Iterable[tuple[str, int]]]) -> Iterator[Any]:
        cfg = self.config
        (split, b), groups = bucket[0], self.pools[bucket[0][0]]
        dupe_factor, counter = (1, self.eval_instances) if split == EVAL else (cfg.dupe_factor, self.instances)
        # by doc_id (read_pool): the pool must not depend on the shuffle or on how documents were gathered
        pool, doc_ids = read_pool(sorted(uri for uri, _ in bucket[1]), self.vocab_ids.vocab_size)
        for spec in cfg.lengths:
            # one name per (length, split, pool): a retry rewrites the same rows
            uri = storage.join(spill_folder(self.output, "instances"),
                               f"seq{spec.max_seq_length}-{split}-{b:05d}.arrow")
            pieces = write_pool_instances(
                uri, pool, doc_ids, groups, seed=cfg.seed, dupe_factor=dupe_factor,
                max_seq_length=spec.max_seq_length, max_predictions_per_seq=spec.max_predictions_per_seq,
                masked_lm_prob=cfg.masked_lm_prob, short_seq_prob=cfg.short_seq_prob, vocab=self.vocab_ids,
                next_sentence_prediction=cfg.next_sentence_prediction,
                whole_word_mask=cfg.whole_word_mask, mask=cfg.masking == "static",
            )
            for g, start, stop in pieces:
                key = ((spec.max_seq_length, split), (g, b))
                counter.inc(stop - start)
                yield key, RowRange(uri, start, stop)
                yield beam.pvalue.TaggedOutput("sizes", (key, stop - start))
        report(self.progress, POOLS_PHASE, item_key((split, b)), 1)


class WriteShards(beam.DoFn):
    """(((length, split), shard), parts) -> the Parquet shard (rows in rank order, streamed from
    the spill files) in ``seq{L}/`` or ``seq{L}/eval/``, its manifest entry and stats."""

    def __init__(self, output: str, mask_id: int, progress: str | None = None) -> None:
        self.output, self.mask_id, self.progress = output, mask_id, progress

    def process(self, group: tuple[tuple[int, int], Iterable[Any]], layout: dict) -> Iterator[dict]:
        (length_split, index), parts = group
        length, split = length_split
        ranked = sorted((p for p in parts if p is not None), key=lambda p: p[0])  # None: the empty marker
        # Rank order: piece after piece, each a key-ordered (pseudo-random) slice of one pool.
        # Not re-sorted: the loader shuffles the rows of a shard anyway (bert_core/pretrain/data.py).
        uri = storage.join(set_folder(self.output, length_split),
                           instance_shard_name(index, layout[length_split]["shards"]))
        writer = InstanceShardWriter(uri, length, self.mask_id)
        for _, rows in ranked:
            for batch in rows.batches():
                writer.write(batch)
        entry = writer.close()
        report(self.progress, SHARDS_PHASE, item_key((length_split, index)), 1)
        yield {"length": length, "split": split, "index": index,
               "entry": entry, "stats": writer.stats.to_dict()}


# --------------------------------------------------------------------------- pipeline


class CreateInstanceShards(beam.PTransform):
    """(doc_id, sentences) -> {"results": one dict per written shard (training and eval),
    "rejects": a spill file of rejected documents per bundle, "layout", "documents": how many
    documents gave instances, "eval_documents": how many of them are in the eval split}."""

    def __init__(self, config: InstanceConfig, vocab: str, vocab_ids: VocabIds, output: str,
                 documents_read: int, lowercase: bool = True,
                 min_docs_per_bucket: int = MIN_DOCS_PER_BUCKET, tokens_read: int = 0,
                 progress: str | None = None) -> None:
        super().__init__()
        self.config, self.vocab, self.vocab_ids = config, vocab, vocab_ids
        self.output, self.lowercase, self.progress = output, lowercase, progress
        # Known up front (Parquet footers), the eval threshold and the pool counts need no side
        # input: tokenized documents go straight into the pool shuffle.
        self.threshold = eval_threshold(documents_read, config)
        self.pools = split_pools(documents_read, self.threshold, config, min_docs_per_bucket, tokens_read)

    def expand(self, docs):
        cfg = self.config
        tokenized = docs | "TokenizeDocuments" >> beam.ParDo(
            TokenizeDocuments(self.vocab, self.lowercase, cfg.seed, self.threshold, self.pools, self.output)
        ).with_outputs("rejects", main="docs")
        n_docs = (tokenized.docs
                  | "DocumentsPerFile" >> beam.Map(lambda kv: kv[1][1])
                  | "CountDocuments" >> beam.CombineGlobally(sum))
        n_eval = (tokenized.docs
                  | "EvalDocumentsPerFile" >> beam.Map(lambda kv: kv[1][1] if kv[0][0] == EVAL else 0)
                  | "CountEvalDocuments" >> beam.CombineGlobally(sum))
        instances = (
            tokenized.docs
            | "GroupBuckets" >> beam.GroupByKey()  # file names, not documents
            | "CreateInstances" >> beam.ParDo(CreateInstances(cfg, self.vocab_ids, self.pools, self.output,
                                                              self.progress))
            .with_outputs("sizes", main="pieces")
        )
        layout = (
            instances.sizes  # (piece key, rows): a count per piece
            | "GatherCounts" >> beam.combiners.ToList()
            | "MakeLayout" >> beam.Map(make_layout, config=cfg, splits=tuple(self.pools))
        )
        layout_si = beam.pvalue.AsSingleton(layout)
        placed = instances.pieces | "AssignShards" >> beam.FlatMap(assign_shards, layout=layout_si)
        empty = layout | "EveryShard" >> beam.FlatMap(lambda lay: [(key, None) for key in every_shard(lay)])
        results = (
            (placed, empty)
            | "FlattenShards" >> beam.Flatten()
            | "GroupShards" >> beam.GroupByKey()  # row ranges of spill files, not rows
            | "WriteShards" >> beam.ParDo(WriteShards(self.output, self.vocab_ids.mask_id, self.progress),
                                          layout=layout_si)
        )
        return {"results": results, "rejects": tokenized.rejects, "layout": layout, "documents": n_docs,
                "eval_documents": n_eval}


def read_parts(shards: list[str], workers: int) -> list[tuple[str, int, int]]:
    """``(shard, k, parts)`` to read: each shard whole, or in ``parts`` parts when there are
    fewer shards than workers (every worker then reads all of a shard, keeping its share)."""
    parts = max(1, math.ceil(workers / max(1, len(shards))))
    return [(uri, k, parts) for uri in shards for k in range(parts)]


def build_pipeline(p: beam.Pipeline, shards: list[str], output: str, config: InstanceConfig, vocab: str,
                   vocab_ids: VocabIds, *, workers: int, inputs: list[dict] | None = None,
                   vocab_used: dict[str, str] | None = None, lowercase: bool = True,
                   min_docs_per_bucket: int = MIN_DOCS_PER_BUCKET, attempt: str | None = None,
                   progress: str | None = None) -> None:
    """The job's graph on ``p``: documents shards -> instance shards, rejects and manifests in
    ``output`` (prepared by the caller; ``attempt``: the id of the lease it holds on ``output``,
    whose own names the shards are written under until they are published; ``progress``: the
    folder the steps write their progress to)."""
    docs = (p
            | "ListParts" >> beam.Create(read_parts(shards, workers))
            | "ReadSentences" >> beam.ParDo(ReadPart(progress)))
    out = docs | "CreateInstanceShards" >> CreateInstanceShards(
        config, vocab, vocab_ids, lease.staging(output, attempt), count_documents(shards), lowercase, min_docs_per_bucket,
        estimated_tokens(shards), progress)
    _ = (
        out["results"]
        | "GatherResults" >> beam.combiners.ToList()
        | "WriteManifests" >> beam.Map(
            lambda rs, rj, lay, n, e: write_manifests(
                rs, rj, lay, output=output, config=config, inputs=inputs or [], documents_used=n,
                eval_documents=e, vocab=vocab_used, attempt=attempt),
            rj=beam.pvalue.AsList(out["rejects"]), lay=beam.pvalue.AsSingleton(out["layout"]),
            n=beam.pvalue.AsSingleton(out["documents"]), e=beam.pvalue.AsSingleton(out["eval_documents"]),
        )
    )


def run(
    config: InstanceConfig,
    corpus: str,
    vocab: str,
    output: str,
    *,
    lowercase: bool = True,
    workers: int = 2,
    runner: str = LOCAL_RUNNER,
    beam_args: Iterable[str] = (),
    min_docs_per_bucket: int = MIN_DOCS_PER_BUCKET,
    shared_storage: bool = False,
    on_progress: OnProgress | None = None,
) -> dict[str, Any]:
    """Run the job; returns the top-level manifest. ``lowercase`` only matters for a bare vocab.txt;
    ``min_docs_per_bucket`` lets a test give a tiny corpus several random-next pools; ``runner``,
    ``beam_args`` and ``shared_storage``: as for :func:`beam_jobs.clean_corpus.run`; ``on_progress``
    is told the documents read (of the corpus's), the pools made into instances and the shards
    written while the job runs."""
    runner, beam_args = resolve_runner(runner, beam_args)
    check_shared_storage("instances", runner, shared_storage,
                         [("output", output), ("corpus", corpus), ("vocab", vocab)])
    # resolved here, on the driver: a worker has another working directory, or is another machine
    corpus, vocab, output = storage.to_uri(corpus), storage.to_uri(vocab), storage.to_uri(output)
    finished = lease.refuse_finished(output, "instances", config,  # before any work: never rewritten
                                     [corpus, *([] if vocab.endswith(".txt") else [vocab])],
                                     {"vocab_sha256": vocab_record(vocab).get("vocab_sha256")})
    if finished is not None:
        return finished
    corpus_manifest = storage.read_manifest(corpus)
    storage.check_shards(corpus, corpus_manifest)
    inputs = [corpus_manifest]
    if not vocab.endswith(".txt"):
        inputs.append(storage.read_manifest(vocab))
    vocab_used = vocab_record(vocab)  # before tokenizing: the ids come from these bytes
    vocab_ids = VocabIds.from_tokenizer(load_tokenizer(vocab, lowercase))
    if min(vocab_ids.cls_id, vocab_ids.sep_id, vocab_ids.mask_id) < 0:
        raise VocabError(f"vocab {vocab} lacks [CLS], [SEP] or [MASK]; instances need all three: "
                         "use a BERT vocab (the vocab stage always adds them)")
    shards = storage.shard_uris(corpus, corpus_manifest)
    if not count_documents(shards):
        raise EmptyResultError(f"{corpus} holds 0 documents: there is nothing to make instances from; "
                               "run corpus on inputs that keep documents (its rejects say why they did not)")
    storage.check_writable(output)
    with lease.hold(output, "instances", None) as held:
        if held.finished:
            return storage.read_manifest(output)
        prepare_output(output, config, held.attempt)
        folder = progress_folder(output)
        watch = Watch(folder, "instances", {
            READ_PHASE: Phase("reading documents", count_documents(shards), "documents"),
            POOLS_PHASE: Phase("creating instances", None, "pools"),
            SHARDS_PHASE: Phase("writing shards", None, "shards"),
        }, on_progress)
        watch.clear()

        def build(p: beam.Pipeline) -> None:
            build_pipeline(p, shards, output, config, vocab, vocab_ids, workers=workers, inputs=inputs,
                           vocab_used=vocab_used, lowercase=lowercase, min_docs_per_bucket=min_docs_per_bucket,
                           attempt=held.attempt, progress=folder if on_progress else None)

        try:
            run_pipeline(build, workers, runner, beam_args, watch if on_progress else None)
        finally:
            watch.clear()
        return _checked_manifest(output, count_documents(shards))


def _checked_manifest(output: str, documents: int) -> dict[str, Any]:
    """The top-level manifest of a finished run, or one line (and no manifest) when the
    ``documents`` read gave no instances, or when some of them were neither used nor rejected."""
    if not storage.has_manifest(output):
        check_produced("instances", 0, f"instances (no {storage.MANIFEST} written)", documents, "documents")
    manifest = storage.read_manifest(output)
    c = manifest["counts"]
    made = sum(n for k, n in c.items() if k.startswith(("instances_seq", "eval_instances_seq")))
    if documents and c["documents_read"] == documents and not made:
        storage.remove(storage.join(output, storage.MANIFEST))
        raise EmptyResultError(
            f"instances: 0 instances from {documents:,} documents ({c['documents_rejected']:,} rejected for "
            f"having no token of the vocab, {c['documents_used']:,} used); check that --vocab is the corpus's "
            f"own vocab; the rejects are under {output}")
    if documents and (c["documents_read"] != documents or (c["documents_used"] and not made)):
        storage.remove(storage.join(output, storage.MANIFEST))
        check_produced("instances", 0, f"instances from {c['documents_used']:,} documents used and "
                       f"{c['documents_rejected']:,} rejected", documents, "documents read")
    return manifest


if __name__ == "__main__":
    forward_to_cli("instances")
