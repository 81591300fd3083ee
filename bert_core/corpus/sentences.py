"""An offline sentence splitter: rules, an abbreviation list, no model download.

    from bert_core.corpus.sentences import split_sentences
    split_sentences('Dr. Smith arrived at 3.30 p.m. on Monday. "Hello!" he said. It was 2.5 km.')
    # ['Dr. Smith arrived at 3.30 p.m. on Monday.', '"Hello!" he said.', 'It was 2.5 km.']

Used by ``beam_jobs/clean_corpus.py`` on every paragraph of every document.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

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
_MARKS = r"[.!?\u2026]+"
_AFTER_MARKS = r"([\"'\u201d\u2019)\]]*)(\s++)(?![a-z,;:])"
_BOUNDARY = re.compile(f"({_MARKS}){_AFTER_MARKS}")
# The same where periods are the only marks (most paragraphs), written to start with a literal
# (``\.\.*``, not ``\.+``): such a pattern is found by the regex engine's fast search, one that
# starts with a set of characters or a repeat is tried at every character.
_PERIOD_BOUNDARY = re.compile(rf"(\.\.*){_AFTER_MARKS}")
_INITIAL = re.compile(r"^[A-Z]$")
_DOTTED = re.compile(r"^(?:[A-Za-z]\.)+[A-Za-z]$")  # U.S, e.g, a.m (final period not included)
# Each abbreviation's list, as one lookup.
_NEVER, _SOFT, _NUMBER = range(3)
_KIND = {**dict.fromkeys(_ABBREVIATIONS, _NEVER), **dict.fromkeys(_SOFT_ABBREVIATIONS, _SOFT),
         **dict.fromkeys(_NUMBER_ABBREVIATIONS, _NUMBER)}


def _is_abbreviation(word: str, next_first: str) -> bool:
    """Whether ``word`` before a period is an abbreviation there; ``next_first`` is the first
    character of the word after the space."""
    word = word.lstrip("\"'(\u201c\u2018[")
    kind = _KIND.get(word.lower())
    if kind == _SOFT:
        return not next_first.isupper()
    if kind == _NUMBER:
        return next_first.isdigit()
    return (kind == _NEVER
            or (len(word) <= 2 and _INITIAL.match(word) is not None)
            or ("." in word and _DOTTED.match(word) is not None))


def _boundaries(text: str) -> Iterator[re.Match[str]]:
    """:data:`_BOUNDARY` matches in ``text``, in order."""
    if "!" in text or "?" in text or "\u2026" in text:
        return _BOUNDARY.finditer(text)
    return _PERIOD_BOUNDARY.finditer(text)


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
            # the word before the period (no slicing of the rest); the word after the space
            # starts with ``first``, as the space is taken whole
            mark = m.start()
            word = text[(text.rfind(" ", start, mark) + 1) or start : mark]
            if word and _is_abbreviation(word, first):
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
