"""Concurrent writers of one folder: real `bertpipe` processes of the same stage with the same
inputs, started together (or one killed with SIGKILL). Each case ends with every run finished and
outputs byte-identical to a single run's, or with one waiting on the other; `bertpipe verify` is
clean on every folder with a manifest. Where a test needs the runs to overlap, it holds the
folder's lease while they start."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bert_core import lease, storage

sys.path.insert(0, str(Path(__file__).parent))
from test_gcs import gcs  # noqa: E402, F401  (the emulator fixture)

SETS = ["--set", "instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10}]",
        "--set", "instances.dupe_factor=1",
        "--set", "pretrain.phases=[{max_seq_length: 64, max_steps: 3, global_batch_size: 8, micro_batch_size: 4, "
        "learning_rate: 0.003, warmup_steps: 1}]"]


def bertpipe(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    return [(p.wait(timeout), p.stdout.read()) for p in procs]


def verify_all(root: str) -> None:
    """`bertpipe verify` on every folder under ``root`` with a manifest of its own stage."""
    tops = sorted({m.rsplit("/", 1)[0] for m in storage.glob(storage.join(root, "**", storage.MANIFEST))})
    tops = [t for t in tops if not any(t != o and t.startswith(o + "/") for o in tops)]
    assert tops
    for folder in tops:
        out = subprocess.run([sys.executable, "-m", "flows.cli", "verify", folder], capture_output=True,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stdout + out.stderr
        assert not storage.exists(storage.join(folder, lease.LEASE))


def shard_bytes(folder: str) -> dict[str, bytes]:
    """Every shard a manifest under ``folder`` names, by its path below ``folder``."""
    found = {}
    for m in storage.glob(storage.join(folder, "**", storage.MANIFEST)):
        sub = m.rsplit("/", 1)[0]
        for uri in storage.shard_uris(sub):
            with storage.open_file(uri, "rb") as f:
                found[uri[len(storage.to_uri(folder)):]] = f.read()
    return found


@pytest.fixture(scope="module")
def inputs(samples_dir, tmp_path_factory) -> dict[str, str]:
    """Text records cut from a sample book, the corpus made of them and a vocab file."""
    root = tmp_path_factory.mktemp("concurrent")
    words = (samples_dir / "books" / "botchan.txt").read_text(encoding="utf-8").split()
    with open(root / "records.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": str(i), "text": " ".join(words[2000 + i * 300:2000 + i * 300 + 300])}) + "\n")
    corpus = str(root / "corpus")
    code, out = finish([bertpipe("corpus", "--text", str(root / "records.jsonl"), "--output", corpus,
                                 "--workers", "1")])[0]
    assert code == 0, out
    return {"records": str(root / "records.jsonl"), "corpus": corpus,
            "vocab": str(samples_dir / "models" / "minilm" / "vocab.txt")}


def stage_args(stage: str, inputs: dict[str, str], output: str) -> list[str]:
    if stage == "corpus":
        return ["corpus", "--text", inputs["records"], "--output", output, "--workers", "1"]
    if stage == "vocab":
        return ["vocab", "--corpus", inputs["corpus"], "--output", output, "--workers", "1",
                "--set", "vocab.vocab_size=300"]
    return ["instances", "--corpus", inputs["corpus"], "--vocab", inputs["vocab"], "--output", output,
            "--workers", "1", *SETS]


def single_run(stage: str, inputs: dict[str, str], output: str) -> dict[str, bytes]:
    code, out = finish([bertpipe(*stage_args(stage, inputs, output))])[0]
    assert code == 0, out
    return shard_bytes(output)


def drained(proc: subprocess.Popen) -> tuple[list[str], threading.Thread]:
    """The process's output lines as they come, read by a thread of their own."""
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader


def concurrent_runs(stage: str, inputs: dict[str, str], root: Path, writers: int) -> None:
    """``writers`` runs of ``stage`` into one folder at once, started while this test holds the
    folder's lease so that all of them are running when it is let go: all finish, one folder, the
    bytes of a single run, verify clean."""
    out = str(root / "together")
    held = lease.acquire(out, stage)
    procs = [bertpipe(*stage_args(stage, inputs, out)) for _ in range(writers)]
    outputs = [drained(p) for p in procs]
    deadline = time.time() + 300
    while time.time() < deadline and not all(
            any("waiting for it to finish" in line for line in lines) or p.poll() is not None
            for p, (lines, _) in zip(procs, outputs, strict=True)):
        time.sleep(0.2)
    lease.release(held)
    for p, (lines, reader) in zip(procs, outputs, strict=True):
        code = p.wait(600)
        reader.join()
        assert code == 0, "".join(lines)[-3000:]
        assert any("waiting for it to finish" in line for line in lines)
    verify_all(out)
    assert shard_bytes(out) == single_run(stage, inputs, str(root / "alone"))


@pytest.mark.parametrize("stage", [pytest.param("corpus", marks=pytest.mark.slow),
                                   pytest.param("vocab", marks=pytest.mark.slow), "instances"])
def test_two_runs_of_a_stage_at_once_leave_one_whole_folder(stage, inputs, tmp_path) -> None:
    concurrent_runs(stage, inputs, tmp_path, 2)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["corpus", "vocab", "instances"])
def test_three_runs_of_a_stage_at_once_leave_one_whole_folder(stage, inputs, tmp_path) -> None:
    concurrent_runs(stage, inputs, tmp_path, 3)


def hold_and_sleep(folder: str) -> None:
    held = lease.acquire(folder, "test")
    print(held.attempt, flush=True)
    time.sleep(600)


def test_a_lease_being_renewed_is_never_read_half_written(tmp_path) -> None:
    """A waiting run reads the lease while its holder rewrites it: it must see the old record or
    the new one, never a file cut short, which it would take for a dead holder's and take over."""
    held = lease.acquire(str(tmp_path / "out"), "corpus")
    stop = threading.Event()

    def renew() -> None:
        while not stop.is_set():
            held.renew()

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        seen = {lease.read(held.folder).attempt for _ in range(3000)}
    finally:
        stop.set()
        renewer.join()
    lease.release(held)
    assert seen == {held.attempt}


def test_a_killed_holder_is_taken_over_and_its_leftovers_cleared(tmp_path) -> None:
    folder = str(tmp_path / "out")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from tests.test_concurrent_writers import "
                               f"hold_and_sleep; hold_and_sleep({folder!r})"], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parent.parent)
    dead = holder.stdout.readline().strip()
    assert lease.read(folder).attempt == dead and lease.in_progress(folder)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.time()
    with lease.hold(folder, "test") as held:
        assert held.attempt != dead and not held.finished
        assert time.time() - start < 5  # a dead pid on this machine is not waited for
    assert lease.read(folder) is None


def test_a_second_writer_is_refused_in_one_line_past_its_wait(inputs, tmp_path) -> None:
    folder = str(tmp_path / "out")
    holder = subprocess.Popen([sys.executable, "-c", "from tests.test_concurrent_writers import "
                               f"hold_and_sleep; hold_and_sleep({folder!r})"], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parent.parent)
    try:
        holder.stdout.readline()
        code, out = finish([bertpipe(*stage_args("instances", inputs, folder), env={"BERTPIPE_LEASE_WAIT": "0"})])[0]
    finally:
        holder.kill()
        holder.wait()
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 3, out
    assert "Traceback" not in out
    assert "is being written by attempt" in lines[-1] and "BERTPIPE_LEASE_WAIT" in lines[-1], lines[-1]
    assert not storage.has_manifest(folder)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["corpus", "vocab", "instances"])
def test_a_writer_killed_at_a_random_point_then_a_rerun(stage, inputs, tmp_path) -> None:
    out = str(tmp_path / "together")
    first = bertpipe(*stage_args(stage, inputs, out))
    second = bertpipe(*stage_args(stage, inputs, out))
    time.sleep(random.uniform(1.0, 8.0))
    first.send_signal(signal.SIGKILL)
    first.wait()
    code, text = finish([second])[0]
    assert code == 0, text[-3000:]
    verify_all(out)
    committed = shard_bytes(out)
    assert committed == single_run(stage, inputs, str(tmp_path / "alone"))
    code, text = finish([bertpipe(*stage_args(stage, inputs, out))])[0]  # the same command again: nothing to do
    assert code == 0 and "is finished already with these settings" in text, text[-3000:]
    assert shard_bytes(out) == committed


def test_pretraining_checks_the_eval_split_and_names_the_file(inputs, tmp_path) -> None:
    from bert_core.pretrain.run_folder import check_splits

    out = str(tmp_path / "instances")
    code, text = finish([bertpipe(*stage_args("instances", inputs, out))])[0]
    assert code == 0, text
    check_splits(out, [64])
    shard = Path(storage.shard_uris(out + "/seq64/eval")[0])
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(storage.ManifestError, match=r"seq64/eval/part-00000-of-00001\.parquet has 100 bytes"):
        check_splits(out, [64])
    (Path(out) / "seq64" / "eval" / storage.MANIFEST).unlink()
    with pytest.raises(storage.UnfinishedWriteError, match="seq64/eval"):
        check_splits(out, [64])


@pytest.mark.slow
@pytest.mark.parametrize("writers", [2, 3])
@pytest.mark.parametrize("stage", ["corpus", "vocab", "instances"])
def test_runs_of_a_stage_at_once_on_gcs(stage, writers, inputs, gcs) -> None:  # noqa: F811
    out = f"{gcs}/concurrent-{stage}-{writers}/together"
    results = finish([bertpipe(*stage_args(stage, inputs, out)) for _ in range(writers)])
    for code, text in results:
        assert code == 0, text[-3000:]
    verify_all(out)
    assert shard_bytes(out) == single_run(stage, inputs, f"{gcs}/concurrent-{stage}-{writers}/alone")


PRETRAIN_SETS = [
    "model.hidden_size=64", "model.num_attention_heads=2", "model.intermediate_size=128",
    "model.num_hidden_layers=1", "pretrain.log_every=1", "pretrain.checkpoint_every=1",
]


@pytest.mark.slow
@pytest.mark.parametrize("writers", [2, 3])
def test_pretraining_runs_into_one_folder_at_once(writers, inputs, tmp_path) -> None:
    instances = str(tmp_path / "instances")
    code, text = finish([bertpipe(*stage_args("instances", inputs, instances))])[0]
    assert code == 0, text
    run = str(tmp_path / "run")
    args = ["pretrain", "--instances", instances, "--output", run, *SETS[2:],
            *(a for s in PRETRAIN_SETS for a in ("--set", s))]
    results = finish([bertpipe(*args) for _ in range(writers)])
    for code, text in results:
        assert code == 0, text[-3000:]
    assert sum("finished already" in text for _, text in results) == writers - 1
    verify_all(instances)
    verify_all(run)
    assert not storage.exists(f"{run}/{lease.LEASE}")


@pytest.mark.slow
def test_two_whole_pipeline_runs_at_once_both_finish_and_every_folder_verifies(
        prefect_api, samples_dir, make_pipeline_config, tmp_path) -> None:
    """Two `bertpipe run` of one config on one storage root at the same moment (a schedule and a
    manual run): both exit 0, each stage is done once and read whole by both, and every folder
    verifies."""
    import yaml

    root = tmp_path / "data"
    config = make_pipeline_config(samples_dir, root)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {"PREFECT_API_URL": prefect_api.api}
    results = finish([bertpipe("run", "--config", str(path), env=env) for _ in range(2)], timeout=900)
    for code, text in results:
        assert code == 0, text[-3000:]
    outputs = [[line.split()[-1] for line in text.splitlines() if line.startswith(("corpus ", "instances "))]
               for _, text in results]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 2  # the same folders, whoever ran them
    for stage in ("corpus", "vocab", "instances"):
        (version,) = [p for p in (root / stage).iterdir() if p.is_dir()]
        verify_all(str(version))
    for run in (root / "pretrain").iterdir():
        verify_all(str(run))


def processes_naming(text: str) -> list[str]:
    """Command lines of the live processes that name ``text`` (a run folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.slow
def test_a_pretraining_killed_at_a_random_point_takes_its_ranks_with_it_and_a_rerun_finishes(
        inputs, tmp_path) -> None:
    """SIGKILL on `bertpipe pretrain` gives its launcher no chance to clean up: the launcher
    ends with it all the same (and stops its ranks), and the rerun resumes and finishes a run
    folder that verifies."""
    instances = str(tmp_path / "instances")
    code, text = finish([bertpipe(*stage_args("instances", inputs, instances))])[0]
    assert code == 0, text
    run = str(tmp_path / "run")
    args = ["pretrain", "--instances", instances, "--output", run, *SETS[2:],
            *(a for s in PRETRAIN_SETS for a in ("--set", s)), "--set", "pretrain.phases.0.max_steps=30"]
    first = bertpipe(*args)
    deadline = time.monotonic() + 300
    while not storage.exists(f"{run}/metrics.jsonl") and time.monotonic() < deadline:  # the ranks train
        time.sleep(0.5)
    time.sleep(random.uniform(0.0, 3.0))
    first.send_signal(signal.SIGKILL)
    first.wait()
    deadline = time.monotonic() + 60
    while processes_naming(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_naming(run) == []  # no launcher or rank outlives the command
    code, text = finish([bertpipe(*args)])[0]  # the rerun
    assert code == 0, text[-3000:]
    verify_all(run)
    verify_all(instances)
