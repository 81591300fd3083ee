"""Beam job: Wikipedia dumps + book folders + text records -> cleaned, deduplicated document-level sentences.

    bertpipe corpus --wikipedia 'samples/wikipedia/*.xml.bz2' --books 'samples/books/*.txt' \\
        --output ./bertpipe-data/corpus --workers 2
    bertpipe corpus --text 'data/*.jsonl.zst' --text-field text --output ./bertpipe-data/corpus
    python -m beam_jobs.clean_corpus --wikipedia ... --output ... [--preset demo] [--set corpus.num_shards=8] \\
        [--workers N] [-- beam args]

Steps: ``ReadWikipediaDump`` (stream pages, keep namespace-0 non-redirects, wikitext -> text,
split sentences), ``ReadBooks`` (one book = one document), ``ReadTextRecords`` (JSON lines and
Parquet, one record = one document: ``bert_core/corpus/records.py``), ``CleanDocuments`` (filters, exact
and near-duplicate removal), ``WriteDocuments`` (sorted, hash-assigned shards), then the
manifest. Every record read ends as a kept document or one reject (with a reason, and the id it
duplicates for duplicates); one Beam counter per reject reason. Output layout and schema:
``bert_core/corpus/documents.py``. Output bytes do not depend on ``--workers``: shards are chosen by a
stable hash of ``doc_id``, rows sorted by ``doc_id``, rejects sorted too, and which of a set of
duplicates is kept depends only on ids, never on arrival order.
"""

from __future__ import annotations

import json
import pickle
import uuid
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import AsDict, AsList, AsSingleton, TaggedOutput

from beam_jobs.job import LOCAL_RUNNER, job_parser, parse_job_args, run_pipeline
from beam_jobs.job import counters as job_counters
from bert_core import storage
from bert_core.config import CorpusConfig
from bert_core.corpus import documents as D
from bert_core.corpus.dedup import duplicate_verdicts, exact_losers
from bert_core.corpus.inputs import InputError, book_ids, expand_inputs
from bert_core.corpus.sentences import split_paragraphs

NAMESPACE = "clean_corpus"
REJECTS = "rejects"
READ = "read"
EXACT = "exact"
BANDS = "bands"
# Near-duplicate search covers books: editions and copies of one book differ by a few lines.
# Text records too: web and dataset dumps are full of pages that differ only in a date, a
# header or boilerplate, which the exact hash misses, and nothing makes their ids unique.
# Wikipedia pages are unique by page id and copied pages are caught by the exact hash; MinHash
# over every article would cost a large share of the job's CPU (and 8 band records per article)
# for almost no hits.
NEAR_DEDUP_SOURCES = (D.BOOKS, D.TEXT)
SPILL_DIR = "_spill"  # temporary, removed before the manifest is written
SPILL_CHARS = 16 << 20  # characters of documents a worker holds before it spills them


def _count_reject(reject: D.Reject) -> D.Reject:
    Metrics.counter(NAMESPACE, f"rejected_{reject['reason']}").inc()
    return reject


# --------------------------------------------------------------------------- reading


class ReadPagesFn(beam.DoFn):
    """One dump work item -> documents (sentences) and rejects; plus one READ count per item."""

    def process(self, item) -> Iterator[Any]:
        from bert_core.corpus.dumps import read_pages
        from bert_core.corpus.wikitext import CleanStats, is_redirect, wikitext_to_paragraphs

        read = 0
        for kind, record in read_pages(item):
            read += 1
            if kind == "reject":
                yield TaggedOutput(REJECTS, record)
                continue
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
                yield D.make_document(doc_id, D.WIKIPEDIA, title, sentences, record["origin"])
        yield TaggedOutput(READ, (D.WIKIPEDIA, read))


class ReadBookFn(beam.DoFn):
    """One book file -> one document, or a reject naming why it is not a book."""

    def process(self, element: tuple[str, str]) -> Iterator[Any]:
        from bert_core.corpus.books import BookError, book_paragraphs

        uri, doc_id = element
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


class ReadRecordsFn(beam.DoFn):
    """One text work item (a JSON lines file or a Parquet row group) -> documents and rejects,
    plus its READ count."""

    def __init__(self, cfg: CorpusConfig):
        self.cfg = cfg

    def process(self, item) -> Iterator[Any]:
        from bert_core.corpus.records import read_records

        read = 0
        for kind, record in read_records(item, self.cfg):
            read += 1
            yield TaggedOutput(REJECTS, record) if kind == "reject" else record
        yield TaggedOutput(READ, (D.TEXT, read))


class ReadWikipediaDump(beam.PTransform):
    """Dump files -> {"docs", "rejects", "read"} (work items reshuffled across workers)."""

    def __init__(self, files: list[str]):
        super().__init__()
        self.files = files

    def expand(self, pbegin):
        from bert_core.corpus.dumps import plan_reads

        # a single-stream .bz2 is split by bz2 block too, so one big file uses every worker
        items = [item for f in self.files for item in plan_reads(f)]
        out = (
            pbegin
            # Create would reshuffle too (more than one element): once is enough, and the shuffle
            # is what spreads the items over the workers (the local runner deals them out)
            | "ListWorkItems" >> beam.Create(items, reshuffle=False)
            | "SpreadWorkItems" >> beam.Reshuffle()
            | "ParsePages" >> beam.ParDo(ReadPagesFn()).with_outputs(REJECTS, READ, main="docs")
        )
        return {"docs": out.docs, "rejects": out[REJECTS], "read": out[READ]}


class ReadBooks(beam.PTransform):
    """Book files -> {"docs", "rejects", "read"}."""

    def __init__(self, files: list[str]):
        super().__init__()
        self.files = files

    def expand(self, pbegin):
        ids = book_ids(self.files)
        out = (
            pbegin
            | "ListBooks" >> beam.Create(sorted(ids.items()), reshuffle=False)
            | "SpreadBooks" >> beam.Reshuffle()
            | "ReadBooks" >> beam.ParDo(ReadBookFn()).with_outputs(REJECTS, READ, main="docs")
        )
        return {"docs": out.docs, "rejects": out[REJECTS], "read": out[READ]}


class ReadTextRecords(beam.PTransform):
    """Text record files -> {"docs", "rejects", "read"}: one work item per Parquet row group
    and per JSON lines file, reshuffled across workers."""

    def __init__(self, files: list[str], cfg: CorpusConfig):
        super().__init__()
        self.files, self.cfg = files, cfg

    def expand(self, pbegin):
        from bert_core.corpus.records import plan_records

        out = (
            pbegin
            | "ListRecordItems" >> beam.Create(plan_records(self.files, self.cfg), reshuffle=False)
            | "SpreadRecordItems" >> beam.Reshuffle()
            | "ReadRecords" >> beam.ParDo(ReadRecordsFn(self.cfg)).with_outputs(REJECTS, READ, main="docs")
        )
        return {"docs": out.docs, "rejects": out[REJECTS], "read": out[READ]}


# --------------------------------------------------------------------------- cleaning


class FilterFn(beam.DoFn):
    def __init__(self, cfg: CorpusConfig):
        self.cfg = cfg

    def process(self, doc: D.Document) -> Iterator[Any]:
        result = D.apply_filters(doc, self.cfg)
        yield TaggedOutput(REJECTS, result) if D.is_reject(result) else result


class FingerprintFn(beam.DoFn):
    """Per document: the exact-duplicate key and, for near duplicates, its LSH band entries.

    Only these small records are grouped to find duplicates; the documents themselves go to
    their output shard once (through spill files), where the verdicts are applied (side inputs).
    """

    def __init__(self, cfg: CorpusConfig):
        self.cfg = cfg

    def setup(self) -> None:
        from bert_core.corpus.dedup import MinHasher

        self.hasher = MinHasher(self.cfg.minhash_num_perm, self.cfg.near_dup_threshold)

    def process(self, doc: D.Document) -> Iterator[Any]:
        from bert_core.corpus.dedup import normalize, normalized_hash

        text = normalize(" ".join(doc["sentences"]))
        if self.cfg.dedup_exact:
            yield TaggedOutput(EXACT, (normalized_hash(text), (doc["doc_id"], doc["origin"])))
        if self.cfg.dedup_near and doc["source"] in NEAR_DEDUP_SOURCES:
            # 32-bit values: half the bytes to shuffle, same estimate
            sig = self.hasher.signature(text, normalized=True).astype("uint32")
            for key in self.hasher.band_keys(sig):
                yield TaggedOutput(BANDS, (key, (doc["doc_id"], sig)))


def _bucket_pairs(element, threshold: float) -> Iterator[tuple[str, tuple[str, float]]]:
    from bert_core.corpus.dedup import near_duplicates_in_bucket

    _, members = element
    members = list(members)
    if len(members) > 1:
        for doc_id, dup_of, sim in near_duplicates_in_bucket(members, threshold):
            yield doc_id, (dup_of, sim)


class CleanDocuments(beam.PTransform):
    """Documents -> {"docs", "rejects", "duplicates", "near_duplicates"}.

    Filters run here (too short, too few sentences); duplicates are *found* here but applied by
    :class:`WriteDocuments`, so the documents travel once: "duplicates" maps
    (doc_id, origin) -> the (doc_id, origin) with the same text that is kept, and
    "near_duplicates" maps doc_id -> (smallest similar doc_id, estimated Jaccard).
    """

    def __init__(self, cfg: CorpusConfig):
        super().__init__()
        self.cfg = cfg

    def expand(self, docs):
        cfg = self.cfg
        out = docs | "ApplyFilters" >> beam.ParDo(FilterFn(cfg)).with_outputs(REJECTS, main="docs")
        prints = out.docs | "Fingerprint" >> beam.ParDo(FingerprintFn(cfg)).with_outputs(EXACT, BANDS)
        duplicates = (
            prints[EXACT]
            | "GroupByContent" >> beam.GroupByKey()
            | "FindExactDuplicates" >> beam.FlatMap(exact_losers)
        )
        near = (
            prints[BANDS]
            | "GroupByBand" >> beam.GroupByKey()
            | "FindNearDuplicates" >> beam.FlatMap(_bucket_pairs, cfg.near_dup_threshold)
            # a document similar to several others names the smallest id
            | "SmallestMatch" >> beam.CombinePerKey(min)
        )
        return {"docs": out.docs, "rejects": out[REJECTS], "duplicates": duplicates,
                "near_duplicates": near}


# --------------------------------------------------------------------------- writing


class SpillDocumentsFn(beam.DoFn):
    """Documents -> (shard, spill file): documents are written by shard to temporary files and
    only the file names are shuffled. The local runner keeps every shuffled element in memory,
    so shuffling the documents themselves would make its memory grow with the corpus."""

    def __init__(self, output: str, num_shards: int):
        self.output, self.num_shards = output, num_shards

    def start_bundle(self) -> None:
        self.buffers: dict[int, list[D.Document]] = {}
        self.chars = 0

    def process(self, doc: D.Document) -> Iterator[tuple[int, str]]:
        self.buffers.setdefault(D.stable_shard(doc["doc_id"], self.num_shards), []).append(doc)
        self.chars += sum(len(s) for s in doc["sentences"])
        if self.chars >= SPILL_CHARS:
            yield from self._flush()

    def finish_bundle(self) -> Iterator[Any]:
        from apache_beam.transforms.window import GlobalWindows

        for shard, uri in self._flush():
            yield GlobalWindows.windowed_value((shard, uri))

    def _flush(self) -> Iterator[tuple[int, str]]:
        for shard, docs in sorted(self.buffers.items()):
            # a unique name: a retried bundle's files are simply never referenced
            uri = storage.join(self.output, SPILL_DIR, f"shard-{shard:05d}-{uuid.uuid4().hex}.pkl")
            with storage.open_file(uri, "wb") as f:
                pickle.dump(docs, f, protocol=pickle.HIGHEST_PROTOCOL)
            yield shard, uri
        self.buffers, self.chars = {}, 0


def _load_spills(uris: Iterable[str]) -> Iterator[D.Document]:
    for uri in uris:
        with storage.open_file(uri, "rb") as f:
            yield from pickle.load(f)  # our own temporary files, written by SpillDocumentsFn


def _write_doc_shard(element, output: str, num_shards: int, text_format: str,
                     duplicates: dict | None = None, near: dict | None = None) -> Iterator[Any]:
    """Write one shard (rows sorted by doc_id) from its spill files, applying the verdicts."""
    index, spills = element
    docs = []
    for record in duplicate_verdicts(_load_spills(sorted(spills)), duplicates or {}, near or {}):
        if D.is_reject(record):
            yield TaggedOutput(REJECTS, record)
        else:
            docs.append(record)
    uri = storage.join(output, D.shard_name("docs", index, num_shards, "parquet"))
    D.write_documents(uri, docs)
    if text_format == "google":
        D.write_google_text(storage.join(output, D.shard_name("text", index, num_shards, "txt")), docs)
    for doc in docs:
        yield TaggedOutput("kept", (doc["source"], D.length_stats(doc)))
    yield ("docs", index)


def _write_reject_shard(element, output: str, num_shards: int) -> tuple[str, int]:
    index, group = element
    D.write_rejects(storage.join(output, D.shard_name("rejects", index, num_shards, "jsonl")), list(group))
    return ("rejects", index)


class WriteDocuments(beam.PTransform):
    """Docs + rejects (+ duplicate verdicts) -> shards under ``output``;
    returns {"written", "kept", "rejects"}. Documents reach their shard through spill files
    (:class:`SpillDocumentsFn`); rejects are small and shuffled directly."""

    def __init__(self, output: str, num_shards: int, text_format: str):
        super().__init__()
        self.output, self.num_shards, self.text_format = output, num_shards, text_format

    def expand(self, pcolls):
        n = self.num_shards
        written = (
            pcolls["docs"]
            | "SpillByShard" >> beam.ParDo(SpillDocumentsFn(self.output, n))
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteShards" >> beam.FlatMap(
                _write_doc_shard, self.output, n, self.text_format,
                duplicates=AsDict(pcolls["duplicates"]), near=AsDict(pcolls["near_duplicates"]))
            .with_outputs(REJECTS, "kept", main="written")
        )
        rejects = (
            (pcolls["rejects"], written[REJECTS])
            | "AllRejects" >> beam.Flatten()
            | "CountRejects" >> beam.Map(_count_reject)
        )
        reject_shards = (
            rejects
            | "KeyRejectsByShard" >> beam.Map(lambda r, n: (D.stable_shard(r["id"], n), r), n=n)
            | "GroupRejects" >> beam.GroupByKey()
            | "WriteRejects" >> beam.Map(_write_reject_shard, self.output, n)
        )
        done = (written.written, reject_shards) | "ShardsDone" >> beam.Flatten()
        return {"written": done, "kept": written["kept"], "rejects": rejects}


class SummaryFn(beam.CombineFn):
    """Counts per source and reason, and length histograms of kept documents."""

    def create_accumulator(self) -> dict[str, Any]:
        return {"read": {}, "kept": {}, "rejected": {}, "sentences": {}, "chars": {}, "totals": {}}

    def add_input(self, acc, element):
        kind, value = element
        if kind == "read":
            source, n = value
            acc["read"][source] = acc["read"].get(source, 0) + n
        elif kind == "kept":
            source, stats = value
            acc["kept"][source] = acc["kept"].get(source, 0) + 1
            for name, edges in (("sentences", D.SENTENCE_BINS), ("chars", D.CHAR_BINS)):
                label = D.bin_of(stats[name], edges)
                acc[name][label] = acc[name].get(label, 0) + 1
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
            written: list[tuple[str, int]], summary: dict[str, Any]) -> dict[str, Any]:
    """Empty shards for shard indices that got no rows, then the manifest (written last)."""
    done = set(written)
    for index in range(num_shards):
        if ("docs", index) not in done:
            list(_write_doc_shard((index, []), output, num_shards, cfg.text_format))
        if ("rejects", index) not in done:
            _write_reject_shard((index, []), output, num_shards)
    storage.remove(storage.join(output, SPILL_DIR))
    return D.write_corpus_manifest(output, cfg, inputs, num_shards, summary)


# --------------------------------------------------------------------------- entry points


def build_pipeline(p, cfg: CorpusConfig, output: str, inputs: dict[str, list[str]], num_shards: int) -> None:
    """The job's graph: read -> clean -> write shards -> manifest (after every shard)."""
    wiki_files, book_files, text_files = inputs["wikipedia"], inputs["books"], inputs["text"]
    parts = []
    if wiki_files:
        parts.append(p | "ReadWikipediaDump" >> ReadWikipediaDump(wiki_files))
    if book_files:
        parts.append(p | "ReadBooksFiles" >> ReadBooks(book_files))
    if text_files:
        parts.append(p | "ReadTextRecords" >> ReadTextRecords(text_files, cfg))
    docs = [x["docs"] for x in parts] | "AllDocuments" >> beam.Flatten()
    read = [x["read"] for x in parts] | "AllReadCounts" >> beam.Flatten()
    cleaned = docs | "CleanDocuments" >> CleanDocuments(cfg)
    early_rejects = [x["rejects"] for x in parts] + [cleaned["rejects"]]
    rejects = early_rejects | "ReadAndCleanRejects" >> beam.Flatten()
    out = {**cleaned, "rejects": rejects} | "WriteDocuments" >> WriteDocuments(
        output, num_shards, cfg.text_format)
    summary = (
        (
            read | "TagRead" >> beam.Map(lambda x: ("read", x)),
            out["kept"] | "TagKept" >> beam.Map(lambda x: ("kept", x)),
            out["rejects"] | "TagRejected" >> beam.Map(lambda x: ("rejected", x)),
        )
        | "AllEvents" >> beam.Flatten()
        | "Summarize" >> beam.CombineGlobally(SummaryFn())
    )
    _ = (
        p
        | "Once" >> beam.Create([None])
        | "WriteManifest" >> beam.Map(
            _finish, output, cfg, inputs, num_shards,
            written=AsList(out["written"]), summary=AsSingleton(summary))
    )


def clean(cfg: CorpusConfig, output: str, workers: int = 1, runner: str = LOCAL_RUNNER,
          beam_args: Iterable[str] = (), counters: dict[str, int] | None = None) -> dict[str, Any]:
    """Run the job; returns the manifest. Missing inputs raise :class:`InputError` at once.

    ``runner`` is a Beam runner name (``beam_jobs.job``: the local FnApiRunner by default, or
    DataflowRunner, FlinkRunner, ... with ``beam_args``). ``counters``, if given, receives the
    job's Beam counters (``rejected_<reason>``, ``slow_path_paragraphs``).
    """
    wiki_files = expand_inputs(cfg.wikipedia, "wikipedia")
    book_files = expand_inputs(cfg.books, "books")
    text_files = expand_inputs(cfg.text, "text")
    if not wiki_files and not book_files and not text_files:
        raise InputError("no inputs: give --wikipedia GLOB, --books GLOB and/or --text GLOB "
                         "(corpus.wikipedia / corpus.books / corpus.text)")
    output = storage.to_uri(output)
    storage.check_writable(output)
    total_bytes = sum(storage.size(f) for f in wiki_files + book_files + text_files)
    # Shard count from the input size (never from workers), so output bytes do not depend on them.
    num_shards = cfg.num_shards or D.auto_num_shards(total_bytes // 2)
    storage.remove(storage.join(output, storage.MANIFEST))  # an old manifest must not bless new shards
    storage.remove(storage.join(output, SPILL_DIR))
    inputs = {"wikipedia": wiki_files, "books": book_files, "text": text_files}

    try:
        result = run_pipeline(lambda p: build_pipeline(p, cfg, output, inputs, num_shards), workers, runner, beam_args)
    finally:
        storage.remove(storage.join(output, SPILL_DIR))  # a failed run leaves no temporary files
    if counters is not None:
        for name, n in job_counters(result, NAMESPACE).items():
            counters[name] = counters.get(name, 0) + n
    return storage.read_manifest(output)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line entry: the shared job options plus the inputs; unknown ones go to Beam.
    ``--wikipedia``/``--books``/``--text`` given replace all of the config's globs (the text
    fields come from ``--set corpus.text_field=...``)."""
    parser = job_parser(__doc__.split("\n", 1)[0])
    parser.add_argument("--wikipedia", action="append", default=[], help="Dump glob (repeatable).")
    parser.add_argument("--books", action="append", default=[], help="Book glob (repeatable).")
    parser.add_argument("--text", action="append", default=[], help="JSON lines / Parquet glob (repeatable).")
    parser.add_argument("--output", required=True, help="Output folder URI.")
    args, cfg, beam_args = parse_job_args(parser, argv)
    corpus = cfg.corpus
    if args.wikipedia or args.books or args.text:
        corpus = CorpusConfig.model_validate({**corpus.model_dump(), "wikipedia": args.wikipedia,
                                              "books": args.books, "text": args.text})
    return clean(corpus, args.output, cfg.workers, cfg.beam_runner, beam_args)


if __name__ == "__main__":
    import logging

    logging.getLogger().setLevel(logging.WARNING)
    manifest = run()
    print(json.dumps(manifest["counts"], indent=2))
