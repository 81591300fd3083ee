"""benchmarks/gpu/gpu_check.py's dry run: the slot's two calls on CPU, so the script that a short GPU
slot runs never rots; and what a call keeps and ends when it is stopped."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.gpu.gpu_check import (
    LOG,
    RESULTS,
    SLOT_CALLS,
    STAGES,
    VARIANTS,
    Plan,
    build_data,
    start_stage,
    stop_process_tree,
    training_step,
)
from tests.test_ds_config import one_rank  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")


def test_the_slots_two_calls_cover_every_stage_in_order_of_value():
    calls = [SLOT_CALLS[n][0] for n in sorted(SLOT_CALLS)]
    assert all(stages[0] == "env" for stages in calls)  # each call's rows name the card
    assert [s for stages in calls for s in stages if s != "env"] == [s for s in STAGES if s != "env"]
    # eager variants first: the first compile comes after every eager one
    names = [name for name, _, _ in VARIANTS]
    assert names.index("static_shapes") < names.index("compile") < names.index("cuda_graphs")


def rows_of(out: Path) -> list[dict]:
    path = out / RESULTS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def dry_run(tmp_path, call: int) -> tuple[dict, list[dict], str]:
    """The slot's call on CPU with a tiny model: each stage's result, the variants' own rows, and
    what it printed."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.gpu_check", "--dry-run", "--call", str(call),
                           "--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "900"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1200)
    rows = rows_of(out)
    stages = [r for r in rows if "variant" not in r]
    assert [r["stage"] for r in stages] == list(SLOT_CALLS[call][0]), done.stdout[-3000:]
    failed = {r["stage"]: r.get("error") for r in stages if not r["ok"]}
    assert not failed, failed
    assert done.returncode == 0
    for stage in SLOT_CALLS[call][0]:  # each stage printed its summary line, into the log too
        assert f"[{stage}] ok" in done.stdout
    assert f"===== {stage}" in (out / LOG).read_text()
    return ({row["stage"]: row["result"] for row in stages}, [r for r in rows if "variant" in r],
            done.stdout)


@pytest.mark.slow
def test_dry_run_of_the_first_call(tmp_path):
    r, variant_rows, _ = dry_run(tmp_path, 1)
    assert r["env"]["torch"] and r["env"]["deepspeed"][0].isdigit()
    # the real launcher trained, checkpointed at 2 and 4 and exported; the rate leaves the saves out
    assert r["e2e"]["steps"] == 4 and r["e2e"]["checkpoints"] == ["step2", "step4"] and r["e2e"]["exported"]
    assert r["e2e"]["tokens_per_s"] > 0 and r["e2e"]["checkpoint_seconds"] > 0
    # CPU against "the device" (the CPU here) in fp32: the same numbers
    assert r["numerics"]["fp32_loss_diff"] == 0.0
    # bucketed against exact, eagerly: the loader's batch and one whose extra entries are all empty
    buckets = {b["batch"]: b for b in r["numerics"]["buckets"]}
    assert buckets["extra_entries_empty"]["empty_extra_entries"] == buckets["extra_entries_empty"]["extra_entries"]
    assert r["numerics"]["buckets_within_1e-2"]
    # every variant ran on the product's engine, one change after another, each with its figures,
    # and each wrote its own row the moment it finished
    variants = r["variants"]["rows"]
    assert [v["variant"] for v in variants] == [name for name, _, _ in VARIANTS]
    assert [v["variant"] for v in variant_rows] == [name for name, _, _ in VARIANTS]
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


@pytest.mark.slow
def test_dry_run_of_the_second_call(tmp_path):
    r, _, _ = dry_run(tmp_path, 2)
    assert r["e2e_large"]["model"] == "mini" and r["e2e_large"]["checkpoints"] == ["step2", "step4"]
    # ours and transformers' computed on the same batch at every micro-batch size
    assert [x["micro_batch"] for x in r["compare"]["rows"]] == [4, 8, 8]
    assert all(x["ratio"] > 0 and x["reference_attention"] == "sdpa" for x in r["compare"]["rows"])
    # on CPU in fp32 a resume of e2e_large's run is exact: no checkpoint skipped, the same losses
    assert r["resume"]["resumed_line"] and r["resume"]["skipped"] == []
    assert r["resume"]["steps_compared"] == [3, 4] and r["resume"]["max_loss_diff"] == 0.0
    assert r["finetune"]["score"] is not None and r["finetune"]["train"]["device"] == "cpu"


def running_in(work: Path) -> list[int]:
    """Live processes whose command line names ``work`` (a stage, its launcher, its ranks)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(work).encode() in (proc / "cmdline").read_bytes() and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def wait_until(condition, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "waited in vain"
        time.sleep(0.2)


def test_a_stopped_stage_takes_its_launcher_and_ranks_with_it(tmp_path):
    """What a stage timeout does: the stage's group and the launcher's session (its own) end."""
    plan, out, work = Plan(dry_run=True), tmp_path / "out", tmp_path / "work"
    out.mkdir()
    build_data(work, plan)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    proc = start_stage("e2e", work, out, plan)
    try:
        for line in proc.stdout:  # until a rank is training
            if "phase 1 step 1/" in line:
                break
        assert len(running_in(work)) >= 3  # the stage, the launcher, a rank
        stop_process_tree(proc)
        wait_until(lambda: not running_in(work), 30)
    finally:
        proc.kill()


def test_a_stopped_call_keeps_every_row_it_finished(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    call = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.gpu_check", "--dry-run", "--stages", "env,variants",
                             "--out", str(out), "--work", str(work)], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: any("variant" in r for r in rows_of(out)))
        call.send_signal(signal.SIGTERM)
        assert call.wait(60) == 128 + signal.SIGTERM
    finally:
        call.kill()
    rows = rows_of(out)
    assert rows[0]["stage"] == "env" and rows[0]["ok"]
    assert rows[1]["variant"] == VARIANTS[0][0] and rows[1]["ok"]
    log = (out / LOG).read_text()
    assert "===== variants" in log and f"variant {VARIANTS[0][0]}:" in log  # streamed as it ran
    wait_until(lambda: not running_in(work), 30)


class Replayed(torch.nn.Module):
    """A model whose every call overwrites the loss it returned before, as each replay of a CUDA
    graph overwrites the graph's output buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.last = None

    def forward(self, x):
        loss = (self.w * x).sum()
        if self.last is not None:
            with torch.no_grad():
                self.last.copy_(loss)
        self.last = loss
        return {"loss": loss}


def test_each_kept_loss_is_its_own_steps_not_a_later_replays(one_rank):  # noqa: F811
    import deepspeed

    model = Replayed()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        config={"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
    losses: list = []
    step = training_step(engine, {"x": torch.tensor(2.0)}, losses)
    for _ in range(3):
        step()
    # each step lowers the loss from 2: views of the returned losses would all read the last one
    kept = [float(x) for x in losses]
    assert kept[0] == 2.0 and kept[0] > kept[1] > kept[2], kept
