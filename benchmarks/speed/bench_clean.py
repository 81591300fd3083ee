"""Benchmark: our corpus cleaning job vs wikiextractor 3.1.0 on the same dump, same processes.

    python -m benchmarks.speed.bench_clean                  (make bench runs it with BERTPIPE_SAMPLES set)
    python -m benchmarks.speed.bench_clean --repeats 5      # more timings per command, taken in turn

Inputs: the sample enwiki excerpt, and a multistream dump of it followed by distinct real text
as pages (:mod:`benchmarks.text.distinct_text`). A one-page dump measures each tool's fixed
start-up, which the "beyond start-up" rows take off; on the distinct dump, our job with one worker
also runs in turn with ``bzip2 -d`` of the same file, its floor. Each command runs ``--repeats`` times, the
two tools in turn, so that a drift in the machine's speed reaches both sides of a pair alike.
wikiextractor runs in its own venv under the bertpipe cache. Results: ``bench-results/clean.json``.
"""

from __future__ import annotations

import argparse
import bz2
import json
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import ROOT, distinct_files, measure, reference_venv, row, write_rows
from benchmarks.common import samples as samples_dir
from benchmarks.text.dumps import split_dump, write_multistream
from bert_core.corpus.dedup import normalize
from bert_core.corpus.sentences import split_sentences
from bert_core.corpus.wikitext import MARKUP

PROCESSES = 2
DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.xml.bz2"
WORKERS = (1, PROCESSES)  # our runs: one worker process (per core), and as many as wikiextractor's
FORCED = ("--bytes-per-worker", "0")  # every one of --workers started, whatever the input size
LARGE_MB = 61.0  # XML of the large run: the excerpt, then distinct real text as pages


def text_page(title: str, page_id: int, paragraphs: list[str]) -> bytes:
    """One namespace-0 page whose wikitext is plain paragraphs."""
    from xml.sax.saxutils import escape

    body = escape("\n\n".join(paragraphs))
    return (f"<page>\n    <title>{escape(title)}</title>\n    <ns>0</ns>\n    <id>{page_id}</id>\n"
            f"    <revision>\n      <id>{page_id}</id>\n      <model>wikitext</model>\n"
            f"      <format>text/x-wiki</format>\n      <text xml:space=\"preserve\">{body}</text>\n"
            f"    </revision>\n  </page>").encode()


def distinct_multistream(xml: bytes, target_mb: float, out: Path) -> tuple[Path, float]:
    """The excerpt's pages, then one page per document of distinct real text (every source in
    turn) up to ``target_mb`` of XML, as a multistream dump; and its size in MB. Nothing is copied."""
    header, pages, footer = split_dump(xml)
    size = len(xml)
    for i, path in enumerate(distinct_files()):
        if size >= target_mb * 1e6:
            break
        paragraphs = [p for p in path.read_text("utf-8").split("\n\n") if p.strip()]
        pages.append(text_page(f"{path.parent.name}: {path.stem}", 90_000_000 + i, paragraphs))
        size += len(pages[-1])
    return write_multistream(header, pages, footer, out / "enwiki-distinct-multistream.xml.bz2"), size / 1e6


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over repeated runs of one command."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def beyond_start_up(mb: float, cpu: float, start_up: float) -> float | None:
    """MB per CPU-second beyond the fixed start-up, or None where start-up is nearly all of the
    run (the difference of two medians would then be noise)."""
    return round(mb / (cpu - start_up), 3) if cpu - start_up >= 0.25 * cpu else None


def measured_in_turn(repeats: int, name: str, tmp: Path, commands: dict[str | int, Callable[[Path], list[str]]],
                     keep: bool = False) -> dict[str | int, list[dict]]:
    """``repeats`` passes of every command in turn (each writing to a fresh folder), by
    :func:`benchmarks.common.measure`; with ``keep``, the first pass's outputs stay
    (``<key>-<name>-0``, for the sentence checks)."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    runs: dict[str | int, list[dict]] = {key: [] for key in commands}
    for r in range(repeats):
        for key, command in commands.items():
            out = tmp / f"{key}-{name}-{r}"
            runs[key].append(measure(command(out), tmp / "commands.log", env, every=0.1))
            if not (keep and r == 0):
                shutil.rmtree(out, ignore_errors=True)
    return runs


def commands(python: Path, dump: Path, *extra: str) -> dict[str | int, Callable[[Path], list[str]]]:
    """wikiextractor (``wx``) with ``--processes 2``, then our job with each of ``WORKERS`` on the
    local runner (``extra``: more of our options)."""
    def ours(workers: int) -> Callable[[Path], list[str]]:
        return lambda out: [sys.executable, "-m", "flows.cli", "corpus", "--wikipedia", str(dump),
                            "--output", str(out), "--workers", str(workers), *extra]

    wikiextractor = [str(python), "-m", "wikiextractor.WikiExtractor", str(dump), "--json",
                     "--processes", str(PROCESSES), "-q"]
    return {"wx": lambda out: [*wikiextractor, "-o", str(out)], **{w: ours(w) for w in WORKERS}}


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
    """wikiextractor's sentences (normalized) that are not among ours, by where they come from in the
    dump's wikitext: a heading, a list item, table row, indented line or preformatted code (left out
    by design, as the paper does), wikiextractor's placeholders for maths and code (``formula_7``),
    the same words split or punctuated differently, and what is left: prose we lose."""
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
    parser.add_argument("--repeats", type=int, default=3,
                        help="Runs of each command on each input, ours and wikiextractor in turn (medians reported).")
    args = parser.parse_args()
    python = reference_venv("bench/wikiextractor-3.1.0", ["wikiextractor==3.1.0"], "wikiextractor")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-clean-") as tmp_dir:
        tmp = Path(tmp_dir)
        dump1 = samples_dir() / "wikipedia" / DUMP
        xml = bz2.decompress(dump1.read_bytes())
        # The header and the first page that is not a redirect: a job that reads pages and keeps
        # none fails, as it should.
        header, pages, _ = split_dump(xml)
        tiny_xml = header + next(p for p in pages if b"<redirect" not in p) + b"\n</mediawiki>\n"
        tiny = tmp / "enwiki-1page.xml.bz2"
        tiny.write_bytes(bz2.compress(tiny_xml))
        start = {key: median_run(runs) for key, runs in
                 measured_in_turn(args.repeats, "1-page", tmp, commands(python, tiny, *FORCED)).items()}
        for w in WORKERS:
            rows.append(row(f"start-up: a 1-page dump, ours {w} worker(s)", start[w]["wall_s"],
                            start["wx"]["wall_s"], "s", start["wx"]["wall_s"] / start[w]["wall_s"], digits=2))
            rows.append(row(f"start-up CPU time: a 1-page dump, ours {w} worker(s)", start[w]["cpu_s"],
                            start["wx"]["cpu_s"], "CPU s", start["wx"]["cpu_s"] / start[w]["cpu_s"], digits=2))
        dump, mb = distinct_multistream(xml, LARGE_MB, tmp)
        inputs = [("1x", "enwiki excerpt 1x", dump1, len(xml) / 1e6),
                  ("distinct", f"enwiki excerpt + distinct text as pages ({mb:.0f} MB XML, no copies)", dump, mb)]
        tiny_mb = len(tiny_xml) / 1e6
        for name, label, dump, mb in inputs:
            runs = measured_in_turn(args.repeats, name, tmp, commands(python, dump), keep=name == "1x")
            ref = median_run(runs["wx"])
            for w in WORKERS:
                ours = median_run(runs[w])
                case = f"{name}, {w} worker(s)"
                pairs = sorted(r["cpu_s"] / o["cpu_s"] for o, r in zip(runs[w], runs["wx"], strict=True))
                print(f"{case}: {label}: {mb:.1f} MB of XML; medians: ours {ours}, wikiextractor {ref}; "
                      f"CPU ratio pair by pair {pairs}", flush=True)
                rows.append(row(f"throughput, {case}, {label} (ours: {ours['processes']} process(es), wikiextractor "
                                f"--processes {PROCESSES})", mb / ours["wall_s"], mb / ref["wall_s"], "MB/s of XML",
                                ref["wall_s"] / ours["wall_s"]))
                rows.append(row(f"CPU throughput (all processes, start-up included), {case}", mb / ours["cpu_s"],
                                mb / ref["cpu_s"], "MB of XML per CPU-second", statistics.median(pairs),
                                ratio_range=[round(pairs[0], 3), round(pairs[-1], 3)]))
                per_mb = [beyond_start_up(mb - tiny_mb, run["cpu_s"], fixed["cpu_s"])
                          for run, fixed in ((ours, start[w]), (ref, start["wx"]))]
                rows.append(row(f"CPU throughput beyond start-up, {case}", *per_mb, "MB of XML per CPU-second",
                                per_mb[0] / per_mb[1] if None not in per_mb else None))
                rows.append(row(f"peak RSS of the process tree, {case}", ours["peak_rss_mb"], ref["peak_rss_mb"],
                                "MB", ours["peak_rss_mb"] / max(ref["peak_rss_mb"], 1), digits=1))
            if name == "distinct":  # the floor: decoding the same dump alone, taken in turn with ours
                floor = measured_in_turn(args.repeats, "bzip2", tmp, {
                    "bzip2": lambda out, d=dump: ["bash", "-c", f"bzip2 -dc {d} > /dev/null"],
                    1: commands(python, dump)[1]})
                pairs = sorted((o["cpu_s"] - start[1]["cpu_s"]) / b["cpu_s"]
                               for o, b in zip(floor[1], floor["bzip2"], strict=True))
                beyond = statistics.median(o["cpu_s"] for o in floor[1]) - start[1]["cpu_s"]
                bzip2_cpu = statistics.median(b["cpu_s"] for b in floor["bzip2"])
                rows.append(row(f"CPU-s beyond start-up vs `bzip2 -d` of the same dump, {label}, 1 worker",
                                beyond, bzip2_cpu, "CPU-s", statistics.median(pairs),
                                ratio_range=[round(pairs[0], 3), round(pairs[-1], 3)]))
        ours_s = our_sentences(tmp / "1-1x-0")
        ref_s = wikiextractor_sentences(tmp / "wx-1x-0")
        ours_set = {normalize(s) for s in ours_s}
        ref_set = {normalize(s) for s in ref_s if normalize(s)}
        share = len(ref_set & ours_set) / max(len(ref_set), 1)
        residue = [sum(any(m in s for m in MARKUP) for s in x) for x in (ours_s, ref_s)]
        rows.append(row("share of wikiextractor's sentences we also keep (1x)", share, 1.0, "fraction", share, 4))
        rows.append(row("sentences with wiki markup left (1x)", *residue, "sentences"))
        rows.append(row("sentences kept (1x)", len(ours_s), len(ref_s), "sentences", len(ours_s) / max(len(ref_s), 1)))
        for kind, examples in missing_kinds(ours_s, ref_s, xml).items():
            print(f"  {len(examples):>6}  {kind}: " + " | ".join(e[:80] for e in examples[:3]))
            rows.append(row(f"wikiextractor sentences we do not keep (1x): {kind}", len(examples), None, "sentences"))
    write_rows("clean", rows)


if __name__ == "__main__":
    main()
