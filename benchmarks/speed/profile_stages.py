"""Where each data-prep stage's CPU-seconds go, and the floor of each stage on the same input.

    python -m benchmarks.speed.profile_stages                       # instances, a dump, books and JSON lines
    python -m benchmarks.speed.profile_stages --stages instances --large-mb 44
    python -m benchmarks.speed.profile_stages --out docs/profiles --py-spy "$(which py-spy)"

Each stage runs as its command (``python -m flows.cli instances|corpus``, one worker, so the
whole job is one process) once plainly, for its CPU-seconds, and once under ``cProfile`` on the
process's CPU clock, for the picture ``<out>/<stage>.svg``: the functions with the most CPU
time of their own, and the calls of our code with the most in all; with ``--py-spy``, once more
under py-spy's sampler, for a flame graph ``<out>/<stage>-flame.svg``. The floors run in this process on the same input: for instances,
the sentences tokenized alone by ``tokenizers``' batch path (``encode_batch``, many lines at
once, no special tokens) and by our tokenizer's path in the job (``encode_documents_bytes``, in
the job's batches), and the output's Parquet written
alone; for the corpus, the dump decoded alone (``bzip2 -d``'s CPU time, and libbz2 through
Python's ``bz2``) and the documents' Parquet written alone. The inputs are the benchmarks':
``bench_instances``' sample plus distinct text, ``bench_clean``'s distinct multistream dump.
Rows: ``bench-results/profile.json``.
"""

from __future__ import annotations

import argparse
import bz2
import os
import pstats
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, distinct_files, measure, row, timed, write_rows
from benchmarks.common import samples as samples_dir

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
TOP = 22  # functions per panel of the picture
OUR_CODE = ("/bert_core/", "/beam_jobs/")
PY_SPY = ""  # py-spy's program, where --py-spy gives it (a sampling profiler: pip install py-spy)
# Runs a module under cProfile timed by this process's CPU clock (cProfile's default clock is
# wall time, which a busy machine inflates): argv = stats file, module, its arguments.
RUN_PROFILED = r"""
import cProfile, runpy, sys, time
out, module = sys.argv[1], sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
profile = cProfile.Profile(time.process_time)
code = 0
try:
    profile.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = stop.code
profile.dump_stats(out)
sys.exit(code)
"""


def profiled(argv: list[str], prof: Path, log: Path, output: Path, flame: Path | None) -> dict:
    """``python -m MODULE ARGS`` (``argv`` = ``["-m", MODULE, *ARGS]``) under cProfile on the CPU
    clock and, with ``flame`` (``--py-spy``), once more under py-spy's sampler (a flame graph);
    ``output`` is the command's output folder, removed before each run."""
    shutil.rmtree(output, ignore_errors=True)
    done = measure([sys.executable, "-c", RUN_PROFILED, str(prof), *argv[1:]], log, ENV)
    if flame is not None and PY_SPY:
        shutil.rmtree(output, ignore_errors=True)
        flame.parent.mkdir(parents=True, exist_ok=True)
        measure([PY_SPY, "record", "--rate", "100", "--output", str(flame), "--", sys.executable, *argv],
                log.with_suffix(".py-spy.log"), ENV)
    return done


def label(func: tuple[str, int, str]) -> str:
    """``module:function:line`` of a pstats key, short."""
    path, line, name = func
    if path == "~":
        return name.strip("<>").replace("built-in method ", "").replace("method ", "")
    parts = Path(path).with_suffix("").parts
    if Path(path).is_relative_to(ROOT):
        parts = Path(path).relative_to(ROOT).with_suffix("").parts
    elif "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1:]
    return f"{'.'.join(parts[-2:])}:{name}:{line}"


def picture(prof: Path, title: str, floors: dict[str, float], total: float, out: Path) -> list[tuple[str, float, float]]:
    """Two panels from a cProfile file: the functions with the most CPU of their own, and the
    calls of our code with the most in all; the stage's CPU-seconds and its floors in the title. Returns
    the top rows (label, own s, cumulative s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text: a smaller file, searchable

    stats = pstats.Stats(str(prof)).stats  # func -> (cc, nc, tottime, cumtime, callers)
    longest = max(v[3] for v in stats.values())
    scale = total / longest if longest else 1.0  # the profiler's overhead taken off, pro rata
    own = sorted(((label(f), v[2] * scale, v[3] * scale) for f, v in stats.items()), key=lambda r: -r[1])[:TOP]
    # the calls of our own code (bert_core, beam_jobs), and all imports as one row
    ours = [(label(f), v[3] * scale) for f, v in stats.items() if any(p in f[0] for p in OUR_CODE)]
    imports = max((v[3] for f, v in stats.items() if f[2] == "_find_and_load"), default=0.0) * scale
    cumulative = sorted([*ours, ("(all imports)", imports)], key=lambda r: -r[1])[:TOP]
    fig, axes = plt.subplots(1, 2, figsize=(17, 0.36 * TOP + 2.4))
    for ax, rows, what in ((axes[0], [(n, s) for n, s, _ in own], "CPU-s of its own (tottime)"),
                           (axes[1], cumulative, "CPU-s including calls (cumtime), our code")):
        names, secs = [n for n, _ in rows][::-1], [s for _, s in rows][::-1]
        ax.barh(range(len(rows)), secs, color="#4878a8")
        ax.set_yticks(range(len(rows)), names, fontsize=7.5)
        ax.set_xlabel(what)
        for i, s in enumerate(secs):
            ax.text(s, i, f" {s:.2f}", va="center", fontsize=7)
    floor_text = ", ".join(f"{k} {v:.2f}" for k, v in floors.items())
    fig.suptitle(f"{title}: {total:.1f} CPU-s (cProfile on the CPU clock, scaled to the plain run: call-heavy Python looks bigger than it is)\nfloors on the same input, "
                 f"CPU-s: {floor_text}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lstrip(".") or "svg")
    plt.close(fig)
    return own


# --------------------------------------------------------------------------- instances


def job_batches(documents: list[list[str]]) -> list[list[list[str]]]:
    """The documents in the batches the instance job tokenizes at once (``TOKENIZE_CHARS``)."""
    from beam_jobs.create_instances import TokenizeDocuments

    batches: list[list[list[str]]] = [[]]
    chars = 0
    for sentences in documents:
        batches[-1].append(sentences)
        chars += sum(map(len, sentences))
        if chars >= TokenizeDocuments.TOKENIZE_CHARS:
            batches.append([])
            chars = 0
    return batches


def instances(large_mb: float, work: Path, out: Path) -> list[dict]:
    from benchmarks.speed.bench_instances import D, L, P, distinct_documents, write_inputs

    docs = distinct_documents(large_mb)
    text, corpus = write_inputs(docs, work)
    mb = text.stat().st_size / 1e6
    vocab = samples_dir() / "models" / "minilm" / "vocab.txt"
    sets = [f"instances.lengths=[{{max_seq_length: {L}, max_predictions_per_seq: {P}}}]",
            f"instances.dupe_factor={D}", "instances.num_shards=4", "instances.eval_fraction=0",
            "instances.next_sentence_prediction=true", "instances.whole_word_mask=false",
            "instances.masking=static", "workers=1",
            f"pretrain.phases=[{{max_seq_length: {L}, micro_batch_size: 16, global_batch_size: 32}}]",
            "model.max_position_embeddings=512"]
    output = work / "instances"
    argv = ["-m", "flows.cli", "instances", "--corpus", str(corpus), "--vocab", str(vocab), "--output",
            str(output), "--preset", "demo", *(a for s in sets for a in ("--set", s))]
    plain = measure([sys.executable, *argv], work / "instances.log", ENV)
    prof = work / "instances.prof"
    profiled(argv, prof, work / "instances-profiled.log", output, out / "instances-flame.svg")

    # floors, in this process, on the same sentences
    from tokenizers import Tokenizer as HF  # noqa: F401  (imported before timing)

    from bert_core.vocab.tokenization import Tokenizer

    tok = Tokenizer.from_vocab_file(str(vocab))
    lines = [" ".join(s.split()) for _, ss in docs for s in ss]
    backend = tok._backend

    def hf_batch() -> int:
        n = 0
        for i in range(0, len(lines), 4096):
            n += sum(len(e.ids) for e in backend.encode_batch(lines[i:i + 4096], add_special_tokens=False))
        return n

    n_tokens, hf_s = timed(hf_batch)
    tok2 = Tokenizer.from_vocab_file(str(vocab))  # cold caches, as the job starts
    texts = [[" ".join(s.split()) for s in ss] for _, ss in docs]
    _, ours_s = timed(lambda: [tok2.encode_documents_bytes(batch) for batch in job_batches(texts)])

    import pyarrow.parquet as pq

    from bert_core import storage

    table = pq.read_table(str(output / f"seq{L}"))
    _, write_s = timed(lambda: pq.write_table(table, str(work / "alone.parquet"), compression="zstd"))
    manifest = storage.read_manifest(str(output))
    n_instances = manifest["counts"][f"instances_seq{L}"]
    floors = {"encode_batch": hf_s, "our tokenizer": ours_s, "Parquet write": write_s}
    picture(prof, f"instances, {mb:.0f} MB of text, one worker, {n_instances:,} instances", floors,
            plain["cpu_s"], out / "instances.svg")
    print(f"instances: {plain['cpu_s']} CPU-s, {n_tokens:,} tokens; encode_batch {hf_s:.2f} CPU-s "
          f"({n_tokens / hf_s:,.0f} tokens/CPU-s), ours {ours_s:.2f}, Parquet {write_s:.2f}", file=sys.stderr)
    return [row(f"instances, {mb:.0f} MB: stage CPU-s vs tokenizing alone (encode_batch)", plain["cpu_s"], hf_s,
                "CPU-s", plain["cpu_s"] / hf_s, 3),
            row(f"instances, {mb:.0f} MB: our tokenizer's path in the job vs encode_batch", ours_s, hf_s, "CPU-s",
                ours_s / hf_s, 3),
            row(f"instances, {mb:.0f} MB: Parquet of the {n_instances:,} instances written alone", write_s, None,
                "CPU-s"),
            row("tokens per CPU-second, encode_batch (one thread)", n_tokens / hf_s, None, "tokens/CPU-s", digits=0)]


# --------------------------------------------------------------------------- corpus


def corpus(work: Path, out: Path) -> list[dict]:
    from benchmarks.speed.bench_clean import DUMP, LARGE_MB, distinct_multistream

    xml = bz2.decompress((samples_dir() / "wikipedia" / DUMP).read_bytes())
    dump, mb = distinct_multistream(xml, LARGE_MB, work)
    output = work / "corpus"
    argv = ["-m", "flows.cli", "corpus", "--wikipedia", str(dump), "--output", str(output), "--workers", "1"]
    plain = measure([sys.executable, *argv], work / "corpus.log", ENV)
    prof = work / "corpus.prof"
    profiled(argv, prof, work / "corpus-profiled.log", output, out / "corpus-flame.svg")
    bzip2 = measure(["bash", "-c", f"bzip2 -dc {dump} > /dev/null"], work / "bzip2.log", ENV)
    data = dump.read_bytes()

    def libbz2() -> int:  # a multistream dump: one decompressor per stream
        return len(bz2.decompress(data))

    _, py_s = timed(libbz2)
    import pyarrow.parquet as pq

    shards = sorted(p for p in output.rglob("*.parquet") if "rejects" not in str(p))
    import pyarrow as pa

    table = pa.concat_tables([pq.read_table(str(p)) for p in shards]) if shards else None
    _, write_s = timed(lambda: pq.write_table(table, str(work / "docs-alone.parquet"), compression="zstd")) \
        if table is not None else (None, 0.0)
    floors = {"bzip2 -d": bzip2["cpu_s"], "libbz2 (Python bz2)": py_s, "Parquet write": write_s}
    picture(prof, f"corpus, {mb:.0f} MB of XML ({len(data) / 1e6:.1f} MB bz2), one worker", floors,
            plain["cpu_s"], out / "corpus.svg")
    print(f"corpus: {plain['cpu_s']} CPU-s; bzip2 -d {bzip2['cpu_s']}, libbz2 {py_s:.2f}, Parquet {write_s:.2f}",
          file=sys.stderr)
    return [row(f"corpus, {mb:.0f} MB of XML: stage CPU-s vs bzip2 -d", plain["cpu_s"], bzip2["cpu_s"], "CPU-s",
                plain["cpu_s"] / bzip2["cpu_s"], 3),
            row("corpus: libbz2 through Python's bz2 vs bzip2 -d", py_s, bzip2["cpu_s"], "CPU-s",
                py_s / bzip2["cpu_s"], 3),
            row("corpus: the documents' Parquet written alone", write_s, None, "CPU-s")]


# --------------------------------------------------------------------------- books and text records


def text_sources(large_mb: float, work: Path) -> list[dict]:
    """The corpus stage on the distinct text as books (``.txt``) and as JSON lines, each beyond its
    start-up (one book, one record), against reading the same files alone: the lines decoded for
    books, each record parsed for JSON lines; and the documents' sentence splitting alone."""
    import json

    from bert_core.corpus.sentences import split_sentences

    books, records, tiny = work / "books", work / "records", work / "tiny"
    for folder in (books, records, tiny):
        folder.mkdir(exist_ok=True)
    size = 0
    with (records / "docs.jsonl").open("w", encoding="utf-8") as out:
        for i, path in enumerate(distinct_files()):
            if size >= large_mb * 1e6:
                break
            text = path.read_text("utf-8")
            (books / f"{i:05d}.txt").write_text(text, "utf-8")
            out.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
            size += len(text.encode())
    first = sorted(books.glob("*.txt"))[0]
    shutil.copy(first, tiny / "one.txt")
    (tiny / "one.jsonl").write_text(json.dumps({"id": "d0", "text": first.read_text("utf-8")}) + "\n", "utf-8")
    mb = size / 1e6

    def stage(kind: str, pattern: Path, name: str) -> dict:
        output = work / f"out-{name}"
        shutil.rmtree(output, ignore_errors=True)
        return measure([sys.executable, "-m", "flows.cli", "corpus", f"--{kind}", str(pattern), "--output",
                        str(output), "--workers", "1"], work / f"{name}.log", ENV)

    def read_books() -> int:
        return sum(len(p.read_text("utf-8").splitlines()) for p in sorted(books.glob("*.txt")))

    def read_records() -> int:
        with (records / "docs.jsonl").open(encoding="utf-8") as lines:
            return sum(len(json.loads(line)["text"]) for line in lines)

    def split_alone() -> int:
        return sum(len(split_sentences(paragraph)) for p in sorted(books.glob("*.txt"))
                   for paragraph in p.read_text("utf-8").split("\n\n") if paragraph.strip())

    rows = []
    _, split_s = timed(split_alone)
    for kind, name, pattern, one, read in (("books", "books", books / "*.txt", tiny / "one.txt", read_books),
                                           ("text", "jsonl", records / "*.jsonl", tiny / "one.jsonl", read_records)):
        whole, start = stage(kind, pattern, name), stage(kind, one, f"{name}-tiny")
        _, read_s = timed(read)
        beyond = whole["cpu_s"] - start["cpu_s"]
        print(f"{name}: {whole['cpu_s']} CPU-s, start-up {start['cpu_s']}; read alone {read_s:.2f}, "
              f"sentences alone {split_s:.2f}", file=sys.stderr)
        rows += [row(f"corpus stage, {mb:.0f} MB as {name}: CPU-s beyond start-up vs reading alone", beyond, read_s,
                     "CPU-s", beyond / read_s, 3),
                 row(f"corpus stage, {mb:.0f} MB as {name}: CPU-s beyond start-up vs splitting its sentences alone",
                     beyond, split_s, "CPU-s", beyond / split_s, 3),
                 row(f"corpus stage, one {name[:-1] if name == 'books' else 'record'}: start-up CPU-s",
                     start["cpu_s"], None, "CPU-s")]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", default="instances,corpus,text",
                        help="instances, corpus (a dump), text (books and JSON lines), comma-separated")
    parser.add_argument("--large-mb", type=float, default=44.0, help="text of the instances input (MB)")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "profiles",
                        help="folder of the pictures (docs/profiles for the docs)")
    parser.add_argument("--py-spy", default="", help="py-spy's program: also a flame graph of each stage")
    parser.add_argument("--keep", type=Path, help="keep the inputs, outputs and .prof files here")
    args = parser.parse_args()
    global PY_SPY
    PY_SPY = args.py_spy and shutil.which(args.py_spy) or ""
    if args.py_spy and not PY_SPY:
        sys.exit(f"--py-spy {args.py_spy}: no such program; pip install py-spy, or leave --py-spy out")
    if set(args.stages.split(",")) - {"instances", "corpus", "text"}:
        sys.exit(f"--stages {args.stages}: each stage is instances, corpus or text")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="profile-stages-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        stages = args.stages.split(",")
        if "instances" in stages:
            (work / "i").mkdir(exist_ok=True)
            rows += instances(args.large_mb, work / "i", args.out)
        if "corpus" in stages:
            (work / "c").mkdir(exist_ok=True)
            rows += corpus(work / "c", args.out)
        if "text" in stages:
            (work / "t").mkdir(exist_ok=True)
            rows += text_sources(args.large_mb, work / "t")
    write_rows("profile", rows, load=os.getloadavg())


if __name__ == "__main__":
    main()
