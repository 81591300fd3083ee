"""Fine-tuning: ours (bert_core.finetune) vs transformers' Trainer + BertForSequenceClassification.

    BERTPIPE_SAMPLES=samples OMP_NUM_THREADS=2 python -m benchmarks.speed.bench_finetune

The sample MiniLM checkpoint fine-tuned on the real sentiment task by both, one after the other,
with the same examples (encoded once by our tokenizer), hyper-parameters and torch threads.
Accuracy must agree (the majority-class rate is chance); throughput is examples per second.
Rows: ``bench-results/finetune.json``.
"""

from __future__ import annotations

import os
import time

from benchmarks.common import row, samples, write_rows

TRAIN_EXAMPLES, DEV_EXAMPLES, SEED = 480, 400, 1


def run_ours(checkpoint: str, train, dev, cfg, seed: int, pad_id: int) -> dict:
    import numpy as np

    from bert_core.finetune.data import TaskData
    from bert_core.finetune.train import train_and_predict

    data = TaskData(kind="classification", num_labels=2, train=train, evals={"dev": dev},
                    finish=lambda s, o: ({}, {}))
    out = train_and_predict(data, checkpoint, cfg, seed, pad_id)
    pred = np.stack(out["outputs"]["dev"]).argmax(-1)
    acc = float((pred == np.array([f["label"] for f in dev])).mean())
    return {"accuracy": acc, "train_examples_per_second": out["train"]["examples_per_second"],
            "train_seconds": out["train"]["seconds"], "steps": out["train"]["steps"]}


def run_transformers(checkpoint: str, train, dev, cfg, seed: int, pad_id: int, workdir: str) -> dict:
    import functools

    import numpy as np
    import torch
    from transformers import BertForSequenceClassification, Trainer, TrainingArguments

    from bert_core.finetune.data import collate

    steps_per_epoch = -(-len(train) // cfg.batch_size)
    total = max(1, int(np.ceil(steps_per_epoch * cfg.num_train_epochs)))
    args = TrainingArguments(
        output_dir=workdir, learning_rate=cfg.learning_rate, per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=64, num_train_epochs=cfg.num_train_epochs,
        warmup_steps=int(cfg.warmup_proportion * total), weight_decay=cfg.weight_decay,
        adam_epsilon=1e-6, max_grad_norm=1.0, lr_scheduler_type="linear", seed=seed,
        use_cpu=True, report_to=[], save_strategy="no", eval_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(checkpoint, num_labels=2)
    trainer = Trainer(model=model, args=args, train_dataset=train,
                      data_collator=functools.partial(collate, "classification", pad_id=pad_id))
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logits = trainer.predict(dev).predictions
    acc = float((np.asarray(logits).argmax(-1) == np.array([f["label"] for f in dev])).mean())
    # Trainer goes through every example each epoch (the last batch may be short), as ours does.
    seen = round(len(train) * cfg.num_train_epochs)
    return {"accuracy": acc, "train_examples_per_second": round(seen / seconds, 2),
            "train_seconds": round(seconds, 3), "steps": total}


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import tempfile

    import torch

    from bert_core.config import FinetuneConfig
    from bert_core.finetune.glue import SENTIMENT_LABELS, encode_examples, read_sentiment
    from bert_core.vocab.tokenization import load_tokenizer

    # 1 thread by default: on a shared, oversubscribed CPU two spinning OpenMP threads run slower than one.
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    folder = samples()
    checkpoint = str(folder / "models" / "minilm")
    tokenizer = load_tokenizer(checkpoint)
    # few steps here, so a learning rate above the paper's grid (tuned for thousands of steps)
    cfg = FinetuneConfig(learning_rate=2e-4, batch_size=16, num_train_epochs=1.0, max_seq_length=64, threads=threads)
    sentiment = str(folder / "tasks" / "sentiment")
    train, dev = (encode_examples(tokenizer, read_sentiment(sentiment, part)[0][:n], SENTIMENT_LABELS, cfg.max_seq_length)
                  for part, n in (("train", TRAIN_EXAMPLES), ("dev", DEV_EXAMPLES)))
    labels = [f["label"] for f in dev]
    majority = max(labels.count(0), labels.count(1)) / len(labels)
    print(f"sentiment: {len(train)} train / {len(dev)} dev examples (majority class {majority:.3f}), "
          f"MiniLM, lr {cfg.learning_rate}, batch {cfg.batch_size}, {cfg.num_train_epochs} epoch(s), "
          f"{threads} threads", flush=True)
    ours = run_ours(checkpoint, train, dev, cfg, SEED, tokenizer.pad_id)
    with tempfile.TemporaryDirectory() as work:
        ref = run_transformers(checkpoint, train, dev, cfg, SEED, tokenizer.pad_id, work)
    rows = [row("sentiment dev accuracy (MiniLM)", ours["accuracy"], ref["accuracy"], "accuracy",
                ours["accuracy"] / max(ref["accuracy"], 1e-9), 4),
            row("fine-tune training throughput (MiniLM)", ours["train_examples_per_second"],
                ref["train_examples_per_second"], "examples/s",
                ours["train_examples_per_second"] / max(ref["train_examples_per_second"], 1e-9), 4)]
    settings = {"train_examples": TRAIN_EXAMPLES, "dev_examples": DEV_EXAMPLES, "seed": SEED, **cfg.model_dump(
        include={"learning_rate", "batch_size", "num_train_epochs", "max_seq_length", "threads"})}
    write_rows("finetune", rows, majority_class=majority, ours=ours, transformers=ref, settings=settings)


if __name__ == "__main__":
    main()
