"""Quality: does our pre-training pay, and most when labels are few? A pre-registered
learning-curve protocol (the full text, with the results, is ``docs/quality.md``).

    nice -n 19 python -m benchmarks.bench_quality --work /work/quality-runs --reuse   # the protocol
    python -m benchmarks.bench_quality --quick --work /tmp/q                           # bookkeeping on tiny data

- **Tasks** (``benchmarks/quality_tasks.py``, files pinned by sha256): ``sentiment`` (binary) and
  ``tweets3`` (negative / neutral / positive crowd-labelled tweets; their held-out set is removed
  from the pre-training text). A run stops if any dev or test text is in the corpus.
- **Arms**: A, the chosen recipe pre-trained by the product path (``bertpipe corpus``, ``vocab``,
  ``instances``, ``pretrain``) for each budget of CPU-minutes (60 and 240), 3 runs (seeds 42-44);
  B, the same model from random init (seeds 42-44); TF-IDF + logistic regression; C, the sample
  MiniLM at one fixed setting.
- **Learning curve**: 100, 300, 1,000 and all training examples; 5 stratified subsamples per
  size, subsample k fine-tuned with seed 1 + k in every arm (paired).
- **Fine-tuning**: the product's loop; each arm's setting chosen once per task on the full pool's
  dev score (macro-F1) from learning rate {3e-4, 1e-3} x pooling {cls, mean} x layer-wise decay
  {1.0, 0.8}, then fixed for every size and run; 6 epochs, at least 100 steps.
- **Primary endpoint**: at 300 and at 1,000 labels, the mean over tasks of A - B (macro-F1), with
  a 95% Welch interval over pre-training runs. Secondary: the full-label gain per task, a linear
  probe per layer, held-out MLM accuracy on each task's text, and the regression check (A - B at
  300 labels per task; negative = ``REGRESSION``).
- **Bookkeeping**: every pre-training run and fine-tuning job is cached under ``--work`` by a
  hash of its settings, so ``--reuse`` resumes a killed session without redoing finished work.

Writes ``bench-results/quality.json`` (every run, subsample and seed) and ``docs/quality.png``.


from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from itertools import product
from pathlib import Path

import numpy as np

from benchmarks.common import machine, samples

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench-results"


# --------------------------------------------------------------------------- recipes


PRETRAIN_SEED = 42  # the product's default; run k of an arm pre-trains (or initialises) with seed 42 + k


@dataclass(frozen=True)
class Recipe:
    """How a small BERT is pre-trained: product settings of the instances stage and of pre-training."""

    about: str
    seq: int = 128
    next_sentence_prediction: bool = True
    masking: str = "static"
    whole_word_mask: bool = False
    model: dict = field(default_factory=lambda: {"size": "tiny"})
    global_batch: int = 32
    learning_rate: float = 1e-3
    warmup_fraction: float = 0.1

    def instance_sets(self) -> list[str]:
        length = {"max_seq_length": self.seq, "max_predictions_per_seq": math.ceil(self.seq * 0.15)}
        return [f"instances.lengths=[{json.dumps(length)}]",
                f"instances.next_sentence_prediction={str(self.next_sentence_prediction).lower()}",
                f"instances.masking={self.masking}",
                f"instances.whole_word_mask={str(self.whole_word_mask).lower()}",
                f"pretrain.phases=[{json.dumps({'max_seq_length': self.seq})}]"]

    def pretrain_sets(self, steps: int, ranks: int, seed: int = PRETRAIN_SEED) -> list[str]:
        phase = {"max_seq_length": self.seq, "max_steps": steps, "global_batch_size": self.global_batch,
                 "micro_batch_size": self.global_batch // ranks, "learning_rate": self.learning_rate,
                 "warmup_steps": max(1, round(steps * self.warmup_fraction))}
        return [self.instance_sets()[0], f"pretrain.phases=[{json.dumps(phase)}]", f"pretrain.procs_per_node={ranks}",
                f"pretrain.checkpoint_every={steps}", f"pretrain.log_every={max(1, min(50, steps // 10))}",
                "pretrain.eval_every=0", f"pretrain.seed={seed}", *(f"model.{k}={v}" for k, v in self.model.items())]


TINY_WIDE = {"size": "custom", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 1024}

RECIPES: dict[str, Recipe] = {
    "paper": Recipe("the paper's objective at the demo's old settings: MLM + NSP pairs, static masks, seq 128"),
    "mlm-only": Recipe("RoBERTa: no next-sentence pairs, whole sentences packed to 128", next_sentence_prediction=False),
    "mlm-only-seq64": Recipe("packed sentences at 64 tokens, twice the sequences a step",
                             seq=64, next_sentence_prediction=False, global_batch=64),
    "mlm-only-seq64-lr3e-3": Recipe("as mlm-only-seq64 with a 3x higher peak rate and pre-LN",
                                    seq=64, next_sentence_prediction=False, global_batch=64, learning_rate=3e-3,
                                    model={"size": "tiny", "pre_layer_norm": True}),
    "mlm-only-seq64-lr3e-3-dynamic": Recipe("as mlm-only-seq64-lr3e-3 with masks drawn anew each epoch",
                                            seq=64, next_sentence_prediction=False, global_batch=64,
                                            learning_rate=3e-3, masking="dynamic",
                                            model={"size": "tiny", "pre_layer_norm": True}),
    "mlm-only-seq64-dynamic": Recipe("as mlm-only-seq64 with masks drawn anew each epoch",
                                     seq=64, next_sentence_prediction=False, global_batch=64, masking="dynamic"),
    "mlm-only-seq64-wwm": Recipe("as mlm-only-seq64 with whole-word masking",
                                 seq=64, next_sentence_prediction=False, global_batch=64, whole_word_mask=True),
    "mlm-only-seq64-wide": Recipe("as mlm-only-seq64 with hidden 256 (2 layers, 4 heads)",
                                  seq=64, next_sentence_prediction=False, global_batch=64, model=TINY_WIDE),
}
CHOSEN = "mlm-only-seq64-lr3e-3-dynamic"


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


def cpu_per_step(rows: list[dict]) -> float:
    """CPU seconds (all ranks) one training step costs, from the train rows past the first quarter."""
    rows = [r for r in rows if r.get("kind", "train") == "train" and "cpu_seconds" in r]
    late = [r for r in rows if r["step"] > rows[-1]["step"] // 4] or rows
    first, last = (late[0], late[-1]) if len(late) > 1 else (rows[0], rows[-1])
    if last["step"] == first["step"]:
        raise ValueError("the calibration run logged one step only; give it more steps")
    return (last["cpu_seconds"] - first["cpu_seconds"]) / (last["step"] - first["step"])


def steps_in_budget(cpu_minutes: float, seconds_per_step: float) -> int:
    """Optimizer steps whose CPU cost fits ``cpu_minutes`` (at least 1)."""
    return max(1, int(cpu_minutes * 60 / seconds_per_step))


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


def bertpipe(args: list[str], log: Path) -> float:
    """Run a ``bertpipe`` command as a user types it; its CPU seconds (the whole process tree)."""
    print("  $ bertpipe " + " ".join(args), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-m", "flows.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                              cwd=ROOT).returncode
    if code != 0:
        raise SystemExit(f"bertpipe {args[0]} failed (exit {code}); see {log}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def corpus_inputs(sample_dir: Path | None = None, tweets: Path | None = None) -> list[tuple[str, str]]:
    """The demo preset's corpus as ``bertpipe corpus`` options: (flag, glob) pairs, the globs as the
    preset names them, or under ``sample_dir`` when given; ``tweets`` replaces the preset's text
    (the sample tweets) with that file."""
    from bert_core.config import load_config
    from flows.demo import demo_config

    cfg = (demo_config(str(sample_dir), []) if sample_dir else load_config("demo")).corpus
    text = [str(tweets)] if tweets else cfg.text
    return [(flag, p) for flag, globs in (("--wikipedia", cfg.wikipedia), ("--books", cfg.books),
                                          ("--text", text)) for p in globs]


def corpus_and_vocab(inputs: list[tuple[str, str]], work: Path) -> tuple[Path, Path]:
    """The corpus and vocab stages with the demo preset on ``inputs``, built once per set of inputs
    (a change of inputs removes the corpus and everything built from it)."""
    corpus, vocab = work / "corpus", work / "vocab"
    stamp = work / "corpus-inputs.json"
    if not stamp.exists() or json.loads(stamp.read_text()) != [list(i) for i in inputs]:
        for built in [corpus, vocab, *work.glob("instances-*")]:
            shutil.rmtree(built, ignore_errors=True)
    if not (corpus / "_MANIFEST.json").exists():
        bertpipe(["corpus", *(a for i in inputs for a in i), "--output", str(corpus)], work / "corpus.log")
        stamp.write_text(json.dumps(inputs))
    if not (vocab / "_MANIFEST.json").exists():
        bertpipe(["vocab", "--corpus", str(corpus), "--output", str(vocab)], work / "vocab.log")
    return corpus, vocab


def normalized(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def held_out_in_corpus(split: dict[str, list], corpus: Path) -> int:
    """Dev and test examples whose text (of 4 words or more) or longest sentence (of 8 or more) is a
    sentence of the pre-training corpus: text the arms are scored on must not be pre-trained on.
    Shorter ones ("perfect.", "i love it!") are common phrases, not copies."""
    import pyarrow.parquet as pq

    seen = {normalized(s) for f in sorted(corpus.glob("docs-*.parquet"))
            for doc in pq.read_table(f, columns=["sentences"]).column("sentences").to_pylist() for s in doc}
    found = 0
    for example in split["dev"] + split["test"]:
        longest = normalized(max(re.split(r"(?<=[.!?])\s+", example.text_a), key=len))
        whole = normalized(example.text_a)
        keys = {k for k, words in ((whole, 4), (longest, 8)) if len(k.split()) >= words}
        found += bool(keys & seen)
    return found


def instances_for(recipe: Recipe, corpus: Path, vocab: Path, work: Path) -> Path:
    """The instances stage with the recipe's settings, built once per distinct setting."""
    sets = recipe.instance_sets()
    key = "-".join([f"seq{recipe.seq}", "nsp" if recipe.next_sentence_prediction else "packed", recipe.masking,
                    "wwm" if recipe.whole_word_mask else "wordpiece"])
    out = work / f"instances-{key}"
    if not (out / "_MANIFEST.json").exists():
        cmd = ["instances", "--corpus", str(corpus), "--vocab", str(vocab), "--output", str(out)]
        for s in sets:
            cmd += ["--set", s]
        bertpipe(cmd, work / f"instances-{key}.log")
    return out


# --------------------------------------------------------------------------- pre-training


def read_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def pretrain(recipe: Recipe, instances: Path, run: Path, steps: int, ranks: int, seed: int = PRETRAIN_SEED) -> dict:
    """``bertpipe pretrain`` with the recipe's settings for ``steps``: CPU seconds, rows, final eval."""
    shutil.rmtree(run, ignore_errors=True)
    cmd = ["pretrain", "--instances", str(instances), "--output", str(run)]
    for s in recipe.pretrain_sets(steps, ranks, seed):
        cmd += ["--set", s]
    started = time.perf_counter()
    cpu = bertpipe(cmd, run.parent / f"{run.name}.log")
    rows = read_rows(run)
    evals = [r for r in rows if r.get("kind") == "eval"]
    train = [r for r in rows if r.get("kind", "train") == "train"]
    return {"steps": steps, "cpu_minutes": cpu / 60, "wall_minutes": (time.perf_counter() - started) / 60,
            "train_cpu_minutes": (train[-1]["cpu_seconds"] - train[0]["cpu_seconds"]) / 60 if len(train) > 1 else 0.0,
            "last_loss": train[-1]["loss"] if train else None, "rows": rows,
            "eval": {k: evals[-1][k] for k in ("mlm_loss", "mlm_acc", "nsp_loss", "nsp_acc", "instances")}
            if evals else None}


def calibrate(recipe: Recipe, instances: Path, work: Path, name: str, steps: int, ranks: int) -> float:
    """CPU seconds one training step of the recipe costs, from a short run of the same command."""
    done = pretrain(recipe, instances, work / f"calibration-{name}", steps, ranks)
    per_step = cpu_per_step(done["rows"])
    print(f"  calibration: {per_step:.2f} CPU-s a step ({done['cpu_minutes'] * 60:.0f} CPU-s for {steps} steps "
          f"with start-up)", flush=True)
    return per_step


def random_init(recipe: Recipe, instances: Path, folder: Path, seed: int = PRETRAIN_SEED) -> Path:
    """Arm B: the model config pre-training would build, random weights drawn from ``seed`` as
    pre-training draws its initial weights, the same vocab."""
    import torch

    from bert_core.config import load_config
    from bert_core.model.bert import BertForPreTraining
    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.data import read_vocab, vocab_file_of
    from bert_core.pretrain.loop import model_config

    cfg = load_config("demo", None, recipe.pretrain_sets(1, 1, seed))
    vocab_file = vocab_file_of(str(instances))
    torch.manual_seed(cfg.pretrain.seed)
    model = BertForPreTraining(model_config(cfg, len(read_vocab(vocab_file))))
    save_pretrained(model, str(folder), vocab_file=vocab_file, lowercase=cfg.vocab.lowercase)
    return folder


# --------------------------------------------------------------------------- fine-tuning


def finetune(checkpoint: str, data: dict[str, list], split: str, lr: float, epochs: float, seed: int,
             batch_size: int, max_seq_length: int, pad_id: int) -> float:
    """Accuracy (0-100) on ``split`` after fine-tuning on train with the product's loop."""
    import torch

    from bert_core.config import FinetuneConfig
    from bert_core.finetune.data import TaskData
    from bert_core.finetune.glue import glue_metrics
    from bert_core.finetune.train import train_and_predict

    torch.set_num_threads(1)
    cfg = FinetuneConfig(learning_rate=lr, num_train_epochs=epochs, batch_size=batch_size,
                         max_seq_length=max_seq_length, threads=1)
    task = TaskData(kind="classification", num_labels=2, train=data["train"], evals={split: data[split]},
                    finish=lambda s, o: ({}, {}))
    out = train_and_predict(task, checkpoint, cfg, seed, pad_id)
    pred = np.stack(out["outputs"][split]).argmax(-1)
    return 100 * glue_metrics("sentiment", [f["label"] for f in data[split]], pred)["accuracy"]


def encoded(checkpoint: Path, split: dict[str, list], max_seq_length: int) -> tuple[dict[str, list], int]:
    """Every part of the split in the checkpoint's vocab, and its padding id."""
    from bert_core.vocab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(checkpoint))
    return {k: encode(tokenizer, v, max_seq_length) for k, v in split.items()}, tokenizer.pad_id


def select_setting(name: str, checkpoint: Path, split: dict[str, list], lrs: list[float], epochs: list[float],
                   args: argparse.Namespace, pool: ProcessPoolExecutor, scored: bool = False) -> dict:
    """The grid on dev, each point the mean over the selection seeds; the best point is ``selected``.
    A grid of one point is scored only when ``scored``: otherwise there is nothing to choose."""
    data, pad_id = encoded(checkpoint, split, args.max_seq_length)
    dev_data = {"train": data["train"], "dev": data["dev"]}
    grid_points = list(product(lrs, epochs))
    select_seeds = args.select_seeds if len(grid_points) > 1 or scored else 0
    futures = {(lr, ep): [pool.submit(finetune, str(checkpoint), dev_data, "dev", lr, ep, seed, args.batch_size,
                                      args.max_seq_length, pad_id)
                          for seed in range(1, select_seeds + 1)] for lr, ep in grid_points}
    grid = {s: [f.result() for f in fs] for s, fs in futures.items()}
    for (lr, ep), scores in filter(lambda item: item[1], grid.items()):
        print(f"  {name}: lr {lr:g} x {ep:g} epochs -> dev {statistics.fmean(scores):.1f}", flush=True)
    lr, ep = best_setting({s: statistics.fmean(v) if v else 0.0 for s, v in grid.items()})
    return {"grid": [{"learning_rate": s[0], "epochs": s[1], "dev_scores": v,
                      "dev_mean": statistics.fmean(v) if v else None} for s, v in grid.items()],
            "selected": {"learning_rate": lr, "epochs": ep},
            "dev_mean": statistics.fmean(grid[(lr, ep)]) if grid[(lr, ep)] else None}


def final_scores(checkpoint: Path, split: dict[str, list], selected: dict, args: argparse.Namespace,
                pool: ProcessPoolExecutor) -> list[float]:
    """Test accuracy of ``--seeds`` fresh fine-tuning seeds at the selected setting."""
    data, pad_id = encoded(checkpoint, split, args.max_seq_length)
    test_data = {"train": data["train"], "test": data["test"]}
    jobs = [(str(checkpoint), test_data, "test", selected["learning_rate"], selected["epochs"], 1000 + seed,
             args.batch_size, args.max_seq_length, pad_id) for seed in range(1, args.seeds + 1)]
    return list(pool.map(finetune, *zip(*jobs, strict=True)))


def run_arm(name: str, checkpoint: Path, split: dict[str, list], lrs: list[float], epochs: list[float],
            args: argparse.Namespace, pool: ProcessPoolExecutor, final: bool = True) -> dict:
    """Grid on dev (mean over the selection seeds), then the final seeds at the best setting on test."""
    started = time.perf_counter()
    entry = {"arm": name, "checkpoint": str(checkpoint)} | select_setting(name, checkpoint, split, lrs, epochs,
                                                                            args, pool, scored=not final)
    if final:
        scores = final_scores(checkpoint, split, entry["selected"], args, pool)
        entry["test_scores"] = scores
        entry["mean"], entry["sd"] = mean_sd(scores)
        print(f"  {name}: chose lr {entry['selected']['learning_rate']:g} x {entry['selected']['epochs']:g} epochs; "
              f"test {entry['mean']:.1f} ± {entry['sd']:.1f} over {len(scores)} seeds", flush=True)
    entry["finetune_minutes"] = (time.perf_counter() - started) / 60
    return entry


def runs_of(arm: dict) -> list[dict]:
    """The pre-training runs of an arm (one per seed); an arm written before runs were recorded
    is one run with the default seed."""
    if "runs" in arm:
        return arm["runs"]
    return [{"seed": PRETRAIN_SEED, "checkpoint": arm.get("checkpoint"), "pretrain": arm.get("pretrain"),
             "eval_mlm": arm.get("eval_mlm"), "test_scores": arm["test_scores"], "mean": arm["mean"]}]


def gain_interval(arm: dict, base: dict) -> dict:
    """The arm's gain over ``base`` with its 95% Welch interval. With two or more pre-training runs in
    both arms the unit is the run (its mean over the fine-tuning seeds), so the interval carries the
    spread between pre-training runs; with one run it can only be over fine-tuning seeds."""
    a, b = runs_of(arm), runs_of(base)
    if len(a) > 1 and len(b) > 1:
        return welch_interval([r["mean"] for r in a], [r["mean"] for r in b]) | {"over": f"{len(a)} vs {len(b)} runs"}
    return welch_interval(arm["test_scores"], base["test_scores"]) | {"over": "fine-tuning seeds of one run"}


# --------------------------------------------------------------------------- main


SAME_RUN = ("recipe", "corpus_inputs", "lrs", "epochs", "select_seeds", "seeds", "dev_size", "test_size", "split_seed",
            "batch_size", "max_seq_length")
SAME_REFERENCE = ("reference_lrs", "reference_epochs", "select_seeds", "seeds", "dev_size", "test_size",
                  "split_seed", "batch_size", "max_seq_length")


def reusable_arms(args: argparse.Namespace) -> dict[float | None, dict]:
    """Arms of the last ``quality.json`` whose results this run would compute again, by budget
    (``None``: the reference). Fine-tuning is seeded and CPU results repeat, so an arm of the same
    recipe, split, grid and seeds is the same arm; a pre-trained arm also needs the same budget."""
    path = RESULTS / "quality.json"
    if not path.exists():
        return {}
    last = json.loads(path.read_text())
    same = all(last["settings"].get(k) == getattr(args, k) for k in SAME_RUN)
    same_reference = all(last["settings"].get(k) == getattr(args, k) for k in SAME_REFERENCE)
    return {a["budget_cpu_minutes"]: a for a in last["arms"]
            if (a["budget_cpu_minutes"] is None and same_reference) or (a["budget_cpu_minutes"] is not None and same)}



def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def search(args, split, corpus, vocab, work, pool) -> int:
    """Every recipe at one budget, fine-tuned on the dev grid; results kept across runs."""
    out_file = RESULTS / "quality-search.json"
    results = json.loads(out_file.read_text()) if out_file.exists() else {"entries": []}
    budget = args.search_budget
    for name in args.recipes or list(RECIPES):
        recipe = RECIPES[name]
        print(f"\n== recipe {name}: {recipe.about}", flush=True)
        instances = instances_for(recipe, corpus, vocab, work)
        if budget == 0:  # the recipe's model from random init: what the budgets are measured against
            checkpoint = random_init(recipe, instances, work / f"random-init-{name}")
            per_step, steps, done = math.nan, 0, {"eval": {"mlm_acc": 0.0}, "last_loss": None}
        else:
            per_step = calibrate(recipe, instances, work, name, args.calibration_steps, args.ranks)
            steps = steps_in_budget(budget, per_step)
            done = pretrain(recipe, instances, work / f"search-{name}", steps, args.ranks)
            checkpoint = work / f"search-{name}" / "hf"
            print(f"  pre-trained {steps} steps: eval MLM accuracy {done['eval']['mlm_acc']:.3f}", flush=True)
        arm = run_arm(name, checkpoint, split, args.lrs, args.epochs, args, pool, final=False)
        entry = {"recipe": name, **asdict(recipe), "budget_cpu_minutes": budget, "steps": steps,
                 "cpu_seconds_per_step": per_step, "eval_mlm": done["eval"], "last_loss": done["last_loss"],
                 "grid": arm["grid"], "selected": arm["selected"], "dev_mean": arm["dev_mean"],
                 "machine": machine()}
        results["entries"] = [e for e in results["entries"]
                              if (e["recipe"], e["budget_cpu_minutes"]) != (name, budget)] + [entry]
        out_file.write_text(json.dumps(results, indent=1))
    print(f"\n{'recipe':>24} | {'CPU-min':>7} | {'steps':>6} | {'eval MLM acc':>12} | {'best dev':>8}")
    for e in sorted(results["entries"], key=lambda e: (e["budget_cpu_minutes"], -e["dev_mean"])):
        print(f"{e['recipe']:>24} | {e['budget_cpu_minutes']:>7g} | {e['steps']:>6} | "
              f"{e['eval_mlm']['mlm_acc']:>12.3f} | {e['dev_mean']:>8.1f}")
    print(f"wrote {out_file}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", default=None, help="sample folder (default: benchmarks.common.samples())")
    parser.add_argument("--recipe", default=CHOSEN, choices=list(RECIPES), help="pre-training recipe of arm A")
    parser.add_argument("--budgets", type=floats, default=[0, 15, 30],
                        help="CPU-minutes of pre-training per arm (all ranks); 0 = random init (arm B)")
    parser.add_argument("--search", action="store_true", help="score recipes on dev at --search-budget")
    parser.add_argument("--recipes", type=lambda t: t.split(","), help="recipes for --search (default: all)")
    parser.add_argument("--search-budget", type=float, default=8.0, help="CPU-minutes per recipe in --search")
    parser.add_argument("--ranks", type=int, default=2, help="pre-training ranks (CPU processes)")
    parser.add_argument("--calibration-steps", type=int, default=40)
    parser.add_argument("--lrs", type=floats, default=[3e-4, 1e-3], help="fine-tuning grid for arms A and B")
    parser.add_argument("--epochs", type=floats, default=[3, 6])
    parser.add_argument("--reference-lrs", type=floats, default=[1e-4], help="grid for MiniLM")
    parser.add_argument("--reference-epochs", type=floats, default=[1])
    parser.add_argument("--select-seeds", type=int, default=2, help="seeds per grid point, scored on dev")
    parser.add_argument("--seeds", type=int, default=5, help="seeds at the chosen setting, scored on test")
    parser.add_argument("--pretrain-seeds", type=int, default=3,
                        help="pre-training runs per budget (random inits for arm B), seeds 42, 43, ...; "
                        "a budget reused with --reuse keeps every run it has")
    parser.add_argument("--no-reference", action="store_true", help="skip arm C (MiniLM)")
    parser.add_argument("--dev-size", type=int, default=1000)
    parser.add_argument("--test-size", type=int, default=1500)
    parser.add_argument("--split-seed", type=int, default=20240601)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="fine-tuning runs side by side")
    parser.add_argument("--reuse", action="store_true",
                        help="take arms from the last quality.json that ran with the same recipe, split and grids")
    args = parser.parse_args(argv)
    if args.test_size < 1000:
        parser.error("--test-size must be at least 1000")
    sample_dir = Path(args.samples) if args.samples else samples()
    work = RESULTS / "quality-data"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}", flush=True)

    split = sentiment_split(sample_dir / "tasks" / "sentiment", args.dev_size, args.test_size, args.split_seed)
    positive = sum(e.label == "positive" for e in split["test"]) / len(split["test"])
    print(f"sentiment: {len(split['train'])} train / {len(split['dev'])} dev / {len(split['test'])} test "
          f"(test majority class {100 * max(positive, 1 - positive):.1f})", flush=True)
    corpus, vocab = corpus_and_vocab(sample_dir, work)
    leaked = held_out_in_corpus(split, corpus)
    args.corpus_inputs = [p for _, p in corpus_inputs()]
    print(f"pre-training corpus: {', '.join(args.corpus_inputs)}; dev/test sentences in it: {leaked}",
          flush=True)
    if leaked:
        raise SystemExit(f"{leaked} dev/test sentences are in the pre-training corpus; the arms would not be fair")
    with ProcessPoolExecutor(args.jobs) as pool:
        if args.search:
            return search(args, split, corpus, vocab, work, pool)
        recipe = RECIPES[args.recipe]
        print(f"recipe {args.recipe}: {recipe.about}", flush=True)
        instances = instances_for(recipe, corpus, vocab, work)
        budgets = sorted(set(args.budgets) | {0.0})
        per_step = math.nan
        arms = []
        earlier = reusable_arms(args) if args.reuse else {}
        for budget in budgets:
            print(f"\n== budget {budget:g} CPU-minutes", flush=True)
            name = "B (random init)" if budget == 0 else f"A ({budget:g} CPU-min)"
            entry: dict = {"budget_cpu_minutes": budget, "arm": name}
            runs = runs_of(earlier[budget]) if budget in earlier else []  # reused runs are all kept
            if runs:
                entry |= {k: earlier[budget][k] for k in ("grid", "selected", "dev_mean")}
                means = ", ".join(f"{r['mean']:.1f}" for r in runs)
                print(f"  reused from the last run: {len(runs)} run(s), test {means}", flush=True)
            if budget and not runs and math.isnan(per_step):
                per_step = calibrate(recipe, instances, work, args.recipe, args.calibration_steps, args.ranks)
            steps = 0 if budget == 0 else (runs[0]["pretrain"]["steps"] if runs else steps_in_budget(budget, per_step))
            started = time.perf_counter()
            for k in range(len(runs), args.pretrain_seeds):
                seed = PRETRAIN_SEED + k
                run: dict = {"seed": seed}
                if budget == 0:
                    checkpoint = random_init(recipe, instances, work / f"random-init-seed{seed}", seed)
                    run["eval_mlm"] = None
                else:
                    folder = work / f"pretrain-{args.recipe}-{budget:g}-seed{seed}"
                    done = pretrain(recipe, instances, folder, steps, args.ranks, seed)
                    checkpoint = folder / "hf"
                    run["pretrain"] = {k: v for k, v in done.items() if k not in ("rows", "eval")}
                    run["eval_mlm"] = done["eval"]
                    print(f"  seed {seed}: {steps} steps, {done['train_cpu_minutes']:.1f} CPU-min of steps "
                          f"({done['cpu_minutes']:.1f} with start-up, eval and export); "
                          f"eval MLM accuracy {done['eval']['mlm_acc']:.3f}", flush=True)
                run["checkpoint"] = str(checkpoint)
                if "selected" not in entry:  # the setting is chosen on dev with the arm's first run
                    entry |= select_setting(name, checkpoint, split, args.lrs, args.epochs, args, pool)
                run["test_scores"] = final_scores(checkpoint, split, entry["selected"], args, pool)
                run["mean"] = statistics.fmean(run["test_scores"])
                print(f"  seed {seed}: lr {entry['selected']['learning_rate']:g} x "
                      f"{entry['selected']['epochs']:g} epochs -> test {run['mean']:.1f}", flush=True)
                runs.append(run)
            entry["runs"] = runs
            entry["test_scores"] = [x for r in runs for x in r["test_scores"]]
            entry["mean"], entry["sd"] = mean_sd(entry["test_scores"])
            entry["sd_between_runs"] = mean_sd([r["mean"] for r in runs])[1]
            mlm = [r["eval_mlm"]["mlm_acc"] for r in runs if r.get("eval_mlm")]
            entry["eval_mlm"] = {"mlm_acc": statistics.fmean(mlm), "per_run": mlm} if mlm else None
            entry["finetune_minutes"] = (time.perf_counter() - started) / 60
            arms.append(entry)
        if not args.no_reference and None in earlier:
            print(f"\n== reference: sample MiniLM reused from the last run, test {earlier[None]['mean']:.1f}")
            arms.append(earlier[None])
        elif not args.no_reference:
            print("\n== reference: sample MiniLM", flush=True)
            arms.append({"budget_cpu_minutes": None, "eval_mlm": None} |
                        run_arm("C (MiniLM)", sample_dir / "models" / "minilm", split, args.reference_lrs,
                                args.reference_epochs, args, pool))

    base = arms[0]
    curve = [{"budget_cpu_minutes": a["budget_cpu_minutes"], "eval_mlm_acc": a["eval_mlm"]["mlm_acc"],
              **gain_interval(a, base)} for a in arms if a["budget_cpu_minutes"]]
    top = curve[-1] if curve else {"gain": math.nan, "ci_low": math.nan, "ci_high": math.nan, "df": math.nan}

    print(f"\nmachine: {info['cpu']} ({info['cores']} cores, torch {info['torch']}, python {info['python']})")
    print(f"recipe {args.recipe}; sentiment test accuracy (0-100), n = {len(split['test'])}: mean over runs x "
          f"{args.seeds} fine-tuning seeds ± sd between runs (within one run for C); the interval is over runs, "
          "or over fine-tuning seeds (*) for an arm of one run")
    print(f"{'arm':>18} | {'CPU-min':>7} | {'runs':>4} | {'eval MLM acc':>12} | {'setting':>13} | "
          f"{'test accuracy':>13} | {'gain over B [95% CI]':>22}")
    for a in arms:
        gain = next((c for c in curve if c["budget_cpu_minutes"] == a["budget_cpu_minutes"]), None)
        mlm = f"{100 * a['eval_mlm']['mlm_acc']:.1f}" if a.get("eval_mlm") else "-"
        setting = f"{a['selected']['learning_rate']:g} x {a['selected']['epochs']:g}"
        seeds_only = gain and not gain["over"].endswith(" runs")
        cell = (f"{gain['gain']:+.1f} [{gain['ci_low']:+.1f}, {gain['ci_high']:+.1f}]{'*' if seeds_only else ''}"
                if gain else "-")
        budget = "-" if a["budget_cpu_minutes"] is None else f"{a['budget_cpu_minutes']:g}"
        runs, sd = len(a.get("runs", [])) or "-", a.get("sd_between_runs", a["sd"])
        print(f"{a['arm']:>18} | {budget:>7} | {runs:>4} | {mlm:>12} | {setting:>13} | "
              f"{a['mean']:>6.1f} ± {sd:<4.1f} | {cell:>22}")
    minutes = (time.perf_counter() - started) / 60
    print(f"total {minutes:.1f} min")

    rows = [{"measure": f"sentiment test accuracy gain of {c['budget_cpu_minutes']:g} CPU-min pre-training "
             "over random init", "ours": round(c["gain"], 2), "reference": 0.0, "ratio": None,
             "unit": "accuracy points"} for c in curve]
    result = {"machine": info, "settings": vars(args), "recipe": {"name": args.recipe, **asdict(recipe)},
              "split": {k: len(v) for k, v in split.items()}, "test_majority": 100 * max(positive, 1 - positive),
              "cpu_seconds_per_step": per_step, "arms": arms, "curve": curve, "gain": top["gain"],
              "ci_low": top["ci_low"], "ci_high": top["ci_high"], "df": top["df"], "rows": rows,
              "minutes": minutes}
    (RESULTS / "quality.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {RESULTS / 'quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
