"""One fine-tuning job: a task, a data folder, a checkpoint, one setting and a seed.

    python -m bert_core.finetune.train --task mrpc --data glue_data --checkpoint runs/demo/hf         --output finetune/demo --seed 1 --set learning_rate=3e-5 --set batch_size=32

The FinetuneConfig of a job is a one-point grid (``FinetuneConfig.at``). ``finetune.accelerator``
places the job (``bert_core.device``); the CPU path is the same code with ``cpu`` for the device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from typing import Any

from bert_core import lease, stopping, storage
from bert_core.config import FinetuneConfig
from bert_core.finetune.errors import TaskDataError
from bert_core.model.schedule import linear_warmup_decay
from bert_core.progress import OnProgress, Update


class JobStopped(RuntimeError):
    """The command running this job was stopped (SIGTERM, SIGINT): the job ends at its next step."""


def prepare_task(task_name: str, data_dir: str, tokenizer: Any, cfg: FinetuneConfig) -> Any:
    from bert_core.finetune import get_task, task_dir

    task = get_task(task_name)
    folder = task_dir(data_dir, task)
    if task.kind in ("classification", "regression"):
        from bert_core.finetune import glue

        return glue.prepare(task.name, folder, tokenizer, cfg)
    if task.kind == "span":
        from bert_core.finetune import squad

        return squad.prepare(task.name, folder, tokenizer, cfg)
    if task.kind == "token":
        from bert_core.finetune import ner

        return ner.prepare(folder, tokenizer, cfg, splits=task.splits)
    if task.kind == "multiple_choice":
        from bert_core.finetune import swag

        return swag.prepare(folder, tokenizer, cfg, splits=task.splits)
    raise ValueError(f"task {task.name}: kind {task.kind} is not trained by this loop")


def reinit_top_layers(bert: Any, n: int) -> None:
    """Fresh BERT init for the top ``n`` encoder layers and the pooler (the pre-LN final norm too)."""
    from bert_core.model.bert import init_weights

    if n > len(bert.encoder.layer):
        raise TaskDataError(f"finetune.reinit_layers={n} but the checkpoint has {len(bert.encoder.layer)} "
                            "layers; set it to at most that")
    tops = [*bert.encoder.layer[len(bert.encoder.layer) - n:], bert.pooler, bert.encoder.ln] if n else []
    for module in tops:
        if module is not None:
            init_weights(module, bert.config.initializer_range)


def layer_groups(model: Any, weight_decay: float, learning_rate: float, decay: float) -> list[dict[str, Any]]:
    """The weight-decay groups, split by depth when ``decay`` < 1: the embeddings at depth 0, encoder
    layer i at i + 1, everything above the encoder at L + 1; depth d trains at
    ``learning_rate * decay ** (L + 1 - d)`` (ELECTRA's layer-wise decay)."""
    from bert_core.model.weight_decay import decays, param_groups

    if decay == 1.0:
        return param_groups(model, weight_decay)
    top = len(model.bert.encoder.layer) + 1

    def depth(name: str) -> int:
        if name.startswith("bert.embeddings."):
            return 0
        if name.startswith("bert.encoder.layer."):
            return int(name.split(".")[3]) + 1
        return top

    by_depth: dict[int, list[Any]] = {}
    for name, param in model.named_parameters():
        by_depth.setdefault(depth(name), []).append(param)
    groups = [{"params": [p for p in params if decays(p) == decayed], "lr": learning_rate * decay ** (top - d),
               "weight_decay": weight_decay if decayed else 0.0}
              for d, params in sorted(by_depth.items()) for decayed in (True, False)]
    return [g for g in groups if g["params"]]


def _deepspeed_engine(model: Any, optimizer: Any, scheduler: Any, cfg: FinetuneConfig) -> Any:
    """Wrap the loop's model/optimizer/scheduler in a one-rank DeepSpeed engine (gloo on CPU,
    NCCL on GPU)."""
    import socket

    if cfg.accelerator == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # never CUDA for a CPU job on a GPU machine
    import deepspeed

    from bert_core.device import dist_backend

    if "RANK" not in os.environ:  # launched as a plain process: be rank 0 of 1
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend=dist_backend(cfg.accelerator))
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    return engine


def train_and_predict(
    data: Any, checkpoint: str, cfg: FinetuneConfig, seed: int, pad_id: int, log=None,
    on_progress: OnProgress | None = None, job: str = "training",
) -> dict[str, Any]:
    """Fine-tune all parameters on ``data.train``; return per-split outputs, the trained model (in
    eval mode, on its device) and training stats. ``on_progress`` is told each optimizer step (of the job's, phase ``job``).

    The paper's recipe: all parameters trained, AdamW (no decay on biases and LayerNorm), linear
    warmup over ``warmup_proportion`` of the steps then linear decay to 0, gradient clipping at
    1.0, single process by default; with ``finetune.deepspeed`` the same loop runs in a
    (single-rank) DeepSpeed engine. On ``gpu`` the model sits on ``cuda:<LOCAL_RANK>``, batches are
    pinned and copied there without blocking, AdamW is torch's fused kernel, a DeepSpeed engine
    talks NCCL, and losses stay on the device until the job (or a log line) reads them;
    ``precision: bf16`` runs forward and loss under autocast.
    """
    import torch

    from bert_core.device import configure_matmul, resolve_device
    from bert_core.finetune.data import collate, to_device
    from bert_core.finetune.heads import BertForTask, mask_padding, task_loss
    from bert_core.model.bert import BertModel

    device = resolve_device(cfg.accelerator, int(os.environ.get("LOCAL_RANK", "0")))
    configure_matmul(cfg.precision, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
    torch.manual_seed(seed)
    model = BertForTask(BertModel.from_pretrained(checkpoint), data.kind, data.num_labels, cfg.pooling)
    reinit_top_layers(model.bert, cfg.reinit_layers)
    model = model.to(device)
    steps_per_epoch = math.ceil(len(data.train) / cfg.batch_size)
    total_steps = max(1, math.ceil(steps_per_epoch * cfg.num_train_epochs))
    warmup = int(cfg.warmup_proportion * total_steps)
    optimizer = torch.optim.AdamW(layer_groups(model, cfg.weight_decay, cfg.learning_rate, cfg.layerwise_lr_decay),
                                  lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-6,
                                  fused=True if device.type == "cuda" else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(warmup, total_steps))
    engine = _deepspeed_engine(model, optimizer, scheduler, cfg) if cfg.deepspeed else None
    shuffle = torch.Generator().manual_seed(seed)

    model.train()
    losses: list[Any] = []  # on the device: reading one waits for the GPU, so only log lines do
    step, seen, start = 0, 0, time.perf_counter()
    stopped = threading.Event()
    with stopping.on_stop(stopped.set):
        while step < total_steps:
            order = torch.randperm(len(data.train), generator=shuffle).tolist()
            for i in range(0, len(order), cfg.batch_size):
                if stopped.is_set():  # a stop signal: end here, so the command unwinds at once
                    raise JobStopped(f"{job}: stopped at step {step} of {total_steps}")
                if step >= total_steps:
                    break
                batch = to_device(collate(data.kind, [data.train[j] for j in order[i : i + cfg.batch_size]], pad_id),
                                  device)
                runner = engine if engine is not None else model
                with autocast:
                    logits = runner(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
                    loss = task_loss(data.kind, logits, batch["labels"])
                if engine is not None:
                    engine.backward(loss)
                    engine.step()  # clips, steps the optimizer and the scheduler
                else:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                seen += len(batch["input_ids"])
                step += 1
                if on_progress:
                    on_progress(Update("finetune", job, step, total_steps, "steps"))
                if log and (step % 20 == 0 or step == total_steps):
                    log(f"step {step}/{total_steps} loss {losses[-1].item():.4f}")
    losses = torch.stack(losses).float().tolist() if losses else []
    train_seconds = time.perf_counter() - start  # after the read above, which waits for the device

    model.eval()
    outputs: dict[str, list[Any]] = {}
    eval_start, n_eval = time.perf_counter(), 0
    with torch.no_grad(), autocast:
        for split, feats in data.evals.items():
            outputs[split] = []
            for i in range(0, len(feats), 64):
                chunk = feats[i : i + 64]
                batch = to_device(collate(data.kind, chunk, pad_id), device)
                logits = mask_padding(data.kind, model(batch["input_ids"], batch["token_type_ids"],
                                                       batch["attention_mask"]), batch["attention_mask"])
                for f, row in zip(chunk, logits.float().cpu().numpy(), strict=True):
                    # drop the batch padding: token/span outputs keep only this feature's length
                    outputs[split].append(row[: len(f["input_ids"])] if data.kind in ("token", "span") else row)
                n_eval += len(chunk)
    return {
        "outputs": outputs,
        "model": model,
        "train": {
            "steps": total_steps, "warmup_steps": warmup, "examples_seen": seen,
            "seconds": round(train_seconds, 3), "examples_per_second": round(seen / max(train_seconds, 1e-9), 2),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "mean_loss_last_10": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "eval_examples_per_second": round(n_eval / max(time.perf_counter() - eval_start, 1e-9), 2),
            "deepspeed": bool(cfg.deepspeed),
            "device": str(next(model.parameters()).device), "precision": cfg.precision,
        },
    }


def _write_predictions(job_dir: str, files: dict[str, Any]) -> list[str]:
    written = []
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=2, sort_keys=True)
        storage.write_text(storage.join(job_dir, name), text)
        written.append(name)
    return written


def run_job(
    task: str, data_dir: str, checkpoint: str, cfg: FinetuneConfig, seed: int, output: str, log=None,
    on_progress: OnProgress | None = None, attempt: str | None = None,
) -> dict[str, Any]:
    """Fine-tune + evaluate one (task, setting, seed); ``cfg`` holds one setting. Writes the
    model, predictions and metrics.json; returns the metrics. ``on_progress`` is told the training
    steps, in a phase named by the job (``sst2 lr3e-5-bs32-ep3 seed=2``).

    The files: ``<output>/<task>/<setting>/seed=<seed>/metrics.json`` (``grid.job_dir``), written
    last, the trained model in ``model/`` beside it (``task_model``; a feature-based task saves
    none) and the task's predictions (GLUE ``*_predictions.tsv``, SQuAD ``predictions.json`` +
    ``null_odds.json``, NER ``*_predictions.txt`` in conlleval's input format, SWAG
    ``*_predictions.csv``). ``attempt``: the id of the lease held on the task's folder; the job
    then writes under the attempt's own names (``lease.staging``) and its folder moves into
    place only while the lease is still the attempt's (``lease.publish``).
    """
    import torch

    from bert_core.finetune import get_task
    from bert_core.finetune.grid import Setting
    from bert_core.finetune.grid import job_dir as folder_of

    spec = get_task(task)
    setting = Setting.of(cfg)
    torch.set_num_threads(cfg.threads)
    task_folder, own = storage.join(output, spec.name), f"{setting.name}/seed={seed}"
    job_dir = folder_of(output, spec.name, setting, seed)
    if attempt is not None:
        job_dir = storage.join(lease.staging(task_folder, attempt), own)
    from bert_core.vocab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    if spec.kind == "token_features":
        from bert_core.finetune import bilstm

        result = bilstm.run_feature_based_ner(data_dir, checkpoint, tokenizer, cfg, seed, log=log)
        data, files, split_metrics = result["data"], result["files"], result["metrics"]
        train_stats = result["train"]
    else:
        data = prepare_task(spec.name, data_dir, tokenizer, cfg)
        trained = train_and_predict(data, checkpoint, cfg, seed, tokenizer.pad_id, log=log, on_progress=on_progress,
                                    job=f"{spec.name} {setting.name} seed={seed}")
        split_metrics, files = {}, {}
        for split, outs in trained["outputs"].items():
            m, f = data.finish(split, outs)
            split_metrics[split] = m
            files.update(f)
        train_stats = trained["train"]
    flat = {f"{split}/{k}": v for split, m in split_metrics.items() for k, v in m.items()
            if isinstance(v, (int, float))}
    model_dir = None
    if spec.kind != "token_features":
        from bert_core.finetune.task_model import job_meta, job_model_dir, save_task_model

        model_dir = job_model_dir(job_dir)
        storage.remove(model_dir)  # an earlier attempt's, finished or not
        meta = job_meta(spec.name, cfg, seed)
        threshold = flat.get(f"{spec.splits[0]}/null_score_diff_threshold")  # SQuAD 2.0's, tuned on dev
        if threshold is not None:
            meta["null_score_diff_threshold"] = threshold
        save_task_model(trained["model"], model_dir, task=spec.name, checkpoint=checkpoint, labels=data.labels,
                        max_seq_length=meta["max_seq_length"], meta=meta)
    main_name = f"{spec.splits[0]}/{spec.metric}"
    metrics = {
        "task": spec.name, "setting": setting.as_dict(), "seed": seed,
        "checkpoint": storage.to_uri(checkpoint),
        "data": storage.to_uri(data_dir), "main_metric": main_name, "main": flat.get(main_name),
        "metrics": split_metrics, "flat": flat, "counts": data.counts, "train": train_stats,
        "config": cfg.model_dump(mode="json"),
        "predictions": sorted(files),
        "model": None if model_dir is None else "model",
    }
    _write_predictions(job_dir, files)
    if data.rejects:
        storage.write_text(storage.join(job_dir, "rejects.jsonl"),
                           "".join(json.dumps(r) + "\n" for r in data.rejects))
    storage.write_text(storage.join(job_dir, "metrics.json"), json.dumps(metrics, indent=2, default=float))
    lease.publish(task_folder, attempt, own)  # lost: one line, nothing moved
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="finetune field=value")
    args = parser.parse_args(argv)
    from bert_core.config import load_config

    cfg = load_config(None, None, [f"finetune.{s}" for s in args.set]).finetune
    m = run_job(args.task, args.data, args.checkpoint, cfg, args.seed, args.output, log=print)
    print(json.dumps({"task": m["task"], "setting": m["setting"]["name"], "seed": m["seed"],
                      "main": m["main_metric"], "value": m["main"]}))


if __name__ == "__main__":
    main()
