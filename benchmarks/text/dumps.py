"""Wikipedia dumps made from other dumps for the benchmarks: a dump cut into its pages, a page
renumbered for a copy, pages written as a multistream ``.xml.bz2`` with its index."""

from __future__ import annotations

import bz2
import re
from pathlib import Path

STREAM_PAGES = 100  # pages a bz2 stream of a multistream dump, as Wikimedia publishes them


def split_dump(xml: bytes) -> tuple[bytes, list[bytes], bytes]:
    """A dump's bytes before the first page, each ``<page>`` element, and the bytes after the last."""
    pages, at = [], xml.find(b"<page>")
    head_end = end = at if at >= 0 else len(xml)
    while at >= 0:
        end = xml.index(b"</page>", at) + len(b"</page>")
        pages.append(xml[at:end])
        at = xml.find(b"<page>", end)
    return xml[:head_end], pages, xml[end:]


def renumbered(page: bytes, copy: int) -> bytes:
    """Copy ``copy`` of a page: its id + copy x 10,000,000 and " (copy)" after its title (copy 0:
    the page itself)."""
    if not copy:
        return page
    page = page.replace(b"</title>", f" ({copy})</title>".encode(), 1)
    return re.sub(rb"<id>(\d+)</id>", lambda m: b"<id>%d</id>" % (int(m.group(1)) + copy * 10_000_000), page, count=1)


def write_multistream(header: bytes, pages: list[bytes], footer: bytes, dump: Path) -> Path:
    """Pages as a multistream ``.xml.bz2`` (a bz2 stream of ``STREAM_PAGES`` pages at a time, one
    page a line) with its ``-index.txt.bz2`` beside it (offset:id:title a page)."""
    index = []
    with open(dump, "wb") as f:
        f.write(bz2.compress(header))
        for i in range(0, len(pages), STREAM_PAGES):
            offset = f.tell()
            for page in pages[i : i + STREAM_PAGES]:
                page_id = re.search(rb"<id>(\d+)</id>", page).group(1).decode()
                title = re.search(rb"<title>(.*?)</title>", page).group(1).decode()
                index.append(f"{offset}:{page_id}:{title}\n")
            f.write(bz2.compress(b"".join(page + b"\n" for page in pages[i : i + STREAM_PAGES])))
        f.write(bz2.compress(footer))
    index_name = dump.name.replace(".xml.bz2", "-index.txt.bz2")
    (dump.parent / index_name).write_bytes(bz2.compress("".join(index).encode()))
    return dump
