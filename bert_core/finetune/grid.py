"""The fine-tuning grid: settings, and the names and folders of the jobs that run them.

    from bert_core.finetune.grid import settings, job_name, job_dir

A setting is one point of ``learning_rates`` x ``batch_sizes`` x ``epochs`` (the paper's grid:
{5e-5, 3e-5, 2e-5} x {16, 32} x {2, 3, 4}) x ``poolings`` x ``layerwise_lr_decays``; a job is one
(task, setting, seed). Names say what a job is, so the UI, the logs and the folders read alike: a
pooling or a decay away from its default adds ``-mean`` or ``-lld0.8`` to a setting's name, so a
setting at the defaults keeps the name it has always had.
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, fields
from typing import Any

from bert_core import storage
from bert_core.config import FinetuneConfig


def _short(x: float) -> str:
    """3e-05 -> '3e-5', 0.0002 -> '2e-4', 1.5e-05 -> '1.5e-5'."""
    mantissa, exponent = f"{x:.6e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


_DEFAULT = FinetuneConfig.model_fields


@dataclass(frozen=True)
class Setting:
    learning_rate: float
    batch_size: int
    num_train_epochs: float
    pooling: str = _DEFAULT["pooling"].default
    layerwise_lr_decay: float = _DEFAULT["layerwise_lr_decay"].default

    @property
    def name(self) -> str:
        name = f"lr{_short(self.learning_rate)}-bs{self.batch_size}-ep{self.num_train_epochs:g}"
        if self.pooling != _DEFAULT["pooling"].default:
            name += f"-{self.pooling}"
        if self.layerwise_lr_decay != _DEFAULT["layerwise_lr_decay"].default:
            name += f"-lld{self.layerwise_lr_decay:g}"
        return name

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Setting:
        """The setting of an :meth:`as_dict` row (one written before a field existed: its default)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def of(cls, cfg: FinetuneConfig) -> Setting:
        """The one setting of a one-point config (what one job runs with)."""
        return cls(cfg.learning_rate, cfg.batch_size, cfg.num_train_epochs, cfg.pooling, cfg.layerwise_lr_decay)

    def job_config(self, cfg: FinetuneConfig) -> FinetuneConfig:
        """``cfg`` reduced to this setting: what its job runs with."""
        return cfg.at(*astuple(self))


def settings(cfg: FinetuneConfig) -> list[Setting]:
    """Every setting of ``cfg``'s grid, in its order (the order that breaks ties on dev)."""
    return [Setting(*point) for point in cfg.grid()]


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
