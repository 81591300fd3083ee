"""Render infra/ (Kubernetes, Prefect deployments, Beam runner settings) from the typed config.

    bertpipe infra render --preset bert-base-128 --set pretrain.nodes=4 --out build/infra

``infra/`` holds templates with ``${name}`` placeholders, filled from
:class:`~bert_core.config.PipelineConfig` and the few :class:`InfraSettings` that are not part of
a run (image, namespace); ``infra/prefect.yaml`` is rendered from the ``demo`` preset.
"""

from __future__ import annotations

import copy
import json
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bert_core import storage
from bert_core.config import PipelineConfig

INFRA_DIR = Path(__file__).resolve().parents[2] / "infra"
PROCESS_POOL = "bertpipe-process"
GPU_POOL = "bertpipe-k8s-gpu"
# The refresh runs on the 10th of each month: the dump of the 1st has finished its articles job
# by then; the refresh falls back to an earlier dump if not.
REFRESH_CRON = "0 6 10 * *"
BEAM_RUNNERS = {"DataflowRunner": "dataflow", "FlinkRunner": "flink", "SparkRunner": "spark"}


@dataclass(frozen=True)
class InfraSettings:
    """Where things run; not part of a run's config (so not in its version hash)."""

    image: str = "bertpipe:latest"
    namespace: str = "bertpipe"
    job_name: str = "bert-pretrain"
    instances: str | None = None  # instance folder the pods read; default <root>/instances/latest
    run: str | None = None  # run folder the pods write; default <runs mount>/pretrain/<config name>
    runs_mount: str = "/mnt/bertpipe-runs"  # where pods mount the runs volume unless runs_root is set
    runs_claim: str = "bertpipe-runs"  # ReadWriteMany PVC for the runs volume when storage is not gs://
    gcp_project: str = "my-gcp-project"
    gcp_region: str = "us-central1"
    flink_master: str = "flink-jobmanager:8081"
    spark_master: str = "spark://spark-master:7077"
    max_workers: int = 32
    memory_per_node: str = "64Gi"


def fill(template: str, values: dict[str, Any], name: str = "template") -> str:
    """``${key}`` -> value (dicts/lists as flow-style JSON, valid YAML); unknown keys are an error."""
    rendered = string.Template(template).safe_substitute(
        {k: json.dumps(v) if isinstance(v, (dict, list)) else str(v) for k, v in values.items()})
    missing = sorted(set(re.findall(r"\$\{(\w+)\}", rendered)))
    if missing:
        raise ValueError(f"{name}: no value for {', '.join(missing)}; add it to the render call")
    return rendered


def template(relative: str) -> str:
    path = INFRA_DIR / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path}: infra template missing; run from a bertpipe checkout or image")
    return path.read_text()


# --------------------------------------------------------------------------- Kubernetes


def master_host(settings: InfraSettings) -> str:
    """Node 0's stable DNS name through the headless Service."""
    return f"{settings.job_name}-0.{settings.job_name}.{settings.namespace}.svc.cluster.local"


def pretrain_manifests(cfg: PipelineConfig, settings: InfraSettings = InfraSettings()) -> list[dict]:
    """ConfigMap + headless Service + one Pod per node, each with its own ``--node_rank``."""
    from bert_core.pretrain.launch import DEFAULT_MASTER_PORT, launcher_argv, render_hostfile

    pre = cfg.pretrain.model_copy(update={"launcher": "no_ssh", "master_addr": master_host(settings)})
    run_cfg = cfg.model_copy(update={"pretrain": pre})
    instances = settings.instances or storage.join(cfg.storage_root, "instances", "latest")
    mount = storage.to_uri(cfg.runs_root or settings.runs_mount)
    run = settings.run or storage.join(mount, "pretrain", cfg.name)
    if not storage.is_local(run) or not run.startswith(mount.rstrip("/") + "/"):
        raise ValueError(f"run folder {run}: pods write it with torch.save, so it must be a path under "
                         f"the runs volume mounted at {mount} (set runs_root or InfraSettings.runs_mount)")
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{settings.job_name}-config", "namespace": settings.namespace},
        "data": {"pipeline.json": json.dumps(run_cfg.model_dump(mode="json"), indent=1),
                 "hostfile": render_hostfile(pre)},
    }
    protocol, path = storage.split_protocol(cfg.storage_root)
    if protocol == "gs":  # the bucket itself, through GKE's gcsfuse CSI driver
        bucket, _, prefix = path.partition("/")
        only_dir = f"{prefix.strip('/')}/runs" if prefix.strip("/") else "runs"
        runs_volume = {"name": "runs", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {
            "bucketName": bucket, "mountOptions": f"implicit-dirs,only-dir={only_dir}"}}}
        annotations = {"gke-gcsfuse/volumes": "true"}
    else:
        runs_volume = {"name": "runs", "persistentVolumeClaim": {"claimName": settings.runs_claim}}
        annotations = {}
    common = {"job_name": settings.job_name, "namespace": settings.namespace,
              "master_port": pre.master_port or DEFAULT_MASTER_PORT, "image": settings.image}
    docs = [config_map, yaml.safe_load(fill(template("k8s/pretrain-service.yaml"), common))]
    gpu = pre.accelerator == "gpu"
    requests = {"cpu": str(pre.procs_per_node * pre.threads_per_rank), "memory": settings.memory_per_node}
    limits = {"memory": settings.memory_per_node}
    if gpu:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(pre.procs_per_node)
    env = [{"name": "OMP_NUM_THREADS", "value": str(pre.threads_per_rank)},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if not gpu:
        env.append({"name": "DS_ACCELERATOR", "value": "cpu"})
    node_template = template("k8s/pretrain-node.yaml")
    for rank in range(pre.nodes):
        command = launcher_argv(
            pre, ["--config", "/etc/bertpipe/pipeline.json", "--instances", instances, "--output", run],
            node_rank=rank, hostfile="/etc/bertpipe/hostfile")
        docs.append(yaml.safe_load(fill(node_template, {
            **common, "node_rank": rank, "command": command, "env": env, "requests": requests,
            "limits": limits, "annotations": annotations, "runs_volume": runs_volume, "runs_mount": mount,
            "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"} if gpu else {},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
            if gpu else [],
        }, "k8s/pretrain-node.yaml")))
    return docs


def gpu_base_job_template(cfg: PipelineConfig, settings: InfraSettings = InfraSettings()) -> dict:
    """The Kubernetes work pool's base job template with this config's defaults filled in."""
    tmpl = json.loads(template("k8s/gpu-base-job-template.json"))
    props = tmpl["variables"]["properties"]
    pre = cfg.pretrain
    props["gpus"]["default"] = pre.procs_per_node if pre.accelerator == "gpu" else 0
    props["image"]["default"] = settings.image
    props["namespace"]["default"] = settings.namespace
    props["cpu"]["default"] = str(pre.procs_per_node * pre.threads_per_rank)
    props["memory"]["default"] = settings.memory_per_node
    props["env"]["default"] = {**props["env"]["default"], "OMP_NUM_THREADS": str(pre.threads_per_rank)}
    return tmpl


# --------------------------------------------------------------------------- Beam


def beam_settings(cfg: PipelineConfig, runner: str, settings: InfraSettings = InfraSettings()) -> dict:
    """The runner's YAML from infra/beam/, filled in: ``{"runner": ..., "options": {...}}``."""
    if runner not in BEAM_RUNNERS:
        raise ValueError(f"runner {runner!r}: choose one of {', '.join(BEAM_RUNNERS)}")
    name = f"beam/{BEAM_RUNNERS[runner]}.yaml"
    values = {"gcp_project": settings.gcp_project, "gcp_region": settings.gcp_region,
              "storage_root": storage.to_uri(cfg.storage_root), "image": settings.image,
              "max_workers": settings.max_workers, "flink_master": settings.flink_master,
              "spark_master": settings.spark_master}
    return yaml.safe_load(fill(template(name), values, name))


def beam_args(cfg: PipelineConfig, runner: str, settings: InfraSettings = InfraSettings()) -> list[str]:
    """``--key=value`` pipeline options for the runner (what ``PipelineConfig.beam_args`` holds)."""
    opts = beam_settings(cfg, runner, settings)["options"]
    return [f"--{k}={v}" for k, v in opts.items()]


def beam_overlay(cfg: PipelineConfig, runner: str, settings: InfraSettings = InfraSettings()) -> dict:
    """A config overlay for ``--config``: switches every Beam stage to that runner."""
    return {"beam_runner": runner, "beam_args": beam_args(cfg, runner, settings)}


# --------------------------------------------------------------------------- Prefect


def _deployment(name: str, entrypoint: str, description: str, pool: dict, **extra: Any) -> dict:
    return {"name": name, "entrypoint": entrypoint, "description": description,
            "tags": ["bertpipe"], "work_pool": pool, **extra}


def prefect_yaml(cfg: PipelineConfig, settings: InfraSettings = InfraSettings()) -> str:
    """``infra/prefect.yaml``: a deployment per flow, the monthly model refresh, process + GPU pools."""
    config = cfg.model_dump(mode="json")
    process = {"name": PROCESS_POOL, "work_queue_name": "default"}
    gpu_vars = {"image": settings.image, "gpus": cfg.pretrain.procs_per_node}
    gpu = {"name": GPU_POOL, "work_queue_name": "training", "job_variables": gpu_vars}
    params = {"config": config}
    # Fine-tuning reads the registry's current model unless a run names another checkpoint.
    finetune_params = {"config": config, "checkpoint": "models:current",
                       "output": f"{cfg.storage_root.rstrip('/')}/finetune/current"}
    deployments = [
        _deployment("local", "flows/pipeline.py:bert_pipeline",
                    "The whole DAG; finished stages are skipped.", process, parameters=params),
        _deployment("monthly", "flows/refresh.py:refresh",
                    "Refresh the model on the newest finished Wikipedia dump: continued pre-training, "
                    "the suite, the gate against models:current, promotion.",
                    process, parameters=params,
                    schedules=[{"cron": REFRESH_CRON, "timezone": "UTC", "active": True}]),
        _deployment("local", "flows/corpus.py:clean_corpus", "Stage 1: dumps + books -> documents.",
                    process, parameters=params),
        _deployment("local", "flows/vocab.py:build_vocab", "Stage 2: WordPiece vocab.", process,
                    parameters=params),
        _deployment("local", "flows/instances.py:create_instances",
                    "Stage 3: masked-LM instances (+ NSP pairs when instances.next_sentence_prediction "
                    "is on).", process, parameters=params),
        _deployment("local", "flows/pretrain.py:pretrain", "Stage 4: DeepSpeed on local CPU ranks.",
                    process, parameters=params),
        _deployment("gpu", "flows/pretrain.py:pretrain",
                    "Stage 4 on a GPU node of the Kubernetes pool (multi-node: infra/k8s/).", gpu,
                    parameters=params),
        _deployment("local", "flows/finetune.py:finetune",
                    "Stage 5: one checkpoint (models:current by default) x tasks x seeds (target of "
                    "run_deployment fan-out).", process, parameters=finetune_params),
        _deployment("gpu", "flows/finetune.py:finetune", "Stage 5 on a GPU pod (models:current by default).",
                    gpu, parameters=finetune_params),
    ]
    doc = {
        "name": "bertpipe",
        "prefect-version": "3.8.8",
        "build": None,
        "push": None,
        # Flow code is the installed checkout (process pool) or the image (Kubernetes pool).
        "pull": [{"prefect.deployments.steps.set_working_directory": {
            "directory": "{{ $BERTPIPE_HOME }}"}}],
        "definitions": {"work_pools": {"process": process, "gpu": gpu},
                        "parameters": params, "finetune_parameters": finetune_params},
        "deployments": deployments,
    }
    text = yaml.safe_dump(doc, sort_keys=False, width=100)
    # PyYAML anchors shared objects as &id001; name them after the key that holds them.
    for key, anchor in re.findall(r"(\w[\w-]*): &(id\d+)", text):
        text = text.replace(f"&{anchor}", f"&{key}").replace(f"*{anchor}", f"*{key}")
    header = (
        "# Prefect deployments of bertpipe: one per flow, the monthly model refresh, two work pools.\n"
        "# GENERATED from the demo preset: `bertpipe infra render --preset demo --out build/infra`\n"
        "# (flows/tools/render.py::prefect_yaml); edit that, not this file.\n"
        "#   prefect work-pool create bertpipe-process --type process\n"
        "#   prefect work-pool create bertpipe-k8s-gpu --type kubernetes \\\n"
        "#       --base-job-template build/infra/k8s/gpu-base-job-template.json\n"
        "#   BERTPIPE_HOME=$PWD prefect deploy --prefect-file infra/prefect.yaml --all\n"
        "#   prefect worker start --pool bertpipe-process       (or: bertpipe serve)\n"
    )
    return header + text


# --------------------------------------------------------------------------- all at once


def render_all(cfg: PipelineConfig, settings: InfraSettings, out: str) -> list[str]:
    """Write every rendered file under ``out``; returns their paths."""
    root = Path(out)
    written: list[str] = []

    def write(relative: str, text: str) -> None:
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(str(path))

    docs = pretrain_manifests(cfg, settings)
    write("k8s/pretrain.yaml", yaml.safe_dump_all(docs, sort_keys=False, width=100))
    write("k8s/gpu-base-job-template.json",
          json.dumps(gpu_base_job_template(cfg, settings), indent=2) + "\n")
    for runner, short in BEAM_RUNNERS.items():
        write(f"beam/{short}.config.yaml", yaml.safe_dump(beam_overlay(cfg, runner, settings),
                                                           sort_keys=False, width=100))
    write("prefect.yaml", prefect_yaml(cfg, settings))
    return written


def load_prefect_yaml(path: str | Path = INFRA_DIR / "prefect.yaml") -> dict:
    """The deployment definitions, with anchors resolved (a deep copy per deployment)."""
    data = yaml.safe_load(Path(path).read_text())
    data["deployments"] = [copy.deepcopy(d) for d in data["deployments"]]
    return data
