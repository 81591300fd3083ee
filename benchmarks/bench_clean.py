"""Benchmark: our corpus cleaning job vs wikiextractor 3.1.0 on the same dump, same processes.

    python benchmarks/bench_clean.py            (make bench runs it with BERTPIPE_SAMPLES set)

Inputs: the real enwiki excerpt (6.1 MB of XML, single bz2 stream, which our job splits by bz2
block) and the excerpt repeated 10x (61 MB of XML; page ids and titles renumbered so every copy
is a distinct page) written as a multistream .xml.bz2 with its index, the way Wikimedia
publishes big dumps. A one-page dump measures each tool's fixed start-up (for ours: Beam, its
worker processes and its stages), which weighs most on the 1x run. Both tools get the
same file and 2 processes (ours: ``--workers 2`` on the local FnApiRunner; wikiextractor:
``--processes 2``). Timed: wall clock of the whole command, start-up included. Also measured:
peak RSS of the whole process tree (sum over processes, sampled every 0.1 s), the share of
wikiextractor's sentences (split with our splitter, normalized) that we also keep, and
sentences with wiki markup left in each output.

wikiextractor is installed for this script only, into its own venv under the bertpipe cache
(never a dependency of bertpipe). Results: ``bench-results/clean.json``.
"""

from __future__ import annotations

import bz2
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import samples as samples_dir  # noqa: E402
from bert_core.corpus.dedup import normalize  # noqa: E402
from bert_core.corpus.sentences import split_sentences  # noqa: E402
from bert_core.corpus.wikitext import MARKUP  # noqa: E402

WIKIEXTRACTOR = "wikiextractor==3.1.0"
PROCESSES = 2
DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.xml.bz2"




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


def repeated_multistream(xml: bytes, copies: int, out: Path) -> Path:
    """The dump repeated ``copies`` times (renumbered) as multistream bz2 + index."""
    start, end = xml.index(b"<page>"), xml.rindex(b"</page>") + len(b"</page>")
    pages = [p + b"</page>\n" for p in xml[start:end].split(b"</page>") if p.strip()]
    dump, index = out / f"enwiki-{copies}x-multistream.xml.bz2", []
    with open(dump, "wb") as f:
        f.write(bz2.compress(xml[:start]))
        for copy in range(copies):
            renamed = [_renumber(p, copy) for p in pages]
            for i in range(0, len(renamed), 100):
                offset = f.tell()
                for p in renamed[i : i + 100]:
                    pid = re.search(rb"<id>(\d+)</id>", p).group(1).decode()
                    title = re.search(rb"<title>(.*?)</title>", p).group(1).decode()
                    index.append(f"{offset}:{pid}:{title}\n")
                f.write(bz2.compress(b"".join(renamed[i : i + 100])))
        f.write(bz2.compress(xml[end:]))
    (out / f"enwiki-{copies}x-multistream-index.txt.bz2").write_bytes(bz2.compress("".join(index).encode()))
    return dump


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, float]:
    """(wall seconds, peak RSS of the process tree in bytes, CPU seconds of the tree) of one
    command. CPU time counts every reaped descendant and does not grow when other jobs share
    the cores, so it is the steadier measure on a busy machine."""
    peak = [0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def watch() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - start
    watcher.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return seconds, peak[0], cpu


def run_ours(dump: Path, out: Path) -> tuple[float, int, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return timed([sys.executable, "-m", "beam_jobs.clean_corpus", "--wikipedia", str(dump),
                  "--output", str(out), "--workers", str(PROCESSES)], env)


def run_wikiextractor(python: str, dump: Path, out: Path) -> tuple[float, int, float]:
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


def main() -> None:
    samples = samples_dir()
    python = wikiextractor_python()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-clean-") as tmp_dir:
        tmp = Path(tmp_dir)
        dump1 = samples / "wikipedia" / DUMP
        xml = bz2.decompress(dump1.read_bytes())
        dump10 = repeated_multistream(xml, 10, tmp)
        end = xml.index(b"</page>") + len(b"</page>")  # the header and the first page
        tiny = tmp / "enwiki-1page.xml.bz2"
        tiny.write_bytes(bz2.compress(xml[:end] + b"\n</mediawiki>\n"))
        ours, ref = run_ours(tiny, tmp / "ours-tiny"), run_wikiextractor(python, tiny, tmp / "wx-tiny")
        print(f"start-up (1-page dump): ours {ours[0]:.1f} s ({ours[2]:.1f} CPU s), "
              f"wikiextractor {ref[0]:.1f} s ({ref[2]:.1f} CPU s)", flush=True)
        rows.append({"measure": f"start-up: a 1-page dump, {PROCESSES} processes", "ours": round(ours[0], 2),
                     "reference": round(ref[0], 2), "ratio": round(ref[0] / ours[0], 3), "unit": "s"})
        results = {}
        for name, dump, mb in (("1x", dump1, len(xml) / 1e6), ("10x", dump10, 10 * len(xml) / 1e6)):
            ours = run_ours(dump, tmp / f"ours-{name}")
            ref = run_wikiextractor(python, dump, tmp / f"wx-{name}")
            results[name] = (ours, ref)
            print(f"{name}: {mb:.1f} MB of XML  ours {ours[0]:.1f} s ({mb / ours[0]:.2f} MB/s, "
                  f"peak RSS {ours[1] / 1e6:.0f} MB)  wikiextractor {ref[0]:.1f} s "
                  f"({mb / ref[0]:.2f} MB/s, peak RSS {ref[1] / 1e6:.0f} MB)  ratio {ref[0] / ours[0]:.2f}; "
                  f"CPU s: ours {ours[2]:.1f}, wikiextractor {ref[2]:.1f}",
                  flush=True)
            rows.append({"measure": f"throughput, enwiki excerpt {name} ({mb:.0f} MB XML), "
                                    f"{PROCESSES} processes",
                         "ours": round(mb / ours[0], 3), "reference": round(mb / ref[0], 3),
                         "ratio": round(ref[0] / ours[0], 3), "unit": "MB/s of XML"})
            rows.append({"measure": f"CPU throughput (all processes, start-up included), {name}",
                         "ours": round(mb / ours[2], 3), "reference": round(mb / ref[2], 3),
                         "ratio": round(ref[2] / ours[2], 3), "unit": "MB of XML per CPU-second"})
            rows.append({"measure": f"peak RSS of the process tree, {name}",
                         "ours": round(ours[1] / 1e6, 1), "reference": round(ref[1] / 1e6, 1),
                         "ratio": round(ours[1] / max(ref[1], 1), 3), "unit": "MB"})
        ours_s = our_sentences(tmp / "ours-1x")
        ref_s = wikiextractor_sentences(tmp / "wx-1x")
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
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    (out / "clean.json").write_text(json.dumps({"rows": rows}, indent=2))
    for r in rows:
        print(f"{r['measure']:<60} ours {r['ours']!s:>10}  reference {r['reference']!s:>10}  "
              f"ratio {r['ratio']!s:>6} {r['unit']}")


if __name__ == "__main__":
    main()
