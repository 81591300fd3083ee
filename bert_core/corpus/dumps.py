"""Streaming reader for MediaWiki XML dumps (.xml, .xml.bz2, multistream .xml.bz2).

    from bert_core.corpus.dumps import plan_reads, read_pages
    for item in plan_reads("enwiki-...-multistream.xml.bz2"):
        for kind, record in read_pages(item):   # ("page", dict), ("reject", dict) or ("cut", Cut)
            ...

A dump is never read whole: memory is bounded by the largest page, and a malformed page is one
reject, not the end of the file. A file that breaks off is one :class:`Cut`, which becomes its
reject once the pages read from the whole file are counted (:func:`cut_rejects`).
"""

from __future__ import annotations

import bz2
import codecs
import itertools
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from bert_core import storage
from bert_core.corpus import documents as D

# Work items and rejects:
#
# Work items let several workers share one big file, planned from its size alone (the driver
# never reads a dump through):
#   * plain ``.xml``: byte ranges; a page belongs to the range where its ``<page>`` tag starts;
#   * ``.xml.bz2``, single stream (Wikimedia's ``pages-articles.xml.bz2``, our sample excerpt) or
#     multistream (many bz2 streams back to back, Wikimedia's ``-multistream`` dumps): ranges of
#     compressed bytes, "blocks" (``split_single_stream=False`` keeps one item). A bz2 block
#     starts at a 48-bit magic at any bit offset and decompresses alone
#     (``bert_core/corpus/bz2_blocks.py``), so an item finds the first block that starts in its
#     range, reads the blocks that start there and reads on into later blocks (and later streams)
#     only to finish its last page: the ``<page>`` rule of byte ranges, with blocks for bytes.
#     Each item scans only its own range for blocks, so the scan of a big dump is shared out
#     over the workers. A block that does not decompress is skipped by the item it starts in
#     and reported there; an item that meets it while reading on stops silently. Page origins
#     of these items read ``file@bit<B>+<N>``: byte N of the block whose magic is at bit B;
#   * anything else (``.gz``, UTF-16, a small ``.bz2``): one item for the whole file.
#
# Bad input becomes rejects (source ``wikipedia``): ``truncated_input`` (a bz2, gzip or XML file
# that breaks off: a Cut, counted as one record read), ``malformed_xml``, ``invalid_utf8``,
# ``not_a_dump`` (no ``<page>`` anywhere, e.g. an empty or binary file), ``unreadable_file``.
# UTF-16 dumps are transcoded, not rejected.
# Used by ``beam_jobs/clean_corpus.py``.

BLOCK = 1 << 20
RANGE_BYTES = 4 << 20  # target XML bytes of one work item (bz2 compresses about 4:1)
PIECE_BYTES = 64 << 10  # compressed bytes fed to a decompressor at a time
MAX_PAGE_BYTES = 256 << 20  # a "page" larger than this is a broken file, not an article
_PAGE_OPEN = b"<page>"
_PAGE_CLOSE = b"</page>"
_TITLE = re.compile(rb"<title>([^<]*)<")  # tolerant: the closing tag may be the broken part
_ID = re.compile(rb"<id>(\d+)</id>")


@dataclass(frozen=True)
class WorkItem:
    """A slice of one dump: ``kind`` is "range" (plain XML bytes), "blocks" (the bz2 blocks
    whose magic starts in compressed bytes [start, end)) or "whole"."""

    uri: str
    kind: str
    start: int = 0
    end: int = -1
    last: bool = True  # the item that holds the end of the file (and its </mediawiki>)


def _is_utf16(head: bytes) -> bool:
    return head.startswith((b"\xff\xfe", b"\xfe\xff")) or head[:4] in (b"<\x00m\x00", b"\x00<\x00m")


def plan_reads(uri: str, range_bytes: int = RANGE_BYTES, split_single_stream: bool = True) -> list[WorkItem]:
    """Split one dump file into work items (independent of the number of workers), from its
    size and first bytes only: the items find their own bz2 blocks.

    ``split_single_stream=False`` keeps a ``.bz2`` as one "whole" item (to compare a split read
    with the whole file; ``WorkItem(uri, "whole")`` reads any file whole)."""
    total = storage.size(uri)
    with storage.open_file(uri, "rb") as f:
        head = f.read(10)
    if uri.endswith(".bz2") and head.startswith(b"BZh"):
        if _is_utf16(_bz2_text_head(uri)):
            return [WorkItem(uri, "whole")]  # splits would cut UTF-16 code units apart
        # About one level-9 block of text (900 kB of XML, ~250 kB compressed) per item for a
        # small file, so the 1.7 MB sample still spreads evenly over two workers; an eighth of a
        # mid-sized file; about 16 blocks for a big one. An item decompresses one block more
        # than it owns (to finish its last page), so the fewer the items, the less of that,
        # and eight items, or thousands for a big dump, are plenty to share out.
        step = max(min(total // 8, range_bytes), range_bytes // 16, 1)
        if split_single_stream and total > step and _bz2_head_ok(head):
            return [WorkItem(uri, "blocks", s, min(s + step, total), last=s + step >= total)
                    for s in range(0, total, step)]
        return [WorkItem(uri, "whole")]
    if uri.endswith(".xml") and total > range_bytes and not _is_utf16(head):
        return [WorkItem(uri, "range", s, min(s + range_bytes, total), last=s + range_bytes >= total)
                for s in range(0, total, range_bytes)]
    return [WorkItem(uri, "whole")]


def _bz2_text_head(uri: str, limit: int = 4 << 20) -> bytes:
    """The first decompressed bytes of a ``.bz2`` file (its first block, at most ``limit``
    compressed bytes read): enough to tell the text encoding before splitting the file."""
    decompressor = bz2.BZ2Decompressor()
    out = b""
    with storage.open_file(uri, "rb") as f:
        read = 0
        while len(out) < 4 and read < limit and not decompressor.eof:
            chunk = f.read(PIECE_BYTES)
            if not chunk:
                break
            read += len(chunk)
            try:
                out += decompressor.decompress(chunk, max_length=4096)
            except (OSError, EOFError):
                break  # a corrupt head is the reader's to report
    return out


def _bz2_head_ok(head: bytes) -> bool:
    """``BZh`` + level digit and the first block's magic: a stream we can split by block."""
    from bert_core.corpus.bz2_blocks import BLOCK_MAGIC

    return (len(head) == 10 and head[3:4] in b"123456789"
            and int.from_bytes(head[4:10], "big") == BLOCK_MAGIC)


class _Truncated(Exception):
    pass


@dataclass(frozen=True)
class Cut:
    """Where a dump file breaks off (a bz2 or gzip stream without its end, XML without its end):
    ``at`` is the reject id (the place in the decompressed data), ``why`` what is missing.

    The work item that meets the end knows only its own pages; the reject names the pages read
    from the whole file, so the caller counts them over every item of the file."""

    uri: str
    at: str
    why: str

    def reject(self, pages: int) -> D.Reject:
        size = storage.size(self.uri)
        return D.make_reject(
            D.WIKIPEDIA, self.at, D.TRUNCATED_INPUT,
            f"{self.uri} is cut short at byte {size:,}: {self.why}; {pages:,} pages were read before the cut")


def cut_rejects(parts: Iterable[tuple[int, list[Cut]]]) -> list[D.Reject]:
    """The rejects of the cuts of one file, from ``(pages read, cuts met)`` of each of its work
    items."""
    parts = list(parts)
    pages = sum(n for n, _ in parts)
    return [cut.reject(pages) for _, cuts in parts for cut in cuts]


class _BlockFeed:
    """What reading a "blocks" item learned, for read_pages: where the data of its own blocks
    ends (``bound``, a decompressed offset; None while still in them), whether its own blocks
    reached the end of the stream, whether it stopped at a bad block while reading on (a later
    item reports that block), corrupt blocks it skipped, and block starts for page origins."""

    def __init__(self, item: WorkItem):
        self.item = item
        self.bound: int | None = None
        self.eos = self.stopped = False
        self.corrupt: list[int] = []
        self.starts: list[tuple[int, int]] = []  # (decompressed offset, bit offset of the block)

    def where(self, pos: int) -> str:
        for start, bit in reversed(self.starts):
            if start <= pos:
                return f"{self.item.uri}@bit{bit}+{pos - start}"
        return f"{self.item.uri}@bit{self.item.start * 8}"

    def blocks(self, raw) -> Iterator[bytes]:
        from bert_core.corpus.bz2_blocks import BlockReader, Corrupt, Truncated

        item = self.item
        header = raw.read(4)
        reader = BlockReader(raw, item.start, header)
        blocks = reader.blocks(item.start * 8, item.end * 8)
        produced = 0
        while True:
            try:
                block = next(blocks, None)
            except (Truncated, Corrupt) as err:
                if err.bit is not None and err.bit >= item.end * 8:
                    self.stopped = True  # in a later item's block: that item reports it
                    return
                if isinstance(err, Truncated):
                    raise _Truncated("the bz2 stream ends before its end-of-stream marker") from None
                raise OSError(f"{err}; the pages in it are lost") from None
            finally:
                # a magic in range that does not decompress: a false match inside a block that
                # started earlier, or a corrupt block of ours (reported, never silently lost)
                for bit in reader.undecodable:
                    if not reader.inside_block(bit):
                        self.corrupt.append(bit)
                reader.undecodable.clear()
            if block is None:
                return
            if not block.owned and self.bound is None:
                self.bound = produced
            self.eos = self.eos or (block.owned and block.last)
            if not self.starts or self.starts[-1][1] != block.bit:  # (later blocks come in pieces)
                self.starts.append((produced, block.bit))
            produced += len(block.data)
            yield block.data


def _bz2_blocks(raw) -> Iterator[bytes]:
    """Decompress consecutive bz2 streams; raises _Truncated if the data stops mid-stream."""
    decomp = bz2.BZ2Decompressor()
    while True:
        chunk = raw.read(BLOCK)
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


def _blocks(item: WorkItem, raw, feed: _BlockFeed | None) -> Iterator[bytes]:
    if feed is not None:
        return feed.blocks(raw)
    if item.kind == "range":
        raw.seek(item.start)
        return _raw_blocks(raw, None)  # read past `end` to finish the last page
    head = raw.read(4)
    raw.seek(0)
    if head.startswith(b"BZh"):
        blocks = _bz2_blocks(raw)
    elif head.startswith(b"\x1f\x8b"):
        blocks = _gzip_blocks(raw)
    else:
        blocks = _raw_blocks(raw, None)
    return blocks


def _peek_utf16(blocks: Iterator[bytes]) -> Iterator[bytes]:
    first = next(blocks, b"")
    chained = itertools.chain([first] if first else [], blocks)
    return _transcode_utf16(chained) if _is_utf16(first[:4]) else chained


def read_pages(item: WorkItem) -> Iterator[tuple[str, dict | Cut]]:
    """Pages of one work item, in file order, as ("page", dict) or ("reject", dict), and
    ("cut", :class:`Cut`) last where the file breaks off.

    A byte scanner cuts the (decompressed) stream into ``<page>...</page>`` chunks and each chunk
    is parsed alone by expat (``ElementTree``).
    """
    pages = 0
    buf = b""
    pos = 0  # buf[:pos] is read; pages are cut from buf in place and buf is trimmed once a block
    offset = item.start if item.kind == "range" else 0  # offset of buf[0] in the (decompressed) data
    seen_page = closed = False
    feed = _BlockFeed(item) if item.kind == "blocks" else None
    where = feed.where if feed else lambda at: f"{item.uri}@{at}"
    try:
        with storage.open_file(item.uri, "rb") as raw:
            blocks = _blocks(item, raw, feed)
            if item.kind == "whole":
                blocks = _peek_utf16(blocks)
            for block in blocks:
                buf, offset, pos = buf[pos:] + block, offset + pos, 0
                while True:
                    start = buf.find(_PAGE_OPEN, pos)
                    if start < 0:
                        closed = closed or buf.find(b"</mediawiki>", pos) >= 0
                        pos = max(len(buf) - (len(_PAGE_OPEN) - 1), pos)  # a tag may straddle two blocks
                        break
                    bound = item.end if item.kind == "range" else feed.bound if feed else None
                    if bound is not None and offset + start >= bound:
                        yield from _corrupt_blocks(feed)
                        return  # the next range (or the item of the next blocks) owns this page
                    end = buf.find(_PAGE_CLOSE, start)
                    # (searched up to the "</page>" only: a "<page>" cannot straddle it)
                    nested = buf.find(_PAGE_OPEN, start + 1, end if end >= 0 else len(buf))
                    if nested >= 0:
                        # "<page>" again before "</page>": the first page never closed
                        seen_page = True
                        pages += 1
                        yield "reject", _unclosed(buf[start:nested], where(offset + start))
                        pos = nested
                        continue
                    if end < 0:
                        if len(buf) - start > MAX_PAGE_BYTES:
                            seen_page = True
                            pages += 1
                            yield "reject", _unclosed(buf[start : start + 4096], where(offset + start))
                            pos = len(buf)
                        else:
                            pos = start
                        break
                    stop = end + len(_PAGE_CLOSE)
                    seen_page = True
                    pages += 1
                    yield _page_record(buf[start:stop], where(offset + start))
                    pos = stop
    except _Truncated as err:
        buf, offset = buf[pos:], offset + pos
        yield from _corrupt_blocks(feed)
        yield "cut", _cut(buf, item, where, offset, str(err))
        return
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as err:
        offset += pos
        yield from _corrupt_blocks(feed)
        yield "reject", D.make_reject(
            D.WIKIPEDIA, where(offset), D.UNREADABLE_FILE,
            f"{item.uri}: cannot read past decompressed byte {offset} ({type(err).__name__}: {err}); "
            f"{pages} pages were read before it. Check the file (e.g. `bzip2 -t`) or download it again")
        return
    buf, offset = buf[pos:], offset + pos
    yield from _corrupt_blocks(feed)
    if feed and feed.stopped:
        return  # stopped at a later item's bad block, which that item reports
    last = feed.eos if feed else item.last
    if _PAGE_OPEN in buf:  # the file ended inside a page
        yield "cut", _cut(buf, item, where, offset, "the XML ends inside a <page>")
    elif seen_page and last and not closed and b"</mediawiki>" not in buf:
        yield "cut", _cut(b"", item, where, offset, "the XML ends without </mediawiki>")
    elif not seen_page and item.start == 0:
        yield "reject", D.make_reject(
            D.WIKIPEDIA, item.uri, D.NOT_A_DUMP,
            f"{item.uri}: no <page> element found; is it a MediaWiki XML export "
            "(pages-articles*.xml[.bz2])?")


def _corrupt_blocks(feed: _BlockFeed | None) -> Iterator[tuple[str, dict]]:
    """One unreadable_file reject per corrupt bz2 block an item skipped (its pages are lost)."""
    for bit in feed.corrupt if feed else ():
        yield "reject", D.make_reject(
            D.WIKIPEDIA, f"{feed.item.uri}@bit{bit}", D.UNREADABLE_FILE,
            f"{feed.item.uri}: the bz2 block at bit {bit} does not decompress; the pages in it are "
            "lost. Check the file (e.g. `bzip2 -t`) or download it again")
    if feed:
        feed.corrupt.clear()


def _unclosed(chunk: bytes, at: str) -> dict:
    title_m = _TITLE.search(chunk)
    title = title_m.group(1).decode("utf-8", "replace") if title_m else "?"
    return D.make_reject(D.WIKIPEDIA, at, D.MALFORMED_XML, f"page {title!r} at {at} has no </page>")


def _cut(buf: bytes, item: WorkItem, where: Callable[[int], str], offset: int, why: str) -> Cut:
    start = buf.find(_PAGE_OPEN)
    title_m = _TITLE.search(buf, max(start, 0))
    inside = f" inside page {title_m.group(1).decode('utf-8', 'replace')!r}" if start >= 0 and title_m else ""
    return Cut(item.uri, where(offset + max(start, 0)), why + inside)
