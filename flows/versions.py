"""Where each stage writes and whether it already finished: one rule for every flow.

    from flows.versions import corpus_folder, is_done, run_once, stage_paths

A stage's ``version`` hashes its config and the manifests of its inputs. A folder is done when it
holds its ``_MANIFEST.json`` (written last) and, where the folder is not named by its version, the
manifest records the wanted one; done work is skipped ("skipped (cached)"), another version redone.
What lies inside the storage root enters a version by its place in the root, under the root's
own name (``storage.root_name``), so a root copied, synced or mounted elsewhere keeps its versions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import get_run_logger
from prefect.states import Completed, State

from bert_core import lease, storage
from bert_core.config import FAN_OUT_FIELDS, FinetuneConfig, PipelineConfig, config_hash, versioned
from bert_core.preflight import runs_base

SKIPPED = "skipped (cached)"


# --------------------------------------------------------------------------- identities


def portable(root: str, uri: str) -> str:
    """``uri`` as a version names it: a place inside the storage root ``root`` under the root's
    name, anything else (a user's book folder, a given checkpoint) as it is."""
    where, base = storage.to_uri(uri), storage.to_uri(root).rstrip("/")
    if where == base or where.startswith(base + "/"):
        name = storage.root_name(root)
        if name != base:  # a root at the place it is named after keeps every name as given
            return name + where[len(base):]
    return uri


def manifest_identity(folder: str, root: str) -> dict[str, Any]:
    """What a downstream version depends on: the stage, its place and the bytes it wrote."""
    m = storage.read_manifest(folder)
    return {"stage": m.get("stage"), "uri": portable(root, storage.to_uri(folder)),
            "shards": [s.get("sha256") for s in m.get("shards", [])]}


def files_identity(patterns: list[str], root: str) -> list[list[Any]]:
    """Raw inputs (dumps, books) have no manifest: name and size stand for their content."""
    return [[portable(root, p), [[portable(root, u), storage.size(u)] for u in storage.glob(p)]]
            for p in patterns]


def checkpoint_identity(checkpoint: str, root: str) -> dict[str, Any]:
    """A pipeline checkpoint has a manifest (the run's); a given one is known by its files."""
    run = checkpoint.rstrip("/").rsplit("/", 1)[0]
    for folder in (checkpoint, run):
        if is_done(folder):
            return manifest_identity(folder, root)
    files = storage.list_files(checkpoint)
    if not files:
        raise FileNotFoundError(f"checkpoint {checkpoint}: no files there; give a folder with "
                                "config.json and model.safetensors (transformers layout)")
    config_json = storage.join(checkpoint, "config.json")
    return {"uri": portable(root, storage.to_uri(checkpoint)), "files": [[portable(root, u), storage.size(u)] for u in files],
            "config": storage.sha256(config_json) if storage.exists(config_json) else None}


# --------------------------------------------------------------------------- version folders


def stage_folder(root: str, stage: str, *parts: Any) -> str:
    """``<root>/<stage>/<version>``, the version hashing the stage's config and input identities."""
    return storage.join(root, stage, config_hash(*parts))


def corpus_folder(config: PipelineConfig) -> str:
    root, corpus = config.storage_root, config.corpus
    # The config names its inputs too (a refresh's dump lies under <root>/raw/).
    named = corpus.model_copy(update={k: [portable(root, p) for p in getattr(corpus, k)]
                                      for k in ("wikipedia", "books", "text")})
    inputs = files_identity(corpus.wikipedia + corpus.books + corpus.text, root)
    return stage_folder(root, "corpus", named, inputs)


def vocab_folder(config: PipelineConfig, corpus: str) -> str:
    root, vocab = config.storage_root, config.vocab
    if vocab.vocab_file:
        vocab = vocab.model_copy(update={"vocab_file": portable(root, vocab.vocab_file)})
    return stage_folder(root, "vocab", vocab, manifest_identity(corpus, root))


def instances_folder(config: PipelineConfig, corpus: str, vocab: str) -> str:
    root = config.storage_root
    return stage_folder(root, "instances", config.instances,
                        manifest_identity(corpus, root), manifest_identity(vocab, root))


def pretrain_version(config: PipelineConfig, instances: str, vocab: str,
                     extended: list[dict[str, Any]] | None = None) -> str:
    """The version of a pre-training run: its run folder and its published model share it.

    An extended run (its manifest's ``extended``, ``bertpipe pretrain --extend-to``) has the
    version of a run set to its length from the start, with the re-stretches since its last
    re-entry hashed in (``bert_core.pretrain.extend.version_extensions``): a re-entered run is
    that run, a re-stretched one is not. Its folder keeps the name it had."""
    from bert_core.pretrain.extend import version_extensions

    # How often a failed launch is retried, and where checkpoints are copied, do not change
    # what is trained.
    pretrain = versioned(config.pretrain, exclude=frozenset({"launch_retries", "checkpoint_uri"}))
    root = config.storage_root
    stretched = version_extensions(extended or [])
    return config_hash(config.model, pretrain, manifest_identity(instances, root), manifest_identity(vocab, root),
                       *([stretched] if stretched else []))


def pretrain_folder(config: PipelineConfig, instances: str, vocab: str) -> str:
    """``<runs_root or storage_root>/pretrain/<version>``: where a pre-training run writes."""
    return storage.join(runs_base(config), "pretrain", pretrain_version(config, instances, vocab))


# The folders each stage flow reads, by parameter name, in the order the stages run.
STAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "corpus": (), "vocab": ("corpus",), "instances": ("corpus", "vocab"), "pretrain": ("instances",)}


def stage_paths(config: PipelineConfig, stage: str, **given: str | None) -> dict[str, str]:
    """The folders ``stage`` reads (by its flow's parameter names) and writes (``output``) for
    ``config``: those ``given``, the rest by the pipeline's rule, each stage in its version folder.

    A version after the corpus's hashes the manifests of the stages before it, so those must have
    finished; an unfinished one is refused with the stage to run first."""
    if stage not in STAGE_INPUTS:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGE_INPUTS)}")
    paths = {name: folder for name, folder in given.items() if folder}

    def finished(name: str) -> str:
        if name not in paths:
            paths[name] = folder_of(name)
        folder = paths[name]
        if not is_done(folder):
            given_instead = f", or give {name}=FOLDER" if name in STAGE_INPUTS[stage] else ""
            raise storage.UnfinishedWriteError(
                f"{stage}: {name} {storage.to_uri(folder)} has no {storage.MANIFEST} (not run yet, or "
                f"unfinished); run the {name} stage first with this config (its {name}/local "
                f"deployment, or `bertpipe run` for every stage){given_instead}")
        return folder

    def folder_of(name: str) -> str:
        if name == "corpus":
            return corpus_folder(config)
        if name == "vocab":
            return vocab_folder(config, finished("corpus"))
        if name == "instances":
            return instances_folder(config, finished("corpus"), finished("vocab"))
        return pretrain_folder(config, finished("instances"), finished("vocab"))

    for name in (*STAGE_INPUTS[stage], "output"):
        if name not in paths:
            paths[name] = folder_of(stage if name == "output" else name)
    return {name: paths[name] for name in (*STAGE_INPUTS[stage], "output")}


def finetune_job_config(config: PipelineConfig, task_name: str) -> PipelineConfig:
    """The config one fine-tune job sees: its one task; the other fan-out settings at their
    defaults, so that a job's version does not depend on what else the fan-out runs."""
    fields = FinetuneConfig.model_fields
    cleared = {name: fields[name].get_default(call_default_factory=True) for name in FAN_OUT_FIELDS}
    ft = config.finetune.model_copy(update=cleared | {"tasks": [task_name]})
    return config.model_copy(update={"finetune": ft})


def finetune_folder(config: PipelineConfig, checkpoint_name: str) -> str:
    """``<storage_root>/finetune/<checkpoint name>``: every task's results on one checkpoint."""
    return storage.join(config.storage_root, "finetune", checkpoint_name)


def finetune_version(config: PipelineConfig, task_name: str, checkpoint_id: dict[str, Any]) -> str:
    """The version of one task fine-tuned on one checkpoint (``checkpoint_id`` from
    :func:`checkpoint_identity`): its settings, grid, seeds and data, and the checkpoint."""
    return config_hash(finetune_job_config(config, task_name).finetune, checkpoint_id)


# --------------------------------------------------------------------------- done or not


def is_done(folder: str, version: str | None = None) -> bool:
    """The one test of finished work: the folder holds its ``_MANIFEST.json``, and, given a
    ``version``, that manifest records it."""
    if not storage.has_manifest(folder):
        return False
    return version is None or storage.read_manifest(folder).get("version") == version


def cached(output: str) -> State:
    """What a skipped stage or job returns: shows as "Cached" in the UI, with its output."""
    return Completed(name="Cached", message=f"{SKIPPED}: {output}", data={"status": SKIPPED, "output": output})


def unwrap(out: Any) -> dict[str, Any]:
    """A task's return value, also when it returned a State (the "Cached" one)."""
    return out.result() if isinstance(out, State) else out


def run_once(what: str, output: str, work: Callable[[], Any],
             version: str | None = None) -> State | dict[str, Any]:
    """Inside a task: skip ``work`` when ``output`` is done (at ``version``, when given), else run
    it and check it finished. A finished ``output`` of another version is emptied first, under
    its lease (never while another run writes it): its results belong to another config or
    checkpoint and must not be read as these. Only a fine-tuning task's folder is given a
    ``version`` here: every stage's folder is named by its version, so a finished one is never
    written again (``lease.refuse_finished``)."""
    logger = get_run_logger()
    if is_done(output, version):
        logger.info("%s: %s, %s has a manifest", what, SKIPPED, output)
        return cached(output)
    if version is not None and storage.has_manifest(output):
        with lease.hold(output, "clear") as held:  # never under a live writer of the folder
            if is_done(output, version):  # finished at this version while this run waited
                logger.info("%s: %s, %s has a manifest", what, SKIPPED, output)
                return cached(output)
            if storage.has_manifest(output):
                old = storage.read_manifest(output).get("version")
                logger.info("%s: %s holds version %s, this config and checkpoint are %s; redoing",
                            what, output, old, version)
                if not lease.clear_if_held(output, held.attempt):
                    held.check()
    logger.info("%s: running into %s", what, output)
    work()
    if not is_done(output, version):
        raise RuntimeError(f"{what}: the work returned but {output} has no {storage.MANIFEST}"
                           f"{'' if version is None else f' of version {version}'}; it did not "
                           "finish its write, see the child flow run's logs")
    return {"status": "completed", "output": output}


def finished_manifest(what: str, output: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Inside a stage flow: the manifest of ``output``, read when done, else written by ``work``
    (which refuses a folder another run finished since: it is read then too)."""
    if is_done(output):
        get_run_logger().info("%s: %s, %s has a manifest; not redone", what, SKIPPED, output)
        return storage.read_manifest(output)
    try:
        return work()
    except lease.FinishedFolderError:
        get_run_logger().info("%s: %s, %s was finished by another run; not redone", what, SKIPPED, output)
        return storage.read_manifest(output)


# --------------------------------------------------------------------------- run names


def output_run_name() -> str:
    """A stage flow run's name in the UI: the last two parts of the folder it writes
    (``corpus/<version>``, ``pretrain/<version>``), so a run says what it made."""
    from prefect.runtime import flow_run

    output = str(flow_run.parameters.get("output") or "")
    return "/".join(output.rstrip("/").split("/")[-2:]) or flow_run.flow_name
