"""Read a .bz2 file from any point, block by block (pure Python + stdlib ``bz2``).

    from bert_core.corpus.bz2_blocks import BlockReader
    with open("enwiki-...-pages-articles.xml.bz2", "rb") as f:
        reader = BlockReader(f, start=0)
        for block in reader.blocks(start_bit=0, end_bit=8 << 20):  # the blocks that start in
            ...  # block.bit, .data, .owned, .last    # the first MB whole, then later ones in pieces
"""

from __future__ import annotations

import bz2
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

# How it works:
#
# A bzip2 stream is a header (``BZh`` + level digit) and blocks, each starting with the 48-bit
# magic 0x314159265359 at any *bit* offset (blocks are not byte aligned) and its 32-bit CRC; the
# stream ends with 0x177245385090 and the combined CRC. One block decompresses on its own when its
# bits are copied into a fresh stream: header, the block, the end-of-stream marker and, as the
# combined CRC of a one-block stream, the block's own CRC. The decompressor then checks the block
# (Huffman tables, CRC), so 48 bits inside compressed data that merely look like a magic (a false
# match, about one per 2**48 bit positions) never pass for a block: ``[a, b)`` is a block only if
# it decompresses, and the end of a block is the first later magic (or end-of-stream marker) at
# which it does.
#
# Decoding costs what ``bz2.decompress`` of the same bytes costs, plus a scan for magics (16
# ``bytes.find`` passes over the compressed data). Memory is bounded by a few blocks (a level-9
# block is 900 kB of data, about 250 kB compressed for text). Errors: :class:`Truncated` (the file
# ends inside a block or before the end-of-stream marker) and :class:`Corrupt` (no end found where
# a block must end). A multistream file (streams back to back) is read the same way, following
# each end-of-stream marker to the next stream's first block. Used by ``bert_core/corpus/dumps.py``
# to split one big dump into work items, each finding its own blocks; :func:`ends_whole` (the last
# 11 bytes) lets the download refuse a file that is cut short.
#
# Why not ``indexed_bzip2``: ``benchmarks/speed/bench_bz2.py`` compares the two on the sample dump and a
# larger file. Its C++ decoder is somewhat faster per thread over a whole file, but it can seek only
# through an index of every block, which it builds by decoding the file from the start; a work
# item here decodes only its own blocks, so each item costs a fraction of the file and the corpus
# job's workers share a dump with no index, in less memory. The decoded bytes are the same.

BLOCK_MAGIC = 0x314159265359
EOS_MAGIC = 0x177245385090
CHUNK = 1 << 20
PIECE = 64 << 10  # blocks after the range are decompressed this much at a time
_MASK48 = (1 << 48) - 1


class Truncated(Exception):
    """The file ends inside a block (the one at ``bit``), or before the end-of-stream marker."""

    def __init__(self, bit: int | None = None):
        super().__init__("the bz2 data ends inside a block, before its end-of-stream marker")
        self.bit = bit


class Corrupt(Exception):
    """The block at ``bit`` does not decompress up to any later magic within a block's size."""

    def __init__(self, bit: int):
        super().__init__(f"the bz2 block at bit {bit} does not decompress")
        self.bit = bit


@dataclass(frozen=True)
class Block:
    bit: int  # offset of the block's magic in the file, in bits
    data: bytes  # its decompressed bytes (of a block after the range: the next piece of them)
    owned: bool  # the magic lies in the range asked for
    last: bool  # the stream's end-of-stream marker follows it (and this is its last piece)


def _patterns(magic: int) -> list[tuple[int, bytes, int, int, int, int, int]]:
    """Per bit shift s: (s, bytes to find, their offset from the magic's first byte, then the
    mask and value of the first byte and of the seventh byte that hold its remaining bits)."""
    out = []
    for s in range(8):
        w = (magic << (8 - s)).to_bytes(7, "big")  # the magic at bit s of a 7-byte window
        if s == 0:
            out.append((0, w[:6], 0, 0, 0, 0, 0))
        else:
            out.append((s, w[1:6], 1, (1 << (8 - s)) - 1, w[0], (0xFF << (8 - s)) & 0xFF, w[6]))
    return out


_BLOCK_PATTERNS = _patterns(BLOCK_MAGIC)
_EOS_PATTERNS = _patterns(EOS_MAGIC)


def find_magics(buf: bytes, lo: int, hi: int, magic: int = BLOCK_MAGIC) -> list[int]:
    """Bit offsets (in ``buf``) of ``magic`` starting in bytes [lo, hi); ``hi <= len(buf) - 6``."""
    hits = []
    patterns = {BLOCK_MAGIC: _BLOCK_PATTERNS, EOS_MAGIC: _EOS_PATTERNS}.get(magic) or _patterns(magic)
    for s, pat, off, m0, v0, m6, v6 in patterns:
        j = buf.find(pat, lo + off, hi + off + len(pat) - 1)
        while j >= 0:
            i = j - off
            if s == 0 or ((buf[i] & m0) == v0 and (buf[i + 6] & m6) == v6):
                hits.append(i * 8 + s)
            j = buf.find(pat, j + 1, hi + off + len(pat) - 1)
    return sorted(hits)


def ends_whole(f: BinaryIO) -> bool:
    """The file ``f`` (seekable) ends as a bz2 stream does: the end-of-stream marker, the combined
    CRC and at most 7 zero bits to the byte. A file cut short almost never does (a 48-bit match at
    one of 8 places), so this reads 11 bytes to tell a whole download from a cut one."""
    f.seek(0, 2)
    size = f.tell()
    f.seek(max(size - 11, 0))
    tail = f.read()
    value, bits = int.from_bytes(tail, "big"), 8 * len(tail)
    return any(bits >= 80 + pad and value & ((1 << pad) - 1) == 0
               and (value >> (32 + pad)) & _MASK48 == EOS_MAGIC for pad in range(8))


def max_block_bits(level: int) -> int:
    """An upper bound on one compressed block (incompressible data grows a little)."""
    return (level * 100_000 * 5 // 4 + 4096) * 8


class BlockReader:
    """Blocks of the bz2 stream(s) in ``f`` from byte ``start`` on (``f`` seekable); streams
    after the first are followed as they come (:meth:`_next_stream`)."""

    def __init__(self, f: BinaryIO, start: int, header: bytes | None = None):
        if header is None:
            f.seek(0)
            header = f.read(4)
        if len(header) < 4 or not header.startswith(b"BZh") or header[3:4] not in b"123456789":
            raise ValueError(f"not a bz2 stream header: {header!r}")
        self.f, self.header = f, header
        self.max_bits = max_block_bits(int(header[3:4]))
        f.seek(start)
        self.base = start  # file offset of buf[0]
        self.buf = b""
        self.scanned = 0  # magics starting in buf[:scanned] are in self.cands
        self.cands: list[tuple[int, bool]] = []  # (bit offset in the file, is end-of-stream)
        self.eof = False
        self.undecodable: list[int] = []  # candidate block starts skipped in the search

    # ------------------------------------------------------------------ buffer and candidates

    def _fill(self) -> bool:
        if self.eof:
            return False
        chunk = self.f.read(CHUNK)
        if not chunk:
            self.eof = True
            hi = len(self.buf)  # the last 6 bytes cannot hold a whole magic plus a block
        else:
            self.buf += chunk
            hi = max(len(self.buf) - 6, self.scanned)
        if hi > self.scanned:
            lo = self.scanned
            found = [(b, False) for b in find_magics(self.buf, lo, min(hi, len(self.buf) - 6))]
            found += [(b, True) for b in find_magics(self.buf, lo, min(hi, len(self.buf) - 6), EOS_MAGIC)]
            self.cands += sorted((self.base * 8 + b, eos) for b, eos in found)
            self.scanned = hi
        return True

    def _drop_before(self, bit: int) -> None:
        """Forget bytes before the one holding ``bit`` (bounded memory)."""
        cut = bit // 8 - self.base
        if cut > CHUNK:
            self.buf = self.buf[cut:]
            self.base += cut
            self.scanned -= cut
            self.cands = [c for c in self.cands if c[0] >= bit]

    def _candidates(self, after: int, limit: int) -> Iterator[tuple[int, bool]]:
        """Magics after bit ``after`` and at most bit ``limit``, reading on as needed; raises
        Truncated if the file ends first."""
        i = 0
        while True:
            while i < len(self.cands) and self.cands[i][0] <= after:
                i += 1
            if i < len(self.cands):
                c = self.cands[i]
                if c[0] > limit:
                    return
                yield c
                after = c[0]
                continue
            if (self.base + self.scanned) * 8 > limit:
                return
            if not self._fill():
                raise Truncated()

    # ------------------------------------------------------------------ decoding

    def _stream(self, a: int, b: int) -> bytes:
        """Bits [a, b) of the file as a one-block bz2 stream."""
        n = b - a
        ra, rb = a - self.base * 8, b - self.base * 8
        lo, hi = ra // 8, (rb + 7) // 8
        v = (int.from_bytes(self.buf[lo:hi], "big") >> (hi * 8 - rb)) & ((1 << n) - 1)
        crc = (v >> (n - 80)) & 0xFFFFFFFF  # right after the 48-bit magic
        pad = -(n + 80) % 8
        v = ((((v << 48) | EOS_MAGIC) << 32 | crc) << pad)
        return self.header + v.to_bytes((n + 80 + pad) // 8, "big")

    def _decode(self, a: int, b: int) -> bytes | None:
        """Decompress bits [a, b) of the file as one block, or None if they are not one."""
        if b - a <= 80:
            return None
        try:
            return bz2.decompress(self._stream(a, b))
        except (OSError, ValueError, EOFError):
            return None

    def _open(self, a: int, b: int) -> tuple[bz2.BZ2Decompressor, bytes] | None:
        """A decompressor of bits [a, b) as one block and its first piece, or None if they are
        not one. The whole block is Huffman-decoded before the first byte comes out (a false end
        fails there), but the rest of the output, and its CRC check, waits until asked for."""
        if b - a <= 80:
            return None
        dec = bz2.BZ2Decompressor()
        try:
            first = dec.decompress(self._stream(a, b), max_length=PIECE)
        except (OSError, ValueError, EOFError):
            return None
        return (dec, first) if first else None

    def _decode_to_eof(self, a: int) -> bytes:
        """The block at bit ``a`` when the file ends after it, inside the next magic (which the
        scan cannot see): the decompressor gives out a whole block once its CRC checks."""
        n = (len(self.buf) + self.base) * 8 - a
        ra = a - self.base * 8
        v = int.from_bytes(self.buf[ra // 8 :], "big") & ((1 << n) - 1)
        try:
            return bz2.BZ2Decompressor().decompress(self.header + (v << (-n % 8)).to_bytes((n + 7) // 8, "big"))
        except (OSError, ValueError, EOFError):
            return b""

    def _block_at(self, a: int, lazy: bool = False) -> tuple[Any, int | None, bool]:
        """(data, end bit, end is end-of-stream) of the block starting at bit ``a``; the end is
        None for a whole block at the very end of a truncated file. A block that decodes to no
        later magic is Corrupt, or Truncated if the file ends before any later magic. ``lazy``:
        data is (decompressor, first piece) instead, when the end is known."""
        tried = False
        try:
            for b, eos in self._candidates(a + 80, a + self.max_bits):
                data = self._open(a, b) if lazy else self._decode(a, b)
                if data is not None:
                    return data, b, eos
                tried = True
        except Truncated:
            if tried:
                raise Corrupt(a) from None
            data = self._decode_to_eof(a)
            if data:
                return data, None, False
            raise Truncated(a) from None
        raise Corrupt(a)

    def blocks(self, start_bit: int, end_bit: int) -> Iterator[Block]:
        """The blocks whose magic starts in bits [start_bit, end_bit) (``owned``), then the
        blocks after them for as long as the caller iterates, across stream boundaries. A
        candidate magic in range that does not decompress is skipped and noted in
        ``undecodable`` (a false match or a corrupt block); if no block starts in range nothing
        is yielded."""
        a = None
        for c, eos in self._candidates(start_bit - 1, end_bit - 1):
            if eos:
                continue
            try:
                data, b, eos = self._block_at(c)
            except Corrupt:
                self.undecodable.append(c)
                continue
            a = c
            break
        if a is None:
            return
        while True:
            following = self._next_stream(b) if eos else None
            yield Block(a, data, a < end_bit, eos and following is None)
            if eos and following is None:
                return
            if b is None:
                raise Truncated(a)  # reported by the owner of this last whole block
            a = following if eos else b
            self._drop_before(a)
            if a >= end_bit:
                yield from self._pieces(a)
                return
            data, b, eos = self._block_at(a)

    def _pieces(self, a: int) -> Iterator[Block]:
        """Blocks from bit ``a`` on, a piece at a time: the caller reads past its range only to
        finish a page, usually a few kB into the next block."""
        while True:
            opened, b, eos = self._block_at(a, lazy=True)
            if b is None:  # a whole block at the end of a truncated file
                yield Block(a, opened, False, False)
                raise Truncated(a)
            dec, piece = opened
            following = self._next_stream(b) if eos else None
            while True:
                yield Block(a, piece, False, eos and following is None and dec.eof)
                if dec.eof:
                    break
                try:
                    piece = dec.decompress(b"", max_length=PIECE)
                except (OSError, ValueError, EOFError):
                    raise Corrupt(a) from None
                if not piece and not dec.eof:
                    raise Corrupt(a)
            if eos and following is None:
                return
            a = following if eos else b
            self._drop_before(a)

    def _next_stream(self, eos_bit: int) -> int | None:
        """The first block of the stream after the end-of-stream marker at ``eos_bit``, or None
        at the end of the file. A multistream file (Wikimedia's ``-multistream`` dumps,
        pbzip2/lbzip2 output) is bz2 streams back to back: marker, combined CRC and padding to a
        byte, then ``BZh`` + level and the next block's magic, byte aligned. Its blocks decode
        with this reader's header: the tools write every stream of a file at one level."""
        start = -(-(eos_bit + 80) // 8)
        while self.base + len(self.buf) < start + 10 and self._fill():
            pass
        head = self.buf[start - self.base : start - self.base + 10]
        if (len(head) == 10 and head.startswith(b"BZh") and head[3:4] in b"123456789"
                and int.from_bytes(head[4:10], "big") == BLOCK_MAGIC):
            return (start + 4) * 8
        return None

    def inside_block(self, bit: int) -> bool:
        """Whether ``bit`` lies inside a block that starts before it (so a magic found there is a
        false match, not a corrupt block). Reads up to two blocks' worth around it."""
        pos = self.f.tell()
        try:
            reader = BlockReader(self.f, max((bit - self.max_bits) // 8, 0), self.header)
            starts = [c for c, eos in reader._candidates(reader.base * 8 - 1, bit - 1) if not eos]
            for a in reversed(starts):
                try:
                    for b, _ in reader._candidates(bit, a + self.max_bits):
                        if reader._decode(a, b) is not None:
                            return True
                except Truncated:
                    pass
            return False
        finally:
            self.f.seek(pos)
