"""Tokenizer: ours (HF tokenizers, bert_core/vocab/tokenization.py) vs transformers' pure-Python BERT
tokenizer (``BertTokenizerLegacy`` in transformers 5, the Google algorithm), on every line of the
sample corpus.

    python -m benchmarks.speed.bench_tokenization                 # samples from ~/.cache/bertpipe/samples
    BERTPIPE_SAMPLES=samples python -m benchmarks.speed.bench_tokenization --casings uncased

Both get the same lines (the Gutenberg book, the 300 news articles, the 38 plays, and the enwiki
excerpt crudely stripped: XML entities decoded, one line each) and the bert-base-uncased
``vocab.txt`` of the sample MiniLM model, with Google's 200-character word limit on both sides.
Measured: tokens per CPU-second on one thread (CPU time of this process, robust to other load on
the machine; ours runs with ``TOKENIZERS_PARALLELISM=false``), and the number of lines whose ids
differ (they must not). Rows go to ``bench-results/tokenization.json``.
"""

from __future__ import annotations

import argparse
import bz2
import html
import os
import time
from pathlib import Path

from benchmarks.common import samples, write_rows

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: a per-core comparison
os.environ.setdefault("RAYON_NUM_THREADS", "1")




def corpus_lines(root: Path) -> list[str]:
    lines = (root / "books" / "botchan.txt").read_text(encoding="utf-8").split("\n")
    lines += (root / "news" / "lee_background.cor").read_text(encoding="utf-8").split("\n")
    for play in sorted((root / "plays").glob("*.md")):
        lines += play.read_text(encoding="utf-8").split("\n")
    for dump in sorted((root / "wikipedia").glob("*.xml.bz2")):
        with bz2.open(dump, "rt", encoding="utf-8") as f:
            lines += html.unescape(f.read()).split("\n")
    return lines


def cpu_timed(fn):
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--casings", nargs="+", default=["uncased", "cased"], choices=["uncased", "cased"])
    args = parser.parse_args(argv)

    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    from bert_core.vocab.tokenization import Tokenizer

    root = samples()
    vocab = root / "models" / "minilm" / "vocab.txt"
    lines = corpus_lines(root)
    rows = []
    for casing in args.casings:
        lowercase = casing == "uncased"
        ours = Tokenizer.from_vocab_file(str(vocab), lowercase=lowercase)
        ref = BertTokenizerLegacy(str(vocab), do_lower_case=lowercase)
        ref.wordpiece_tokenizer.max_input_chars_per_word = 200
        got, ours_s = cpu_timed(lambda ours=ours: ours.encode_batch(lines))
        want, ref_s = cpu_timed(lambda ref=ref: [ref.convert_tokens_to_ids(ref.tokenize(x)) for x in lines])
        tokens = sum(map(len, want))
        differ = sum(a != b for a, b in zip(got, want, strict=True))
        print(f"{casing}: {len(lines)} lines, {tokens} tokens; ours {ours_s:.1f} CPU-s, "
              f"reference {ref_s:.1f} CPU-s ({ref_s / ours_s:.1f}x); lines with different ids: {differ}")
        rows += [
            {"measure": f"{casing}: tokens per CPU-second (1 thread)", "ours": round(tokens / ours_s),
             "reference": round(tokens / ref_s), "ratio": round(ref_s / ours_s, 2), "unit": "tokens/s"},
            {"measure": f"{casing}: lines with ids different from the reference (of {len(lines)})",
             "ours": differ, "reference": 0, "ratio": None, "unit": "lines"},
        ]
    write_rows("tokenization", rows)


if __name__ == "__main__":
    main()
