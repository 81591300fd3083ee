"""``bertpipe pretrain --extend-to N``: the plan per schedule, the one-line refusals, and real
2-rank CPU DeepSpeed runs extended in their folder.

    .venv/bin/python -m pytest -q tests/test_extend.py            # all (the slow ones ~3 min)
    .venv/bin/python -m pytest -q tests/test_extend.py -m "not slow"

The runs use the real launcher, the real Botchan instances and vocab (tests/test_data.py) and a
tiny model with dropout 0; a run extended by re-entry must give the losses, rates, data epochs
and final weights of a run set to N from the start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert_core import storage
from bert_core.config import load_config
from bert_core.model.schedule import warmup_decay_lr
from bert_core.pretrain.extend import (
    EXTENDED_FILE,
    REENTER,
    RESTRETCH,
    ExtensionRefused,
    describe,
    extend_run,
    extension_plan,
    version_extensions,
)
from bert_core.pretrain.launch import ensure_cpu_comm_op
from bert_core.pretrain.loop import check_instances
from bert_core.pretrain.metrics import read_metrics, train_rows
from bert_core.pretrain.run_folder import CONFIG_FILE, load_run_config

sys.path.insert(0, str(Path(__file__).parent))
from test_data import make_instances  # noqa: E402
from test_pretrain import free_port  # noqa: E402


def tiny_sets(steps: int, warmup: int, checkpoint_every: int) -> list[str]:
    return [
        "model.hidden_size=64", "model.num_attention_heads=2", "model.intermediate_size=128",
        "model.num_hidden_layers=1", "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0",
        "instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10}]",
        f"pretrain.phases=[{{max_seq_length: 64, max_steps: {steps}, global_batch_size: 8, "
        f"micro_batch_size: 4, learning_rate: 0.003, warmup_steps: {warmup}}}]",
        "pretrain.log_every=1", f"pretrain.checkpoint_every={checkpoint_every}", "pretrain.monitor=none",
    ]


def config(steps: int, warmup: int = 2, checkpoint_every: int = 3):
    return load_config("demo", None, tiny_sets(steps, warmup, checkpoint_every))


# --------------------------------------------------------------------------- the plan (fast)


def test_the_rates_agree_up_to_step_warmup_plus_one_and_differ_after():
    short, long = warmup_decay_lr(1.0, 4, 10), warmup_decay_lr(1.0, 4, 20)
    assert [short(k) for k in range(1, 6)] == [0.0, 0.25, 0.5, 0.75, 1.0]  # step 5 = iteration 4: the peak
    assert [short(k) for k in range(1, 6)] == [long(k) for k in range(1, 6)]
    assert short(6) != long(6) and short(11) == 0.0 and long(11) == pytest.approx(10 / 16)
    # DeepSpeed warms up over at least 2 iterations
    assert [warmup_decay_lr(1.0, 1, 5)(k) for k in range(1, 5)] == [0.0, 0.5, 1.0, 2 / 3]


def test_extension_plan_reenters_before_the_schedules_differ_else_restretches():
    # warm-up 2: the rates of a run set to 5 and one set to 8 agree up to step 3, a checkpoint step
    step, schedule = extension_plan(config(5, warmup=2, checkpoint_every=3).pretrain, 5, 8)
    assert (step, schedule.rule) == (3, REENTER)
    assert [schedule.lr(k) for k in range(1, 9)] == [warmup_decay_lr(0.003, 2, 8)(k) for k in range(1, 9)]
    # the newest of several early checkpoints
    assert extension_plan(config(9, warmup=4, checkpoint_every=2).pretrain, 9, 12)[0] == 4
    # a run that ended in its warm-up continues from its end: the same run as one set to N
    assert extension_plan(config(3, warmup=3, checkpoint_every=10).pretrain, 3, 30)[0] == 3
    # warm-up 1 is 2 iterations: up to step 3 the rates agree
    assert extension_plan(config(3, warmup=1, checkpoint_every=4).pretrain, 3, 5)[0] == 3
    # no checkpoint up to step warmup + 1: from the last step, on the N run's schedule from there
    step, schedule = extension_plan(config(5, warmup=1, checkpoint_every=4).pretrain, 5, 7)
    assert (step, schedule.rule) == (5, RESTRETCH)
    assert schedule.lr(6) == pytest.approx(0.003 * 2 / 5) and schedule.lr(8) == 0.0
    with pytest.raises(ExtensionRefused, match="has 5 steps already; give more than 5"):
        extension_plan(config(5).pretrain, 5, 5)


def test_a_version_counts_the_restretches_since_the_last_reentry():
    re = {"phase": 1, "from": 5, "to": 8, "resume_step": 3, "rule": REENTER, "at": "t0"}
    st = {"phase": 1, "from": 8, "to": 12, "resume_step": 8, "rule": RESTRETCH, "at": "t1"}
    assert version_extensions([]) == [] and version_extensions([re]) == []
    assert version_extensions([re, st]) == [{k: st[k] for k in ("phase", "from", "to", "resume_step", "rule")}]
    assert version_extensions([st, re]) == []  # a re-entry replays the run set to N exactly


def test_pretrain_version_of_an_extended_run(tmp_path):
    from flows.versions import pretrain_version

    folders = {}
    for stage in ("instances", "vocab"):
        folders[stage] = str(tmp_path / stage)
        storage.write_manifest(folders[stage], stage=stage, config={})
    cfg8 = config(8).model_copy(update={"storage_root": str(tmp_path)})
    plain = pretrain_version(cfg8, folders["instances"], folders["vocab"])
    re = {"phase": 1, "from": 5, "to": 8, "resume_step": 3, "rule": REENTER, "at": "t"}
    st = re | {"resume_step": 5, "rule": RESTRETCH}
    assert pretrain_version(cfg8, folders["instances"], folders["vocab"], [re]) == plain
    stretched = pretrain_version(cfg8, folders["instances"], folders["vocab"], [st])
    assert stretched != plain
    assert pretrain_version(cfg8, folders["instances"], folders["vocab"], [st | {"at": "later"}]) == stretched


# --------------------------------------------------------------------------- refusals (fast)


def _finished_run(tmp_path: Path, cfg, steps: list[int]) -> str:
    """A run folder as a finished run leaves it: its manifest and step folders with a model file."""
    run = tmp_path / "run"
    for s in steps:
        (run / "checkpoints" / "phase1" / f"step{s}").mkdir(parents=True)
        (run / "checkpoints" / "phase1" / f"step{s}" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (run / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json")))
    storage.write_manifest(str(run), stage="pretrain", config=cfg)
    return str(run)


def test_refusals_are_one_line_and_leave_the_folder_as_it_was(tmp_path):
    cfg = config(5)
    with pytest.raises(ExtensionRefused, match="no such folder"):
        extend_run(cfg, str(tmp_path / "nope"), 8)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ExtensionRefused, match="is not a pre-training run"):
        extend_run(cfg, str(empty), 8)
    storage.write_manifest(str(tmp_path / "corpus"), stage="corpus", config={})
    with pytest.raises(ExtensionRefused, match="output of the corpus stage"):
        extend_run(cfg, str(tmp_path / "corpus"), 8)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json")))
    with pytest.raises(ExtensionRefused, match="has not finished .* without --extend-to to resume it"):
        extend_run(cfg, str(unfinished), 8)

    run = _finished_run(tmp_path, cfg, [5])  # step 3, where the rule re-enters, is gone
    with pytest.raises(ExtensionRefused, match="has 5 steps already"):
        extend_run(cfg, run, 4)
    with pytest.raises(ExtensionRefused, match=r"phase1/step3: missing, and extending to 8 steps re-enters"):
        extend_run(cfg, run, 8)
    with pytest.raises(Exception, match="with another config"):
        extend_run(config(5, warmup=1), run, 8)
    assert storage.has_manifest(run) and not (Path(run) / EXTENDED_FILE).exists()


def test_extend_run_prepares_the_folder_and_goes_on_after_a_stop(tmp_path):
    cfg = config(5)
    run = _finished_run(tmp_path, cfg, [3, 5])
    ckpt = Path(run, "checkpoints", "phase1")
    with pytest.raises(ExtensionRefused, match="pre-training stopped: .*nope"):  # checked first
        extend_run(cfg, run, 8, check=lambda c: check_instances(c, str(tmp_path / "nope")))
    assert storage.has_manifest(run) and (ckpt / "step5").exists()
    target = extend_run(cfg, run, 8)
    assert target.pretrain.phases[-1].max_steps == 8
    assert load_run_config(str(Path(run) / CONFIG_FILE)).pretrain.phases[-1].max_steps == 8
    assert not storage.has_manifest(run) and not (ckpt / "step5").exists()
    assert (ckpt / "latest").read_text() == "step3"
    [entry] = json.loads((Path(run) / EXTENDED_FILE).read_text())
    assert {k: entry[k] for k in ("phase", "from", "to", "resume_step", "rule")} == {
        "phase": 1, "from": 5, "to": 8, "resume_step": 3, "rule": REENTER}
    assert "re-entering at step 3" in describe(entry) and "the run set to 8 from the start" in describe(entry)
    # stopped before it finished: the same --extend-to goes on, another one is refused
    assert extend_run(cfg, run, 8).pretrain.phases[-1].max_steps == 8
    assert (ckpt / "step3").exists()
    with pytest.raises(ExtensionRefused, match="extension to 8 steps has not finished; run --extend-to 8"):
        extend_run(cfg, run, 9)


def test_the_command_refuses_in_one_line_with_exit_2(tmp_path):
    bertpipe = str(Path(sys.executable).with_name("bertpipe"))
    proc = subprocess.run([bertpipe, "pretrain", "--instances", str(tmp_path), "--output", str(tmp_path / "gone"),
                           "--extend-to", "9"], capture_output=True, text=True, timeout=120)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, lines
    assert "no such folder" in lines[-1] and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- real runs (slow)


@pytest.fixture(scope="module")
def instances(tmp_path_factory, samples_dir) -> str:
    return make_instances(tmp_path_factory.mktemp("extend"), samples_dir, num_shards=4, max_docs=10)


@pytest.fixture(scope="module")
def comm_op() -> None:
    ensure_cpu_comm_op(print)  # paid once per machine (cached), before the first launch


def _pretrain(instances: str, run: Path, sets: list[str], *extra: str) -> None:
    cli = [str(Path(sys.executable).with_name("bertpipe")), "pretrain", "--preset", "demo",
           "--instances", instances, "--output", str(run),
           *[a for s in [*sets, f"pretrain.master_port={free_port()}"] for a in ("--set", s)], *extra]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def _steps(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in train_rows(read_metrics(str(run)))}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "hf" / "model.safetensors"))


@pytest.mark.slow
def test_a_run_extended_by_reentry_is_the_run_set_to_n_from_the_start(instances, comm_op, tmp_path):
    """Warm-up 2, a checkpoint every 3 steps: a run to 5 extended to 8 re-enters at step 3 and
    gives the per-step losses, rates, epochs and final weights of a run set to 8."""
    M, N = 5, 8
    extended, reference = tmp_path / "extended", tmp_path / "reference"
    _pretrain(instances, extended, tiny_sets(M, 2, 3))
    assert max(_steps(extended)) == M and storage.has_manifest(str(extended))
    _pretrain(instances, extended, tiny_sets(M, 2, 3), "--extend-to", str(N))
    _pretrain(instances, reference, tiny_sets(N, 2, 3))

    got, want = _steps(extended), _steps(reference)
    assert sorted(got) == sorted(want) == list(range(1, N + 1))
    assert want[N]["epoch"] > want[1]["epoch"]  # the data order runs on into a new epoch
    for k in want:
        assert got[k]["loss"] == pytest.approx(want[k]["loss"], abs=1e-6), k
        assert got[k]["lr"] == pytest.approx(want[k]["lr"], rel=1e-9, abs=1e-12), k
        assert got[k]["epoch"] == want[k]["epoch"], k
    assert [got[k]["max_steps"] for k in got] == [M] * 3 + [N] * (N - 3)  # rows up to the re-entry kept
    _, schedule = extension_plan(config(M).pretrain, M, N)
    assert [got[k]["lr"] for k in range(1, N + 1)] == pytest.approx([schedule.lr(k) for k in range(1, N + 1)])
    a, b = _weights(extended), _weights(reference)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)

    manifest = storage.read_manifest(str(extended))
    assert manifest["config"]["pretrain"]["phases"][0]["max_steps"] == N and manifest["counts"]["steps"] == N
    [entry] = manifest["extended"]
    assert {k: entry[k] for k in ("from", "to", "resume_step", "rule")} == {
        "from": M, "to": N, "resume_step": 3, "rule": REENTER}
    assert "extended" not in storage.read_manifest(str(reference))


@pytest.mark.slow
def test_a_run_without_an_early_checkpoint_is_restretched_from_its_end(instances, comm_op, tmp_path):
    """Warm-up 1 (2 iterations), a checkpoint every 4 steps, a run to 5 extended to 7: no checkpoint
    up to step 3, so it goes on from step 5 at the rates of a run set to 7 (not that run: steps 4
    and 5 ran at lower rates)."""
    M, N = 5, 7
    run = tmp_path / "run"
    _pretrain(instances, run, tiny_sets(M, 1, 4))
    before = _steps(run)
    _pretrain(instances, run, tiny_sets(M, 1, 4), "--extend-to", str(N))
    got = _steps(run)
    assert sorted(got) == list(range(1, N + 1))
    assert all(got[k]["loss"] == before[k]["loss"] for k in range(1, M + 1))  # kept as they were
    old = warmup_decay_lr(0.003, 1, M)
    _, schedule = extension_plan(config(M, 1, 4).pretrain, M, N)
    assert schedule.rule == RESTRETCH
    assert [got[k]["lr"] for k in range(1, M + 1)] == pytest.approx([old(k) for k in range(1, M + 1)])
    assert [got[k]["lr"] for k in range(M + 1, N + 1)] == pytest.approx([schedule.lr(k) for k in range(M + 1, N + 1)])
    assert got[M + 1]["lr"] == pytest.approx(0.003 * 2 / 5)  # the N run's rate at step 6, not 0
    [entry] = storage.read_manifest(str(run))["extended"]
    assert {k: entry[k] for k in ("from", "to", "resume_step", "rule")} == {
        "from": M, "to": N, "resume_step": M, "rule": RESTRETCH}
    # a run that finished is refused an extension that does not add steps
    cli = [str(Path(sys.executable).with_name("bertpipe")), "pretrain", "--preset", "demo", "--instances",
           instances, "--output", str(run), *[a for s in tiny_sets(N, 1, 4) for a in ("--set", s)],
           "--extend-to", str(N)]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "has 7 steps already" in proc.stderr.strip().splitlines()[-1]
