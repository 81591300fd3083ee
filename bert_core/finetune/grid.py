"""The fine-tuning grid: settings, and the names and folders of the jobs that run them.

    from bert_core.finetune.grid import settings, job_name, job_dir

A setting is one point of ``learning_rates`` x ``batch_sizes`` x ``epochs`` (the paper's grid:
{5e-5, 3e-5, 2e-5} x {16, 32} x {2, 3, 4}); a job is one (task, setting, seed). Names say what a
job is, so the UI, the logs and the folders read alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bert_core import storage
from bert_core.config import FinetuneConfig


def _short(x: float) -> str:
    """3e-05 -> '3e-5', 0.0002 -> '2e-4', 1.5e-05 -> '1.5e-5'."""
    mantissa, exponent = f"{x:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


@dataclass(frozen=True)
class Setting:
    learning_rate: float
    batch_size: int
    num_train_epochs: float

    @property
    def name(self) -> str:
        return f"lr{_short(self.learning_rate)}-bs{self.batch_size}-ep{self.num_train_epochs:g}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name}

    @classmethod
    def of(cls, cfg: FinetuneConfig) -> Setting:
        """The one setting of a one-point config (what one job runs with)."""
        return cls(cfg.learning_rate, cfg.batch_size, cfg.num_train_epochs)


def settings(cfg: FinetuneConfig) -> list[Setting]:
    return [Setting(lr, bs, ep) for lr, bs, ep in cfg.grid()]


def checkpoint_name(checkpoint: str) -> str:
    """A readable label: the folder's name, or its run's name for a run's ``hf/`` export."""
    parts = storage.to_uri(checkpoint).rstrip("/").split("/")
    return parts[-2] if parts[-1] == "hf" and len(parts) > 1 else parts[-1]


def job_name(task: str, checkpoint: str, setting: Setting, seed: int) -> str:
    """The task run / flow run name: ``finetune-sst2-minilm-lr3e-5-bs32-ep3-seed2``."""
    return f"finetune-{task}-{checkpoint}-{setting.name}-seed{seed}"


def job_dir(output: str, task: str, setting: Setting, seed: int) -> str:
    """The job's folder, ``<output>/<task>/<setting>/seed=<s>`` with ``<output>`` the checkpoint's
    folder: ``finetune/minilm/sst2/lr3e-5-bs32-ep3/seed=2`` (its ``metrics.json`` goes there).
    """
    return storage.join(output, task, setting.name, f"seed={seed}")
