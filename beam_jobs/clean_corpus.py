"""Beam job: Wikipedia dumps + book folders + text records -> cleaned, deduplicated document-level sentences.

    bertpipe corpus --wikipedia 'samples/wikipedia/*.xml.bz2' --books 'samples/books/*.txt' \\
        --output ./bertpipe-data/corpus --workers 2
    bertpipe corpus --text 'data/*.jsonl.zst' --text-field text --output ./bertpipe-data/corpus

Every record read ends as a kept document or one reject with its reason; the output layout and
schema are defined in ``bert_core/corpus/documents.py``, and the output bytes do not depend on the
runner or ``--workers``.
"""

from __future__ import annotations

import heapq
import json
import logging
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import AsSingleton, TaggedOutput

from beam_jobs.job import (
    LOCAL_BYTES_PER_WORKER,
    LOCAL_RUNNER,
    EmptyResultError,
    check_produced,
    check_shared_storage,
    forward_to_cli,
    is_local,
    item_key,
    local_workers,
    progress_folder,
    resolve_runner,
    run_pipeline,
    shares_of_files,
)
from beam_jobs.job import counters as job_counters
from beam_jobs.sorted_runs import WriteSortedRuns, identity
from bert_core import lease, storage
from bert_core.config import CorpusConfig
from bert_core.corpus import documents as D
from bert_core.corpus.inputs import InputError, book_ids, expand_inputs
from bert_core.corpus.records import check_text_field
from bert_core.corpus.sentences import split_paragraphs
from bert_core.histogram import bin_index
from bert_core.progress import OnProgress, Phase, Tally, Watch
from bert_core.sorted_runs import SPILL_DIR

# How the job works:
#
# Steps: ``ReadWikipediaDump`` (stream pages, keep namespace-0 non-redirects, wikitext -> text,
# split sentences), ``ReadBooks`` (one book = one document), ``ReadTextRecords`` (JSON lines and
# Parquet, one record = one document: ``bert_core/corpus/records.py``), then per source
# ``CleanDocuments`` (filters, duplicate fingerprints), ``FindDuplicates`` (exact and
# near-duplicate verdicts), ``WriteDocuments`` (sorted, hash-assigned shards, the verdicts
# applied), then the manifest (none if an input file was cut short: the job then ends naming the
# file, ``bert_core/corpus/documents.py``). Every record read ends as a kept document or one
# reject (with a reason, and the id it duplicates for duplicates); one Beam counter per reject
# reason. Output layout and schema: ``bert_core/corpus/documents.py``. Output bytes do not depend on
# ``--workers``: shards are chosen by a stable hash of ``doc_id``, rows sorted by ``doc_id``,
# rejects sorted too, and which of a set of duplicates is kept depends only on ids, never on
# arrival order.
#
# Memory does not grow with the corpus, on the local runner too (which holds every element that
# passes between steps in its own process, and materializes a Flatten of several inputs): records
# pass between steps as sorted runs in temporary files under the output (``_spill/``,
# ``bert_core/sorted_runs.py``) and only the file names are shuffled; each source is cleaned
# alone (no Flatten of documents); the verdicts meet the documents by shard (``CoGroupByKey`` of
# file names, no side inputs) and a shard is written as one merge of sorted streams, a Parquet row
# group at a time. The only side input is the job's summary (counts and histograms).
#
# On the local runner ``--workers`` is an upper bound: the job starts one worker process per
# 4 MB of input (``.bz2``/``.gz``/``.zst`` counted at four times their size), so a tiny input runs
# in the driver process (a worker process has Beam's start-up to pay: its imports, the harness, a
# bundle processor per stage) and any real corpus starts every worker: the number of processes,
# and with it the job's memory, does not change as the corpus grows. ``--workers 1`` runs the
# job in one process, which costs the fewest CPU-seconds (no gRPC traffic between processes;
# ``benchmarks/speed/bench_clean.py`` measures both). ``--bytes-per-worker 0`` starts every worker
# whatever the input size.
#
# Progress: each read work item writes the bytes of input it covers (its share of its file) and
# the records it read to the output's ``_progress/read/`` (``bert_core/progress.py``), which the
# driver sums against the input's size while the job runs.

NAMESPACE = "clean_corpus"
REJECTS = "rejects"
READ = "read"
CUTS = "cuts"
EXACT = "exact"
BANDS = "bands"
# Near-duplicate search covers books: editions and copies of one book differ by a few lines.
# Text records too: web and dataset dumps are full of pages that differ only in a date, a
# header or boilerplate, which the exact hash misses, and nothing makes their ids unique.
# Wikipedia pages are unique by page id and copied pages are caught by the exact hash; MinHash
# over every article would cost a large share of the job's CPU (and 8 band records per article)
# for almost no hits.
NEAR_DEDUP_SOURCES = (D.BOOKS, D.TEXT)
READ_PHASE = "read"  # the progress phase of the read steps: bytes of input, and records
ROW_GROUP_CHARS = 2 << 20  # characters of documents per Parquet row group of a shard (bounds the writer)
LATE_REJECTS = 50_000  # duplicate rejects a shard writer holds before it spills them

_LOG = logging.getLogger(__name__)


def _count_reject(reject: D.Reject) -> D.Reject:
    Metrics.counter(NAMESPACE, f"rejected_{reject['reason']}").inc()
    return reject


# --------------------------------------------------------------------------- reading


def _spread(items, label: str, spread: bool):
    """Work items reshuffled, which spreads them over the workers (the local runner deals them
    out; ``Create`` is asked not to reshuffle: once is enough). With one worker process there is
    nothing to spread, and the shuffle would only add a stage."""
    return items | label >> beam.Reshuffle() if spread else items


class _ReadFn(beam.DoFn):
    """A read step's progress: with ``progress`` (a folder) and ``shares`` (work item -> its
    bytes of input), each item's records and, when it is done, its bytes."""

    def __init__(self, progress: str | None = None, shares: dict[str, int] | None = None):
        self.progress, self.shares = progress, shares or {}

    def tally(self, item: Any) -> tuple[Tally, int]:
        key = item_key(item)
        return Tally(self.progress, READ_PHASE, key), self.shares.get(key, 0)


class ReadPagesFn(_ReadFn):
    """One dump work item -> documents (sentences) and rejects; plus one READ count and one
    ``(file, (pages read, cuts met))`` CUTS entry per item."""

    def process(self, item) -> Iterator[Any]:
        from bert_core.corpus.dumps import read_pages
        from bert_core.corpus.wikitext import CleanStats, is_redirect, wikitext_to_paragraphs

        read = pages = 0
        cuts = []
        tally, share = self.tally(item)
        for kind, record in read_pages(item):
            read += 1
            tally.add(records=1)
            if kind == "cut":
                cuts.append(record)
                continue
            if kind == "reject":
                yield TaggedOutput(REJECTS, record)
                continue
            pages += 1
            doc_id, title = record["doc_id"], record["title"]
            if record["ns"] != "0":
                yield TaggedOutput(REJECTS, D.make_reject(
                    D.WIKIPEDIA, doc_id, D.NOT_ARTICLE, f"{title!r} is in namespace {record['ns']}"))
            elif record["redirect"] or is_redirect(record["text"]):
                yield TaggedOutput(REJECTS, D.make_reject(
                    D.WIKIPEDIA, doc_id, D.REDIRECT, f"{title!r} is a redirect"))
            else:
                stats = CleanStats()
                try:
                    paragraphs = wikitext_to_paragraphs(record["text"], stats)
                    longest = max(map(len, paragraphs), default=0)
                    if longest > D.MAX_LINE_CHARS:
                        yield TaggedOutput(REJECTS, D.make_reject(
                            D.WIKIPEDIA, doc_id, D.LINE_TOO_LONG,
                            f"{title!r} at {record['origin']}: a paragraph of {longest:,} characters "
                            f"(limit {D.MAX_LINE_CHARS:,}) is not prose"))
                        continue
                    sentences = split_paragraphs(paragraphs)
                except Exception as err:  # one odd page must not stop the job
                    yield TaggedOutput(REJECTS, D.make_reject(
                        D.WIKIPEDIA, doc_id, D.UNPARSEABLE_PAGE,
                        f"{title!r} at {record['origin']}: {type(err).__name__}: {err}"))
                    continue
                if stats.slow_paragraphs:
                    Metrics.counter(NAMESPACE, "slow_path_paragraphs").inc(stats.slow_paragraphs)
                if stats.dropped_markup_sentences:
                    Metrics.counter(NAMESPACE, "dropped_markup_sentences").inc(stats.dropped_markup_sentences)
                yield D.make_document(doc_id, D.WIKIPEDIA, title, sentences, record["origin"])
        tally.close(share)
        yield TaggedOutput(READ, (D.WIKIPEDIA, read))
        yield TaggedOutput(CUTS, (item.uri, (pages, cuts)))


class ReadBookFn(_ReadFn):
    """One book file -> one document, or a reject naming why it is not a book."""

    def process(self, element: tuple[str, str]) -> Iterator[Any]:
        from bert_core.corpus.books import BookError, book_paragraphs

        uri, doc_id = element
        tally, share = self.tally(uri)
        tally.close(share, records=1)
        yield TaggedOutput(READ, (D.BOOKS, 1))
        try:
            with storage.open_file(uri, "rb") as f:
                data = f.read()
            if uri.endswith(".gz"):
                import gzip

                data = gzip.decompress(data)
            title, paragraphs = book_paragraphs(uri, data)
        except BookError as err:
            yield TaggedOutput(REJECTS, D.make_reject(D.BOOKS, doc_id, err.reason, err.detail))
            return
        except (OSError, EOFError, zlib.error) as err:  # zlib.error: a corrupt .gz member
            yield TaggedOutput(REJECTS, D.make_reject(
                D.BOOKS, doc_id, D.UNREADABLE_FILE, f"{uri}: {type(err).__name__}: {err}"))
            return
        yield D.make_document(doc_id, D.BOOKS, title, split_paragraphs(paragraphs), uri)


class ReadRecordsFn(_ReadFn):
    """One text work item (a JSON lines file or a Parquet row group) -> documents and rejects,
    plus its READ count."""

    def __init__(self, cfg: CorpusConfig, progress: str | None = None, shares: dict[str, int] | None = None):
        super().__init__(progress, shares)
        self.cfg = cfg

    def process(self, item) -> Iterator[Any]:
        from bert_core.corpus.records import read_records

        read = 0
        tally, share = self.tally(item)
        for kind, record in read_records(item, self.cfg):
            read += 1
            tally.add(records=1)
            yield TaggedOutput(REJECTS, record) if kind == "reject" else record
        tally.close(share)
        yield TaggedOutput(READ, (D.TEXT, read))


def _shares(progress: str | None, items: list, uri_of) -> dict[str, int] | None:
    return shares_of_files(items, uri_of) if progress else None


class ReadWikipediaDump(beam.PTransform):
    """Dump files -> {"docs", "rejects", "cuts", "read"} ("cuts": the rejects of files that break
    off, each naming the pages read from its whole file). Work items are reshuffled across
    workers unless ``spread`` is false: see :func:`_spread`. ``progress``: the folder the items
    write their progress to (none if None)."""

    def __init__(self, files: list[str], spread: bool = True, progress: str | None = None):
        super().__init__()
        self.files, self.spread, self.progress = files, spread, progress

    def expand(self, pbegin):
        from bert_core.corpus.dumps import plan_reads

        # a single-stream .bz2 is split by bz2 block too, so one big file uses every worker
        items = [item for f in self.files for item in plan_reads(f)]
        shares = _shares(self.progress, items, lambda item: item.uri)
        listed = pbegin | "ListWorkItems" >> beam.Create(items, reshuffle=False)
        out = (
            _spread(listed, "SpreadWorkItems", self.spread)
            | "ParsePages" >> beam.ParDo(ReadPagesFn(self.progress, shares))
            .with_outputs(REJECTS, READ, CUTS, main="docs")
        )
        # a cut's reject counts the pages of every item of its file, the items before it too
        cuts = (
            out[CUTS]
            | "GroupItemsByFile" >> beam.GroupByKey()
            | "NameCuts" >> beam.FlatMapTuple(_cut_rejects)
        )
        return {"docs": out.docs, "rejects": out[REJECTS], "cuts": cuts, "read": out[READ]}


def _cut_rejects(_uri: str, parts: Iterable[tuple[int, list]]) -> list[D.Reject]:
    from bert_core.corpus.dumps import cut_rejects

    return cut_rejects(parts)


class ReadBooks(beam.PTransform):
    """Book files -> {"docs", "rejects", "read"}; ``progress`` as for :class:`ReadWikipediaDump`."""

    def __init__(self, files: list[str], spread: bool = True, progress: str | None = None):
        super().__init__()
        self.files, self.spread, self.progress = files, spread, progress

    def expand(self, pbegin):
        ids = book_ids(self.files)
        shares = _shares(self.progress, list(ids), lambda uri: uri)
        listed = pbegin | "ListBooks" >> beam.Create(sorted(ids.items()), reshuffle=False)
        out = (
            _spread(listed, "SpreadBooks", self.spread)
            | "ReadBooks" >> beam.ParDo(ReadBookFn(self.progress, shares)).with_outputs(REJECTS, READ, main="docs")
        )
        return {"docs": out.docs, "rejects": out[REJECTS], "read": out[READ]}


class ReadTextRecords(beam.PTransform):
    """Text record files -> {"docs", "rejects", "read"}: one work item per Parquet row group
    and per JSON lines file, reshuffled across workers; ``progress`` as for
    :class:`ReadWikipediaDump`."""

    def __init__(self, files: list[str], cfg: CorpusConfig, spread: bool = True, progress: str | None = None):
        super().__init__()
        self.files, self.cfg, self.spread, self.progress = files, cfg, spread, progress

    def expand(self, pbegin):
        from bert_core.corpus.records import plan_records

        items = plan_records(self.files, self.cfg)
        shares = _shares(self.progress, items, lambda item: item.uri)
        listed = pbegin | "ListRecordItems" >> beam.Create(items, reshuffle=False)
        out = (
            _spread(listed, "SpreadRecordItems", self.spread)
            | "ReadRecords" >> beam.ParDo(ReadRecordsFn(self.cfg, self.progress, shares))
            .with_outputs(REJECTS, READ, main="docs")
        )
        return {"docs": out.docs, "rejects": out[REJECTS], "read": out[READ]}


# --------------------------------------------------------------------------- sorted runs of each kind


def _doc_key(doc: D.Document) -> tuple[str, str]:
    return doc["doc_id"], doc["origin"]


def _doc_bucket(doc: D.Document, n: int) -> int:
    return D.stable_shard(doc["doc_id"], n)


def _doc_weight(doc: D.Document) -> int:
    return sum(map(len, doc["sentences"]))


def _reject_bucket(reject: D.Reject, n: int) -> int:
    return D.stable_shard(reject["id"], n)


def _key_bucket(record: tuple, n: int) -> int:
    """Bucket of a keyed record: its key, or the doc_id at the head of a tuple key."""
    key = record[0]
    return D.stable_shard(key if isinstance(key, str) else key[0], n)


def _band_key(record: tuple) -> tuple[str, str]:
    return record[0], record[1][0]


def _band_weight(record: tuple) -> int:
    return 100 + 4 * len(record[1][1])


def spill_docs(output: str, n: int) -> WriteSortedRuns:
    return WriteSortedRuns(output, "docs", n, _doc_bucket, _doc_key, _doc_weight)


def spill_rejects(output: str, n: int) -> WriteSortedRuns:
    return WriteSortedRuns(output, "rejects", n, _reject_bucket, D.reject_sort_key)


# --------------------------------------------------------------------------- cleaning


class CleanFn(beam.DoFn):
    """Per document: the filters, then the duplicate fingerprints (the exact-duplicate key and,
    for near duplicates, its LSH band entries), each record written at once to sorted runs
    (:class:`~beam_jobs.sorted_runs.WriteSortedRuns`). Main output: the documents' runs; tagged:
    the runs of filter rejects, exact keys and band entries.

    One step for all of it: every step the documents pass through costs the runner an
    operation to set up and a hop per element. Only the small fingerprints are compared to find duplicates;
    the documents themselves go to their output shard once (through spill files), where the
    verdicts are applied.
    """

    def __init__(self, cfg: CorpusConfig, output: str, num_buckets: int):
        self.cfg = cfg
        self.spills = {
            None: spill_docs(output, num_buckets),
            REJECTS: spill_rejects(output, num_buckets),
            EXACT: WriteSortedRuns(output, "exact", num_buckets, _key_bucket),
            BANDS: WriteSortedRuns(output, "bands", num_buckets, _key_bucket, _band_key, _band_weight),
        }

    def setup(self) -> None:
        from bert_core.corpus.dedup import MinHasher

        self.hasher = MinHasher(self.cfg.minhash_num_perm, self.cfg.near_dup_threshold)

    def start_bundle(self) -> None:
        for spill in self.spills.values():
            spill.start_bundle()

    def process(self, doc: D.Document) -> Iterator[Any]:
        from bert_core.corpus.dedup import normalize, normalized_hash

        doc = D.apply_filters(doc, self.cfg)  # too-short sentences dropped, or a reject
        if D.is_reject(doc):
            yield from self._spill(REJECTS, doc)
            return
        yield from self._spill(None, doc)
        text = normalize(" ".join(doc["sentences"]))
        if self.cfg.dedup_exact:
            yield from self._spill(EXACT, (normalized_hash(text), (doc["doc_id"], doc["origin"])))
        if self.cfg.dedup_near and doc["source"] in NEAR_DEDUP_SOURCES:
            # 32-bit values: half the bytes to spill, same estimate
            sig = self.hasher.signature(text, normalized=True).astype("uint32")
            for key in self.hasher.band_keys(sig):
                yield from self._spill(BANDS, (key, (doc["doc_id"], sig)))

    def finish_bundle(self) -> Iterator[Any]:
        for tag, spill in self.spills.items():
            for run in spill.finish_bundle():
                yield run if tag is None else TaggedOutput(tag, run)

    def _spill(self, tag: str | None, record: Any) -> Iterator[Any]:
        for run in self.spills[tag].process(record):
            yield run if tag is None else TaggedOutput(tag, run)


class CleanDocuments(beam.PTransform):
    """One source's {"docs", "rejects"[, "cuts"]} -> sorted runs, as ``(bucket, run file)``
    PCollections: {"docs", "rejects"} (the cuts among them) by output shard, {"exact", "bands"}
    (duplicate fingerprints) by key.

    Filters run here (too short, too few sentences) and fingerprints are taken; duplicates are
    found by :class:`FindDuplicates` and applied by :class:`WriteDocuments`, so the documents
    travel once. Apply it to each source alone: a Flatten of several sources' documents would be
    held whole by the local runner.
    """

    def __init__(self, cfg: CorpusConfig, output: str, num_shards: int):
        super().__init__()
        self.cfg, self.output, self.num_shards = cfg, output, num_shards

    def expand(self, pcolls):
        cfg, output, n = self.cfg, self.output, self.num_shards
        out = pcolls["docs"] | "CleanAndSpill" >> beam.ParDo(CleanFn(cfg, output, n)).with_outputs(
            REJECTS, EXACT, BANDS, main="docs")
        runs = [pcolls["rejects"] | "SpillReadRejects" >> beam.ParDo(spill_rejects(output, n)), out[REJECTS]]
        if "cuts" in pcolls:
            runs.append(pcolls["cuts"] | "SpillCutRejects" >> beam.ParDo(spill_rejects(output, n)))
        return {
            "docs": out.docs,
            "rejects": runs | "AllRejectRuns" >> beam.Flatten(),
            "exact": out[EXACT],
            "bands": out[BANDS],
        }


def _exact_verdicts(element: tuple[int, Iterable[str]]) -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """One bucket of content keys (runs) -> exact-duplicate verdicts, one group at a time."""
    from bert_core.corpus.dedup import exact_losers
    from bert_core.sorted_runs import group_sorted, merge_runs

    _, runs = element
    for content, records in group_sorted(merge_runs(sorted(runs), identity), _first):
        if len(records) > 1:
            yield from exact_losers((content, [member for _, member in records]))


def _near_verdicts(element: tuple[int, Iterable[str]], threshold: float) -> Iterator[tuple[str, tuple[str, float]]]:
    """One bucket of LSH band entries (runs) -> (doc_id, (similar smaller doc_id, similarity))."""
    from bert_core.corpus.dedup import near_duplicates_in_bucket
    from bert_core.sorted_runs import group_sorted, merge_runs

    _, runs = element
    for _, records in group_sorted(merge_runs(sorted(runs), _band_key), _first):
        if len(records) > 1:
            for doc_id, dup_of, sim in near_duplicates_in_bucket([member for _, member in records], threshold):
                yield doc_id, (dup_of, sim)


def _first(record: tuple) -> Any:
    return record[0]


class FindDuplicates(beam.PTransform):
    """{"exact", "bands"} fingerprint runs -> {"exact", "near"} verdict runs by output shard.

    "exact": (doc_id, origin) -> the (doc_id, origin) with the same text that is kept (the
    smallest); "near": doc_id -> (a smaller doc_id it is similar to, estimated Jaccard), of which
    the writer takes the smallest. A bucket's runs are merged as streams: one group of equal
    keys is held at a time.
    """

    def __init__(self, cfg: CorpusConfig, output: str, num_shards: int):
        super().__init__()
        self.cfg, self.output, self.num_shards = cfg, output, num_shards

    def expand(self, runs):
        output, n = self.output, self.num_shards
        exact = (
            runs["exact"]
            | "GroupContentRuns" >> beam.GroupByKey()
            | "FindExactDuplicates" >> beam.FlatMap(_exact_verdicts)
            | "SpillExactVerdicts" >> beam.ParDo(WriteSortedRuns(output, "dup", n, _key_bucket))
        )
        near = (
            runs["bands"]
            | "GroupBandRuns" >> beam.GroupByKey()
            | "FindNearDuplicates" >> beam.FlatMap(_near_verdicts, self.cfg.near_dup_threshold)
            | "SpillNearVerdicts" >> beam.ParDo(WriteSortedRuns(output, "near", n, _key_bucket))
        )
        return {"exact": exact, "near": near}


# --------------------------------------------------------------------------- writing


def _write_shard(element, output: str, num_shards: int, text_format: str) -> Iterator[Any]:
    """Write one documents shard and its rejects shard from their runs, applying the duplicate
    verdicts as one merge of sorted streams; yields the shard's partial summary."""
    from bert_core.corpus.dedup import apply_verdicts
    from bert_core.sorted_runs import merge_runs, write_run

    index, runs = element
    summary = SummaryFn()
    acc = summary.create_accumulator()
    docs = merge_runs(sorted(runs["docs"]), _doc_key)
    exact = merge_runs(sorted(runs["exact"]), identity)
    near = merge_runs(sorted(runs["near"]), identity)
    text = storage.join(output, storage.shard_name("text", index, num_shards, "txt")) if text_format == "google" else None
    writer = D.DocumentShardWriter(storage.join(output, storage.shard_name("docs", index, num_shards, "parquet")), text,
                           ROW_GROUP_CHARS)
    late: list[D.Reject] = []  # duplicate rejects: at most one per document, spilled in runs
    late_runs: list[str] = []
    try:
        for record in apply_verdicts(docs, exact, near):
            if D.is_reject(record):
                late.append(record)
                if len(late) >= LATE_REJECTS:
                    late_runs.append(storage.join(output, SPILL_DIR, storage.unique_name(f"late-{index:05d}", "pkl")))
                    write_run(late_runs[-1], late, D.reject_sort_key)
                    late = []
            else:
                writer.add(record)
                summary.add_input(acc, ("kept", (record["source"], D.length_stats(record))))
    finally:
        writer.close()
    late.sort(key=D.reject_sort_key)
    runs_in_order = [*sorted(runs["rejects"]), *late_runs]
    rejects = heapq.merge(merge_runs(runs_in_order, D.reject_sort_key), late, key=D.reject_sort_key)
    uri = storage.join(output, storage.shard_name("rejects", index, num_shards, "jsonl"))
    with storage.open_file(uri, "wb") as f:
        for reject in rejects:
            _count_reject(reject)
            summary.add_input(acc, ("rejected", reject))
            f.write((json.dumps(reject, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8"))
    yield ("partial", acc)


class WriteDocuments(beam.PTransform):
    """Runs {"docs", "rejects", "exact", "near"} (``(shard, run file)``) -> every documents and
    rejects shard under ``output`` (an empty one where no run falls); returns the shards'
    partial summaries. Runs are joined by shard (CoGroupByKey of file names), never by side
    inputs."""

    def __init__(self, output: str, num_shards: int, text_format: str):
        super().__init__()
        self.output, self.num_shards, self.text_format = output, num_shards, text_format

    def expand(self, runs):
        n = self.num_shards
        every = runs["docs"].pipeline | "EveryShard" >> beam.Create([(i, None) for i in range(n)])
        return (
            {"shard": every, **runs}
            | "JoinRunsByShard" >> beam.CoGroupByKey()
            | "WriteShards" >> beam.FlatMap(_write_shard, self.output, n, self.text_format)
        )


class SummaryFn(beam.CombineFn):
    """Counts per source and reason, and length histograms of kept documents."""

    def create_accumulator(self) -> dict[str, Any]:
        return {"read": {}, "kept": {}, "rejected": {}, "sentences": {}, "chars": {}, "totals": {}}

    def add_input(self, acc, element):
        kind, value = element
        if kind == "partial":  # a shard's own summary
            return self.merge_accumulators([acc, value])
        if kind == "read":
            source, n = value
            acc["read"][source] = acc["read"].get(source, 0) + n
        elif kind == "kept":
            source, stats = value
            acc["kept"][source] = acc["kept"].get(source, 0) + 1
            for name, edges in D.LENGTH_EDGES.items():
                i = bin_index(stats[name], edges)
                acc[name][i] = acc[name].get(i, 0) + 1
                acc["totals"][name] = acc["totals"].get(name, 0) + stats[name]
        else:
            key = f"{value['source']}/{value['reason']}"
            acc["rejected"][key] = acc["rejected"].get(key, 0) + 1
        return acc

    def merge_accumulators(self, accs):
        out = self.create_accumulator()
        for acc in accs:
            for part, values in acc.items():
                for k, v in values.items():
                    out[part][k] = out[part].get(k, 0) + v
        return out

    def extract_output(self, acc):
        return acc


def _finish(_, output: str, cfg: CorpusConfig, inputs: dict[str, list[str]], num_shards: int,
            attempt: str | None, summary: dict[str, Any]) -> dict[str, Any] | None:
    """The shards moved into place, then the manifest, only by the attempt that holds the
    folder's lease (``lease.publish``, ``lease.commit``): the summary is complete only once every
    shard is written. None when an input file was cut short (the driver names it:
    :func:`_checked_manifest`)."""
    storage.remove(storage.join(lease.staging(output, attempt), SPILL_DIR))  # its own names
    lease.publish(output, attempt)  # lost: one line, nothing moved or committed
    if D.truncated_inputs(summary) and not cfg.allow_truncated:
        return None
    return D.write_corpus_manifest(output, cfg, inputs, num_shards, summary, fence=lease.fence(output, attempt))


# --------------------------------------------------------------------------- entry points


def build_pipeline(p, cfg: CorpusConfig, output: str, inputs: dict[str, list[str]], num_shards: int,
                   spread: bool = True, attempt: str | None = None, progress: str | None = None) -> None:
    """The job's graph: read -> clean (each source alone) -> find duplicates -> write shards ->
    manifest. Between steps only run file names and small summaries travel. ``spread``: reshuffle
    the work items over the workers (needless with one worker process); ``progress``: the folder
    the read steps write their progress to. Every file is written under the attempt's own names
    (``lease.staging``) until :func:`_finish` publishes them."""
    staged = lease.staging(output, attempt)
    wiki_files, book_files, text_files = inputs["wikipedia"], inputs["books"], inputs["text"]
    parts = []
    if wiki_files:
        parts.append(("Wikipedia", p | "ReadWikipediaDump" >> ReadWikipediaDump(wiki_files, spread, progress)))
    if book_files:
        parts.append(("Books", p | "ReadBooksFiles" >> ReadBooks(book_files, spread, progress)))
    if text_files:
        parts.append(("Text", p | "ReadTextRecords" >> ReadTextRecords(text_files, cfg, spread, progress)))
    runs = [part | f"Clean{name}" >> CleanDocuments(cfg, staged, num_shards) for name, part in parts]
    by_kind = {kind: [r[kind] for r in runs] | f"All{kind.capitalize()}Runs" >> beam.Flatten()
               for kind in ("docs", "rejects", "exact", "bands")}
    verdicts = by_kind | "FindDuplicates" >> FindDuplicates(cfg, staged, num_shards)
    written = (
        {"docs": by_kind["docs"], "rejects": by_kind["rejects"], **verdicts}
        | "WriteDocuments" >> WriteDocuments(staged, num_shards, cfg.text_format)
    )
    read = [part["read"] for _, part in parts] | "AllReadCounts" >> beam.Flatten()
    summary = (
        (read | "TagRead" >> beam.Map(lambda x: ("read", x)), written)
        | "AllSummaries" >> beam.Flatten()
        # every shard gives a partial summary, so no default for an empty input is needed
        | "Summarize" >> beam.CombineGlobally(SummaryFn()).without_defaults()
    )
    _ = (
        p
        | "Once" >> beam.Create([None])
        | "WriteManifest" >> beam.Map(_finish, output, cfg, inputs, num_shards, attempt,
                                    summary=AsSingleton(summary))
    )


def run(cfg: CorpusConfig, output: str, workers: int = 1, runner: str = LOCAL_RUNNER,
        beam_args: Iterable[str] = (), counters: dict[str, int] | None = None,
        bytes_per_worker: int = LOCAL_BYTES_PER_WORKER, shared_storage: bool = False,
        on_progress: OnProgress | None = None) -> dict[str, Any]:
    """Run the job; returns the manifest. Missing inputs raise :class:`InputError` at once.

    ``runner`` is a Beam runner name (``beam_jobs.job``: the local FnApiRunner by default, ``dask``,
    or DataflowRunner, FlinkRunner, ... with ``beam_args``); ``shared_storage`` lets a runner
    whose workers are other machines take local paths (:func:`check_shared_storage`). On the
    local runner ``workers`` is an upper bound: :func:`local_workers` starts one process per
    ``bytes_per_worker`` of input (0: all of them). ``counters``, if given, receives the job's
    Beam counters (``rejected_<reason>``, ``slow_path_paragraphs``,
    ``dropped_markup_sentences``), where the runner reports them. ``on_progress`` is told the
    bytes of input read (of their total, with the records read) while the job runs.
    """
    runner, beam_args = resolve_runner(runner, beam_args)
    output = storage.to_uri(output)
    finished = lease.refuse_finished(output, "corpus", cfg)  # before any work: never rewritten
    if finished is not None:
        return finished
    check_shared_storage("corpus", runner, shared_storage,
                         [("output", output), *((kind, g) for kind in ("wikipedia", "books", "text")
                                                for g in getattr(cfg, kind))])
    wiki_files = expand_inputs(cfg.wikipedia, "wikipedia")
    book_files = expand_inputs(cfg.books, "books")
    text_files = expand_inputs(cfg.text, "text")
    check_text_field(text_files, cfg)
    if not wiki_files and not book_files and not text_files:
        raise InputError("no inputs: give --wikipedia GLOB, --books GLOB and/or --text GLOB "
                         "(corpus.wikipedia / corpus.books / corpus.text)")
    storage.check_writable(output)
    total_bytes = sum(storage.size(f) for f in wiki_files + book_files + text_files)
    # Shard count from the input size (never from workers), so output bytes do not depend on them.
    num_shards = cfg.num_shards or D.auto_num_shards(total_bytes // 2)
    inputs = {"wikipedia": wiki_files, "books": book_files, "text": text_files}
    if is_local(runner):
        workers = local_workers(workers, wiki_files + book_files + text_files, bytes_per_worker)
    spread = workers > 1 or not is_local(runner)

    with lease.hold(output, "corpus", None) as held:
        if held.finished:
            return storage.read_manifest(output)
        D.clear_output(output, held.attempt)
        watch = Watch(progress_folder(output), "corpus", {READ_PHASE: Phase("reading inputs", total_bytes, "bytes")},
                      on_progress)
        watch.clear()
        folder = progress_folder(output) if on_progress else None
        try:  # a failed run leaves no temporary files: lease.hold removes what it staged
            result = run_pipeline(lambda p: build_pipeline(p, cfg, output, inputs, num_shards, spread, held.attempt,
                                                           folder),
                                  workers, runner, beam_args, watch if on_progress else None)
        finally:
            watch.clear()
        if counters is not None:
            for name, n in (job_counters(result, NAMESPACE) or {}).items():
                counters[name] = counters.get(name, 0) + n
        return _checked_manifest(output, cfg, num_shards, len(wiki_files + book_files + text_files), total_bytes)


def _checked_manifest(output: str, cfg: CorpusConfig, num_shards: int, files: int, total_bytes: int) -> dict[str, Any]:
    """The manifest of a finished run, or one line (and no manifest) when an input file was cut
    short or non-empty input files gave neither a document nor a reject. A cut file let through
    by ``corpus.allow_truncated`` is one warning line each."""
    if not storage.has_manifest(output):
        cuts = D.read_rejects(output, num_shards, D.TRUNCATED_INPUT)
        if cuts:
            raise D.TruncatedInputError(D.truncation_message(output, cuts, allowed=False))
        check_produced("corpus", 0, f"documents or rejects (no {storage.MANIFEST} written)", files, "input files")
    manifest = storage.read_manifest(output)
    c = manifest["counts"]
    if any(isinstance(s, dict) and s["rejected_by_reason"].get(D.TRUNCATED_INPUT) for s in c.values()):
        for cut in D.read_rejects(output, num_shards, D.TRUNCATED_INPUT):
            _LOG.warning(D.truncation_message(output, [cut], allowed=True))
    if total_bytes > 0 and c["documents"] + c["rejects"] == 0:
        storage.remove(storage.join(output, storage.MANIFEST))
        check_produced("corpus", 0, "documents and 0 rejects", total_bytes, "bytes of input")
    if c["documents"] == 0 and c["rejects"] > 0:
        storage.remove(storage.join(output, storage.MANIFEST))
        raise EmptyResultError(_nothing_kept(output, c, num_shards))
    return manifest


def _nothing_kept(output: str, counts: dict[str, Any], num_shards: int) -> str:
    """One line for a run that rejected every record it read: how many, why, and one example."""
    reasons: dict[str, int] = {}
    for source in counts.values():
        if isinstance(source, dict):
            for reason, n in source.get("rejected_by_reason", {}).items():
                reasons[reason] = reasons.get(reason, 0) + n
    top = max(reasons, key=reasons.__getitem__)
    example = next(iter(D.read_rejects(output, num_shards, top)), {}).get("detail", "")
    listed = ", ".join(f"{reason} {n:,}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
    return (f"corpus: 0 documents kept of {counts['rejects']:,} records read, every one rejected ({listed}); "
            f"e.g. {example}; the reasons are in {output}/rejects-*.jsonl")


if __name__ == "__main__":
    forward_to_cli("corpus")
