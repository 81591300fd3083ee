"""The scale benchmark's helpers: registry text -> prose paragraphs, .deb unpacking, the report."""

from __future__ import annotations

import bz2
import io
import tarfile
from pathlib import Path

from benchmarks.speed.bench_scale import renumbered_dump, rss_ratios, table
from benchmarks.text import distinct_text as dt

LONG = "This sentence is long enough to count as real prose in a manual."


def test_rst_keeps_prose_and_drops_code_titles_and_markup() -> None:
    text = f"""\
.. _target:

A title
=======

{LONG} See :ref:`the guide <guide>` and ``open()`` for details.

.. code-block:: python

    x = {{"not": "prose"}}

.. note::

   {LONG} Notes are prose.

Run this::

    $ make all

.. function:: open(file)

   {LONG} The body of an object description is prose.
"""
    paragraphs = list(dt.rst_paragraphs(text))
    assert paragraphs == [
        f"{LONG} See the guide and open() for details.",
        f"{LONG} Notes are prose.",
        f"{LONG} The body of an object description is prose.",
    ]


def test_asciidoc_drops_listings_and_titles() -> None:
    text = f"""\
git-rebase(1)
=============

NAME
----
{LONG} It calls linkgit:git-am[1] and `git log`.

------------
$ git rebase master
------------

    indented literal paragraph that is not prose at all here
"""
    assert list(dt.asciidoc_paragraphs(text)) == [f"{LONG} It calls git-am and git log."]


def test_pod_and_html_and_osis() -> None:
    pod = f"=head1 NAME\n\n{LONG} Use C<print> and L<the manual|perlfunc>.\n\n    my $x = 1;\n"
    assert list(dt.pod_paragraphs(pod)) == [f"{LONG} Use print and the manual."]
    html = f"<p>{LONG} <code>x</code></p><pre><p>{LONG}</p></pre><div class=\"para\">{LONG} Para.</div><p>Short.</p>"
    assert list(dt.html_paragraphs(html)) == [f"{LONG} x", f"{LONG} Para."]
    osis = ('<div type="book" osisID="Gen"><title type="main">GENESIS</title>'
            '<verse osisID="Gen.1.1" sID="Gen.1.1"/><w lemma="x">In the beginning</w> God.<verse eID="Gen.1.1"/>'
            '<verse osisID="Gen.1.2" sID="Gen.1.2"/>And<note>n</note> the earth.<verse eID="Gen.1.2"/></div>')
    assert list(dt.osis_books(osis)) == [("Gen", "GENESIS", ["In the beginning God.", "And the earth."])]


def test_is_prose_rejects_code_and_fragments() -> None:
    assert dt.is_prose(LONG)
    assert not dt.is_prose("Too short.")
    assert not dt.is_prose("if (a == b) { return c + d + e + f; }")
    assert not dt.is_prose(">>> import os, sys, json, re, time, math")


def test_deb_members_are_selected_and_gunzipped(tmp_path: Path) -> None:
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w:gz") as tar:
        for name, data in (("./usr/share/doc/a/guide.rst.gz", _gzip(b"text")), ("./usr/share/doc/a/skip.png", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    deb = tmp_path / "a_1_all.deb"
    deb.write_bytes(b"!<arch>\n" + _ar_member("debian-binary", b"2.0\n") + _ar_member("data.tar.gz", tar_bytes.getvalue()))
    source = dt.Source("a", "debian", "a", "1", deb.name, "", "MIT", "test", "rst", ("./usr/share/doc/a/*.rst.gz",))
    assert list(dt.members(source, deb)) == [("./usr/share/doc/a/guide.rst", b"text")]


def test_interleaved_takes_every_source_in_turn() -> None:
    files = [Path("b/1.txt"), Path("a/2.txt"), Path("a/1.txt"), Path("b/2.txt"), Path("a/3.txt")]
    assert [str(p) for p in dt.interleaved(files)] == ["a/1.txt", "b/1.txt", "a/2.txt", "b/2.txt", "a/3.txt"]


def test_renumbered_dump_changes_every_page_id_and_title(tmp_path: Path) -> None:
    xml = (b"<mediawiki><page><title>A</title><id>10</id><revision><id>5</id></revision></page>"
           b"<page><title>B</title><id>11</id></page></mediawiki>")
    out = bz2.decompress(renumbered_dump(xml, 2, tmp_path).read_bytes())
    assert out == (b"<mediawiki><page><title>A (2)</title><id>20000010</id><revision><id>5</id></revision></page>"
                   b"<page><title>B (2)</title><id>20000011</id></page></mediawiki>")


def test_rss_ratio_and_table() -> None:
    rows = [{"stage": "clean", "size": s, "input_mb": 12.0 * s, "distinct_mb": 12.0 * min(s, 3),
             "wall_s": 10.0 * s, "cpu_s": 8.0 * s, "peak_rss_mb": rss, "mb_per_s": 1.2, "mb_per_cpu_s": 1.5,
             "copies": s > 3} for s, rss in ((1, 500.0), (10, 600.0))]
    assert rss_ratios(rows) == {"clean": {"from": 1, "to": 10, "ratio": 1.2}}
    assert "| clean | x10 | 120.0 | 36.0 (rest copies) |" in table(rows)


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


def _ar_member(name: str, data: bytes) -> bytes:
    header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode()
    return header + data + (b"\n" if len(data) % 2 else b"")


def test_rows_for_counts_text_bytes_per_row() -> None:
    import pyarrow as pa

    from benchmarks.speed.bench_scale import rows_for, text_bytes

    table = pa.table({"doc_id": ["a", "b", "c"], "sentences": [["12345"], ["1234567890", "12345"], ["1"]]})
    assert text_bytes(table) == 21
    assert [rows_for(table, n) for n in (1, 5, 6, 20, 21, 99)] == [1, 1, 2, 2, 3, 3]


def test_copied_documents_are_written_in_row_groups_like_the_corpus_stage(tmp_path: Path, monkeypatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from beam_jobs import clean_corpus
    from benchmarks.speed import bench_scale

    monkeypatch.setattr(clean_corpus, "ROW_GROUP_CHARS", 100)
    table = pa.table({"doc_id": [str(i) for i in range(10)], "sentences": [["x" * 30, "y" * 10]] * 10})
    bench_scale.write_documents(table, str(tmp_path / "docs.parquet"))
    shard = pq.ParquetFile(tmp_path / "docs.parquet")
    assert shard.metadata.num_row_groups == 5  # 40 characters a row, a new group at every 100
    assert shard.read().equals(table)


def test_a_fork_that_has_not_exec_ed_is_counted_once() -> None:
    import subprocess
    import sys
    import time

    from benchmarks.common import process_tree

    code = ("import os, time\nblock = bytearray(64 << 20)\nblock[::4096] = b'x' * len(block[::4096])\n"
            "if os.fork() == 0:\n    time.sleep(30)\nelse:\n    time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        import psutil

        while len(psutil.Process(proc.pid).children()) < 1:
            time.sleep(0.05)
        time.sleep(0.3)
        parent = psutil.Process(proc.pid).memory_info().rss
        tree = process_tree(proc.pid)
        assert [p.pid for p in tree] == [proc.pid]  # the child shares the parent's pages
        assert sum(p.memory_info().rss for p in tree) < parent * 1.2
    finally:
        for child in psutil.Process(proc.pid).children():
            child.kill()
        proc.kill()
        proc.wait()


def test_measure_counts_the_whole_tree(tmp_path) -> None:
    import sys

    from benchmarks.common import measure

    code = ("import subprocess, sys\nblock = bytearray(32 << 20)\nblock[::4096] = b'x' * len(block[::4096])\n"
            "subprocess.run([sys.executable, '-c', 'import time; time.sleep(0.6)'], check=True)\nprint('done')\n")
    result = measure([sys.executable, "-c", code], tmp_path / "log", every=0.05)
    assert result["processes"] == 2 and result["peak_rss_mb"] > 32 and result["cpu_s"] > 0
    assert result["wall_s"] >= 0.6 and (tmp_path / "log").read_text() == "done\n"
