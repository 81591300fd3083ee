"""A stop signal ends a command in order: SIGTERM or SIGINT to ``bertpipe run`` in each stage, and
to a Beam stage run alone, exits within 30 s with our own last line and 128 + the signal, ends
every process the command started (Prefect's temporary server, Beam's workers, the DeepSpeed
launcher and its ranks, fine-tuning jobs), leaves no manifest in the stopped stage's folder, and
a rerun finishes (``bertpipe verify`` passes on every folder).

Real processes on the samples: each command runs detached from the terminal (setsid) with a mark in its
environment, which every process it starts inherits, so a process left behind is found even
after it lost its parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from bert_core import storage
from bert_core.lease import LEASE

pytestmark = pytest.mark.slow
STOP_WITHIN_S = 30
MARK = "BERTPIPE_STOP_TEST"
SAMPLE_DUMP = "wikipedia/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.xml.bz2"


def _env(tmp_path: Path, mark: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "OMP_NUM_THREADS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", MARK: mark}
    env.pop("PREFECT_API_URL", None)  # Prefect's own temporary server, as a new user has it
    return env


def _run_args(samples: Path, tasks: Path, root: Path) -> list[str]:
    """``bertpipe run`` with the demo preset cut to about a minute."""
    sets = [f"storage_root={root}", "corpus.wikipedia=[]", "corpus.text=[]",
            f"corpus.books=[{samples}/books/botchan.txt]", "vocab.vocab_size=1000",
            "instances.dupe_factor=1", "instances.num_shards=2",
            "pretrain.phases=[{max_seq_length: 64, max_steps: 4, global_batch_size: 16, "
            "micro_batch_size: 8, warmup_steps: 1}]",
            "pretrain.log_every=1", "pretrain.checkpoint_every=2",
            "finetune.tasks=[sentiment]", "finetune.seeds=[1]", f"finetune.data_dir={tasks}",
            "finetune.max_train_examples=32", "finetune.epochs=[1]", "finetune.extra_checkpoints=[]",
            "finetune.random_init_baseline=false"]
    return ["run", *(a for s in sets for a in ("--set", s))]


def _bertpipe(args: list[str], env: dict[str, str], out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], env=env, cwd=Path(__file__).parent.parent,
                            stdout=open(out / "stdout", "wb"), stderr=open(out / "stderr", "wb"),
                            start_new_session=True)


def _lease_in(root: Path, stage: str, proc: subprocess.Popen, timeout: float = 600) -> Path:
    """The folder of ``stage`` under ``root`` whose lease the command holds, once it has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted((root / stage).glob(f"**/{LEASE}")) if (root / stage).exists() else []
        if found:
            return found[0].parent
        assert proc.poll() is None, f"the command ended (exit {proc.returncode}) before {stage} began"
        time.sleep(0.05)
    raise AssertionError(f"{stage} did not begin within {timeout} s")


def _left(mark: str) -> list[str]:
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            pass
    return left


def _stop(proc: subprocess.Popen, signum: int, mark: str, out: Path) -> str:
    """Send ``signum``; assert the exit code, the time, that nothing is left; the last line."""
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        code = proc.wait(STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running {STOP_WITHIN_S} s after {signal.Signals(signum).name}") from None
    took = time.monotonic() - sent
    time.sleep(0.5)  # a process signalled as the command ended has gone by now
    left = _left(mark)
    for line in left:
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, f"left running: {left}"
    assert code == 128 + signum, (code, (out / "stderr").read_text()[-2000:])
    assert took < STOP_WITHIN_S
    lines = (out / "stderr").read_text(encoding="utf-8").strip().splitlines()
    return lines[-1]


def _verify_all(root: Path, env: dict[str, str]) -> None:
    stages = ("corpus", "vocab", "instances", "pretrain", "finetune")
    folders = [m.parent for stage in stages for m in root.glob(f"{stage}/*/{storage.MANIFEST}")]
    assert {f.parent.name for f in folders} == set(stages)
    for folder in folders:
        done = subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(folder)], env=env,
                              capture_output=True, text=True, cwd=Path(__file__).parent.parent)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("stage", ["corpus", "vocab", "instances", "pretrain", "finetune"])
def test_sigterm_to_run_in_each_stage_ends_everything_and_a_rerun_finishes(
        stage, samples_dir, sentiment_tasks, tmp_path):
    root, mark = tmp_path / "data", uuid.uuid4().hex
    env, args = _env(tmp_path, mark), _run_args(samples_dir, sentiment_tasks, root)
    proc = _bertpipe(args, env, tmp_path)
    folder = _lease_in(root, stage, proc)
    if stage == "pretrain":  # stopped while its ranks train
        while not any("deepspeed" in " ".join(c.cmdline()) for c in psutil.Process(proc.pid).children(True)):
            assert proc.poll() is None
            time.sleep(0.05)
    last = _stop(proc, signal.SIGTERM, mark, tmp_path)
    assert last == (f"stopped by SIGTERM during {stage}; run the same command again to resume "
                    "(finished stages are kept)")
    assert not (folder / storage.MANIFEST).exists()
    assert not (folder / LEASE).exists()  # a fine-tuning job in a thread ends at its next step

    rerun = subprocess.run([sys.executable, "-m", "flows.cli", *args], env=_env(tmp_path, "rerun"),
                           capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent.parent)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _verify_all(root, env)


def test_sigint_to_run_in_pretraining_ends_the_launcher_and_its_ranks(samples_dir, sentiment_tasks, tmp_path):
    root, mark = tmp_path / "data", uuid.uuid4().hex
    proc = _bertpipe(_run_args(samples_dir, sentiment_tasks, root), _env(tmp_path, mark), tmp_path)
    folder = _lease_in(root, "pretrain", proc)
    while not any("deepspeed" in " ".join(c.cmdline()) for c in psutil.Process(proc.pid).children(True)):
        assert proc.poll() is None
        time.sleep(0.05)
    assert _stop(proc, signal.SIGINT, mark, tmp_path).startswith("stopped by SIGINT during pretrain; ")
    assert not (folder / storage.MANIFEST).exists() and not (folder / LEASE).exists()


def test_sigterm_to_a_beam_stage_alone_ends_its_workers_and_a_rerun_finishes(samples_dir, tmp_path):
    # The sample dump is large enough for the local runner to start two worker processes.
    out, mark = tmp_path / "corpus", uuid.uuid4().hex
    args = ["corpus", "--wikipedia", str(samples_dir / SAMPLE_DUMP), "--output", str(out), "--workers", "2",
            "--set", f"storage_root={tmp_path / 'data'}"]
    env = _env(tmp_path, mark)
    proc = _bertpipe(args, env, tmp_path)
    _lease_in(tmp_path, "corpus", proc)
    while not any("sdk_worker" in " ".join(c.cmdline()) for c in psutil.Process(proc.pid).children(True)):
        assert proc.poll() is None
        time.sleep(0.05)
    last = _stop(proc, signal.SIGTERM, mark, tmp_path)
    assert last == ("stopped by SIGTERM during corpus; run the same command again to resume "
                    "(finished stages are kept)")
    assert not (out / storage.MANIFEST).exists() and not (out / LEASE).exists()
    assert subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True,
                          cwd=Path(__file__).parent.parent).returncode == 0
    done = subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(out)], env=env, capture_output=True,
                          text=True, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stdout + done.stderr
