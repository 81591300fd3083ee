"""The quality protocol's corpora K1 and K2 (``docs/quality-protocol-v2.md``) as ``bertpipe corpus``
inputs, their vocab and instances (and those of version 1's tweets), and a checkpoint's measures
per genre, built by the protocol's ``--corpus`` and the choice's ``prepare``.

A document is a tweet, a Wikipedia article or a paragraph of a book file. Task texts leave by
tweet, paragraph and whole article. A genre's pieces are its share of the training documents'
pieces (the instances keep no document ids).
"""

from __future__ import annotations

import argparse
import bz2
import glob
import hashlib
import json
import math
import os
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.quality import tasks as qt
from benchmarks.quality.build import corpus_and_vocab, corpus_inputs, instances_for, locked
from benchmarks.quality.measures import masked_lm_accuracy
from benchmarks.text import distinct_text
from benchmarks.text.dumps import split_dump
from bert_core import storage
from bert_core.corpus.books import book_paragraphs, book_stem, unwrap
from bert_core.corpus.inputs import book_ids
from bert_core.corpus.sentences import split_paragraphs, split_sentences
from bert_core.corpus.wikitext import is_redirect, wikitext_to_paragraphs
from flows.tools.samples import tweet_records, tweet_rows

CORPORA = ("k1", "k2")
SET_ASIDE_SEED = 20240601
SET_ASIDE_SHARE, SET_ASIDE_MIN = 0.01, 10
HELDOUT_SEQUENCES, HELDOUT_LENGTH = 2000, 64
QUICK_FILES = 2  # --quick: the smallest book files of each folder
PREFIX_GENRES = {"wiki:": "encyclopedia", "text:": "tweets"}  # a book's genre is its folder's (distinct_text.GENRES)
VERSION = 1  # of the prepared inputs' layout; a new value prepares them again


@dataclass
class Doc:
    """A document the set-aside draws from: its id, genre, the text that decides the task-text
    filter (paragraphs of an article) and its sentences as the corpus stage splits them."""

    id: str
    genre: str
    texts: list[str]
    sentences: list[str]


@dataclass
class Prepared:
    """A corpus's inputs: ``bertpipe corpus`` flags and globs, the genre of each book document id
    (and of the ``wiki:`` and ``text:`` prefixes), the set-aside folder and the sizes per genre."""

    corpus: str
    inputs: list[tuple[str, str]]
    genres: dict[str, str]
    heldout: Path | None  # None: version 1's corpus sets no text aside
    sizes: dict[str, dict[str, float]] = field(default_factory=dict)


# --------------------------------------------------------------------------- the rules


def set_aside(ids: list[str], seed: int = SET_ASIDE_SEED) -> set[str]:
    """The ids set aside from a genre: 1% of them (at least 10, all when fewer), the first of a
    ``numpy.random.default_rng(seed)`` permutation of the ids sorted."""
    ordered = sorted(ids)
    n = min(len(ordered), max(SET_ASIDE_MIN, math.ceil(SET_ASIDE_SHARE * len(ordered))))
    order = np.random.default_rng(seed).permutation(len(ordered))
    return {ordered[i] for i in order[:n]}


def genre_of(doc_id: str, genres: dict[str, str]) -> str | None:
    """The genre of a corpus document id (``book:...`` by name, ``wiki:`` and ``text:`` by prefix)."""
    return genres.get(doc_id) or genres.get(doc_id.split(":", 1)[0] + ":")


# --------------------------------------------------------------------------- reading the inputs


def book_docs(path: Path, genre: str) -> list[Doc]:
    """The paragraphs of a book file as the corpus stage reads them (``book_paragraphs``), those a
    rewritten copy keeps (a heading line is not one); ids ``<folder>/<stem>#<n>``."""
    _, paragraphs = book_paragraphs(path.name, path.read_bytes())
    stem = f"{path.parent.name}/{book_stem(path.name)}"
    return [Doc(f"{stem}#{n:06d}", genre, [p], split_sentences(p))
            for n, p in enumerate(paragraphs) if unwrap(p) == [p]]


def dump_pages(path: Path) -> tuple[bytes, list[bytes], bytes]:
    """A dump file's bytes before the first page, each ``<page>`` element, and the bytes after."""
    raw = path.read_bytes()
    return split_dump(bz2.decompress(raw) if path.name.endswith(".bz2") else raw)


def article_doc(page: bytes) -> Doc | None:
    """An article page as a document (its text paragraphs as the corpus stage cleans them), or
    None for a redirect, another namespace or a page without text."""
    element = ET.fromstring(page)
    revision = element.find("revision")
    text = (revision.findtext("text") if revision is not None else None) or ""
    if (element.findtext("ns") or "0").strip() != "0" or element.find("redirect") is not None or is_redirect(text):
        return None
    paragraphs = wikitext_to_paragraphs(text)
    sentences = split_paragraphs(paragraphs)
    return Doc(f"wiki:{int(element.findtext('id'))}", "encyclopedia", paragraphs, sentences) if sentences else None


def tweet_docs(samples: Path) -> list[Doc]:
    """Each tweet of the samples (as ``samples fetch`` reads them), ids ``tweet:<row>``."""
    return [Doc(f"tweet:{n:06d}", "tweets", [text], split_paragraphs(unwrap(text)))
            for n, (_, text) in enumerate(tweet_rows(samples))]


def book_files(corpus: str, samples: Path, distinct: Path | None, quick: bool) -> list[Path]:
    """The book files of a corpus: the sample's (Botchan, the plays), and for K2 every source of
    ``distinct`` (``distinct_text.text_files``); with ``quick`` the smallest few of each folder."""
    files = sample_files(samples, "--books")
    if corpus == "k2" and distinct is not None:
        files += [p for p in distinct_text.text_files(distinct) if p.parent.name in distinct_text.GENRES]
    if quick:
        by_size = sorted(files, key=lambda p: (p.stat().st_size, p.name))
        files = sorted(p for folder in {p.parent.name for p in files}
                       for p in [q for q in by_size if q.parent.name == folder][:QUICK_FILES])
    return files


def sample_files(samples: Path, option: str) -> list[Path]:
    """The files of the sample's demo corpus that one ``bertpipe corpus`` option names."""
    return sorted(Path(p) for flag, pattern in corpus_inputs(samples) if flag == option
                  for p in Path(pattern).parent.glob(Path(pattern).name))


# --------------------------------------------------------------------------- preparing a corpus


def prepare(corpus: str, work: Path, samples: Path, examples: list, distinct: Path | None = None,
            quick: bool = False, log: Callable[[str], None] = print) -> Prepared:
    """The inputs of corpus ``k1`` or ``k2`` under ``work/<corpus>/inputs-<sha256>/``: every tweet,
    paragraph and article that holds a task text (:func:`tasks.holds_held_out` with the
    keys of ``examples``) dropped, each genre's set-aside documents (:func:`set_aside`) and any copy
    of their text dropped and written to ``work/heldout-genres/<genre>.jsonl``. Prepared once per
    content of the inputs and keys (``work/<corpus>/prepared.json``)."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus {corpus!r}: one of {CORPORA}")
    folder = work / corpus
    folder.mkdir(parents=True, exist_ok=True)
    heldout = work / ("heldout-genres-quick" if quick else "heldout-genres")
    books, dumps = book_files(corpus, samples, distinct, quick), sample_files(samples, "--wikipedia")
    keys = qt.keys_of(examples)
    stamp = _digest(json.dumps({"version": VERSION, "corpus": corpus, "quick": quick, "keys": sorted(keys),
                                "files": [[str(p), _file_sha(p)] for p in [*books, *dumps,
                                                                         samples / "text" / "tweets.csv"]]}))
    done = folder / "prepared.json"
    if done.exists():
        saved = json.loads(done.read_text())
        if saved["stamp"] == stamp and all(glob.glob(p) for _, p in saved["inputs"]) \
                and all((heldout / f"{g}.jsonl").exists() for g in saved["sizes"]):
            return Prepared(corpus, [tuple(i) for i in saved["inputs"]], saved["genres"], heldout, saved["sizes"])

    sizes: dict[str, dict[str, float]] = {}

    def count(genre: str, what: str, n: float = 1) -> None:
        sizes.setdefault(genre, {"documents": 0, "task_text_dropped": 0, "set_aside": 0,
                                 "copies_dropped": 0, "kept": 0, "mb": 0.0})[what] += n

    # every document, by input; the filter first, then the set-aside draws from what is left
    by_book = {p: book_docs(p, distinct_text.GENRES[p.parent.name]) for p in books}
    by_dump = {}
    for p in dumps:
        head, pages, tail = dump_pages(p)
        by_dump[p] = (head, [(page, article_doc(page)) for page in pages], tail)
    tweets = tweet_docs(samples)
    every = [d for docs in by_book.values() for d in docs] + \
            [d for _, pages, _ in by_dump.values() for _, d in pages if d] + tweets
    dropped = set()
    for d in every:
        count(d.genre, "documents")
        if any(qt.holds_held_out(t, keys) for t in d.texts):
            dropped.add(d.id)
            count(d.genre, "task_text_dropped")
    aside: set[str] = set()
    for genre in sorted({d.genre for d in every}):
        aside |= set_aside([d.id for d in every if d.genre == genre and d.id not in dropped])
    aside_texts = {t for d in every if d.id in aside for t in d.texts if not d.id.startswith("wiki:")}

    def keep(d: Doc) -> bool:
        if d.id in dropped:
            return False
        if d.id in aside:
            count(d.genre, "set_aside")
            return False
        if not d.id.startswith("wiki:") and d.texts[0] in aside_texts:
            count(d.genre, "copies_dropped")
            return False
        count(d.genre, "kept")
        count(d.genre, "mb", sum(len(t.encode()) for t in d.texts) / 1e6)
        return True

    staging = folder / "inputs.part"
    shutil.rmtree(staging, ignore_errors=True)
    for path, docs in by_book.items():
        kept = [d.texts[0] for d in docs if keep(d)]
        if kept:
            name = path.name.removesuffix(".md").removesuffix(".txt") + ".txt"
            _write(staging / "books" / path.parent.name / name, "\n\n".join(kept) + "\n")
    for path, (head, pages, tail) in by_dump.items():
        kept_pages = [page for page, d in pages if d is None or keep(d)]
        _write(staging / "wikipedia" / path.name, bz2.compress(head + b"\n  ".join(kept_pages) + tail))
    _write(staging / "text" / "tweets.jsonl", tweet_records([d.texts[0] for d in tweets if keep(d)]))

    digest = _digest("\n".join(f"{p.relative_to(staging)} {_file_sha(p)}" for p in sorted(staging.rglob("*"))
                               if p.is_file()))[:16]
    root = folder / f"inputs-{digest}"
    if root.exists():
        shutil.rmtree(staging)
    else:
        staging.rename(root)
    for stale in folder.glob("inputs-*"):
        if stale != root:
            shutil.rmtree(stale)
    inputs = [("--wikipedia", str(root / "wikipedia" / "*.xml.bz2")), ("--books", str(root / "books" / "*" / "*.txt")),
              ("--text", str(root / "text" / "tweets.jsonl"))]
    inputs = [(flag, p) for flag, p in inputs if glob.glob(p)]
    book_texts = sorted((root / "books").glob("*/*.txt"))
    ids = book_ids([str(f) for f in book_texts])
    genres = {ids[str(f)]: distinct_text.GENRES[f.parent.name] for f in book_texts} | PREFIX_GENRES
    write_heldout(heldout, [d for d in every if d.id in aside])
    sizes = {g: {k: round(v, 2) if k == "mb" else int(v) for k, v in s.items()} for g, s in sorted(sizes.items())}
    done.write_text(json.dumps({"stamp": stamp, "inputs": inputs, "genres": genres, "sizes": sizes}, indent=1))
    for genre, s in sizes.items():
        log(f"{corpus} {genre}: {s['kept']} documents kept ({s['mb']} MB), {s['set_aside']} set aside, "
            f"{s['task_text_dropped']} with task text dropped, {s['copies_dropped']} copies of set-aside text dropped")
    return Prepared(corpus, inputs, genres, heldout, sizes)


def write_heldout(folder: Path, docs: list[Doc]) -> None:
    """``<genre>.jsonl``: each set-aside document, ``{"id", "sentences"}``, in id order."""
    for genre in sorted({d.genre for d in docs}):
        rows = sorted((d for d in docs if d.genre == genre), key=lambda d: d.id)
        _write(folder / f"{genre}.jsonl", "".join(json.dumps({"id": d.id, "sentences": d.sentences}) + "\n"
                                                    for d in rows))


def _write(path: Path, data: str | bytes) -> None:
    """``data`` to ``path`` whole (written beside it, then renamed): a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _file_sha(path: Path) -> str:
    return storage.sha256(str(path)) if path.exists() else "missing"


# --------------------------------------------------------------------------- corpus, vocab, instances


@dataclass
class Built:
    prepared: Prepared
    corpus: Path
    vocab: Path
    instances: Path


def build(corpus: str, recipe, work: Path, samples: Path, parts_by_task: dict[str, dict[str, list]],
          distinct: Path | None = None, quick: bool = False, log: Callable[[str], None] = print) -> Built:
    """Corpus ``k1`` or ``k2`` with its own vocab (demo preset) and the instances of ``recipe``
    (a ``spec.Recipe``), built once under ``work/<corpus>/``, or ``v1``, the sample tweets less
    the tasks' (``tasks.pretrain_tweets``), under ``work``; stops when a dev or test example of a
    task is in the built corpus."""
    if corpus == "k2" and distinct is None and not quick:
        distinct = distinct_text.cached(log=log)
    folder = work if corpus == "v1" else work / corpus
    with locked(work / f"{corpus}.build.lock"):  # another process building the same corpus: wait for it
        if corpus == "v1":
            tweets = parts_by_task["tweets3"]
            text = qt.pretrain_tweets(samples, tweets["train"] + tweets["dev"] + tweets["test"], work / "pretrain-text")
            prepared = Prepared(corpus, [("--text", str(text))], {}, None)
        else:
            examples = [e for parts in parts_by_task.values() for split in parts.values() for e in split]
            prepared = prepare(corpus, work, samples, examples, distinct, quick, log)
        built, vocab = corpus_and_vocab(prepared.inputs, folder)
        leaked = {name: qt.held_out_in_corpus(parts["dev"] + parts["test"], built)
                  for name, parts in parts_by_task.items()}
        if any(leaked.values()):
            raise SystemExit(f"dev/test texts are in corpus {corpus} ({leaked}); the arms would not be fair")
        return Built(prepared, built, vocab, instances_for(recipe, built, vocab, folder))


# --------------------------------------------------------------------------- measures per genre


def heldout_sequences(path: Path, tokenizer, count: int = HELDOUT_SEQUENCES,
                      length: int = HELDOUT_LENGTH) -> list[list[int]]:
    """The first ``count`` sequences of a genre's set-aside documents: ``[CLS]``, consecutive
    sentences of one document while they fit in ``length`` pieces, ``[SEP]`` (a longer sentence
    alone, cut)."""
    out: list[list[int]] = []
    budget = length - 2
    for doc in map(json.loads, filter(str.strip, path.read_text(encoding="utf-8").splitlines())):
        current: list[int] = []
        for ids in tokenizer.encode_batch(doc["sentences"]):
            ids = list(ids)
            if current and len(current) + len(ids) > budget:
                out.append(current)
                current = []
            current += ids
        if current:
            out.append(current)
        if len(out) >= count:
            break
    return [[tokenizer.cls_id, *s[:budget], tokenizer.sep_id] for s in out[:count]]


def genre_mlm_accuracy(checkpoint: str, heldout: Path, count: int = HELDOUT_SEQUENCES,
                       length: int = HELDOUT_LENGTH, seed: int = 0) -> dict[str, float]:
    """Held-out MLM accuracy of a checkpoint on each genre's set-aside documents (the masking of
    ``measures.masked_lm_accuracy``)."""
    from bert_core.vocab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    return {p.stem: masked_lm_accuracy(checkpoint, heldout_sequences(p, tokenizer, count, length), seed)
            for p in sorted(heldout.glob("*.jsonl"))}


def genre_pieces(corpus: Path, vocab: Path, instances: Path, genres: dict[str, str]) -> dict[str, dict[str, int]]:
    """Word pieces of each genre: in the corpus's training documents (those the instances stage
    does not hold out for eval), tokenized with ``vocab``, and that genre's share of the pieces
    of the training instances. Counted once per instances (a JSON file beside them)."""
    import pyarrow.parquet as pq

    from bert_core.instances.sharding import eval_threshold, is_eval_document
    from bert_core.vocab.tokenization import load_tokenizer

    manifest = storage.read_manifest(str(instances))
    saved = instances.with_name(instances.name + ".genre-pieces.json")
    stamp = hashlib.sha256((instances / "_MANIFEST.json").read_bytes()).hexdigest()
    if saved.exists() and json.loads(saved.read_text())["stamp"] == stamp:
        return json.loads(saved.read_text())["pieces"]
    config = manifest["config"]
    threshold = eval_threshold(manifest["counts"]["documents_read"], argparse.Namespace(**config))
    tokenizer = load_tokenizer(str(vocab))
    corpus_pieces: dict[str, int] = {}
    for f in sorted(corpus.glob("docs-*.parquet")):
        table = pq.read_table(f, columns=["doc_id", "sentences"])
        for doc_id, sentences in zip(table.column("doc_id").to_pylist(), table.column("sentences").to_pylist(),
                                     strict=True):
            if threshold > 0 and is_eval_document(doc_id, config["seed"], threshold):
                continue
            genre = genre_of(doc_id, genres) or "unknown"
            corpus_pieces[genre] = corpus_pieces.get(genre, 0) + sum(map(len, tokenizer.encode_batch(sentences)))
    in_instances = sum(s["counts"]["maskable_tokens"] for s in manifest["stats"].values())
    total = sum(corpus_pieces.values())
    pieces = {g: {"corpus_pieces": n, "instance_pieces": round(in_instances * n / total)}
              for g, n in sorted(corpus_pieces.items())}
    _write(saved, json.dumps({"stamp": stamp, "pieces": pieces}))
    return pieces


def epochs_seen(pieces: dict[str, dict[str, int]], instances: Path, sequences_drawn: int) -> dict[str, float]:
    """Per genre, its pieces in the sequences a run drew over its pieces in the instances: a run
    draws shuffled instances epoch after epoch, so in expectation every genre's share of the draws
    is its share of the instances, and the ratio is the run's sequences over the instances."""
    manifest = storage.read_manifest(str(instances))
    count = sum(s["counts"]["instances"] for s in manifest["stats"].values())
    return {g: sequences_drawn / count for g in pieces}
