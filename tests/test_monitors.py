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

