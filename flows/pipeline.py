"""The whole DAG as one Prefect flow: clean -> vocab -> instances -> pre-train -> fine-tune -> report.

    bertpipe run --preset demo --set pretrain.phases.0.max_steps=20

Each stage is a task that runs the stage's flow into ``<storage_root>/<stage>/<version>``
(pre-training: ``<runs_root or storage_root>/pretrain/<version>``), by the rule a stage's flow run
alone uses too (``flows.versions.stage_paths``), skipped when that folder is finished, so a re-run
resumes where a failed one stopped. What every stage reads is checked first (``bert_core.preflight``). Fine-tune jobs (one per checkpoint x task) are isolated: a failed one is reported and
fails the run only after the others finish.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from bert_core import lease, storage
from bert_core.config import PipelineConfig
from bert_core.preflight import check_run, extra_checkpoints
from flows.dispatch import run_on_deployment
from flows.retry import retry_on_infrastructure
from flows.versions import (
    SKIPPED,
    checkpoint_identity,
    finetune_folder,
    finetune_job_config,
    finetune_version,
    pretrain_version,
    run_once,
    stage_paths,
    unwrap,
)

# --------------------------------------------------------------------------- stages


def _stage_flow(stage: str):
    # Imported when first needed: each stage flow pulls in its heavy framework (Beam, DeepSpeed).
    if stage == "corpus":
        from flows.corpus import clean_corpus
        return clean_corpus
    if stage == "vocab":
        from flows.vocab import build_vocab
        return build_vocab
    if stage == "instances":
        from flows.instances import create_instances
        return create_instances
    if stage == "pretrain":
        from flows.pretrain import pretrain
        return pretrain
    if stage == "finetune":
        from flows.finetune import finetune
        return finetune
    raise ValueError(f"unknown stage {stage!r}")


@task(retries=2, retry_delay_seconds=20, retry_condition_fn=retry_on_infrastructure,
      cache_policy=NO_CACHE, task_run_name="{stage}")
def run_stage(stage: str, config: PipelineConfig, output: str, inputs: dict[str, Any]):
    """Run one stage flow into ``output`` unless its manifest says it already finished."""
    return run_once(stage, output, lambda: _stage_flow(stage)(config, **inputs, output=output))


@task(retries=2, retry_delay_seconds=20, retry_condition_fn=retry_on_infrastructure,
      cache_policy=NO_CACHE, task_run_name="finetune-{task_name}-{label}")
def finetune_job(config: PipelineConfig, checkpoint: str, folder: str, task_name: str, label: str,
                 version: str):
    """One fine-tune job (every setting and seed of one task on one checkpoint) into
    ``<folder>/<task_name>``, here or on a work pool; done when that folder's manifest has ``version``."""
    job_config = finetune_job_config(config, task_name)
    what = f"finetune {task_name} on {label}"
    params = {"checkpoint": checkpoint, "output": folder, "checkpoint_name": label}

    def work() -> None:
        if not config.finetune.deployment:
            _stage_flow("finetune")(job_config, **params)
            return
        run_on_deployment(config.finetune.deployment, f"finetune-{task_name}-{label}",
                          {"config": job_config.model_dump(mode="json"), **params},
                          key=storage.join(folder, task_name))

    return run_once(what, storage.join(folder, task_name), work, version=version)


# --------------------------------------------------------------------------- the DAG


class FinetuneJob(NamedTuple):
    """The arguments of one :func:`finetune_job`, in its order."""

    config: PipelineConfig  # with the checkpoint's own settings (``finetune.by_checkpoint``)
    checkpoint: str
    folder: str
    task_name: str
    label: str
    version: str


def fan_out_finetune(config: PipelineConfig, checkpoints: dict[str, str]) -> list[dict[str, Any]]:
    """One isolated job per checkpoint x task (called inside a flow) into
    ``finetune/<checkpoint name>/<task>``; failures become rows. Then ``finetune/`` and each
    checkpoint's folder get their index (``bertpipe stats <storage_root>/finetune``)."""
    from bert_core.finetune import get_task
    from bert_core.finetune.report import write_index

    for name in sorted(set(config.finetune.by_checkpoint) - set(checkpoints)):
        print(f"finetune.by_checkpoint.{name}: unused, no checkpoint of that name is fine-tuned "
              f"here ({', '.join(checkpoints)})")
    jobs = []
    for label, checkpoint in checkpoints.items():
        ident = checkpoint_identity(checkpoint, config.storage_root)
        job_config = config.model_copy(update={"finetune": config.finetune.for_checkpoint(label)})
        for task_name in (get_task(t).name for t in config.finetune.tasks):
            jobs.append(FinetuneJob(job_config, checkpoint, finetune_folder(config, label), task_name, label,
                                    finetune_version(job_config, task_name, ident)))
    submit = config.finetune.deployment is not None
    # Deployed jobs run in parallel on the pool; in-process jobs one after another (shared CPU).
    states = [finetune_job.submit(*job) if submit else finetune_job(*job, return_state=True) for job in jobs]
    results = []
    for job, st in zip(jobs, states, strict=True):
        if submit:
            st.wait()
        state = st.state if submit else st
        if state.is_completed():
            value = unwrap(state.result())
            results.append({"checkpoint": job.label, "task": job.task_name, **value})
        else:
            results.append({"checkpoint": job.label, "task": job.task_name, "status": "failed",
                            "output": storage.join(job.folder, job.task_name), "error": state.message or state.name})
    for folder in dict.fromkeys(job.folder for job in jobs):
        write_index(folder)
    write_index(storage.join(config.storage_root, "finetune"))
    return results


@task(retries=2, retry_delay_seconds=20, retry_condition_fn=retry_on_infrastructure,
      cache_policy=NO_CACHE, task_run_name="publish-model")
def publish_model(run: str, output: str):
    """Copy a finished run's ``hf/`` export to ``output`` (the bucket) with a manifest, under the
    folder's lease: two runs publishing one version take turns, the second finds it finished."""
    def work() -> None:
        from bert_core.card import CARD

        with lease.hold(output, "model") as held:
            if held.finished:
                return
            run_manifest = storage.read_manifest(run)
            files = storage.copy_files(storage.join(run, "hf"), output)
            if not any(f.endswith(("model.safetensors", "pytorch_model.bin")) for f in files):
                raise RuntimeError(f"{storage.join(run, 'hf')} holds no model weights; was the export written?")
            storage.write_manifest(output, stage="model", config={"run": storage.to_uri(run)},
                                   inputs=[run_manifest],
                                   # the card is rewritten by the registry as the version is judged
                                   shards=[storage.shard_entry(f) for f in files if not f.endswith("/" + CARD)],
                                   counts={"files": len(files)}, fence=lease.fence(output, held.attempt))

    return run_once("model", output, work)


@task(cache_policy=NO_CACHE, task_run_name="random-init-model")
def save_random_init(config: PipelineConfig, vocab: str, output: str):
    """The pre-trained model's architecture and vocab with the weights its run started from (the
    baseline), saved under the folder's lease."""
    def work() -> None:
        from bert_core.pretrain.in_process import save_random_init
        from bert_core.pretrain.run_folder import model_config
        from bert_core.vocab.tokenization import load_tokenizer

        with lease.hold(output, "model") as held:
            if held.finished:
                return
            model = save_random_init(model_config(config, load_tokenizer(vocab).vocab_size), config.pretrain.seed,
                                     output, storage.join(vocab, "vocab.txt"), config.vocab.lowercase)
            files = [f for f in storage.list_files(output) if f.rsplit("/", 1)[-1] not in (lease.LEASE, lease.LOCK)]
            storage.write_manifest(output, stage="model", config={"random_init_seed": config.pretrain.seed,
                                                                  **model.config.model_dump(mode="json")},
                                   inputs=[storage.read_manifest(vocab)], fence=lease.fence(output, held.attempt),
                                   shards=[storage.shard_entry(f) for f in files], counts={"files": len(files)})

    return run_once("random-init model", output, work)


def stage_once(stage: str, config: PipelineConfig, output: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Run one stage's flow into ``output`` unless finished; its status and output."""
    # Pre-training retries its launch inside its own flow (pretrain.launch_retries), only there.
    run = run_stage.with_options(retries=0) if stage == "pretrain" else run_stage
    return unwrap(run(stage, config, output, inputs))


def pipeline_run_name() -> str:
    """``demo-2026-11-26-1431``: the config's name and the UTC minute the run started."""
    import datetime as dt

    from prefect.runtime import flow_run

    config = flow_run.parameters["config"]
    name = config.name if isinstance(config, PipelineConfig) else config.get("name", "bert")
    return f"{name}-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d-%H%M}"


def data_stages(config: PipelineConfig) -> dict[str, dict[str, Any]]:
    """The three Beam stages (corpus, vocab, instances) in their version folders, on
    ``config.beam_runner``: each stage's status and output."""
    stages: dict[str, dict[str, Any]] = {}
    for stage in ("corpus", "vocab", "instances"):
        inputs = stage_paths(config, stage)
        stages[stage] = stage_once(stage, config, inputs.pop("output"), inputs)
    return stages


@flow(name="bert-pipeline", flow_run_name=pipeline_run_name, log_prints=True)
def bert_pipeline(config: PipelineConfig) -> dict[str, Any]:
    """Raw text to fine-tuned models; finished stages are skipped, failed jobs listed."""
    from flows.report import publish_pipeline_report

    check_run(config)  # a deployment's run checks too, not only `bertpipe run`
    stages = data_stages(config)
    vocab, instances = stages["vocab"]["output"], stages["instances"]["output"]

    version = pretrain_version(config, instances, vocab)
    inputs = stage_paths(config, "pretrain", instances=instances, vocab=vocab)
    run = inputs.pop("output")
    stages["pretrain"] = stage_once("pretrain", config, run, inputs)

    pretrained = storage.join(run, "hf")
    if config.runs_root:
        pretrained = storage.join(config.storage_root, "models", version)
        stages["model"] = unwrap(publish_model(run, pretrained))

    checkpoints = {"pretrained": pretrained}
    if config.finetune.random_init_baseline:
        checkpoints["random-init"] = storage.join(config.storage_root, "models", f"random-init-{version}")
        stages["random-init"] = unwrap(save_random_init(config, vocab, checkpoints["random-init"]))
    checkpoints |= extra_checkpoints(config)
    results = fan_out_finetune(config, checkpoints)
    stages["finetune"] = {"status": _overall(results), "output": storage.join(
        config.storage_root, "finetune")}

    summary = {"stages": stages, "finetune_jobs": results,
               "storage_root": storage.to_uri(config.storage_root)}
    publish_pipeline_report(config, summary, run=run, instances=instances)
    failed = [r for r in results if r["status"] == "failed"]
    if failed:
        from bert_core.finetune.report import failure_lines

        raise RuntimeError(f"fine-tune jobs failed: {'; '.join(failure_lines(failed))} (every other job finished; "
                           "run the pipeline again to retry just these)")
    print(json.dumps({k: v["status"] for k, v in stages.items()}))
    return summary


def _overall(results: list[dict[str, Any]]) -> str:
    statuses = {r["status"] for r in results}
    if "failed" in statuses:
        return f"{sum(r['status'] == 'failed' for r in results)}/{len(results)} failed"
    return SKIPPED if statuses == {SKIPPED} else "completed"
