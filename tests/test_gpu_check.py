"""benchmarks/gpu_check.py's dry run: every stage of the GPU check on CPU, so the script that a
short GPU slot runs never rots."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import CHECK_STAGES, STAGES, VARIANTS

ROOT = Path(__file__).resolve().parent.parent


# The stages in two runs, so that pytest's two workers can share them; together, every stage.
LAUNCHED = ("env", "e2e", "numerics", "resume", "finetune")
IN_PROCESS = ("variants", "compare", "e2e_large")


def test_the_two_dry_runs_cover_every_stage():
    assert sorted(LAUNCHED + IN_PROCESS) == sorted(STAGES) and "variants" not in CHECK_STAGES


def dry_run(tmp_path, stages: tuple[str, ...]) -> tuple[dict, str]:
    """The check on CPU with a tiny model: each stage's result, and what it printed."""
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--budget-s", "900", "--stages", ",".join(stages)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == list(stages), done.stdout[-3000:]
    failed = {r["stage"]: r.get("error") for r in rows if not r["ok"]}
    assert not failed, failed
    assert done.returncode == 0
    for stage in stages:  # each stage printed its summary line
        assert f"[{stage}] ok" in done.stdout
    return {row["stage"]: row["result"] for row in rows}, done.stdout


@pytest.mark.slow
def test_dry_run_of_the_launched_stages(tmp_path):
    r, _ = dry_run(tmp_path, LAUNCHED)
    assert r["env"]["torch"] and r["env"]["deepspeed"][0].isdigit()
    # the real launcher trained, checkpointed at 2 and 4 and exported; the rate leaves the saves out
    assert r["e2e"]["steps"] == 4 and r["e2e"]["checkpoints"] == ["step2", "step4"] and r["e2e"]["exported"]
    assert r["e2e"]["tokens_per_s"] > 0 and r["e2e"]["checkpoint_seconds"] > 0
    # CPU against "the device" (the CPU here) in fp32: the same numbers
    assert r["numerics"]["fp32_loss_diff"] == 0.0
    # on CPU in fp32 a resume is exact: no checkpoint skipped, the same losses
    assert r["resume"]["resumed_line"] and r["resume"]["skipped"] == []
    assert r["resume"]["steps_compared"] == [3, 4] and r["resume"]["max_loss_diff"] == 0.0
    assert r["finetune"]["score"] is not None and r["finetune"]["train"]["device"] == "cpu"


@pytest.mark.slow
def test_dry_run_of_the_in_process_stages(tmp_path):
    r, _ = dry_run(tmp_path, IN_PROCESS)
    assert r["e2e_large"]["model"] == "mini" and r["e2e_large"]["checkpoints"] == ["step4"]
    # every variant ran on the product's engine, one change after another, each with its figures
    variants = r["variants"]["rows"]
    assert [v["variant"] for v in variants] == [name for name, _, _ in VARIANTS]
    for v in variants:
        assert "error" not in v, v
        assert v["tokens_per_s"] > 0 and set(v["profile"]) == {"matmul", "attention", "elementwise", "idle"}
        assert v["loss_at_step"][0] == r["variants"]["steps"]
        # one fixed batch: the losses stay close to the baseline's
        assert v["loss_diff_vs_baseline"] < 0.05, v
    # static shapes: the real tokens rounded up to one of 8 buckets of B x T / 8 rows
    B = r["variants"]["micro_batch"]
    assert variants[0]["rows"] == variants[0]["real_tokens"]
    assert variants[-1]["rows"] % (B * 128 // 8) == 0 and variants[-1]["shape"] == [B, 128]
    # ours and transformers' computed on the same batch at every micro-batch size
    assert [x["micro_batch"] for x in r["compare"]["rows"]] == [4, 8, 8]
    assert all(x["ratio"] > 0 and x["reference_attention"] == "sdpa" for x in r["compare"]["rows"])
