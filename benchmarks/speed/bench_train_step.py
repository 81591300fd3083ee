"""Pre-training step: ours (bert_core.model.bert) vs transformers.BertForPreTraining, side by side.

    BERTPIPE_SAMPLES=samples OMP_NUM_THREADS=1 python -m benchmarks.speed.bench_train_step
    python -m benchmarks.speed.bench_train_step --instances bertpipe-data/instances/<version> --sizes base
    python -m benchmarks.speed.bench_train_step --sizes base --mlm-loss-chunk 64  # ours: the chunked masked-LM loss

One step (forward with MLM + NSP loss, backward, AdamW) on the same batch of real instances
(Botchan cut by the instance stage's functions, or ``--instances``), the same weights and threads,
dropout on, at the demo and the BERT-base size; the two are timed alternately in process CPU
time, the fastest timed step counting. Throughput is non-padding tokens per CPU-second. Also
timed: the data loader, against the sequences/s the demo-size step consumes.
Rows: ``bench-results/train_step.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import hf_labels, make_pair, row, samples, timed, write_rows

MAX_SEQ_LENGTH = 128
MAX_PREDICTIONS = 20
BATCH, BASE_BATCH = 16, 8  # sequences per step: at the tiny to small sizes, at base and large
STEPS, WARMUP = 2, 1  # timed steps per model and size (the fastest counts), untimed steps first


def build_instances(samples: Path, root: Path, num_shards: int = 2) -> str:
    """Botchan -> sentences -> tokenized documents -> seq128 instances in the instances contract."""
    from bert_core import storage
    from bert_core.config import InstanceConfig, SequenceSpec
    from bert_core.corpus.sentences import split_sentences
    from bert_core.instances.batch import create_instance_batch, write_instance_shards
    from bert_core.instances.pairs import DocumentPool, VocabIds
    from bert_core.vocab.tokenization import Tokenizer

    vocab_file = samples / "models" / "minilm" / "vocab.txt"
    vocab_dir = root / "vocab"
    vocab_dir.mkdir(parents=True, exist_ok=True)
    (vocab_dir / "vocab.txt").write_text(vocab_file.read_text())
    vocab_manifest = storage.write_manifest(str(vocab_dir), stage="vocab", config={"lowercase": True})
    tok = Tokenizer.from_vocab_file(str(vocab_file))
    text = (samples / "books" / "botchan.txt").read_text(encoding="utf-8-sig")
    body = text.split("*** START OF", 1)[-1].split("\n", 1)[-1].split("*** END OF", 1)[0]
    paragraphs = [" ".join(p.split()) for p in body.split("\n\n") if p.strip()]
    sentences = [s for p in paragraphs for s in split_sentences(p)]
    encoded = [ids for ids in tok.encode_batch(sentences) if ids]
    docs = [encoded[i:i + 60] for i in range(0, len(encoded), 60)]  # ~chapter-sized documents
    spec = SequenceSpec(max_seq_length=MAX_SEQ_LENGTH, max_predictions_per_seq=MAX_PREDICTIONS)
    cfg = InstanceConfig(lengths=[spec], dupe_factor=1, num_shards=num_shards)
    batch = create_instance_batch(
        DocumentPool.from_documents(docs), [f"book:botchan:{i}" for i in range(len(docs))],
        seed=cfg.seed, dupe_factor=1, max_seq_length=MAX_SEQ_LENGTH,
        max_predictions_per_seq=MAX_PREDICTIONS, masked_lm_prob=cfg.masked_lm_prob,
        short_seq_prob=cfg.short_seq_prob, vocab=VocabIds.from_tokenizer(tok),
    )
    out = root / "instances"
    folder = out / f"seq{MAX_SEQ_LENGTH}"
    shards = write_instance_shards(batch, str(folder), num_shards)
    storage.write_manifest(str(folder), stage="instances", config=cfg, shards=shards,
                           counts={"instances": len(batch)})
    storage.write_manifest(str(out), stage="instances", config=cfg, inputs=[vocab_manifest],
                           counts={"instances": len(batch)})
    return str(out)


RAW_KEYS = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions", "masked_lm_ids",
            "masked_lm_weights", "next_sentence_label")


def bench_size(size: str, batch, vocab_size: int, mlm_loss_chunk: int = 0) -> dict:
    import torch

    cfg, ours, ref, attn = make_pair(size, vocab_size)
    ours.mlm_loss_chunk = mlm_loss_chunk
    labels = hf_labels(batch)
    hf_batch = {"input_ids": batch["input_ids"], "token_type_ids": batch["token_type_ids"],
                "attention_mask": batch["attention_mask"], "labels": labels,
                "next_sentence_label": batch["next_sentence_label"]}
    losses = {"ours": lambda: ours(**batch)["loss"], "ref": lambda: ref(**hf_batch).loss}
    # Same loss on the same weights (no dropout for the check): they compute the same thing.
    ours.eval(), ref.eval()
    with torch.no_grad():
        a, b = losses["ours"]().item(), losses["ref"]().item()
    ours.train(), ref.train()
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, eps=1e-6)
                  for name, model in (("ours", ours), ("ref", ref))}
    cpu: dict[str, list[float]] = {"ours": [], "ref": []}
    wall: dict[str, list[float]] = {"ours": [], "ref": []}
    for i in range(WARMUP + STEPS):
        for name, loss in losses.items():
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            loss().backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if i >= WARMUP:
                cpu[name].append(time.process_time() - start_cpu)
                wall[name].append(time.perf_counter() - start_wall)
    tokens = int(batch["attention_mask"].sum())
    # CPU time of this process, fastest step: what the step costs, not how busy the machine was.
    t_ours, t_ref = min(cpu["ours"]), min(cpu["ref"])
    return {
        "timing": "process CPU time, fastest of the timed steps",
        "wall_s_ours": statistics.median(wall["ours"]), "wall_s_reference": statistics.median(wall["ref"]),
        "size": size, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "mlm_loss_chunk": mlm_loss_chunk,
        "batch": list(batch["input_ids"].shape), "non_padding_tokens": tokens,
        "masked_positions": int(batch["masked_lm_weights"].sum()), "reference_attention": attn,
        "loss_ours": a, "loss_reference": b,
        "step_s_ours": t_ours, "step_s_reference": t_ref,
        "tokens_per_s_ours": tokens / t_ours, "tokens_per_s_reference": tokens / t_ref,
        "sequences_per_s_ours": batch["input_ids"].shape[0] / t_ours,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--instances", help="An instances folder (with seq128/); default: built from Botchan.")
    p.add_argument("--sizes", default="tiny,base", help="Model sizes to time (config MODEL_SIZES names).")
    p.add_argument("--mlm-loss-chunk", type=int, default=0,
                   help="Ours: the masked-LM loss this many rows at a time (pretrain.mlm_loss_chunk; 0 = all at once).")
    args = p.parse_args(argv)

    import torch

    from bert_core.model.bert import pretraining_plan
    from bert_core.pretrain.data import PretrainingLoader

    torch.set_num_threads(1)  # CPU time = the step's cost; more threads spin-wait
    folder = samples()
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as tmp:
        instances = args.instances or build_instances(folder, Path(tmp))
        vocab_size = len((folder / "models" / "minilm" / "vocab.txt").read_text().splitlines())
        loader = PretrainingLoader(instances, MAX_SEQ_LENGTH, micro_batch_size=max(BATCH, BASE_BATCH), seed=1)
        big = next(iter(loader))  # one real, padded micro-batch (padded to its longest, rounded to 8)
        # the loader's sequences/s in-process, its first batch (a shard read) included
        it = iter(PretrainingLoader(instances, MAX_SEQ_LENGTH, micro_batch_size=BATCH, seed=1))
        _, seconds = timed(lambda: [next(it) for _ in range(20)], time.perf_counter)
        loader_sps = 20 * BATCH / seconds

    results, rows = [], []
    for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
        n = BATCH if size in ("tiny", "mini", "small") else BASE_BATCH
        batch = {k: big[k][:n].contiguous() for k in RAW_KEYS}
        # the unpadding indices the loader precomputes, for the rows kept
        batch |= pretraining_plan(batch["attention_mask"], batch["masked_lm_positions"],
                                  batch["masked_lm_ids"], batch["masked_lm_weights"])
        r = bench_size(size, batch, vocab_size, args.mlm_loss_chunk)
        results.append(r)
        ratio = r["tokens_per_s_ours"] / r["tokens_per_s_reference"]
        rows.append(row(f"train step {size} L{r['layers']}/H{r['hidden']} batch {n}x{r['batch'][1]}",
                        r["tokens_per_s_ours"], r["tokens_per_s_reference"],
                        "non-padding tokens per CPU-second (1 thread)", ratio, 1))
        print(f"{size:>5}: ours {r['tokens_per_s_ours']:8.1f} tok/s ({r['step_s_ours']:.3f} s/step)   "
              f"transformers {r['tokens_per_s_reference']:8.1f} tok/s ({r['step_s_reference']:.3f} s/step)   "
              f"ratio {ratio:.2f}x   loss {r['loss_ours']:.4f} vs {r['loss_reference']:.4f}", flush=True)
    consume = results[0]["sequences_per_s_ours"] if results else float("nan")
    rows.append(row(f"data loader vs {results[0]['size'] if results else '?'} train step", loader_sps, consume,
                    "sequences/s (loader / step consumes)", loader_sps / consume, 1))
    write_rows("train_step", rows, threads=1, details=results, torch=torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
