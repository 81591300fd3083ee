"""``pretrain.checkpoint_uri``: each checkpoint copied to a store with its manifest, and a run on a
machine without its run folder resumed from there.

    .venv/bin/python -m pytest -q tests/test_checkpoint_uri.py            # the GCS runs ~2 min
    .venv/bin/python -m pytest -q tests/test_checkpoint_uri.py -m "not slow"

The copy and the download on a local folder as the store; then real 2-rank DeepSpeed runs (the
demo preset, tiny) with ``gs://`` on the GCS emulator: a run uploads every checkpoint, and after
its local run folder is deleted and the store cut back to what a machine lost after its first
upload would have left (a later step without its manifest), the same command resumes from the
store and ends with the uninterrupted run's losses and weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert_core import storage
from bert_core.config import load_config
from bert_core.pretrain.checkpoint_mirror import (
    CheckpointMirror,
    CheckpointMirrorRefused,
)
from bert_core.pretrain.run_folder import (
    check_run_config,
    checkpoint_dir,
    config_changes,
    latest_step,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_gcs import gcs  # noqa: E402, F401 (a fixture: the GCS emulator)
from test_pretrain import PHASE2_STEPS, comm_op, instances, tiny_sets  # noqa: E402, F401 (fixtures)

STEPS = 8  # phase 1: checkpoints at 4 and 8, phase 2 at 4


# --------------------------------------------------------------------------- the copy, on a local store


def fake_step(run: Path, phase: int, step: int, payload: bytes) -> None:
    """A saved step as the run folder holds it (``save_checkpoint``'s layout), ``latest`` on it."""
    folder = run / "checkpoints" / f"phase{phase}" / f"step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(payload)
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(payload[::-1])
    (run / "checkpoints" / f"phase{phase}" / "latest").write_text(f"step{step}")
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "train", "phase": phase, "step": step, "loss": 1.0 / step}) + "\n")


def test_each_step_is_copied_with_its_manifest_and_a_new_machine_takes_the_newest_whole_one(tmp_path):
    config = load_config("demo", None, [f"pretrain.checkpoint_uri={tmp_path / 'store'}"])
    run = tmp_path / "runs" / "v1"
    logged: list[str] = []
    mirror = CheckpointMirror(config, str(run), log=logged.append)
    for step in (2, 4):
        fake_step(run, 1, step, f"weights at {step}".encode() * 100)
        mirror.upload(checkpoint_dir(str(run), 0), step)
    mirror.wait()
    remote = tmp_path / "store" / "v1" / "checkpoints" / "phase1"
    assert (remote / "latest").read_text() == "step4"
    for step in (2, 4):
        manifest = storage.read_manifest(str(remote / f"step{step}"))
        assert manifest["stage"] == "pretrain-checkpoint" and manifest["counts"] == {"phase": 1, "step": step}
        assert sorted(s["path"] for s in manifest["shards"]) == [
            "metrics.jsonl", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
        assert storage.shard_problems(str(remote / f"step{step}"), manifest, checksums=True) == []
    assert (remote / "step2" / "metrics.jsonl").read_text().count("\n") == 1  # the log as it was then
    assert any("uploaded" in line and "step4" in line for line in logged)

    # a later step without its manifest (an upload cut short) is passed over, saying so
    (remote / "step6").mkdir()
    shutil.copy(remote / "step4" / "mp_rank_00_model_states.pt", remote / "step6")
    fresh = tmp_path / "machine2" / "v1"
    logged.clear()
    CheckpointMirror(config, str(fresh), log=logged.append).restore()
    assert latest_step(str(fresh), 0) == 4
    assert (fresh / "checkpoints" / "phase1" / "step4" / "mp_rank_00_model_states.pt").read_bytes() == (
        run / "checkpoints" / "phase1" / "step4" / "mp_rank_00_model_states.pt").read_bytes()
    assert [json.loads(r)["step"] for r in (fresh / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    assert any("passed over" in line and "step6" in line and "no _MANIFEST.json" in line for line in logged)
    assert not list(fresh.rglob(".step*"))  # no download left half-way

    # a whole step whose file was changed after the upload is passed over for the one before
    (remote / "step4" / "mp_rank_00_model_states.pt").write_bytes(b"changed")
    third = tmp_path / "machine3" / "v1"
    logged.clear()
    CheckpointMirror(config, str(third), log=logged.append).restore()
    assert latest_step(str(third), 0) == 2
    assert any("step4" in line and "not the file its manifest lists" in line for line in logged)

    # a run folder as new as the store downloads nothing
    logged.clear()
    CheckpointMirror(config, str(fresh), log=logged.append).restore()
    assert not any("downloaded" in line for line in logged)


def test_a_store_holding_another_configs_run_is_refused_and_an_unwritable_one_named(tmp_path):
    store = tmp_path / "store"
    config = load_config("demo", None, [f"pretrain.checkpoint_uri={store}"])
    run = tmp_path / "runs" / "v1"
    fake_step(run, 1, 2, b"w" * 64)
    mirror = CheckpointMirror(config, str(run))
    mirror.upload(checkpoint_dir(str(run), 0), 2)
    mirror.wait()
    other = load_config("demo", None, [f"pretrain.checkpoint_uri={store}", "pretrain.seed=7"])
    with pytest.raises(Exception, match=r"holds a run of another config \(pretrain.seed: 42 -> 7\)"):
        CheckpointMirror(other, str(tmp_path / "m2" / "v1")).restore()

    (tmp_path / "a-file").write_text("not a folder")
    under_a_file = load_config("demo", None, [f"pretrain.checkpoint_uri={tmp_path / 'a-file'}"])
    with pytest.raises(CheckpointMirrorRefused) as refused:
        CheckpointMirror(under_a_file, str(run), tries=2, backoff=0.01).restore()
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"pretrain.checkpoint_uri {tmp_path / 'a-file'}/v1")
    upload = CheckpointMirror(under_a_file, str(run), tries=2, backoff=0.01)
    upload.upload(checkpoint_dir(str(run), 0), 2)
    with pytest.raises(CheckpointMirrorRefused, match="uploading step 2"):
        upload.wait()


def test_the_checkpoint_uri_enters_neither_the_version_nor_the_run_folders_config(tmp_path):
    from flows.versions import pretrain_version

    root = tmp_path / "root"
    folders = {}
    for stage in ("vocab", "instances"):
        folders[stage] = str(root / stage / "v")
        storage.write_text(storage.join(folders[stage], "part-00000-of-00001.txt"), stage)
        storage.write_manifest(folders[stage], stage=stage, config={},
                               shards=[storage.shard_entry(storage.join(folders[stage], "part-00000-of-00001.txt"))])
    plain = load_config("demo", None, [f"storage_root={root}"])
    copied = load_config("demo", None, [f"storage_root={root}", "pretrain.checkpoint_uri=gs://b/ckpt"])
    reseeded = load_config("demo", None, [f"storage_root={root}", "pretrain.seed=7"])
    version = pretrain_version(plain, folders["instances"], folders["vocab"])
    assert pretrain_version(copied, folders["instances"], folders["vocab"]) == version
    assert pretrain_version(reseeded, folders["instances"], folders["vocab"]) != version  # the hash works
    # a run folder started without a copy resumes with one (and the other way round)
    assert config_changes(plain.model_dump(mode="json"), copied.model_dump(mode="json")) == []
    run = tmp_path / "run"
    fake_step(run, 1, 2, b"w")
    (run / "pretrain_config.json").write_text(json.dumps(plain.model_dump(mode="json")))
    check_run_config(copied, str(run))


BLOCK_S3FS = """
import sys
class NoS3fs:  # as if the package were not installed, whatever this environment holds
    def find_spec(self, name, path=None, target=None):
        if name == "s3fs" or name.startswith("s3fs."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoS3fs())
sys.argv = ["bertpipe", *sys.argv[1:]]
from flows.cli.main import main
main()
"""


def test_s3_without_s3fs_is_one_line_before_any_work(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_S3FS, "pretrain", "--instances", str(tmp_path / "nowhere"), "--output",
         str(run), "--set", "pretrain.checkpoint_uri=s3://bucket/ckpt"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == "pretrain.checkpoint_uri=s3://bucket/ckpt: s3:// needs s3fs: pip install 'bertpipe[s3]'"
    assert "Traceback" not in done.stderr and not run.exists()  # refused before the instances are read
    # the storage seam says the same wherever an s3:// path is read (here, where s3fs is missing)
    if importlib.util.find_spec("s3fs") is None:
        with pytest.raises(storage.SchemeError, match=r"s3:// needs s3fs: pip install 'bertpipe\[s3\]'"):
            storage.exists("s3://bucket/x.jsonl")


# --------------------------------------------------------------------------- real runs on the GCS emulator (slow)


def _launch(config, folder: str, run: str) -> list[str]:
    from bert_core.pretrain.launch import launch_pretraining

    lines: list[str] = []
    launch_pretraining(config, folder, run, on_line=lines.append)
    return lines


def _weights(run: str) -> dict[str, torch.Tensor]:
    from bert_core.model.bert import BertForPreTraining

    return BertForPreTraining.from_pretrained(storage.read_manifest(run)["hf"]).state_dict()


@pytest.fixture(scope="module")
def uploaded_run(gcs, instances, comm_op, tmp_path_factory):  # noqa: F811
    """One uninterrupted run whose checkpoints are copied to the emulator's bucket."""
    uri = storage.join(gcs, "ckpts")
    config = load_config("demo", None, [*tiny_sets(STEPS), f"pretrain.checkpoint_uri={uri}"])
    run = str(tmp_path_factory.mktemp("uploaded") / "v1")
    lines = _launch(config, instances, run)
    return config, run, storage.join(uri, "v1"), lines


@pytest.mark.slow
def test_a_run_uploads_each_checkpoint_with_its_manifest_and_latest(uploaded_run):
    _, run, remote, lines = uploaded_run
    assert remote.startswith("gs://")
    for phase, steps in ((1, [4, 8]), (2, [4])):
        ckpt = storage.join(remote, "checkpoints", f"phase{phase}")
        assert storage.read_text(storage.join(ckpt, "latest")) == f"step{steps[-1]}"
        for step in steps:
            manifest = storage.read_manifest(storage.join(ckpt, f"step{step}"))
            assert manifest["counts"] == {"phase": phase, "step": step}
            local = Path(run, "checkpoints", f"phase{phase}", f"step{step}")
            files = sorted(p.name for p in local.iterdir())
            assert sorted(s["path"] for s in manifest["shards"]) == sorted([*files, "metrics.jsonl"])
            for entry in manifest["shards"]:
                if entry["path"] != "metrics.jsonl":
                    assert entry["sha256"] == storage.sha256(str(local / entry["path"])), entry
    assert sum(line.startswith("uploaded gs://") for line in lines) == 3
    assert storage.read_manifest(run)["counts"]["steps"] == STEPS + PHASE2_STEPS


@pytest.mark.slow
def test_a_new_machine_resumes_from_the_bucket_and_ends_as_the_uninterrupted_run(uploaded_run, instances):  # noqa: F811
    config, run, remote, _ = uploaded_run
    reference = {(r["phase"], r["step"]): r["loss"] for r in _read(run)}
    expected = _weights(run)
    # What a machine lost after the upload of step 4 leaves: step 8's files without their manifest
    # (the upload was cut short), no phase 2, latest on step 4. The run folder goes with the machine.
    fs = storage.filesystem(remote)
    phase1 = storage.join(remote, "checkpoints", "phase1")
    fs.rm(storage.split_protocol(storage.join(phase1, "step8", storage.MANIFEST))[1])
    fs.rm(storage.split_protocol(storage.join(remote, "checkpoints", "phase2"))[1], recursive=True)
    storage.write_text(storage.join(phase1, "latest"), "step4")
    shutil.rmtree(run)

    lines = _launch(config, instances, run)
    said = "\n".join(lines)
    assert f"passed over {phase1}/step8: no _MANIFEST.json" in said, said[-3000:]
    assert f"downloaded {phase1}/step4 (the run folder had no checkpoint)" in said
    assert "phase 1: resumed at step 4" in said
    got = {(r["phase"], r["step"]): r["loss"] for r in _read(run)}
    assert sorted(got) == sorted(reference)  # steps 1-4 from the bucket's log, the rest trained again
    for key in sorted(got):
        assert got[key] == pytest.approx(reference[key], abs=1e-6), (key, got[key], reference[key])
    weights = _weights(run)
    assert weights.keys() == expected.keys()
    assert all(torch.allclose(weights[k], expected[k], atol=1e-6) for k in expected)
    # and the bucket is whole again
    assert storage.has_manifest(storage.join(phase1, "step8"))
    assert storage.read_text(storage.join(remote, "checkpoints", "phase2", "latest")) == f"step{PHASE2_STEPS}"


def _read(run: str) -> list[dict]:
    from bert_core.pretrain.metrics import read_metrics, train_rows

    return train_rows(read_metrics(run))
