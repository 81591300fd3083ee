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
  resumed run computes the same losses as an uninterrupted one. The files are read weights-only
  (``bert_core.model.checkpoint.weights_only_loads``: a pickled object never runs); a checkpoint
  that does not load on every rank (truncated, not weights, ``latest`` garbage or dangling) is
  skipped with a line saying why, and the next older one is tried;
- every ``checkpoint_every`` steps all ranks call ``save_checkpoint`` (ZeRO shards are per rank)
  and only when every rank has written its part does rank 0 point ``latest`` at it, so a failed
  save (full or read-only disk) never becomes the resume point;
- rank 0 appends ``RUN/metrics.jsonl`` every ``log_every`` steps: phase, step, loss, mlm_acc,
  nsp_acc (means over all ranks), lr, seq_per_s, tokens_per_s (non-padding), mfu (with
  ``peak_flops_per_rank``), cpu_seconds (summed over all ranks since they started);
- every ``eval_every`` steps and at the end of each phase all ranks evaluate the whole eval split
  of the phase's length (``seq{L}/eval/``, ``bert_core.pretrain.evaluate``): rank 0 appends a
  ``"kind": "eval"`` row (masked LM / NSP loss and accuracy) and writes ``Eval/*`` events to
  the DeepSpeed monitor; instances without an eval split train without evaluation;
- at the end rank 0 exports ``RUN/hf/`` (transformers layout) and writes ``RUN/_MANIFEST.json``
  (with each phase's final eval, and the sha256 of the vocab shipped);
- the vocab is the ``vocab.txt`` the instances name, refused at the start and again at the
  export when its sha256 is not the one the instances recorded
  (``bert_core.pretrain.data.check_vocab``).

A problem a retry cannot fix (config, data, checkpoints, a full or read-only disk) exits the
rank that met it with code 2 after one line starting with ``bertpipe-config-error:``, so the
launcher classifies the run by the failing rank's own error, not by the "connection closed"
of the ranks that lost it (see ``bert_core/pretrain/launch.py``); those print one line too.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bert_core import storage
from bert_core.config import ConfigError, PipelineConfig, validate
from bert_core.failures import is_comm_error, refusal
from bert_core.pretrain.metrics import MetricsLog, eval_rows, read_metrics, train_rows

CONFIG_ERROR_EXIT = 2
CONFIG_ERROR_PREFIX = "bertpipe-config-error:"
CONFIG_FILE = "pretrain_config.json"


class PretrainConfigError(ConfigError):
    """The run cannot start with this config/data (not an infrastructure failure)."""


class CheckpointWriteError(PretrainConfigError):
    """A checkpoint could not be written (full or read-only disk): a retry fails the same way."""


# Operational settings a finished or resumed run may change without changing what it trains.
_OPERATIONAL = {"launcher", "hostfile", "master_addr", "master_port", "monitor", "threads_per_rank",
                "log_every", "checkpoint_every", "peak_flops_per_rank", "launch_retries"}


# --------------------------------------------------------------------------- run folder


def checkpoint_dir(run: str, phase_index: int) -> str:
    return storage.join(run, "checkpoints", f"phase{phase_index + 1}")


def latest_step(run: str, phase_index: int) -> int | None:
    """The step ``latest`` names, if it names a saved step of the phase (None when ``latest`` is
    missing, garbage or dangling)."""
    ckpt = checkpoint_dir(run, phase_index)
    latest = storage.join(ckpt, "latest")
    if not storage.exists(latest):
        return None
    tag = storage.read_text(latest).strip()
    if not re.fullmatch(r"step\d+", tag) or int(tag[4:]) not in saved_steps(run, phase_index):
        return None
    return int(tag[4:])


def saved_steps(run: str, phase_index: int) -> list[int]:
    """Steps of the phase's ``step{N}/`` folders that hold a model file, newest first."""
    files = storage.glob(storage.join(checkpoint_dir(run, phase_index), "step*", "*model_states.pt"))
    tags = {uri.rsplit("/", 2)[-2] for uri in files}
    return sorted((int(t[4:]) for t in tags if re.fullmatch(r"step\d+", t)), reverse=True)


def resume_candidates(run: str, phase_index: int) -> tuple[list[int], list[str]]:
    """The steps to try resuming from, newest first, and a note for each thing passed over.

    With a valid ``latest`` these are its step and the older ones (a newer folder is a save that
    never finished); without one, every saved step.
    """
    ckpt = checkpoint_dir(run, phase_index)
    latest = storage.join(ckpt, "latest")
    steps, notes = saved_steps(run, phase_index), []
    named = latest_step(run, phase_index)
    if named is not None:
        notes += [f"skipped {ckpt}/step{s}: newer than latest, a save that did not finish"
                  for s in steps if s > named]
        steps = [s for s in steps if s <= named]
    elif storage.exists(latest):
        text = storage.read_text(latest).strip()
        notes.append(f"{latest} names {text[:40]!r}, not a saved step of this phase; "
                     "trying the saved steps, newest first")
    return steps, notes


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``section.field: old -> new`` for each training setting of ``model`` and ``pretrain`` that
    differs (operational ones such as ports and log intervals do not count)."""
    changes: list[str] = []
    for section in ("model", "pretrain"):
        a, b = old.get(section) or {}, new.get(section) or {}
        for key in sorted(set(a) | set(b)):
            if key not in _OPERATIONAL:
                _diff(f"{section}.{key}", a.get(key), b.get(key), changes)
    return changes


def _diff(path: str, a: Any, b: Any, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(f"{path}.{key}", a.get(key), b.get(key), out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(f"{path}.{i}", x, y, out)
    elif a != b:
        out.append(f"{path}: {_short(a)} -> {_short(b)}")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_run_config(config: PipelineConfig, run: str) -> None:
    """Refuse a run folder that holds (or is half-way through) a run of another config."""
    if storage.has_manifest(run):
        old, what = storage.read_manifest(run).get("config") or {}, "was pre-trained"
    elif storage.exists(storage.join(run, CONFIG_FILE)) and any(
            saved_steps(run, i) for i in range(len(config.pretrain.phases))):
        old, what = json.loads(storage.read_text(storage.join(run, CONFIG_FILE))), "is being pre-trained"
    else:
        return
    changes = config_changes(old, config.model_dump(mode="json"))
    if changes:
        raise PretrainConfigError(
            f"{storage.to_uri(run)} {what} with another config ({'; '.join(changes[:4])}"
            f"{f'; and {len(changes) - 4} more' if len(changes) > 4 else ''}); "
            "pass a new --output for this config, or the run's own settings to reuse it"
        )


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
    with the instances' vocab size (rounded up to ``pad_vocab_to_multiple`` rows)."""
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
    return config.model.for_vocab(vocab_size)


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def _dropout_seed(seed: int, phase: int, step: int, rank: int, micro: int) -> int:
    # Reseeding per micro-batch makes dropout a function of the position in training, not of
    # the process's history, so a resumed run draws the same dropout masks.
    return hash((seed, phase, step, rank, micro)) & 0x7FFF_FFFF


# --------------------------------------------------------------------------- errors


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    # torch's weights-only refusal explains itself over many lines; the global it met says it all
    unsupported = [line for line in lines if "Unsupported global" in line]
    return ((unsupported or lines or [type(err).__name__])[0])[:240]


def _free_space(folder: str) -> str:
    path = folder
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return f"{shutil.disk_usage(path or '.').free / 1e6:,.0f} MB free there"
    except OSError:
        return "free space unknown"


def _unreadable(err: BaseException) -> str:
    if isinstance(err, pickle.UnpicklingError):
        return f"holds pickled objects that are not weights, refused unread ({first_line(err)})"
    return f"cannot be read, damaged or truncated ({first_line(err)})"


# --------------------------------------------------------------------------- checkpoints


def save_checkpoint(engine: Any, ckpt: str, step: int, client_state: dict[str, Any], rank: int) -> None:
    """Every rank writes its part of ``step{N}``; then rank 0 points ``latest`` at it.

    DeepSpeed's ``save_checkpoint`` ends in a barrier, so when it returns every rank has written;
    ``latest`` goes through a temporary file and a rename, so it is never half written either.
    A failed write on this rank is a :class:`CheckpointWriteError` naming the folder.
    """
    tag = f"step{step}"
    try:
        engine.save_checkpoint(ckpt, tag=tag, client_state=client_state, save_latest=False)
        if rank == 0:
            tmp = os.path.join(ckpt, "latest.tmp")
            with open(tmp, "w") as f:
                f.write(tag)
            os.replace(tmp, os.path.join(ckpt, "latest"))
    except Exception as err:
        if is_comm_error(err):
            raise
        raise CheckpointWriteError(
            f"{ckpt}/{tag}: cannot write the checkpoint ({first_line(err)}; {_free_space(ckpt)}); free "
            "space or make the folder writable, then run again (it resumes from the last complete checkpoint)"
        ) from err


def resume(engine: Any, run: str, phase_index: int, rank: int) -> dict[str, Any] | None:
    """Load the newest checkpoint of the phase that loads on every rank; its client state, or
    None when the phase has no checkpoint. Each one passed over is logged with the reason."""
    import torch
    import torch.distributed as dist

    from bert_core.model.checkpoint import CheckpointError, weights_only_loads

    ckpt = checkpoint_dir(run, phase_index)
    steps, notes = resume_candidates(run, phase_index)
    for note in notes:
        _log(rank, f"phase {phase_index + 1}: {note}")
    if not steps and not notes:
        return None
    skipped = []
    for step in steps:
        reason = None
        try:
            with weights_only_loads():
                path, client = engine.load_checkpoint(ckpt, tag=f"step{step}")
            if path is None or not client:
                reason = "DeepSpeed found no checkpoint files in it"
        except Exception as err:
            if is_comm_error(err):
                raise
            reason = _unreadable(err)
        # Every rank must resume from the same step: one rank's bad shard rules the step out.
        loaded = torch.tensor([0 if reason else 1], device=engine.device)
        dist.all_reduce(loaded, op=dist.ReduceOp.MIN)
        if loaded.item():
            return client
        reason = reason or "another rank could not load its part"
        skipped.append(f"step{step} {reason}")
        _log(rank, f"phase {phase_index + 1}: skipped checkpoint {ckpt}/step{step}: {reason}")
    raise CheckpointError(
        f"{ckpt}: no checkpoint loads ({'; '.join(skipped) or 'no step folder holds a model file'}); "
        f"restore the folder from a copy, or delete it to train phase {phase_index + 1} from its start"
    )


def start_from_previous_phase(engine: Any, run: str, phase_index: int, previous_steps: int) -> None:
    """The previous phase's final weights; its optimizer state and LR schedule stay behind."""
    from bert_core.model.checkpoint import CheckpointError, weights_only_loads

    previous = checkpoint_dir(run, phase_index - 1)
    try:
        with weights_only_loads():
            path, _ = engine.load_checkpoint(previous, tag=f"step{previous_steps}", load_module_only=True,
                                             load_optimizer_states=False, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{previous}/step{previous_steps}")
    except Exception as err:
        if is_comm_error(err):
            raise
        raise CheckpointError(
            f"{previous}/step{previous_steps}: phase {phase_index + 1} starts from it, but it "
            f"{_unreadable(err)}; restore it, or delete {previous} to train phase {phase_index} again"
        ) from None


# --------------------------------------------------------------------------- one phase


def run_phase(
    config: PipelineConfig, instances: str, run: str, phase_index: int, vocab_size: int,
    init_checkpoint: str | None, rank: int, world_size: int,
) -> dict[str, Any]:
    """Train one phase to its ``max_steps`` (resuming if it has checkpoints); returns its stats."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from bert_core.device import peak_flops
    from bert_core.model.bert import BertForPreTraining, flops_per_token
    from bert_core.model.weight_decay import param_groups
    from bert_core.pretrain.data import PretrainingLoader, to_device
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
    if pre.compile:
        # Batch shapes vary (padded length, real tokens, masked positions): compile for dynamic shapes.
        engine.compile(compile_kwargs={"dynamic": True})
    loader = PretrainingLoader(
        instances, phase.max_seq_length, phase.micro_batch_size, rank=rank, world_size=world_size,
        seed=pre.seed + phase_index, workers=pre.loader_workers, vocab_file=config.vocab.vocab_file,
        pin_memory=engine.device.type == "cuda",
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
        if metrics:
            metrics.truncate(phase_index + 1, step)
        _log(rank, f"phase {phase_index + 1}: resumed at step {step} from {ckpt}/step{step} "
                   f"(loader epoch {loader.epoch}, position {loader.position})")
    elif phase_index > 0:
        # Weights only: the optimizer state and LR schedule start fresh for the new length.
        start_from_previous_phase(engine, run, phase_index, pre.phases[phase_index - 1].max_steps)
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
    device = engine.device
    peak = peak_flops(device, pre.precision, pre.peak_flops_per_rank)
    first_loss = last_loss = None
    # The hot loop never waits for the device: the step's sums stay there and are read (with one
    # all-reduce) only on the steps that log. Sequence and token counts come from the host.
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, mlm_acc, nsp_acc, micro-batches
    one = torch.ones((), device=device)
    sequences = tokens = 0  # this rank's, since the last log line
    t0 = time.perf_counter()
    engine.train()
    while step < phase.max_steps:
        # The rate this step's update uses: the optimizer's own, which a resume restores (the
        # scheduler's get_last_lr() is only set by its next step()).
        lr = float(engine.get_lr()[0])
        sums.zero_()
        for micro in range(accumulation):
            batch = to_device(next(batches), device)
            torch.manual_seed(_dropout_seed(pre.seed, phase_index, step, rank, micro))
            out = engine(**batch)
            engine.backward(out["loss"])
            engine.step()
            sums += torch.stack([out["loss"].detach(), out["mlm_acc"], out["nsp_acc"], one]).double()
            sequences += batch["input_ids"].shape[0]
            tokens += batch["token_index"].numel()
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
                "epoch": loader.epoch, "cpu_seconds": cpu, "time": time.time(),
            }
            if metrics:
                metrics.append(row)
            _log(rank, f"phase {phase_index + 1} step {step}/{phase.max_steps} loss {loss:.4f} "
                       f"mlm_acc {row['mlm_acc']:.3f} nsp_acc {row['nsp_acc']:.3f} lr {row['lr']:.2e} "
                       f"{row['seq_per_s']:.1f} seq/s {tokens_per_s:.0f} tok/s")
            sequences = tokens = 0
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
            save_checkpoint(engine, ckpt, step, {"step": step, "loader": loader.state_dict(),
                                                 "phase": phase_index + 1}, rank)
            t0 += time.perf_counter() - t_save
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
    were made with), the model's vocab size against it and each phase's shard sizes (a cut
    shard fails now, not hours in). Returns (vocab file, vocab size); raises a refusal."""
    from bert_core.pretrain.data import length_folder, read_vocab, vocab_file_of

    vocab_file = vocab_file_of(instances, fallback=config.vocab.vocab_file)
    vocab_size = len(read_vocab(vocab_file))
    model_config(config, vocab_size, init_checkpoint)
    for phase in config.pretrain.phases:
        storage.check_shards(length_folder(instances, phase.max_seq_length), checksums=False)
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
        if rank == 0:
            export(config, args, engine.module, vocab_file, stats)
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
    """One line for the launcher and an exit code: a refusal (2: the failing rank's own message)
    or a lost peer (1: its "connection closed" says infrastructure unless a peer refused);
    anything else is a bug and keeps its traceback."""
    message = refusal(err)
    if message is not None:
        print(f"{CONFIG_ERROR_PREFIX} {message}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
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
    from bert_core.model.checkpoint import save_pretrained
    from bert_core.pretrain.data import check_vocab

    instances = storage.read_manifest(args.instances)
    check_vocab(args.instances, vocab_file, instances)
    hf = storage.join(args.output, "hf")
    save_pretrained(model, hf, vocab_file=vocab_file, lowercase=config.vocab.lowercase)
    shards = [storage.shard_entry(storage.join(hf, name)) for name in ("config.json", "model.safetensors")]
    storage.write_manifest(
        args.output, stage="pretrain", config=config,
        inputs=[instances], shards=shards, vocab_file=storage.to_uri(vocab_file),
        vocab_sha256=storage.sha256(storage.join(hf, "vocab.txt")),
        counts={"phases": len(stats), "steps": sum(s.get("steps", 0) for s in stats),
                "sequences": sum(s.get("sequences", 0) for s in stats)},
        stats={"phases": stats, "first_loss": stats[0].get("first_loss"),
               "last_loss": stats[-1].get("last_loss"), "eval": stats[-1].get("eval")},
        hf=hf, init_checkpoint=args.init_checkpoint,
    )
    print(f"exported {hf} and wrote {storage.join(args.output, storage.MANIFEST)}", flush=True)

