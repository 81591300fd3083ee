"""Tokenizer: ours (HF tokenizers, bert_core/vocab/tokenization.py) vs transformers' pure-Python BERT
tokenizer (``BertTokenizerLegacy``, the Google algorithm), on every line of the sample corpus.

    BERTPIPE_SAMPLES=samples python -m benchmarks.speed.bench_tokenization --casings uncased

Both get the same lines and the sample MiniLM's bert-base-uncased ``vocab.txt``, with Google's
200-character word limit. Measured: tokens per CPU-second on one thread, and the lines whose ids
differ (they must not). Rows: ``bench-results/tokenization.json``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.common import row, sample_texts, samples, timed, write_rows

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: a per-core comparison
os.environ.setdefault("RAYON_NUM_THREADS", "1")


def corpus_lines(root: Path) -> list[str]:
    """Every line of the sample texts (the enwiki excerpt's XML crudely: a line each)."""
    return [line for text in sample_texts(root) for line in text.split("\n")]


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
        got, ours_s = timed(lambda ours=ours: ours.encode_batch(lines))
        want, ref_s = timed(lambda ref=ref: [ref.convert_tokens_to_ids(ref.tokenize(x)) for x in lines])
        tokens = sum(map(len, want))
        differ = sum(a != b for a, b in zip(got, want, strict=True))
        print(f"{casing}: {len(lines)} lines, {tokens} tokens; ours {ours_s:.1f} CPU-s, "
              f"reference {ref_s:.1f} CPU-s ({ref_s / ours_s:.1f}x); lines with different ids: {differ}")
        rows += [row(f"{casing}: tokens per CPU-second (1 thread)", round(tokens / ours_s), round(tokens / ref_s),
                     "tokens/s", ref_s / ours_s),
                 row(f"{casing}: lines with ids different from the reference (of {len(lines)})", differ, 0, "lines")]
    write_rows("tokenization", rows)


if __name__ == "__main__":
    main()
