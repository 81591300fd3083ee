"""Wikitext -> plain paragraphs: the text passages of an article, nothing else.

    from bert_core.corpus.wikitext import wikitext_to_paragraphs
    wikitext_to_paragraphs("'''Anarchism''' is a [[political philosophy]].{{cn}}")
    # ['Anarchism is a political philosophy.']

The paper keeps "only the text passages and ignore[s] lists, tables, and headers"; no markup
reaches the corpus. Used by ``beam_jobs/clean_corpus.py`` (``bertpipe corpus``).
"""

from __future__ import annotations

import bisect
import html
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from bert_core.corpus.sentences import split_sentences

# Elements dropped with their content: citations, maths, code, galleries, ... (not prose).
_DROP_ELEMENTS = (
    "ref|references|math|chem|ce|gallery|timeline|score|syntaxhighlight|source|pre|nowiki|"
    "imagemap|table|hiero|graph|mapframe|maplink|templatedata|templatestyles|code|inputbox|"
    "categorytree|noinclude|includeonly|ol|ul|li|dl|caption|charinsert|section|indicator"
)
_COMMENT = re.compile(r"<!--.*?(?:-->|$)", re.S)
_OPEN_TAG = re.compile(rf"<({_DROP_ELEMENTS})\b[^<>]*?(/?)\s*>", re.I)
_CLOSE_TAGS: dict[str, re.Pattern[str]] = {}

# Balanced-brace tokens: templates/parser functions {{ }}, tables {| |}. A table token counts
# only at a line start (after spaces, and colons for "{|"), which the scan checks itself: a
# pattern that starts with a literal is found by a fast search, one that starts with "^" is
# tried at every character.
_BRACES = re.compile(r"\{\{|\}\}|\{\||\|\}")
_TABLE_INDENT = {"{|": " \t:", "|}": " \t"}
_LINK_TOKENS = re.compile(r"\[\[|\]\]")
_DROP_NAMESPACES = {"file", "image", "category", "media", "template", "module"}
# Sister-project prefixes whose links show their text inline (kept, unlike interlanguage links).
_SISTER = {"s", "w", "q", "n", "b", "v", "d", "m", "c", "wikt", "wikipedia", "wp",
           "wiktionary", "wikisource", "wikiquote", "commons", "meta", "species"}
_LANG_PREFIX = re.compile(r"^[a-z]{2,3}(?:-[a-z0-9]+)*$")

_HEADING = re.compile(r"^=+.*=+\s*$")
# A line starting with a space is preformatted (code), unless markup follows the space: a
# table, a link, a list, or the "}}" that closes a template spanning lines (" }}</ref> The
# text goes on": the space is inside the template's call, and the prose after it is no code).
_PRE_LINE = re.compile(r"^ (?![ \t]*(?:[{<\[|:*#]|\}\})).*$", re.M)
# Whether a line starts with a space: the regex engine finds this literal faster than
# ``str.find``, which checks its last character, a space, first.
_NEWLINE_SPACE = re.compile("\n ")
_MAGIC = re.compile(r"__[A-Z]+__")
_EXT_LINK = re.compile(r"\[(?:https?:|ftp:|//|mailto:)[^\s\]]*\s*([^\]]*)\]")
_BARE_URL = re.compile(r"\bhttps?://\S+")
_BOLD_ITALIC = re.compile(r"'{2,5}")
_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*\b[^<>]*>")
_EMPTY_BRACKETS = re.compile(r"\(\s*[,;]?\s*\)|\[\s*\]")
_SPACE_BEFORE_MARK = re.compile(r" (?=[,.;:!?])")

# What "markup" means for the residue check.
MARKUP = ("{{", "}}", "[[", "]]", "<ref", "{|", "|-", "==", "''")
_MARKUP_RE = re.compile("|".join(map(re.escape, MARKUP)))

# Where a paragraph may hold something for :func:`_inline` to change or :func:`has_markup` to
# find: a paragraph with none of these is its own text (most paragraphs of an article). Each is
# searched for over all of a page's paragraphs at once, by the fastest search there is for it
# (a character by ``memchr``, a literal by ``str.find``, a pattern with a literal prefix by the
# regex engine's prefix search): one regex of them all would try every alternative at every
# character, and one search per paragraph costs more in calls than in characters. A character
# stands for every token that holds it ("{" for "{{" and "{|"), which only sends more
# paragraphs to the exact path.
_BUSY_LITERALS = ("[", "]", "<", "&", "{", "}", "|", "__", "://", "''", "==")
_BUSY_PATTERNS = (
    re.compile(r" [ ,.;:!?]"),  # double spaces, a space before a mark (_SPACE_BEFORE_MARK)
    re.compile(r"\(\s*[,;]?\s*\)"),  # empty brackets (_EMPTY_BRACKETS; "[" is a literal above)
)
# Joins a page's paragraphs for those searches: printable (a paragraph with whitespace other
# than single spaces is found as not printable) and in no token, so no match spans two paragraphs.
_JOIN = "#"


@dataclass
class CleanStats:
    """Why a page produced fewer sentences than it might have (counted, never silent)."""

    slow_paragraphs: int = 0  # paragraphs that needed the full mwparserfromhell parse
    dropped_markup_sentences: int = 0  # sentences dropped because markup survived both paths
    notes: list[str] = field(default_factory=list)


def _drop_elements(text: str) -> str:
    """Remove ``<ref>...</ref>``-like elements with their content (and self-closing ones).

    An element that never closes ends at the paragraph end (a blank line), not the page end.
    A scan with ``find``, not one regex with a lazy ``.*?``: that checked three alternatives
    at every character of every reference.
    """
    out: list[str] = []
    pos = 0
    while m := _OPEN_TAG.search(text, pos):
        out.append(text[pos : m.start()])
        if m.group(2):  # <ref name="x" />
            pos = m.end()
            continue
        name = m.group(1).lower()
        closer = _CLOSE_TAGS.get(name)
        if closer is None:
            closer = _CLOSE_TAGS[name] = re.compile(rf"</{name}\s*>", re.I)
        close = closer.search(text, m.end())
        blank = text.find("\n\n", m.end())
        if close and (blank < 0 or close.start() < blank):
            pos = close.end()
        else:
            pos = blank if blank >= 0 else len(text)
    out.append(text[pos:])
    return "".join(out)


def _brace_tokens(text: str) -> Iterator[tuple[str, int, int]]:
    """``(token, start, end)`` of every ``{{``, ``}}`` and line-start ``{|``/``|}`` in order;
    a table token's span starts at its line start (the indent goes with it)."""
    pos = 0
    while m := _BRACES.search(text, pos):
        tok, start = m.group(), m.start()
        indent = _TABLE_INDENT.get(tok)
        if indent is not None:
            line = text.rfind("\n", 0, start) + 1
            if text[line:start].strip(indent):
                pos = start + 1  # not at a line start; a "}}" may begin at the "}"
                continue
            start = line
        yield tok, start, m.end()
        pos = m.end()


def _strip_balanced_braces(text: str) -> str:
    """Remove every ``{{...}}`` and line-start ``{|...|}`` span, nesting included.

    An opener that never closes removes text up to the next blank line only (a stray ``{{`` in
    an article must not swallow the rest of it).
    """
    if "{" not in text and "}" not in text:
        return text
    out: list[str] = []
    stack: list[tuple[str, int]] = []  # (kind, start offset) of open spans
    last = 0
    for tok, start, end in _brace_tokens(text):
        if tok in ("{{", "{|"):
            if not stack:
                out.append(text[last:start])
            stack.append((tok, start))
        elif stack:
            want = "{{" if tok == "}}" else "{|"
            # close the innermost span of the same kind; a mismatched closer is ignored
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] == want:
                    del stack[i:]
                    break
            if not stack:
                last = end
        else:  # a closer with nothing open: residue, drop the token itself
            out.append(text[last:start])
            last = end
    if stack:
        start = stack[0][1]
        blank = text.find("\n\n", start)
        if blank >= 0:
            return "".join(out) + _strip_balanced_braces(text[blank:])
        return "".join(out)
    out.append(text[last:])
    return "".join(out)


def _link_text(inner: str) -> str | None:
    """Display text of ``[[inner]]``, or None when the link is not shown as text."""
    target, pipe, label = inner.partition("|")
    prefix, colon, _ = target.partition(":")
    if colon and not target.startswith(":"):
        ns = prefix.strip().lower()
        if ns in _DROP_NAMESPACES:
            return None
        if not pipe and ns not in _SISTER and _LANG_PREFIX.match(ns):
            return None  # interlanguage link (e.g. [[de:Anarchismus]])
    if pipe:
        label = label.strip()
        if label:
            return label.rsplit("|", 1)[-1]
        # pipe trick: [[Paris, Texas|]] -> "Paris"
        return re.sub(r"\s*\(.*\)$", "", target.split(",", 1)[0]).lstrip(":").strip()
    return target.lstrip(":").split("#", 1)[0].strip() or target.strip("#")


def _replace_links(text: str) -> str:
    """``[[a|b]]`` -> b, ``[[a]]`` -> a; file/category/interlanguage links removed whole
    (their captions may hold nested links, hence the balanced scan)."""
    if ("[" not in text or "[[" not in text) and ("]" not in text or "]]" not in text):
        return text  # (a character is found faster than two)
    out: list[str] = []
    starts: list[int] = []
    pieces: list[list[str]] = [out]
    last = 0
    for m in _LINK_TOKENS.finditer(text):
        pieces[-1].append(text[last : m.start()])
        last = m.end()
        if m.group() == "[[":
            starts.append(m.start())
            pieces.append([])
        elif starts:
            starts.pop()
            inner = "".join(pieces.pop())
            shown = _link_text(inner)
            if shown is not None:
                pieces[-1].append(shown)
        # a stray "]]" is dropped
    pieces[-1].append(text[last:])
    while len(pieces) > 1:  # unclosed "[[": keep its text, drop the brackets
        inner = "".join(pieces.pop())
        pieces[-1].append(inner)
    return "".join(out)


def prescan(wikitext: str) -> str:
    """The fast cut: comments, preformatted lines, dropped elements, templates, tables,
    non-text links."""
    text = _COMMENT.sub("", wikitext) if "<" in wikitext else wikitext
    if text.startswith(" ") or _NEWLINE_SPACE.search(text):
        # judged on the raw text, as removals later leave harmless spaces at line starts
        text = _PRE_LINE.sub("", text)
    if "<" in text:
        text = _drop_elements(text)
    text = _strip_balanced_braces(text)
    return _replace_links(text)


def _paragraph_lines(text: str) -> list[str]:
    """Group text lines into paragraphs; headings, lists, tables rows and rules end one.

    A line indented with ``:`` is an indented paragraph (a quotation, or the prose of a
    definition), not a list item: it is kept as a paragraph of its own.
    """
    paragraphs: list[str] = []
    current: list[str] = []
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped and (stripped[0] not in _LINE_MARKS or _is_text_line(stripped)):
            current.append(stripped)
            continue
        if current:
            paragraphs.append(" ".join(current))
            current = []
        if stripped[:1] == ":" and stripped.lstrip(":").strip():
            paragraphs.append(stripped.lstrip(":").strip())
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs


# The first characters of the lines that may not be text (:func:`_is_text_line`): a line
# that starts with none of them is text.
_LINE_MARKS = "*#:;|!=-"


def _is_text_line(stripped: str) -> bool:
    """Whether a stripped, non-empty line is text: not a list item, an indented line, a
    table row, a heading or a rule."""
    return not (
        stripped[0] in "*#:;|!"
        or (stripped[0] == "=" and _HEADING.match(stripped))
        or stripped.startswith("----")
    )


def _inline(paragraph: str) -> str:
    # Each substitution runs only if its trigger is present: most paragraphs need few of them.
    text = paragraph
    if "__" in text:
        text = _MAGIC.sub("", text)
    if "[" in text:
        text = _EXT_LINK.sub(r"\1", text)
    if "://" in text:
        text = _BARE_URL.sub("", text)
    if "''" in text:
        text = _BOLD_ITALIC.sub("", text)
    if "<" in text:
        text = _TAG.sub("", text)
    if "&" in text:
        text = html.unescape(text)
    text = _single_spaced(text)
    cut = 0
    if _has_empty_brackets(text):  # "(; born 1920)" leftovers of removed templates
        text, cut = _EMPTY_BRACKETS.subn("", text)
    if " " in text:  # "word ." left where a template or reference was cut
        text = _SPACE_BEFORE_MARK.sub("", text)
    return " ".join(text.split()) if cut else text


def _single_spaced(text: str) -> str:
    """``" ".join(text.split())``, without the split when the text already is: every
    whitespace character but the space is unprintable, so a printable text with no double or
    edge spaces has nothing to change."""
    if text.isprintable() and "  " not in text and text[:1] != " " and text[-1:] != " ":
        return text
    return " ".join(text.split())


def _has_empty_brackets(text: str) -> bool:
    """Whether :data:`_EMPTY_BRACKETS` matches: ``(``, spaces, an optional ``,`` or ``;``,
    spaces, ``)``; or ``[``, spaces, ``]`` (a few ``find`` calls, cheaper than the regex
    search on a paragraph with brackets and none empty)."""
    for opener, closer, marks in (("(", ")", ",;"), ("[", "]", "")):
        i = text.find(opener)
        while i >= 0:
            j = _skip_spaces(text, i + 1)
            if marks and text[j : j + 1] in (",", ";"):
                j = _skip_spaces(text, j + 1)
            if text[j : j + 1] == closer:
                return True
            i = text.find(opener, i + 1)
    return False


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def has_markup(text: str) -> bool:
    return _MARKUP_RE.search(text) is not None


def _slow_paragraph(raw: str) -> str:
    """The exact path: mwparserfromhell on one paragraph (imported only when needed)."""
    import mwparserfromhell

    code = mwparserfromhell.parse(raw)
    return _inline(code.strip_code(normalize=True, collapse=True, keep_template_params=False))


def _without_markup_sentences(text: str, stats: CleanStats) -> str:
    """The sentences of ``text`` that show no markup, joined; each one left out is counted."""
    kept = []
    for sentence in split_sentences(text):
        if has_markup(sentence):
            stats.dropped_markup_sentences += 1
        else:
            kept.append(sentence)
    return " ".join(kept)


def wikitext_to_paragraphs(wikitext: str, stats: CleanStats | None = None) -> list[str]:
    """Text paragraphs of an article in page order (no headings, lists, tables, templates).

    A fast scanner (:func:`prescan`) cuts templates, references, tables and file/category links
    first, then a light pass turns what is left (links, bold/italic, inline tags, headings, lists)
    into text. A paragraph that still shows markup after that goes through ``mwparserfromhell``
    (the slow, exact path), and a sentence of its result that *still* shows markup is dropped and
    counted (``CleanStats.dropped_markup_sentences``), so no markup reaches the corpus.
    """
    stats = stats if stats is not None else CleanStats()
    paragraphs = _paragraph_lines(prescan(wikitext))
    for i in _busy_paragraphs(paragraphs):
        paragraphs[i] = _clean_paragraph(paragraphs[i], stats)
    return [text for text in paragraphs if text]


def _clean_paragraph(raw: str, stats: CleanStats) -> str:
    """One paragraph's text: the light pass, then the slow path where markup is left."""
    text = _inline(raw)
    if has_markup(text):
        stats.slow_paragraphs += 1
        text = _slow_paragraph(raw)
        if has_markup(text):
            text = _without_markup_sentences(text, stats)
    return text


def _busy_paragraphs(paragraphs: list[str]) -> list[int]:
    """Indices (ascending) of the paragraphs that may hold something for :func:`_inline` or
    :func:`has_markup` (:data:`_BUSY_LITERALS`, :data:`_BUSY_PATTERNS`, or whitespace other than
    single spaces); every other paragraph is its own text. The paragraphs are stripped
    (:func:`_paragraph_lines`), so none has a space at either end."""
    joined = _JOIN.join(paragraphs)
    # ends[i]: the offset just after paragraph i and its separator (where paragraph i + 1 starts)
    ends = list(itertools.accumulate(len(p) + 1 for p in paragraphs))
    busy: set[int] = set()

    def busy_at(at: int) -> int:
        """Marks the paragraph that holds offset ``at``; returns where the next one starts."""
        i = bisect.bisect_right(ends, at)
        busy.add(i)
        return ends[i]

    for literal in _BUSY_LITERALS:
        at = joined.find(literal)
        while at >= 0:
            at = joined.find(literal, busy_at(at))
    for pattern in _BUSY_PATTERNS:
        m = pattern.search(joined)
        while m:
            m = pattern.search(joined, busy_at(m.start()))
    if not joined.isprintable():
        busy.update(i for i, p in enumerate(paragraphs) if not p.isprintable())
    return sorted(busy)


def is_redirect(wikitext: str) -> bool:
    return wikitext.lstrip()[:9].upper() == "#REDIRECT"
