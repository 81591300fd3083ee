"""The run report of flows/pipeline.py: the stages, the fine-tuning results and a markdown page
with the pre-training curves and instance lengths (``pipeline-stages``,
``pipeline-finetune-results``, ``pipeline-report``).
"""

from __future__ import annotations

from typing import Any

from bert_core import storage
from bert_core.config import PipelineConfig
from bert_core.histogram import Histogram
from bert_core.pretrain.metrics import kind, read_metrics
from flows import artifacts


def length_histograms(instances: str) -> dict[str, Histogram]:
    """The instance length histogram of each sequence length, as the instances manifest stores it."""
    stats = storage.read_manifest(instances).get("stats", {})
    return {name: Histogram.from_json(s["length_histogram"]) for name, s in stats.items()
            if isinstance(s, dict) and s.get("length_histogram")}


def objective(nsp: bool) -> str:
    """What pre-training optimises: the masked LM, with next-sentence prediction where trained."""
    return "MLM + NSP" if nsp else "MLM"


def pretrain_curves(rows: list[dict[str, Any]], nsp: bool = True) -> dict[str, Any]:
    """Loss and accuracy figures from ``metrics.jsonl`` rows: train and eval curves of every
    phase on one plot each (series like ``eval mlm_acc phase 1``); next-sentence accuracy only
    when ``nsp`` (the instances have next-sentence pairs)."""
    loss: dict[str, tuple[list[float], list[float]]] = {}
    acc: dict[str, tuple[list[float], list[float]]] = {}
    fields = [("loss", loss), ("mlm_acc", acc)] + ([("nsp_acc", acc)] if nsp else [])
    for row in rows:
        if "step" not in row:
            continue
        phase = f" phase {row['phase']}" if "phase" in row else ""
        for field, target in fields:
            value = row.get(field)
            if isinstance(value, (int, float)):
                xs, ys = target.setdefault(f"{kind(row)} {field}{phase}", ([], []))
                xs.append(float(row["step"]))
                ys.append(float(value))
    figs = {}
    if loss:
        figs["loss"] = artifacts.line_plot(loss, f"Pre-training loss ({objective(nsp)}), train and eval",
                                           ylabel="loss")
    if acc:
        what = "Masked LM and next-sentence accuracy" if nsp else "Masked LM accuracy"
        figs["accuracy"] = artifacts.line_plot(acc, f"{what}, train and eval", ylabel="accuracy")
    return figs


def finetune_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per checkpoint x task x metric, from each job's manifest (``stats.summary``):
    mean and sd over seeds on the 0-100 scale, to one decimal."""
    from bert_core.finetune.report import percent

    rows = []
    for job in results:
        base = {"checkpoint": job["checkpoint"], "task": job["task"]}
        if job["status"] == "failed":
            rows.append({**base, "metric": "-", "status": "failed", "error": job.get("error", "")[:200]})
            continue
        summary = storage.read_manifest(job["output"]).get("stats", {}).get("summary", {})
        for task, entry in sorted(summary.items()):
            failed = ",".join(str(s) for s in entry.get("failed_seeds", []))
            if not entry.get("metrics"):
                rows.append({**base, "task": task, "metric": "-", "failed_seeds": failed,
                             "status": "all seeds failed"})
            for metric, v in sorted(entry.get("metrics", {}).items()):
                main = " (main)" if metric == entry.get("main_metric") else ""
                rows.append({**base, "task": task, "metric": metric + main,
                             "mean": round(percent(task, v["mean"]), 1),
                             "sd": round(percent(task, v["sd"]), 1), "n": v["n"], "failed_seeds": failed,
                             "status": job["status"]})
    return rows


def _md_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "_none_\n"
    def fmt(v: Any) -> str:
        return f"{v:.1f}" if isinstance(v, float) else ("" if v is None else str(v))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def publish_pipeline_report(
    config: PipelineConfig, summary: dict[str, Any], *, run: str, instances: str
) -> str:
    """Publish the three pipeline artifacts; returns the markdown."""
    stage_rows = [{"stage": s, **info} for s, info in summary["stages"].items()]
    artifacts.publish_table("pipeline-stages", stage_rows, f"Stages of {config.name}")
    results = finetune_rows(summary["finetune_jobs"])
    artifacts.publish_table("pipeline-finetune-results", results,
                            "Fine-tuning: mean and sd over seeds per checkpoint x task x metric, "
                            "scores on 0-100")

    md = [f"# bertpipe run report: {config.name}\n",
          f"Storage root: `{summary['storage_root']}`\n", "## Stages\n",
          _md_table(stage_rows, ["stage", "status", "output"])]
    figures = pretrain_curves(read_metrics(run), nsp=config.instances.next_sentence_prediction)
    if figures:
        md.append("## Pre-training\n")
        md += [artifacts.markdown_image(fig, name) + "\n" for name, fig in figures.items()]
        md.append(f"Checkpoints: `{storage.join(run, 'checkpoints')}`, export: `{storage.join(run, 'hf')}`\n")
    lengths = length_histograms(instances)
    if any(h.total() for h in lengths.values()):
        md.append("## Instance lengths\n")
        for name, hist in sorted(lengths.items(), key=lambda kv: (len(kv[0]), kv[0])):
            fig = artifacts.histogram(hist, f"Tokens per instance ({name}, n={hist.total()})",
                                      "tokens incl. [CLS]/[SEP]")
            md.append(artifacts.markdown_image(fig, f"{name} lengths") + "\n")
    md.append("## Fine-tuning\n")
    md.append(_md_table(results, ["checkpoint", "task", "metric", "mean", "sd", "n",
                                  "failed_seeds", "status"]))
    text = "\n".join(md)
    artifacts.publish_markdown("pipeline-report", text, f"Run report of {config.name}")
    return text
