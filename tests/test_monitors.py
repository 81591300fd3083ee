"""pretrain.monitor: each choice renders a section that DeepSpeed's own monitor config accepts."""

from __future__ import annotations

import pytest

from bert_core.config import load_config
from bert_core.pretrain.ds_config import ds_config


@pytest.mark.parametrize("monitor, section", [("csv", "csv_monitor"), ("tensorboard", "tensorboard"),
                                              ("wandb", "wandb")])
def test_each_monitor_renders_a_section_deepspeed_accepts(monitor, section, tmp_path):
    from deepspeed.monitor.config import get_monitor_config

    cfg = load_config("demo", sets=[f"pretrain.monitor={monitor}"])
    rendered = ds_config(cfg.pretrain, 0, str(tmp_path / "run"))
    assert rendered[section]["enabled"] is True
    parsed = get_monitor_config(rendered)
    assert getattr(parsed, section).enabled


@pytest.mark.slow
def test_a_real_pretraining_run_logs_to_an_offline_wandb_run(samples_dir, tmp_path):
    """`bertpipe pretrain` with pretrain.monitor=wandb and WANDB_MODE=offline: DeepSpeed's W&B
    monitor writes the run's training rows into an offline run on disk, closed at the end."""
    import os
    import subprocess
    import sys

    from beam_jobs import clean_corpus, create_instances
    from bert_core.config import CorpusConfig, InstanceConfig, SequenceSpec

    corpus, instances = str(tmp_path / "corpus"), str(tmp_path / "instances")
    clean_corpus.run(CorpusConfig(books=[str(samples_dir / "books" / "botchan.txt")]), corpus, workers=1)
    create_instances.run(InstanceConfig(lengths=[SequenceSpec(max_seq_length=64, max_predictions_per_seq=10)],
                                        dupe_factor=1, num_shards=2), corpus,
                         str(samples_dir / "models" / "minilm" / "vocab.txt"), instances, workers=1)
    sets = ["pretrain.monitor=wandb", "instances.lengths=[{max_seq_length: 64, max_predictions_per_seq: 10}]",
            "pretrain.phases=[{max_seq_length: 64, max_steps: 3, global_batch_size: 8, micro_batch_size: 4, "
            "learning_rate: 0.003, warmup_steps: 1}]", "model.hidden_size=64", "model.num_attention_heads=2",
            "model.intermediate_size=128", "model.num_hidden_layers=1", "pretrain.log_every=1"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "pretrain", "--instances", instances, "--output",
                           str(tmp_path / "run"), *(a for s in sets for a in ("--set", s))],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"Train/Samples/lr" in run.read_bytes()  # the rows reached the run, and it was closed
