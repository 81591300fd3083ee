"""Streaming reader for MediaWiki XML dumps (.xml, .xml.bz2, multistream .xml.bz2).

    from beam_jobs.dumps import plan_reads, read_pages
    for item in plan_reads("enwiki-...-multistream.xml.bz2"):
        for kind, record in read_pages(item):   # ("page", dict) or ("reject", dict)
            ...

A dump is never read whole. A byte scanner cuts the (decompressed) stream into
``<page>...</page>`` chunks and each chunk is parsed alone by expat (``ElementTree``), so memory
is bounded by the largest page and a malformed page is one reject, not the end of the file.

Work items let several workers share one big file:
  * plain ``.xml``: byte ranges; a page belongs to the range where its ``<page>`` tag starts;
  * multistream ``.xml.bz2`` (many independent bz2 streams, as Wikimedia publishes): groups of
    streams, found from the ``-index.txt.bz2`` beside the dump or by scanning for stream headers;
  * anything else (single-stream ``.bz2``, ``.gz``, UTF-16): one item for the whole file.

Bad input becomes rejects (source ``wikipedia``): ``truncated_input`` (a bz2 or XML file that ends
inside a page), ``malformed_xml``, ``invalid_utf8``, ``not_a_dump`` (no ``<page>`` anywhere,
e.g. an empty or binary file), ``unreadable_file``. UTF-16 dumps are transcoded, not rejected.
Used by ``beam_jobs/clean_corpus.py``.
"""

from __future__ import annotations

import bz2
import codecs
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass

from bert_core import documents as D
from bert_core import storage

BLOCK = 1 << 20
RANGE_BYTES = 4 << 20  # target XML bytes of one work item (bz2 compresses about 4:1)
MAX_PAGE_BYTES = 256 << 20  # a "page" larger than this is a broken file, not an article
_BZ2_STREAM = re.compile(rb"BZh[1-9]1AY&SY")  # stream header + first block magic
_PAGE_OPEN = b"<page>"
_PAGE_CLOSE = b"</page>"
_TITLE = re.compile(rb"<title>([^<]*)<")  # tolerant: the closing tag may be the broken part
_ID = re.compile(rb"<id>(\d+)</id>")


@dataclass(frozen=True)
class WorkItem:
    """A slice of one dump: ``kind`` is "range" (plain XML bytes), "streams" (bz2 streams in
    compressed bytes [start, end)) or "whole"."""

    uri: str
    kind: str
    start: int = 0
    end: int = -1
    last: bool = True  # the item that holds the end of the file (and its </mediawiki>)


def _is_utf16(head: bytes) -> bool:
    return head.startswith((b"\xff\xfe", b"\xfe\xff")) or head[:4] in (b"<\x00m\x00", b"\x00<\x00m")


def _bz2_stream_offsets(uri: str) -> list[int]:
    """Start offsets of the bz2 streams of a dump: from its index file if present, else by
    scanning the compressed bytes for stream headers (a false hit only costs one reject)."""
    index = re.sub(r"\.xml\.bz2$", "-index.txt.bz2", uri)
    if index != uri and storage.exists(index):
        offsets = set()
        with storage.open_file(index, "rb") as raw, bz2.open(raw, "rb") as f:
            for line in f:
                offsets.add(int(line.split(b":", 1)[0]))
        return sorted({0, *offsets})
    offsets = []
    with storage.open_file(uri, "rb") as f:
        pos, tail = 0, b""
        while block := f.read(BLOCK):
            data = tail + block
            base = pos - len(tail)
            offsets += [base + m.start() for m in _BZ2_STREAM.finditer(data)]
            tail = data[-9:]
            pos += len(block)
    return sorted(set(offsets)) or [0]


def plan_reads(uri: str, range_bytes: int = RANGE_BYTES) -> list[WorkItem]:
    """Split one dump file into work items (independent of the number of workers)."""
    total = storage.size(uri)
    with storage.open_file(uri, "rb") as f:
        head = f.read(4)
    if uri.endswith(".bz2") and head.startswith(b"BZh"):
        offsets = _bz2_stream_offsets(uri)
        if len(offsets) > 1:
            items, start = [], offsets[0]
            for off in offsets[1:]:
                if off - start >= range_bytes // 4:
                    items.append(WorkItem(uri, "streams", start, off, last=False))
                    start = off
            items.append(WorkItem(uri, "streams", start, total))
            return items
        return [WorkItem(uri, "whole")]
    if uri.endswith(".xml") and total > range_bytes and not _is_utf16(head):
        return [WorkItem(uri, "range", s, min(s + range_bytes, total), last=s + range_bytes >= total)
                for s in range(0, total, range_bytes)]
    return [WorkItem(uri, "whole")]


class _Truncated(Exception):
    pass


def _bz2_blocks(raw, limit: int | None) -> Iterator[bytes]:
    """Decompress consecutive bz2 streams; raises _Truncated if the data stops mid-stream."""
    decomp = bz2.BZ2Decompressor()
    read = 0
    while True:
        want = BLOCK if limit is None else min(BLOCK, limit - read)
        chunk = raw.read(want) if want > 0 else b""
        read += len(chunk)
        if not chunk:
            if not decomp.eof:
                raise _Truncated("the bz2 stream ends before its end-of-stream marker")
            return
        while chunk:
            if decomp.eof:
                decomp = bz2.BZ2Decompressor()
            out = decomp.decompress(chunk)
            if out:
                yield out
            chunk = decomp.unused_data if decomp.eof else b""


def _gzip_blocks(raw) -> Iterator[bytes]:
    import gzip

    with gzip.GzipFile(fileobj=raw) as f:
        try:
            while block := f.read(BLOCK):
                yield block
        except EOFError as err:
            raise _Truncated(f"gzip: {err}") from None


def _transcode_utf16(blocks: Iterator[bytes]) -> Iterator[bytes]:
    decoder = codecs.getincrementaldecoder("utf-16")(errors="strict")
    for block in blocks:
        yield decoder.decode(block).encode("utf-8")
    yield decoder.decode(b"", final=True).encode("utf-8")


def _raw_blocks(raw, limit: int | None) -> Iterator[bytes]:
    read = 0
    while True:
        want = BLOCK if limit is None else min(BLOCK, limit - read)
        block = raw.read(want) if want > 0 else b""
        if not block:
            return
        read += len(block)
        yield block


def _page_record(chunk: bytes, origin: str) -> tuple[str, dict]:
    """("page", {id, ns, title, redirect, text, origin}) or ("reject", reject) for one chunk."""
    title_m, id_m = _TITLE.search(chunk), _ID.search(chunk)
    record_id = f"wiki:{int(id_m.group(1))}" if id_m else origin
    title = title_m.group(1).decode("utf-8", "replace") if title_m else "?"
    try:
        chunk.decode("utf-8")
    except UnicodeDecodeError as err:
        return "reject", D.make_reject(
            D.WIKIPEDIA, record_id, D.INVALID_UTF8,
            f"page {title!r} at {origin}: invalid UTF-8 at byte {err.start} of the page; "
            "re-export the dump as UTF-8")
    try:
        page = ET.fromstring(chunk)
    except ET.ParseError as err:
        return "reject", D.make_reject(
            D.WIKIPEDIA, record_id, D.MALFORMED_XML, f"page {title!r} at {origin}: {err}")
    id_text = page.findtext("id")
    if not id_text or not id_text.strip().isdigit():
        return "reject", D.make_reject(
            D.WIKIPEDIA, record_id, D.MALFORMED_XML, f"page {title!r} at {origin}: no numeric <id>")
    revision = page.find("revision")
    text = revision.findtext("text") if revision is not None else None
    return "page", {
        "doc_id": f"wiki:{int(id_text)}",
        "title": page.findtext("title") or "",
        "ns": (page.findtext("ns") or "0").strip(),
        "redirect": page.find("redirect") is not None,
        "text": text or "",
        "origin": origin,
    }


def _blocks(item: WorkItem, raw) -> Iterator[bytes]:
    if item.kind == "streams":
        raw.seek(item.start)
        return _bz2_blocks(raw, item.end - item.start)
    if item.kind == "range":
        raw.seek(item.start)
        return _raw_blocks(raw, None)  # read past `end` to finish the last page
    head = raw.read(4)
    raw.seek(0)
    if head.startswith(b"BZh"):
        blocks = _bz2_blocks(raw, None)
    elif head.startswith(b"\x1f\x8b"):
        blocks = _gzip_blocks(raw)
    else:
        blocks = _raw_blocks(raw, None)
    return blocks


def _peek_utf16(blocks: Iterator[bytes]) -> Iterator[bytes]:
    first = next(blocks, b"")
    rest = (b for b in ([first] if first else []))
    chained = _chain(rest, blocks)
    return _transcode_utf16(chained) if _is_utf16(first[:4]) else chained


def _chain(*iterators: Iterator[bytes]) -> Iterator[bytes]:
    for it in iterators:
        yield from it


def read_pages(item: WorkItem) -> Iterator[tuple[str, dict]]:
    """Pages of one work item, in file order, as ("page", dict) or ("reject", dict)."""
    pages = 0
    buf = b""
    offset = item.start if item.kind == "range" else 0  # offset of buf[0] in the (decompressed) data
    seen_page = closed = False
    try:
        with storage.open_file(item.uri, "rb") as raw:
            blocks = _blocks(item, raw)
            if item.kind == "whole":
                blocks = _peek_utf16(blocks)
            for block in blocks:
                buf += block
                while True:
                    start = buf.find(_PAGE_OPEN)
                    if start < 0:
                        closed = closed or b"</mediawiki>" in buf
                        keep = len(_PAGE_OPEN) - 1  # a tag may straddle two blocks
                        offset += max(len(buf) - keep, 0)
                        buf = buf[-keep:]
                        break
                    if item.kind == "range" and offset + start >= item.end:
                        return  # the next range owns this page
                    end = buf.find(_PAGE_CLOSE, start)
                    nested = buf.find(_PAGE_OPEN, start + 1)
                    if 0 <= nested < (end if end >= 0 else len(buf)):
                        # "<page>" again before "</page>": the first page never closed
                        seen_page = True
                        pages += 1
                        yield "reject", _unclosed(buf[start:nested], item, offset + start)
                        offset += nested
                        buf = buf[nested:]
                        continue
                    if end < 0:
                        if len(buf) - start > MAX_PAGE_BYTES:
                            seen_page = True
                            pages += 1
                            yield "reject", _unclosed(buf[start : start + 4096], item, offset + start)
                            offset += len(buf)
                            buf = b""
                        elif start:
                            offset += start
                            buf = buf[start:]
                        break
                    stop = end + len(_PAGE_CLOSE)
                    seen_page = True
                    pages += 1
                    yield _page_record(buf[start:stop], f"{item.uri}@{offset + start}")
                    offset += stop
                    buf = buf[stop:]
    except _Truncated as err:
        yield "reject", _truncated(buf, item, offset, pages, str(err))
        return
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as err:
        yield "reject", D.make_reject(
            D.WIKIPEDIA, f"{item.uri}@{offset}", D.UNREADABLE_FILE,
            f"{item.uri}: cannot read past decompressed byte {offset} ({type(err).__name__}: {err}); "
            f"{pages} pages were read before it. Check the file (e.g. `bzip2 -t`) or download it again")
        return
    if _PAGE_OPEN in buf:  # the file ended inside a page
        yield "reject", _truncated(buf, item, offset, pages, "the XML ends inside a <page>")
    elif seen_page and item.last and not closed and b"</mediawiki>" not in buf:
        yield "reject", _truncated(b"", item, offset, pages, "the XML ends without </mediawiki>")
    elif not seen_page and item.start == 0:
        yield "reject", D.make_reject(
            D.WIKIPEDIA, item.uri, D.NOT_A_DUMP,
            f"{item.uri}: no <page> element found; is it a MediaWiki XML export "
            "(pages-articles*.xml[.bz2])?")


def _unclosed(chunk: bytes, item: WorkItem, at: int) -> dict:
    title_m = _TITLE.search(chunk)
    title = title_m.group(1).decode("utf-8", "replace") if title_m else "?"
    return D.make_reject(D.WIKIPEDIA, f"{item.uri}@{at}", D.MALFORMED_XML,
                         f"page {title!r} at {item.uri}@{at} has no </page>")


def _truncated(buf: bytes, item: WorkItem, offset: int, pages: int, why: str) -> dict:
    start = buf.find(_PAGE_OPEN)
    title_m = _TITLE.search(buf, max(start, 0))
    inside = f" inside page {title_m.group(1).decode('utf-8', 'replace')!r}" if start >= 0 and title_m else ""
    return D.make_reject(
        D.WIKIPEDIA, f"{item.uri}@{offset + max(start, 0)}", D.TRUNCATED_INPUT,
        f"{item.uri}: {why}{inside} after {pages} complete pages; the file is cut short, "
        "download it again")
