"""Books -> paragraphs: Project Gutenberg boilerplate removed, hard-wrapped lines re-joined.

    from bert_core.corpus.books import book_paragraphs
    title, paragraphs = book_paragraphs("botchan.txt", open("botchan.txt", "rb").read())

One book is one document: ``.txt`` (and ``.txt.gz``) books are plain text, ``.md`` files are
plays (Shakespeare in Markdown). A file that is not a book raises :class:`BookError`.
Used by ``beam_jobs/clean_corpus.py`` (``bertpipe corpus --books GLOB``).
"""

from __future__ import annotations

import re

from bert_core.corpus import documents as D
from bert_core.corpus.documents import MAX_LINE_CHARS
from bert_core.failures import Refusal

# Longest line a wrapped book may have; a longer one is not a book (and would be one "paragraph").

_GUTENBERG_START = re.compile(
    r"^\s*\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\s*\*END\*THE SMALL PRINT.*$",
    re.I | re.M,
)
_GUTENBERG_END = re.compile(
    r"^\s*\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\s*End of (?:the )?Project Gutenberg.*$",
    re.I | re.M,
)
_PRODUCED_BY = re.compile(r"^\s*(?:Produced|Prepared|Transcribed) by\b.*$", re.I)
_SENTENCE_END = re.compile(r"[.!?:\"'\u201d\u2019)\]]$")


class BookError(ValueError, Refusal):
    """A file among the books that is not a readable book; ``reason`` names the reject.

    Reasons: ``empty_file``, ``binary_file``, ``invalid_utf8``, ``line_too_long`` (e.g. a 50 MB
    single line).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def decode_book(name: str, data: bytes) -> str:
    """UTF-8 text of a book file, or :class:`BookError` saying why it is not one."""
    if not data.strip():
        raise BookError("empty_file", f"{name} is empty; remove it or add the book text")
    head = data[:8192]
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return _normalize_newlines(data.decode("utf-16"))
        except UnicodeDecodeError as err:
            raise BookError("invalid_utf16", f"{name}: {err}") from None
    controls = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13))
    if b"\x00" in head or controls > len(head) // 100:
        raise BookError(
            "binary_file", f"{name} looks binary ({controls} control bytes in the first "
            f"{len(head)}); only UTF-8 text books are read"
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise BookError(
            "invalid_utf8", f"{name}: invalid UTF-8 at byte {err.start}; re-encode it, e.g. "
            "`iconv -f latin1 -t utf-8`"
        ) from None
    return _normalize_newlines(text)


def _normalize_newlines(text: str) -> str:
    """Unix newlines, and no NUL characters (stray NULs of a text file are never words)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")


def _check_lines(name: str, text: str) -> None:
    for number, line in enumerate(text.split("\n"), 1):
        if len(line) > MAX_LINE_CHARS:
            raise BookError(
                D.LINE_TOO_LONG, f"{name}: line {number} has {len(line):,} characters (limit "
                f"{MAX_LINE_CHARS:,}); a book is expected to be wrapped text, one paragraph a line at most"
            )


def strip_gutenberg(text: str) -> str:
    """The book between Project Gutenberg's START and END markers (all of it if none).

    The markers are the ``*** START/END OF ... ***`` lines around the header and licence footer.
    """
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
        lines = text.lstrip("\n").split("\n", 1)
        if _PRODUCED_BY.match(lines[0]):
            text = lines[1] if len(lines) > 1 else ""
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def _is_heading(line: str) -> bool:
    """Chapter titles and the like: short, no sentence punctuation, mostly capitals."""
    if len(line) >= 60:
        return False
    letters = [c for c in line if c.isalpha()]
    return bool(letters) and sum(c.isupper() for c in letters) > 0.6 * len(letters)


def unwrap(text: str) -> list[str]:
    """Join hard-wrapped lines into paragraphs; headings are dropped.

    A blank line, an indented line, a heading or a short line ending a sentence closes a
    paragraph, so books stored without blank lines still work.
    """
    lines = text.split("\n")
    lengths = sorted(len(x.rstrip()) for x in lines if len(x.strip()) > 20)
    # The wrap width: most lines of a wrapped book are close to it.
    width = lengths[int(len(lengths) * 0.8)] if lengths else 0
    paragraphs: list[str] = []
    current: list[str] = []

    def close() -> None:
        if current:
            paragraphs.append(" ".join(current))
            current.clear()

    for raw in lines:
        line = raw.strip()
        if not line:
            close()
            continue
        if _is_heading(line):
            close()
            continue
        if raw[:1] in " \t" and current:
            close()  # an indented line starts a new paragraph
        current.append(line)
        # a line well short of the wrap width that ends a sentence ends its paragraph
        if width and len(raw.rstrip()) < 0.7 * width and _SENTENCE_END.search(line):
            close()
    close()
    return paragraphs


_MD_HEADING = re.compile(r"^\s*#{1,6}\s")
_MD_SPEAKER = re.compile(r"^\s*\*\*[^*]+\*\*\s*$")
_MD_DIRECTION = re.compile(r"(?<![\w\\])_+[^_]*?_+(?!\w)", re.S)  # _Enter X_ / _\[Aside]_
_MD_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_MD_BRACKET_DIRECTION = re.compile(r"\*?\[[^\]\n]*\]\*?")


def play_paragraphs(markdown: str) -> tuple[str | None, list[str]]:
    """(title, one paragraph per speech) of a play in Markdown.

    Headings (act/scene), speaker labels (``**HAMLET**``) and italic stage directions
    (``_Enter Ghost_``, ``_[Aside]_``) are dropped; Markdown escapes (a backslash before ``[``)
    are undone.
    """
    title_match = re.search(r"^#\s+(.+)$", markdown, re.M)
    text = _MD_DIRECTION.sub("\n\n", markdown)
    paragraphs: list[str] = []
    current: list[str] = []
    for raw in text.split("\n"):
        line = raw.strip()
        if not line or _MD_HEADING.match(line) or _MD_SPEAKER.match(line):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        line = _MD_ESCAPE.sub(r"\1", line)
        line = _MD_BRACKET_DIRECTION.sub("", line).replace("**", "").strip()
        if line:
            current.append(line)
    if current:
        paragraphs.append(" ".join(current))
    return (title_match.group(1).strip() if title_match else None), paragraphs


def book_paragraphs(name: str, data: bytes) -> tuple[str, list[str]]:
    """(title, paragraphs) of one book file; ``name`` picks the format (``.md`` = play)."""
    text = decode_book(name, data)
    _check_lines(name, text)
    stem = book_stem(name)
    if name.endswith(".md"):
        title, paragraphs = play_paragraphs(text)
        return title or stem, paragraphs
    title_match = re.search(r"^\s*Title:\s*(.+)$", text[:5000], re.M)
    title = title_match.group(1).strip() if title_match else stem
    return title, unwrap(strip_gutenberg(text))


def book_stem(name: str) -> str:
    """``/x/botchan.txt.gz`` -> ``botchan``."""
    base = name.rsplit("/", 1)[-1]
    for suffix in (".gz", ".txt", ".md"):
        base = base.removesuffix(suffix)
    return base
