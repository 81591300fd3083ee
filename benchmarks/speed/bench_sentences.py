"""Sentence splitter: ours (bert_core/corpus/sentences.py) vs ``pysbd`` and ``blingfire``, on the
paragraphs of the sample Wikipedia excerpt.

    BERTPIPE_SAMPLES=samples python -m benchmarks.speed.bench_sentences

Accuracy: boundary precision, recall and F1 against ``sentences_gold.json``, hand-checked sentence
starts of 120 random paragraphs of the excerpt, kept as references into the dump (title,
paragraph, offsets), never its text. Speed: characters per CPU-second on one thread over the
first ``SPEED_CHARS`` characters of paragraphs. Rows: ``bench-results/sentences.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import row, samples, timed, write_rows

GOLD = Path(__file__).resolve().parent / "sentences_gold.json"
SPEED_CHARS = 300_000


def gold_paragraph(pages: dict[str, list[str]], ref: dict) -> str | None:
    """The paragraph a gold reference labels: at its index if the text there is the one labelled
    (same length and digest), else the page's paragraph with that text (the cleaning may drop
    or add a paragraph before it, which moves the index but not the sentences), else None."""
    paragraphs = pages.get(ref["title"], [])
    at = ref["paragraph"]
    candidates = ([paragraphs[at]] if at < len(paragraphs) else []) + paragraphs
    return next((t for t in candidates if len(t) == ref["chars"]
                 and hashlib.sha256(t.encode("utf-8")).hexdigest()[:16] == ref["sha256"]), None)


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
        found = [split(text) for text in texts]  # first, so that the timing below starts warm
        _, seconds = timed(lambda split=split: [split(text) for text in speed_texts])
        results[name] = {**scores(found, gold), "chars_per_s": size / seconds}
        r = results[name]
        print(f"{name:>9}: precision {r['precision']:.3f} recall {r['recall']:.3f} F1 {r['f1']:.3f} "
              f"({r['false']} false, {r['missed']} missed boundaries of {n_sentences} sentences); "
              f"{r['chars_per_s'] / 1e6:.2f} M chars per CPU-second")

    ours = results["ours"]
    rows = []
    for ref in ("pysbd", "blingfire"):
        theirs = results[ref]
        rows += [row(f"sentence boundary F1 vs {ref} ({n_sentences} hand-checked Wikipedia sentences)", ours["f1"],
                     theirs["f1"], "F1", ours["f1"] / theirs["f1"]),
                 row(f"sentence splitting speed vs {ref} (1 thread)", round(ours["chars_per_s"]),
                     round(theirs["chars_per_s"]), "chars/CPU-s", ours["chars_per_s"] / theirs["chars_per_s"])]
    write_rows("sentences", rows, detail=results)


if __name__ == "__main__":
    main()
