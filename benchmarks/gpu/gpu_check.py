"""The GPU check: one prepared script for a short slot on one GPU, most important numbers first.

    python -m benchmarks.gpu.gpu_check --out DIR --call 1 --gpu-left-s S   # the slot's first call
    python -m benchmarks.gpu.gpu_check --out DIR --call 2 --gpu-left-s S   # its second
    python -m benchmarks.gpu.gpu_check --out DIR --dry-run --call 1        # the same on CPU, tiny (the test suite)
    make gpu-wheels && make gpu-check CALL=1 GPU_LEFT=S                 # with its wheels installed first

It builds its own input, then runs its stages (:data:`STAGES`, most valuable first), each in its
own process group under a timeout; the slot's two calls (:data:`SLOT_CALLS`) split them. Each stage
and variant appends its JSON line to ``DIR/gpu_check.jsonl`` as it finishes, its output streaming
into ``DIR/gpu_check.log`` (docs/scale-out.md: the stages; docs/benchmarks.md: the slot's plan).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import ROOT, hf_labels, make_pair, process_tree, timed
from bert_core import storage
from bert_core.config import FinetuneConfig, InstanceConfig, ModelConfig, SequenceSpec, load_config
from bert_core.device import peak_flops
from bert_core.finetune.train import run_job
from bert_core.instances.batch import create_instance_batch, write_instance_shards
from bert_core.instances.pairs import DocumentPool
from bert_core.model.bert import flops_per_token
from bert_core.pretrain.data import PretrainingLoader, model_inputs, to_device, vocab_ids
from bert_core.pretrain.ds_config import loop_clipping
from bert_core.pretrain.in_process import random_init
from bert_core.pretrain.launch import free_port, launch_pretraining, stop_group
from bert_core.pretrain.loop import backward_and_step, build_engine
from bert_core.pretrain.metrics import read_metrics, train_rows

STAGES = ("env", "e2e", "numerics", "variants", "e2e_large", "compare", "resume", "finetune")
# Each call has its own budget and reads nothing another wrote: it runs the same on a fresh machine.
SLOT_CALLS = {1: (("env", "e2e", "numerics", "variants"), 420),
              2: (("env", "e2e_large", "compare", "resume", "finetune"), 300)}
TIMEOUTS = {"env": 60, "e2e": 150, "numerics": 60, "variants": 300, "e2e_large": 150, "compare": 120,
            "resume": 120, "finetune": 90}
# Kept from the GPU time left for the last transfer back and the give-back.
SLOT_RESERVE_S = 60
COMMAND_LIMIT_S = 600
RESULTS, LOG = "gpu_check.jsonl", "gpu_check.log"
RESULT_PREFIX = "GPU_CHECK_RESULT "
SEQ = 128
MAX_PREDICTIONS = 20
RAW_KEYS = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions", "masked_lm_ids",
            "masked_lm_weights", "next_sentence_label")
BUCKETS = 8  # the variants' and the presets' token_buckets


class Plan:
    """What each stage runs: BERT-base on a GPU, or a tiny model on CPU for the dry run."""

    def __init__(self, dry_run: bool, precision: str | None = None) -> None:
        self.dry_run = dry_run
        self.accelerator, self.size = ("cpu", "tiny") if dry_run else ("gpu", "base")
        self.precision = precision or ("fp32" if dry_run else "bf16")
        self.steps, self.checkpoint_at, self.log_every = (4, 2, 1) if dry_run else (30, 15, 5)
        # e2e and variants at the micro-batch of the fastest in-process row (one per step on GPU)
        self.micro_batch, self.global_batch = (8, 16) if dry_run else (256, 256)
        # the dry run's e2e_large takes one micro-batch a step (e2e covers gradient accumulation)
        self.large_batch = (4, 4) if dry_run else (128, self.global_batch)  # micro, global
        self.variant_micro_batch = 2 if dry_run else 256  # bf16 matmuls are slow on a CPU
        # warm-up, timed; then one more for the syncs (the dry run: no warm-up, each path once)
        self.variant_steps = (0, 1) if dry_run else (5, 14)
        # the dry run checks the compiled variants' graphs without generating code (minutes on CPU)
        self.compile_backend = "eager" if dry_run else "inductor"
        self.compare_batches = (4, 8) if dry_run else (32, 128, 256)
        self.compare_steps = (0, 1) if dry_run else (3, 10)  # warm-up, timed
        self.documents, self.vocab_size = (60, 2000) if dry_run else (1200, 30522)
        self.loader_workers = 0 if dry_run else 4


def build_data(work: Path, plan: Plan) -> str:
    """A vocab of real fixture words plus filler, documents of Zipf-drawn words, and seq128
    instances made by the instance stage's own code (NSP pairs, masking) in 8 shards."""
    out = work / "instances"
    if storage.has_manifest(str(out)):
        return str(out)
    specials = ["[PAD]", *[f"[unused{i}]" for i in range(99)], "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    fixtures = sorted((ROOT / "tests" / "fixtures" / "tasks").glob("*/*.tsv"))
    cleaned = ("".join(ch for ch in word if ch.isalnum())
               for tsv in fixtures for word in tsv.read_text(encoding="utf-8").lower().split())
    words = [word for word in dict.fromkeys(cleaned) if word]
    filler = [f"w{i}" for i in range(plan.vocab_size - len(specials) - len(words))]  # none when negative
    tokens = specials + words[: plan.vocab_size - len(specials)] + filler
    vocab_dir = work / "vocab"
    vocab_dir.mkdir(parents=True, exist_ok=True)
    (vocab_dir / "vocab.txt").write_text("".join(t + "\n" for t in tokens))
    vocab_manifest = storage.write_manifest(str(vocab_dir), stage="vocab", config={"lowercase": True})
    rng = np.random.default_rng(0)
    first_word = len(specials)
    p = 1.0 / np.arange(1, len(tokens) - first_word + 1)
    p /= p.sum()
    docs = [[(first_word + rng.choice(len(p), size=int(rng.integers(5, 40)), p=p)).tolist()
             for _ in range(int(rng.integers(4, 30)))] for _ in range(plan.documents)]
    spec = SequenceSpec(max_seq_length=SEQ, max_predictions_per_seq=MAX_PREDICTIONS)
    cfg = InstanceConfig(lengths=[spec], dupe_factor=1, num_shards=8)
    batch = create_instance_batch(
        DocumentPool.from_documents(docs), [f"synthetic:{i}" for i in range(len(docs))],
        seed=cfg.seed, dupe_factor=1, max_seq_length=SEQ, max_predictions_per_seq=MAX_PREDICTIONS,
        masked_lm_prob=cfg.masked_lm_prob, short_seq_prob=cfg.short_seq_prob, vocab=vocab_ids(tokens),
    )
    folder = out / f"seq{SEQ}"
    shards = write_instance_shards(batch, str(folder), 8)
    storage.write_manifest(str(folder), stage="instances", config=cfg, shards=shards,
                           counts={"instances": len(batch)})
    storage.write_manifest(str(out), stage="instances", config=cfg, inputs=[vocab_manifest],
                           counts={"instances": len(batch)})
    return str(out)


def pretrain_config(work: Path, plan: Plan, large: bool = False, micro_batch: int | None = None,
                    global_batch: int | None = None, extra: tuple[str, ...] = ()) -> Any:
    """The bert-base-128 preset on one GPU (or CPU), at this check's size (``large``: BERT-large, a
    mini model in the dry run), steps and batch."""
    size = plan.size
    if large:
        size, micro_batch, global_batch = "mini" if plan.dry_run else "large", *plan.large_batch
    phase = {"max_seq_length": SEQ, "max_steps": plan.steps, "global_batch_size": global_batch or plan.global_batch,
             "micro_batch_size": micro_batch or plan.micro_batch, "learning_rate": 1e-4, "warmup_steps": 3}
    sets = [f"model.size={size}", "model.pad_vocab_to_multiple=64",
            f"pretrain.accelerator={plan.accelerator}", "pretrain.nodes=1", "pretrain.procs_per_node=1",
            f"pretrain.precision={plan.precision}", f"pretrain.zero_stage={1 if plan.precision == 'bf16' else 0}",
            f"pretrain.phases=[{json.dumps(phase)}]", f"pretrain.checkpoint_every={plan.checkpoint_at}",
            f"pretrain.log_every={plan.log_every}", "pretrain.eval_every=0", "pretrain.monitor=none",
            f"pretrain.loader_workers={plan.loader_workers}",
            f"pretrain.threads_per_rank={2 if plan.dry_run else 4}", f"storage_root={work}", *extra]
    return load_config("bert-base-128", None, sets)


def first_batch(instances: str, micro_batch: int, token_buckets: int = 0) -> dict[str, Any]:
    return next(iter(PretrainingLoader(instances, SEQ, micro_batch, seed=1, token_buckets=token_buckets)))


def stage_env(work: Path, plan: Plan) -> dict[str, Any]:
    row: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                           "nvcc": shutil.which("nvcc"), "cpus": os.cpu_count()}
    for package in ("deepspeed", "transformers"):
        try:
            row[package] = importlib.import_module(package).__version__
        except Exception as err:  # reported, not fatal: the later stages say what it breaks
            row[package] = f"import failed: {err}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        row |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
                "bf16_supported": torch.cuda.is_bf16_supported()}
    elif not plan.dry_run:
        raise RuntimeError("no CUDA device visible to torch")
    return row


def stage_e2e(work: Path, plan: Plan, large: bool = False) -> dict[str, Any]:
    """Pre-train BERT-base through the real launcher, or with ``large`` BERT-large (stage e2e_large).
    Rates: real tokens over the wall time between logged steps after the first (warm-up),
    checkpoint saves reported apart."""
    config, run = pretrain_config(work, plan, large), work / ("run-large" if large else "run")
    instances = build_data(work, plan)
    shutil.rmtree(run, ignore_errors=True)
    _, wall = timed(lambda: launch_pretraining(config, instances, str(run), on_line=print), time.perf_counter)
    rows = train_rows(read_metrics(str(run)))
    steady = [r for r in rows if r["step"] > rows[0]["step"]] or rows[-1:]
    phase = config.pretrain.phases[0]
    return {"model": config.model.size, "precision": config.pretrain.precision,
            "zero_stage": config.pretrain.zero_stage, "micro_batch": phase.micro_batch_size,
            "global_batch": phase.global_batch_size, "steps": rows[-1]["step"], "wall_s": round(wall, 1),
            "tokens_per_s": round(statistics.fmean(r["tokens_per_s"] for r in steady)),
            "seq_per_s": round(statistics.fmean(r["seq_per_s"] for r in steady), 1),
            "mfu": round(statistics.fmean(r["mfu"] for r in steady), 4) if steady[0].get("mfu") else None,
            "checkpoint_seconds": round(sum(r.get("checkpoint_seconds", 0.0) for r in rows), 2),
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
            "checkpoints": sorted(p.name for p in (run / "checkpoints" / "phase1").glob("step*")),
            "exported": (run / "hf" / "model.safetensors").exists(), "losses": {r["step"]: r["loss"] for r in rows}}


def stage_e2e_large(work: Path, plan: Plan) -> dict[str, Any]:
    """BERT-large (NVIDIA's published figure is for it); ``resume`` and ``finetune`` read its run."""
    return stage_e2e(work, plan, large=True)


# Each variant is the one before it plus one change: product settings, or a DeepSpeed section
# set over the rendered config (None drops that override again). The baseline is how the product
# trained before these changes, its stored q/k/v matrix aside. Eager variants run before the first
# compile, whose failure could leave the device unusable; the compiled ones run on static shapes.
VARIANTS: tuple[tuple[str, tuple[str, ...], dict[str, Any]], ...] = (
    ("baseline", ("model.attention_probs_dropout_prob=0.1", "pretrain.zero_stage=1"),
     {"timers": {"throughput": {"enabled": True, "synchronized": True}}}),
    ("timers_off", (), {"timers": None}),
    ("attention_dropout_0", ("model.attention_probs_dropout_prob=0",), {}),
    ("immediate_grad_update", (), {"bf16": {"enabled": True, "immediate_grad_update": True}}),
    ("autocast_zero0", ("pretrain.zero_stage=0",), {"bf16": None}),
    ("static_shapes", ("pretrain.token_buckets=8",), {}),
    ("compile", ("pretrain.compile=true",), {}),
    ("cuda_graphs", ("pretrain.compile_mode=reduce-overhead",), {}),
    ("chunked_mlm_loss", ("pretrain.mlm_loss_chunk=1024",), {}),  # 6 chunks of the 6,144 rows at 256
)
KERNEL_CLASSES = (("attention", ("flash", "fmha", "attention", "sdpa", "varlen")),
                  ("matmul", ("gemm", "mm", "matmul", "cutlass", "xmma", "linear")))


def profile_shares(step, device, steps: int) -> dict[str, float]:
    """Shares of the steps' wall time: matmuls, attention, other (element-wise) kernels, idle."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    busy = {"matmul": 0.0, "attention": 0.0, "elementwise": 0.0}
    for e in prof.key_averages():
        spent = e.self_device_time_total if cuda else (e.self_cpu_time_total if e.key.startswith("aten::") else 0)
        if spent > 0:
            kind = next((k for k, words in KERNEL_CLASSES if any(w in e.key.lower() for w in words)), "elementwise")
            busy[kind] += spent
    shares = {k: round(v / wall_us, 3) for k, v in busy.items()}
    shares["idle"] = round(max(0.0, 1 - sum(busy.values()) / wall_us), 3)
    return shares


def host_syncs(step, device) -> int | None:
    """Runs one step: its host synchronizations per torch's sync debug mode (None off CUDA)."""
    if device.type != "cuda":
        step()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def training_step(engine: Any, batch: dict[str, Any], losses: list[Any], max_norm: float = 0.0) -> Any:
    """One optimizer step of ``engine`` on ``batch`` as the loop takes it (dropout reseeded per step,
    the loop's own clipping), each step's loss kept in ``losses`` on the device (no host wait)."""
    def step() -> None:
        torch.manual_seed(len(losses))
        out = engine(**batch)
        # A copy now: under CUDA graphs the loss is a view of the graph's output buffer, which
        # the next replay overwrites.
        losses.append(out["loss"].detach().clone())
        backward_and_step(engine, out["loss"], max_norm)

    return step


def time_steps(step, steps: tuple[int, int], device, cfg, tokens: int, micro: int,
               peak: float | None) -> dict[str, Any]:
    """Rates of ``step`` (``tokens`` real tokens in ``micro`` sequences) over the timed steps of
    ``steps`` (warm-up, timed): tokens per second, step time, MFU and the device's peak memory."""
    warmup, counted = steps
    for _ in range(warmup):
        step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(counted):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / counted
    return {"tokens_per_s": round(tokens / seconds), "step_ms": round(seconds * 1e3, 2),
            "mfu": round(flops_per_token(cfg, round(tokens / micro)) * tokens / seconds / peak, 4) if peak else None,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}


def run_variant(work: Path, plan: Plan, instances: str, sets: tuple[str, ...], ds: dict[str, Any]) -> dict[str, Any]:
    """The product's engine (``build_engine``) on the loader's first batch for ``variant_steps``."""
    micro = plan.variant_micro_batch  # one micro-batch an optimizer step
    config = pretrain_config(work, plan, micro_batch=micro, global_batch=micro, extra=(
        "pretrain.precision=bf16", f"pretrain.compile_backend={plan.compile_backend}", *sets))
    pre = config.pretrain
    torch._dynamo.reset()  # each variant compiles its own model, within dynamo's cache limit
    if plan.dry_run:
        # the engine build's six gc.collect() calls (0.25 CPU-s each) skip the heap frozen here
        gc.freeze()
    engine, scheduler = build_engine(config, 0, plan.vocab_size, ds_overrides=ds)
    device = engine.device
    batch = to_device(first_batch(instances, micro, pre.token_buckets), device)
    real_tokens = int(batch["attention_mask"].sum())
    scheduler.step()
    losses: list[Any] = []
    step = training_step(engine, batch, losses, loop_clipping(pre))
    peak = peak_flops(device, "bf16", pre.peak_flops_per_rank)
    rates = time_steps(step, plan.variant_steps, device, engine.module.config, real_tokens, micro, peak)
    syncs = host_syncs(step, device)  # the step whose loss is reported
    last = len(losses) - 1
    shares = profile_shares(step, device, 1 if plan.dry_run else 3)
    row = {
        **rates, "loss_at_step": [last + 1, float(losses[last])], "host_syncs_per_step": syncs,
        "profile": shares, "real_tokens": real_tokens, "shape": list(batch["input_ids"].shape),
        "rows": int(batch["token_index"].numel()),
    }
    engine.destroy()
    torch.cuda.empty_cache()  # a no-op where CUDA never started
    return row


def stage_variants(work: Path, plan: Plan, out: Path) -> dict[str, Any]:
    import deepspeed

    instances = build_data(work, plan)
    # this process as rank 0 of a world of 1, as the engine expects
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    sets, ds = (), {}
    rows = []
    for name, more_sets, more_ds in VARIANTS:
        sets, ds = sets + more_sets, ds | more_ds
        try:
            row = run_variant(work, plan, instances, sets, {k: v for k, v in ds.items() if v is not None})
        except Exception as err:  # one variant failing (a kernel, a compile) leaves the others
            row = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
        rows.append({"variant": name, **row})
        append_row(out, {"stage": "variants", "variant": name, "ok": "error" not in row, "dry_run": plan.dry_run,
                         "time": time.time(), "result": row})
        print(f"variant {name}: {row}", flush=True)
    base = rows[0]
    for row in rows:
        if "tokens_per_s" in row and "tokens_per_s" in base:  # both ran
            row["loss_diff_vs_baseline"] = round(abs(row["loss_at_step"][1] - base["loss_at_step"][1]), 5)
            row["speedup_vs_baseline"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
    return {"micro_batch": plan.variant_micro_batch, "steps": sum(plan.variant_steps) + 1, "rows": rows}


def _compare_one(plan: Plan, instances: str, vocab_size: int, micro: int,
                 attention_dropout: float | None) -> dict[str, Any]:
    """Ours against transformers' BertForPreTraining (SDPA), the same weights and batch, on the device."""
    cfg, ours, ref, attn = make_pair(plan.size, vocab_size, attention_dropout=attention_dropout)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ours, ref = ours.to(device), ref.to(device)
    batch = to_device(first_batch(instances, micro), device)
    hf_inputs = {key: batch[key] for key in ("input_ids", "token_type_ids", "attention_mask", "next_sentence_label")}
    hf_inputs["labels"] = hf_labels(batch)
    fused = device.type == "cuda"
    out: dict[str, Any] = {"micro_batch": micro, "reference_attention": attn,
                           "attention_dropout": cfg.attention_probs_dropout_prob}
    tokens = batch["token_index"].numel()
    peak = peak_flops(device, plan.precision)
    for name, model, call in (("ours", ours, lambda: ours(**batch)["loss"]),
                              ("reference", ref, lambda: ref(**hf_inputs).loss)):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, eps=1e-6, fused=fused)

        def step(model=model, call=call, opt=opt) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=plan.precision == "bf16"):
                loss = call()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        rates = time_steps(step, plan.compare_steps, device, cfg, tokens, micro, peak)
        out |= {f"{name}_{key}": value for key, value in rates.items()}
        model.to("cpu")
        del opt
        torch.cuda.empty_cache()
    out["ratio"] = round(out["ours_tokens_per_s"] / out["reference_tokens_per_s"], 3)
    out["real_tokens"], out["padded_shape"] = tokens, list(batch["input_ids"].shape)
    return out


def stage_compare(work: Path, plan: Plan) -> dict[str, Any]:
    instances = build_data(work, plan)
    vocab_size = -(-plan.vocab_size // 64) * 64  # both models get the GPU presets' padded rows
    rows = [_compare_one(plan, instances, vocab_size, micro, None) for micro in plan.compare_batches]
    middle = plan.compare_batches[len(plan.compare_batches) // 2]
    rows.append(_compare_one(plan, instances, vocab_size, middle, 0.0))
    best = max(rows, key=lambda r: r["ours_tokens_per_s"])
    return {"rows": rows, "best_micro_batch": best["micro_batch"], "best_mfu": best["ours_mfu"],
            "best_ratio": best["ratio"]}


def _loss_and_grad_norm(model, batch) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch)["loss"]
    loss.backward()
    norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(norm)


def stage_numerics(work: Path, plan: Plan) -> dict[str, Any]:
    instances = build_data(work, plan)
    batch = first_batch(instances, 8 if plan.dry_run else 32)
    cfg = ModelConfig(size=plan.size, vocab_size=plan.vocab_size, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, pad_vocab_to_multiple=64).for_vocab(plan.vocab_size)
    cpu_model = random_init(cfg, seed=0)
    row: dict[str, Any] = {"batch": list(batch["input_ids"].shape), "padded": batch["padded"]}
    row["cpu_fp32"] = _loss_and_grad_norm(cpu_model, batch)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = copy.deepcopy(cpu_model).to(device)
    dev_batch = to_device(batch, device)
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default; the later runs are in bf16
    torch.backends.cudnn.allow_tf32 = False
    row["device_fp32"] = _loss_and_grad_norm(model, dev_batch)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        row["device_bf16_autocast"] = _loss_and_grad_norm(model, dev_batch)
    bf16 = copy.deepcopy(cpu_model).to(device, dtype=torch.bfloat16)  # as DeepSpeed's bf16 holds it
    row["device_bf16_weights"] = _loss_and_grad_norm(bf16, dev_batch)
    ref = row["cpu_fp32"]
    row["fp32_loss_diff"] = abs(row["device_fp32"][0] - ref[0])
    row["fp32_grad_norm_rel_diff"] = abs(row["device_fp32"][1] - ref[1]) / ref[1]
    row["bf16_loss_diff"] = abs(row["device_bf16_autocast"][0] - row["device_fp32"][0])
    row["bf16_weights_loss_diff"] = abs(row["device_bf16_weights"][0] - row["device_fp32"][0])
    row["fp32_within_1e-4"] = row["fp32_loss_diff"] <= 1e-4
    row["bf16_within_1e-2"] = row["bf16_loss_diff"] <= 1e-2
    row["attention_kernels"] = attention_kernels(bf16, dev_batch, device)
    del model
    row["buckets"] = bucket_numerics(bf16, batch, device)
    row["buckets_within_1e-2"] = all(b["loss_rel_diff"] <= 1e-2 and b["grad_norm_rel_diff"] <= 1e-2
                                     for b in row["buckets"])
    return row


def fill_bucket(batch: dict[str, Any], token_buckets: int) -> tuple[dict[str, Any], int]:
    """``batch`` with padding turned into real tokens, row by row, up to a whole token bucket, and
    the bucket count that bucket is of: ``token_buckets``, or the next count whose bucket the batch
    can fill and still be padded (a batch in the top bucket would have none left). Bucketed with
    that count it has no padding positions, and every extra ``cu_seqlens`` entry is empty."""
    mask = batch["attention_mask"].clone()
    B, T = mask.shape
    n_real = int(mask.sum())
    buckets = token_buckets
    while True:
        size = -(-B * T // buckets)
        target = -(-n_real // size) * size
        if target < B * T or size == 1:
            break
        buckets += 1
    free = (mask == 0).reshape(-1).nonzero().squeeze(1)[:target - n_real]  # flat positions to fill
    mask.view(-1)[free] = 1
    # segment B, a word of the vocab: past every masked position, so the predictions stay as they are
    return dict(batch, attention_mask=mask,
                token_type_ids=batch["token_type_ids"].reshape(-1).index_fill(0, free, 1).view(B, T),
                input_ids=batch["input_ids"].reshape(-1).index_fill(0, free, 1000).view(B, T)), buckets


def bucket_numerics(model: Any, batch: dict[str, Any], device: Any) -> list[dict[str, Any]]:
    """Loss and gradient norm of a token-bucketed batch against the exact batch, eagerly (``model``:
    bf16 on the device), for the loader's batch and one whose extra ``cu_seqlens`` entries are all
    empty: the packed attention (varlen) sees these zero-length sequences here, before any compile."""
    raw = {k: batch[k] for k in RAW_KEYS}
    rows = []
    for name, (inputs, buckets) in (("loader", (raw, BUCKETS)), ("extra_entries_empty", fill_bucket(raw, BUCKETS))):
        host = {k: v.numpy() for k, v in inputs.items()}
        exact, bucketed = model_inputs(host), model_inputs(host, buckets)
        B = inputs["input_ids"].shape[0]
        cu = bucketed["cu_seqlens"]
        empty = int((cu[B + 1:] == cu[B:-1]).sum())
        want = _loss_and_grad_norm(model, to_device(exact, device))
        got = _loss_and_grad_norm(model, to_device(bucketed, device))
        rows.append({"batch": name, "token_buckets": buckets, "real_tokens": int(inputs["attention_mask"].sum()),
                     "bucket_rows": int(bucketed["token_index"].numel()), "empty_extra_entries": empty,
                     "extra_entries": int(cu.numel()) - B - 1, "exact": want, "bucketed": got,
                     "loss_rel_diff": abs(got[0] - want[0]) / abs(want[0]),
                     "grad_norm_rel_diff": abs(got[1] - want[1]) / want[1]})
    return rows


def attention_kernels(model, batch, device) -> list[str]:
    """Names of the attention kernels one forward pass ran (the profiler's device events)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        model(**batch)
    names = {e.key for e in prof.key_averages()}
    keys = ("flash", "fmha", "efficient", "attention", "varlen", "sdpa")
    return sorted(n[:90] for n in names if any(k in n.lower() for k in keys))


def stage_resume(work: Path, plan: Plan) -> dict[str, Any]:
    source = work / "run-large"
    if not (source / "_MANIFEST.json").exists():
        raise RuntimeError(f"{source}: stage e2e_large did not finish; nothing to resume")
    run = work / "run-resumed"
    shutil.rmtree(run, ignore_errors=True)
    later = [f"step{step}" for step in range(plan.checkpoint_at + 1, plan.steps + 1)]  # checkpoints after it
    shutil.copytree(source, run, ignore=shutil.ignore_patterns("hf", "_MANIFEST.json", *later))
    (run / "checkpoints" / "phase1" / "latest").write_text(f"step{plan.checkpoint_at}")
    lines: list[str] = []
    launch_pretraining(pretrain_config(work, plan, large=True), str(work / "instances"), str(run),
                       on_line=lambda line: (lines.append(line), print(line)))
    original = {r["step"]: r["loss"] for r in train_rows(read_metrics(str(source)))}
    resumed = {r["step"]: r["loss"] for r in train_rows(read_metrics(str(run))) if r["step"] > plan.checkpoint_at}
    diffs = {s: abs(resumed[s] - original[s]) for s in resumed if s in original}
    return {"resumed_line": next((line for line in lines if "resumed at step" in line), None),
            "skipped": [line for line in lines if "skipped" in line],
            "steps_compared": sorted(diffs), "max_loss_diff": max(diffs.values()) if diffs else None,
            "within_2e-2": bool(diffs) and max(diffs.values()) <= 2e-2,
            "exported": (run / "hf" / "model.safetensors").exists()}


def stage_finetune(work: Path, plan: Plan) -> dict[str, Any]:
    checkpoint = work / "run-large" / "hf"
    if not (checkpoint / "model.safetensors").exists():
        raise RuntimeError(f"{checkpoint}: stage e2e_large did not export a model")
    cfg = FinetuneConfig(tasks=["sst2"], learning_rates=[5e-5], batch_sizes=[16], epochs=[3.0],
                         accelerator=plan.accelerator, precision=plan.precision, threads=4)
    metrics, wall = timed(lambda: run_job("sst2", str(ROOT / "tests" / "fixtures" / "tasks"), str(checkpoint),
                                          cfg, 1, str(work / "finetune"), log=print), time.perf_counter)
    return {"task": "sst2", "wall_s": round(wall, 1), "main_metric": metrics["main_metric"],
            "score": metrics["main"], "train": metrics["train"], "counts": metrics["counts"]}


def summary(stage: str, row: dict[str, Any]) -> str:
    if not row.get("ok"):
        return f"[{stage}] FAILED ({row.get('seconds', 0):.0f} s): {row.get('error', '')[:300]}"
    r = row["result"]
    text = {
        "env": lambda: f"{r.get('gpu', 'cpu')} {r.get('gpu_memory_gib', '')} GiB, torch {r['torch']} "
                       f"CUDA {r['cuda']}, DeepSpeed {r['deepspeed']}, nvcc {'yes' if r['nvcc'] else 'no'}",
        "e2e": lambda: f"{r['model']} mb {r['micro_batch']}: {r['steps']} steps, {r['tokens_per_s']} tok/s, "
                       f"MFU {r['mfu']}, checkpoints {r['checkpoint_seconds']} s, "
                       f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}",
        "variants": lambda: "; ".join(f"{x['variant']} " + (f"{x['tokens_per_s']} tok/s MFU {x['mfu']} "
                                      f"syncs {x['host_syncs_per_step']} loss {x['loss_at_step'][1]:.3f}"
                                      if "tokens_per_s" in x else f"FAILED {x['error'][:80]}")
                                      for x in r["rows"]),
        "compare": lambda: "; ".join(f"mb {x['micro_batch']} (attn dropout {x['attention_dropout']}): ours "
                                     f"{x['ours_tokens_per_s']} tok/s MFU {x['ours_mfu']} vs ref "
                                     f"{x['reference_tokens_per_s']} = {x['ratio']}x" for x in r["rows"]),
        "numerics": lambda: f"fp32 diff {r['fp32_loss_diff']:.2e}, bf16 diff {r['bf16_loss_diff']:.2e}, "
                            "buckets against exact: " + ", ".join(
                                f"{b['batch']} loss {b['loss_rel_diff']:.1e} grad {b['grad_norm_rel_diff']:.1e}"
                                for b in r["buckets"]) + f"; kernels {r['attention_kernels'][:3]}",
        "resume": lambda: f"skipped {len(r['skipped'])}, max loss diff {r['max_loss_diff']}",
        "finetune": lambda: f"{r['task']} {r['main_metric']} {r['score']}, {r['train']}",
    }[stage.removesuffix("_large")]  # e2e_large's line reads as e2e's
    return f"[{stage}] ok ({row['seconds']:.0f} s): {text()}"


def append_row(out: Path, row: dict[str, Any]) -> None:
    """One JSON line onto ``OUT/gpu_check.jsonl``, on disk before this returns."""
    with open(out / RESULTS, "a") as f:
        print(json.dumps(row, default=str), file=f, flush=True)
        os.fsync(f.fileno())


def stop_process_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End a stage: its process group (SIGTERM, so that the stage stops its launcher, and SIGKILL
    after ``grace`` seconds), then the group of every process that was below it (the launcher
    starts its ranks in process groups of their own)."""
    groups = set()
    for p in process_tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(p.pid))
    stop_group(proc, grace)
    for group in groups - {os.getpgid(0)}:  # never this driver's own group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def start_stage(stage: str, work: Path, out: Path, plan: Plan) -> subprocess.Popen:
    """The stage's process, in a process group of its own, its output on a pipe."""
    argv = [sys.executable, "-m", "benchmarks.gpu.gpu_check", "--stage", stage, "--work", str(work),
            "--out", str(out), "--precision", plan.precision] + (["--dry-run"] if plan.dry_run else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, process_group=0)


def run_stage(stage: str, work: Path, out: Path, plan: Plan, timeout: float) -> dict[str, Any]:
    """One stage's row, its output streamed into ``OUT/gpu_check.log``; past ``timeout``, or when
    this process is stopped, the stage and everything it started are stopped."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"stage": stage, "dry_run": plan.dry_run, "time": time.time()}
    lines: list[str] = []
    with open(out / LOG, "a") as log, start_stage(stage, work, out, plan) as proc:
        print(f"===== {stage} (timeout {timeout:.0f} s)", file=log, flush=True)

        def pump() -> None:
            for line in proc.stdout:
                print(line, end="", file=log, flush=True)
                lines.append(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_process_tree(proc)
            code = None
        except BaseException:  # this call is being stopped: nothing of it runs on into the next
            stop_process_tree(proc, grace=3)
            raise
        reader.join(30)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    results = [line.removeprefix(RESULT_PREFIX) for line in lines if line.startswith(RESULT_PREFIX)]
    if code == 0 and results:
        row |= {"ok": True, "result": json.loads(results[-1])}
    else:
        why = f"timed out after {timeout:.0f} s" if code is None else f"exit {code}"
        tail = [line for line in lines if line.strip() and not line.startswith(RESULT_PREFIX)][-12:]
        row |= {"ok": False, "error": f"{why}: " + " | ".join(tail)}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", required=True, help="Folder for gpu_check.jsonl and gpu_check.log.")
    p.add_argument("--work", help="Scratch folder (data, runs); default OUT/../gpu-check-work.")
    p.add_argument("--dry-run", action="store_true", help="Every stage on CPU with a tiny model.")
    p.add_argument("--call", type=int, choices=sorted(SLOT_CALLS),
                   help="The slot's call: its stages and budget (docs/benchmarks.md, the slot's plan).")
    p.add_argument("--stages", help=f"Comma-separated stages to run, in order, of {', '.join(STAGES)} "
                                    "(default: the call's, else all).")
    p.add_argument("--gpu-left-s", type=float, help=f"The slot's GPU time left (the device tool's "
                   f"budget_left_s); the call keeps {SLOT_RESERVE_S} s of it for the transfer back.")
    p.add_argument("--budget-s", type=float, help="Seconds this call may take (default: the call's).")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="Default: bf16 on GPU, fp32 in the dry run.")
    p.add_argument("--stage", help=argparse.SUPPRESS)  # the child process's one stage
    args = p.parse_args(argv)
    plan = Plan(args.dry_run, args.precision)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else out.parent / "gpu-check-work"
    work.mkdir(parents=True, exist_ok=True)
    # Stopped (SIGTERM), a stage raises SystemExit, so the launcher's own cleanup runs (run_launch),
    # and the call stops its stage too, keeping the rows written so far.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.stage:  # the child process: one stage, its result as the last line (or its traceback, exit 1)
        function = globals()[f"stage_{args.stage}"]
        result = function(work, plan, out) if args.stage == "variants" else function(work, plan)
        print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
        return 0
    if plan.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    start = time.perf_counter()
    stages = ([s.strip() for s in args.stages.split(",") if s.strip()] if args.stages
              else list(SLOT_CALLS[args.call][0] if args.call else STAGES))
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        print(f"gpu_check: unknown stage(s) {unknown}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    # --budget-s, else the call's share of the slot; never more than the GPU time left less the
    # reserve, nor (on a GPU) the command limit less a margin
    budget = args.budget_s if args.budget_s is not None else (
        SLOT_CALLS[args.call][1] if args.call else COMMAND_LIMIT_S - 60)
    if args.gpu_left_s is not None:
        budget = min(budget, args.gpu_left_s - SLOT_RESERVE_S)
    if not plan.dry_run:
        budget = min(budget, COMMAND_LIMIT_S - 30)

    def say(line: str) -> None:
        print(line, flush=True)
        with open(out / LOG, "a") as log:
            log.write(line + "\n")

    say(f"[plan] {','.join(stages)} within {budget:.0f} s")
    build_data(work, plan)
    say(f"[data] {work / 'instances'} ready ({time.perf_counter() - start:.0f} s)")
    failed = 0
    for stage in stages:
        left = budget - (time.perf_counter() - start)
        if left < 20:
            row = {"stage": stage, "ok": False, "error": f"skipped: {budget:.0f} s budget spent"}
        else:
            row = run_stage(stage, work, out, plan, min(TIMEOUTS[stage] * (3 if plan.dry_run else 1), left))
        failed += not row["ok"]
        append_row(out, row)
        say(summary(stage, row) if "seconds" in row else f"[{stage}] {row['error']}")
    say(f"[done] {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
