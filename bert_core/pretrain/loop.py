"""BERT pre-training (masked LM + next sentence) on a DeepSpeed engine: one process per rank.

    deepspeed --num_gpus 2 --module bert_core.pretrain.loop --config RUN/pretrain_config.json \
        --instances INSTANCES_URI --output RUN
    (``bertpipe pretrain`` and ``bert_core.pretrain.launch`` render this command; you rarely type it)

Every phase of ``config.pretrain.phases`` runs in turn, in the same processes:

- the model is ``BertForPreTraining`` (vocab size from the instances' vocab), built with the
  same seed on every rank; phase 1 may start from ``--init-checkpoint`` (transformers layout);
  phase 2+ starts from the previous phase's weights with a fresh optimizer and schedule, as
  NVIDIA's BERT recipe does;
- a phase resumes from its latest checkpoint (``RUN/checkpoints/phase{i}/step{N}``): weights,
  optimizer, LR schedule and the loader position (``client_state``), so the resumed run sees
  the same batches in the same order; dropout is reseeded from (seed, phase, step, rank), so a
  resumed run computes the same losses as an uninterrupted one;
- every ``checkpoint_every`` steps all ranks call ``save_checkpoint`` (ZeRO shards are per rank);
- rank 0 appends ``RUN/metrics.jsonl`` every ``log_every`` steps: phase, step, loss, mlm_acc,
  nsp_acc (means over all ranks), lr, seq_per_s, tokens_per_s (non-padding), mfu (with
  ``peak_flops_per_rank``);
- every ``eval_every`` steps and at the end of each phase all ranks evaluate the whole eval split
  of the phase's length (``seq{L}/eval/``, ``bert_core.pretrain.evaluate``): rank 0 appends a
  ``"kind": "eval"`` row (masked LM / NSP loss and accuracy) and writes ``Eval/*`` events to
  the DeepSpeed monitor; instances without an eval split train without evaluation;
- at the end rank 0 exports ``RUN/hf/`` (transformers layout) and writes ``RUN/_MANIFEST.json``
  (with each phase's final eval).

A config or data problem exits with code 2 after a line starting with ``bertpipe-config-error:``
so the launcher can tell it from an infrastructure failure (see ``bert_core/pretrain/launch.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bert_core import storage
from bert_core.config import ConfigError, PipelineConfig, validate
from bert_core.pretrain.metrics import MetricsLog, eval_rows, read_metrics, train_rows

CONFIG_ERROR_EXIT = 2
CONFIG_ERROR_PREFIX = "bertpipe-config-error:"
CONFIG_FILE = "pretrain_config.json"


class PretrainConfigError(ConfigError):
    """The run cannot start with this config/data (not an infrastructure failure)."""


# --------------------------------------------------------------------------- run folder


def checkpoint_dir(run: str, phase_index: int) -> str:
    return storage.join(run, "checkpoints", f"phase{phase_index + 1}")


def latest_step(run: str, phase_index: int) -> int | None:
    """The step of a phase's latest checkpoint (DeepSpeed's ``latest`` file names the tag)."""
    latest = storage.join(checkpoint_dir(run, phase_index), "latest")
    if not storage.exists(latest):
        return None
    return int(storage.read_text(latest).strip().removeprefix("step"))


def total_steps(config: PipelineConfig) -> int:
    return sum(p.max_steps for p in config.pretrain.phases)


def steps_done(config: PipelineConfig, rows: list[dict[str, Any]]) -> int:
    """Optimizer steps finished over all phases, from the last metrics row."""
    if not rows:
        return 0
    last = rows[-1]
    return sum(p.max_steps for p in config.pretrain.phases[: last["phase"] - 1]) + last["step"]


# --------------------------------------------------------------------------- setup


def load_run_config(uri: str) -> PipelineConfig:
    return validate(json.loads(storage.read_text(uri)), source=uri)


def model_config(config: PipelineConfig, vocab_size: int, init_checkpoint: str | None = None):  # -> ModelConfig
    """The encoder's shape: the init checkpoint's own config.json if given, else ``config.model``
    with the instances' vocab size."""
    if init_checkpoint:
        from bert_core.model.checkpoint import model_config_from_hf

        source = storage.join(init_checkpoint, "config.json")
        cfg = model_config_from_hf(json.loads(storage.read_text(source)), source=source)
        if (cfg.vocab_size or 0) < vocab_size:
            raise PretrainConfigError(
                f"{source}: vocab_size={cfg.vocab_size} but the instances' vocab has {vocab_size} "
                "tokens; start from a checkpoint trained with this vocab"
            )
        return cfg
    if config.model.vocab_size is not None and config.model.vocab_size < vocab_size:
        raise PretrainConfigError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the instances' vocab "
            f"({vocab_size} tokens); leave model.vocab_size unset"
        )
    return config.model.model_copy(update={"vocab_size": config.model.vocab_size or vocab_size})


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def _dropout_seed(seed: int, phase: int, step: int, rank: int, micro: int) -> int:
    # Reseeding per micro-batch makes dropout a function of the position in training, not of
    # the process's history, so a resumed run draws the same dropout masks.
    return hash((seed, phase, step, rank, micro)) & 0x7FFF_FFFF


# --------------------------------------------------------------------------- one phase


def run_phase(
    config: PipelineConfig, instances: str, run: str, phase_index: int, vocab_size: int,
    init_checkpoint: str | None, rank: int, world_size: int,
) -> dict[str, Any]:
    """Train one phase to its ``max_steps`` (resuming if it has checkpoints); returns its stats."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from bert_core.model.bert import BertForPreTraining, flops_per_token
    from bert_core.model.weight_decay import param_groups
    from bert_core.pretrain.data import PretrainingLoader
    from bert_core.pretrain.ds_config import client_optimizer, ds_config, uses_client_optimizer
    from bert_core.pretrain.evaluate import EvalSplit, eval_folder, evaluate

    pre = config.pretrain
    phase = pre.phases[phase_index]
    ckpt = checkpoint_dir(run, phase_index)
    mcfg = model_config(config, vocab_size, init_checkpoint)

    torch.manual_seed(pre.seed)  # same initial weights on every rank
    if phase_index == 0 and init_checkpoint:
        model = BertForPreTraining.from_pretrained(init_checkpoint)
    else:
        model = BertForPreTraining(mcfg)
    groups = param_groups(model, pre.weight_decay)
    optimizer = client_optimizer(pre, phase, groups) if uses_client_optimizer(pre) else None
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=groups, optimizer=optimizer,
        config=ds_config(pre, phase_index, run),
    )
    loader = PretrainingLoader(
        instances, phase.max_seq_length, phase.micro_batch_size, rank=rank, world_size=world_size,
        seed=pre.seed + phase_index, workers=pre.loader_workers, vocab_file=config.vocab.vocab_file,
    )
    metrics = MetricsLog(run) if rank == 0 else None
    eval_split = EvalSplit.open(
        instances, phase.max_seq_length, phase.micro_batch_size, rank=rank, world_size=world_size,
        seed=pre.seed, vocab_file=config.vocab.vocab_file, lockstep=pre.zero_stage == 3,
    )
    if eval_split is None:
        _log(rank, f"phase {phase_index + 1}: no eval split ({eval_folder(instances, phase.max_seq_length)} "
                   "has no manifest); training without evaluation")
    else:
        _log(rank, f"phase {phase_index + 1}: evaluating on {eval_split.num_rows} instances of "
                   f"{eval_split.folder} every {pre.eval_every or phase.max_steps} steps and at the end")

    step = 0
    if latest_step(run, phase_index) is not None:
        _, client = engine.load_checkpoint(ckpt)
        step = int(client["step"])
        loader.load_state_dict(client["loader"])
        if metrics:
            metrics.truncate(phase_index + 1, step)
        _log(rank, f"phase {phase_index + 1}: resumed at step {step} from {ckpt} "
                   f"(loader epoch {loader.epoch}, position {loader.position})")
    elif phase_index > 0:
        # Weights only: the optimizer state and LR schedule start fresh for the new length.
        engine.load_checkpoint(checkpoint_dir(run, phase_index - 1), load_module_only=True,
                               load_optimizer_states=False, load_lr_scheduler_states=False)
        _log(rank, f"phase {phase_index + 1}: starting from phase {phase_index}'s weights")
    if step == 0:
        # DeepSpeed's WarmupLR starts at iteration -1 and its first step() gives iteration 0,
        # so the first two updates would both run at warmup_min_lr; one step() here makes
        # update k use iteration k-1 (0, peak/W, 2 peak/W, ...), as transformers' schedule does.
        scheduler.step()
        if metrics:
            metrics.truncate(phase_index + 1, 0)

    accumulation = engine.gradient_accumulation_steps()
    batches = iter(loader)
    first_loss = last_loss = None
    engine.train()
    while step < phase.max_steps:
        t0 = time.perf_counter()
        lr = float(scheduler.get_last_lr()[0])  # the rate this step's update uses
        # loss, mlm_acc, nsp_acc, micro-batches, sequences, real tokens
        sums = torch.zeros(6, dtype=torch.float64)
        for micro in range(accumulation):
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in next(batches).items()}
            torch.manual_seed(_dropout_seed(pre.seed, phase_index, step, rank, micro))
            out = engine(**batch)
            engine.backward(out["loss"])
            engine.step()
            mask = batch["attention_mask"]
            sums += torch.tensor([out["loss"].item(), out["mlm_acc"].item(), out["nsp_acc"].item(), 1,
                                  mask.shape[0], mask.sum().item()], dtype=torch.float64)
        dist.all_reduce(sums)  # means over all ranks; throughput summed over all ranks
        step += 1
        seconds = time.perf_counter() - t0
        loss = sums[0].item() / sums[3].item()
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        if step % pre.log_every == 0 or step == phase.max_steps or step == 1:
            tokens_per_s = sums[5].item() / seconds
            # The encoder runs on the real tokens only, so MFU counts useful FLOPs of real tokens.
            mean_len = sums[5].item() / sums[4].item()
            row = {
                "kind": "train", "phase": phase_index + 1, "step": step, "max_steps": phase.max_steps,
                "loss": loss, "mlm_acc": sums[1].item() / sums[3].item(),
                "nsp_acc": sums[2].item() / sums[3].item(), "lr": lr,
                "seq_per_s": sums[4].item() / seconds, "tokens_per_s": tokens_per_s,
                "mfu": (flops_per_token(mcfg, round(mean_len)) * tokens_per_s
                        / (pre.peak_flops_per_rank * world_size)) if pre.peak_flops_per_rank else None,
                "epoch": loader.epoch, "time": time.time(),
            }
            if metrics:
                metrics.append(row)
            _log(rank, f"phase {phase_index + 1} step {step}/{phase.max_steps} loss {loss:.4f} "
                       f"mlm_acc {row['mlm_acc']:.3f} nsp_acc {row['nsp_acc']:.3f} lr {row['lr']:.2e} "
                       f"{row['seq_per_s']:.1f} seq/s {tokens_per_s:.0f} tok/s")
        if eval_split is not None and (step == phase.max_steps or (pre.eval_every and step % pre.eval_every == 0)):
            # Before the checkpoint: a resume from it keeps this row and never evaluates again.
            result = evaluate(engine, eval_split)
            row = {"kind": "eval", "phase": phase_index + 1, "step": step, "max_steps": phase.max_steps,
                   **result, "time": time.time()}
            if metrics:
                metrics.append(row)
            if engine.monitor.enabled:  # writes on rank 0 only
                engine.monitor.write_events([(f"Eval/{k}", row[k], engine.global_samples)
                                             for k in ("loss", "mlm_loss", "mlm_acc", "nsp_loss", "nsp_acc")])
            _log(rank, f"phase {phase_index + 1} step {step}/{phase.max_steps} eval loss {row['loss']:.4f} "
                       f"mlm_acc {row['mlm_acc']:.3f} nsp_acc {row['nsp_acc']:.3f} "
                       f"({row['instances']} instances, {row['seconds']:.1f} s)")
        if step % pre.checkpoint_every == 0 or step == phase.max_steps:
            # All ranks save: with ZeRO each holds its own optimizer shard.
            engine.save_checkpoint(ckpt, tag=f"step{step}",
                                   client_state={"step": step, "loader": loader.state_dict(),
                                                 "phase": phase_index + 1})
    return {"engine": engine, "first_loss": first_loss, "last_loss": last_loss, "steps": step,
            "sequences": step * phase.global_batch_size}


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bert_core.pretrain", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="PipelineConfig JSON (launch writes RUN/pretrain_config.json).")
    p.add_argument("--instances", required=True, help="Instances folder (with seq{L}/ and _MANIFEST.json).")
    p.add_argument("--output", required=True, help="Run folder.")
    p.add_argument("--init-checkpoint", default=None, help="Transformers-layout folder for phase 1's weights.")
    p.add_argument("--local_rank", type=int, default=0, help="Set by the deepspeed launcher.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bert_core.model.checkpoint import CheckpointError
    from bert_core.pretrain.data import InstanceDataError, read_vocab, vocab_file_of

    try:
        config = load_run_config(args.config)
        pre = config.pretrain
        if not storage.is_local(args.output):
            raise PretrainConfigError(
                f"--output {args.output}: DeepSpeed writes checkpoints with torch.save to a local "
                "path; use a local or mounted (e.g. gcsfuse, NFS) folder shared by the nodes"
            )
        vocab_file = vocab_file_of(args.instances, fallback=config.vocab.vocab_file)
        vocab_size = len(read_vocab(vocab_file))
        model_config(config, vocab_size, args.init_checkpoint)
    except (ConfigError, CheckpointError, InstanceDataError, storage.UnfinishedWriteError,
            FileNotFoundError) as err:
        print(f"{CONFIG_ERROR_PREFIX} {err}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    if storage.has_manifest(args.output):
        print(f"{args.output}: finished already ({storage.MANIFEST} present)", flush=True)
        return 0

    import torch

    if pre.accelerator == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(pre.threads_per_rank)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo" if pre.accelerator == "cpu" else "nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != pre.world_size:
        print(f"{CONFIG_ERROR_PREFIX} the launcher started {world_size} ranks but pretrain.nodes x "
              f"procs_per_node = {pre.world_size}; launch with the config's sizes", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT

    stats = []
    engine = None
    try:
        for i, phase in enumerate(pre.phases):
            if latest_step(args.output, i) == phase.max_steps and i < len(pre.phases) - 1:
                _log(rank, f"phase {i + 1}: finished already (step {phase.max_steps})")
                stats.append(_phase_stats_from_metrics(args.output, i, phase.global_batch_size))
                continue
            result = run_phase(config, args.instances, args.output, i, vocab_size,
                               args.init_checkpoint, rank, world_size)
            engine = result.pop("engine")
            stats.append(result | _phase_stats_from_metrics(args.output, i, phase.global_batch_size,
                                                            prefer=result))
    except (ConfigError, CheckpointError, InstanceDataError) as err:
        print(f"{CONFIG_ERROR_PREFIX} {err}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT

    if rank == 0:
        export(config, args, engine.module, vocab_file, stats)
    dist.barrier()
    return 0


def _phase_stats_from_metrics(run: str, phase_index: int, global_batch: int,
                              prefer: dict[str, Any] | None = None) -> dict[str, Any]:
    """First/last logged loss of a phase (its first step may have run before a resume) and its
    final eval (the eval row at the phase's last step), if it has one."""
    all_rows = [r for r in read_metrics(run) if r.get("phase") == phase_index + 1]
    rows = train_rows(all_rows)
    out: dict[str, Any] = {"phase": phase_index + 1}
    if rows:
        out |= {"first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"], "steps": rows[-1]["step"],
                "sequences": rows[-1]["step"] * global_batch}
    elif prefer:
        out |= {k: prefer[k] for k in ("first_loss", "last_loss", "steps", "sequences")}
    final = [r for r in eval_rows(all_rows) if r["step"] == r.get("max_steps")]
    if final:
        out["eval"] = {k: final[-1][k] for k in ("step", "loss", "mlm_loss", "mlm_acc", "nsp_loss",
                                                 "nsp_acc", "instances")}
    return out


def export(config: PipelineConfig, args: argparse.Namespace, model: Any, vocab_file: str,
           stats: list[dict[str, Any]]) -> None:
    """``RUN/hf/`` in the transformers layout, then the run manifest (written last)."""
    from bert_core.model.checkpoint import save_pretrained

    hf = storage.join(args.output, "hf")
    save_pretrained(model, hf, vocab_file=vocab_file, lowercase=config.vocab.lowercase)
    shards = [storage.shard_entry(storage.join(hf, name)) for name in ("config.json", "model.safetensors")]
    storage.write_manifest(
        args.output, stage="pretrain", config=config,
        inputs=[storage.read_manifest(args.instances)], shards=shards,
        counts={"phases": len(stats), "steps": sum(s.get("steps", 0) for s in stats),
                "sequences": sum(s.get("sequences", 0) for s in stats)},
        stats={"phases": stats, "first_loss": stats[0].get("first_loss"),
               "last_loss": stats[-1].get("last_loss"), "eval": stats[-1].get("eval")},
        hf=hf, init_checkpoint=args.init_checkpoint,
    )
    print(f"exported {hf} and wrote {storage.join(args.output, storage.MANIFEST)}", flush=True)

