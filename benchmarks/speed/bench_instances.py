"""Instance creation: ours (Beam job) vs google-research/bert's create_pretraining_data.py.

    python -m benchmarks.speed.bench_instances                  # sample corpus + 44 MB of distinct text
    python -m benchmarks.speed.bench_instances --large-mb 0     # the sample corpus only

The reference is google-research/bert's own ``create_pretraining_data.py`` as published on PyPI
(``bert-tensorflow==1.0.4``), run unmodified in its own venv (``$BERTPIPE_CACHE/bench-venv-tf``).
Both sides get the same documents, vocab and settings (ours set to the reference's algorithm:
next-sentence pairs, static token-level masking). Three corpora: the sample, the sample plus
distinct text up to ``--large-mb``, and the sample's first few documents, which measure each
side's fixed start-up. The statistics of both outputs come from the same code and are compared
with z = difference / (sd over ``--seeds`` extra seeds x sqrt 2). Rows: ``bench-results/instances.json``.
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
from pathlib import Path

from benchmarks.common import ROOT, distinct_files, measure, reference_venv, row, write_rows
from benchmarks.common import samples as samples_dir

SECTION = 40  # sentences per document cut from a book or play
STARTUP_DOCUMENTS = 20  # the few documents that measure each side's fixed start-up costs
TF_PACKAGES = ["tensorflow-cpu==2.21.0", "bert-tensorflow==1.0.4"]
ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "2", "TOKENIZERS_PARALLELISM": "false"}
L, P, D = 128, 20, 2  # max_seq_length, max_predictions_per_seq, dupe_factor of both sides
SEEDS = 6  # extra seeds for the sampling error

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
    n = sum(f["input_mask"].int64_list.value)
    ids = list(f["input_ids"].int64_list.value)[:n]
    k = int(sum(f["masked_lm_weights"].float_list.value))
    positions = list(f["masked_lm_positions"].int64_list.value)[:k]
    labels = list(f["masked_lm_ids"].int64_list.value)[:k]
    nsp = int(f["next_sentence_labels"].int64_list.value[0])
    stats.add(ids, positions, labels, nsp, mask_id, n_special=3)
print(json.dumps(stats.summary()))
"""


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
    news = (root / "news" / "lee_background.cor").read_text("utf-8").splitlines()
    books = sorted([*(root / "books").glob("*.txt"), *(root / "plays").glob("*.md")])
    return sections([*((f"news:{i}", split_sentences(line)) for i, line in enumerate(news)),
                     *((f"book:{path.stem}", book_sentences(path)) for path in books)])


def text_bytes(docs: list[tuple[str, list[str]]]) -> int:
    """Size of the documents in the reference's text format."""
    return sum(len(" ".join(s.split()).encode()) + 1 for _, ss in docs for s in ss) + len(docs)


def distinct_documents(total_mb: float) -> list[tuple[str, list[str]]]:
    """The sample corpus, then distinct real text (benchmarks.text.distinct_text: manuals, guides, the
    King James Bible; every source in turn) up to ``total_mb`` of text. No copies."""
    docs = sample_documents()
    have = text_bytes(docs)
    for path in distinct_files():
        if have >= total_mb * 1e6:
            break
        more = sections([(f"{path.parent.name}:{path.stem}", book_sentences(path))])
        docs += more
        have += text_bytes(more)
    if have < total_mb * 1e6:
        print(f"only {have / 1e6:.1f} MB of distinct text (asked for {total_mb} MB)", file=sys.stderr)
    return docs


def write_inputs(docs: list[tuple[str, list[str]]], work: Path) -> tuple[Path, Path]:
    """The same documents as our documents folder and, beside it, the reference's text format."""
    from bert_core import storage
    from bert_core.corpus.documents import DocumentShardWriter

    text, folder = work / "docs.txt", work / "corpus"
    shard = storage.join(str(folder), "docs-00000-of-00001.parquet")
    writer = DocumentShardWriter(shard, text_uri=str(text))
    for doc_id, sentences in docs:
        # a line break inside a sentence would split it in the reference's reader
        writer.add({"doc_id": doc_id, "source": "books", "title": doc_id,
                    "sentences": [" ".join(s.split()) for s in sentences]})
    writer.close()
    storage.write_manifest(str(folder), stage="corpus", config={"bench": True},
                           shards=[storage.shard_entry(shard, len(docs))], counts={"documents": len(docs)})
    return text, folder


STAT_KEYS = ["instances", "mean_length", "masked_fraction", "mask_token_fraction", "kept_fraction",
             "random_token_fraction", "random_next_fraction"]


def seed_spread(docs: list[tuple[str, list[str]]], vocab: Path) -> dict[str, float]:
    """Standard deviation of each statistic over seeds: the sampling error of one run, from the
    Beam job's own pure functions rerun with other seeds. (The target length is drawn once per
    document and pass, so instances are not independent draws: a binomial error would be too small.)"""
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
    for seed in range(1000, 1000 + SEEDS):
        stats = InstanceStats(max_seq_length=L)
        for pool, doc_ids in built:
            b = create_instance_batch(pool, doc_ids, seed=seed, dupe_factor=D, max_seq_length=L,
                                      max_predictions_per_seq=P, masked_lm_prob=0.15,
                                      short_seq_prob=0.1, vocab=vocab_ids)
            stats.add_columns(b.input_ids, b.offsets, b.len_a, b.masked_lm_positions, b.masked_lm_ids,
                              b.mask_offsets, b.next_sentence_label, vocab_ids.mask_id)
        summary = stats.summary()
        for k in STAT_KEYS:
            values[k].append(summary[k])
    return {k: statistics.stdev(v) for k, v in values.items()}


def compare(docs: list[tuple[str, list[str]]], label: str, tf_python: Path, workers: tuple[int, ...],
            spread: bool = True) -> dict:
    """Both sides on the same documents, with the sample MiniLM's vocab: timings, stats, sampling spread."""
    vocab = samples_dir() / "models" / "minilm" / "vocab.txt"
    mask_id = vocab.read_text("utf-8").splitlines().index("[MASK]")
    with tempfile.TemporaryDirectory(prefix="bench-instances-") as tmp:
        work = Path(tmp)
        text, corpus = write_inputs(docs, work)
        n_sent = sum(len(s) for _, s in docs)
        mb = text.stat().st_size / 1e6
        print(f"{label}: {len(docs)} documents, {n_sent} sentences, {mb:.1f} MB text; "
              f"max_seq_length={L} dupe_factor={D}", file=sys.stderr)

        ref = measure([str(tf_python), "-m", "bert.create_pretraining_data", f"--input_file={text}",
                     f"--output_file={work / 'ref.tfrecord'}", f"--vocab_file={vocab}",
                     "--do_lower_case=True", f"--max_seq_length={L}", f"--max_predictions_per_seq={P}",
                     f"--dupe_factor={D}", "--masked_lm_prob=0.15", "--short_seq_prob=0.1",
                     "--random_seed=12345"], work / "ref.log", ENV)
        reader = work / "read_tfrecords.py"
        reader.write_text(READ_TFRECORDS)
        ref_stats = json.loads(subprocess.run(
            [str(tf_python), str(reader), str(ROOT), str(work / "ref.tfrecord"), str(L), str(mask_id)],
            env={**os.environ, **ENV}, capture_output=True, text=True, check=True).stdout)

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
            argv = [sys.executable, "-m", "flows.cli", "instances", "--corpus", str(corpus),
                    "--vocab", str(vocab), "--output", str(work / f"ours-w{w}"), "--preset", "demo",
                    *(arg for s in [f"workers={w}", *sets] for arg in ("--set", s))]
            ours[w] = measure(argv, work / f"ours-w{w}.log", {**ENV, "PYTHONPATH": str(ROOT)})
        from bert_core import storage

        our_stats = storage.read_manifest(str(work / "ours-w1"))["stats"][f"seq{L}"]
    sd = seed_spread(docs, vocab) if spread else {}
    return {"ref": ref, "ours": ours, "ref_stats": ref_stats, "our_stats": our_stats, "spread": sd,
            "documents": len(docs), "sentences": n_sent, "mb": mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large-mb", type=float, default=44.0,
                        help="Also measure the sample plus distinct real text up to this many MB "
                             "(extra rows, one worker; 0: skip).")
    args = parser.parse_args()
    tf_python = reference_venv("bench-venv-tf", TF_PACKAGES, "tensorflow, bert.create_pretraining_data")
    rows = []

    def add(measure: str, o: float, r: float, unit: str, **extra: float) -> None:
        rows.append(row(measure, o, r, unit, o / r if r else None, digits=4, **extra))

    def stat_rows(m: dict, suffix: str) -> None:
        # z = difference / sampling error of a difference of two runs (sd over seeds x sqrt 2)
        for key in STAT_KEYS:
            o, r = m["our_stats"][key], m["ref_stats"][key]
            se = m["spread"][key] * math.sqrt(2)
            add(key + suffix, o, r,
                "count" if key == "instances" else "tokens" if key == "mean_length" else "fraction",
                z=round((o - r) / se, 2) if se else None)

    def process_rows(m: dict, tag: str) -> None:
        ref, ours = m["ref"], m["ours"][1]
        add("instances per CPU-second" + tag, m["our_stats"]["instances"] / ours["cpu_s"],
            m["ref_stats"]["instances"] / ref["cpu_s"], "instances/s")
        add("wall time, 1 process" + tag, ours["wall_s"], ref["wall_s"], "s")
        add("CPU time, 1 process" + tag, ours["cpu_s"], ref["cpu_s"], "s")
        add("peak RSS, 1 process" + tag, ours["peak_rss_mb"], ref["peak_rss_mb"], "MB")

    main_run = compare(sample_documents(), "sample corpus", tf_python, (1, 2))
    ref, ours = main_run["ref"], main_run["ours"]
    n_ref, n_ours = main_run["ref_stats"]["instances"], main_run["our_stats"]["instances"]
    add("instances/s per process (wall)", n_ours / ours[1]["wall_s"], n_ref / ref["wall_s"], "instances/s")
    process_rows(main_run, "")
    add("instances/s, ours 2 workers vs reference (wall)", n_ours / ours[2]["wall_s"], n_ref / ref["wall_s"],
        "instances/s")
    stat_rows(main_run, "")
    runs = {"sample": main_run}
    if args.large_mb:
        # Fixed costs (interpreter, imports, pipeline start-up) measured on a few documents, so
        # the large run's cost splits into start-up + per-MB.
        tiny = compare(sample_documents()[:STARTUP_DOCUMENTS], "start-up", tf_python, (1,), spread=False)
        big = compare(distinct_documents(args.large_mb), "distinct text", tf_python, (1,))
        runs["startup"], runs["distinct"] = tiny, big
        tag = f" ({big['mb']:.0f} MB distinct text)"
        process_rows(big, tag)
        add(f"start-up CPU time ({STARTUP_DOCUMENTS} documents)", tiny["ours"][1]["cpu_s"], tiny["ref"]["cpu_s"], "s")
        extra_mb = big["mb"] - tiny["mb"]
        per_mb = [big["ours"][1]["cpu_s"] - tiny["ours"][1]["cpu_s"], big["ref"]["cpu_s"] - tiny["ref"]["cpu_s"]]
        add("MB of text per CPU-second beyond start-up" + tag, extra_mb / per_mb[0], extra_mb / per_mb[1],
            "MB/CPU-s")
        n_extra = [big["our_stats"]["instances"] - tiny["our_stats"]["instances"],
                   big["ref_stats"]["instances"] - tiny["ref_stats"]["instances"]]
        add("instances per CPU-second beyond start-up" + tag, n_extra[0] / per_mb[0], n_extra[1] / per_mb[1],
            "instances/s")
        stat_rows(big, tag)

    setup = {"documents": main_run["documents"], "sentences": main_run["sentences"], "max_seq_length": L,
             "max_predictions_per_seq": P, "dupe_factor": D, "reference": TF_PACKAGES, "cpu_count": os.cpu_count(),
             "text_mb": {name: round(m["mb"], 2) for name, m in runs.items()}}
    stats = {name: {"ours": m["our_stats"], "reference": m["ref_stats"], "sd_over_seeds": m["spread"]}
             for name, m in runs.items() if m["spread"]}
    write_rows("instances", rows, setup=setup, stats=stats)


if __name__ == "__main__":
    main()
