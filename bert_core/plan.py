"""What a run will do and what it will cost, before it starts: for each stage, whether its version
folder is finished (cached) or will run, what it reads and writes, and an estimate.

    bertpipe plan --preset demo
    bertpipe plan --preset bert-base-128 --assume-size 'wikipedia/*.xml.bz2=24GB' --workers 32
    bertpipe run --preset demo --dry-run

Estimates multiply the work a config asks for by costs the benchmarks measured, held in one table
each with its machine, date and benchmark row (:data:`DATA_COSTS`, :data:`CPU_TRAIN_RATES`,
:data:`GPU_MFU`): a data stage costs a fixed start-up plus CPU-seconds per MB of its input, spread
over its workers; pre-training costs its FLOPs (``flops_per_token``) at the CPU rate of the train
step benchmark and at the MFU the GPU check measured. Planning reads manifests and file sizes and
writes nothing.

A stage's version needs the manifests of the stages before it (flows/versions.py), so a stage
after one that will run has an unknown version until then. Inputs that are not here yet (a dump
still to download) are given by size (``--assume-size GLOB=SIZE``); the corpus version is then
unknown too, since it hashes the files themselves.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from bert_core import storage
from bert_core.config import ConfigError, PipelineConfig
from bert_core.corpus.inputs import expand_inputs, local_workers_for, text_bytes

CACHED, WILL_RUN = "cached", "will run"

# --------------------------------------------------------------------------- measured costs

DATA_MACHINE = "2-core AMD EPYC VM (AVX2), Python 3.11, 2026-12-06 (docs/benchmarks.md)"


@dataclass(frozen=True)
class StageCost:
    """One Beam stage on the local runner: a fixed start-up, then CPU-seconds per MB of input."""

    startup_s: float  # wall seconds of a one-worker run on an input of a few pages
    startup_cpu_s: float
    worker_startup_s: float  # wall seconds more when the job starts worker processes
    worker_startup_cpu_s: float  # CPU-seconds each worker process adds
    cpu_s_per_mb: float  # beyond start-up, one worker
    multi_worker_cpu: float  # CPU per MB with worker processes / with one (the runner's gRPC)
    rows: str  # the benchmark rows these come from


# Every stage's worker_startup_s, worker_startup_cpu_s and multi_worker_cpu are bench_clean's of
# 2026-11-23/24 (2.28 s, 1.155 CPU-s, 9.81 / 7.08): its two runs of 2026-12-06 gave 1.23 and 0.90
# for the CPU per MB with two workers against one, too far apart on the busy VM to replace them.
DATA_COSTS: dict[str, StageCost] = {
    # bench_clean, 2026-12-06, the quieter of two runs: "start-up: a 1-page dump, ours 1
    # worker(s)" (1.66 s, 1.64 CPU-s) and "CPU throughput beyond start-up, distinct, 1 worker(s)"
    # (10.02 MB of XML per CPU-second; 9.86 in the other run).
    "corpus": StageCost(1.66, 1.64, 2.28, 1.155, 1 / 10.02, 9.81 / 7.08,
                        "bench_clean: start-up of a 1-page dump; CPU throughput beyond start-up, distinct"),
    # bench_scale (2026-11-23/24): vocab CPU-seconds 10.1 -> 127 from x1 to x30 (7.2 -> 216 MB of
    # text); its start-up is the job skeleton's, as measured by bench_clean.
    "vocab": StageCost(1.66, 1.64, 2.28, 1.155, (127 - 10.1) / (216 - 7.2), 1.0,
                       "bench_scale: vocab CPU-s x1 -> x30; start-up from bench_clean"),
    # bench_instances, 2026-12-06, medians of three runs: "start-up CPU time (20 documents)" 1.72
    # and "MB of text per CPU-second beyond start-up (44 MB distinct text)" 8.98, at dupe_factor
    # 2, one process.
    "instances": StageCost(1.72, 1.72, 2.28, 1.155, 1 / 8.98, 9.81 / 7.08,
                           "bench_instances: start-up CPU time (20 documents); MB of text per CPU-second "
                           "beyond start-up, dupe_factor 2"),
}
# Of the instance stage's CPU beyond start-up at dupe_factor 2, the share that grows with the
# passes over the corpus (pairs, masking, assembling and writing instances, 1.8 of about 4.9
# CPU-s on the 44 MB); the rest (reading, tokenizing) is paid once (docs/benchmarks.md).
INSTANCES_DUPE_SHARE, INSTANCES_BENCH_DUPE = 0.37, 2
# Characters of clean text per byte of (uncompressed) input, by source: the corpus stage on the
# samples (the enwiki excerpt's XML, botchan.txt, tweets.jsonl), 2026-11-28, same VM. Used for the
# later stages' input until the corpus manifest counts the real characters.
TEXT_PER_INPUT_BYTE = {"wikipedia": 0.42, "books": 0.90, "text": 0.91}

# bench_train_step, one thread, 30,522-token vocab, seq 128: real tokens per CPU-second
# (tiny L2/H128: summary table, 2026-11-23/24; base L12/H768: 2026-11-27, docs/benchmarks.md).
CPU_TRAIN_MACHINE = DATA_MACHINE.replace("2026-12-06", "2026-11-23/24 and 2026-11-27")
CPU_TRAIN_RATES: dict[str, float] = {"tiny": 3796.0, "base": 109.7}
CPU_TRAIN_SEQ, CPU_TRAIN_VOCAB = 128, 30522

# The GPU check's end-to-end runs (bertpipe's launcher, BERT-base, bf16 ZeRO-1, micro-batch 128,
# seq 128): MFU of each run (docs/results/gpu_check-h200-2026-11-26*.jsonl). Empty: not measured.
GPU_MACHINE = "NVIDIA H200, 2026-11-26 (docs/results/gpu_check-h200-2026-11-26*.jsonl, e2e)"
GPU_MFU: tuple[float, ...] = (0.1337, 0.1674)
GPU_PEAK_CARD = "H200"  # whose peak FLOP/s the MFU is a share of, unless peak_flops_per_rank is set
# Real tokens per sequence slot of the instances (bench_instances: mean length 113.2 of 128).
MEAN_FILL = 113.2 / 128


# --------------------------------------------------------------------------- inputs


class Assumed(NamedTuple):
    """An input glob's total size, given instead of read (its files are not here)."""

    pattern: str
    size: int


_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_assumed(text: str) -> Assumed:
    """``GLOB=SIZE`` (``'wikipedia/*.xml.bz2=24GB'``, sizes in B, KB, MB, GB, TB or KiB...)."""
    pattern, eq, amount = text.rpartition("=")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", amount)
    if not eq or not pattern or not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"--assume-size {text!r}: give GLOB=SIZE, the glob as the config names "
                          "it and a size such as 24GB or 700MB (units B, KB, MB, GB, TB, KiB, MiB, GiB)")
    return Assumed(pattern, int(float(m.group(1)) * _UNITS[m.group(2).upper()]))


def corpus_inputs(config: PipelineConfig, assumed: list[Assumed] = (),
                  declared: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Each input glob of the corpus stage: its source, files, bytes and bytes of text (compressed
    files by their ratio), read from the files or taken from ``assumed``. A glob that matches
    nothing is ``missing``: its size is the one ``declared`` for it (``assumed`` then), else 0."""
    from bert_core.corpus.inputs import InputError

    given = {a.pattern: a.size for a in assumed}
    patterns = {p for source in TEXT_PER_INPUT_BYTE for p in getattr(config.corpus, source)}
    unused = sorted(set(given) - patterns)
    if unused:
        raise ConfigError(f"--assume-size {unused[0]}: no corpus input of the config is that glob; "
                          f"its inputs: {', '.join(sorted(patterns)) or 'none'}")
    rows = []
    for source in TEXT_PER_INPUT_BYTE:
        for pattern in getattr(config.corpus, source):
            if pattern in given:
                size = given[pattern]
                rows.append({"source": source, "pattern": pattern, "files": None, "bytes": size,
                             "text_bytes": text_bytes(pattern, size), "assumed": True})
                continue
            try:
                files = expand_inputs([pattern], source)
            except InputError:
                size = (declared or {}).get(pattern)
                rows.append({"source": source, "pattern": pattern, "files": 0, "bytes": size or 0,
                             "text_bytes": text_bytes(pattern, size or 0), "assumed": size is not None,
                             "missing": True})
                continue
            sizes = [storage.size(f) for f in files]
            rows.append({"source": source, "pattern": pattern, "files": len(files), "bytes": sum(sizes),
                         "text_bytes": sum(text_bytes(f, s) for f, s in zip(files, sizes, strict=True)),
                         "assumed": False})
    return rows


# --------------------------------------------------------------------------- estimates


def data_estimate(stage: str, mb: float, workers: int, *, passes: float = 1.0) -> dict[str, Any]:
    """CPU-hours and wall hours of one Beam stage on ``mb`` MB of input with ``workers`` worker
    processes; ``passes``: the instance stage's dupe_factor over the benchmark's."""
    cost = DATA_COSTS[stage]
    per_mb = cost.cpu_s_per_mb
    if stage == "instances":
        per_mb *= 1 - INSTANCES_DUPE_SHARE + INSTANCES_DUPE_SHARE * passes
    many = workers > 1
    work_cpu = mb * per_mb * (cost.multi_worker_cpu if many else 1.0)
    cpu = cost.startup_cpu_s + (cost.worker_startup_cpu_s * workers if many else 0.0) + work_cpu
    wall = cost.startup_s + (cost.worker_startup_s if many else 0.0) + work_cpu / workers
    return {"input_mb": round(mb, 3), "workers": workers, "cpu_hours": cpu / 3600, "wall_hours": wall / 3600,
            "measured_on": DATA_MACHINE, "from": cost.rows}


def pretrain_estimate(config: PipelineConfig, vocab_size: int) -> dict[str, Any]:
    """Sequences, tokens, steps and FLOPs of every phase, with CPU-hours at the train step
    benchmark's rate and GPU-hours at the GPU check's MFU."""
    from bert_core.device import peak_flops_of
    from bert_core.model.bert import flops_per_token

    model = config.model.for_vocab(vocab_size)
    pre = config.pretrain
    phases, flops, tokens = [], 0.0, 0
    for p in pre.phases:
        sequences = p.max_steps * p.global_batch_size
        real = sequences * p.max_seq_length * MEAN_FILL
        f = real * flops_per_token(model, p.max_seq_length, config.instances.masked_lm_prob)
        phases.append({"max_seq_length": p.max_seq_length, "steps": p.max_steps,
                       "global_batch_size": p.global_batch_size, "sequences": sequences,
                       "tokens": round(real), "flops": f})
        flops += f
        tokens += round(real)
    out: dict[str, Any] = {"phases": phases, "steps": sum(p.max_steps for p in pre.phases),
                           "tokens": tokens, "flops": flops, "ranks": pre.world_size,
                           "accelerator": pre.accelerator}
    # CPU: the FLOP rate of the benchmark row of this size, else of the nearest size measured
    near = config.model.size if config.model.size in CPU_TRAIN_RATES else min(
        CPU_TRAIN_RATES, key=lambda s: abs(math.log(_size_flops(s) / flops_per_token(model, CPU_TRAIN_SEQ))))
    rate = CPU_TRAIN_RATES[near] * _size_flops(near)
    cpu_hours = flops / rate / 3600
    out["cpu"] = {"cpu_hours": cpu_hours, "wall_hours": cpu_hours / pre.world_size,
                  "rate_of": f"bench_train_step {near}", "measured_on": CPU_TRAIN_MACHINE}
    if not GPU_MFU:
        out["gpu"] = {"gpu_hours": None, "note": "unknown until the GPU check has run"}
        return out
    peak = pre.peak_flops_per_rank or peak_flops_of(GPU_PEAK_CARD, pre.precision)
    hours = [flops / (mfu * peak) / 3600 for mfu in sorted(GPU_MFU, reverse=True)]
    out["gpu"] = {"gpu_hours": hours, "wall_hours": [h / pre.world_size for h in hours],
                  "mfu": sorted(GPU_MFU), "peak_flops_per_gpu": peak, "measured_on": GPU_MACHINE,
                  "note": "MFU measured for BERT-base at seq 128 in bf16; other shapes may differ"}
    return out


def _size_flops(size: str) -> float:
    from bert_core.config import ModelConfig
    from bert_core.model.bert import flops_per_token

    return flops_per_token(ModelConfig(size=size, vocab_size=CPU_TRAIN_VOCAB), CPU_TRAIN_SEQ)


# --------------------------------------------------------------------------- the plan


class Folders(NamedTuple):
    """How versions are computed and finished work is recognised (flows/versions.py's rules)."""

    corpus: Callable[[PipelineConfig], str]
    vocab: Callable[[PipelineConfig, str], str]
    instances: Callable[[PipelineConfig, str, str], str]
    pretrain: Callable[[PipelineConfig, str, str], str]
    done: Callable[[str], bool]


def _stage(name: str, output: str | None, done: bool, inputs: list[str], estimate: dict[str, Any],
           note: str = "") -> dict[str, Any]:
    version = output.rstrip("/").rsplit("/", 1)[-1] if output else None
    return {"stage": name, "status": CACHED if done else WILL_RUN, "version": version, "output": output,
            "inputs": inputs, "estimate": estimate, "note": note}


def build_plan(config: PipelineConfig, folders: Folders, workers: int | None = None,
               assumed: list[Assumed] = (), declared: dict[str, int] | None = None) -> dict[str, Any]:
    """Every stage of ``bertpipe run`` for ``config``: status, version, output, inputs, estimate;
    ``declared``: the expected size of an input glob that matches nothing yet."""
    workers = workers or config.workers
    local = config.beam_runner in ("FnApiRunner", "local")
    inputs = corpus_inputs(config, assumed, declared)
    total_text = sum(r["text_bytes"] for r in inputs)
    stages = []
    unknown = "version unknown until {} has run"

    # corpus
    absent = any(r["assumed"] or r.get("missing") for r in inputs)
    corpus = None if absent else folders.corpus(config)
    corpus_done = corpus is not None and folders.done(corpus)
    n = local_workers_for(workers, total_text) if local else workers
    stages.append(_stage("corpus", corpus, corpus_done, [r["pattern"] for r in inputs],
                         data_estimate("corpus", total_text / 1e6, n),
                         "" if corpus else "version unknown: inputs not here, their sizes assumed"))

    # the later stages read the corpus's text: counted by its manifest, else estimated by source
    if corpus_done:
        chars, counted = storage.read_manifest(corpus)["counts"].get("chars", 0), True
    else:
        chars = sum(r["text_bytes"] * TEXT_PER_INPUT_BYTE[r["source"]] for r in inputs)
        counted = False
    text_note = "" if counted else f"{chars / 1e6:,.1f} MB of text estimated from the inputs"

    vocab = folders.vocab(config, corpus) if corpus_done else None
    vocab_done = vocab is not None and folders.done(vocab)
    vocab_mb = 0.0 if config.vocab.vocab_file else chars / 1e6
    stages.append(_stage("vocab", vocab, vocab_done, [corpus or "corpus/<version>"],
                         data_estimate("vocab", vocab_mb, workers),
                         "; ".join(x for x in (text_note, "" if vocab else unknown.format("corpus")) if x)))

    instances = folders.instances(config, corpus, vocab) if vocab_done else None
    instances_done = instances is not None and folders.done(instances)
    passes = config.instances.dupe_factor / INSTANCES_BENCH_DUPE
    stages.append(_stage("instances", instances, instances_done,
                         [corpus or "corpus/<version>", vocab or "vocab/<version>"],
                         data_estimate("instances", chars / 1e6, workers, passes=passes),
                         "; ".join(x for x in (text_note, "" if instances else unknown.format("vocab")) if x)))

    run = None
    if instances_done:
        run = folders.pretrain(config, instances, vocab)
    vocab_size = config.model.vocab_size or config.vocab.vocab_size
    stages.append(_stage("pretrain", run, run is not None and folders.done(run),
                         [instances or "instances/<version>"], pretrain_estimate(config, vocab_size),
                         "" if run else unknown.format("instances")))

    ft = config.finetune
    checkpoints = 1 + ft.random_init_baseline + len(ft.extra_checkpoints)
    jobs = checkpoints * len(ft.tasks)
    stages.append({"stage": "finetune", "status": WILL_RUN if not (run and folders.done(run)) else "per job",
                   "version": None, "output": storage.join(config.storage_root, "finetune"),
                   "inputs": [(run and storage.join(run, "hf")) or "pretrain/<version>/hf",
                              *ft.extra_checkpoints],
                   "estimate": {"jobs": jobs, "settings_per_job": len(ft.grid()) * len(ft.seeds)},
                   "note": "each job (checkpoint x task) is skipped when its own version is finished"})
    return {"config": config.name, "storage_root": storage.to_uri(config.storage_root),
            "workers": workers, "runner": config.beam_runner, "inputs": inputs, "stages": stages,
            "data_prep": {"cpu_hours": sum(s["estimate"]["cpu_hours"] for s in stages[:3] if s["status"] != CACHED),
                          "wall_hours": sum(s["estimate"]["wall_hours"] for s in stages[:3] if s["status"] != CACHED),
                          "measured_on": DATA_MACHINE}}
