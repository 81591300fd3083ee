"""An offline sentence splitter: rules, an abbreviation list, no model download.

    from bert_core.corpus.sentences import split_sentences
    split_sentences('Dr. Smith arrived at 3.30 p.m. on Monday. "Hello!" he said. It was 2.5 km.')
    # ['Dr. Smith arrived at 3.30 p.m. on Monday.', '"Hello!" he said.', 'It was 2.5 km.']

Used by ``beam_jobs/clean_corpus.py`` on every paragraph of every document.
"""

from __future__ import annotations

import re

# Never end a sentence: titles before a name, and abbreviations inside a sentence.
_ABBREVIATIONS = frozenset(
    """
    mr mrs ms mx dr prof st sr jr rev hon gen col lt sgt capt cpt maj cmdr adm gov pres sen rep
    messrs mme mlle sra srta fr
    e.g i.e cf vs viz al approx ca esp ed eds trans repr dept univ assn bros mt ft rd ave blvd
    jan feb apr jun jul aug sep sept oct nov dec tues thur thurs
    u.s u.k u.n e.u u.s.a u.s.s.r d.c
    """.split()
)
# May end a sentence: split after them only when a capitalised word follows.
_SOFT_ABBREVIATIONS = frozenset("etc a.m p.m inc ltd co corp llc plc bc ad b.c a.d".split())
# Abbreviations before a number ("No. 5", "Fig. 3", "pp. 12"); elsewhere "no." ends a sentence.
_NUMBER_ABBREVIATIONS = frozenset("no nos vol vols p pp ch chap sec fig figs eq eqs op art".split())

# The spaces are taken whole (possessive) so that the look-ahead, which skips a lowercase ASCII
# letter or a ",;:" after them in the regex engine, cannot match fewer spaces instead.
_BOUNDARY = re.compile(r"([.!?\u2026]+)([\"'\u201d\u2019)\]]*)(\s++)(?![a-z,;:])")
_INITIAL = re.compile(r"^[A-Z]$")
_DOTTED = re.compile(r"^(?:[A-Za-z]\.)+[A-Za-z]$")  # U.S, e.g, a.m (final period not included)


def _is_abbreviation(word: str, next_word: str) -> bool:
    word = word.lstrip("\"'(\u201c\u2018[")
    low = word.lower()
    if low in _SOFT_ABBREVIATIONS:
        return not next_word[:1].isupper()
    if low in _NUMBER_ABBREVIATIONS:
        return next_word[:1].isdigit()
    return (low in _ABBREVIATIONS
            or (len(word) <= 2 and _INITIAL.match(word) is not None)
            or ("." in word and _DOTTED.match(word) is not None))


def _boundaries(text: str) -> list[re.Match[str]]:
    """:data:`_BOUNDARY` matches in ``text``, as ``finditer`` gives them. A boundary starts at a
    mark, so where periods are the only marks (most paragraphs) it is checked only at each period,
    found by ``str.find``: a regex scan of every character costs several times more."""
    if "!" in text or "?" in text or "\u2026" in text:
        return list(_BOUNDARY.finditer(text))
    found = []
    match = _BOUNDARY.match
    last = len(text) - 1  # a match needs a character after the mark
    i = text.find(".", 0, last)
    while i >= 0:
        m = match(text, i)
        if m is None:
            i = text.find(".", i + 1, last)
        else:
            found.append(m)
            i = text.find(".", m.end(), last)
    return found


# Why not a library: benchmarks/speed/bench_sentences.py scores this splitter, pysbd and blingfire
# against hand-checked sentence boundaries of the sample Wikipedia excerpt; this one makes no more
# boundary errors than either, is faster than both, and needs no extra dependency.
def split_sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph, in order, stripped; the text is otherwise unchanged.

    A boundary is terminal punctuation (``.``, ``!``, ``?``, ``…``), then any closing quotes or
    brackets, then whitespace, then something that is not a lowercase letter. It is *not* a
    boundary when the word before the period is a title or a common abbreviation (``Dr.``,
    ``e.g.``, ``U.S.``, ``Fig.``), or a single capital initial (``J. R. R. Tolkien``). A few
    abbreviations that often end a sentence (``etc.``, ``a.m.``, ``Inc.``) split only before a
    capitalised word. Decimals (``3.14``) never split because no space follows the period.
    """
    text = paragraph.strip()
    sentences: list[str] = []
    start = 0
    size = len(text)
    for m in _boundaries(text):
        after = m.end()
        if after >= size:
            break
        first = text[after]
        if first.islower() or first in ",;:":
            continue  # '"Stop!" he said' / 'e.g., x': the sentence goes on
        if m.group(1) == ".":
            # the word before the period and the word after the space (no slicing of the rest)
            word = text[max(text.rfind(" ", start, m.start()) + 1, start) : m.start()]
            next_end = text.find(" ", after)
            next_word = text[after : next_end if next_end >= 0 else size]
            if word and _is_abbreviation(word, next_word):
                continue
        sentence = text[start : m.end(2)].strip()
        if sentence:
            sentences.append(sentence)
        start = after
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def split_paragraphs(paragraphs: list[str]) -> list[str]:
    """All sentences of a document (paragraph boundaries always end a sentence)."""
    return [s for p in paragraphs for s in split_sentences(p)]
