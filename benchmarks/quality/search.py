"""The recipe choice: which of a version's candidate recipes (its ``candidates``) buys the most
few-label gain for its CPU-minutes. Three steps, each resumed from what ``--work`` holds:

    python -m benchmarks.quality prepare  --protocol v3 --work W                 # corpora, instances, step counts
    python -m benchmarks.quality pretrain --protocol v3 --candidates --work W --seeds 42 --scale 0.25 --keep R
    python -m benchmarks.quality choose   --protocol v3 --work W --checkpoints R --choose FILE

The steps: :func:`prepare`, :func:`pretrain_all`, :func:`evaluate`. A run trains on the GPU when
there is one; version 2's trip to a device machine and back (the stage, the runs' archives) is in
git's history.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.quality import build
from benchmarks.quality import corpus as quality_corpus
from benchmarks.quality import tasks as qt
from benchmarks.quality.cache import Cache, run_cached, weights_digest
from benchmarks.quality.spec import CHOSEN, RECIPES, ROOT, Recipe, candidates, protocol, versions
from bert_core.config import PretrainConfig
from bert_core.storage import sha256

BUDGET_MINUTES = 60.0
TIMING_ROUNDS = 3  # prepare: each cost is timed this many times, the costs in turn, and the median kept

CANDIDATE_SETS = {v: candidates(v) for v in versions()}
CANDIDATES_V2 = CANDIDATE_SETS["v2"]
ALL_RECIPES = {n: r for recipes in CANDIDATE_SETS.values() for n, r in recipes.items()}
CHOSEN_ON_K1 = RECIPES["chosen-on-k1"]
GRID = protocol("v2")["grid"]


def recipe_names(text: str) -> list[str]:
    """``--recipes``: a version (``v2``) for its candidates, else candidates' names, comma-separated."""
    names = [n for part in text.split(",") if part.strip()
             for n in (CANDIDATE_SETS[part.strip()] if part.strip() in CANDIDATE_SETS else [part.strip()])]
    unknown = [n for n in names if n not in ALL_RECIPES]
    if unknown or not names:
        raise SystemExit(f"--recipes {text}: unknown recipe {', '.join(unknown) or '(none)'}; "
                         f"known: {', '.join([*CANDIDATE_SETS, *ALL_RECIPES])}")
    return names


def model_for(variant: Recipe, vocab_size: int, seed: int = 42):
    """The variant's model from the product's random init for ``seed``."""
    from bert_core.pretrain.in_process import random_init

    return random_init(model_config_for(variant, vocab_size), seed)


def model_config_for(recipe: Recipe, vocab_size: int):
    """The search's model config of ``recipe``: pre-LN at 512 positions, the same for every
    candidate, since fine-tuning is at 64 tokens whatever the pre-training length."""
    from bert_core.config import ModelConfig

    return ModelConfig(size=recipe.size, vocab_size=vocab_size, max_position_embeddings=512, pre_layer_norm=True)


def train(variant: Recipe, model, instances: str, steps: int, seed: int, device: str = "cpu", **kwargs) -> list[dict]:
    """The product's in-process masked-LM steps at the variant's settings: ``batch`` sequences of
    ``seq`` tokens a step, the instances' dynamic masks drawn with the variant's share of pieces
    (whole words with ``whole_word_mask``, as the loader masks for ``instances.whole_word_mask``)."""
    from bert_core.config import PretrainPhase

    phase = PretrainPhase(max_seq_length=variant.seq, max_steps=steps, global_batch_size=variant.batch,
                          micro_batch_size=variant.batch, learning_rate=variant.learning_rate,
                          warmup_steps=max(1, steps // 10))
    config = PretrainConfig(phases=[phase], procs_per_node=1, weight_decay=variant.weight_decay, seed=seed)
    masking = {"masked_lm_prob": variant.masked_lm_prob, "whole_word_mask": variant.whole_word_mask}
    return train_mlm(model, instances, config, device=device, masking=masking, **kwargs)


def train_mlm(model: Any, instances: str, config: PretrainConfig, phase_index: int = 0, device: str = "cpu",
              masking: dict[str, Any] | None = None, log_every: int = 500,
              on_step: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """The phase's ``max_steps`` optimizer steps on ``instances`` in this process: batches of its
    ``global_batch_size`` at its length, AdamW with the config's betas, epsilon and weight decay
    (matrices only), linear warmup then linear decay, gradient clipping; ``masking`` overrides
    fields of the instances' dynamic masking. The loss and masked-LM accuracy every ``log_every``
    steps and at the last."""
    import torch

    from bert_core.model.schedule import linear_warmup_decay
    from bert_core.model.weight_decay import param_groups
    from bert_core.pretrain.data import PretrainingLoader, to_device

    phase = config.phases[phase_index]
    model.to(device).train()
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=phase.learning_rate,
                                  betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(phase.warmup_steps, phase.max_steps))
    loader = PretrainingLoader(instances, max_seq_length=phase.max_seq_length,
                               micro_batch_size=phase.global_batch_size, seed=config.seed + phase_index)
    if masking:
        loader.masking = replace(loader.masking, **masking)
    batches = iter(loader)
    log = []
    for step in range(phase.max_steps):
        result = model(**to_device(next(batches), device))
        result["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.gradient_clipping)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step:
            on_step(step)
        if step % log_every == 0 or step == phase.max_steps - 1:
            log.append({"step": step, "loss": float(result["mlm_loss"]), "mlm_acc": float(result["mlm_acc"])})
    return log


def cpu_seconds_per_step(variant: Recipe, instances: str, vocab_size: int, warmup: int = 5, timed: int = 30) -> float:
    """CPU seconds a step of ``variant`` costs on this machine, one thread, after ``warmup`` steps."""
    import torch

    torch.set_num_threads(1)
    marks: dict[int, float] = {}
    train(variant, model_for(variant, vocab_size, seed=0), instances, warmup + timed, 0, log_every=10**9,
          on_step=lambda s: marks.setdefault(s, time.process_time()))
    return (marks[warmup + timed - 1] - marks[warmup - 1]) / timed


def corpus_for(name: str, work: Path, samples: Path) -> tuple[Path, Path]:
    """Corpus ``name`` (``k1``, ``k2``) and its vocab, built once under ``work/name`` by
    ``corpus`` (with the chosen recipe's instances beside them); stops when a
    dev or test text of a task is in it."""

    if name not in quality_corpus.CORPORA:
        raise SystemExit(f"corpus {name}: not one of {', '.join(quality_corpus.CORPORA)}")
    tasks = {n: qt.load(t, samples) for n, t in qt.TASKS.items()}
    built = quality_corpus.build(name, RECIPES[CHOSEN], work, samples, tasks)
    return built.corpus, built.vocab


def cost_key(variant: Recipe) -> tuple:
    """What decides a step's cost: variants equal in it (they differ in optimizer settings only)
    share one timing."""
    return (variant.corpus, variant.size, variant.seq, variant.batch, variant.masked_lm_prob, variant.whole_word_mask)


def prepare(work: Path, samples: Path, chosen_steps: int, corpora: list[str]) -> dict:
    """Per candidate of ``corpora``, its corpus's vocab and instances at its length,
    and its step count, the protocol's ``chosen_steps`` for the chosen recipe (on K1) scaled by
    that recipe's CPU-seconds a step over the candidate's (timed here in-process on one thread,
    per :func:`cost_key`, the median of :data:`TIMING_ROUNDS` timings taken in turn). The corpora
    come from :func:`corpus_for`. Writes the plan (instances, vocabs and step counts) to
    ``work/search-v2/plan.json``."""
    from bert_core.pretrain.data import read_vocab, vocab_file_of

    names = [n for n, v in CANDIDATES_V2.items() if v.corpus in corpora]
    if not names:
        raise SystemExit(f"--corpus {','.join(corpora)}: no candidate of version 2 uses it (k1, k2)")
    built = {corpus: corpus_for(corpus, work, samples) for corpus in sorted({"k1", *(CANDIDATES_V2[n].corpus
                                                                                   for n in names)})}
    base = RECIPES[CHOSEN]
    local: dict[tuple[str, int], Path] = {}
    for corpus, seq in sorted({("k1", 64), *((CANDIDATES_V2[n].corpus, CANDIDATES_V2[n].seq) for n in names)}):
        corpus_dir, vocab_dir = built[corpus]
        local[corpus, seq] = build.instances_for(replace(base, seq=seq), corpus_dir, vocab_dir, work / corpus)
    timed_variants = {"chosen": CHOSEN_ON_K1, **{n: CANDIDATES_V2[n] for n in names}}
    groups: dict[tuple, tuple[str, Recipe]] = {}
    for name, variant in timed_variants.items():
        groups.setdefault(cost_key(variant), (name, variant))
    rounds: dict[tuple, list[float]] = {key: [] for key in groups}
    for r in range(TIMING_ROUNDS):  # in turn, so that the machine's load drifts over every cost alike
        for key, (name, variant) in groups.items():
            instances = str(local[variant.corpus, variant.seq])
            started = time.perf_counter()
            rounds[key].append(cpu_seconds_per_step(variant, instances, len(read_vocab(vocab_file_of(instances))),
                                                    timed=20))
            print(f"timed {name} (round {r + 1}): {rounds[key][-1]:.3f} CPU-s a step "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    members = {n: cost_key(v) for n, v in timed_variants.items()}
    costs = {n: statistics.median(rounds[key]) for n, key in members.items()}
    timings = {groups[key][0]: {"rounds": rounds[key], "for": [n for n, k in members.items() if k == key]}
               for key in groups}
    steps = {n: round(chosen_steps * costs["chosen"] / costs[n]) for n in names}
    plan = {"candidates": "v2", "chosen_steps": chosen_steps, "cpu_seconds_per_step": costs, "timings": timings,
            "steps": steps, "corpus": {n: CANDIDATES_V2[n].corpus for n in names},
            "instances": {n: str(local[CANDIDATES_V2[n].corpus, CANDIDATES_V2[n].seq]) for n in names},
            "vocabs": {c: vocab_file_of(str(f)) for (c, _), f in local.items()},
            "budget_cpu_minutes": {n: BUDGET_MINUTES for n in names}}
    (work / "search-v2").mkdir(parents=True, exist_ok=True)
    (work / "search-v2" / "plan.json").write_text(json.dumps(plan, indent=1))
    return plan


def read_plan(work: Path) -> dict:
    """The plan :func:`prepare` left in ``work/search-v2``."""
    plan_file = work / "search-v2" / "plan.json"
    if not plan_file.exists():
        raise SystemExit(f"{plan_file} is missing: run benchmarks.quality prepare --work {work} first")
    return json.loads(plan_file.read_text())


def pretrain_one(name: str, steps: int, out: str, seed: int, folder: str, inputs: tuple[str, str],
                 threads: int) -> dict:
    """One recipe for ``steps`` from its random init for ``seed``, saved as ``out/folder`` with
    ``pretrain-log.json``: card, steps, tokens seen (steps x batch x length), wall-clock minutes
    of the steps and the loss log. The folder appears whole (written beside it, then renamed), so
    a folder with its log is a finished run."""
    import torch

    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.data import read_vocab

    variant = ALL_RECIPES[name]
    instances, vocab_file = inputs
    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model_for(variant, len(read_vocab(vocab_file)), seed)
    started = time.perf_counter()
    log = train(variant, model, instances, steps, seed, device)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / 60
    target = Path(out) / folder
    part = target.with_name(f"{target.name}.part")
    shutil.rmtree(part, ignore_errors=True)
    save_pretrained(model.cpu(), str(part), vocab_file=vocab_file)
    row = {"recipe": name, "seed": seed, "folder": target.name, "steps": steps, "device": device,
           "card": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "batch": variant.batch, "seq": variant.seq, "tokens_seen": steps * variant.batch * variant.seq,
           "wall_minutes": wall, "log": log}
    (part / "pretrain-log.json").write_text(json.dumps(row))
    shutil.rmtree(target, ignore_errors=True)
    part.rename(target)
    return row


def pretrain_all(work: Path, keep: Path, names: list[str], seeds: list[int], scale: float = 1.0) -> int:
    """Every recipe x seed side by side, one process each, for the plan's step count of the recipe
    (times ``scale``), each run a folder ``keep/<recipe>-seed<S>``; a run already there is not run
    again. A run that fails is reported and left out, and the status is 1."""
    plan = read_plan(work)
    missing = [n for n in names if n not in plan["steps"]]
    if missing:
        raise SystemExit(f"{work} was prepared without {', '.join(missing)} (it has {', '.join(plan['steps'])}); "
                         "prepare it with the candidates you pre-train")
    every = [(n, s, f"{n}-seed{s}") for n in names for s in seeds]
    done = [f for _, _, f in every if (keep / f / "pretrain-log.json").exists()]
    if done:
        print(f"already finished in {keep}, not run again: {', '.join(done)}", flush=True)
    runs = [r for r in every if r[2] not in done]
    if not runs:
        return 0
    threads = max(1, (os.cpu_count() or 1) // len(runs))
    failed = []
    with ProcessPoolExecutor(len(runs)) as pool:
        futures = {pool.submit(pretrain_one, n, max(2, round(plan["steps"][n] * scale)), str(keep), s, f,
                               (plan["instances"][n], plan["vocabs"][plan["corpus"][n]]), threads): f
                   for n, s, f in runs}
        for future in as_completed(futures):
            try:
                row = future.result()
            except Exception as err:  # the protocol reports a run that did not finish; it never replaces it
                failed.append(futures[future])
                print(f"run {futures[future]} did not finish: {type(err).__name__}: {err}", flush=True)
                continue
            print(f"pretrained {row['folder']}: {row['steps']} steps on {row['card']} in "
                  f"{row['wall_minutes']:.1f} min, {row['tokens_seen']:,} tokens, last {row['log'][-1]}", flush=True)
    return 1 if failed else 0


def run_folders(checkpoints: Path, names: list[str]) -> dict[str, list[tuple[int, Path]]]:
    """Per recipe of ``names``, its runs under ``checkpoints`` as (seed, folder), from the folders
    ``<recipe>-seed<S>`` that hold a model."""
    out: dict[str, list[tuple[int, Path]]] = {}
    for folder in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        name, sep, seed = folder.name.rpartition("-seed")
        if sep and name in names and seed.isdigit() and (folder / "config.json").exists():
            out.setdefault(name, []).append((int(seed), folder))
    return out


def random_init_v2(work: Path, corpus: str, vocab_file: str, seed: int) -> Path:
    """Arm B of a corpus for the choice: the candidates' model config (tiny, pre-LN, 512
    positions: the same for every candidate, since fine-tuning is at 64 tokens whatever the
    pre-training length) from the product's random init for ``seed`` (the weights every
    candidate's run of ``seed`` starts from), with the corpus's vocab."""
    from bert_core.pretrain.data import read_vocab
    from bert_core.pretrain.in_process import save_random_init

    folder = work / "search-v2" / f"random-init-{corpus}-seed{seed}"
    if not (folder / "config.json").exists():
        part = folder.with_name(f"{folder.name}.{os.getpid()}.part")
        shutil.rmtree(part, ignore_errors=True)
        save_random_init(model_config_for(CANDIDATES_V2["k1"], len(read_vocab(vocab_file))), seed, str(part),
                         vocab_file)
        shutil.rmtree(folder, ignore_errors=True)
        part.rename(folder)
    return folder


def every_setting_jobs(arm: str, checkpoint: Path, task, parts: dict, sizes: list[int], subsamples: int,
                       settings: list[int] | None = None, encodings: dict | None = None) -> list:
    """One checkpoint's dev jobs on one task: every size x subsample (fine-tuned with seed 1 + k)
    x setting of ``the protocol's grid`` (``settings``: their numbers 1-8, default all), keyed for
    the job cache by the arm, its weights and vocab, and the accelerator when it is not the CPU
    (``QUALITY_ACCELERATOR``). ``encodings`` keeps each subsample's features by vocab, so that
    the checkpoints of one corpus tokenize them once."""
    from benchmarks.quality.finetune import ACCELERATOR_VARIABLE, encoded, finetune
    from bert_core.finetune.data import subsample

    vocab = sha256(str(checkpoint / "vocab.txt"))[:16]
    accelerator = os.environ.get(ACCELERATOR_VARIABLE, "cpu")
    ckpt_key = {"search": "v2", "arm": arm, "weights": weights_digest(checkpoint), "vocab": vocab}
    if accelerator != "cpu":
        ckpt_key["accelerator"] = accelerator
    encodings = {} if encodings is None else encodings
    jobs = []
    for size in sizes:
        for k in range(subsamples):
            if (vocab, task.name, size, k) not in encodings:
                encodings[vocab, task.name, size, k] = encoded(
                    str(checkpoint), {"train": subsample(parts["train"], size, task.name, k), "dev": parts["dev"]},
                    task.labels, 64)
            data, pad = encodings[vocab, task.name, size, k]
            for number in settings or range(1, len(GRID) + 1):
                setting = GRID[number - 1]
                key = ckpt_key | {"task": task.name, "size": str(size), "subsample": k, "seed": 1 + k,
                                  "setting": setting, "split": "dev"}
                jobs.append((key, finetune, (str(checkpoint), data, "dev", len(task.labels), setting, 1 + k, pad)))
    return jobs


def run_jobs(cache, work_list: list, jobs: int) -> list:
    """Each job's value, from ``cache`` or computed by ``jobs`` processes, one started as another
    ends (``cache.run_cached``)."""

    print(f"{sum(cache.lookup(key) is None for key, _, _ in work_list)} of {len(work_list)} jobs to run "
          f"({jobs} at a time)", flush=True)
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        return run_cached(cache, pool, work_list, "choice", in_flight=max(1, jobs))


def evaluate(work: Path, checkpoints: Path, plan: dict, samples: Path, jobs: int, output: Path,
             sizes: list[int], subsamples: int, choose: Path | None = None, settings: list[int] | None = None) -> dict:
    """The choice on dev: every run of every candidate and every B (a random init per
    corpus and seed of the runs) fine-tuned at every size x subsample x setting of the grid
    (:func:`every_setting_jobs`, all of them in one queue for ``jobs`` processes; finished jobs
    are read from the cache under ``work/search-v2``, so a second call resumes); a candidate's gain in a cell is the mean of its runs and
    subsamples minus the same mean of its corpus's B. Writes every score to ``output`` and, with
    ``choose``, the choice (``choice.choose``)."""
    from benchmarks.quality import choice as qc
    from benchmarks.quality.finetune import ACCELERATOR_VARIABLE

    names = [n for n in CANDIDATES_V2 if n in plan["steps"]]
    runs = run_folders(checkpoints, names)
    if not runs:
        raise SystemExit(f"{checkpoints}: no checkpoint of a version-2 candidate (folders <recipe>-seed<S>)")
    seeds = sorted({seed for found in runs.values() for seed, _ in found})
    arms: dict[str, dict] = {}
    for corpus in sorted({plan["corpus"][n] for n in runs}):
        for seed in seeds:
            folder = random_init_v2(work, corpus, plan["vocabs"][corpus], seed)
            arms[f"B-{corpus}-seed{seed}"] = {"arm": "B", "corpus": corpus, "seed": seed, "checkpoint": folder}
    for name, found in runs.items():
        for seed, folder in found:
            log = folder / "pretrain-log.json"
            arms[folder.name] = {"arm": name, "corpus": plan["corpus"][name], "seed": seed, "checkpoint": folder,
                                 "pretrain": {k: v for k, v in json.loads(log.read_text()).items() if k != "log"}
                                 if log.exists() else None}
    cache = Cache(work / "search-v2" / "cache", reuse=True)
    tasks = {name: qt.load(task, samples) for name, task in qt.TASKS.items()}
    encodings: dict = {}
    work_list, owners = [], []
    for label, arm in arms.items():
        for task_name, parts in tasks.items():
            found = every_setting_jobs(label, arm["checkpoint"], qt.TASKS[task_name], parts, sizes, subsamples,
                                       settings, encodings)
            work_list += found
            owners += [label] * len(found)
    order = sorted(range(len(work_list)), key=lambda i: -int(work_list[i][0]["size"]))  # the longest jobs first
    work_list, owners = [work_list[i] for i in order], [owners[i] for i in order]
    values = run_jobs(cache, work_list, jobs)
    for (key, _, _), label, value in zip(work_list, owners, values, strict=True):
        c = qc.cell(key["task"], key["size"], GRID.index(key["setting"]) + 1)
        arms[label].setdefault("dev_macro_f1", {}).setdefault(c, []).append(value["macro_f1"])
    for label, arm in arms.items():
        scores = arm["dev_macro_f1"]
        print(f"  {label}: dev macro-F1 {statistics.fmean(v for s in scores.values() for v in s):.1f} "
              f"(mean of {len(scores)} cells)", flush=True)
    pooled: dict[str, dict[str, list[float]]] = {}
    for arm in arms.values():
        key = f"B-{arm['corpus']}" if arm["arm"] == "B" else arm["arm"]
        for c, cell_scores in arm["dev_macro_f1"].items():
            pooled.setdefault(key, {}).setdefault(c, []).extend(cell_scores)
    gains = {n: qc.gains(pooled[n], pooled[f"B-{plan['corpus'][n]}"]) for n in names if n in runs}
    numbers = settings or list(range(1, len(GRID) + 1))
    expected = [c for c in qc.cells(list(tasks), tuple(str(s) for s in sizes), len(GRID))
                if int(c.rsplit("/", 1)[1]) in numbers]
    choice = qc.choose(gains, plan["corpus"], expected)
    choice["not_run"] = [n for n in names if n not in runs]
    choice["runs"] = {n: [seed for seed, _ in runs[n]] for n in runs}
    result = {"what": "version 2's recipe choice: each candidate's dev macro-F1 at every size x subsample x "
                      "setting, its gain per cell over random init with its corpus's vocab, and the choice",
              "sizes": [str(s) for s in sizes], "subsamples": subsamples, "grid": GRID, "settings": numbers,
              "accelerator": os.environ.get(ACCELERATOR_VARIABLE, "cpu"), "plan": plan,
              "arms": {label: {k: str(v) if k == "checkpoint" else v for k, v in arm.items()}
                       for label, arm in arms.items()},
              "choice": choice}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    if choose:
        qc.write_choice(choice, choose)
    for row in choice["candidates"]:
        print(f"{row['name']:<10} {row['corpus']}  {len(choice['runs'][row['name']])} run(s)  "
              f"minimum gain {row['minimum']:+.1f}  mean gain {row['mean']:+.1f}")
    if choice["not_run"]:
        print(f"not run: {', '.join(choice['not_run'])}")
    print(f"chosen: {choice['name']} (corpus {choice['corpus']})" + (f"; written to {choose}" if choose else ""))
    return result


def numbers(flag: str, text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} {text}: give integers, comma-separated") from None


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import samples as default_samples

    parser = argparse.ArgumentParser(prog="benchmarks.quality", description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=["prepare", "pretrain", "evaluate"])
    parser.add_argument("--work", default="/work/quality-runs", help="the test phase's --work")
    parser.add_argument("--samples", default=None, help="the samples folder")
    parser.add_argument("--chosen-steps", type=int, default=14533, help="the protocol's 60-minute step count")
    parser.add_argument("--corpus", default="k1,k2", help="prepare: only the candidates on these")
    parser.add_argument("--recipes", default="v2", help="pretrain: a version's candidates or recipe names")
    parser.add_argument("--seeds", default="42", help="pretrain: each recipe once per seed")
    parser.add_argument("--keep", default=None, help="pretrain: the runs' folder (<recipe>-seed<S> in it)")
    parser.add_argument("--scale", type=float, default=1.0, help="pretrain: a share of each step count (dry run)")
    parser.add_argument("--checkpoints", default=None, help="evaluate: the folder of the runs")
    parser.add_argument("--jobs", type=int, default=1, help="evaluate: fine-tuning jobs at a time (processes)")
    parser.add_argument("--sizes", default="300,1000", help="evaluate: label counts")
    parser.add_argument("--settings", default=None, help="evaluate: only these grid settings, numbered 1-8 (dry run)")
    parser.add_argument("--subsamples", type=int, default=3, help="evaluate: subsamples a size")
    parser.add_argument("--choose", default=None, help="evaluate: write the choice here")
    parser.add_argument("--output", default=str(ROOT / "bench-results" / "quality-v2-search.json"),
                        help="evaluate: every score")
    args = parser.parse_args(argv)
    work = Path(args.work)
    samples = Path(args.samples) if args.samples else default_samples()
    if args.step == "prepare":
        print(json.dumps(prepare(work, samples, args.chosen_steps, [c.strip() for c in args.corpus.split(",")]),
                         indent=1))
        return 0
    if args.step == "pretrain":
        if not args.keep:
            raise SystemExit("pretrain needs --keep, the folder its runs go to")
        return pretrain_all(work, Path(args.keep), recipe_names(args.recipes), numbers("--seeds", args.seeds),
                            args.scale)
    if not args.checkpoints:
        raise SystemExit("evaluate needs --checkpoints, the folder of the runs")
    settings = numbers("--settings", args.settings) if args.settings else None
    if settings and not all(1 <= n <= len(GRID) for n in settings):
        raise SystemExit(f"--settings {args.settings}: the grid's settings are numbered 1 to {len(GRID)}")
    evaluate(work, Path(args.checkpoints), read_plan(work), samples, args.jobs, Path(args.output),
             numbers("--sizes", args.sizes), args.subsamples, Path(args.choose) if args.choose else None, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
