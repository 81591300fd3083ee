"""Fencing with real stage runs: a `bertpipe corpus`, `vocab`, `instances`, `pretrain` or `finetune` on "another
machine" (its own pid namespace) is paused with SIGSTOP past its lease while a second run takes the
folder over and commits, then resumed: the first commits nothing, deletes nothing of the second's,
leaves nothing of its own (it wrote under its own names, ``lease.staging``) and exits non-zero
with one line saying it lost its lease; `bertpipe verify` passes on the folder."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bert_core import lease, storage

sys.path.insert(0, str(Path(__file__).parent))
from test_concurrent_writers import (  # noqa: E402
    bertpipe,
    inputs,  # noqa: F401  (the fixture)
    shard_bytes,
    stage_args,
    verify_all,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                 reason="another machine is a pid namespace: needs root and unshare")]
TTL = {"BERTPIPE_LEASE_SECONDS": "2"}


def _tree(pid: int) -> list[int]:
    import psutil

    root = psutil.Process(pid)
    return [root.pid, *(c.pid for c in root.children(recursive=True))]


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _pause_while_another_commits(args: list[str], leased: str, committed: Callable[[], Any],
                                 ready: Callable[[], bool] = lambda: True) -> tuple[Any, subprocess.Popen]:
    """Start ``bertpipe *args`` on another machine, pause it once it holds ``leased``'s lease and
    ``ready()`` holds, run ``bertpipe *args`` again here until it commits, read ``committed()``
    while the first is still paused, then resume the first: (what ``committed()`` read, the first
    process, resumed)."""
    old = subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-m", "flows.cli", *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1", **TTL})
    deadline = time.monotonic() + 180
    while lease.read(leased) is None or not ready():  # the first run holds the folder: pause it there
        assert old.poll() is None and time.monotonic() < deadline, old.stdout.read()
        time.sleep(0.02)
    first = lease.read(leased).attempt
    assert lease.read(leased).machine != lease._machine()  # another machine: judged by its silence
    paused = _tree(old.pid)
    _signal(paused, signal.SIGSTOP)
    try:
        new = bertpipe(*args, env=TTL)
        code, text = new.wait(600), new.stdout.read()
        assert code == 0, text[-3000:]
        assert f"attempt {first} " in text and "takes the folder over" in text, text[-3000:]
        seen = committed()
    finally:
        _signal(paused, signal.SIGCONT)
    return seen, old


def _lost_its_lease(old: subprocess.Popen) -> None:
    """The resumed first run ends non-zero, its last line saying it lost its lease."""
    code, text = old.wait(300), old.stdout.read()
    last = text.strip().splitlines()[-1]
    assert code != 0, text[-3000:]
    assert "lease went to another run" in last and len(last) < 400, text[-3000:]


def _files(folder: str) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and p.name not in (lease.LEASE, lease.LOCK)}


def test_a_paused_finetune_run_commits_and_deletes_nothing_once_its_lease_is_taken(samples_dir, tmp_path) -> None:
    import torch

    from bert_core.config import ModelConfig
    from bert_core.model.bert import BertModel
    from bert_core.model.checkpoint import save_pretrained

    torch.manual_seed(0)
    checkpoint = str(tmp_path / "tiny-bert")
    model = BertModel(ModelConfig(size="tiny", vocab_size=30522, max_position_embeddings=64))
    save_pretrained(model, checkpoint, vocab_file=str(samples_dir / "models" / "minilm" / "vocab.txt"))
    out = str(tmp_path / "ft")
    args = ["finetune", "--task", "sst2", "--data", str(Path(__file__).parent / "fixtures" / "tasks"),
            "--checkpoint", checkpoint, "--output", out, "--seeds", "1,2", "--learning-rates", "1e-4",
            "--epochs", "1", "--set", "finetune.batch_size=8", "--set", "finetune.threads=1"]
    task = storage.join(out, "sst2")
    (committed, manifest), old = _pause_while_another_commits(
        args, task, lambda: (_files(out), storage.read_text(storage.join(task, storage.MANIFEST))))
    assert storage.read_manifest(task)["stage"] == "finetune"
    _lost_its_lease(old)
    assert storage.read_text(storage.join(out, "sst2", storage.MANIFEST)) == manifest  # committed nothing
    assert _files(out) == committed  # its jobs wrote under its own names, and moved none into place
    assert not list(Path(out).rglob(f"{lease.STAGING}*"))  # what it staged, it removed as it ended
    verify_all(out)


@pytest.mark.parametrize("stage", ["corpus", "vocab", "instances"])
def test_a_paused_stage_run_commits_and_deletes_nothing_once_its_lease_is_taken(stage, inputs, tmp_path) -> None:  # noqa: F811
    out = str(tmp_path / stage)
    (committed, manifest), old = _pause_while_another_commits(
        stage_args(stage, inputs, out), out,
        lambda: (shard_bytes(out), storage.read_text(storage.join(out, storage.MANIFEST))))
    assert committed and storage.read_manifest(out)["stage"] == stage
    _lost_its_lease(old)
    assert storage.read_text(storage.join(out, storage.MANIFEST)) == manifest  # committed nothing
    assert shard_bytes(out) == committed  # deleted or rewrote nothing of the second run's
    assert not list(Path(out).rglob(f"{lease.STAGING}*"))  # what it staged, it removed as it ended
    verify_all(out)


def test_a_paused_pretraining_publishes_and_commits_nothing_once_its_lease_is_taken(inputs, tmp_path) -> None:  # noqa: F811
    """Paused once its first checkpoint is in place; the second run takes over, resumes from that
    checkpoint and commits; the first, resumed, moves no checkpoint, export or ``latest`` into
    place and leaves nothing of its own."""
    from test_concurrent_writers import PRETRAIN_SETS, SETS

    instances = str(tmp_path / "instances")
    done = subprocess.run([sys.executable, "-m", "flows.cli", *stage_args("instances", inputs, instances)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    run = str(tmp_path / "run")
    args = ["pretrain", "--instances", instances, "--output", run, *SETS[2:],
            *(a for s in PRETRAIN_SETS for a in ("--set", s)), "--set", "pretrain.phases.0.max_steps=8",
            "--set", "pretrain.checkpoint_every=2"]
    latest = Path(run, "checkpoints", "phase1", "latest")

    def kept() -> dict[str, bytes]:  # what the manifest vouches for and a resume reads
        return {k: v for k, v in _files(run).items() if k.startswith(("checkpoints/", "hf/", storage.MANIFEST))}

    (committed, manifest), old = _pause_while_another_commits(
        args, run, lambda: (kept(), storage.read_text(storage.join(run, storage.MANIFEST))), latest.exists)
    assert storage.read_manifest(run)["stage"] == "pretrain"
    assert latest.read_text() == "step8"
    _lost_its_lease(old)
    assert storage.read_text(storage.join(run, storage.MANIFEST)) == manifest  # committed nothing
    assert kept() == committed  # moved no checkpoint, export or latest into place
    assert not list(Path(run).rglob(f"{lease.STAGING}*"))  # what it staged, it removed as it ended
    verify_all(run)
