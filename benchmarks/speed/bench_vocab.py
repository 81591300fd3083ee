"""Vocab stage: ours (Beam word counts -> WordPiece trained from the counts) vs training HF
tokenizers' WordPiece directly on the raw text (one process, the usual way), same settings.

    BERTPIPE_SAMPLES=samples python -m benchmarks.speed.bench_vocab --vocab-size 8000

Both see every non-empty line of the sample corpus (ours as 40-line documents). Measured: wall
time (ours with 1 and 2 Beam workers, Beam's start-up included) and the Jaccard similarity of the
two vocabs. Rows: ``bench-results/vocab.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import row, samples, timed, write_rows
from benchmarks.speed.bench_tokenization import corpus_lines
from bert_core.config import VocabConfig


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


def raw_text_training(lines: list[str], cfg: VocabConfig) -> set[str]:
    from tokenizers import Tokenizer, models, trainers

    from bert_core.vocab.tokenization import bert_normalizer, bert_pre_tokenizer
    from bert_core.vocab.training import special_tokens

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = bert_normalizer(lowercase=True)
    tok.pre_tokenizer = bert_pre_tokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                        limit_alphabet=cfg.limit_alphabet, special_tokens=special_tokens(cfg.num_unused),
                                        show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return set(tok.get_vocab())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args(argv)

    from beam_jobs import build_vocab

    lines = [line for line in corpus_lines(samples()) if line.strip()]
    cfg = VocabConfig(vocab_size=args.vocab_size, num_unused=10)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_documents(Path(tmp), lines)
        theirs, ref_s = timed(lambda: raw_text_training(lines, cfg), time.perf_counter)
        ours_s = {w: timed(lambda w=w: build_vocab.run(cfg, corpus, os.path.join(tmp, f"vocab{w}"), workers=w),
                           time.perf_counter)[1] for w in (1, 2)}
        ours = set(Path(tmp, "vocab1", "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1])
        same_bytes = Path(tmp, "vocab1", "vocab.txt").read_bytes() == Path(tmp, "vocab2", "vocab.txt").read_bytes()
    jaccard = len(ours & theirs) / len(ours | theirs)
    print(f"{len(lines)} lines; raw-text training {ref_s:.1f} s; ours {ours_s[1]:.1f} s (1 worker), "
          f"{ours_s[2]:.1f} s (2 workers); vocab Jaccard {jaccard:.4f}; 1 vs 2 workers same bytes: {same_bytes}")
    rows = [
        row("wall seconds, 1 worker (ours incl. Beam start-up)", ours_s[1], ref_s, "s", ref_s / ours_s[1], 2),
        row("wall seconds, 2 workers (ours)", ours_s[2], ref_s, "s", ref_s / ours_s[2], 2),
        row("vocab Jaccard, ours vs raw-text training", jaccard, 1.0, "fraction", jaccard, 5),
        row("vocab.txt identical with 1 and 2 workers", int(same_bytes), None, "bool"),
    ]
    write_rows("vocab", rows)


if __name__ == "__main__":
    main()
