"""Quality: does our pre-training help? Sentiment accuracy of a small BERT pre-trained by the
pipeline (arm A) against the same architecture and vocab from random init (arm B), with the
sample MiniLM (arm C) as the strong reference.

    python -m benchmarks.bench_quality                                 # budgets 0,7,15,30 minutes
    python -m benchmarks.bench_quality --budgets 0,1 --seeds 2 --lrs 3e-4,1e-3 --epochs 2 \
        --select-seeds 1 --train-examples 1500 --dev-examples 500 --instances DIR   # a quick look

- **Data**: every sample sentiment sentence (``samples/tasks/sentiment``, read by the product's
  ``read_sentiment``, neutral ratings rejected as there), split once by ``--split-seed`` into
  train / dev / test. The test split is scored only with the chosen setting's final seeds.
- **Pre-training** (arm A, one run per budget): the product path, ``bertpipe pretrain`` (DeepSpeed,
  2 CPU ranks), one phase at 128 tokens with ``--set`` overrides; ``max_steps`` is the budget in
  minutes times the steps per minute measured by a short calibration run of the same command.
  Instances come from the real stages (``bertpipe corpus/vocab/instances`` on the samples, as
  ``bench_parity`` builds them); the last ``seq128`` shard is held out of pre-training and gives
  the eval masked-LM accuracy. Budget 0 is arm B: the same model config, seeded random init.
- **Fine-tuning**: the product's loop (``bert_core.finetune.train.train_and_predict``), the
  paper's protocol per arm: a learning-rate x epochs grid, each setting scored on dev as the mean
  over ``--select-seeds`` seeds, then ``--seeds`` fresh seeds at the best setting scored on test
  (mean ± sd). The gain of each budget over arm B has a 95% Welch confidence interval
  (Welch–Satterthwaite degrees of freedom).

Writes ``bench-results/quality.json`` and prints a table with the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from itertools import product
from pathlib import Path

import numpy as np

from benchmarks.bench_parity import build_instances, evaluate
from benchmarks.common import machine, samples

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench-results"
SEQ = 128


# --------------------------------------------------------------------------- pure helpers


def split_indices(n: int, dev_size: int, test_size: int, seed: int) -> tuple[list[int], list[int], list[int]]:
    """A fixed random split of ``range(n)`` into (train, dev, test), each sorted."""
    if dev_size + test_size >= n:
        raise ValueError(f"dev {dev_size} + test {test_size} leaves no training examples of {n}")
    order = np.random.default_rng(seed).permutation(n).tolist()
    test, dev, train = order[:test_size], order[test_size:test_size + dev_size], order[test_size + dev_size:]
    return sorted(train), sorted(dev), sorted(test)


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def welch_interval(a: list[float], b: list[float], level: float = 0.95) -> dict[str, float]:
    """mean(a) - mean(b) with its Welch t interval; df by Welch–Satterthwaite."""
    from scipy import stats

    gain = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return {"gain": gain, "ci_low": math.nan, "ci_high": math.nan, "df": math.nan}
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return {"gain": gain, "ci_low": gain, "ci_high": gain, "df": math.inf}
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * se
    return {"gain": gain, "ci_low": gain - half, "ci_high": gain + half, "df": df}


def best_setting(dev_means: dict[tuple[float, float], float]) -> tuple[float, float]:
    """The (learning rate, epochs) with the highest mean dev score; ties go to the first listed."""
    return max(dev_means, key=lambda s: (dev_means[s], -list(dev_means).index(s)))


def steps_for(minutes: float, sequences_per_second: float, global_batch: int) -> int:
    """Optimizer steps that fit ``minutes`` at the measured throughput (at least 1)."""
    return max(1, int(minutes * 60 * sequences_per_second / global_batch))


# --------------------------------------------------------------------------- data


def sentiment_split(folder: Path, dev_size: int, test_size: int, seed: int) -> dict[str, list]:
    """All non-neutral sample sentences (both of the reader's parts), split by ``seed``."""
    from bert_core.finetune.glue import read_sentiment

    examples = read_sentiment(str(folder), "train")[0] + read_sentiment(str(folder), "dev")[0]
    examples.sort(key=lambda e: e.guid)
    parts = split_indices(len(examples), dev_size, test_size, seed)
    return {name: [examples[i] for i in idx] for name, idx in zip(("train", "dev", "test"), parts, strict=True)}


def encode(tokenizer, examples: list, max_seq_length: int) -> list[dict]:
    from bert_core.finetune.glue import SENTIMENT_LABELS, encode_pairs

    enc = encode_pairs(tokenizer, examples, max_seq_length)
    return [{"input_ids": i, "token_type_ids": t, "label": SENTIMENT_LABELS.index(e.label)}
            for i, t, e in zip(enc["input_ids"], enc["token_type_ids"], examples, strict=True)]


def held_out_view(instances: Path, work: Path) -> tuple[Path, Path]:
    """An instances folder of all ``seq128`` shards but the last (for pre-training), and the last."""
    view = work / "instances-train"
    folder = instances / f"seq{SEQ}"
    manifest = json.loads((folder / "_MANIFEST.json").read_text())
    *kept, last = manifest["shards"]
    if not kept:
        raise SystemExit(f"{folder}: one shard only; build instances with num_shards >= 3 to hold one out")
    shutil.rmtree(view, ignore_errors=True)
    (view / f"seq{SEQ}").mkdir(parents=True)
    for entry in kept:
        (view / f"seq{SEQ}" / entry["path"]).symlink_to((folder / entry["path"]).resolve())
    manifest["shards"] = kept
    manifest.setdefault("counts", {})["instances"] = sum(int(e.get("count") or 0) for e in kept)
    (view / f"seq{SEQ}" / "_MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    shutil.copy(instances / "_MANIFEST.json", view / "_MANIFEST.json")
    return view, folder / last["path"]


# --------------------------------------------------------------------------- pre-training


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pretrain_sets(args: argparse.Namespace, steps: int) -> list[str]:
    phase = {"max_seq_length": SEQ, "max_steps": steps, "global_batch_size": args.global_batch,
             "micro_batch_size": args.global_batch // 2, "learning_rate": args.pretrain_lr,
             "warmup_steps": max(1, steps // 10)}
    return [f"pretrain.phases=[{json.dumps(phase)}]", f"model.size={args.model_size}",
            f"pretrain.master_port={free_port()}", f"pretrain.checkpoint_every={max(steps, 1)}",
            f"pretrain.log_every={max(1, min(50, steps // 10))}"]


def pretrain(view: Path, run: Path, sets: list[str]) -> dict:
    """``bertpipe pretrain`` as a user types it; progress from its metrics.jsonl. Returns its rows."""
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "flows.cli", "pretrain", "--instances", str(view), "--output", str(run)]
    for s in sets:
        cmd += ["--set", s]
    print("  $ bertpipe " + " ".join(cmd[3:]), flush=True)
    started = time.perf_counter()
    with open(run.parent / f"{run.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None:
            time.sleep(15)
            rows = _metrics(run)
            if rows:
                r = rows[-1]
                print(f"    step {r['step']}/{r['max_steps']} loss {r['loss']:.3f} mlm acc {r['mlm_acc']:.3f} "
                      f"({r['seq_per_s']:.0f} seq/s)", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"bertpipe pretrain failed (exit {proc.returncode}); see {run.parent / run.name}.log")
    rows = _metrics(run)
    return {"rows": rows, "wall_seconds": time.perf_counter() - started,
            "train_seconds": rows[-1]["time"] - rows[0]["time"] if len(rows) > 1 else 0.0}


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def random_init(view: Path, folder: Path, args: argparse.Namespace) -> Path:
    """Arm B: the model config pre-training would build, seeded random weights, the same vocab."""
    import torch

    from bert_core.config import load_config
    from bert_core.model.bert import BertForPreTraining
    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.data import read_vocab, vocab_file_of
    from bert_core.pretrain.loop import model_config

    cfg = load_config("demo", None, pretrain_sets(args, 1))
    vocab_file = vocab_file_of(str(view))
    torch.manual_seed(cfg.pretrain.seed)
    model = BertForPreTraining(model_config(cfg, len(read_vocab(vocab_file))))
    save_pretrained(model, str(folder), vocab_file=vocab_file, lowercase=cfg.vocab.lowercase)
    return folder


def mlm_accuracy(checkpoint: Path, held_out: Path, rows: int) -> dict[str, float]:
    import pyarrow.parquet as pq

    from bert_core.model.bert import BertForPreTraining

    model = BertForPreTraining.from_pretrained(str(checkpoint))
    return evaluate("ours", model, pq.read_table(held_out).slice(0, rows), SEQ)


# --------------------------------------------------------------------------- fine-tuning


def finetune(checkpoint: Path, data: dict[str, list], split: str, lr: float, epochs: float, seed: int,
             args: argparse.Namespace, pad_id: int) -> float:
    """Accuracy on ``split`` after fine-tuning on train with the product's loop."""
    from bert_core.config import FinetuneConfig
    from bert_core.finetune.data import TaskData
    from bert_core.finetune.glue import glue_metrics
    from bert_core.finetune.train import train_and_predict

    cfg = FinetuneConfig(learning_rate=lr, num_train_epochs=epochs, batch_size=args.batch_size,
                         max_seq_length=args.max_seq_length, threads=args.threads)
    task = TaskData(kind="classification", num_labels=2, train=data["train"], evals={split: data[split]},
                    finish=lambda s, o: ({}, {}))
    out = train_and_predict(task, str(checkpoint), cfg, seed, pad_id)
    pred = np.stack(out["outputs"][split]).argmax(-1)
    return glue_metrics("sentiment", [f["label"] for f in data[split]], pred)["accuracy"]


def run_arm(name: str, checkpoint: Path, split: dict[str, list], lrs: list[float], args: argparse.Namespace) -> dict:
    """Grid on dev (mean over the selection seeds), then the final seeds at the best setting on test."""
    from bert_core.vocab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(checkpoint))
    data = {k: encode(tokenizer, v, args.max_seq_length) for k, v in split.items()}
    grid: dict[tuple[float, float], list[float]] = {}
    started = time.perf_counter()
    for lr, epochs in product(lrs, args.epochs):
        grid[(lr, epochs)] = [finetune(checkpoint, data, "dev", lr, epochs, seed, args, tokenizer.pad_id)
                              for seed in range(1, args.select_seeds + 1)]
        print(f"  {name}: lr {lr:g} x {epochs:g} epochs -> dev {statistics.fmean(grid[(lr, epochs)]):.4f}",
              flush=True)
    lr, epochs = best_setting({s: statistics.fmean(v) for s, v in grid.items()})
    scores = [finetune(checkpoint, data, "test", lr, epochs, 1000 + seed, args, tokenizer.pad_id)
              for seed in range(1, args.seeds + 1)]
    mean, sd = mean_sd(scores)
    minutes = (time.perf_counter() - started) / 60
    print(f"  {name}: chose lr {lr:g} x {epochs:g} epochs; test {mean:.4f} ± {sd:.4f} over {len(scores)} seeds "
          f"({minutes:.1f} min of fine-tuning)", flush=True)
    return {"arm": name, "checkpoint": str(checkpoint),
            "grid": [{"learning_rate": s[0], "epochs": s[1], "dev_scores": v, "dev_mean": statistics.fmean(v)}
                     for s, v in grid.items()],
            "selected": {"learning_rate": lr, "epochs": epochs}, "test_scores": scores, "mean": mean, "sd": sd,
            "finetune_minutes": minutes}


# --------------------------------------------------------------------------- main


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", default=None, help="sample folder (default: benchmarks.common.samples())")
    parser.add_argument("--instances", help="an instances stage folder (default: built from the samples)")
    parser.add_argument("--budgets", type=floats, default=[0, 7, 15, 30],
                        help="minutes of pre-training per arm; 0 = random init (arm B)")
    parser.add_argument("--pretrain-minutes", type=float,
                        help="one pre-trained arm of this budget (same as --budgets 0,M)")
    parser.add_argument("--steps-per-minute", type=float, help="skip the calibration run")
    parser.add_argument("--calibration-steps", type=int, default=40)
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "mini", "small"])
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument("--eval-rows", type=int, default=2048, help="held-out instances scored for MLM accuracy")
    parser.add_argument("--lrs", type=floats, default=[1e-4, 3e-4, 1e-3], help="grid for arms A and B")
    parser.add_argument("--reference-lrs", type=floats, default=[3e-5, 5e-5, 1e-4], help="grid for MiniLM")
    parser.add_argument("--epochs", type=floats, default=[2, 3])
    parser.add_argument("--select-seeds", type=int, default=2, help="seeds per grid point, scored on dev")
    parser.add_argument("--seeds", type=int, default=5, help="seeds at the chosen setting, scored on test")
    parser.add_argument("--no-reference", action="store_true", help="skip arm C (MiniLM)")
    parser.add_argument("--dev-size", type=int, default=1000)
    parser.add_argument("--test-size", type=int, default=1500)
    parser.add_argument("--split-seed", type=int, default=20240601)
    parser.add_argument("--train-examples", type=int, help="subsample train (for a quick look)")
    parser.add_argument("--dev-examples", type=int, help="subsample dev (for a quick look)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = parser.parse_args(argv)
    if args.pretrain_minutes is not None:
        args.budgets = [0.0, args.pretrain_minutes]
    budgets = sorted(set(args.budgets) | {0.0})
    if args.test_size < 1000:
        parser.error("--test-size must be at least 1000")
    import torch

    torch.set_num_threads(args.threads)
    sample_dir = Path(args.samples) if args.samples else samples()
    work = RESULTS / "quality-data"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}", flush=True)

    split = sentiment_split(sample_dir / "tasks" / "sentiment", args.dev_size, args.test_size, args.split_seed)
    split["train"] = split["train"][: args.train_examples or None]
    split["dev"] = split["dev"][: args.dev_examples or None]
    positive = sum(e.label == "positive" for e in split["test"]) / len(split["test"])
    print(f"sentiment: {len(split['train'])} train / {len(split['dev'])} dev / {len(split['test'])} test "
          f"(test majority class {max(positive, 1 - positive):.3f})", flush=True)

    instances = Path(args.instances) if args.instances else build_instances(sample_dir, work)
    view, held_out = held_out_view(instances, work)
    print(f"instances: {instances} (pre-training reads all seq{SEQ} shards but {held_out.name})", flush=True)

    spm = args.steps_per_minute
    if spm is None and any(b > 0 for b in budgets):
        print(f"calibration: {args.calibration_steps} steps", flush=True)
        cal = pretrain(view, work / "calibration", pretrain_sets(args, args.calibration_steps))
        late = [r["seq_per_s"] for r in cal["rows"] if r["step"] > args.calibration_steps // 4] or \
            [r["seq_per_s"] for r in cal["rows"]]
        spm = steps_for(1, statistics.median(late), args.global_batch)
        print(f"calibration: {statistics.median(late):.0f} seq/s -> {spm:g} steps a minute "
              f"({cal['wall_seconds']:.0f} s with start-up)", flush=True)

    arms = []
    for budget in budgets:
        print(f"\n== budget {budget:g} min", flush=True)
        entry: dict = {"budget_minutes": budget}
        if budget == 0:
            checkpoint = random_init(view, work / "random-init", args)
        else:
            steps = max(1, int(budget * spm))
            done = pretrain(view, work / f"pretrain-{budget:g}min", pretrain_sets(args, steps))
            checkpoint = work / f"pretrain-{budget:g}min" / "hf"
            entry["pretrain"] = {"steps": steps, "train_minutes": done["train_seconds"] / 60,
                                 "wall_minutes": done["wall_seconds"] / 60,
                                 "last_loss": done["rows"][-1]["loss"] if done["rows"] else None,
                                 "path": "bertpipe pretrain (DeepSpeed, 2 CPU ranks)"}
        entry["eval_mlm"] = mlm_accuracy(checkpoint, held_out, args.eval_rows)
        print(f"  eval MLM accuracy {entry['eval_mlm']['mlm_acc']:.4f} (loss {entry['eval_mlm']['mlm_loss']:.3f})",
              flush=True)
        name = "B (random init)" if budget == 0 else f"A ({budget:g} min)"
        arms.append(entry | run_arm(name, checkpoint, split, args.lrs, args))
    if not args.no_reference:
        print("\n== reference: sample MiniLM", flush=True)
        arms.append({"budget_minutes": None} |
                    run_arm("C (MiniLM)", sample_dir / "models" / "minilm", split, args.reference_lrs, args))

    base = arms[0]
    curve = [{"budget_minutes": a["budget_minutes"], "eval_mlm_acc": a["eval_mlm"]["mlm_acc"],
              **welch_interval(a["test_scores"], base["test_scores"])} for a in arms if a["budget_minutes"]]
    top = curve[-1] if curve else {"gain": math.nan, "ci_low": math.nan, "ci_high": math.nan, "df": math.nan}

    print(f"\nmachine: {info['cpu']} ({info['cores']} cores, torch {info['torch']}, python {info['python']})")
    print(f"{'arm':>16} | {'budget':>6} | {'eval MLM acc':>12} | {'setting':>14} | {'test accuracy':>16} | "
          f"{'gain over B [95% CI]':>26}")
    for a in arms:
        gain = next((c for c in curve if c["budget_minutes"] == a["budget_minutes"]), None)
        mlm = f"{a['eval_mlm']['mlm_acc']:.4f}" if "eval_mlm" in a else "-"
        setting = f"{a['selected']['learning_rate']:g} x {a['selected']['epochs']:g}"
        cell = f"{gain['gain']:+.4f} [{gain['ci_low']:+.4f}, {gain['ci_high']:+.4f}]" if gain else "-"
        budget = "-" if a["budget_minutes"] is None else f"{a['budget_minutes']:g}"
        print(f"{a['arm']:>16} | {budget:>6} | {mlm:>12} | {setting:>14} | "
              f"{a['mean']:.4f} ± {a['sd']:.4f} | {cell:>26}")
    minutes = (time.perf_counter() - started) / 60
    print(f"total {minutes:.1f} min")

    rows = [{"measure": f"sentiment test accuracy gain of {c['budget_minutes']:g} min pre-training over random init",
             "ours": round(c["gain"], 4), "reference": 0.0, "ratio": None, "unit": "accuracy"} for c in curve]
    result = {"machine": info, "settings": {k: v for k, v in vars(args).items()},
              "split": {k: len(v) for k, v in split.items()}, "test_majority": max(positive, 1 - positive),
              "steps_per_minute": spm, "arms": arms, "curve": curve, "gain": top["gain"],
              "ci_low": top["ci_low"], "ci_high": top["ci_high"], "df": top["df"], "rows": rows,
              "minutes": minutes}
    (RESULTS / "quality.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {RESULTS / 'quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
