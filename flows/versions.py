"""Where each stage writes and whether it already finished: one rule for every flow.

    from flows.versions import corpus_folder, is_done, run_once

A stage writes into ``<storage_root>/<stage>/<version>``, where ``version = config_hash(stage
config, identities of its inputs)``: the same settings on the same inputs always land in the
same folder. The stage is done iff that folder holds its ``_MANIFEST.json`` (written last, so
it is the proof that the write finished); a done stage is skipped and shows as ``Cached`` with
"skipped (cached)". The cache key comes from the manifests, never from Prefect's run ids or
result storage, so a re-run of a failed pipeline resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import get_run_logger
from prefect.states import Completed, State

from bert_core import storage
from bert_core.config import PipelineConfig, config_hash

SKIPPED = "skipped (cached)"


# --------------------------------------------------------------------------- identities


def manifest_identity(folder: str) -> dict[str, Any]:
    """What a downstream version depends on: the stage, its place and the bytes it wrote."""
    m = storage.read_manifest(folder)
    return {"stage": m.get("stage"), "uri": storage.to_uri(folder),
            "shards": [s.get("sha256") for s in m.get("shards", [])]}


def files_identity(patterns: list[str]) -> list[list[Any]]:
    """Raw inputs (dumps, books) have no manifest: name and size stand for their content."""
    return [[p, [[u, storage.size(u)] for u in storage.glob(p)]] for p in patterns]


def checkpoint_identity(checkpoint: str) -> dict[str, Any]:
    """A pipeline checkpoint has a manifest (the run's); a given one is known by its files."""
    run = checkpoint.rstrip("/").rsplit("/", 1)[0]
    for folder in (checkpoint, run):
        if is_done(folder):
            return manifest_identity(folder)
    files = storage.list_files(checkpoint)
    if not files:
        raise FileNotFoundError(f"checkpoint {checkpoint}: no files there; give a folder with "
                                "config.json and model.safetensors (transformers layout)")
    config_json = storage.join(checkpoint, "config.json")
    return {"uri": storage.to_uri(checkpoint), "files": [[u, storage.size(u)] for u in files],
            "config": storage.sha256(config_json) if storage.exists(config_json) else None}


# --------------------------------------------------------------------------- version folders


def stage_folder(root: str, stage: str, *parts: Any) -> str:
    """``<root>/<stage>/<version>``, the version hashing the stage's config and input identities."""
    return storage.join(root, stage, config_hash(*parts))


def corpus_folder(config: PipelineConfig) -> str:
    inputs = files_identity(config.corpus.wikipedia + config.corpus.books + config.corpus.text)
    return stage_folder(config.storage_root, "corpus", config.corpus, inputs)


def vocab_folder(config: PipelineConfig, corpus: str) -> str:
    return stage_folder(config.storage_root, "vocab", config.vocab, manifest_identity(corpus))


def instances_folder(config: PipelineConfig, corpus: str, vocab: str) -> str:
    return stage_folder(config.storage_root, "instances", config.instances,
                        manifest_identity(corpus), manifest_identity(vocab))


def pretrain_version(config: PipelineConfig, instances: str, vocab: str) -> str:
    """The version of a pre-training run: its run folder and its published model share it."""
    return config_hash(config.model, config.pretrain, manifest_identity(instances),
                       manifest_identity(vocab))


def finetune_folder(config: PipelineConfig, checkpoint_id: dict[str, Any]) -> str:
    """``config`` is one job's config (one task); ``checkpoint_id`` from :func:`checkpoint_identity`."""
    return stage_folder(config.storage_root, "finetune", config.finetune, checkpoint_id)


# --------------------------------------------------------------------------- done or not


def is_done(folder: str) -> bool:
    """The one test of finished work: the folder holds its ``_MANIFEST.json``."""
    return storage.has_manifest(folder)


def cached(output: str) -> State:
    """What a skipped stage or job returns: shows as "Cached" in the UI, with its output."""
    return Completed(name="Cached", message=f"{SKIPPED}: {output}", data={"status": SKIPPED, "output": output})


def unwrap(out: Any) -> dict[str, Any]:
    """A task's return value, also when it returned a State (the "Cached" one)."""
    return out.result() if isinstance(out, State) else out


def run_once(what: str, output: str, work: Callable[[], Any]) -> State | dict[str, Any]:
    """Inside a task: skip ``work`` when ``output`` is done, else run it and check it finished."""
    logger = get_run_logger()
    if is_done(output):
        logger.info("%s: %s, %s has a manifest", what, SKIPPED, output)
        return cached(output)
    logger.info("%s: running into %s", what, output)
    work()
    if not is_done(output):
        raise RuntimeError(f"{what}: the work returned but {output} has no {storage.MANIFEST}; "
                           "it did not finish its write, see the child flow run's logs")
    return {"status": "completed", "output": output}


def finished_manifest(what: str, output: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Inside a stage flow: the manifest of ``output``, read when done, else written by ``work``."""
    if is_done(output):
        get_run_logger().info("%s: %s, %s has a manifest; not redone", what, SKIPPED, output)
        return storage.read_manifest(output)
    return work()
