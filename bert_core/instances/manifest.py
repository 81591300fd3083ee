"""The instances stage's folder: cleared before a run, manifests written after it, both by the
attempt that holds the folder's lease (``bert_core.lease``).

    OUT/seq{L}/part-SSSSS-of-NNNNN.parquet        training instances of length L (batch.py)
    OUT/seq{L}/eval/part-SSSSS-of-NNNNN.parquet   the eval split: the same columns, its own documents
    OUT/seq{L}/eval/_MANIFEST.json   the eval split of that length: shards, counts, stats, split="eval"
    OUT/seq{L}/_MANIFEST.json        training shards (sha256, count), counts (eval_instances too), stats
    OUT/rejects.jsonl                documents that gave no tokens, with the reason
    OUT/_MANIFEST.json               written last: InstanceConfig, inputs, per-length statistics,
                                     counts, vocab_file and vocab_sha256 (the vocab.txt of the ids)
"""

from __future__ import annotations

from typing import Any

from bert_core import lease, storage
from bert_core.config import InstanceConfig
from bert_core.instances.pool_files import merge_rejects
from bert_core.instances.sharding import EVAL, TRAIN, set_folder
from bert_core.instances.stats import InstanceStats
from bert_core.sorted_runs import SPILL_DIR


def prepare_output(output: str, config: InstanceConfig, attempt: str | None = None) -> None:
    """Refuse another stage's folder; clear an older instances run of the same lengths (eval
    splits included), so no old manifest vouches for shards being rewritten and no stale shard
    count is left behind; each removal only while ``attempt`` holds the lease."""
    if storage.has_manifest(output):
        stage = storage.read_manifest(output).get("stage")
        if stage != "instances":
            raise storage.OutputError(f"{output} holds the output of the {stage!r} stage; "
                             "give the instances their own --output folder")
    lease.remove_held(output, attempt, storage.join(output, storage.MANIFEST))
    lease.remove_held(output, attempt, storage.join(output, SPILL_DIR))
    for spec in config.lengths:
        lease.remove_held(output, attempt, storage.join(output, f"seq{spec.max_seq_length}"))


def vocab_record(vocab: str) -> dict[str, str]:
    """The vocab.txt the instances are tokenized with (``vocab`` is a vocab stage folder or a
    vocab.txt) and its sha256: the instances' ids mean something only with these bytes."""
    vocab_file = storage.to_uri(vocab if vocab.endswith(".txt") else storage.join(vocab, "vocab.txt"))
    if not storage.exists(vocab_file):
        return {}  # the tokenizer says what is missing
    return {"vocab_file": vocab_file, "vocab_sha256": storage.sha256(vocab_file)}


def _set_stats(results: list[dict], length: int, split: str) -> tuple[list[dict], InstanceStats]:
    """The shard results of one set, by shard index, and their stats added up."""
    mine = sorted((r for r in results if r["length"] == length and r["split"] == split),
                  key=lambda r: r["index"])
    stats = InstanceStats(max_seq_length=length)
    for r in mine:
        stats.merge(InstanceStats.from_dict(r["stats"]))
    return mine, stats


def write_manifests(results: list[dict], rejects: list[tuple[str, int]], layout: dict, *, output: str,
                    config: InstanceConfig, inputs: list[dict], documents_used: int,
                    eval_documents: int = 0, vocab: dict[str, str] | None = None,
                    attempt: str | None = None) -> dict:
    """The rejects file (from ``rejects``, the job's spill files of them and their counts), the
    job's spill folder removed, the shards published, then the per-length manifests (each eval
    split's first) and the top-level manifest (last: it marks done). ``layout`` has an eval set
    per length when the split is on; ``vocab`` is :func:`vocab_record` of the vocab used;
    ``attempt`` is the id of the lease the job holds on ``output`` (``bert_core.lease``): the
    job wrote under the attempt's own names (``lease.staging``), which move into place, and each
    manifest lands, only while the lease is still its own, so an attempt that lost its lease
    commits and deletes nothing.

    The top-level counts include ``eval_documents`` and ``eval_instances_seq{L}``;
    ``rejects.jsonl`` is merged from the job's sorted spill files of them.
    """
    if attempt is not None:
        lease.check(output, attempt)
    staged = lease.staging(output, attempt)  # where the attempt wrote, under names of its own
    n_rejected = merge_rejects([uri for uri, _ in rejects], storage.join(staged, "rejects.jsonl"))
    storage.remove(storage.join(staged, SPILL_DIR))
    lease.publish(output, attempt)  # lost: one line, nothing moved or committed
    stats_by_length: dict[str, Any] = {}
    counts: dict[str, Any] = {"documents_read": documents_used + n_rejected,
                              "documents_used": documents_used,
                              "documents_rejected": n_rejected, "eval_documents": eval_documents}
    has_eval = any(split == EVAL for _, split in layout)
    for spec in config.lengths:
        length = spec.max_seq_length
        length_config = {**config.model_dump(mode="json"), "max_seq_length": length,
                         "max_predictions_per_seq": spec.max_predictions_per_seq}
        eval_instances = 0
        if has_eval:
            mine, stats = _set_stats(results, length, EVAL)
            eval_instances = stats.instances
            storage.write_manifest(
                set_folder(output, (length, EVAL)), stage="instances", fence=lease.fence(output, attempt),
                config={**length_config, "dupe_factor": 1}, inputs=inputs, shards=[r["entry"] for r in mine],
                counts={"instances": stats.instances, "tokens": stats.tokens, "documents": eval_documents,
                        "shards": layout[(length, EVAL)]["shards"]},
                stats=stats.summary(), split=EVAL,
            )
        mine, stats = _set_stats(results, length, TRAIN)
        summary = stats.summary()
        stats_by_length[f"seq{length}"] = summary
        counts[f"instances_seq{length}"] = stats.instances
        counts[f"eval_instances_seq{length}"] = eval_instances
        storage.write_manifest(
            set_folder(output, (length, TRAIN)), stage="instances", config=length_config,
            fence=lease.fence(output, attempt),
            inputs=inputs, shards=[r["entry"] for r in mine],
            counts={"instances": stats.instances, "eval_instances": eval_instances, "tokens": stats.tokens,
                    "shards": layout[(length, TRAIN)]["shards"]},
            stats=summary,
        )
    return storage.write_manifest(
        output, stage="instances", config=config, inputs=inputs, counts=counts,
        fence=lease.fence(output, attempt),
        stats=stats_by_length, lengths={f"seq{s.max_seq_length}": f"seq{s.max_seq_length}"
                                        for s in config.lengths},
        **(vocab or {}),
    )
