"""The refresh's plain steps: the continued pre-training config, the evaluation suite's scores
and the gate that decides whether a new model version replaces the current one.

    bertpipe refresh --date 20261201        (flows/refresh.py runs these between the stages)

The suite is paired: the new model and the current one are scored on the same held-out
documents (the new dump's eval split, and the previous dump's: what the new version forgot) and
on the same fine-tune tasks and seeds.
"""

from __future__ import annotations

from typing import Any

from bert_core import storage
from bert_core.config import PipelineConfig, PretrainPhase, RefreshConfig
from bert_core.failures import Refusal

EVAL_BATCH = 32


class SuiteError(Refusal):
    """The evaluation suite cannot run on these instances or models."""


class NoDumpError(LookupError, Refusal):
    """No finished dump among the dates looked at."""


class CorpusFloorError(Refusal):
    """A refreshed corpus holds fewer documents than ``refresh.min_documents``."""


def check_corpus_floor(corpus_manifest: dict[str, Any], refresh: RefreshConfig) -> None:
    """Refuse a corpus of fewer documents than the floor: a truncated dump must not train a model."""
    documents = int(corpus_manifest["counts"].get("documents", 0))
    if documents < refresh.min_documents:
        raise CorpusFloorError(
            f"{corpus_manifest['uri']}: {documents} documents, below refresh.min_documents="
            f"{refresh.min_documents}; check the dump (a truncated or failed download?) or lower the floor")


def continued_config(config: PipelineConfig) -> PipelineConfig:
    """The pre-training config of a run that continues a model: one phase at the first phase's
    sequence length and batch, ``refresh.max_steps`` steps, the rate warmed up again from 0."""
    first, r = config.pretrain.phases[0], config.refresh
    phase = PretrainPhase(**{**first.model_dump(), "max_steps": r.max_steps, "warmup_steps": r.warmup_steps,
                             "learning_rate": r.learning_rate or first.learning_rate})
    pretrain = config.pretrain.model_copy(update={"phases": [phase]})
    return config.model_copy(update={"pretrain": pretrain})


def eval_length(config: PipelineConfig) -> int:
    """The sequence length the suite's masked-LM scores are taken at: the first phase's."""
    return config.pretrain.phases[0].max_seq_length


def mlm_scores(model: str, instances: str, max_seq_length: int, seed: int) -> dict[str, float]:
    """Masked-LM loss and accuracy of ``model`` on the eval split of ``instances`` (every row,
    the same masks for every model)."""
    from bert_core.model.bert import BertForPreTraining
    from bert_core.pretrain.evaluate import EvalSplit, eval_metrics, eval_sums

    split = EvalSplit.open(instances, max_seq_length, EVAL_BATCH, seed=seed)
    if split is None:
        raise SuiteError(f"{instances}: no eval split at seq{max_seq_length}/eval, so the suite has no "
                         "held-out documents; set instances.eval_fraction above 0 and min_eval_documents")
    metrics = eval_metrics(eval_sums(BertForPreTraining.from_pretrained(model), split))
    return {"mlm_loss": metrics["mlm_loss"], "mlm_acc": metrics["mlm_acc"], "instances": metrics["instances"]}


def finetune_scores(folder: str, tasks: list[str]) -> dict[str, dict[str, float]]:
    """Each task's final score (0-100, mean and sd over seeds) from a checkpoint's fine-tune folder."""
    from bert_core.finetune import get_task
    from bert_core.finetune.report import task_stats

    names = [get_task(t).name for t in tasks]
    summary = task_stats(folder, names)["summary"]
    missing = [t for t in names if not (summary.get(t) or {}).get("final")]
    if missing:
        raise SuiteError(f"{folder}: no final score for {', '.join(missing)} (every job failed?); "
                         f"`bertpipe stats {folder}` shows the jobs")
    return {t: dict(summary[t]["final"]) for t in names}


def gate(new: dict[str, Any], current: dict[str, Any] | None, refresh: RefreshConfig) -> dict[str, Any]:
    """``{"decision": "promote" | "keep", "why": str, "rows": [...]}`` for the suite's scores of the
    new model and of the current one (``{"mlm": {name: {...}}, "finetune": {task: {...}}}``).

    The gate promotes when no metric is worse than the current model's by more than its band:
    ``refresh.mlm_loss_band`` for a masked-LM loss, ``refresh.finetune_band`` plus the larger seed
    sd for a fine-tune score.
    """
    if current is None:
        return {"decision": "promote", "why": "the first model of its line (no current model)", "rows": []}
    rows = []
    for name, score in new.get("mlm", {}).items():
        if name in current.get("mlm", {}):
            cur = current["mlm"][name]["mlm_loss"]
            rows.append({"metric": f"mlm_loss:{name}", "new": score["mlm_loss"], "current": cur,
                         "worse_by": score["mlm_loss"] - cur, "band": refresh.mlm_loss_band})
    for task, score in new.get("finetune", {}).items():
        if task in current.get("finetune", {}):
            cur = current["finetune"][task]
            rows.append({"metric": f"finetune:{task}", "new": score["mean"], "current": cur["mean"],
                         "worse_by": cur["mean"] - score["mean"],
                         "band": refresh.finetune_band + max(score["sd"], cur["sd"])})
    for row in rows:
        row["ok"] = row["worse_by"] <= row["band"]
    failed = [r for r in rows if not r["ok"]]
    if failed:
        why = "; ".join(f"{r['metric']} {r['new']:.4g} vs current {r['current']:.4g} (worse by "
                        f"{r['worse_by']:.4g} > band {r['band']:.4g})" for r in failed)
        return {"decision": "keep", "why": why, "rows": rows}
    if not rows:
        return {"decision": "keep", "why": "no metric of the suite is shared with the current model", "rows": rows}
    return {"decision": "promote", "why": f"no metric of {len(rows)} worse than current beyond its band",
            "rows": rows}


def model_identity(model: str | None) -> str | None:
    """What a continued run depends on besides its config and data: the sha256 of the model's manifest."""
    return storage.manifest_sha256(model) if model else None
