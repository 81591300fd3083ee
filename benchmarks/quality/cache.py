"""Finished work on disk: one JSON file per job, named by a hash of everything that decides its
result, read back with ``--reuse``, and packed into one file to travel to another machine.

    cache = Cache(Path("work/cache"), reuse=True)
    values = cache.run(pool, [(key, function, args), ...], "label")
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from bert_core.storage import sha256


def run_cached(cache, pool: ProcessPoolExecutor, jobs: list[tuple[dict, Callable, tuple]], label: str,
               in_flight: int | None = None) -> list:
    """Each job's value, from ``cache`` (its ``lookup``/``store``) or computed in ``pool`` and
    stored as it ends, started in list order with at most ``in_flight`` running (default: all at
    once)."""
    values: list = [cache.lookup(key) for key, _, _ in jobs]
    todo = [i for i, v in enumerate(values) if v is None]
    if todo and getattr(cache, "only", False):
        raise SystemExit(f"{label}: {len(todo)} of {len(jobs)} jobs are not in {cache.folder}: the cache is incomplete")
    if len(todo) < len(jobs):
        print(f"  {label}: {len(jobs) - len(todo)} of {len(jobs)} jobs reused", flush=True)
    started, queue, running = time.monotonic(), list(reversed(todo)), {}
    limit, every = in_flight or max(1, len(todo)), max(5, len(todo) // 20)
    done_count = 0
    while queue or running:
        while queue and len(running) < limit:
            i = queue.pop()
            running[pool.submit(jobs[i][1], *jobs[i][2])] = i
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in finished:
            i = running.pop(future)
            values[i] = future.result()
            cache.store(jobs[i][0], values[i])
            done_count += 1
            if done_count % every == 0 or done_count == len(todo):
                print(f"  {label}: {done_count}/{len(todo)} jobs done in {time.monotonic() - started:.0f} s",
                      flush=True)
    return values


class Cache:
    """With ``reuse``, a job whose file exists is read, not run again, and a missing folder starts
    as ``archive`` holds it (:func:`pack_cache`); with ``only``, a job not there stops the run."""

    def __init__(self, folder: Path, reuse: bool, archive: Path | None = None, only: bool = False) -> None:
        self.folder, self.reuse, self.only = folder, reuse, only
        self.hits = self.misses = 0
        if reuse and archive is not None and archive.exists() and not folder.exists():
            unpack_cache(archive, folder)
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
        return self.folder / f"{digest}.json"

    def lookup(self, key: dict):
        path = self.path(key)
        if self.reuse and path.exists():
            self.hits += 1
            return json.loads(path.read_text())["value"]
        return None

    def store(self, key: dict, value) -> None:
        self.misses += 1
        path = self.path(key)
        tmp = path.with_suffix(f".{os.getpid()}.part")  # two processes may finish the same job
        tmp.write_text(json.dumps({"key": key, "value": value}, default=str))
        tmp.replace(path)

    run = run_cached  # cache.run(pool, jobs, label): each job's value, from disk or computed in ``pool``


def pack_cache(folder: Path, archive: Path) -> int:
    """Every finished job of a :class:`Cache` folder into one ``.tar.xz``, in name order and
    without owners or times, so the same jobs give the same bytes; the number of jobs."""
    def plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
        return info

    files = sorted(folder.glob("*.json"))
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(f"{archive.name}.{os.getpid()}.part")
    with tarfile.open(tmp, "w:xz") as tar:
        for f in files:
            tar.add(f, arcname=f.name, filter=plain)
    tmp.replace(archive)
    return len(files)


def unpack_cache(archive: Path, folder: Path) -> None:
    """The jobs of a :func:`pack_cache` archive as a :class:`Cache` folder (written whole, then renamed)."""
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.part")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
    except (tarfile.TarError, EOFError, lzma.LZMAError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"{archive}: not a whole cache archive ({err}); get it again from git") from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(folder)


def weights_digest(checkpoint: Path) -> str:
    return sha256(str(checkpoint / "model.safetensors"))[:20]
