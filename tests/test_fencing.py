"""Fencing: an attempt that lost its folder's lease commits and deletes nothing, lease updates are
conditional, expiry is judged on the waiter's own clock, and the lease needs no hard links. Each
holder is a real process; "another machine" is a process in its own pid namespace."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bert_core import lease, storage

ROOT = Path(__file__).parent.parent
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="another machine is a pid namespace: needs root and unshare")


def script(body: str, env: dict[str, str] | None = None, machine: bool = False) -> subprocess.Popen:
    """Run ``body`` in a new Python process (``machine``: in its own pid namespace)."""
    argv = [sys.executable, "-c", textwrap.dedent(body)]
    if machine:
        argv = ["unshare", "-p", "-f", "--mount-proc", *argv]
    return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


HOLD_THEN_COMMIT = """
    import sys, time
    from bert_core import lease, storage
    folder = sys.argv[1] if len(sys.argv) > 1 else {folder!r}
    held = lease.acquire(folder, "test")
    storage.write_text(storage.join(folder, "mine-" + held.attempt), "x")
    print("held", held.attempt, flush=True)
    while not __import__("os").path.exists("{gate}"):
        time.sleep(0.05)
    spill_gone = None
    try:
        spill_gone = lease.remove_if_held(folder, held.attempt, storage.join(folder, "_spill"))
        storage.write_manifest(folder, stage="test", config={{}}, fence=lease.fence(folder, held.attempt))
        print("committed", spill_gone, flush=True)
    except (lease.LeaseLostError, KeyboardInterrupt) as err:  # a lost lease interrupts the main thread
        print("lost", spill_gone, type(err).__name__, flush=True)
"""


def _wait_line(proc: subprocess.Popen, prefix: str) -> str:
    line = proc.stdout.readline()
    assert line.startswith(prefix), line + proc.stdout.read()
    return line.split()[1]


@NEEDS_ROOT
def test_a_paused_holder_on_another_machine_commits_and_deletes_nothing_of_the_new_holders(tmp_path) -> None:
    folder, gate = str(tmp_path / "out"), str(tmp_path / "go")
    env = {"BERTPIPE_LEASE_SECONDS": "2"}
    old = script(HOLD_THEN_COMMIT.format(folder=folder, gate=gate), env, machine=True)
    first = _wait_line(old, "held")
    old_pids = [int(p) for p in subprocess.run(["pgrep", "-f", gate], capture_output=True, text=True).stdout.split()]
    for pid in old_pids:
        os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    os.environ["BERTPIPE_LEASE_SECONDS"] = "2"
    try:
        with lease.hold(folder, "test") as held:
            assert time.monotonic() - start >= 2  # another machine's holder: judged by its silence
            storage.write_text(storage.join(folder, "_spill", "run"), "new holder's scratch")
            for pid in old_pids:
                os.kill(pid, signal.SIGCONT)
            Path(gate).touch()
            out = old.communicate(timeout=60)[0]
            # cancelled (its main thread interrupted) or refused at its commit: nothing removed or committed
            assert "went to another run" in out, out
            assert not any(line.startswith(("committed", "lost True")) for line in out.splitlines()), out
            assert storage.read_text(storage.join(folder, "_spill", "run")) == "new holder's scratch"
            assert not storage.has_manifest(folder)
            assert lease.read(folder).attempt == held.attempt  # the late renewals wrote nothing
            storage.write_manifest(folder, stage="test", config={}, fence=lease.fence(folder, held.attempt))
    finally:
        del os.environ["BERTPIPE_LEASE_SECONDS"]
        for pid in old_pids:
            with_suppress_kill(pid)
    assert storage.read_manifest(folder)["stage"] == "test"
    assert not storage.exists(storage.join(folder, lease.LEASE))
    assert not storage.exists(storage.join(folder, lease.LOCK))
    assert first != held.attempt


def with_suppress_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


SLOW_FS = """
    import sys, time
    from fsspec.implementations.local import LocalFileSystem
    import fsspec
    class SlowLeaseFS(LocalFileSystem):
        protocol = "slowlease"
        slow = False
        def pipe_file(self, path, value, **kwargs):
            if SlowLeaseFS.slow and "_LEASE.json" in path:
                print("renewal delayed", flush=True)
                time.sleep(float({delay}))
            return super().pipe_file(path, value, **kwargs)
    fsspec.register_implementation("slowlease", SlowLeaseFS, clobber=True)
    from bert_core import lease
    held = lease.acquire("slowlease://{folder}", "test")
    print("held", held.attempt, flush=True)
    SlowLeaseFS.slow = True
    deadline = time.time() + 30
    try:
        while not held.lost and time.time() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:  # a lost lease interrupts the main thread
        pass
    print("lost" if held.lost else "still held", flush=True)
"""


@NEEDS_ROOT
def test_a_renewal_delayed_past_the_ttl_does_not_overwrite_the_new_holders_lease(tmp_path) -> None:
    """The holder's storage sleeps in its write of the lease (a renewal stuck in retries) longer
    than a TTL; a waiter on another machine takes over meanwhile; the late renewal lands nowhere."""
    folder = str(tmp_path / "out")
    old = script(SLOW_FS.format(folder=folder, delay=6), {"BERTPIPE_LEASE_SECONDS": "2"}, machine=True)
    first = _wait_line(old, "held")
    os.environ["BERTPIPE_LEASE_SECONDS"] = "2"
    try:
        held = lease.acquire(folder, "test")
        try:
            assert held.attempt != first
            out = old.communicate(timeout=60)[0]
            assert "renewal delayed" in out and out.strip().endswith("lost"), out
            assert lease.read(folder).attempt == held.attempt and not held.lost
        finally:
            lease.release(held)
    finally:
        del os.environ["BERTPIPE_LEASE_SECONDS"]
    assert lease.read(folder) is None


HOLD_LONG = """
    import time
    from bert_core import lease
    held = lease.acquire({folder!r}, "test")
    print("held", held.attempt, flush=True)
    time.sleep(20)
    print("still mine" if lease.read({folder!r}).attempt == held.attempt and not held.lost else "lost", flush=True)
    lease.release(held)
"""

WAIT = """
    from bert_core import lease
    try:
        held = lease.acquire({folder!r}, "test")
        print("took", held.attempt, flush=True)
    except lease.LeaseHeldError as err:
        print("refused", err, flush=True)
"""


@NEEDS_ROOT
def test_a_waiter_whose_clock_runs_120_s_ahead_does_not_take_over_a_live_holder(tmp_path) -> None:
    folder = str(tmp_path / "out")
    env = {"BERTPIPE_LEASE_SECONDS": "3"}
    holder = script(HOLD_LONG.format(folder=folder), env, machine=True)
    first = _wait_line(holder, "held")
    waiter = script(WAIT.format(folder=folder), {**env, "BERTPIPE_CLOCK_OFFSET": "120",
                                                 "BERTPIPE_LEASE_WAIT": "8"}, machine=True)
    out = waiter.communicate(timeout=60)[0]
    assert out.splitlines()[-1].startswith("refused") and first in out, out
    assert holder.communicate(timeout=60)[0].strip().endswith("still mine")


NO_LINKS = """
    import errno, os, sys, time
    def refuse(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted (no hard links here)")
    os.link = refuse  # a filesystem without hard links (gcsfuse, s3fs-fuse)
    from bert_core import lease, storage
    held = lease.acquire({folder!r}, "test")
    print("held", held.attempt, flush=True)
    time.sleep(1.5)
    storage.write_manifest({folder!r}, stage="test", config={{}}, fence=lease.fence({folder!r}, held.attempt))
    lease.release(held)
    print("done", flush=True)
"""


def test_the_lease_needs_no_hard_links(tmp_path) -> None:
    """No filesystem without link(2) can be mounted here (no vfat module, no FUSE library), so
    link(2) is made to fail in the writers: two at once still take turns, and both finish."""
    folder = str(tmp_path / "out")
    procs = [script(NO_LINKS.format(folder=folder)) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(o.strip().endswith("done") for o in outs), outs
    assert storage.read_manifest(folder)["stage"] == "test"


NO_LOCKS = """
    import errno, fcntl
    def refuse(*args, **kwargs):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = refuse  # a filesystem that cannot lock
    from bert_core import lease
    try:
        lease.acquire({folder!r}, "test")
    except OSError as err:
        print(err)
"""


def test_a_filesystem_that_cannot_lock_is_refused_in_one_line(tmp_path) -> None:
    folder = str(tmp_path / "out")
    out = script(NO_LOCKS.format(folder=folder)).communicate(timeout=60)[0].strip()
    assert len(out.splitlines()) == 1 and "cannot hold a lease" in out, out


def test_an_unreadable_pid_counts_as_alive(tmp_path) -> None:
    """psutil's AccessDenied (``/proc`` mounted hidepid=2): a live holder, never taken over."""
    psutil = pytest.importorskip("psutil")
    record = lease.Record("a", "test", lease._machine(), 1, 1.0, 0.0)
    real = psutil.Process

    class Denied:
        def __init__(self, pid: int) -> None:
            raise psutil.AccessDenied(pid)

    psutil.Process = Denied
    try:
        assert not record.gone()
    finally:
        psutil.Process = real


def test_a_lost_attempt_cannot_commit_even_after_its_check(tmp_path) -> None:
    """The commit is the check: a lease taken over between a stage's check and its manifest still
    stops the manifest, whose temporary name is gone too."""
    folder = str(tmp_path / "out")
    held = lease.acquire(folder, "test")
    held.check()
    held._stop.set()
    other = lease.Record.mine("other", "test", 60, 0)
    assert lease._swap(folder, other, lambda now: now is not None)
    with pytest.raises(lease.LeaseLostError, match="went to another run"):
        storage.write_manifest(folder, stage="test", config={}, fence=lease.fence(folder, held.attempt))
    assert not storage.has_manifest(folder)
    assert not [f for f in storage.list_files(folder) if Path(f).name.startswith(storage.MANIFEST)]
    assert not lease.remove_if_held(folder, held.attempt, folder)
    assert lease.read(folder).attempt == "other"


# --------------------------------------------------------------------------- every writer fenced


def test_the_registry_lock_is_one_exclusive_create(tmp_path) -> None:
    """``create_exclusive`` (the registry's lock): the second create of one name loses, whoever
    wrote first keeps its bytes; on GCS the same step is a generation precondition."""
    uri = str(tmp_path / "registry" / "lock")
    assert lease.create_exclusive(uri, "first")
    assert not lease.create_exclusive(uri, "second")
    assert storage.read_text(uri) == "first"


def test_a_lost_finetune_attempt_clears_nothing_of_the_task_folder(tmp_path) -> None:
    from bert_core.finetune.report import clear_task

    folder = str(tmp_path / "ft" / "sst2")
    storage.write_text(storage.join(folder, "lr1e-4", "seed=1", "metrics.json"), "{}")
    storage.write_manifest(folder, stage="finetune", config={}, task="sst2")
    held = lease.acquire(folder, "finetune")
    held._stop.set()
    assert lease._swap(folder, lease.Record.mine("other", "finetune", 60, 0), lambda now: now is not None)
    with pytest.raises(lease.LeaseLostError, match="went to another run"):
        clear_task(folder, held.attempt)
    assert storage.has_manifest(folder)
    assert storage.exists(storage.join(folder, "lr1e-4", "seed=1", "metrics.json"))
    assert lease.read(folder).attempt == "other"


def test_a_held_finetune_task_folder_is_cleared_but_for_its_lease(tmp_path) -> None:
    from bert_core.finetune.report import clear_task

    folder = str(tmp_path / "ft" / "sst2")
    storage.write_text(storage.join(folder, "lr1e-4", "seed=1", "metrics.json"), "{}")
    storage.write_manifest(folder, stage="finetune", config={}, task="sst2")
    with lease.hold(folder, "finetune") as held:
        clear_task(folder, held.attempt)
        assert {p.name for p in Path(folder).iterdir()} <= {lease.LEASE, lease.LOCK}
        assert lease.read(folder).attempt == held.attempt
    assert list(Path(folder).iterdir()) == []


def test_the_finetune_index_is_written_under_a_lease_of_its_own(tmp_path, monkeypatch) -> None:
    """Several runs write ``finetune/_MANIFEST.json``: one at a time, each under the index
    folder's lease; a writer that cannot get it within BERTPIPE_LEASE_WAIT is refused."""
    from bert_core.finetune.report import write_index

    root = str(tmp_path / "finetune")
    other = lease.acquire(root, "finetune-index")
    monkeypatch.setenv("BERTPIPE_LEASE_WAIT", "1")
    try:
        with pytest.raises(lease.LeaseHeldError, match="is being written by"):
            write_index(root)
        assert not storage.has_manifest(root)
    finally:
        lease.release(other)
    assert write_index(root)["stage"] == "finetune-index"
    assert storage.read_manifest(root)["stage"] == "finetune-index"
    assert lease.read(root) is None


def test_run_once_never_empties_a_folder_another_run_writes(prefect_api, tmp_path, monkeypatch) -> None:
    """A finished folder of another version is emptied only under its lease: while another run
    holds it, ``run_once`` waits (here refused past BERTPIPE_LEASE_WAIT) and removes nothing."""
    from prefect import flow

    from flows.versions import run_once

    folder = str(tmp_path / "finetune" / "minilm" / "sst2")
    storage.write_text(storage.join(folder, "lr1e-4", "seed=1", "metrics.json"), "{}")
    storage.write_manifest(folder, stage="finetune", config={}, version="a")
    other = lease.acquire(folder, "finetune")
    monkeypatch.setenv("BERTPIPE_LEASE_WAIT", "1")

    @flow
    def once() -> None:
        run_once("ft", folder, lambda: None, version="b")

    try:
        with pytest.raises(lease.LeaseHeldError):
            once()
        assert storage.read_manifest(folder)["version"] == "a"
        assert storage.exists(storage.join(folder, "lr1e-4", "seed=1", "metrics.json"))
    finally:
        lease.release(other)


STAGE_SETS = ["--set", "instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10}]",
              "--set", "instances.dupe_factor=1", "--set", "instances.num_shards=1",
              "--set", "instances.shard_multiple_of=1",
              "--set", "pretrain.phases=[{max_seq_length: 64, max_steps: 3, global_batch_size: 8, micro_batch_size: 4, warmup_steps: 1}]"]


@pytest.fixture(scope="module")
def finished_stages(samples_dir, tmp_path_factory) -> dict[str, list[str]]:
    """A finished corpus, vocab and instances folder, each made by its `bertpipe` command: the
    command lines, by stage."""
    from typer.testing import CliRunner

    from flows.cli.main import app

    root = tmp_path_factory.mktemp("finished")
    words = (samples_dir / "books" / "botchan.txt").read_text(encoding="utf-8").split()
    with open(root / "records.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"id": str(i), "text": " ".join(words[2000 + i * 300:2300 + i * 300])}) + "\n")
    corpus, vocab_txt = str(root / "corpus"), str(samples_dir / "models" / "minilm" / "vocab.txt")
    commands = {
        "corpus": ["corpus", "--text", str(root / "records.jsonl"), "--output", corpus, "--workers", "1"],
        "vocab": ["vocab", "--corpus", corpus, "--output", str(root / "vocab"), "--workers", "1",
                  "--set", "vocab.vocab_size=300"],
        "instances": ["instances", "--corpus", corpus, "--vocab", vocab_txt, "--output",
                      str(root / "instances"), "--workers", "1", *STAGE_SETS],
    }
    for args in commands.values():
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    return commands


def _files(folder: str) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


OTHER_SETTING = {"corpus": ("corpus.min_chars_per_doc=7", "corpus.min_chars_per_doc", "50", "7"),
                 "vocab": ("vocab.vocab_size=301", "vocab.vocab_size", "300", "301"),
                 "instances": ("instances.dupe_factor=2", "instances.dupe_factor", "1", "2")}


@pytest.mark.parametrize("stage", ["corpus", "vocab", "instances"])
def test_a_rerun_into_a_finished_folder_rewrites_nothing(stage, finished_stages) -> None:
    """The same command again has nothing to do (exit 0); other settings are refused (exit 2).
    Neither touches a file."""
    from typer.testing import CliRunner

    from flows.cli.main import app

    args = finished_stages[stage]
    output = args[args.index("--output") + 1]
    before = _files(output)
    created = storage.read_manifest(output)["created"]
    same = CliRunner().invoke(app, args)
    assert same.exit_code == 0, same.output
    assert _files(output) == before  # not a byte rewritten, not a file touched

    setting, key, was, now = OTHER_SETTING[stage]
    result = CliRunner().invoke(app, [*args, "--set", setting])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last == (f'{output} is finished (its _MANIFEST.json, stage "{stage}", written {created}, with '
                    f'{key}={was} where this run has {now}); bertpipe never rewrites a finished folder a '
                    f"reader may hold: give a new --output, or remove {output} first"), result.output
    assert _files(output) == before
    assert not storage.exists(storage.join(output, lease.LEASE))
    verified = CliRunner().invoke(app, ["verify", output])
    assert verified.exit_code == 0, verified.output
