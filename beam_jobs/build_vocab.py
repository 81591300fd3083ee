"""Beam job: documents -> WordPiece vocab (``vocab.txt``, ``tokenizer.json``, ``_MANIFEST.json``).

    bertpipe vocab --corpus ./bertpipe-data/corpus --output ./bertpipe-data/vocab
    python -m beam_jobs.build_vocab --corpus CORPUS_URI --output VOCAB_URI [--workers 2] \\
        [--vocab-size 30522] [--cased] [--vocab-file VOCAB_TXT] [beam args]

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

import argparse
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from bert_core import storage
from bert_core.config import VocabConfig
from bert_core.vocab.tokenization import (
    Tokenizer,
    VocabError,
    parse_vocab,
    vocab_problems,
)

NAMESPACE = "build_vocab"
SCRATCH = "_word_counts"


# --------------------------------------------------------------------------- pipeline


def read_sentences(uri: str, batch_rows: int = 256) -> Iterator[tuple[str, list[str]]]:
    """``(doc_id, sentences)`` of one documents shard, streamed in row batches."""
    import pyarrow.parquet as pq

    with storage.open_file(uri, "rb") as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=["doc_id", "sentences"]):
            yield from zip(batch.column("doc_id").to_pylist(), batch.column("sentences").to_pylist(),
                           strict=True)


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
    """Documents shards -> ``(word, count)`` over the whole corpus."""

    def __init__(self, lowercase: bool, strip_accents: bool):
        super().__init__()
        self.lowercase, self.strip_accents = lowercase, strip_accents

    def expand(self, shard_uris):
        return (
            shard_uris
            | "ReadSentences" >> beam.FlatMap(read_sentences)
            # A corpus may have fewer shards than workers; spread the documents out.
            | "SpreadDocuments" >> beam.Reshuffle()
            | "CountDocumentWords" >> beam.ParDo(CountDocumentWords(self.lowercase, self.strip_accents))
            | "SumPerWord" >> beam.CombinePerKey(sum)
        )


def _format_count(pair: tuple[str, int]) -> str:
    return f"{pair[0]}\t{pair[1]}"


def count_corpus_words(corpus: str, scratch: str, cfg: VocabConfig, workers: int, runner: str,
                       beam_args: Iterable[str]) -> dict[str, int]:
    """Run the counting pipeline; ``word<TAB>count`` files land in ``scratch``. Returns counters."""
    shards = storage.shard_uris(corpus)
    storage.remove(scratch)
    options = pipeline_options(workers, runner, beam_args)
    runner_obj = None
    if runner == "FnApiRunner":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        runner_obj = FnApiRunner()
    p = beam.Pipeline(runner=runner_obj, options=options)
    _ = (
        p
        | "ListShards" >> beam.Create(shards)
        | "CountWords" >> CountWords(cfg.lowercase, cfg.do_strip_accents)
        | "FormatCounts" >> beam.Map(_format_count)
        | "WriteCounts" >> beam.io.WriteToText(storage.join(scratch, "counts"), file_name_suffix=".tsv")
    )
    result = p.run()
    result.wait_until_finish()
    counters = {c.key.metric.name: c.committed for c in result.metrics().query()["counters"]
                if c.key.metric.namespace == NAMESPACE}
    return {name: int(counters.get(name, 0)) for name in
            ("documents", "sentences", "words", "documents_without_sentences", "null_sentences")}


def read_counts(scratch: str) -> list[tuple[str, int]]:
    """All ``(word, count)`` pairs, sorted by count descending then word (a stable training order)."""
    pairs = []
    for uri in storage.glob(storage.join(scratch, "counts*.tsv")):
        with storage.open_file(uri, "rb") as f:
            for line in f:
                word, count = line.decode("utf-8").rstrip("\n").rsplit("\t", 1)
                pairs.append((word, int(count)))
    pairs.sort(key=lambda wc: (-wc[1], wc[0]))
    return pairs


def pipeline_options(workers: int, runner: str = "FnApiRunner", beam_args: Iterable[str] = ()):  # noqa: ANN201
    from apache_beam.options.pipeline_options import PipelineOptions

    if runner != "FnApiRunner":
        return PipelineOptions(list(beam_args), runner=runner)
    mode = ({"direct_num_workers": workers, "direct_running_mode": "multi_processing"}
            if workers > 1 else {"direct_num_workers": 1, "direct_running_mode": "in_memory"})
    return PipelineOptions(list(beam_args), **mode)


# --------------------------------------------------------------------------- entry point


def check_vocab_file(uri: str, cfg: VocabConfig) -> Tokenizer:
    """The tokenizer of an existing vocab, or :class:`VocabError` saying what is wrong with it."""
    if not storage.exists(uri):
        raise VocabError(f"--vocab-file {uri} does not exist; give the vocab.txt of a BERT model")
    vocab = parse_vocab(storage.read_text(uri), source=uri)
    problems = vocab_problems(vocab)
    # A wrong casing setting silently ruins a model: uncased text on a cased vocab never uses the
    # capitalised tokens, cased text on an uncased vocab turns every capital into [UNK].
    letters = [t for t in vocab if any(c.isalpha() for c in t) and not t.startswith("[")]
    upper = sum(1 for t in letters if any(c.isupper() for c in t))
    if not cfg.lowercase and letters and upper / len(letters) < 0.001:
        problems.append(f"only {upper} of {len(letters)} tokens have uppercase letters (an uncased "
                        "vocab) but vocab.lowercase is false; set vocab.lowercase=true")
    if cfg.lowercase and letters and upper / len(letters) > 0.05:
        problems.append(f"{upper} of {len(letters)} tokens have uppercase letters (a cased vocab) but "
                        "vocab.lowercase is true; set vocab.lowercase=false")
    if problems:
        raise VocabError(f"--vocab-file {uri} is not a usable BERT vocab: " + "; ".join(problems))
    return Tokenizer(vocab, cfg.lowercase, cfg.do_strip_accents, cfg.max_input_chars_per_word)


def build_vocab(
    corpus: str | None,
    output: str,
    cfg: VocabConfig,
    workers: int = 1,
    runner: str = "FnApiRunner",
    beam_args: Iterable[str] = (),
) -> dict[str, Any]:
    """Train (or validate, with ``cfg.vocab_file``) a vocab; returns the written manifest."""
    from bert_core.vocab.training import train_wordpiece, vocab_stats

    output = storage.to_uri(output)
    if corpus is None and cfg.vocab_file is None:
        raise ValueError("a vocab is trained from a corpus: give --corpus (or --vocab-file to use an existing vocab)")
    given = check_vocab_file(cfg.vocab_file, cfg) if cfg.vocab_file else None
    corpus_manifest = storage.read_manifest(corpus) if corpus else None  # refuses unfinished corpora
    storage.remove(storage.join(output, storage.MANIFEST))  # an old manifest must not bless new files

    counters: dict[str, int] = {}
    pairs: list[tuple[str, int]] = []
    if corpus:
        scratch = storage.join(output, SCRATCH)
        counters = count_corpus_words(corpus, scratch, cfg, workers, runner, beam_args)
        pairs = read_counts(scratch)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--corpus", default=None, help="Corpus stage folder URI (documents + manifest).")
    parser.add_argument("--output", required=True, help="Output folder URI.")
    parser.add_argument("--vocab-file", default=None, help="Validate and use this vocab.txt instead of training.")
    parser.add_argument("--vocab-size", type=int, default=None, help="Trained vocab size (default 30522).")
    parser.add_argument("--cased", action="store_true", help="Keep case and accents (a cased model).")
    parser.add_argument("--workers", type=int, default=1, help="Local Beam worker processes.")
    parser.add_argument("--runner", default="FnApiRunner", help="Beam runner (default: local).")
    parser.add_argument("--config-json", default=None, help="A VocabConfig as JSON (other fields).")
    return parser


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line entry: unknown arguments go to Beam."""
    import json

    args, beam_args = build_parser().parse_known_args(argv)
    data = json.loads(args.config_json) if args.config_json else {}
    if args.vocab_file:
        data["vocab_file"] = args.vocab_file
    if args.vocab_size:
        data["vocab_size"] = args.vocab_size
    if args.cased:
        data["lowercase"] = False
    cfg = VocabConfig.model_validate(data)
    return build_vocab(args.corpus, args.output, cfg, args.workers, args.runner, beam_args)


if __name__ == "__main__":
    manifest = run(sys.argv[1:])
    print(f"vocab of {manifest['counts']['vocab_size']} tokens at {manifest['uri']}")
