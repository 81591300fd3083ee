"""Vocab stage: ours (Beam word counts -> WordPiece trained from the counts) vs training HF
tokenizers' WordPiece directly on the raw text (one process, the usual way), same settings.

    python -m benchmarks.speed.bench_vocab                 # samples from ~/.cache/bertpipe/samples
    BERTPIPE_SAMPLES=samples python -m benchmarks.speed.bench_vocab --vocab-size 8000

Both see the same text: every non-empty line of the sample corpus (the Gutenberg book, the 300
news articles, the 38 plays, and the enwiki excerpt with XML entities decoded), ours as a
documents folder of 40-line documents (the corpus contract). Same vocab size, min_frequency,
limit_alphabet and special tokens. Measured: wall time (ours with 1 and 2 Beam workers; it
includes Beam's start-up, which dominates on a corpus this small) and the Jaccard similarity of
the two vocabs (the claim of bert_core/vocab/training.py: feeding counts reproduces raw-text
training). Rows go to ``bench-results/vocab.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_rows
from benchmarks.speed.bench_tokenization import corpus_lines, samples


def write_documents(folder: Path, lines: list[str], per_doc: int = 40, num_shards: int = 4) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bert_core import storage

    docs = [{"doc_id": f"bench:{i:07d}", "source": "books", "title": "", "sentences": lines[i:i + per_doc]}
            for i in range(0, len(lines), per_doc)]
    entries = []
    for k in range(num_shards):
        part = docs[k::num_shards]
        uri = str(folder / f"docs-{k:05d}-of-{num_shards:05d}.parquet")
        pq.write_table(pa.Table.from_pylist(part), uri)
        entries.append(storage.shard_entry(uri, len(part)))
    storage.write_manifest(str(folder), stage="corpus", config={}, shards=entries,
                           counts={"documents": len(docs)})
    return str(folder)


def raw_text_training(lines: list[str], vocab_size: int, num_unused: int) -> set[str]:
    from tokenizers import Tokenizer, models, trainers

    from bert_core.vocab.tokenization import bert_normalizer, bert_pre_tokenizer
    from bert_core.vocab.training import special_tokens

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = bert_normalizer(lowercase=True)
    tok.pre_tokenizer = bert_pre_tokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=2, limit_alphabet=1000,
                                        special_tokens=special_tokens(num_unused), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return set(tok.get_vocab())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--num-unused", type=int, default=10)
    args = parser.parse_args(argv)

    from beam_jobs import build_vocab
    from bert_core.config import VocabConfig

    lines = [line for line in corpus_lines(samples()) if line.strip()]
    cfg = VocabConfig(vocab_size=args.vocab_size, num_unused=args.num_unused)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_documents(Path(tmp), lines)
        start = time.perf_counter()
        theirs = raw_text_training(lines, args.vocab_size, args.num_unused)
        ref_s = time.perf_counter() - start
        ours_s = {}
        for workers in (1, 2):
            out = os.path.join(tmp, f"vocab{workers}")
            start = time.perf_counter()
            build_vocab.run(cfg, corpus, out, workers=workers)
            ours_s[workers] = time.perf_counter() - start
        ours = set(Path(tmp, "vocab1", "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1])
        same_bytes = Path(tmp, "vocab1", "vocab.txt").read_bytes() == Path(tmp, "vocab2", "vocab.txt").read_bytes()
    jaccard = len(ours & theirs) / len(ours | theirs)
    print(f"{len(lines)} lines; raw-text training {ref_s:.1f} s; ours {ours_s[1]:.1f} s (1 worker), "
          f"{ours_s[2]:.1f} s (2 workers); vocab Jaccard {jaccard:.4f}; 1 vs 2 workers same bytes: {same_bytes}")
    rows = [
        {"measure": "wall seconds, 1 worker (ours incl. Beam start-up)", "ours": round(ours_s[1], 2),
         "reference": round(ref_s, 2), "ratio": round(ref_s / ours_s[1], 3), "unit": "s"},
        {"measure": "wall seconds, 2 workers (ours)", "ours": round(ours_s[2], 2),
         "reference": round(ref_s, 2), "ratio": round(ref_s / ours_s[2], 3), "unit": "s"},
        {"measure": "vocab Jaccard, ours vs raw-text training", "ours": round(jaccard, 5),
         "reference": 1.0, "ratio": round(jaccard, 5), "unit": "fraction"},
        {"measure": "vocab.txt identical with 1 and 2 workers", "ours": int(same_bytes),
         "reference": None, "ratio": None, "unit": "bool"},
    ]
    write_rows("vocab", rows)


if __name__ == "__main__":
    main()
