"""Copies of a run's checkpoints on object storage (``pretrain.checkpoint_uri``), and resuming from them.

    bertpipe pretrain --instances I --output RUN --set pretrain.checkpoint_uri=gs://B/P/checkpoints

    <checkpoint_uri>/<run folder's name>/checkpoints/phase{i}/step{N}/   the step's DeepSpeed files,
                                                                        metrics.jsonl as it was then,
                                                                        _MANIFEST.json, written last
    <checkpoint_uri>/<run folder's name>/checkpoints/phase{i}/latest      the newest step uploaded

The layout is the run folder's own (``run_folder.py``). Rank 0 uploads a step once every rank has
written it and ``latest`` names it, in a background thread: training goes on, and the next save
waits for that upload. A failed upload is retried, then stops the run in one line naming the URI.
A run folder that lacks a phase's newest whole step (a new machine after a preemption) gets it
downloaded by rank 0 before DeepSpeed loads, while the other ranks wait; a step without its
manifest is an unfinished upload and is passed over, saying so.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from bert_core import storage
from bert_core.config import PipelineConfig
from bert_core.failures import InfrastructureError, refusal
from bert_core.pretrain.errors import PretrainConfigError, first_line
from bert_core.pretrain.metrics import METRICS_FILE, read_metrics
from bert_core.pretrain.run_folder import (
    checkpoint_dir,
    config_changes,
    mirror_folder,
    resume_candidates,
)

STAGE = "pretrain-checkpoint"  # the stage a step's manifest names
UPLOAD_TRIES = 3
UPLOAD_BACKOFF_S = 2.0  # doubled after each failed try


class CheckpointMirrorError(InfrastructureError):
    """The checkpoint store failed (network, service): run again, the run resumes."""


class CheckpointMirrorRefused(PretrainConfigError):
    """The checkpoint store refused (permissions, a path under a file): fix ``pretrain.checkpoint_uri``."""


# What a store says when the URI or its credentials are wrong: a rerun fails the same way.
REFUSED_MESSAGE = re.compile(r"forbidden|unauthori[sz]ed|access ?denied|permission|not a directory|"
                             r"is a directory|no such bucket|bucket does not exist", re.IGNORECASE)


def _failure(uri: str, what: str, err: BaseException) -> Exception:
    """The one-line error of a failed transfer: a refusal to fix the URI, else a temporary failure
    (the launcher reads that phrase as an infrastructure failure, worth a rerun)."""
    if refusal(err) is not None or REFUSED_MESSAGE.search(f"{type(err).__name__} {err}"):
        return CheckpointMirrorRefused(f"pretrain.checkpoint_uri {uri}: {what} failed ({first_line(err)}); "
                                       "give a writable pretrain.checkpoint_uri and its credentials")
    return CheckpointMirrorError(f"pretrain.checkpoint_uri {uri}: {what} failed ({first_line(err)}); a "
                                 "temporary failure of the storage or the network: run the same command "
                                 "again, it resumes from the last checkpoint")


def _copy(src: str, dst: str) -> dict[str, Any]:
    """Stream ``src`` to ``dst`` (any protocols); the manifest row of what was copied."""
    digest, size = hashlib.sha256(), 0
    with storage.open_file(src, "rb") as r, storage.open_file(dst, "wb") as w:
        while block := r.read(4 << 20):
            digest.update(block)
            size += len(block)
            w.write(block)
    return {"sha256": digest.hexdigest(), "bytes": size}


def _point(folder: str, tag: str) -> None:
    """``folder/latest`` names ``tag``, through a temporary file: never half written."""
    tmp = storage.join(folder, "latest.tmp")
    storage.write_text(tmp, tag)
    storage.filesystem(folder).mv(storage.split_protocol(tmp)[1],
                                  storage.split_protocol(storage.join(folder, "latest"))[1])


def _step(uri: str) -> int | None:
    tag = uri.rstrip("/").rsplit("/", 2)[-2]
    return int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else None


class CheckpointMirror:
    """Rank 0's copies of the run's checkpoints under ``pretrain.checkpoint_uri``: one upload at
    a time in a background thread (:meth:`upload`, :meth:`wait`) and the download of the newest
    whole step of each phase that the run folder lacks (:meth:`restore`)."""

    def __init__(self, config: PipelineConfig, run: str, tries: int = UPLOAD_TRIES,
                 backoff: float = UPLOAD_BACKOFF_S, log: Any = print) -> None:
        self.config, self.run = config, storage.to_uri(run)
        self.root = mirror_folder(config, run)
        self.tries, self.backoff, self.log = tries, backoff, log
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def remote(self, local: str) -> str:
        """Where a file or folder of the run folder goes under the checkpoint URI."""
        return storage.join(self.root, storage.to_uri(local)[len(self.run):])

    # ------------------------------------------------------------------ upload

    def upload(self, ckpt: str, step: int) -> None:
        """Start uploading ``ckpt/step{step}`` (written by every rank, named by ``latest``) after
        the previous upload; the run's metrics as they are now go with it."""
        self.wait()
        metrics = storage.join(self.run, METRICS_FILE)
        rows = storage.read_text(metrics) if storage.exists(metrics) else ""
        self._thread = threading.Thread(target=self._upload, args=(ckpt, step, rows), daemon=True,
                                        name=f"checkpoint-upload-step{step}")
        self._thread.start()

    def wait(self) -> None:
        """Wait for the upload under way; raise its one-line error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _upload(self, ckpt: str, step: int, metrics: str) -> None:
        remote = self.remote(storage.join(ckpt, f"step{step}"))
        t0 = time.perf_counter()
        for attempt in range(1, self.tries + 1):
            try:
                shards = self._upload_step(ckpt, step, metrics)
                break
            except Exception as err:
                failure = _failure(remote, f"uploading step {step} ({attempt} of {self.tries} tries)", err)
                if attempt == self.tries or isinstance(failure, CheckpointMirrorRefused):
                    self._error = failure
                    return
                self.log(f"checkpoint upload to {remote} failed ({first_line(err)}); trying again")
                time.sleep(self.backoff * 2 ** (attempt - 1))
        megabytes = sum(s["bytes"] for s in shards) / 1e6
        self.log(f"uploaded {remote} ({len(shards)} files, {megabytes:,.1f} MB, "
                 f"{time.perf_counter() - t0:.1f} s)")

    def _upload_step(self, ckpt: str, step: int, metrics: str) -> list[dict[str, Any]]:
        """The step's files, then its manifest, then the phase's ``latest``."""
        local = Path(ckpt, f"step{step}")
        remote = self.remote(str(local))
        storage.remove(storage.join(remote, storage.MANIFEST), recursive=False)  # not whole while rewritten
        shards = []
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            name = path.relative_to(local).as_posix()
            shards.append({"path": name, **_copy(str(path), storage.join(remote, name))})
        storage.write_text(storage.join(remote, METRICS_FILE), metrics)
        data = metrics.encode("utf-8")
        shards.append({"path": METRICS_FILE, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
        phase = int(Path(ckpt).name.removeprefix("phase"))
        storage.write_manifest(remote, stage=STAGE, config=self.config, shards=shards,
                               counts={"phase": phase, "step": step}, run=self.run)
        _point(self.remote(ckpt), f"step{step}")
        return shards

    # ------------------------------------------------------------------ resume

    def restore(self) -> None:
        """For each phase whose newest whole step under the URI is newer than what the run folder
        would resume from (nothing, on a new machine), download it and point ``latest`` at it;
        the run's metrics come with the newest one. Checks first that the URI takes writes."""
        self._probe()
        newest: tuple[int, int, str] | None = None
        for i in range(len(self.config.pretrain.phases)):
            steps, _ = resume_candidates(self.run, i)
            got = self._restore_phase(i, steps[0] if steps else None)
            if got is not None:
                newest = (i + 1, got[0], got[1])
        if newest is not None:
            self._restore_metrics(*newest)

    def _probe(self) -> None:
        probe = storage.join(self.root, storage.unique_name(".bertpipe-write-test", "tmp"))
        try:
            storage.reach(self.root)  # a store that does not answer costs seconds, not retries
            storage.write_text(probe, "ok")
            storage.remove(probe, recursive=False)
        except Exception as err:
            raise _failure(self.root, "writing", err) from None

    def _restore_phase(self, phase_index: int, local_step: int | None) -> tuple[int, str] | None:
        """Download the phase's newest whole step newer than ``local_step``: (step, its metrics
        file in the run folder's checkpoints), or None when there is none to take."""
        ckpt = checkpoint_dir(self.run, phase_index)
        remote_ckpt = self.remote(ckpt)
        try:
            whole = {_step(u) for u in storage.glob(storage.join(remote_ckpt, "step*", storage.MANIFEST))}
            uploaded = {_step(u) for u in storage.glob(storage.join(remote_ckpt, "step*", "*"))}
        except Exception as err:
            raise _failure(remote_ckpt, "listing", err) from None
        whole.discard(None)
        uploaded.discard(None)
        for step in sorted(uploaded - whole, reverse=True):
            if local_step is None or step > local_step:
                self.log(f"phase {phase_index + 1}: passed over {remote_ckpt}/step{step}: no "
                         f"{storage.MANIFEST}, an upload that did not finish")
        for step in sorted(whole, reverse=True):
            if local_step is not None and step <= local_step:
                return None
            metrics = self._download(phase_index, step)
            if metrics is not None:
                had = f"step{local_step}" if local_step is not None else "no checkpoint"
                self.log(f"phase {phase_index + 1}: downloaded {remote_ckpt}/step{step} (the run folder "
                         f"had {had})")
                return step, metrics
        return None

    def _download(self, phase_index: int, step: int) -> str | None:
        """``step{N}`` into the run folder, checked against its manifest, then ``latest``; the
        path of its metrics file, or None (logged) when the copy there is damaged."""
        ckpt = checkpoint_dir(self.run, phase_index)
        remote = self.remote(storage.join(ckpt, f"step{step}"))
        try:
            manifest = storage.read_manifest(remote)
        except storage.ManifestError as err:
            self.log(f"phase {phase_index + 1}: passed over {remote}: {err}")
            return None
        except Exception as err:
            raise _failure(remote, "reading", err) from None
        changes = config_changes(manifest.get("config") or {}, self.config.model_dump(mode="json"))
        if changes:
            raise PretrainConfigError(
                f"pretrain.checkpoint_uri {remote} holds a run of another config ({'; '.join(changes[:4])}); "
                "give another pretrain.checkpoint_uri (or another --output name), or the run's own settings")
        tmp = Path(ckpt, f".step{step}.download")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for entry in manifest["shards"]:
                got = _copy(storage.join(remote, entry["path"]), str(tmp / entry["path"]))
                if got != {"sha256": entry.get("sha256"), "bytes": entry.get("bytes")}:
                    self.log(f"phase {phase_index + 1}: passed over {remote}: {entry['path']} is not the "
                             "file its manifest lists (damaged or changed after the upload)")
                    shutil.rmtree(tmp, ignore_errors=True)
                    return None
        except FileNotFoundError as err:
            self.log(f"phase {phase_index + 1}: passed over {remote}: {first_line(err)} is missing")
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _failure(remote, f"downloading step {step}", err) from None
        metrics = Path(ckpt, f".step{step}.{METRICS_FILE}")
        os.replace(tmp / METRICS_FILE, metrics)
        target = Path(ckpt, f"step{step}")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        _point(ckpt, f"step{step}")
        return str(metrics)

    def _restore_metrics(self, phase: int, step: int, snapshot: str) -> None:
        """The run's ``metrics.jsonl`` from the snapshot of the newest step taken, unless the run
        folder's own reaches further (the resume drops rows past its step either way)."""
        rows = [r for r in read_metrics(self.run) if isinstance(r, dict) and "phase" in r and "step" in r]
        if not rows or max((r["phase"], r["step"]) for r in rows) < (phase, step):
            os.replace(snapshot, Path(self.run, METRICS_FILE))
            self.log(f"restored {storage.join(self.run, METRICS_FILE)} as it was at phase {phase} step {step}")
        for left in Path(self.run, "checkpoints").glob(f"phase*/.step*.{METRICS_FILE}"):
            left.unlink()


def restore_run(config: PipelineConfig, run: str, rank: int) -> CheckpointMirror | None:
    """Every rank calls this before the first phase: rank 0 downloads what the run folder lacks
    (the folder is shared by the nodes, as DeepSpeed's checkpoints need), the others wait for it.
    Returns rank 0's mirror for the run's uploads; None elsewhere or without a checkpoint URI."""
    import torch.distributed as dist

    if not config.pretrain.checkpoint_uri:
        return None
    mirror = CheckpointMirror(config, run) if rank == 0 else None
    if mirror is not None:
        mirror.restore()
    dist.barrier()
    return mirror
