"""Beam job: documents -> WordPiece vocab (``vocab.txt``, ``tokenizer.json``, ``_MANIFEST.json``).

    bertpipe vocab --corpus ./bertpipe-data/corpus --output ./bertpipe-data/vocab
    python -m beam_jobs.build_vocab --corpus CORPUS_URI --output VOCAB_URI [--preset demo] \\
        [--set vocab.vocab_size=30522] [--vocab-size N] [--cased] [--vocab-file VOCAB_TXT] [-- beam args]

Steps: ``ReadSentences`` (the corpus shards its manifest lists, one row batch at a time),
``CountWords`` (BERT's basic tokenization per document, ``CombinePerKey(sum)`` across workers),
``WriteCounts`` (``word<TAB>count`` text shards in a scratch folder). The driver then reads the
counts, sorts them (count descending, then word) and trains WordPiece with HF ``tokenizers``,
feeding each word repeated by its count (why, what it costs and why it is reproducible:
``bert_core/vocab/training.py``). Memory in the driver is the distinct-word table, never the
corpus. Finally the vocab is measured on the same counts (UNK rate, pieces per word, top tokens)
and the manifest is written last.

``--vocab-file`` uses an existing ``vocab.txt`` (e.g. bert-base-uncased's, shipped with the
sample MiniLM model) instead: it is validated (one token per line, no duplicates, ``[PAD]`` = 0,
``[UNK]``/``[CLS]``/``[SEP]``/``[MASK]`` present, casing consistent with ``lowercase``) and copied;
with a corpus, its coverage is measured too.

Output: ``vocab.txt`` (id = line number), ``tokenizer.json`` (transformers-loadable),
``_MANIFEST.json`` (stage "vocab"; ``config`` = VocabConfig with ``strip_accents`` resolved;
``counts``: vocab size, documents, sentences, words; ``stats``: see
:func:`bert_core.vocab.training.vocab_stats`). The bytes of ``vocab.txt`` and ``tokenizer.json``
depend only on the documents and the config, never on the runner or the number of workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from beam_jobs.job import (
    LOCAL_RUNNER,
    ReadSentences,
    counters,
    job_parser,
    parse_job_args,
    run_pipeline,
)
from bert_core import storage
from bert_core.config import VocabConfig
from bert_core.vocab.tokenization import Tokenizer, check_vocab_file
from bert_core.vocab.wordcount import read_counts

NAMESPACE = "build_vocab"
COUNTERS = ("documents", "sentences", "words", "documents_without_sentences", "null_sentences")
SCRATCH = "_word_counts"


# --------------------------------------------------------------------------- pipeline


class CountDocumentWords(beam.DoFn):
    """``(doc_id, sentences)`` -> ``(word, count)`` for each distinct word of the document."""

    def __init__(self, lowercase: bool, strip_accents: bool):
        self.lowercase, self.strip_accents = lowercase, strip_accents
        self.documents = Metrics.counter(NAMESPACE, "documents")
        self.sentences = Metrics.counter(NAMESPACE, "sentences")
        self.words = Metrics.counter(NAMESPACE, "words")
        # A row without sentences is counted, never dropped silently; it has no words to add.
        self.empty = Metrics.counter(NAMESPACE, "documents_without_sentences")
        self.null_sentences = Metrics.counter(NAMESPACE, "null_sentences")

    def process(self, element: tuple[str, list[str] | None]) -> Iterator[tuple[str, int]]:
        from bert_core.vocab.wordcount import count_words

        _, sentences = element
        self.documents.inc()
        nulls = sum(s is None for s in sentences or [])
        if nulls:  # a null in list<string> is a corpus bug: counted so it shows, words unaffected
            self.null_sentences.inc(nulls)
        sentences = [s for s in (sentences or []) if s]
        if not sentences:
            self.empty.inc()
            return
        self.sentences.inc(len(sentences))
        counts = count_words(sentences, self.lowercase, self.strip_accents)
        self.words.inc(sum(counts.values()))
        yield from counts.items()


class CountWords(beam.PTransform):
    """``(doc_id, sentences)`` -> ``(word, count)`` over the whole corpus."""

    def __init__(self, lowercase: bool, strip_accents: bool):
        super().__init__()
        self.lowercase, self.strip_accents = lowercase, strip_accents

    def expand(self, docs):
        return (
            docs
            # A corpus may have fewer shards than workers; spread the documents out.
            | "SpreadDocuments" >> beam.Reshuffle()
            | "CountDocumentWords" >> beam.ParDo(CountDocumentWords(self.lowercase, self.strip_accents))
            | "SumPerWord" >> beam.CombinePerKey(sum)
        )


class WriteCounts(beam.PTransform):
    """``(word, count)`` -> ``word<TAB>count`` text shards ``<prefix>-SSSSS-of-NNNNN.tsv``."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def expand(self, pairs):
        return (
            pairs
            | "FormatCounts" >> beam.MapTuple(lambda word, count: f"{word}\t{count}")
            | "WriteText" >> beam.io.WriteToText(self.prefix, file_name_suffix=".tsv")
        )


def count_corpus_words(corpus: str, scratch: str, cfg: VocabConfig, workers: int, runner: str,
                       beam_args: Iterable[str]) -> dict[str, int]:
    """Run the counting pipeline; ``word<TAB>count`` files land in ``scratch``. Returns counters."""
    shards = storage.shard_uris(corpus)
    storage.remove(scratch)

    def build(p: beam.Pipeline) -> None:
        _ = (
            p
            | "ReadSentences" >> ReadSentences(shards)
            | "CountWords" >> CountWords(cfg.lowercase, cfg.do_strip_accents)
            | "WriteCounts" >> WriteCounts(storage.join(scratch, "counts"))
        )

    found = counters(run_pipeline(build, workers, runner, beam_args), NAMESPACE)
    return {name: found.get(name, 0) for name in COUNTERS}


# --------------------------------------------------------------------------- entry point


def build_vocab(
    corpus: str | None,
    output: str,
    cfg: VocabConfig,
    workers: int = 1,
    runner: str = LOCAL_RUNNER,
    beam_args: Iterable[str] = (),
) -> dict[str, Any]:
    """Train (or validate, with ``cfg.vocab_file``) a vocab; returns the written manifest."""
    from bert_core.vocab.training import train_wordpiece, vocab_stats

    output = storage.to_uri(output)
    if corpus is None and cfg.vocab_file is None:
        raise ValueError("a vocab is trained from a corpus: give --corpus (or --vocab-file to use an existing vocab)")
    given = check_vocab_file(cfg.vocab_file, cfg) if cfg.vocab_file else None
    corpus_manifest = storage.read_manifest(corpus) if corpus else None  # refuses unfinished corpora
    if corpus_manifest:
        storage.check_shards(corpus, corpus_manifest)
    storage.check_writable(output)
    storage.remove(storage.join(output, storage.MANIFEST))  # an old manifest must not bless new files

    counters: dict[str, int] = {}
    pairs: list[tuple[str, int]] = []
    if corpus:
        scratch = storage.join(output, SCRATCH)
        try:
            counters = count_corpus_words(corpus, scratch, cfg, workers, runner, beam_args)
            pairs = read_counts(scratch)
        finally:
            storage.remove(scratch)
    if given is not None:
        tokenizer = given
    else:
        if not pairs:
            raise ValueError(f"corpus {corpus} has no words to train a vocab on; check the corpus stage's counts")
        vocab = train_wordpiece(lambda: pairs, cfg.vocab_size, cfg.min_frequency, cfg.limit_alphabet,
                                cfg.num_unused)
        tokenizer = Tokenizer(vocab, cfg.lowercase, cfg.do_strip_accents, cfg.max_input_chars_per_word)
    tokenizer.save(output)

    stats = vocab_stats(tokenizer, pairs) if pairs else {}
    config = cfg.model_dump(mode="json") | {"strip_accents": cfg.do_strip_accents}
    files = [storage.shard_entry(storage.join(output, name)) for name in ("vocab.txt", "tokenizer.json")]
    counts = {"vocab_size": tokenizer.vocab_size, "vocab_size_requested": None if given else cfg.vocab_size,
              "trained": given is None, **counters}
    return storage.write_manifest(output, stage="vocab", config=config,
                                  inputs=[corpus_manifest] if corpus_manifest else [],
                                  shards=files, counts=counts, stats=stats)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line entry: the shared job options plus the vocab's own; unknown ones go to Beam."""
    parser = job_parser(__doc__.split("\n", 1)[0])
    parser.add_argument("--corpus", default=None, help="Corpus stage folder URI (documents + manifest).")
    parser.add_argument("--output", required=True, help="Output folder URI.")
    parser.add_argument("--vocab-file", default=None, help="Validate and use this vocab.txt instead of training.")
    parser.add_argument("--vocab-size", type=int, default=None, help="Trained vocab size (default: vocab.vocab_size).")
    parser.add_argument("--cased", action="store_true", help="Keep case and accents (a cased model).")
    args, cfg, beam_args = parse_job_args(parser, argv)
    updates: dict[str, Any] = {}
    if args.vocab_file:
        updates["vocab_file"] = args.vocab_file
    if args.vocab_size:
        updates["vocab_size"] = args.vocab_size
    if args.cased:
        updates["lowercase"] = False
    vocab_cfg = VocabConfig.model_validate({**cfg.vocab.model_dump(), **updates})
    return build_vocab(args.corpus, args.output, vocab_cfg, cfg.workers, cfg.beam_runner, beam_args)


if __name__ == "__main__":
    manifest = run()
    print(f"vocab of {manifest['counts']['vocab_size']} tokens at {manifest['uri']}")
