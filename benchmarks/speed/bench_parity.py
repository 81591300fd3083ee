"""Learning parity: our BertForPreTraining and transformers' learn alike on the same instances.

    python -m benchmarks.speed.bench_parity                      # builds sample instances first
    python -m benchmarks.speed.bench_parity --instances DIR --steps 300 --seeds 3

Both start from the same weights, read the same batches and train with the same plain torch loop
(AdamW with pre-training's weight-decay groups, DeepSpeed's linear warmup and decay, clipping);
the last shard of ``seq<L>`` is held out. With dropout 0 the train losses agree step by step up
to rounding; with dropout 0.1 over several seeds the final held-out MLM loss gap is compared
with its standard error (Welch t). Rows: ``bench-results/parity.json``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from benchmarks.common import ROOT, hf_labels, machine, welch, write_rows
from benchmarks.common import samples as samples_dir
from bert_core.config import ModelConfig, preset_dict
from bert_core.model.checkpoint import save_pretrained
from bert_core.model.weight_decay import param_groups
from bert_core.pretrain.data import collate, read_vocab, to_tensors, vocab_file_of
from bert_core.pretrain.in_process import random_init

RESULTS = ROOT / "bench-results"
BATCH, LR = 32, 1e-3
# The paper's pre-training, which transformers' BertForPreTraining implements: masks drawn once
# into the instances, next-sentence pairs, post-LN (the demo preset's own recipe differs on all three).
PAPER_INSTANCES = ["--set", "instances.masking=static", "--set", "instances.next_sentence_prediction=true"]


def build_instances(samples: Path, work: Path) -> Path:
    """Corpus -> vocab -> instances on the sample data with the demo preset, set to the paper's
    masking and pairs (the CLI, as a user)."""
    cli = [sys.executable, "-m", "flows.cli"]
    out = work / "instances-paper"
    if (out / "_MANIFEST.json").exists():
        return out
    steps = [
        ["corpus", "--wikipedia", str(samples / "wikipedia" / "*.xml.bz2"), "--books",
         str(samples / "books" / "*.txt"), "--books", str(samples / "plays" / "*.md"),
         "--output", str(work / "corpus")],
        ["vocab", "--corpus", str(work / "corpus"), "--output", str(work / "vocab")],
        ["instances", "--corpus", str(work / "corpus"), "--vocab", str(work / "vocab"),
         "--output", str(out), *PAPER_INSTANCES],
    ]
    for args in steps:
        print("  $ bertpipe", " ".join(args), flush=True)
        subprocess.run(cli + args, check=True, capture_output=True)
    return out


def shortest_length(instances: Path) -> int:
    """The shortest sequence length an instances folder holds (its ``seq<L>/`` folders)."""
    lengths = [int(p.name[3:]) for p in instances.glob("seq*") if p.name[3:].isdigit()]
    if not lengths:
        raise SystemExit(f"{instances}: no seq<L>/ folders; is it an instances stage folder?")
    return min(lengths)


def forward(kind: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loss and summed metrics of one batch: mlm_loss_sum, mlm_correct, masked, nsp_* likewise."""
    if kind == "ours":
        out = model(**batch)
        m = int(batch["masked_lm_weights"].sum())
        B = batch["input_ids"].shape[0]
        return {"loss": out["loss"], "mlm_loss_sum": out["mlm_loss"] * m, "mlm_correct": out["mlm_acc"] * m,
                "masked": m, "nsp_loss_sum": out["nsp_loss"] * B, "nsp_correct": out["nsp_acc"] * B, "rows": B}
    labels = hf_labels(batch)
    out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                attention_mask=batch["attention_mask"], labels=labels,
                next_sentence_label=batch["next_sentence_label"])
    picked = labels != -100
    logits = out.prediction_logits[picked].float()
    target = labels[picked]
    nsp = out.seq_relationship_logits.float()
    nsp_label = batch["next_sentence_label"]
    return {"loss": out.loss,
            "mlm_loss_sum": F.cross_entropy(logits, target, reduction="sum").detach(),
            "mlm_correct": (logits.argmax(-1) == target).sum().float(), "masked": int(target.numel()),
            "nsp_loss_sum": F.cross_entropy(nsp, nsp_label, reduction="sum").detach(),
            "nsp_correct": (nsp.argmax(-1) == nsp_label).sum().float(), "rows": int(nsp_label.numel())}


def evaluate(kind: str, model: torch.nn.Module, rows: pa.Table, seq: int, batch_size: int = 64) -> dict[str, float]:
    model.eval()
    sums = {"mlm_loss_sum": 0.0, "mlm_correct": 0.0, "masked": 0, "nsp_loss_sum": 0.0, "nsp_correct": 0.0, "rows": 0}
    with torch.no_grad():
        for start in range(0, rows.num_rows, batch_size):
            batch = to_tensors(collate(rows.slice(start, batch_size), seq))
            out = forward(kind, model, batch)
            for k in sums:
                sums[k] += float(out[k])
    model.train()
    return {"mlm_loss": sums["mlm_loss_sum"] / sums["masked"], "mlm_acc": sums["mlm_correct"] / sums["masked"],
            "nsp_loss": sums["nsp_loss_sum"] / sums["rows"], "nsp_acc": sums["nsp_correct"] / sums["rows"]}


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """DeepSpeed's WarmupDecayLR (linear): up to ``peak`` over ``warmup`` steps, then down to 0."""
    if step < warmup:
        return peak * step / max(1, warmup)
    return peak * max(0.0, (total - step) / max(1, total - warmup))


def train(kind: str, model: torch.nn.Module, train_rows: pa.Table, held_out: pa.Table, args: argparse.Namespace,
          seed: int) -> dict:
    """``args.steps`` steps of ``model``, ours or transformers': one plain loop that drives both
    alike, on the same batches."""
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=LR, betas=(0.9, 0.999), eps=1e-6)
    order = np.random.default_rng(seed).permutation(train_rows.num_rows)
    curve, losses = [], []
    started = time.process_time()
    for step in range(args.steps):
        if step % args.eval_every == 0:
            curve.append({"step": step, **evaluate(kind, model, held_out, args.seq)})
        picks = np.take(order, np.arange(step * BATCH, (step + 1) * BATCH), mode="wrap")  # the epoch wraps round
        batch = to_tensors(collate(train_rows.take(pa.array(picks)), args.seq))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, LR, args.warmup, args.steps)
        torch.manual_seed(seed * 1_000_003 + step)  # the same dropout stream position for both
        loss = forward(kind, model, batch)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    curve.append({"step": args.steps, **evaluate(kind, model, held_out, args.seq)})
    return {"curve": curve, "train_loss": losses, "cpu_s": time.process_time() - started}


def twin_models(vocab_size: int, dropout: float, seed: int, work: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours with seeded init, and transformers' BertForPreTraining opened from a copy of it."""
    from transformers import BertForPreTraining as HFBertForPreTraining

    size = preset_dict("demo")["model"]
    cfg = ModelConfig(**{**size, "vocab_size": vocab_size, "hidden_dropout_prob": dropout,
                         "attention_probs_dropout_prob": dropout, "pre_layer_norm": False})
    ours = random_init(cfg, seed)
    folder = work / f"init-{seed}-{dropout}"
    save_pretrained(ours, str(folder))
    theirs = HFBertForPreTraining.from_pretrained(str(folder), attn_implementation="eager")
    return ours.train(), theirs.train()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", help="an instances stage folder (default: built from the samples)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-rows", type=int, default=1024, help="held-out rows evaluated")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    RESULTS.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bertpipe-parity-"))
    instances = Path(args.instances) if args.instances else build_instances(samples_dir(), RESULTS / "parity-data")
    args.seq = shortest_length(instances)
    shards = sorted((instances / f"seq{args.seq}").glob("part-*.parquet"))  # the last one held out
    train_rows = pa.concat_tables([pq.read_table(s) for s in shards[:-1]])
    held_out = pq.read_table(shards[-1]).slice(0, args.eval_rows)
    vocab_size = len(read_vocab(vocab_file_of(str(instances))))
    print(f"machine: {machine()['cpu']}, {torch.get_num_threads()} torch thread(s)")
    print(f"instances: {train_rows.num_rows} train rows, {held_out.num_rows} held out, vocab {vocab_size}; "
          f"{args.steps} steps of {BATCH} x {args.seq}, lr {LR}, warmup {args.warmup}", flush=True)

    # 1. Dropout 0: the same computation up to rounding.
    ours, theirs = twin_models(vocab_size, 0.0, 1, work)
    exact = {kind: train(kind, model, train_rows, held_out, args, seed=1)
             for kind, model in (("ours", ours), ("transformers", theirs))}
    gaps = [abs(a - b) for a, b in zip(exact["ours"]["train_loss"], exact["transformers"]["train_loss"], strict=True)]
    print(f"dropout 0: largest train-loss gap over {args.steps} steps {max(gaps):.2e} "
          f"(final loss ours {exact['ours']['train_loss'][-1]:.4f}, transformers "
          f"{exact['transformers']['train_loss'][-1]:.4f})", flush=True)

    # 2. Dropout 0.1, several seeds: eval curves within seed noise.
    runs: dict[str, list[dict]] = {"ours": [], "transformers": []}
    for seed in range(1, args.seeds + 1):
        ours, theirs = twin_models(vocab_size, 0.1, seed, work)
        for kind, model in (("ours", ours), ("transformers", theirs)):
            runs[kind].append(train(kind, model, train_rows, held_out, args, seed=seed))
            final = runs[kind][-1]["curve"][-1]
            print(f"  seed {seed} {kind:>12}: eval mlm loss {final['mlm_loss']:.4f} acc {final['mlm_acc']:.4f}, "
                  f"nsp acc {final['nsp_acc']:.3f} ({runs[kind][-1]['cpu_s']:.0f} CPU-s)", flush=True)

    print(f"\n{'step':>6} | {'ours eval MLM loss':>20} | {'transformers':>20} | {'ours MLM acc':>14} | {'transformers':>14}")
    rows = [{"step": point["step"], **{f"{kind}_{metric}": [r["curve"][i][metric] for r in runs[kind]]
                                       for kind in runs for metric in ("mlm_loss", "mlm_acc", "nsp_loss", "nsp_acc")}}
            for i, point in enumerate(runs["ours"][0]["curve"])]

    def cell(values: list[float], digits: int = 4) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"

    for row in rows:
        print(f"{row['step']:>6} | {cell(row['ours_mlm_loss']):>20} | {cell(row['transformers_mlm_loss']):>20} | "
              f"{cell(row['ours_mlm_acc'], 3):>14} | {cell(row['transformers_mlm_acc'], 3):>14}")
    last = rows[-1]
    w = welch(last["ours_mlm_loss"], last["transformers_mlm_loss"])
    gap, t, p = w["gain"], w["t"], w["p"]
    agree = math.isnan(p) or p > 0.01
    print(f"\nfinal eval MLM loss gap (ours - transformers) {gap:+.4f}, Welch t {t:.2f}, p {p:.3f}: "
          f"{'agree within seed noise' if agree else 'DISAGREE'}")
    loss = {kind: statistics.fmean(last[f"{kind}_mlm_loss"]) for kind in runs}
    acc = {kind: statistics.fmean(last[f"{kind}_mlm_acc"]) for kind in runs}
    table = [
        {"measure": f"dropout 0: largest train-loss gap over {args.steps} steps", "ours": max(gaps),
         "reference": None, "ratio": None, "unit": "loss difference, ours - transformers, largest absolute"},
        {"measure": f"dropout 0.1, {args.seeds} seeds: held-out MLM loss at step {args.steps} (Welch p {p:.2f})",
         "ours": loss["ours"], "reference": loss["transformers"], "ratio": loss["transformers"] / loss["ours"],
         "unit": "nats (transformers / ours)"},
        {"measure": f"dropout 0.1, {args.seeds} seeds: held-out MLM accuracy at step {args.steps}",
         "ours": acc["ours"], "reference": acc["transformers"], "ratio": None, "unit": "fraction"},
    ]
    write_rows("parity", table, machine=machine(), instances=str(instances), steps=args.steps, batch=BATCH,
               seq=args.seq, lr=LR, warmup=args.warmup, seeds=args.seeds, dropout0_max_train_loss_gap=max(gaps),
               curve=rows, final_gap=gap, welch_t=t, welch_p=p, agree=agree)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
