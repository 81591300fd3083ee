"""The recipe search: which change to the chosen pre-training recipe buys the most few-label gain
for its CPU-minutes. Three steps, the middle one on whatever accelerator there is:

    python -m benchmarks.quality_search prepare --work W --stage .search   # here: step counts, the task text's instances
    python -m benchmarks.quality_search pretrain --stage .search --out OUT  # every recipe side by side, archived in OUT
    python -m benchmarks.quality_search evaluate --work W --checkpoints OUT --jobs N  # here: dev scores, the JSON

Each recipe of :data:`RECIPES` changes one thing of the chosen recipe (``CHOSEN`` in
``bench_quality``: tiny pre-LN BERT, MLM only, 64 tokens, batch 64, peak rate 3e-3, weight decay
0.01, 15% of pieces masked anew each epoch) and keeps the protocol's budget of 60 CPU-minutes:
the protocol's step count for the chosen recipe, scaled by what a step of the recipe costs on
this machine's CPU against a step of the chosen one (both timed here in-process on one thread).
Task-adaptive pre-training (Gururangan et al. 2020) continues the protocol's first 60-minute run
with 5 more CPU-minutes of masked LM on the tasks' training pools (text only, no labels).

Pre-training runs in-process (the product's ``bert_core.pretrain.in_process``: its random init,
model, loader and optimizer settings), on the GPU when there is one: the device changes rounding, not the recipe;
``chosen`` runs there too, as the control for the device. Each checkpoint is fine-tuned on 300
labels of each task, 5 stratified subsamples and seeds, at the protocol's arm-A setting of the
task, and scored on dev (the search never reads test); beside them the protocol's own 60-minute
runs and random init on the same jobs. Output: ``bench-results/quality-search.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUDGET_MINUTES = 60.0
TAPT_MINUTES = 5.0
SIZE = 300
SUBSAMPLES = 5
SETTINGS = {"sentiment": {"learning_rate": 1e-3, "pooling": "mean"},  # arm A's, chosen by the protocol's dev grid
            "tweets3": {"learning_rate": 3e-4, "pooling": "cls"}}
ARCHIVE_PART = 15 * 2**20  # the archive of checkpoints comes back in parts of this many bytes


@dataclass(frozen=True)
class Variant:
    """One pre-training recipe: what it changes of the chosen one."""

    about: str
    size: str = "tiny"
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    masked_lm_prob: float = 0.15
    max_predictions: int = 10
    tapt: bool = False  # continue the protocol's first run on the tasks' training text


RECIPES = {
    "chosen": Variant("the chosen recipe itself, run by this search (the control for the device)"),
    "wd0.1": Variant("weight decay 0.1", weight_decay=0.1),
    "mask0.25": Variant("25% of pieces masked (at most 16 of 64)", masked_lm_prob=0.25, max_predictions=16),
    "mini": Variant("mini (L4/H256) at peak rate 1e-3, fewer steps for the same CPU-minutes", size="mini",
                    learning_rate=1e-3),
    "tapt": Variant("task-adaptive: the protocol's first 60-minute run, then 5 CPU-minutes of MLM on the "
                    "tasks' training pools at peak rate 1e-3", learning_rate=1e-3, tapt=True),
}


def model_for(variant: Variant, vocab_size: int, seed: int = 42, init: str | None = None):
    """The variant's model from the product's random init for ``seed``, or ``init``'s weights
    (the steps that follow draw their dropout from ``seed`` either way)."""
    import torch

    from bert_core.config import ModelConfig
    from bert_core.model.bert import BertForPreTraining
    from bert_core.pretrain.in_process import random_init

    if init:
        torch.manual_seed(seed)
        return BertForPreTraining.from_pretrained(init)
    return random_init(ModelConfig(size=variant.size, vocab_size=vocab_size, max_position_embeddings=512,
                                   pre_layer_norm=True), seed)


def train(variant: Variant, model, instances: str, steps: int, seed: int, device: str = "cpu", **kwargs) -> list[dict]:
    """The product's in-process masked-LM steps at the variant's settings: batch 64 at 64 tokens."""
    from bert_core.pretrain.in_process import short_run, train_mlm

    config = short_run(64, steps, 64, variant.learning_rate, variant.weight_decay, seed)
    masking = {"masked_lm_prob": variant.masked_lm_prob, "max_predictions_per_seq": variant.max_predictions}
    return train_mlm(model, instances, config, device=device, masking=masking, **kwargs)


# --------------------------------------------------------------------------- prepare (here)


def cpu_seconds_per_step(variant: Variant, instances: str, vocab_size: int, warmup: int = 5, timed: int = 30) -> float:
    """CPU seconds a step of ``variant`` costs on this machine, one thread, after ``warmup`` steps."""
    import torch

    torch.set_num_threads(1)
    marks: dict[int, float] = {}
    train(variant, model_for(variant, vocab_size, seed=0), instances, warmup + timed, 0, log_every=10**9,
          on_step=lambda s: marks.setdefault(s, time.process_time()))
    return (marks[warmup + timed - 1] - marks[warmup - 1]) / timed


def task_text(samples: Path, out: Path) -> Path:
    """The tasks' training pools as ``--text`` records of 20 sentences (no dev or test text)."""
    from benchmarks import quality_tasks as qt

    texts = [e.text_a for name, task in qt.TASKS.items() for e in qt.load(task, samples)["train"]]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "task-text.jsonl"
    path.write_text("".join(json.dumps({"id": f"task-{n}", "text": "\n\n".join(texts[i:i + 20])}) + "\n"
                            for n, i in enumerate(range(0, len(texts), 20))))
    return path


def prepare(work: Path, stage: Path, samples: Path, chosen_steps: int) -> dict:
    """Copy what the pre-training step needs into ``stage`` (instances, the task text's instances,
    the protocol's first run) and write each recipe's step count to ``stage/steps.json``."""
    from benchmarks import bench_quality as bq
    from bert_core.pretrain.data import read_vocab, vocab_file_of

    recipe = bq.RECIPES[bq.CHOSEN]
    instances = work / "instances-seq64-packed-dynamic-wordpiece"
    first_run = bq.pretrain_folder(work, bq.CHOSEN, BUDGET_MINUTES, 1, bq.PRETRAIN_SEED) / "hf"
    search = work / "search"
    text = task_text(samples, search)
    corpus = search / "task-corpus"
    if not (corpus / "_MANIFEST.json").exists():
        bq.bertpipe(["corpus", "--text", str(text), "--output", str(corpus)], search / "corpus.log")
    task_instances = bq.instances_for(recipe, corpus, work / "vocab", search)
    vocab_size = len(read_vocab(vocab_file_of(str(instances))))
    costs = {name: cpu_seconds_per_step(v, str(instances), vocab_size) for name, v in RECIPES.items()}
    steps = {name: round(chosen_steps * costs["chosen"] / cost) for name, cost in costs.items()}
    steps["tapt"] = round(chosen_steps * TAPT_MINUTES / BUDGET_MINUTES)
    shutil.rmtree(stage, ignore_errors=True)
    for src, name in ((instances, "instances"), (task_instances, "task-instances"), (first_run, "first-run")):
        shutil.copytree(src, stage / name)
    vocab = Path(vocab_file_of(str(instances)))
    shutil.copy(vocab, stage / "vocab.txt")
    plan = {"vocab": str(vocab), "chosen_steps": chosen_steps, "cpu_seconds_per_step": costs, "steps": steps,
            "budget_cpu_minutes": {n: BUDGET_MINUTES + (TAPT_MINUTES if RECIPES[n].tapt else 0) for n in RECIPES}}
    (stage / "steps.json").write_text(json.dumps(plan, indent=1))
    return plan


# --------------------------------------------------------------------------- pretrain (on the GPU)


def pretrain_one(stage: str, name: str, steps: int, out: str, seed: int = 42) -> dict:
    """One recipe for ``steps``, saved under ``out/name``: its log and wall minutes."""
    import torch

    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.data import read_vocab, vocab_file_of

    variant = RECIPES[name]
    stage_dir = Path(stage)
    instances = str(stage_dir / ("task-instances" if variant.tapt else "instances"))
    vocab_file = vocab_file_of(str(stage_dir / "instances"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.set_num_threads(2)  # the host's cores shared by the recipes' loaders
    model = model_for(variant, len(read_vocab(vocab_file)), seed, str(stage_dir / "first-run") if variant.tapt else None)
    started = time.perf_counter()
    log = train(variant, model, instances, steps, seed, device)
    folder = Path(out) / name
    save_pretrained(model.cpu(), str(folder), vocab_file=vocab_file)
    row = {"recipe": name, "steps": steps, "device": device, "wall_minutes": (time.perf_counter() - started) / 60,
           "log": log}
    (folder / "pretrain-log.json").write_text(json.dumps(row))
    return row


def pretrain_all(stage: Path, out: Path, names: list[str], scale: float = 1.0) -> int:
    """Every recipe side by side, one process each; each checkpoint archived in ``out`` as it ends
    (``NAME.tar``, or its parts ``NAME.tar.part-NN`` when larger than :data:`ARCHIVE_PART`)."""
    plan = json.loads((stage / "steps.json").read_text())
    vocab = Path(plan["vocab"])  # the instances name their vocab by its path here; on another machine, put it there
    if not vocab.exists():
        vocab.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(stage / "vocab.txt", vocab)
    folders = out / "checkpoints"
    with ProcessPoolExecutor(len(names)) as pool:
        futures = {pool.submit(pretrain_one, str(stage), n, max(2, round(plan["steps"][n] * scale)), str(folders)): n
                   for n in names}
        for f in as_completed(futures):
            row = f.result()
            name = row["recipe"]
            print(f"pretrained {name}: {row['steps']} steps on {row['device']} in "
                  f"{row['wall_minutes']:.1f} min, last {row['log'][-1]}", flush=True)
            archive = out / f"{name}.tar"
            with tarfile.open(archive, "w") as tar:
                tar.add(folders / name, arcname=f"checkpoints/{name}")
            shutil.rmtree(folders / name)
            if archive.stat().st_size > ARCHIVE_PART:
                subprocess.run(["split", "-b", str(ARCHIVE_PART), "-d", archive.name, f"{archive.name}.part-"],
                               cwd=out, check=True)
                archive.unlink()
    folders.rmdir()
    return 0


def unpack(archives: Path, into: Path) -> Path:
    """The checkpoints folder from the archives (and archive parts) in ``archives``."""
    for name in sorted({p.name.split(".tar")[0] for p in archives.glob("*.tar*")}):
        if (into / "checkpoints" / name).exists():
            continue
        into.mkdir(parents=True, exist_ok=True)
        whole = into / f"{name}.tar"
        whole.write_bytes(b"".join(p.read_bytes() for p in sorted(archives.glob(f"{name}.tar*"))))
        with tarfile.open(whole) as tar:
            tar.extractall(into, filter="data")
        whole.unlink()
    return into / "checkpoints"


# --------------------------------------------------------------------------- evaluate (here)


def weights_digest(checkpoint: Path) -> str:
    return hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()[:20]


def evaluate(work: Path, checkpoints: Path, plan: dict, samples: Path, jobs: int, output: Path,
             subsamples: int = SUBSAMPLES) -> dict:
    """Fine-tune every checkpoint on the same 300-label jobs, scored on dev."""
    import statistics

    from benchmarks import bench_quality as bq
    from benchmarks import quality_tasks as qt
    from benchmarks.quality_finetune import encoded, finetune
    from bert_core.finetune.data import subsample

    arms = {name: checkpoints / name for name in RECIPES if (checkpoints / name / "config.json").exists()}
    for k in range(bq.RUNS):
        seed = bq.PRETRAIN_SEED + k
        run = bq.pretrain_folder(work, bq.CHOSEN, BUDGET_MINUTES, 1, seed) / "hf"
        if run.exists():
            arms[f"protocol A 60 seed {seed}"] = run
        arms[f"random init seed {seed}"] = bq.baseline_folder(work, bq.CHOSEN, seed)
    cache = bq.Cache(work / "search" / "cache", reuse=True)
    tasks = {name: qt.load(task, samples) for name, task in qt.TASKS.items()}
    scores: dict[str, dict[str, list[float]]] = {}
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        for arm, ckpt in arms.items():
            for task_name, parts in tasks.items():
                task = qt.TASKS[task_name]
                work_list = []
                for k in range(subsamples):
                    train = subsample(parts["train"], SIZE, task_name, k)
                    data, pad = encoded(str(ckpt), {"train": train, "dev": parts["dev"]}, task.labels, 64)
                    key = {"search": arm, "weights": weights_digest(ckpt), "task": task_name, "size": SIZE,
                           "subsample": k, "setting": SETTINGS[task_name]}
                    work_list.append((key, finetune, (str(ckpt), data, "dev", len(task.labels), SETTINGS[task_name],
                                                      1 + k, pad)))
                results = cache.run(pool, work_list, f"{arm} {task_name}")
                scores.setdefault(arm, {})[task_name] = [r["macro_f1"] for r in results]
                print(f"  {arm} {task_name}: dev macro-F1 {statistics.mean(scores[arm][task_name]):.1f}", flush=True)
    random_mean = {t: statistics.mean(v for a, s in scores.items() if a.startswith("random") for v in s[t])
                   for t in tasks}
    entries = []
    for arm, by_task in scores.items():
        means = {t: statistics.mean(v) for t, v in by_task.items()}
        recipe = RECIPES.get(arm)
        pretrain_log = checkpoints / arm / "pretrain-log.json"
        entries.append({"arm": arm, "about": recipe.about if recipe else None,
                        "budget_cpu_minutes": plan.get("budget_cpu_minutes", {}).get(arm, BUDGET_MINUTES
                                                                                     if "protocol" in arm else 0),
                        "steps": plan.get("steps", {}).get(arm),
                        "pretrain": json.loads(pretrain_log.read_text()) if pretrain_log.exists() else None,
                        "dev_macro_f1": by_task, "mean": means,
                        "gain_over_random_init": {t: means[t] - random_mean[t] for t in means},
                        "mean_gain": statistics.mean(means[t] - random_mean[t] for t in means)})
    result = {"what": "the recipe search: each recipe's 300-label dev macro-F1 (5 stratified subsamples, the "
                      "protocol's arm-A setting per task), its gain over random init (mean of 3 inits)",
              "size": SIZE, "subsamples": subsamples, "settings": SETTINGS, "plan": plan, "entries": entries}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    for e in sorted(entries, key=lambda e: -e["mean_gain"]):
        print(f"{e['arm']:<28} {e['budget_cpu_minutes']:>5g} CPU-min  gain {e['mean_gain']:+.1f}  "
              + "  ".join(f"{t} {m:.1f}" for t, m in e["mean"].items()))
    return result


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import samples as default_samples

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=["prepare", "pretrain", "evaluate"])
    parser.add_argument("--work", default="/work/quality-runs", help="bench_quality's --work")
    parser.add_argument("--stage", default=str(ROOT / ".search"), help="what the pre-training step reads")
    parser.add_argument("--out", default=None, help="pretrain: where the checkpoints' archive goes")
    parser.add_argument("--checkpoints", default=None, help="evaluate: folder of the archive's parts")
    parser.add_argument("--samples", default=None)
    parser.add_argument("--chosen-steps", type=int, default=14533, help="the protocol's 60-minute step count")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--scale", type=float, default=1.0, help="pretrain: a share of each step count (dry run)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--subsamples", type=int, default=SUBSAMPLES, help="evaluate: fewer for a dry run")
    parser.add_argument("--output", default=str(ROOT / "bench-results" / "quality-search.json"))
    args = parser.parse_args(argv)
    work, stage = Path(args.work), Path(args.stage)
    if args.step == "pretrain":
        return pretrain_all(stage, Path(args.out), args.recipes.split(","), args.scale)
    samples = Path(args.samples) if args.samples else default_samples()
    if args.step == "prepare":
        print(json.dumps(prepare(work, stage, samples, args.chosen_steps), indent=1))
        return 0
    folder = unpack(Path(args.checkpoints), work / "search" / "gpu")
    evaluate(work, folder, json.loads((stage / "steps.json").read_text()), samples, args.jobs, Path(args.output),
             args.subsamples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
