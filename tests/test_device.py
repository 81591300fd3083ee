"""bert_core.device on CPU: the backend, the device, TF32 and the peak FLOP/s a rank reports MFU with.

    .venv/bin/python -m pytest -q tests/test_device.py
"""

from __future__ import annotations

import pytest
import torch

from bert_core.config import ConfigError
from bert_core.device import (
    configure_matmul,
    dist_backend,
    peak_flops,
    peak_flops_of,
    resolve_device,
)


def test_backend_per_accelerator():
    assert dist_backend("gpu") == "nccl"
    assert dist_backend("cpu") == "gloo"


def test_cpu_device_and_gpu_refused_without_cuda():
    assert resolve_device("cpu", 1) == torch.device("cpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError) as err:
        resolve_device("gpu", 0)
    message = str(err.value)
    assert "\n" not in message and "accelerator=gpu" in message and "accelerator: cpu" in message


@pytest.fixture
def tf32_flags():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_only_for_fp32_on_cuda(tf32_flags):
    # the flags are process-wide switches torch keeps on any build, so the CUDA branch runs here too
    assert configure_matmul("fp32", torch.device("cpu")) is False
    assert configure_matmul("bf16", torch.device("cuda", 0)) is False
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert configure_matmul("fp32", torch.device("cuda", 0)) is True
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize(("name", "precision", "flops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 80GB HBM3", "fp32", 494e12),
    ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA GH200 480GB", "fp16", 989e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "fp32", 156e12),
    ("Tesla T4", "bf16", None),
])
def test_peak_flops_from_card_name(name, precision, flops):
    assert peak_flops_of(name, precision) == flops


def test_configured_peak_wins_and_cpu_has_none():
    assert peak_flops(torch.device("cpu"), "bf16") is None
    assert peak_flops(torch.device("cpu"), "fp32", configured=5e10) == 5e10
