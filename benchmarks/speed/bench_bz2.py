"""bz2 blocks: ours (bert_core/corpus/bz2_blocks.py, stdlib ``bz2``) vs ``indexed_bzip2`` (parallel
decompression with a block index), on the sample dump and a larger single-stream file.

    BERTPIPE_SAMPLES=samples python -m benchmarks.speed.bench_bz2

Each case runs in a fresh forked process: the whole file on one thread (stdlib streaming for
scale), indexed_bzip2 on every core, and one work item as the corpus job reads it (the blocks of
the last quarter: indexed_bzip2 needs its block index first, which it builds by decoding from the
start); the decoded bytes must be equal. Rows: ``bench-results/bz2.json``.
"""

from __future__ import annotations

import bz2
import hashlib
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks.common import row, samples, write_rows

CHUNK = 1 << 20


def larger_file(root: Path, folder: Path) -> Path:
    """One bz2 stream of the excerpt, the plays, the book and the news articles."""
    parts = [bz2.decompress(p.read_bytes()) for p in sorted((root / "wikipedia").glob("*.xml.bz2"))]
    parts += [p.read_bytes() for p in sorted((root / "plays").glob("*.md"))]
    parts += [(root / "books" / "botchan.txt").read_bytes(), (root / "news" / "lee_background.cor").read_bytes()]
    path = folder / "samples-text.bz2"
    path.write_bytes(bz2.compress(b"".join(parts), 9))
    return path


def ours(path: Path, start: int = 0) -> Iterator[bytes]:
    """Blocks whose magic starts at byte ``start`` or later, decoded by BlockReader."""
    from bert_core.corpus.bz2_blocks import BlockReader

    with open(path, "rb") as f:
        header = f.read(4)
        reader = BlockReader(f, start, header)
        for block in reader.blocks(start * 8, path.stat().st_size * 8):
            yield block.data


def stdlib(path: Path) -> Iterator[bytes]:
    with bz2.open(path, "rb") as f:
        while data := f.read(CHUNK):
            yield data


def indexed(path: Path, threads: int, start: int = 0) -> Iterator[bytes]:
    """From the first block at byte ``start`` or later (found through the block index)."""
    import indexed_bzip2

    with indexed_bzip2.open(str(path), parallelization=threads) as f:
        if start:
            offsets = f.raw.bz2reader.block_offsets()  # {bit offset: decompressed offset}
            f.seek(min(out for bit, out in offsets.items() if bit >= start * 8))
        while data := f.read(CHUNK):
            yield data


def measured(fn: Callable[[], Iterator[bytes]]) -> dict:
    """Run ``fn`` in a forked process; its times, extra peak RSS and output digest."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()

    def run() -> None:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        digest = hashlib.sha256()
        wall, cpu = time.perf_counter(), time.process_time()
        size = 0
        for data in fn():
            digest.update(data)
            size += len(data)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
        child.send({"wall": wall, "cpu": cpu, "rss_mb": peak / 1024, "bytes": size, "sha256": digest.hexdigest()})

    proc = ctx.Process(target=run)
    proc.start()
    result = parent.recv()
    proc.join()
    return result


def main() -> None:
    root = samples()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {"sample dump": next((root / "wikipedia").glob("*.xml.bz2")),
                 "larger file": larger_file(root, Path(tmp))}
        for label, path in files.items():
            size_mb = path.stat().st_size / 1e6
            start = path.stat().st_size * 3 // 4
            r = {
                "ours": measured(lambda p=path: ours(p)),
                "indexed_bzip2": measured(lambda p=path: indexed(p, 1)),
                "stdlib": measured(lambda p=path: stdlib(p)),
                "indexed_bzip2 parallel": measured(lambda p=path: indexed(p, os.cpu_count() or 1)),
                "ours item": measured(lambda p=path, s=start: ours(p, s)),
                "indexed_bzip2 item": measured(lambda p=path, s=start: indexed(p, 1, s)),
            }
            whole = {r[k]["sha256"] for k in ("ours", "indexed_bzip2", "stdlib", "indexed_bzip2 parallel")}
            same_item = r["ours item"]["sha256"] == r["indexed_bzip2 item"]["sha256"]
            print(f"{label}: {size_mb:.1f} MB compressed, {r['stdlib']['bytes'] / 1e6:.1f} MB of text; "
                  f"decoded bytes equal: {len(whole) == 1}, last-quarter item equal: {same_item}")
            for name, m in r.items():
                print(f"  {name:>18}: {m['wall']:.2f} s wall, {m['cpu']:.2f} CPU-s, "
                      f"+{m['rss_mb']:.0f} MB peak RSS, {m['bytes'] / 1e6:.1f} MB out")
            if len(whole) != 1 or not same_item:
                sys.exit("decoded bytes differ")
            o, ib, parallel = r["ours"], r["indexed_bzip2"], r["indexed_bzip2 parallel"]
            o_item, ib_item = r["ours item"], r["indexed_bzip2 item"]
            rows += [
                row(f"{label} ({size_mb:.1f} MB): whole file, 1 thread", o["cpu"], ib["cpu"], "CPU-s",
                    ib["cpu"] / o["cpu"], 2),
                row(f"{label}: whole file, indexed_bzip2 on {os.cpu_count()} threads (ours 1 thread)", o["wall"],
                    parallel["wall"], "s", parallel["wall"] / o["wall"], 2),
                row(f"{label}: one work item (last quarter), 1 thread", o_item["cpu"], ib_item["cpu"], "CPU-s",
                    ib_item["cpu"] / o_item["cpu"], 2),
                row(f"{label}: extra peak RSS, whole file, 1 thread", round(o["rss_mb"]), round(ib["rss_mb"]), "MB",
                    ib["rss_mb"] / o["rss_mb"] if o["rss_mb"] else None),
            ]
    write_rows("bz2", rows)


if __name__ == "__main__":
    main()
