"""The instances stage's folder: cleared before a run, manifests written after it.

    OUT/seq{L}/_MANIFEST.json   shards (sha256, count), counts and statistics of that length
    OUT/rejects.jsonl           documents that gave no tokens, with the reason
    OUT/_MANIFEST.json          written last: InstanceConfig, inputs, per-length statistics
"""

from __future__ import annotations

import json
from typing import Any

from bert_core import storage
from bert_core.config import InstanceConfig
from bert_core.instances.stats import InstanceStats


def prepare_output(output: str, config: InstanceConfig) -> None:
    """Refuse another stage's folder; clear an earlier instances run of the same lengths, so no
    old manifest vouches for shards being rewritten and no stale shard count is left behind."""
    if storage.has_manifest(output):
        stage = storage.read_manifest(output).get("stage")
        if stage != "instances":
            raise ValueError(f"{output} holds the output of the {stage!r} stage; "
                             "give the instances their own --output folder")
    storage.remove(storage.join(output, storage.MANIFEST))
    for spec in config.lengths:
        storage.remove(storage.join(output, f"seq{spec.max_seq_length}"))


def write_manifests(results: list[dict], rejects: list[dict], layout: dict, *, output: str,
                    config: InstanceConfig, inputs: list[dict], documents_used: int) -> dict:
    """Per-length manifests, the rejects file, then the top-level manifest (last: it marks done)."""
    stats_by_length: dict[str, Any] = {}
    counts: dict[str, Any] = {"documents_read": documents_used + len(rejects),
                              "documents_used": documents_used,
                              "documents_rejected": len(rejects)}
    for spec in config.lengths:
        length = spec.max_seq_length
        mine = sorted((r for r in results if r["length"] == length), key=lambda r: r["index"])
        stats = InstanceStats(max_seq_length=length)
        for r in mine:
            stats.merge(InstanceStats.from_dict(r["stats"]))
        summary = stats.summary()
        stats_by_length[f"seq{length}"] = summary
        counts[f"instances_seq{length}"] = stats.instances
        storage.write_manifest(
            storage.join(output, f"seq{length}"), stage="instances",
            config={**config.model_dump(mode="json"), "max_seq_length": length,
                    "max_predictions_per_seq": spec.max_predictions_per_seq},
            inputs=inputs, shards=[r["entry"] for r in mine],
            counts={"instances": stats.instances, "tokens": stats.tokens,
                    "shards": layout[length]["shards"]},
            stats=summary,
        )
    rejects = sorted(rejects, key=lambda r: str(r["id"]))
    storage.write_text(storage.join(output, "rejects.jsonl"),
                       "".join(json.dumps(r, sort_keys=True) + "\n" for r in rejects))
    return storage.write_manifest(
        output, stage="instances", config=config, inputs=inputs, counts=counts,
        stats=stats_by_length, lengths={f"seq{s.max_seq_length}": f"seq{s.max_seq_length}"
                                        for s in config.lengths},
    )
