"""BERT pre-training (masked LM + next sentence) on a DeepSpeed engine: the script each rank runs.

    deepspeed --num_gpus 2 --module bert_core.pretrain --config RUN/pretrain_config.json         --instances INSTANCES_URI --output RUN
    (``bertpipe pretrain`` starts the same ranks: ``bert_core.pretrain.launch``)

Every phase of ``config.pretrain.phases`` runs in turn in the same processes (:func:`run_phase`).
Rank 0 writes ``RUN/metrics.jsonl``, then ``RUN/hf/`` and ``RUN/_MANIFEST.json``. A problem a
retry cannot fix exits the rank with one ``bertpipe-config-error:`` line and code 2
(``errors.py``), which the launcher reads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from bert_core import lease, storage
from bert_core.config import PipelineConfig
from bert_core.failures import InfrastructureError, is_comm_error, refusal
from bert_core.pretrain.checkpoint_mirror import CheckpointMirror, restore_run
from bert_core.pretrain.checkpoints import (
    fp32_master_model,
    resume,
    save_checkpoint,
    start_from_phase_before,
)
from bert_core.pretrain.errors import (
    CONFIG_ERROR_EXIT,
    CONFIG_ERROR_PREFIX,
    PretrainConfigError,
    first_line,
)
from bert_core.pretrain.metrics import MetricsLog, eval_rows, read_metrics, train_rows
from bert_core.pretrain.run_folder import (
    check_init_vocab,
    check_splits,
    checkpoint_dir,
    latest_step,
    load_run_config,
    model_config,
)

# --------------------------------------------------------------------------- setup


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def _dropout_seed(seed: int, phase: int, step: int, rank: int, micro: int) -> int:
    # Reseeding per micro-batch makes dropout a function of the position in training, not of
    # the process's history, so a resumed run draws the same dropout masks.
    return hash((seed, phase, step, rank, micro)) & 0x7FFF_FFFF


def real_tokens(batch: dict[str, Any]) -> int:
    """The real (non-padding) tokens of a loader batch, read on the host: ``cu_seqlens[B]``,
    where a token bucket's padding positions (counted in ``token_index``) come after it."""
    return int(batch["cu_seqlens"][batch["input_ids"].shape[0]])


def backward_and_step(engine: Any, loss: Any, max_norm: float) -> None:
    """``engine.backward`` and ``engine.step`` for one micro-batch; with ``max_norm`` (the loop's
    own clipping, ``ds_config.loop_clipping``) the gradients are clipped at the step's last
    micro-batch, after the backward that all-reduced them and before the optimizer reads them,
    with torch's foreach clipping: the norm and the scale stay on the device."""
    import torch

    engine.backward(loss)
    if max_norm and engine.is_gradient_accumulation_boundary():
        grads = [p for p in engine.module.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)
    engine.step()


# --------------------------------------------------------------------------- one phase


def build_engine(config: PipelineConfig, phase_index: int, vocab_size: int, init_checkpoint: str | None = None,
                 run: str | None = None, ds_overrides: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The phase's model (seeded: the same initial weights on every rank) in a DeepSpeed engine,
    compiled when the config says so. Returns (engine, LR scheduler). ``ds_overrides`` are
    merged into the rendered DeepSpeed config's top level (the GPU check measures with them)."""
    import deepspeed
    import torch

    from bert_core.model.bert import BertForPreTraining
    from bert_core.model.weight_decay import param_groups
    from bert_core.pretrain.ds_config import client_optimizer, ds_config, uses_client_optimizer
    from bert_core.pretrain.in_process import random_init

    pre = config.pretrain
    phase = pre.phases[phase_index]
    if phase_index == 0 and init_checkpoint:
        torch.manual_seed(pre.seed)  # the heads a checkpoint lacks start the same on every rank
        model = BertForPreTraining.from_pretrained(init_checkpoint)
    else:
        model = random_init(model_config(config, vocab_size, init_checkpoint), pre.seed)
    model.mlm_loss_chunk = pre.mlm_loss_chunk
    groups = param_groups(model, pre.weight_decay)
    optimizer = client_optimizer(pre, phase, groups) if uses_client_optimizer(pre) else None
    rendered = ds_config(pre, phase_index, run) | (ds_overrides or {})
    if "activation_checkpointing" in rendered:  # pretrain.deepspeed asks for it: the encoder's layers
        deepspeed.checkpointing.configure(None, deepspeed_config=rendered)
        model.bert.checkpoint_fn = deepspeed.checkpointing.checkpoint
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=groups, optimizer=optimizer, config=rendered)
    if pre.compile:
        # Without token buckets every batch has its own shapes (padded length, real tokens,
        # masked positions), so the graph is compiled for dynamic shapes.
        kwargs = {"dynamic": not pre.token_buckets}
        if pre.compile_backend == "inductor":  # the modes are inductor's
            kwargs["mode"] = pre.compile_mode
        engine.compile(backend=pre.compile_backend, compile_kwargs=kwargs)
    return engine, scheduler


def run_phase(
    config: PipelineConfig, instances: str, run: str, phase_index: int, vocab_size: int,
    init_checkpoint: str | None, rank: int, world_size: int, mirror: CheckpointMirror | None = None,
) -> dict[str, Any]:
    """Train one phase to its ``max_steps`` (resuming if it has checkpoints); returns its stats.

    Phase 1 may start from ``--init-checkpoint``, a later phase from the weights of the one before,
    with a fresh optimizer and schedule. A phase resumes from its newest checkpoint that loads
    (``checkpoints.py``) with the loader's position, and dropout is reseeded from the position in
    training, so a resumed run computes the losses of an uninterrupted one. Rank 0 appends a
    train row every ``log_every`` steps and an eval row every ``eval_every`` steps and at the
    phase's end. Rank 0's ``mirror`` copies each checkpoint to ``pretrain.checkpoint_uri``.
    """
    import torch
    import torch.distributed as dist

    from bert_core.device import peak_flops
    from bert_core.model.bert import flops_per_token
    from bert_core.pretrain.data import PretrainingLoader, to_device
    from bert_core.pretrain.ds_config import loop_clipping
    from bert_core.pretrain.evaluate import EvalSplit, eval_folder, evaluate

    pre = config.pretrain
    phase = pre.phases[phase_index]
    ckpt = checkpoint_dir(run, phase_index)
    mcfg = model_config(config, vocab_size, init_checkpoint)
    engine, scheduler = build_engine(config, phase_index, vocab_size, init_checkpoint, run)
    loader = PretrainingLoader(
        instances, phase.max_seq_length, phase.micro_batch_size, rank=rank, world_size=world_size,
        seed=pre.seed + phase_index, workers=pre.loader_workers, vocab_file=config.vocab.vocab_file,
        pin_memory=engine.device.type == "cuda", token_buckets=pre.token_buckets,
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
    client = resume(engine, run, phase_index, rank)
    if client is not None:
        step = int(client["step"])
        loader.load_state_dict(client["loader"])
        # The checkpoint holds the scheduler's iteration, not its length: the rate is set again
        # from this config's schedule (the restored one on a plain resume; the schedule of the
        # new length after `--extend-to`, bert_core/pretrain/extend.py).
        scheduler.step(scheduler.last_batch_iteration)
        if metrics:
            metrics.truncate(phase_index + 1, step)
        _log(rank, f"phase {phase_index + 1}: resumed at step {step} from {ckpt}/step{step} "
                   f"(loader epoch {loader.epoch}, position {loader.position})")
    elif phase_index > 0:
        # Weights only: the optimizer state and LR schedule start fresh for the new length.
        start_from_phase_before(engine, run, phase_index, pre.phases[phase_index - 1].max_steps)
        _log(rank, f"phase {phase_index + 1}: starting from phase {phase_index}'s weights")
    if step == 0:
        # DeepSpeed's WarmupLR starts at iteration -1 and its first step() gives iteration 0,
        # so the first two updates would both run at warmup_min_lr; one step() here makes
        # update k use iteration k-1 (0, peak/W, 2 peak/W, ...), as transformers' schedule does.
        scheduler.step()
        if metrics:
            metrics.truncate(phase_index + 1, 0)

    accumulation = engine.gradient_accumulation_steps()
    max_norm = loop_clipping(pre)
    batches = iter(loader)
    device = engine.device
    peak = peak_flops(device, pre.precision, pre.peak_flops_per_rank)
    first_loss = last_loss = None
    # The hot loop never waits for the device: the step's sums stay there and are read (with one
    # all-reduce) only on the steps that log. Sequence and token counts come from the host.
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, mlm_acc, nsp_acc, micro-batches
    one = torch.ones((), device=device)
    sequences = tokens = 0  # this rank's, since the last log line
    save_seconds = 0.0  # spent saving checkpoints, since the last log line
    t0 = time.perf_counter()
    engine.train()
    while step < phase.max_steps:
        # The rate this step's update uses: the optimizer's own, which a resume restores (the
        # scheduler's get_last_lr() is only set by its next step()).
        lr = float(engine.get_lr()[0])
        sums.zero_()
        for micro in range(accumulation):
            host_batch = next(batches)
            batch = to_device(host_batch, device)
            torch.manual_seed(_dropout_seed(pre.seed, phase_index, step, rank, micro))
            out = engine(**batch)
            backward_and_step(engine, out["loss"], max_norm)
            sums += torch.stack([out["loss"].detach(), out["mlm_acc"], out["nsp_acc"], one]).double()
            sequences += batch["input_ids"].shape[0]
            tokens += real_tokens(host_batch)
        step += 1
        if step % pre.log_every == 0 or step == phase.max_steps or step == 1:
            # CPU seconds of every rank since it started: the run's compute cost
            host = torch.tensor([sequences, tokens, time.process_time()], dtype=torch.float64, device=device)
            totals = torch.cat([sums, host])
            dist.all_reduce(totals)  # means over all ranks; throughput summed over all ranks
            loss, mlm_acc, nsp_acc, micros, seqs, toks, cpu = totals.tolist()  # waits for the device
            seconds = time.perf_counter() - t0
            loss, mlm_acc, nsp_acc = loss / micros, mlm_acc / micros, nsp_acc / micros
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
            tokens_per_s = toks / seconds
            # The encoder runs on the real tokens only, so MFU counts useful FLOPs of real tokens.
            mean_len = toks / seqs
            row = {
                "kind": "train", "phase": phase_index + 1, "step": step, "max_steps": phase.max_steps,
                "loss": loss, "mlm_acc": mlm_acc, "nsp_acc": nsp_acc, "lr": lr,
                "seq_per_s": seqs / seconds, "tokens_per_s": tokens_per_s,
                "mfu": (flops_per_token(mcfg, round(mean_len)) * tokens_per_s / (peak * world_size))
                if peak else None,
                "epoch": loader.epoch, "cpu_seconds": cpu, "checkpoint_seconds": save_seconds,
                "time": time.time(),
            }
            if metrics:
                metrics.append(row)
            _log(rank, f"phase {phase_index + 1} step {step}/{phase.max_steps} loss {loss:.4f} "
                       f"mlm_acc {row['mlm_acc']:.3f} nsp_acc {row['nsp_acc']:.3f} lr {row['lr']:.2e} "
                       f"{row['seq_per_s']:.1f} seq/s {tokens_per_s:.0f} tok/s")
            sequences = tokens = 0
            save_seconds = 0.0
            t0 = time.perf_counter()
        if eval_split is not None and (step == phase.max_steps or (pre.eval_every and step % pre.eval_every == 0)):
            # Before the checkpoint: a resume from it keeps this row and never evaluates again.
            t_eval = time.perf_counter()
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
            t0 += time.perf_counter() - t_eval  # the throughput of the next log line is training's
        if step % pre.checkpoint_every == 0 or step == phase.max_steps:
            # All ranks save: with ZeRO each holds its own optimizer shard.
            t_save = time.perf_counter()
            save_checkpoint(engine, run, phase_index, step, {"step": step, "loader": loader.state_dict(),
                                                             "phase": phase_index + 1}, rank, mirror)
            saving = time.perf_counter() - t_save
            t0 += saving  # the rates are training's; the saves are reported apart
            save_seconds += saving
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


def check_instances(config: PipelineConfig, instances: str,
                    init_checkpoint: str | None = None) -> tuple[str, int]:
    """What a run reads, checked before it starts: the vocab the instances name (the one they
    were made with), the model's vocab size against it and every split of each phase's length,
    training and eval, against its manifest (:func:`check_splits`: a cut shard fails now, not
    hours in). Returns (vocab file, vocab size); raises a refusal."""
    from bert_core.pretrain.data import read_vocab, vocab_file_of

    vocab_file = vocab_file_of(instances, fallback=config.vocab.vocab_file)
    vocab_size = len(read_vocab(vocab_file))
    if init_checkpoint:
        check_init_vocab(init_checkpoint, vocab_file)
    model_config(config, vocab_size, init_checkpoint)
    check_splits(instances, [phase.max_seq_length for phase in config.pretrain.phases])
    return vocab_file, vocab_size


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_run_config(args.config)
        pre = config.pretrain
        if not storage.is_local(args.output):
            raise PretrainConfigError(
                f"--output {args.output}: DeepSpeed writes checkpoints with torch.save to a local "
                "path; use a local or mounted (e.g. gcsfuse, NFS) folder shared by the nodes"
            )
        vocab_file, vocab_size = check_instances(config, args.instances, args.init_checkpoint)
    except Exception as err:
        return _exit_on(err, rank=0)
    if storage.has_manifest(args.output):
        print(f"{args.output}: finished already ({storage.MANIFEST} present)", flush=True)
        return 0

    import torch

    if pre.accelerator == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(pre.threads_per_rank)
    import deepspeed
    import torch.distributed as dist

    from bert_core.device import configure_matmul, dist_backend, resolve_device

    try:
        device = resolve_device(pre.accelerator, int(os.environ.get("LOCAL_RANK", args.local_rank)))
    except Exception as err:
        return _exit_on(err, rank=0)
    configure_matmul(pre.precision, device)
    deepspeed.init_distributed(dist_backend=dist_backend(pre.accelerator))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if pre.accelerator == "cpu":
        dist.barrier()  # every rank has mapped every rank's buffer
        release_shm_buffer(rank)
    if world_size != pre.world_size:
        print(f"{CONFIG_ERROR_PREFIX} the launcher started {world_size} ranks but pretrain.nodes x "
              f"procs_per_node = {pre.world_size}; launch with the config's sizes", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT

    stats = []
    engine = None
    try:
        # A new machine takes the newest checkpoints from pretrain.checkpoint_uri before any load.
        mirror = restore_run(config, args.output, rank)
        for i, phase in enumerate(pre.phases):
            if latest_step(args.output, i) == phase.max_steps and i < len(pre.phases) - 1:
                _log(rank, f"phase {i + 1}: finished already (step {phase.max_steps})")
                stats.append(_phase_stats_from_metrics(args.output, i, phase.global_batch_size))
                continue
            result = run_phase(config, args.instances, args.output, i, vocab_size,
                               args.init_checkpoint, rank, world_size, mirror)
            engine = result.pop("engine")
            stats.append(result | _phase_stats_from_metrics(args.output, i, phase.global_batch_size,
                                                            prefer=result))
        if mirror is not None:
            mirror.wait()  # the last checkpoint is in the store before the run is called done
        model = fp32_master_model(engine)  # every rank: ZeRO gathers the partitions
        if rank == 0:
            export(config, args, model, vocab_file, stats)
            if config.pretrain.monitor == "wandb":  # DeepSpeed's monitor never closes its run
                import wandb

                wandb.finish()
        dist.barrier()
        # Gloo's worker threads are joined here rather than torn down by the interpreter's exit,
        # which can abort a rank that has finished ("terminate called without an active exception").
        dist.destroy_process_group()
    except Exception as err:
        return _exit_on(err, rank)
    return 0


def shm_buffer_path(rank: int, env: dict[str, str] | None = None) -> Path:
    """The shared-memory file DeepSpeed's CPU all-reduce creates for ``rank`` on this node."""
    env = os.environ if env is None else env
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR')}_{env.get('MASTER_PORT')}_{rank}"
    return Path("/dev/shm") / name


def release_shm_buffer(rank: int) -> None:
    """Unlink this rank's all-reduce buffer once every rank has mapped it.

    DeepSpeed never unlinks it, so each CPU run would leave its buffers (tens of MB a rank) in
    ``/dev/shm``, which is RAM, until the machine restarts. The mappings stay valid after the
    unlink, and the file is gone however the run ends.
    """
    shm_buffer_path(rank).unlink(missing_ok=True)


def _exit_on(err: Exception, rank: int) -> int:
    """One line for the launcher and an exit code: a refusal (2: the failing rank's own message),
    a lost peer (1: its "connection closed" says infrastructure unless a peer refused) or a failed
    store (1: its line says infrastructure); anything else is a bug and keeps its traceback."""
    message = refusal(err)
    if message is not None:
        print(f"{CONFIG_ERROR_PREFIX} {message}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    if isinstance(err, InfrastructureError):  # a store's failure: its line says so, for the launcher
        print(f"rank {rank} stopped: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return 1
    if is_comm_error(err):
        print(f"rank {rank} stopped: {first_line(err)} (another rank failed or was stopped)",
              file=sys.stderr, flush=True)
        return 1
    raise err


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
    """``RUN/hf/`` in the transformers layout, then the run manifest (written last). The vocab
    is checked again first: one written into the vocab folder during the run is refused, not
    shipped with a model trained on the old ids."""
    from bert_core.card import write_card
    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.data import check_vocab
    from bert_core.pretrain.extend import manifest_fields as extension_fields

    instances = storage.read_manifest(args.instances)
    check_vocab(args.instances, vocab_file, instances)
    hf, attempt = storage.join(args.output, "hf"), os.environ.get(lease.ATTEMPT_ENV)
    # written under the attempt's own names, moved into place only while it holds the lease
    save_pretrained(model, storage.join(lease.staging(args.output, attempt), "hf"), vocab_file=vocab_file,
                    lowercase=config.vocab.lowercase)
    lease.publish(args.output, attempt, "hf")
    # named by their place in the run folder, so that `bertpipe verify RUN` finds them in hf/
    shards = [storage.shard_entry(storage.join(hf, name), path=f"hf/{name}")
              for name in ("config.json", "model.safetensors")]
    storage.write_manifest(
        args.output, stage="pretrain", config=config, fence=lease.fence(args.output, attempt),
        inputs=[instances], shards=shards, vocab_file=storage.to_uri(vocab_file),
        vocab_sha256=storage.sha256(storage.join(hf, "vocab.txt")),
        counts={"phases": len(stats), "steps": sum(s.get("steps", 0) for s in stats),
                "sequences": sum(s.get("sequences", 0) for s in stats)},
        stats={"phases": stats, "first_loss": stats[0].get("first_loss"),
               "last_loss": stats[-1].get("last_loss"), "eval": stats[-1].get("eval")},
        hf=hf, init_checkpoint=args.init_checkpoint, **extension_fields(args.output),
    )
    write_card(hf)
    print(f"exported {hf} and wrote {storage.join(args.output, storage.MANIFEST)}", flush=True)

