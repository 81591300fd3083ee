"""Sentence splitter: ours (bert_core/corpus/sentences.py) vs ``pysbd`` and ``blingfire``, on the
paragraphs of the sample Wikipedia excerpt.

    python -m benchmarks.speed.bench_sentences               # samples from ~/.cache/bertpipe/samples
    BERTPIPE_SAMPLES=samples python -m benchmarks.speed.bench_sentences

Accuracy: ``benchmarks/speed/sentences_gold.json`` holds hand-checked sentence boundaries of 120
paragraphs picked at random from the excerpt (about 400 sentences), as references into the dump
(page title, paragraph index, character offsets where sentences begin), never the text itself.
The gold judges every position where terminal punctuation meets whitespace and every boundary
any of the three splitters proposes; a quotation inside a sentence (`She wrote, "Stop. Go
home."`) is one sentence, and a boundary with no space after the period is a boundary. Each
splitter is scored on boundary precision, recall and F1 against that gold.

Speed: characters per CPU-second (one thread) of each splitter over the same paragraphs, the
first ``SPEED_CHARS`` characters' worth of the excerpt (pysbd is too slow for all of it in a
minute).
Rows go to ``bench-results/sentences.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import samples, write_rows

GOLD = Path(__file__).resolve().parent / "sentences_gold.json"
SPEED_CHARS = 300_000


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def gold_paragraph(pages: dict[str, list[str]], ref: dict) -> str | None:
    """The paragraph a gold reference labels: at its index if the text there is the one labelled
    (same length and digest), else the page's paragraph with that text (the cleaning may drop
    or add a paragraph before it, which moves the index but not the sentences), else None."""
    paragraphs = pages.get(ref["title"], [])
    at = ref["paragraph"]
    candidates = ([paragraphs[at]] if at < len(paragraphs) else []) + paragraphs
    return next((t for t in candidates if (len(t), digest(t)) == (ref["chars"], ref["sha256"])), None)


def article_paragraphs(dump: Path) -> dict[str, list[str]]:
    """Title -> cleaned paragraphs of every article of the dump, as the corpus job makes them."""
    from bert_core.corpus.dumps import WorkItem, read_pages
    from bert_core.corpus.wikitext import is_redirect, wikitext_to_paragraphs

    pages = {}
    for kind, rec in read_pages(WorkItem(str(dump), "whole")):
        if kind == "page" and rec["ns"] == "0" and not rec["redirect"] and not is_redirect(rec["text"]):
            pages[rec["title"]] = [p.strip() for p in wikitext_to_paragraphs(rec["text"])]
    return pages


def sentence_starts(text: str, sentences: list[str]) -> set[int]:
    """Offsets in ``text`` where the second and later of ``sentences`` begin."""
    starts, pos = [], 0
    for sentence in (s.strip() for s in sentences):
        if sentence:
            at = text.find(sentence, pos)
            if at < 0:
                raise ValueError(f"sentence not found in its paragraph: {sentence[:60]!r}")
            starts.append(at)
            pos = at + len(sentence)
    return set(starts[1:])


def splitters() -> dict[str, Callable[[str], set[int]]]:
    import blingfire
    import pysbd

    from bert_core.corpus.sentences import split_sentences

    segmenter = pysbd.Segmenter(language="en", clean=False)
    return {
        "ours": lambda text: sentence_starts(text, split_sentences(text)),
        "pysbd": lambda text: sentence_starts(text, segmenter.segment(text)),
        "blingfire": lambda text: {a for a, _ in blingfire.text_to_sentences_and_offsets(text)[1][1:]},
    }


def scores(found: list[set[int]], gold: list[set[int]]) -> dict[str, float]:
    hits = sum(len(f & g) for f, g in zip(found, gold, strict=True))
    proposed, true = sum(map(len, found)), sum(map(len, gold))
    precision, recall = hits / proposed, hits / true
    return {"precision": precision, "recall": recall, "f1": 2 * precision * recall / (precision + recall),
            "false": proposed - hits, "missed": true - hits}


def main() -> None:
    from benchmarks.common import machine

    print(f"machine: {machine()['cpu']}")
    gold_doc = json.loads(GOLD.read_text())
    pages = article_paragraphs(samples() / "wikipedia" / gold_doc["dump"])
    texts, gold = [], []
    for ref in gold_doc["paragraphs"]:
        text = gold_paragraph(pages, ref)
        if text is None:
            sys.exit(f"{ref['title']!r} has no paragraph with the text the gold refers to (paragraph "
                     f"{ref['paragraph']}, {ref['chars']} characters): the cleaning differs, so the "
                     "gold needs checking again")
        texts.append(text)
        gold.append(set(ref["sentence_starts"]))
    n_sentences = sum(len(g) + 1 for g in gold)

    speed_texts, size = [], 0
    for paragraphs in pages.values():
        for text in paragraphs:
            if size < SPEED_CHARS:
                speed_texts.append(text)
                size += len(text)

    results = {}
    for name, split in splitters().items():
        found = [split(text) for text in texts]
        start = time.process_time()
        for text in speed_texts:
            split(text)
        results[name] = {**scores(found, gold), "chars_per_s": size / (time.process_time() - start)}
        r = results[name]
        print(f"{name:>9}: precision {r['precision']:.3f} recall {r['recall']:.3f} F1 {r['f1']:.3f} "
              f"({r['false']} false, {r['missed']} missed boundaries of {n_sentences} sentences); "
              f"{r['chars_per_s'] / 1e6:.2f} M chars per CPU-second")

    ours = results["ours"]
    rows = []
    for ref in ("pysbd", "blingfire"):
        theirs = results[ref]
        rows += [
            {"measure": f"sentence boundary F1 vs {ref} ({n_sentences} hand-checked Wikipedia sentences)",
             "ours": round(ours["f1"], 3), "reference": round(theirs["f1"], 3),
             "ratio": round(ours["f1"] / theirs["f1"], 3), "unit": "F1"},
            {"measure": f"sentence splitting speed vs {ref} (1 thread)",
             "ours": round(ours["chars_per_s"]), "reference": round(theirs["chars_per_s"]),
             "ratio": round(ours["chars_per_s"] / theirs["chars_per_s"], 2), "unit": "chars/CPU-s"},
        ]
    write_rows("sentences", rows, detail=results)


if __name__ == "__main__":
    main()
