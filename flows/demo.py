"""`make demo`: the whole pipeline on the real sample corpus, as far as it exists.

    python -m flows.demo --samples samples
"""

from __future__ import annotations

import argparse

from bert_core.config import load_config
from bert_core.samples import fetch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", default="samples")
    args = parser.parse_args(argv)
    out = fetch(args.samples)
    cfg = load_config("demo")
    print(f"samples: {out}")
    print(f"demo preset: {cfg.model.num_hidden_layers}-layer BERT, vocab {cfg.vocab.vocab_size}, "
          f"{len(cfg.instances.lengths)} sequence lengths")
    print("Stages available so far: samples, config. The Beam, training and Prefect stages are "
          "not built yet (see the status table in README.md).")


if __name__ == "__main__":
    main()
