"""Beam job: documents -> masked-LM + NSP instances in balanced Parquet shards, per sequence length.

    python -m beam_jobs.create_instances --corpus CORPUS_URI --vocab VOCAB_URI --output OUT_URI \
        [--preset demo] [--set instances.dupe_factor=5]
    bertpipe instances --corpus CORPUS_URI --vocab VOCAB_URI --output OUT_URI   (same thing)

Output (the "instances" contract)::

    OUT/seq{L}/part-SSSSS-of-NNNNN.parquet   input_ids list<int32>, len_a int32,
                                             masked_lm_positions list<int32>,
                                             masked_lm_ids list<int32>, next_sentence_label int8
    OUT/seq{L}/_MANIFEST.json                shards (sha256, count), stats of that length
    OUT/rejects.jsonl                        documents that gave no tokens, with the reason
    OUT/_MANIFEST.json                       written last: InstanceConfig, inputs, per-length stats

Rows are unpadded. Segment ids are 0 before ``len_a`` and 1 after. ``next_sentence_label`` is 1
for a random next, 0 for the actual next, -1 without NSP. With ``masking: dynamic`` the
masked_lm columns are empty and the loader masks with
``bert_core.instances.pairs.create_masked_lm_predictions``.

How it stays streaming, bounded and deterministic:

- Random-next B segments come from the document's *pool* (``stable_hash(doc_id) % pools``),
  not from the whole corpus, so a worker holds one pool, never the corpus. See
  :func:`num_random_doc_buckets`: ``instances.random_doc_buckets``, raised so that no pool
  averages more than MAX_DOCS_PER_BUCKET documents (bounded memory whatever the corpus size),
  lowered so that none averages fewer than MIN_DOCS_PER_BUCKET (a tiny corpus gets one pool,
  so its B segments are not drawn from a handful of documents). The count is that of the
  documents read (Parquet footers, before the pipeline), so no step waits for a count.
- Every draw comes from ``rng_for(seed, doc_id, dupe_index, max_seq_length)`` (pairs, and a
  64-bit key per instance that seeds its masking; see ``bert_core.instances.batch``) and the
  documents of a pool are sorted by ``doc_id``: nothing depends on the runner, the workers or
  bundle order.
- Balanced shards: a pool's instances (per length) are sorted by key and cut into *pieces* by
  ``key % pools``. Pieces are counted and ordered by ``(key % pools, pool)``; a piece's rows get
  consecutive global ranks from that order, and shard ``f`` takes a contiguous rank range, so
  shard sizes differ by at most one. A shard thus holds a random share of every pool (whole
  ``key % pools`` groups, and the key-ordered head or tail of one at each end), written in rank
  order: blocks of pseudo-random order (the reference shuffles all instances in memory; our
  loader shuffles each shard's rows every epoch). Every shard index is written, empty ones
  too, so a loader can always split them evenly.

Why this shape (speed): Beam charges per element and per shuffle, so elements are batches of
up to 512 tokenized documents of one pool (one bytes value of ids each, from
``Tokenizer.encode_document_bytes``) and whole pieces
(``InstanceBatch``: a handful of numpy arrays per element, cheap to pickle), never one
instance, and the instances cross one shuffle (to their shard), not two. Instances are made a
pool at a time by ``bert_core.instances.batch.create_instance_batch`` (pairs as token ranges,
then numpy assembly and masking), shards are written from the arrays and their stats are
counted without a Python loop per row.

Memory: each step holds one pool's documents and instances, or one shard. What a runner keeps
between steps is the runner's business: Dataflow/Flink/Spark shuffle through disk, while the
local FnApiRunner keeps shuffled data in memory (fine for the demo and tests, not for all of
Wikipedia on one machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from bert_core import storage
from bert_core.config import InstanceConfig, load_config
from bert_core.instances.batch import InstanceBatch, create_instance_batch, shard_name, write_table
from bert_core.instances.pairs import DocumentPool, VocabIds, stable_hash
from bert_core.instances.stats import InstanceStats
from bert_core.vocab.tokenization import load_tokenizer

MIN_DOCS_PER_BUCKET = 1000  # random-next pools smaller than this make B too predictable
MAX_DOCS_PER_BUCKET = 20_000  # ~0.5 GB of tokenized Wikipedia articles held by one worker
INSTANCES_PER_SHARD = 100_000  # when num_shards = 0 (automatic)


# --------------------------------------------------------------------------- pure helpers


def num_shards(total: int, config: InstanceConfig) -> int:
    """Shards for one length: the configured count (or one per INSTANCES_PER_SHARD), rounded up
    to a multiple of ``shard_multiple_of`` so world size x loader workers divides it."""
    wanted = config.num_shards or max(1, math.ceil(total / INSTANCES_PER_SHARD))
    m = config.shard_multiple_of
    return math.ceil(wanted / m) * m


def shard_of_rank(rank: int, total: int, shards: int) -> int:
    """The shard holding global rank ``rank`` when ``total`` rows are split into contiguous
    ranges whose sizes differ by at most one (the first ``total % shards`` get one more)."""
    q, rem = divmod(total, shards)
    boundary = rem * (q + 1)
    if rank < boundary:
        return rank // (q + 1)
    return rem + (rank - boundary) // q


def make_layout(counts: Iterable[tuple[tuple[int, Any], int]], config: InstanceConfig) -> dict:
    """Per length: total, shard count, and the first global rank of every piece (pieces in the
    order of their keys, ``(sort group, pool)``)."""
    per_length: dict[int, dict[Any, int]] = {s.max_seq_length: {} for s in config.lengths}
    for (length, bucket), n in counts:
        per_length[length][bucket] = n
    layout = {}
    for length, buckets in per_length.items():
        offsets, running = {}, 0
        for bucket in sorted(buckets):
            offsets[bucket] = running
            running += buckets[bucket]
        layout[length] = {"total": running, "shards": num_shards(running, config), "offsets": offsets}
    return layout


def num_random_doc_buckets(n_docs: int, config: InstanceConfig,
                           min_docs: int = MIN_DOCS_PER_BUCKET, max_docs: int = MAX_DOCS_PER_BUCKET) -> int:
    """How many random-next pools ``n_docs`` documents are hashed into (see the module docstring)."""
    wanted = max(config.random_doc_buckets, math.ceil(n_docs / max_docs))
    return max(1, min(wanted, n_docs // min_docs))


def prepare_output(output: str, config: InstanceConfig) -> None:
    """Refuse another stage's folder; clear an earlier instances run of the same lengths, so no
    old manifest vouches for shards being rewritten and no stale shard count is left behind."""
    if storage.has_manifest(output):
        stage = storage.read_manifest(output).get("stage")
        if stage != "instances":
            raise ValueError(f"{output} holds the output of the {stage!r} stage; "
                             "give the instances their own --output folder")
    storage.remove(storage.join(output, storage.MANIFEST))
    for spec in config.lengths:
        storage.remove(storage.join(output, f"seq{spec.max_seq_length}"))


def read_documents(uri: str) -> Iterator[tuple[str, list[str] | None]]:
    """(doc_id, sentences) of one documents shard, batch by batch (never the whole file)."""
    import pyarrow.parquet as pq

    with storage.open_file(uri, "rb") as f:
        shard = pq.ParquetFile(f)
        missing = {"doc_id", "sentences"} - set(shard.schema_arrow.names)
        if missing:
            raise ValueError(f"documents shard {uri} has no column(s) {sorted(missing)}; it is not "
                             "a corpus stage output: re-run `bertpipe clean` or fix --corpus")
        for batch in shard.iter_batches(columns=["doc_id", "sentences"], batch_size=256):
            yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True)


# --------------------------------------------------------------------------- DoFns


class TokenizeDocuments(beam.DoFn):
    """(doc_id, sentences) -> (pool, [(doc_id, ids), ...]): each document's ids as the bytes of
    a C int array, each sentence's ids followed by an end mark
    (``Tokenizer.encode_document_bytes``), gathered by random-next pool up to FLUSH_DOCS per
    element (Beam's cost is per element: one per document cost more than the tokenizing).
    Documents without a token go to the 'rejects' output; sentences without tokens are dropped
    later, with the marks (as the reference drops empty lines)."""

    FLUSH_DOCS = 512

    def __init__(self, vocab: str, lowercase: bool, pools: int) -> None:
        self.vocab, self.lowercase, self.pools = vocab, lowercase, pools
        self.rejected = Metrics.counter("instances", "rejected_no_tokens")
        self.documents = Metrics.counter("instances", "documents")

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.vocab, self.lowercase)

    def start_bundle(self) -> None:
        self.buffers: dict[int, list[tuple[str, bytes]]] = {}

    def process(self, doc: tuple[str, list[str] | None]) -> Iterator[Any]:
        doc_id, sentences = doc
        sentences = [s for s in sentences or [] if isinstance(s, str)]  # a null sentence is no text
        marked = self.tokenizer.encode_document_bytes(sentences)
        if len(marked) // 4 == len(sentences):  # nothing but the end marks
            self.rejected.inc()
            yield beam.pvalue.TaggedOutput("rejects", {
                "source": "documents", "id": doc_id, "reason": "no_tokens",
                "detail": f"{len(sentences)} sentences, none with a token in this vocab",
            })
            return
        self.documents.inc()
        pool = stable_hash("bucket", doc_id) % self.pools
        buffer = self.buffers.setdefault(pool, [])
        buffer.append((doc_id, marked))
        if len(buffer) >= self.FLUSH_DOCS:
            yield pool, self.buffers.pop(pool)

    def finish_bundle(self) -> Iterator[Any]:
        from apache_beam.transforms.window import GlobalWindows

        for pool, buffer in sorted(self.buffers.items()):
            yield GlobalWindows.windowed_value((pool, buffer))
        self.buffers = {}


class CreateInstances(beam.DoFn):
    """One random-next pool (bucket ``b``) of documents -> for every length, its instances as
    :class:`InstanceBatch` pieces keyed ``(length, (g, b))``: piece ``g`` holds the instances
    whose key is ``g`` modulo the number of pools, sorted by key (see the module docstring);
    and each piece's size on the 'sizes' output."""

    def __init__(self, config: InstanceConfig, vocab_ids: VocabIds, pools: int) -> None:
        self.config, self.vocab_ids, self.pools = config, vocab_ids, pools
        self.instances = Metrics.counter("instances", "instances")

    def process(self, bucket: tuple[int, Iterable[list[tuple[str, bytes]]]]) -> Iterator[Any]:
        import numpy as np

        cfg = self.config
        # by doc_id: the pool must not depend on the shuffle or on how documents were gathered
        docs = sorted(chain.from_iterable(bucket[1]), key=lambda d: d[0])
        pool = DocumentPool.from_marked([marked for _, marked in docs])
        doc_ids = [doc_id for doc_id, _ in docs]
        groups = self.pools
        for spec in cfg.lengths:
            batch = create_instance_batch(
                pool, doc_ids, seed=cfg.seed, dupe_factor=cfg.dupe_factor,
                max_seq_length=spec.max_seq_length, max_predictions_per_seq=spec.max_predictions_per_seq,
                masked_lm_prob=cfg.masked_lm_prob, short_seq_prob=cfg.short_seq_prob, vocab=self.vocab_ids,
                next_sentence_prediction=cfg.next_sentence_prediction,
                whole_word_mask=cfg.whole_word_mask, mask=cfg.masking == "static",
            )
            self.instances.inc(len(batch))
            group_of = batch.keys % np.uint64(groups)
            batch = batch.take(np.lexsort((batch.keys, group_of)))  # by group, then key
            bounds = np.searchsorted((batch.keys % np.uint64(groups)).astype(np.int64), np.arange(groups + 1))
            for g in range(groups):
                if bounds[g + 1] > bounds[g]:
                    key = (spec.max_seq_length, (g, bucket[0]))
                    yield key, batch.slice(int(bounds[g]), int(bounds[g + 1]))
                    yield beam.pvalue.TaggedOutput("sizes", (key, int(bounds[g + 1] - bounds[g])))


def shard_start(shard: int, total: int, shards: int) -> int:
    """The first global rank of ``shard`` (inverse of :func:`shard_of_rank`)."""
    q, rem = divmod(total, shards)
    return shard * q + min(shard, rem)


def assign_shards(piece: tuple[tuple[int, Any], InstanceBatch], layout: dict) -> Iterator[Any]:
    """A piece's rows have global ranks ``offset(piece) ..``: cut it at shard boundaries ->
    ((length, shard), (first rank, rows))."""
    (length, group), batch = piece
    lay = layout[length]
    total, shards = lay["total"], lay["shards"]
    first = lay["offsets"][group]
    last = first + len(batch) - 1
    for shard in range(shard_of_rank(first, total, shards), shard_of_rank(last, total, shards) + 1):
        lo = max(first, shard_start(shard, total, shards))
        hi = min(last + 1, shard_start(shard + 1, total, shards))
        yield (length, shard), (lo, batch.slice(lo - first, hi - first))


class WriteShards(beam.DoFn):
    """((length, shard), pieces) -> the Parquet shard (rows in rank order), its manifest entry
    and stats."""

    def __init__(self, output: str, mask_id: int) -> None:
        self.output, self.mask_id = output, mask_id

    def process(self, group: tuple[tuple[int, int], Iterable[Any]], layout: dict) -> Iterator[dict]:
        (length, index), pieces = group
        ranked = sorted((p for p in pieces if p is not None), key=lambda p: p[0])  # None: the empty marker
        # Rank order: piece after piece, each a key-ordered (pseudo-random) slice of one pool.
        # Not re-sorted: the loader shuffles the rows of a shard anyway (bert_core/pretrain/data.py).
        batch = InstanceBatch.concat([b for _, b in ranked])
        uri = storage.join(self.output, f"seq{length}", shard_name(index, layout[length]["shards"]))
        write_table(uri, batch.to_table())
        stats = InstanceStats(max_seq_length=length)
        stats.add_columns(batch.input_ids, batch.offsets, batch.len_a, batch.masked_lm_positions,
                          batch.masked_lm_ids, batch.mask_offsets, batch.next_sentence_label, self.mask_id)
        yield {"length": length, "index": index,
               "entry": storage.shard_entry(uri, count=len(batch)), "stats": stats.to_dict()}


def count_documents(shards: list[str]) -> int:
    """Rows of the documents shards, from their Parquet footers (no data read)."""
    import pyarrow.parquet as pq

    total = 0
    for uri in shards:
        with storage.open_file(uri, "rb") as f:
            total += pq.ParquetFile(f).metadata.num_rows
    return total


def write_manifests(results: list[dict], rejects: list[dict], layout: dict, *, output: str,
                    config: InstanceConfig, inputs: list[dict], documents_used: int) -> dict:
    """Per-length manifests, the rejects file, then the top-level manifest (last: it marks done)."""
    stats_by_length: dict[str, Any] = {}
    counts: dict[str, Any] = {"documents_read": documents_used + len(rejects),
                              "documents_used": documents_used,
                              "documents_rejected": len(rejects)}
    for spec in config.lengths:
        length = spec.max_seq_length
        mine = sorted((r for r in results if r["length"] == length), key=lambda r: r["index"])
        stats = InstanceStats(max_seq_length=length)
        for r in mine:
            stats.merge(InstanceStats.from_dict(r["stats"]))
        summary = stats.summary()
        stats_by_length[f"seq{length}"] = summary
        counts[f"instances_seq{length}"] = stats.instances
        storage.write_manifest(
            storage.join(output, f"seq{length}"), stage="instances",
            config={**config.model_dump(mode="json"), "max_seq_length": length,
                    "max_predictions_per_seq": spec.max_predictions_per_seq},
            inputs=inputs, shards=[r["entry"] for r in mine],
            counts={"instances": stats.instances, "tokens": stats.tokens,
                    "shards": layout[length]["shards"]},
            stats=summary,
        )
    rejects = sorted(rejects, key=lambda r: str(r["id"]))
    storage.write_text(storage.join(output, "rejects.jsonl"),
                       "".join(json.dumps(r, sort_keys=True) + "\n" for r in rejects))
    return storage.write_manifest(
        output, stage="instances", config=config, inputs=inputs, counts=counts,
        stats=stats_by_length, lengths={f"seq{s.max_seq_length}": f"seq{s.max_seq_length}"
                                        for s in config.lengths},
    )


# --------------------------------------------------------------------------- pipeline


class CreateInstanceShards(beam.PTransform):
    """(doc_id, sentences) -> written shards' results (dicts) and rejects, per length."""

    def __init__(self, config: InstanceConfig, vocab: str, vocab_ids: VocabIds, output: str,
                 documents_read: int, lowercase: bool = True,
                 min_docs_per_bucket: int = MIN_DOCS_PER_BUCKET) -> None:
        super().__init__()
        self.config, self.vocab, self.vocab_ids = config, vocab, vocab_ids
        self.output, self.lowercase = output, lowercase
        # Known up front (Parquet footers), the pool count needs no side input: tokenized
        # documents go straight into the pool shuffle.
        self.pools = num_random_doc_buckets(documents_read, config, min_docs_per_bucket)

    def expand(self, docs):  # noqa: ANN001, ANN201 - PCollections
        cfg = self.config
        tokenized = docs | "TokenizeDocuments" >> beam.ParDo(
            TokenizeDocuments(self.vocab, self.lowercase, self.pools)).with_outputs("rejects", main="docs")
        n_docs = (tokenized.docs
                  | "DocumentsPerElement" >> beam.Map(lambda kv: len(kv[1]))
                  | "CountDocuments" >> beam.CombineGlobally(sum))
        instances = (
            tokenized.docs
            | "GroupBuckets" >> beam.GroupByKey()
            | "CreateInstances" >> beam.ParDo(CreateInstances(cfg, self.vocab_ids, self.pools))
            .with_outputs("sizes", main="pieces")
        )
        layout = (
            instances.sizes  # (piece key, rows): the layout never decodes the pieces themselves
            | "GatherCounts" >> beam.combiners.ToList()
            | "MakeLayout" >> beam.Map(make_layout, config=cfg)
        )
        layout_si = beam.pvalue.AsSingleton(layout)
        placed = instances.pieces | "AssignShards" >> beam.FlatMap(assign_shards, layout=layout_si)
        every_shard = layout | "EveryShard" >> beam.FlatMap(
            lambda lay: [((length, i), None) for length, v in lay.items() for i in range(v["shards"])])
        results = (
            (placed, every_shard)
            | "FlattenShards" >> beam.Flatten()
            | "GroupShards" >> beam.GroupByKey()
            | "WriteShards" >> beam.ParDo(WriteShards(self.output, self.vocab_ids.mask_id), layout=layout_si)
        )
        return results, tokenized.rejects, layout, n_docs


@contextmanager
def fewer_gc_passes(threshold: int = 100_000) -> Iterator[None]:
    """Collect garbage less often while the job runs in this process, then restore.

    The job allocates millions of short-lived objects (token lists, tuples, small arrays) and
    makes no cycles worth chasing, yet CPython's default gen-0 threshold (700) starts a
    collection every few hundred allocations: ~4 % of the CPU time at 10x the sample corpus
    (measured: 14.4 -> 13.8 CPU-s, three runs each). ``gc.freeze`` also keeps the objects
    loaded before the run (Beam, pyarrow, the vocab) out of every pass. Restored afterwards,
    since a Prefect flow process lives on."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold, 50, 1000)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def pipeline_options(workers: int, runner: str = "FnApiRunner", beam_args: Iterable[str] = ()):  # noqa: ANN201
    from apache_beam.options.pipeline_options import PipelineOptions

    if runner == "FnApiRunner":
        mode = {"direct_num_workers": workers, "direct_running_mode": "multi_processing"} \
            if workers > 1 else {"direct_num_workers": 1, "direct_running_mode": "in_memory"}
        return PipelineOptions(list(beam_args), **mode)
    return PipelineOptions(list(beam_args), runner=runner)


def create_instances(
    corpus: str,
    vocab: str,
    output: str,
    config: InstanceConfig,
    *,
    lowercase: bool = True,
    workers: int = 2,
    runner: str = "FnApiRunner",
    beam_args: Iterable[str] = (),
    min_docs_per_bucket: int = MIN_DOCS_PER_BUCKET,
) -> dict[str, Any]:
    """Run the job; returns the top-level manifest. ``lowercase`` only matters for a bare vocab.txt;
    ``min_docs_per_bucket`` lets a test give a tiny corpus several random-next pools."""
    corpus_manifest = storage.read_manifest(corpus)
    inputs = [corpus_manifest]
    if not vocab.endswith(".txt"):
        inputs.append(storage.read_manifest(vocab))
    vocab_ids = VocabIds.from_tokenizer(load_tokenizer(vocab, lowercase))
    if min(vocab_ids.cls_id, vocab_ids.sep_id, vocab_ids.mask_id) < 0:
        raise ValueError(f"vocab {vocab} lacks [CLS], [SEP] or [MASK]; instances need all three: "
                         "use a BERT vocab (the vocab stage always adds them)")
    shards = storage.shard_uris(corpus, corpus_manifest)
    output = storage.to_uri(output)
    prepare_output(output, config)

    options = pipeline_options(workers, runner, beam_args)
    runner_obj: Any = runner
    if runner == "FnApiRunner":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        runner_obj = FnApiRunner()
    with fewer_gc_passes(), beam.Pipeline(runner=runner_obj, options=options) as p:
        docs = (
            p
            | "ListShards" >> beam.Create(shards)
            | "ReadDocuments" >> beam.FlatMap(read_documents)
        )
        if workers > 1 or runner != "FnApiRunner":
            # Spread the documents of a few big shards over the workers. One in-process worker
            # has nothing to spread, and the shuffle would cost it ~10% of its CPU time.
            docs = docs | "SpreadDocuments" >> beam.Reshuffle()
        results, rejects, layout, n_docs = docs | "CreateInstanceShards" >> CreateInstanceShards(
            config, vocab, vocab_ids, output, count_documents(shards), lowercase, min_docs_per_bucket)
        _ = (
            results
            | "GatherResults" >> beam.combiners.ToList()
            | "WriteManifests" >> beam.Map(
                lambda rs, rj, lay, n: write_manifests(
                    rs, rj, lay, output=output, config=config, inputs=inputs, documents_used=n),
                rj=beam.pvalue.AsList(rejects), lay=beam.pvalue.AsSingleton(layout),
                n=beam.pvalue.AsSingleton(n_docs),
            )
        )
    return storage.read_manifest(output)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", required=True, help="Documents folder (corpus stage output).")
    parser.add_argument("--vocab", required=True, help="Vocab stage folder, or a vocab.txt.")
    parser.add_argument("--output", required=True, help="Output folder for seq{L}/ shards.")
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args, beam_args = parser.parse_known_args(argv)
    cfg = load_config(args.preset, args.config, args.sets)
    manifest = create_instances(args.corpus, args.vocab, args.output, cfg.instances,
                                lowercase=cfg.vocab.lowercase, workers=cfg.workers,
                                runner=cfg.beam_runner, beam_args=[*cfg.beam_args, *beam_args])
    print(json.dumps(manifest["counts"], indent=2))
    return manifest


if __name__ == "__main__":
    run()
