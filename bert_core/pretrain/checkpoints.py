"""Saving and resuming a run's DeepSpeed checkpoints, and the fp32 weights a run exports.

Every rank writes its part of ``step{N}`` (under the attempt's own names, moved into place by
rank 0 under the run folder's lease) before rank 0 points ``latest`` at it; a resume tries
the newest step that loads on every rank (read weights-only) and says why it passed over any
other; a bf16 or fp16 run exports the optimizer's fp32 master weights. With
``pretrain.checkpoint_uri`` each complete step is also copied there (``checkpoint_mirror.py``).
"""

from __future__ import annotations

import os
import pickle
import shutil
from typing import TYPE_CHECKING, Any

from bert_core import lease
from bert_core.failures import is_comm_error
from bert_core.pretrain.errors import CheckpointWriteError, first_line
from bert_core.pretrain.run_folder import checkpoint_dir, resume_candidates

if TYPE_CHECKING:
    from bert_core.pretrain.checkpoint_mirror import CheckpointMirror


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


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


def save_checkpoint(engine: Any, run: str, phase_index: int, step: int, client_state: dict[str, Any],
                    rank: int, mirror: CheckpointMirror | None = None) -> None:
    """Every rank writes its part of ``step{N}`` under the launcher's attempt's own names
    (``lease.staging``); then rank 0 moves it into place and points ``latest`` at it, both only
    while the run folder's lease is still the attempt's (``lease.publish``, ``lease.commit``).

    DeepSpeed's ``save_checkpoint`` ends in a barrier, so when it returns every rank has written;
    ``latest`` goes through a temporary file and a rename, so it is never half written either.
    A failed write on this rank is a :class:`CheckpointWriteError` naming the folder. Rank 0's
    ``mirror`` (``pretrain.checkpoint_uri``) first waits for the previous step's upload, then
    starts this one's.
    """
    tag, ckpt = f"step{step}", checkpoint_dir(run, phase_index)
    attempt = os.environ.get(lease.ATTEMPT_ENV)  # None: a run without a lease writes in place
    part = os.path.relpath(ckpt, run)
    staged = os.path.join(lease.staging(run, attempt), part)
    if mirror is not None:
        mirror.wait()
    try:
        engine.save_checkpoint(staged, tag=tag, client_state=client_state, save_latest=False)
        if rank == 0:
            tmp = os.path.join(staged, "latest.tmp")
            with open(tmp, "w") as f:
                f.write(tag)
    except Exception as err:
        if is_comm_error(err):
            raise
        raise CheckpointWriteError(
            f"{ckpt}/{tag}: cannot write the checkpoint ({first_line(err)}; {_free_space(staged)}); free "
            "space or make the folder writable, then run again (it resumes from the last complete checkpoint)"
        ) from err
    if rank == 0:  # a lost attempt: one line, nothing moved
        lease.publish(run, attempt, f"{part}/{tag}")
        if attempt:
            lease.commit(run, attempt, tmp, os.path.join(ckpt, "latest"))
        else:
            os.replace(tmp, os.path.join(ckpt, "latest"))
    if mirror is not None:
        mirror.upload(ckpt, step)


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


def start_from_phase_before(engine: Any, run: str, phase_index: int, previous_steps: int) -> None:
    """The final weights of the phase before; its optimizer state and LR schedule stay behind."""
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


def fp32_master_model(engine: Any) -> Any:
    """The trained model with the optimizer's fp32 master weights: a bf16 or fp16 run trains a
    low-precision copy, and its export should not be rounded to it. Every rank calls this (ZeRO
    gathers each weight from its partitions); an fp32 run returns its own module."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    if not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        return module
    full = {name: safe_get_full_fp32_param(p) for name, p in module.named_parameters()}
    if any(weight is None for weight in full.values()):  # no fp32 master copy to read
        return module
    model = type(module)(module.config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full[name].detach().float().cpu())
    return model
