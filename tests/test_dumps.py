"""bert_core/corpus/dumps.py + bert_core/corpus/bz2_blocks.py: a single-stream .bz2 dump split by bz2 block.

Real files built with the stdlib ``bz2`` at compresslevel=1 (100 kB blocks), read item by item
and by a real Beam job with 1 and 2 workers."""

from __future__ import annotations

import bz2
import hashlib
import json
import random
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

from bert_core import storage
from bert_core.config import CorpusConfig
from bert_core.corpus.bz2_blocks import BLOCK_MAGIC, BlockReader, find_magics
from bert_core.corpus.dumps import WorkItem, plan_reads, read_pages

HEAD = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
        "  <siteinfo><sitename>Test</sitename></siteinfo>\n")
WORDS = ("river town bridge canal lake mill road church school market hill forest valley harbour "
         "station castle tower garden field village island coast plain north south east west").split()
RANGE = 400_000  # -> 25 kB of compressed bytes per "blocks" item, about one 100 kB block


def page_xml(page_id: int, rng: random.Random) -> str:
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
                 for _ in range(rng.randint(5, 60))]
    return (f"  <page>\n    <title>Page {page_id}</title>\n    <ns>0</ns>\n    <id>{page_id}</id>\n"
            f"    <revision><id>1</id><text xml:space=\"preserve\">{escape(' '.join(sentences))}</text>"
            "</revision>\n  </page>\n")


@pytest.fixture(scope="module")
def xml() -> bytes:
    rng = random.Random(7)
    return (HEAD + "".join(page_xml(10 + i, rng) for i in range(300)) + "</mediawiki>\n").encode()


@pytest.fixture(scope="module")
def single(xml, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("single") / "wiki.xml.bz2"
    path.write_bytes(bz2.compress(xml, compresslevel=1))
    return path


def read(items: list[WorkItem]) -> list[tuple[str, str]]:
    return [(kind, "truncated_input" if kind == "cut" else r.get("doc_id") or r["reason"])
            for item in items for kind, r in read_pages(item)]


def test_magic_found_at_every_bit_offset() -> None:
    rng = random.Random(1)
    for shift in range(8):
        bits = 16 * 8 + shift  # random bytes, then the magic `shift` bits into a byte
        tail = 40 + (8 - shift) % 8  # whole bytes in all
        value = (rng.getrandbits(bits) << 48 | BLOCK_MAGIC) << tail | rng.getrandbits(tail)
        data = value.to_bytes((bits + 48 + tail) // 8, "big")
        assert bits in find_magics(data, 0, len(data) - 6)


def test_block_reader_returns_the_whole_stream_from_any_start(xml, single) -> None:
    data = single.read_bytes()
    magics = find_magics(data, 0, len(data) - 6)
    assert len(magics) >= 5  # several 100 kB blocks
    with open(single, "rb") as f:
        blocks = list(BlockReader(f, 0).blocks(0, len(data) * 8))
    assert [b.bit for b in blocks] == magics and b"".join(b.data for b in blocks) == xml
    assert [b.last for b in blocks] == [False] * (len(blocks) - 1) + [True]
    # from the middle: the first block that starts at or after the byte, then onwards
    start = magics[2] // 8 - 3
    with open(single, "rb") as f:
        later = list(BlockReader(f, start).blocks(start * 8, magics[3] + 1))
    assert sorted({b.bit for b in later}) == magics[2:] and b"".join(b.data for b in later) == b"".join(
        b.data for b in blocks[2:])
    # the two blocks in range whole, the later ones a piece at a time, the last piece marked
    assert [(b.bit, b.owned) for b in later[:2]] == [(magics[2], True), (magics[3], True)]
    assert not any(b.owned for b in later[2:]) and len(later) > len(magics)
    assert [b.last for b in later] == [False] * (len(later) - 1) + [True]


class FalseMagics(BlockReader):
    """The real reader, whose scan also "finds" magics at bits where there are none: what a
    false match inside compressed data (48 bits that look like a magic) does to it."""

    fakes: tuple[int, ...] = ()

    def _fill(self) -> bool:
        more = super()._fill()
        known = set(self.cands)
        scanned = range(self.base * 8, (self.base + self.scanned) * 8)
        self.cands = sorted(known | {(bit, eos) for bit, eos in self.fakes if bit in scanned})
        return more


def test_false_magic_matches_are_skipped_not_reported(xml, single) -> None:
    data = single.read_bytes()
    magics = find_magics(data, 0, len(data) - 6)
    middles = [(a + b) // 2 for a, b in zip(magics, magics[1:], strict=False)]
    # a false block start and a false end-of-stream inside blocks, and one right after a magic
    FalseMagics.fakes = ((middles[1], False), (middles[3], True), (magics[2] + 9, False))
    bounds = [0, middles[1] - 8, magics[2], middles[3], len(data) * 8]  # fakes first in some ranges
    out = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        with open(single, "rb") as f:
            reader = FalseMagics(f, lo // 8)
            out += [b.data for b in reader.blocks(lo, hi) if b.owned]
            assert all(reader.inside_block(bit) for bit in reader.undecodable)
            if lo == middles[1] - 8:
                assert reader.undecodable == [middles[1]]
    assert b"".join(out) == xml
    with open(single, "rb") as f:  # a real block start is not inside another block
        assert not BlockReader(f, 0).inside_block(magics[2])


def test_single_stream_bz2_splits_into_items_that_read_every_page_once(single) -> None:
    uri = str(single)
    assert plan_reads(uri, range_bytes=RANGE, split_single_stream=False) == [WorkItem(uri, "whole")]
    items = plan_reads(uri, range_bytes=RANGE)
    assert len(items) >= 2 and {i.kind for i in items} == {"blocks"}
    assert [(i.start, i.end) for i in items][0][0] == 0 and items[-1].end == single.stat().st_size
    assert all(a.end == b.start for a, b in zip(items, items[1:], strict=False)) and items[-1].last
    whole = read([WorkItem(uri, "whole")])
    assert whole == [("page", f"wiki:{10 + i}") for i in range(300)]
    assert read(items) == whole
    # items of other sizes (several blocks each, or less than one) agree too
    for range_bytes in (RANGE * 3, RANGE // 3):
        assert read(plan_reads(uri, range_bytes=range_bytes)) == whole


@pytest.mark.parametrize("cut", [0.5, 0.8, "magic"])
def test_truncated_single_stream_is_read_the_same_split_or_whole(single, tmp_path, cut) -> None:
    data = single.read_bytes()
    magics = find_magics(data, 0, len(data) - 6)
    # in the middle of a block, or inside the magic of one (no trace of the last block at all)
    end = magics[4] // 8 + 3 if cut == "magic" else int(len(data) * cut)
    path = tmp_path / "cut.xml.bz2"
    path.write_bytes(data[:end])
    whole = read([WorkItem(str(path), "whole")])
    split = read(plan_reads(str(path), range_bytes=RANGE))
    assert split == whole
    assert whole[-1] == ("cut", "truncated_input") and [k for k, _ in whole[:-1]] == ["page"] * (len(whole) - 1)
    assert 0 < len(whole) - 1 < 300


def test_corrupt_block_loses_only_its_pages_with_a_reject(single, tmp_path) -> None:
    data = bytearray(single.read_bytes())
    magics = find_magics(bytes(data), 0, len(data) - 6)
    middle = (magics[2] + magics[3]) // 16
    data[middle : middle + 64] = bytes(64)  # zeros in the middle of the third block
    path = tmp_path / "corrupt.xml.bz2"
    path.write_bytes(bytes(data))
    got = read(plan_reads(str(path), range_bytes=RANGE))
    pages = [i for k, i in got if k == "page"]
    rejects = [i for k, i in got if k == "reject"]
    assert rejects == ["unreadable_file"]
    assert len(pages) == len(set(pages)) and 200 < len(pages) < 300
    assert pages == sorted(pages, key=lambda i: int(i.split(":")[1]))


@pytest.mark.slow
def test_job_output_is_the_same_for_one_or_two_workers(tmp_path) -> None:
    """The job splits a single-stream dump by itself (default item size): articles between talk
    pages of incompressible text (cheap to reject, big enough for several items)."""
    import base64

    from beam_jobs import clean_corpus

    rng = random.Random(11)
    pages = []
    for i in range(300):
        pages.append(page_xml(10 + i, rng))
        if i % 3 == 0:
            noise = base64.b64encode(rng.randbytes(6000)).decode()
            pages.append(page_xml(10_000 + i, rng).replace("<ns>0</ns>", "<ns>1</ns>")
                         .replace("</text>", f" {noise}</text>"))
    single = tmp_path / "big.xml.bz2"
    single.write_bytes(bz2.compress((HEAD + "".join(pages) + "</mediawiki>\n").encode()))
    assert len(plan_reads(str(single))) >= 3

    def digest(folder: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.iterdir()) if p.name != storage.MANIFEST}

    cfg = CorpusConfig(wikipedia=[str(single)], num_shards=2, min_chars_per_doc=10, min_sentences_per_doc=1)
    one, two = tmp_path / "one", tmp_path / "two"
    clean_corpus.run(cfg, str(one), workers=1)
    clean_corpus.run(cfg, str(two), workers=2)
    assert digest(one) == digest(two)
    counts = json.loads((two / storage.MANIFEST).read_text())["counts"]["wikipedia"]
    assert counts["read"] == 400 and counts["kept"] + counts["rejected"] == 400
    assert counts["rejected_by_reason"]["not_article"] == 100
