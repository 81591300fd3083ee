"""Beam job: documents -> WordPiece vocab (``vocab.txt``, ``tokenizer.json``, ``_MANIFEST.json``).

    bertpipe vocab --corpus ./bertpipe-data/corpus --output ./bertpipe-data/vocab [--vocab-size N] [--cased]

``vocab.txt`` gives id = line number; ``tokenizer.json`` loads in transformers. The bytes of both
depend only on the documents and the config, never on the runner or the number of workers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from beam_jobs.job import (
    LOCAL_RUNNER,
    NOT_REPORTED,
    check_produced,
    check_shared_storage,
    counters,
    forward_to_cli,
    item_key,
    progress_folder,
    resolve_runner,
    run_pipeline,
)
from bert_core import lease, storage
from bert_core.config import ConfigError, VocabConfig
from bert_core.progress import OnProgress, Phase, Tally, Watch, counted
from bert_core.vocab.tokenization import Tokenizer, VocabError, check_vocab_file
from bert_core.vocab.wordcount import iter_counts, min_count_for, read_count_of_counts

# How the job works:
#
# Steps: ``ListWorkItems`` (the corpus shards its manifest lists, a shard shared by several
# items when there are fewer shards than workers), ``CountWords`` (BERT's basic tokenization per
# document; each worker sums counts in memory up to a bound and spills them to partial
# ``word<TAB>count`` files by word bucket; per bucket the partial files are summed and written
# sorted by count descending, then word, beside its count of counts: how many words have each
# count). Only file names travel between steps, so no step, and not the local runner's process,
# holds the corpus or its distinct words. The driver then streams the sorted bucket files in one
# merged order and trains WordPiece with HF ``tokenizers``, feeding each word repeated by its
# count (why, what it costs and why it is reproducible: ``bert_core/vocab/training.py``).
#
# The trainer holds every distinct word it is given, so it is given at most ``vocab.max_words``:
# the summed count of counts (a few thousand numbers) gives the smallest count ``t`` that at most
# ``max_words`` words reach, and only the words counted ``t`` times or more are streamed (they
# come first in the merged order). A corpus of at most ``max_words`` distinct words is trained on
# all of them, so its vocab is the same as without the bound; otherwise the manifest says how many
# distinct words (and occurrences) were left out and from which count on. Finally the vocab is
# measured on the stream of all the counts (UNK rate, pieces per word, top tokens) and the
# manifest is written last.
#
# ``--vocab-file`` uses an existing ``vocab.txt`` (e.g. bert-base-uncased's, shipped with the
# sample MiniLM model) instead: it is validated (one token per line, no duplicates, ``[PAD]`` = 0,
# ``[UNK]``/``[CLS]``/``[SEP]``/``[MASK]`` present, casing consistent with ``lowercase``) and copied;
# with a corpus, its coverage is measured too.
#
# Progress: each counting work item writes the documents it has counted to the output's
# ``_progress/count/`` (``bert_core/progress.py``), summed by the driver against the corpus's
# documents; the driver then counts the words it streams to the trainer (two passes: the
# alphabet, then training) and to the measurement.

NAMESPACE = "build_vocab"
COUNTERS = ("documents", "sentences", "words", "documents_without_sentences", "null_sentences")
SCRATCH = "_word_counts"
SPILL = "_partial"  # partial counts inside the scratch folder
COUNT_PHASE = "count"  # the progress phase of CountPartWords: documents counted
MIN_BUCKETS = 16


# --------------------------------------------------------------------------- pipeline


MAX_BUFFERED_WORDS = 1 << 19  # distinct words a worker counts in memory before it spills them


def plan_parts(shards: list[str], workers: int) -> list[tuple[str, int, int]]:
    """Work items ``(shard, part, parts)``: part k of a shard is its row groups (or, in a shard
    of fewer row groups than parts, its row batches) k, k + parts, ...

    A corpus may have fewer shards than workers (its shards are large); a shard is then shared
    by ``parts`` items, each counting its own share. Counts, and so the vocab, do not depend on
    the split."""
    parts = max(1, -(-workers // max(len(shards), 1)))
    return [(uri, part, parts) for uri in shards for part in range(parts)]


class CountPartWords(beam.DoFn):
    """Work items -> ``(bucket, counts file)``: BERT's basic tokenization per document, counts
    summed over the bundle and spilled to ``word<TAB>count`` files, one per word bucket. Only
    the file names are shuffled: the local runner holds every shuffled element in memory."""

    def __init__(self, lowercase: bool, strip_accents: bool, scratch: str, buckets: int,
                 progress: str | None = None):
        self.lowercase, self.strip_accents = lowercase, strip_accents
        self.scratch, self.buckets, self.progress = scratch, buckets, progress
        self.documents = Metrics.counter(NAMESPACE, "documents")
        self.sentences = Metrics.counter(NAMESPACE, "sentences")
        self.words = Metrics.counter(NAMESPACE, "words")
        # A row without sentences is counted, never dropped silently; it has no words to add.
        self.empty = Metrics.counter(NAMESPACE, "documents_without_sentences")
        self.null_sentences = Metrics.counter(NAMESPACE, "null_sentences")

    def start_bundle(self) -> None:
        self.counts: Counter[str] = Counter()

    def process(self, item: tuple[str, int, int]) -> Iterator[tuple[int, str]]:
        from bert_core.corpus.documents import read_sentences
        from bert_core.vocab.wordcount import count_words

        uri, part, parts = item
        tally = Tally(self.progress, COUNT_PHASE, item_key(item))
        for _, sentences in read_sentences(uri, part=part, parts=parts):
            self.documents.inc()
            tally.add(1)
            nulls = sum(s is None for s in sentences or [])
            if nulls:  # a null in list<string> is a corpus bug: counted so it shows, words unaffected
                self.null_sentences.inc(nulls)
            sentences = [s for s in (sentences or []) if s]
            if not sentences:
                self.empty.inc()
                continue
            self.sentences.inc(len(sentences))
            counts = count_words(sentences, self.lowercase, self.strip_accents)
            self.words.inc(sum(counts.values()))
            self.counts.update(counts)
            if len(self.counts) >= MAX_BUFFERED_WORDS:
                yield from self._spill()
        tally.close()

    def finish_bundle(self) -> Iterator[Any]:
        from apache_beam.transforms.window import GlobalWindows

        for bucket, uri in self._spill():
            yield GlobalWindows.windowed_value((bucket, uri))

    def _spill(self) -> Iterator[tuple[int, str]]:
        from bert_core.vocab.wordcount import word_bucket, write_counts

        by_bucket: dict[int, list[tuple[str, int]]] = {}
        for word, count in self.counts.items():
            by_bucket.setdefault(word_bucket(word, self.buckets), []).append((word, count))
        for bucket, pairs in sorted(by_bucket.items()):
            # a unique name: a retried bundle's files are simply never referenced
            uri = storage.join(self.scratch, SPILL, storage.unique_name(f"{bucket:05d}", "tsv"))
            write_counts(uri, pairs)
            yield bucket, uri
        self.counts = Counter()


def _merge_bucket(element: tuple[int, Iterable[str]], scratch: str) -> int:
    """One bucket's partial counts -> ``counts-BBBBB.tsv``, sorted in training order, and
    ``hist-BBBBB.tsv``, its count of counts."""
    from bert_core.vocab.wordcount import (
        count_key,
        merge_count_files,
        write_count_of_counts,
        write_counts,
    )

    bucket, uris = element
    counts = merge_count_files(sorted(uris))
    write_counts(storage.join(scratch, f"counts-{bucket:05d}.tsv"), sorted(counts.items(), key=count_key))
    write_count_of_counts(storage.join(scratch, f"hist-{bucket:05d}.tsv"), counts.values())
    return bucket


class CountWords(beam.PTransform):
    """Work items ``(shard, part, parts)`` -> ``counts-BBBBB.tsv`` files in ``scratch``, one per
    word bucket, each sorted by count descending then word (what :func:`iter_counts` merges),
    and their counts of counts ``hist-BBBBB.tsv``; the output PCollection holds the bucket
    numbers written. ``progress``: the folder the items write their progress to (none if None)."""

    def __init__(self, lowercase: bool, strip_accents: bool, scratch: str, buckets: int,
                 progress: str | None = None):
        super().__init__()
        self.lowercase, self.strip_accents = lowercase, strip_accents
        self.scratch, self.buckets, self.progress = scratch, buckets, progress

    def expand(self, items):
        return (
            items
            # spread the work items (never the documents) over the workers
            | "SpreadWorkItems" >> beam.Reshuffle()
            | "CountPartWords" >> beam.ParDo(
                CountPartWords(self.lowercase, self.strip_accents, self.scratch, self.buckets, self.progress))
            | "GroupByBucket" >> beam.GroupByKey()
            | "SumPerWord" >> beam.Map(_merge_bucket, self.scratch)
        )


def count_corpus_words(corpus: str, scratch: str, cfg: VocabConfig, workers: int, runner: str,
                       beam_args: Iterable[str], on_progress: OnProgress | None = None,
                       documents: int | None = None) -> dict[str, int | str]:
    """Run the counting pipeline; sorted ``counts-BBBBB.tsv`` files land in ``scratch``.
    Returns the counters (each :data:`NOT_REPORTED` on a runner without metrics).
    ``on_progress`` is told the documents counted (of ``documents``) while it runs."""
    shards = storage.shard_uris(corpus)
    storage.remove(scratch)
    # More buckets for a bigger corpus, so one bucket's words stay a bounded table.
    buckets = max(MIN_BUCKETS, len(shards))
    folder = progress_folder(scratch)
    watch = Watch(folder, "vocab", {COUNT_PHASE: Phase("counting words", documents, "documents")}, on_progress)

    def build(p: beam.Pipeline) -> None:
        _ = (
            p
            | "ListWorkItems" >> beam.Create(plan_parts(shards, workers), reshuffle=False)
            | "CountWords" >> CountWords(cfg.lowercase, cfg.do_strip_accents, scratch, buckets,
                                         folder if on_progress else None)
        )

    try:
        found = counters(run_pipeline(build, workers, runner, beam_args, watch if on_progress else None), NAMESPACE)
    finally:
        watch.clear()
    storage.remove(storage.join(scratch, SPILL))
    return {name: NOT_REPORTED if found is None else found.get(name, 0) for name in COUNTERS}


# --------------------------------------------------------------------------- entry point


def left_out(count_of_counts: dict[int, int], min_count: int) -> dict[str, int]:
    """The manifest's account of the ``max_words`` bound: distinct words given to the trainer and
    left out, occurrences left out, and the smallest count given."""
    below = {count: words for count, words in count_of_counts.items() if count < min_count}
    return {"distinct_words_trained": sum(count_of_counts.values()) - sum(below.values()),
            "distinct_words_left_out": sum(below.values()),
            "words_left_out": sum(count * words for count, words in below.items()),
            "min_word_count": min_count}


def run(
    cfg: VocabConfig,
    corpus: str | None,
    output: str,
    workers: int = 1,
    runner: str = LOCAL_RUNNER,
    beam_args: Iterable[str] = (),
    shared_storage: bool = False,
    on_progress: OnProgress | None = None,
) -> dict[str, Any]:
    """Train (or validate, with ``cfg.vocab_file``) a vocab; returns the written manifest.
    ``runner``, ``beam_args`` and ``shared_storage``: as for :func:`beam_jobs.clean_corpus.run`;
    ``on_progress`` is told the documents counted, then the words given to the trainer and to
    the measurement.

    The manifest (stage "vocab"): ``config`` = VocabConfig with ``strip_accents`` resolved;
    ``counts``: vocab size, documents, sentences, words, and :func:`left_out`'s
    ``distinct_words_trained``, ``distinct_words_left_out``, ``words_left_out`` (occurrences) and
    ``min_word_count`` (``t``); ``stats``: see :func:`bert_core.vocab.training.vocab_stats`.
    """
    runner, beam_args = resolve_runner(runner, beam_args)
    check_shared_storage("vocab", runner, shared_storage, [("output", output), ("corpus", corpus)])
    output = storage.to_uri(output)
    corpus = storage.to_uri(corpus) if corpus else None
    finished = lease.refuse_finished(output, "vocab", _settings(cfg), [corpus] if corpus else [])  # before any work
    if finished is not None:
        return finished
    if corpus is None and cfg.vocab_file is None:
        raise ConfigError("a vocab is trained from a corpus: give --corpus (or --vocab-file to use an existing vocab)")
    given = check_vocab_file(cfg.vocab_file, cfg) if cfg.vocab_file else None
    corpus_manifest = storage.read_manifest(corpus) if corpus else None  # refuses unfinished corpora
    if corpus_manifest:
        storage.check_shards(corpus, corpus_manifest)
    storage.check_writable(output)
    with lease.hold(output, "vocab", None) as held:
        if held.finished:
            return storage.read_manifest(output)
        lease.remove_held(output, held.attempt, storage.join(output, storage.MANIFEST))  # an old manifest must not bless new files
        return _train(cfg, corpus, output, corpus_manifest, given, workers, runner, beam_args, held, on_progress)


def _settings(cfg: VocabConfig) -> dict[str, Any]:
    """The settings a vocab's manifest records: its config, with accent stripping resolved."""
    return cfg.model_dump(mode="json") | {"strip_accents": cfg.do_strip_accents}


def _train(cfg: VocabConfig, corpus: str | None, output: str, corpus_manifest: dict[str, Any] | None,
           given: Tokenizer | None, workers: int, runner: str, beam_args: Iterable[str],
           held: lease.Held, on_progress: OnProgress | None = None) -> dict[str, Any]:
    """The body of :func:`run`, under the output's lease: count, train, save, then the manifest."""
    from bert_core.vocab.training import train_wordpiece, vocab_stats

    counters: dict[str, int] = {}
    staged = lease.staging(output, held.attempt)  # the attempt's own names until it publishes
    scratch = storage.join(staged, SCRATCH)
    try:
        if corpus:
            documents = (corpus_manifest or {}).get("counts", {}).get("documents")
            counters = count_corpus_words(corpus, scratch, cfg, workers, runner, beam_args, on_progress, documents)
        has_words = bool(corpus) and next(iter_counts(scratch), None) is not None
        if corpus_manifest and not has_words:
            check_produced("vocab", 0, "word counts", corpus_manifest["counts"].get("documents", 0),
                           f"documents of corpus {corpus}")
        if given is not None:
            tokenizer = given
        else:
            if not has_words:
                raise VocabError(f"corpus {corpus} has no words to train a vocab on; check the corpus stage's counts")
            count_of_counts = read_count_of_counts(scratch)
            min_count = min_count_for(count_of_counts, cfg.max_words)
            if min_count > max(count_of_counts):
                raise ConfigError(f"vocab.max_words={cfg.max_words} keeps no word of corpus {corpus}: the "
                                 f"{count_of_counts[max(count_of_counts)]} most frequent words tie; raise it")
            counters |= left_out(count_of_counts, min_count)
            # the sorted counts stream from the scratch files at each pass, never held here; the
            # trainer reads them twice (its alphabet, then the training), counted as one phase
            trained, passes = counters["distinct_words_trained"], iter(range(2))

            def words() -> Iterator[tuple[str, int]]:
                start = next(passes, 1) * trained
                return counted(iter_counts(scratch, min_count), on_progress, "vocab", "training WordPiece",
                               2 * trained, "words", start)

            vocab = train_wordpiece(words, cfg.vocab_size, cfg.min_frequency, cfg.limit_alphabet, cfg.num_unused)
            tokenizer = Tokenizer(vocab, cfg.lowercase, cfg.do_strip_accents, cfg.max_input_chars_per_word)
        tokenizer.save(staged)
        if has_words:
            distinct = sum(read_count_of_counts(scratch).values())
            stats = vocab_stats(tokenizer, counted(iter_counts(scratch), on_progress, "vocab", "measuring the vocab",
                                                   distinct, "words"))
        else:
            stats = {}
    finally:
        storage.remove(scratch)
    lease.publish(output, held.attempt)  # lost: one line, nothing moved or committed
    files = [storage.shard_entry(storage.join(output, name)) for name in ("vocab.txt", "tokenizer.json")]
    counts = {"vocab_size": tokenizer.vocab_size, "vocab_size_requested": None if given else cfg.vocab_size,
              "trained": given is None, **counters}
    held.check()
    return storage.write_manifest(output, stage="vocab", config=_settings(cfg),
                                  inputs=[corpus_manifest] if corpus_manifest else [],
                                  shards=files, counts=counts, stats=stats,
                                  fence=lease.fence(output, held.attempt))


if __name__ == "__main__":
    forward_to_cli("vocab")
