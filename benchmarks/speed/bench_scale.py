"""Scale: each Beam stage at x1, x10, x30 of the sample corpus; time, CPU and peak memory.

    python -m benchmarks.speed.bench_scale                    # sizes 1,10,30 (long: run it alone)
    python -m benchmarks.speed.bench_scale --sizes 1,3        # a quick look
    python -m benchmarks.speed.bench_scale --stages vocab,instances --keep DIR --reuse  # on kept corpora

Each stage runs as the product runs it, demo preset, ``--workers 2`` on the local runner, on
``size`` x the sample corpus: the sample, then distinct text (:mod:`benchmarks.text.distinct_text`),
then renumbered copies, which the corpus stage drops as duplicates, so the later stages' documents
are topped up with copies under new ids. Every row says how much of its input was distinct.
Results: ``bench-results/scale.json`` and ``scale.png``.
"""

from __future__ import annotations

import argparse
import bz2
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, distinct_files, machine, measure, row, write_rows
from benchmarks.common import samples as samples_dir
from benchmarks.text.dumps import renumbered

STAGES = ("clean", "vocab", "instances")
RSS_GOAL = 1.3  # peak RSS at the largest size over the smallest: the memory stays flat
WORKERS = 2


def renumbered_dump(xml: bytes, copy: int, out: Path) -> Path:
    """Copy ``copy`` of a dump, every page renumbered (:func:`benchmarks.text.dumps.renumbered`)."""
    path = out / f"copy{copy:03d}-enwiki.xml.bz2"
    path.write_bytes(bz2.compress(re.sub(rb"<page>.*?</page>", lambda m: renumbered(m.group(0), copy), xml,
                                         flags=re.S), 9))
    return path


def raw_inputs(size: int, samples: Path, distinct: list[Path], work: Path) -> dict:
    """The corpus stage's inputs at ``size`` x the sample: dumps and books, with what is distinct."""
    dumps = sorted((samples / "wikipedia").glob("*.xml.bz2"))
    books = sorted([*(samples / "books").glob("*.txt"), *(samples / "plays").glob("*.md")])
    xml = [bz2.decompress(d.read_bytes()) for d in dumps]
    unit = sum(len(x) for x in xml) + sum(b.stat().st_size for b in books)
    target = size * unit
    folder = work / "inputs"
    (folder / "books").mkdir(parents=True)
    (folder / "wiki").mkdir()
    for path in dumps:
        os.symlink(path.resolve(), folder / "wiki" / path.name)
    for path in books:
        os.symlink(path.resolve(), folder / "books" / path.name)
    have = unit
    for path in distinct:
        if have >= target:
            break
        os.symlink(path.resolve(), folder / "books" / f"{path.parent.name}--{path.name}")
        have += path.stat().st_size
    distinct_bytes = have
    copies = max(0, round((target - have) / unit))
    for copy in range(1, copies + 1):
        for raw in xml:
            renumbered_dump(raw, copy, folder / "wiki")
        for path in books:
            shutil.copyfile(path, folder / "books" / f"copy{copy:03d}-{path.name}")
        have += unit
    return {"wikipedia": str(folder / "wiki" / "*.xml.bz2"), "books": [str(folder / "books" / "*.txt"),
                                                                       str(folder / "books" / "*.md")],
            "input_mb": round(have / 1e6, 2), "distinct_mb": round(distinct_bytes / 1e6, 2),
            "unit_mb": round(unit / 1e6, 2)}


def stage_argv(stage: str, work: Path, inputs: dict, *extra: str, corpus: str | None = None) -> list[str]:
    """A stage's command line in ``work`` as the product runs it, demo preset, ``WORKERS`` workers:
    the corpus stage on ``inputs`` (:func:`raw_inputs`), the others on ``corpus`` (default: the corpus
    stage's output); ``extra`` last (it may end with ``-- beam args``)."""
    corpus = corpus or str(work / "corpus")
    job = {"clean": ["flows.cli", "corpus", "--wikipedia", inputs.get("wikipedia"),
                     *[a for b in inputs.get("books", []) for a in ("--books", b)], "--output", str(work / "corpus")],
           "vocab": ["flows.cli", "vocab", "--corpus", corpus, "--output", str(work / "vocab")],
           "instances": ["flows.cli", "instances", "--corpus", corpus, "--vocab", str(work / "vocab"),
                         "--output", str(work / "instances")]}[stage]
    return [sys.executable, "-m", *job, "--preset", "demo", "--workers", str(WORKERS), *extra]


def text_bytes(table) -> int:
    """UTF-8 bytes of all sentences in a documents table."""
    import pyarrow.compute as pc

    return pc.sum(pc.binary_length(pc.list_flatten(table.column("sentences")))).as_py() or 0


def rows_for(table, nbytes: int) -> int:
    """How many leading rows of a documents table hold at least ``nbytes`` of text."""
    total = 0
    for n, sentences in enumerate(table.column("sentences").to_pylist(), start=1):
        total += sum(len(s.encode()) for s in sentences or ())
        if total >= nbytes:
            return n
    return table.num_rows


def write_documents(table, uri: str) -> None:
    """A documents table -> one shard in row groups of about ``ROW_GROUP_CHARS`` characters of
    text, the corpus stage's own (one row group of the whole table would make every reader hold it)."""
    import numpy as np
    import pyarrow.parquet as pq

    from beam_jobs.clean_corpus import ROW_GROUP_CHARS
    from bert_core import storage

    sizes = np.array([sum(map(len, sentences or ())) for sentences in
                      table.column("sentences").to_pylist()], dtype=np.int64)
    group_of_row = np.cumsum(sizes) // ROW_GROUP_CHARS
    with storage.open_file(uri, "wb") as f, pq.ParquetWriter(f, table.schema) as writer:
        for group in np.unique(group_of_row):
            rows = np.flatnonzero(group_of_row == group)
            writer.write_table(table.slice(int(rows[0]), len(rows)))


def read_shards(folder: str) -> list:
    """The documents shards of a corpus folder, as tables."""
    import pyarrow.parquet as pq

    from bert_core import storage

    return [pq.read_table(storage.to_uri(uri)) for uri in storage.shard_uris(folder)]


def topped_up(corpus: str, target_bytes: int, out: Path) -> tuple[str, int, int]:
    """The corpus stage's documents, plus copies under new ids (the last one partial) up to
    ``target_bytes`` of text: (folder, text bytes, distinct text bytes). No copies needed: the
    folder itself."""
    import pyarrow as pa

    from bert_core import storage

    tables = read_shards(corpus)
    have = sum(text_bytes(t) for t in tables)
    if target_bytes - have < 0.02 * have:
        return corpus, have, have
    out.mkdir(parents=True)
    shards, documents, total, copy = [], 0, 0, 0
    while total < target_bytes:
        for i, table in enumerate(tables):
            size = text_bytes(table)
            if copy and total + size > target_bytes:
                table = table.slice(0, rows_for(table, target_bytes - total))
                size = text_bytes(table)
            if copy:
                ids = [f"{d}~copy{copy}" for d in table.column("doc_id").to_pylist()]
                table = table.set_column(table.schema.get_field_index("doc_id"), "doc_id",
                                         pa.array(ids, type=table.schema.field("doc_id").type))
            name = str(out / f"docs-c{copy:03d}-{i:05d}.parquet")
            write_documents(table, name)
            shards.append(storage.shard_entry(name, table.num_rows))
            documents += table.num_rows
            total += size
            if total >= target_bytes:
                break
        copy += 1
    storage.write_manifest(str(out), stage="corpus", config=storage.read_manifest(corpus).get("config", {}),
                           shards=shards, counts={"documents": documents})
    return str(out), total, have


# ---------------------------------------------------------------- one size, every stage


def run_size(size: int, samples: Path, distinct: list[Path], work: Path, base_doc_bytes: int | None,
             stages: tuple[str, ...], reuse: bool = False) -> tuple[list[dict], int]:
    """Every stage at one size in ``work``; with ``reuse``, the corpus stage's documents (and
    their topped-up copy) already in ``work`` are read again instead of being made anew."""
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    rows = []
    corpus = str(work / "corpus")
    if not (reuse and (work / "corpus" / "_MANIFEST.json").exists()):
        inputs = raw_inputs(size, samples, distinct, work)
        print(f"x{size}: {inputs['input_mb']} MB of input, {inputs['distinct_mb']} MB distinct "
              f"(sample unit {inputs['unit_mb']} MB)", file=sys.stderr, flush=True)
        result = measure(stage_argv("clean", work, inputs), work / "clean.log", env)
        rows.append({"stage": "clean", "size": size, "input_mb": inputs["input_mb"],
                     "distinct_mb": inputs["distinct_mb"], **result})
    clean_bytes = sum(text_bytes(t) for t in read_shards(corpus))
    base = base_doc_bytes or clean_bytes // size
    print(f"x{size}: the corpus stage kept {clean_bytes / 1e6:.2f} MB of text", file=sys.stderr, flush=True)
    topped = work / "corpus-topped"
    if reuse and (topped / "_MANIFEST.json").exists():
        docs, distinct_doc_bytes = str(topped), clean_bytes
        doc_bytes = sum(text_bytes(t) for t in read_shards(docs))
    else:
        shutil.rmtree(topped, ignore_errors=True)
        docs, doc_bytes, distinct_doc_bytes = topped_up(corpus, size * base, topped)
    for stage in ("vocab", "instances"):
        shutil.rmtree(work / stage, ignore_errors=True)
        if stage in stages or "instances" in stages:  # the instances stage reads the vocab
            result = measure(stage_argv(stage, work, {}, corpus=docs), work / f"{stage}.log", env)
            rows.append({"stage": stage, "size": size, "input_mb": round(doc_bytes / 1e6, 2),
                         "distinct_mb": round(distinct_doc_bytes / 1e6, 2), **result})
    for r in rows:
        r["mb_per_s"] = round(r["input_mb"] / r["wall_s"], 3)
        r["mb_per_cpu_s"] = round(r["input_mb"] / max(r["cpu_s"], 1e-9), 3)
        r["copies"] = r["input_mb"] - r["distinct_mb"] > 0.01
        print(json.dumps(r), file=sys.stderr, flush=True)
    return [r for r in rows if r["stage"] in stages], base


# ---------------------------------------------------------------- report


def rss_ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per stage: peak RSS at the largest size over the smallest."""
    ratios = {}
    for stage in STAGES:
        mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["size"])
        if len(mine) >= 2 and mine[0]["peak_rss_mb"]:
            ratios[stage] = {"from": mine[0]["size"], "to": mine[-1]["size"],
                             "ratio": round(mine[-1]["peak_rss_mb"] / mine[0]["peak_rss_mb"], 3)}
    return ratios


def table(rows: list[dict]) -> str:
    lines = ["| stage | size | input MB | distinct MB | wall s | CPU s | peak RSS MB | MB/s | MB per CPU-s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['stage']} | x{r['size']} | {r['input_mb']:.1f} | {r['distinct_mb']:.1f}"
                     f"{' (rest copies)' if r['copies'] else ''} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['mb_per_s']:.2f} | {r['mb_per_cpu_s']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for stage in STAGES:
        mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["size"])
        if not mine:
            continue
        mb = [r["input_mb"] for r in mine]
        for ax, key in ((left, "peak_rss_mb"), (right, "wall_s")):
            line, = ax.plot(mb, [r[key] for r in mine], label=stage)
            for r in mine:  # a hollow marker: part of the input is copies
                ax.plot(r["input_mb"], r[key], marker="o", color=line.get_color(),
                        markerfacecolor="white" if r["copies"] else line.get_color())
    left.set(xlabel="corpus (MB of input text)", ylabel="peak RSS of the process tree (MB)", ylim=(0, None),
             title="memory")
    right.set(xlabel="corpus (MB of input text)", ylabel="wall time (s)", ylim=(0, None), title="time")
    for ax, corner in ((left, "lower right"), (right, "upper left")):  # where no line runs
        ax.grid(alpha=0.3)
        ax.legend(loc=corner)
    fig.suptitle(title + "\nfilled marker: distinct text only; hollow: the rest of the input is copies", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,10,30", help="Corpus sizes, multiples of the sample.")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--no-distinct", action="store_true", help="Copies only, no distinct text.")
    parser.add_argument("--keep", type=Path, default=None, help="Keep the work folders here.")
    parser.add_argument("--reuse", action="store_true",
                        help="With --keep: read the documents a kept run's corpus stage wrote instead of "
                             "running it again (its row is left out).")
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    stages = tuple(s for s in STAGES if s in args.stages.split(","))
    if sizes[0] != 1 and set(stages) - {"clean"}:
        parser.error("--sizes must include 1: the documents its corpus stage keeps size the later stages' inputs")
    distinct = [] if args.no_distinct else distinct_files()
    info = machine()
    load = os.getloadavg()
    rows: list[dict] = []
    base = None
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix=f"bench-scale-x{size}-") as tmp:
            work = args.keep / f"x{size}" if args.keep else Path(tmp)
            reuse = args.reuse and args.keep is not None
            if work.exists() and not reuse:
                shutil.rmtree(work)
            work.mkdir(parents=True, exist_ok=True)
            got, base = run_size(size, samples_dir(), distinct, work, base, stages, reuse)
            rows += got
    load_end = os.getloadavg()
    ratios = rss_ratios(rows)
    summary = [row(f"peak RSS x{r['to']} / x{r['from']}, {stage}", r["ratio"], RSS_GOAL, "x (goal <= reference)",
                   r["ratio"] / RSS_GOAL) for stage, r in ratios.items()]
    summary += [row(f"{r['stage']} x{r['size']}: MB per CPU-second", r["mb_per_cpu_s"], None, "MB/CPU-s") for r in rows]
    out = write_rows("scale", summary, machine=info, load_average={"start": load, "end": load_end}, workers=WORKERS,
                     sizes=sizes, runs=rows, rss_ratio=ratios)
    plot(rows, out.with_suffix(".png"), f"{info['cpu']}, {info['cores']} cores; demo preset, {WORKERS} workers, "
         f"local runner; load average {load[0]:.1f} -> {load_end[0]:.1f}")
    print(f"\nMachine: {info['cpu']}, {info['cores']} cores, Python {info['python']}; "
          f"load average {load[0]:.1f} at start, {load_end[0]:.1f} at end")
    print(table(rows))
    for stage, r in ratios.items():
        verdict = "flat" if r["ratio"] <= RSS_GOAL else "grows"
        print(f"peak RSS x{r['to']}/x{r['from']}, {stage}: {r['ratio']:.2f}x (goal <= {RSS_GOAL}x: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
