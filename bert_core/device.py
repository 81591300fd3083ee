"""Where a rank computes: its torch device, its collective backend, its matmul precision and the
peak FLOP/s its MFU is measured against. Pre-training and fine-tuning both start here, so the
CPU run and the GPU run take the same code path with a different ``accelerator``.

    python -c "from bert_core.device import resolve_device, peak_flops; d = resolve_device('cpu', 0); print(d, peak_flops(d, 'bf16'))"
"""

from __future__ import annotations

from typing import Literal

import torch

from bert_core.config import ConfigError

Accelerator = Literal["cpu", "gpu"]

# (name contains, dense bf16/fp16 FLOP/s, dense TF32 FLOP/s), from NVIDIA's data sheets; the
# first match wins, so a variant comes before its family (GH200 is an H200).
PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 418e12),
    ("H100", 989e12, 494e12),
    ("H200", 989e12, 494e12),
    ("A100", 312e12, 156e12),
)


class DeviceError(ConfigError):
    """A run asks for a device this machine does not have; the message says what to do."""


def dist_backend(accelerator: Accelerator) -> str:
    """The torch.distributed backend of ``accelerator``: NCCL between GPUs, gloo between CPUs.

    NCCL refuses CPU tensors, so every collective's tensors live on the resolved device.
    """
    return "nccl" if accelerator == "gpu" else "gloo"


def resolve_device(accelerator: Accelerator, local_rank: int = 0) -> torch.device:
    """The device of the rank ``local_rank`` of its machine: ``cuda:<local_rank>``, made the
    current CUDA device (NCCL and DeepSpeed allocate there), or ``cpu``."""
    if accelerator != "gpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"accelerator=gpu but torch {torch.__version__} sees no CUDA device (CUDA build: "
            f"{torch.version.cuda}); run on a GPU machine with a CUDA build of torch, or set accelerator: cpu"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(
            f"local rank {local_rank} needs cuda:{local_rank} but this machine has {count} GPU(s); "
            f"set procs_per_node to at most {count}"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def configure_matmul(precision: str, device: torch.device) -> bool:
    """TF32 tensor cores for an fp32 run on CUDA (cuBLAS matmuls and cuDNN); CPU untouched.
    Returns whether TF32 is on for this run.

    TF32 is 10-bit mantissa products with fp32 accumulation, as NVIDIA's BERT recipe uses;
    CPU matmuls are left exact.
    """
    if device.type != "cuda" or precision != "fp32":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def peak_flops_of(name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of the card called ``name`` at ``precision`` (TF32 for fp32), or None
    for a card not in :data:`PEAK_FLOPS`."""
    for family, low_precision, tf32 in PEAK_FLOPS:
        if family.lower() in name.lower():
            return tf32 if precision == "fp32" else low_precision
    return None


def peak_flops(device: torch.device, precision: str, configured: float | None = None) -> float | None:
    """Peak FLOP/s of one rank for the MFU estimate: ``configured`` (``peak_flops_per_rank``) when
    set, else the CUDA card's from its name; None on CPU or an unknown card."""
    if configured:
        return configured
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device), precision)
