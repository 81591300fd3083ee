"""DeepSpeed pre-training on CPU: rendered config, launcher argv, real 2-rank runs, kill -9 + resume.

    .venv/bin/python -m pytest -q tests/test_pretrain.py            # all (slow ones ~2-3 min)
    .venv/bin/python -m pytest -q tests/test_pretrain.py -m "not slow"

Real DeepSpeed engines and the real ``deepspeed`` launcher with gloo ranks, on instances made
from the real Botchan text with the real bert-base-uncased vocab (see tests/test_data.py). The
model is tiny with dropout 0, so a run's losses are a pure function of its data and weights.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from bert_core import storage
from bert_core.config import ConfigError, load_config
from bert_core.model.weight_decay import param_groups
from bert_core.pretrain.ds_config import ds_config, loop_clipping
from bert_core.pretrain.launch import (
    LaunchConfigError,
    LaunchError,
    LaunchInfraError,
    cpu_comm_op_built,
    ensure_cpu_comm_op,
    launch_pretraining,
    launcher_argv,
    prepare_run,
    run_launch,
)
from bert_core.pretrain.metrics import MetricsLog, MetricsTail, eval_rows, read_metrics
from bert_core.pretrain.run_folder import load_run_config, model_config, steps_done, total_steps

sys.path.insert(0, str(Path(__file__).parent))
from test_data import make_instances  # noqa: E402

STEPS = 14  # phase 1
PHASE2_STEPS = 4  # phase 2 continues from phase 1's weights with a fresh optimizer
KILL_AFTER = 6
ALL_STEPS = [(1, s) for s in range(1, STEPS + 1)] + [(2, s) for s in range(1, PHASE2_STEPS + 1)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_sets(steps: int = STEPS) -> list[str]:
    return [
        "model.hidden_size=64", "model.num_attention_heads=2", "model.intermediate_size=128",
        "model.num_hidden_layers=1", "model.hidden_dropout_prob=0", "model.attention_probs_dropout_prob=0",
        "instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10}]",
        f"pretrain.phases=[{{max_seq_length: 64, max_steps: {steps}, global_batch_size: 16, "
        "micro_batch_size: 4, learning_rate: 0.003, warmup_steps: 2}, "
        f"{{max_seq_length: 64, max_steps: {PHASE2_STEPS}, global_batch_size: 8, micro_batch_size: 4, "
        "learning_rate: 0.001, warmup_steps: 1}]",
        "pretrain.log_every=1", "pretrain.checkpoint_every=4", f"pretrain.master_port={free_port()}",
        "pretrain.peak_flops_per_rank=5.0e10",  # a made-up peak, so the MFU column is filled
    ]


def tiny_config(*extra: str, steps: int = STEPS):
    return load_config("demo", None, [*tiny_sets(steps), *extra])


@pytest.fixture(scope="module")
def instances(tmp_path_factory, samples_dir) -> str:
    return make_instances(tmp_path_factory.mktemp("pretrain"), samples_dir, num_shards=4, max_docs=40)


@pytest.fixture(scope="module")
def comm_op() -> None:
    # Paid once per machine (cached), and before any timed launch.
    ensure_cpu_comm_op(print)
    assert cpu_comm_op_built()


# --------------------------------------------------------------------------- rendering (fast)


def test_ds_config_from_pretrain_config():
    cfg = load_config("demo", None, ["pretrain.procs_per_node=2"]).pretrain
    ds = ds_config(cfg, 0, "/runs/x")
    assert ds["train_batch_size"] == 64 and ds["train_micro_batch_size_per_gpu"] == 32
    assert ds["gradient_accumulation_steps"] == 1
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01,
        "torch_adam": True, "adam_w_mode": True}}
    assert ds["scheduler"]["params"]["warmup_type"] == "linear"
    assert ds["scheduler"]["params"]["total_num_steps"] == 200
    # at ZeRO 0 the loop clips (on the device), so DeepSpeed does not
    assert cfg.zero_stage == 0 and ds["gradient_clipping"] == 0.0 and loop_clipping(cfg) == 1.0
    assert ds["csv_monitor"]["output_path"] == "/runs/x/monitor/"
    assert "bf16" not in ds and "fp16" not in ds
    no_warmup = load_config("demo", None, ["pretrain.phases.1.warmup_steps=0"]).pretrain
    assert ds_config(no_warmup, 1)["scheduler"]["params"]["warmup_num_steps"] == 1  # DeepSpeed refuses 0
    gpu = load_config("bert-base-128", None, ["pretrain.zero_stage=2"]).pretrain
    ds = ds_config(gpu, 0)
    assert ds["optimizer"]["params"]["fused"] is True and ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["gradient_clipping"] == 1.0 and loop_clipping(gpu) == 0.0
    assert ds["gradient_accumulation_steps"] == gpu.phases[0].global_batch_size // (
        gpu.phases[0].micro_batch_size * gpu.world_size)
    # LAMB: no DeepSpeed optimizer section, the client optimizer is torch-optimizer's Lamb
    assert "optimizer" not in ds_config(load_config("demo", None, ["pretrain.optimizer=lamb"]).pretrain, 0)


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_real_engine_from_rendered_config(optimizer, monkeypatch):
    """One CPU rank in this process: the rendered config builds a DeepSpeed engine whose optimizer,
    parameter groups and schedule are the paper's (LAMB on CPU: torch-optimizer's, as client)."""
    import deepspeed
    import torch_optimizer

    from bert_core.model.bert import BertForPreTraining
    from bert_core.pretrain.ds_config import client_optimizer, uses_client_optimizer

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(key, value)
    cfg = tiny_config(f"pretrain.optimizer={optimizer}", "pretrain.procs_per_node=1",
                      "pretrain.monitor=none")
    pre = cfg.pretrain
    torch.manual_seed(0)
    model = BertForPreTraining(cfg.model.model_copy(update={"vocab_size": 120}))
    groups = param_groups(model, pre.weight_decay)
    client = client_optimizer(pre, pre.phases[0], groups) if uses_client_optimizer(pre) else None
    deepspeed.init_distributed(dist_backend="gloo")
    engine, opt, _, scheduler = deepspeed.initialize(model=model, model_parameters=groups,
                                                     optimizer=client, config=ds_config(pre, 0))
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt
    assert isinstance(inner, torch.optim.AdamW if optimizer == "adamw" else torch_optimizer.Lamb)
    assert [g["weight_decay"] for g in inner.param_groups] == [0.01, 0.0]
    assert engine.gradient_accumulation_steps() == 4  # global 16 = micro 4 x 1 rank x 4
    g = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(5, 120, (4, 16), generator=g), "token_type_ids": torch.zeros(4, 16, dtype=torch.long),
        "attention_mask": torch.ones(4, 16, dtype=torch.long),
        "masked_lm_positions": torch.tensor([[1, 2, 3]] * 4), "masked_lm_ids": torch.randint(5, 120, (4, 3), generator=g),
        "masked_lm_weights": torch.ones(4, 3), "next_sentence_label": torch.tensor([0, 1, 0, 1]),
    }
    scheduler.step()  # as bert_core.pretrain.loop does on a fresh phase: update k uses iteration k - 1
    lrs, losses = [], []
    before = model.bert.embeddings.word_embeddings.weight.detach().clone()
    for _ in range(3):
        lrs.append(inner.param_groups[0]["lr"])
        for _ in range(4):
            loss = engine(**batch)["loss"]
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    assert lrs == pytest.approx([0.0, 0.0015, 0.003])  # linear warmup over 2 steps to the peak
    assert losses[-1] < losses[0]  # the third update (at the peak rate) learnt the repeated batch
    assert not torch.equal(before, model.bert.embeddings.word_embeddings.weight)


def test_model_shape_from_config_or_init_checkpoint(samples_dir):
    cfg = tiny_config()
    assert model_config(cfg, 30522).hidden_size == 64 and model_config(cfg, 30522).vocab_size == 30522
    minilm = str(samples_dir / "models" / "minilm")
    from_ckpt = model_config(cfg, 30522, minilm)  # the checkpoint's own shape, not the preset's
    assert (from_ckpt.hidden_size, from_ckpt.num_hidden_layers, from_ckpt.vocab_size) == (384, 6, 30522)
    with pytest.raises(ConfigError, match="vocab_size=30522"):
        model_config(cfg, 40000, minilm)


def test_an_init_checkpoint_of_another_vocab_is_refused_naming_the_first_token_that_differs(samples_dir, tmp_path):
    """A larger vocab passes the size check but not the content check: id N would mean another token."""
    from bert_core.pretrain.run_folder import check_init_vocab

    minilm = samples_dir / "models" / "minilm"
    tokens = (minilm / "vocab.txt").read_text(encoding="utf-8").splitlines()
    check_init_vocab(str(minilm), str(minilm / "vocab.txt"))  # its own vocab: fine
    smaller = tmp_path / "vocab.txt"
    smaller.write_text("\n".join(tokens[:1999] + tokens[2500:4000]) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        check_init_vocab(str(minilm), str(smaller))
    message = str(err.value)
    assert f"id 1999 is {tokens[1999]!r} there and {tokens[2500]!r} here" in message
    assert "(30522 tokens)" in message and "3499 tokens" in message and "vocab.vocab_file=" in message
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((minilm / "config.json").read_bytes())
    with pytest.raises(ConfigError, match="has no vocab.txt"):
        check_init_vocab(str(bare), str(smaller))


def runner_command(args: list[str]) -> list[str]:
    """The command DeepSpeed's ``deepspeed`` runner starts for ``args``, caught before it starts."""
    import subprocess as sp

    from deepspeed.launcher import runner

    started = []

    class Caught(Exception):
        pass

    real = sp.Popen

    def popen(cmd, *args, **kwargs):
        if "deepspeed.launcher.launch" not in cmd:
            return real(cmd, *args, **kwargs)
        started.append(cmd)
        raise Caught

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sp, "Popen", popen)
        mp.setenv("DS_ACCELERATOR", "cpu")
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        with pytest.raises(Caught):
            runner.main(args)
    return started[0]


def test_launcher_argv_shapes():
    local = load_config("demo", None, ["pretrain.master_port=29600"]).pretrain
    # local: the very command `deepspeed --num_gpus 2` runs on one machine, started directly
    assert launcher_argv(local, ["--output", "r"]) == ["python", *runner_command(
        ["--num_gpus", "2", "--master_port", "29600", "--module", "bert_core.pretrain", "--output", "r"])[1:]]
    # no port set: a free one per launch, so two runs on one machine never collide
    unpinned = load_config("demo").pretrain
    assert len({launcher_argv(unpinned, [])[6] for _ in range(3)}) >= 2
    pods = load_config("demo", None, ["pretrain.launcher=no_ssh", "pretrain.nodes=4",
                                      "pretrain.master_addr=10.0.0.1",
                                      "pretrain.phases.0.global_batch_size=256",
                                      "pretrain.phases.1.global_batch_size=64"]).pretrain
    argv = launcher_argv(pods, [], node_rank=3, hostfile="/h")
    assert argv[:11] == ["deepspeed", "--hostfile", "/h", "--no_ssh", "--node_rank", "3",
                         "--num_nodes", "4", "--num_gpus", "2", "--master_addr"]
    assert argv[12:14] == ["--master_port", "29500"]  # every node must agree: no free-port pick
    with pytest.raises(ValueError, match="node-rank"):
        launcher_argv(pods, [], node_rank=None)
    ssh = load_config("demo", None, ["pretrain.launcher=hostfile", "pretrain.hostfile=/etc/hosts.ds",
                                     "pretrain.nodes=2", "pretrain.phases.0.global_batch_size=128",
                                     "pretrain.phases.1.global_batch_size=32"]).pretrain
    assert launcher_argv(ssh, [])[1:7] == ["--hostfile", "/etc/hosts.ds", "--num_nodes", "2", "--num_gpus", "2"]


def test_prepare_run_writes_config_hostfile_and_remote_env(tmp_path):
    pods = tiny_config("pretrain.launcher=no_ssh", "pretrain.nodes=2", "pretrain.procs_per_node=1")
    argv, env = prepare_run(pods, str(tmp_path / "inst"), str(tmp_path / "run"), node_rank=1)
    assert (tmp_path / "run" / "hostfile").read_text() == "node0 slots=1\nnode1 slots=1\n"
    assert argv[argv.index("--hostfile") + 1] == str(tmp_path / "run" / "hostfile")
    written = argv[argv.index("--config") + 1]
    assert load_run_config(written) == pods
    assert env["OMP_NUM_THREADS"] == "1" and env["DS_ACCELERATOR"] == "cpu"
    ssh = tiny_config("pretrain.launcher=hostfile", "pretrain.hostfile=/job/hostfile", "pretrain.nodes=2",
                      "pretrain.procs_per_node=1", "pretrain.threads_per_rank=4")
    argv, env = prepare_run(ssh, str(tmp_path / "inst"), str(tmp_path / "run2"))
    assert argv[argv.index("--hostfile") + 1] == "/job/hostfile"
    assert Path(env["DS_ENV_FILE"]).read_text() == "OMP_NUM_THREADS=4\nDS_ACCELERATOR=cpu\n"


def test_metrics_log_and_tail_follow_appends_resume_truncation_and_torn_lines(tmp_path):
    run = str(tmp_path / "run")
    log, tail = MetricsLog(run), MetricsTail(run)
    assert tail.poll() == []
    for step in (1, 2, 3):
        log.append({"phase": 1, "step": step, "loss": 10.0 - step})
    assert [r["step"] for r in tail.poll()] == [1, 2, 3]
    with open(log.uri, "a") as f:  # a line being written
        f.write('{"phase": 1, "step": 4, "lo')
    assert [r["step"] for r in tail.poll()] == [1, 2, 3]
    resumed = MetricsLog(run)  # a resume from the checkpoint at step 2 drops rows 3 and the torn 4
    resumed.truncate(1, 2)
    resumed.append({"phase": 1, "step": 3, "loss": 6.5})
    resumed.append({"phase": 1, "step": 4, "loss": 6.0})
    resumed.append({"phase": 2, "step": 1, "loss": 5.0})
    rows = tail.poll()
    assert [(r["phase"], r["step"], r["loss"]) for r in rows] == [
        (1, 1, 9.0), (1, 2, 8.0), (1, 3, 6.5), (1, 4, 6.0), (2, 1, 5.0)]
    assert read_metrics(run) == rows
    cfg = tiny_config()
    assert steps_done(cfg, rows) == STEPS + 1 and total_steps(cfg) == STEPS + PHASE2_STEPS


def test_run_launch_tells_config_errors_from_infrastructure_failures():
    lines: list[str] = []
    refuse = [sys.executable, "-c", "import sys; print('bertpipe-config-error: bad input'); sys.exit(2)"]
    with pytest.raises(LaunchConfigError, match="bad input"):
        run_launch(refuse, on_line=lines.append)
    assert lines == ["bertpipe-config-error: bad input"]
    killed = [sys.executable, "-c", "import os, signal; print('step 1'); os.kill(os.getpid(), signal.SIGKILL)"]
    with pytest.raises(LaunchInfraError) as err:
        run_launch(killed, on_line=lines.append)
    assert err.value.exit_code == -9
    assert run_launch([sys.executable, "-c", "print('ok')"], on_line=lines.append) == 0
    # a rank's Python error, logged by DeepSpeed's sigkill_handler: neither config nor infrastructure
    crash = [sys.executable, "-c", "print('[launch.py:253:sigkill_handler] Killing subprocess 1'); "
             "raise ValueError('warmup_num_steps must be a positive integer')"]
    with pytest.raises(LaunchError) as err:
        run_launch(crash, on_line=lines.append)
    assert type(err.value) is LaunchError and err.value.exit_code == 1


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no scheduler autogroups")
def test_a_niced_launch_stays_nice_in_its_own_session():
    """The launcher starts under ``setsid``, which Linux schedules as a group of its own:
    that group takes the niceness of whoever launched it, or nice would not hold against others."""
    wait_for_nice = ("import time\n"
                     "for _ in range(100):\n"
                     "    group = open('/proc/self/autogroup').read().strip()\n"
                     "    if not group.endswith('nice 0'): break\n"
                     "    time.sleep(0.05)\n"
                     "print(group)")
    code = ("import sys; from bert_core.pretrain.launch import run_launch; "
            f"run_launch(['python', '-c', {wait_for_nice!r}])")
    out = subprocess.run(["nice", "-n", "7", sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.stdout.strip().endswith("nice 7"), out


def _running(pid: int) -> bool:
    """Is ``pid`` a live process (not a zombie waiting for its parent)?"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["exits", "is stopped"])
def test_the_launchers_group_ends_with_the_launch(how):
    """A rank the launcher left behind (its session is its own, so nothing else ends it) is
    ended when the launcher exits, and when the launching process is stopped mid-run."""
    launcher = ("import subprocess, sys, time; "
                "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                "print(rank.pid, flush=True)" + ("; time.sleep(120)" if how == "is stopped" else ""))
    code = ("import signal, sys; from bert_core.pretrain.launch import run_launch; "
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); "
            f"run_launch(['python', '-c', {launcher!r}])")
    launch = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        rank = int(launch.stdout.readline())
        if how == "is stopped":
            assert _running(rank)
            launch.terminate()
        assert launch.wait(30) == (0 if how == "exits" else 143)
        deadline = time.monotonic() + 10
        while _running(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(rank)
    finally:
        launch.kill()


def test_launch_with_missing_instances_is_a_config_error(tmp_path):
    cfg = tiny_config()
    with pytest.raises(LaunchConfigError, match="no _MANIFEST.json"):
        launch_pretraining(cfg, str(tmp_path / "nowhere"), str(tmp_path / "run"), on_line=lambda s: None)


# --------------------------------------------------------------------------- real runs (slow)
# Three launches in all: two launchers (--no_ssh --node_rank 0/1) give the reference losses; a
# local launcher run (2 ranks) of the same config is killed (-9) mid-run and resumed. Same world
# size, seed and data, so all three must agree step for step.


@pytest.fixture(scope="module")
def run_config():
    return tiny_config()


@pytest.fixture(scope="module")
def reference_run(instances, tmp_path_factory, comm_op, run_config) -> tuple[str, dict[int, list[str]]]:
    """Two launchers on 127.0.0.1, one rank each, as a two-node stand-in (Kubernetes pods)."""
    cfg = run_config.model_copy(deep=True)
    cfg.pretrain = cfg.pretrain.model_copy(update=dict(
        launcher="no_ssh", nodes=2, procs_per_node=1, master_addr="127.0.0.1", master_port=free_port()))
    run = str(tmp_path_factory.mktemp("ref") / "run")
    results: dict[int, object] = {}
    outputs: dict[int, list[str]] = {0: [], 1: []}

    def node(rank: int) -> None:
        argv, env = prepare_run(cfg, instances, run, node_rank=rank)
        assert "--no_ssh" in argv and argv[argv.index("--node_rank") + 1] == str(rank)
        try:
            results[rank] = run_launch(argv, env, outputs[rank].append)
        except Exception as err:  # reported below with the node's output
            results[rank] = err

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == {0: 0, 1: 0}, (results, outputs[0][-15:], outputs[1][-15:])
    return run, outputs


@pytest.mark.slow
def test_two_launchers_no_ssh_node_rank_0_and_1_lower_the_loss(reference_run):
    run, outputs = reference_run
    rows = [r for r in read_metrics(run) if r["phase"] == 1]
    phase2 = [r for r in read_metrics(run) if r["phase"] == 2]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.3, (first, last)
    assert all(r["seq_per_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    # linear warmup from 0 over 2 steps, then linear decay
    assert [r["lr"] for r in rows[:3]] == pytest.approx([0.0, 0.0015, 0.003])
    assert rows[-1]["lr"] == pytest.approx(0.003 / (STEPS - 2))
    # phase 2: a fresh warmup from 0 to its own peak, starting from phase 1's trained weights
    assert [r["step"] for r in phase2] == list(range(1, PHASE2_STEPS + 1))
    assert phase2[0]["lr"] == 0.0 and max(r["lr"] for r in phase2) == pytest.approx(0.001)
    assert phase2[0]["loss"] < rows[0]["loss"] - 0.5
    manifest = storage.read_manifest(run)
    assert manifest["stage"] == "pretrain" and manifest["counts"]["steps"] == STEPS + PHASE2_STEPS
    assert manifest["config"]["pretrain"]["nodes"] == 2
    assert manifest["stats"]["first_loss"] == rows[0]["loss"]
    assert manifest["stats"]["last_loss"] == phase2[-1]["loss"]
    assert any(line.startswith("phase 1 step") for line in outputs[0])
    # instances without seq64/eval/: training runs, says so once per phase, writes no eval rows
    assert sum("no eval split" in line for line in outputs[0]) == 2
    assert not eval_rows(read_metrics(run)) and "eval" not in manifest["stats"]["phases"][0]
    assert not any(line.startswith("phase 1 step") for line in outputs[1])  # rank 1 stays quiet


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    import psutil

    out = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        for arg in cmd:
            if arg.startswith("--local_rank=") and "bert_core.pretrain" in cmd:
                out[int(arg.split("=")[1])] = child.pid
    return out


@pytest.mark.slow
def test_deepspeed_2_ranks_kill_9_then_resume_gives_the_same_losses_and_exports(
    prefect_api, reference_run, instances, tmp_path
):
    """``bertpipe pretrain`` (DeepSpeed's launcher, 2 ranks) is killed mid-run; the Prefect flow resumes it."""
    run = str(tmp_path / "run")
    sets = tiny_sets()
    shm_before = set(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))
    cli = [str(Path(sys.executable).with_name("bertpipe")), "pretrain", "--preset", "demo",
           "--instances", instances, "--output", run, *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    killed_at = None
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        steps = [r["step"] for r in read_metrics(run)]
        if steps and steps[-1] >= KILL_AFTER:  # past the checkpoint at step 4, mid-run
            os.kill(_rank_pids(proc.pid)[1], 9)
            killed_at = steps[-1]
            break
        time.sleep(0.05)
    output, _ = proc.communicate(timeout=120)
    assert killed_at is not None and killed_at < STEPS, f"the run ended before it could be killed:\n{output}"
    assert "-m deepspeed.launcher.launch" in output  # the local launcher, 2 ranks
    assert proc.returncode == 3, output[-2000:]  # infrastructure failure: run it again to resume
    assert "run the same command again" in output and not storage.has_manifest(run)

    from prefect_server import latest_artifacts

    from flows.pretrain import pretrain

    config = load_config("demo", None, sets)
    assert pretrain(config, instances, run) == run
    artifacts = latest_artifacts()
    assert {"pretrain-progress", "pretrain-metrics", "pretrain-report"} <= set(artifacts)
    assert artifacts["pretrain-progress"] == pytest.approx(100.0)
    table = artifacts["pretrain-metrics"]
    assert [(r["phase"], r["step"]) for r in table] == ALL_STEPS
    assert "data:image/png;base64," in artifacts["pretrain-report"]
    # the CPU all-reduce buffers (RAM in /dev/shm) are gone, after the kill as after the resume
    assert set(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*")) <= shm_before

    resume_step = max(s for s in range(0, killed_at + 1, 4))  # the last checkpoint before the kill
    ref = {(r["phase"], r["step"]): r["loss"] for r in read_metrics(reference_run[0])}
    got = {(r["phase"], r["step"]): r["loss"] for r in read_metrics(run)}
    assert sorted(got) == ALL_STEPS  # the killed run's rows past the checkpoint were replaced
    assert resume_step >= 4 and len([k for k in got if k > (1, resume_step)]) >= STEPS - killed_at
    for key in sorted(got):
        assert got[key] == pytest.approx(ref[key], abs=1e-6), (key, got[key], ref[key])

    # the transformers-layout export holds the final weights of the DeepSpeed checkpoint
    from bert_core.model.bert import BertForPreTraining

    manifest = storage.read_manifest(run)
    exported = BertForPreTraining.from_pretrained(manifest["hf"]).state_dict()
    states = torch.load(Path(run, "checkpoints", "phase2", f"step{PHASE2_STEPS}", "mp_rank_00_model_states.pt"),
                        weights_only=False)
    final = states["module"]
    # phase 2's optimizer started fresh: its Adam step count is phase 2's steps only
    adam_steps = {int(v["step"]) for v in states["optimizer"]["state"].values()}
    assert adam_steps == {PHASE2_STEPS}
    assert exported.keys() <= final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in exported)
    from bert_core.model.checkpoint import PRELN_MODEL_TYPE

    model_type = PRELN_MODEL_TYPE if config.model.pre_layer_norm else "bert"  # transformers loads either exactly
    assert json.loads(Path(manifest["hf"], "config.json").read_text())["model_type"] == model_type
    assert (Path(manifest["hf"]) / "vocab.txt").read_text().splitlines()[101] == "[CLS]"
    assert list(Path(run, "monitor").rglob("*.csv"))  # DeepSpeed's CSV monitor ran

    # `bertpipe export RUN/checkpoints` takes the last phase and gives the same weights as hf/
    from bert_core.model.export import export_checkpoint

    again = export_checkpoint(str(Path(run, "checkpoints")), str(tmp_path / "again"))
    reexported = BertForPreTraining.from_pretrained(str(tmp_path / "again")).state_dict()
    assert again and reexported.keys() == exported.keys()
    assert all(torch.equal(reexported[k], exported[k]) for k in exported)


@pytest.mark.slow
def test_two_hosts_in_network_namespaces_match_the_one_host_run(reference_run, instances, tmp_path,
                                                                tmp_path_factory):
    """Two ``no_ssh`` launchers, each on its own host: a network namespace with its own address
    on a veth pair, private /tmp and /dev/shm, node 0's address as --master-addr. The loss falls
    and the export equals the one-host run's (same world size, seed and data)."""
    from clusters import netns_refused, on_host, two_hosts

    from bert_core.model.bert import BertForPreTraining

    refused = netns_refused()
    if refused:
        pytest.skip(refused)
    run = str(tmp_path / "run")
    outputs: dict[int, list[str]] = {0: [], 1: []}
    results: dict[int, object] = {}
    with two_hosts() as hosts:
        cfg = tiny_config().model_copy(deep=True)
        cfg.pretrain = cfg.pretrain.model_copy(update=dict(
            launcher="no_ssh", nodes=2, procs_per_node=1, master_addr=hosts[0]["addr"], master_port=29533))

        def node(rank: int) -> None:
            argv, env = prepare_run(cfg, instances, run, node_rank=rank)
            argv = [str(Path(sys.executable).with_name("deepspeed")), *argv[1:]]
            env["GLOO_SOCKET_IFNAME"] = hosts[rank]["ifname"]  # the host's own address, not loopback
            try:
                results[rank] = run_launch(on_host(hosts[rank], tmp_path_factory.getbasetemp(), argv), env,
                                           outputs[rank].append)
            except Exception as err:  # reported below with the node's output
                results[rank] = err

        threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert results == {0: 0, 1: 0}, (results, outputs[0][-15:], outputs[1][-15:])
    assert any(hosts[0]["addr"] in line for line in outputs[1]), outputs[1][-15:]  # node 1 dialled node 0
    rows = [r for r in read_metrics(run) if r["phase"] == 1]
    assert sum(r["loss"] for r in rows[-3:]) / 3 < sum(r["loss"] for r in rows[:3]) / 3 - 0.3
    ref = {(r["phase"], r["step"]): r["loss"] for r in read_metrics(reference_run[0])}
    got = {(r["phase"], r["step"]): r["loss"] for r in read_metrics(run)}
    assert sorted(got) == ALL_STEPS and all(got[k] == pytest.approx(ref[k], abs=1e-6) for k in got)
    exported = BertForPreTraining.from_pretrained(storage.read_manifest(run)["hf"]).state_dict()
    expected = BertForPreTraining.from_pretrained(storage.read_manifest(reference_run[0])["hf"]).state_dict()
    assert exported.keys() == expected.keys()
    assert all(torch.allclose(exported[k], expected[k], atol=1e-6) for k in expected)


def test_a_run_written_before_a_setting_existed_resumes_under_its_default():
    """A run folder's config from a version without a field (here the vocab padding) is the same
    config as today's with that field at its default: the run resumes, it is not refused."""
    from bert_core.pretrain.run_folder import config_changes

    new = load_config("demo").model_dump(mode="json")
    old = json.loads(json.dumps(new))
    del old["model"]["pad_vocab_to_multiple"], old["pretrain"]["compile"]
    assert config_changes(old, new) == []
    changed = json.loads(json.dumps(new))
    changed["model"]["pad_vocab_to_multiple"] = 64
    assert config_changes(old, changed) == ["model.pad_vocab_to_multiple: 1 -> 64"]


def test_a_run_resumes_with_its_masked_lm_loss_chunked_or_not():
    """mlm_loss_chunk changes memory, not the losses (to fp32 rounding), as compile does: a run
    resumes with it turned on or off."""
    from bert_core.pretrain.run_folder import config_changes

    new = load_config("demo").model_dump(mode="json")
    chunked = json.loads(json.dumps(new))
    chunked["pretrain"]["mlm_loss_chunk"] = 1024
    assert config_changes(new, chunked) == []
