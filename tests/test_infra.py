"""infra/ templates rendered from the typed config (flows/tools/render.py): they parse, and they say
what the config says (node ranks, rendezvous address, GPUs, Beam options, deployments)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from bert_core.config import PipelineConfig, load_config
from flows.tools.render import (
    GPU_POOL,
    INFRA_DIR,
    PROCESS_POOL,
    REFRESH_CRON,
    InfraSettings,
    beam_args,
    gpu_base_job_template,
    load_prefect_yaml,
    master_host,
    prefect_yaml,
    pretrain_manifests,
)

GPU_SETS = ["pretrain.accelerator=gpu", "pretrain.nodes=3", "pretrain.procs_per_node=4",
            "pretrain.precision=bf16", "pretrain.zero_stage=1", "pretrain.master_port=29600",
            "pretrain.phases=[{max_seq_length: 128, max_steps: 10, global_batch_size: 96, "
            "micro_batch_size: 8, warmup_steps: 1}]", "instances.lengths=[{max_seq_length: 128}]"]


def test_every_template_parses():
    files = sorted(p for p in INFRA_DIR.rglob("*") if p.is_file())
    names = {str(p.relative_to(INFRA_DIR)) for p in files}
    assert {"Dockerfile", "prefect.yaml", "compose.yaml", "gcs-layout.md", "k8s/pretrain-node.yaml",
            "k8s/pretrain-service.yaml", "k8s/gpu-base-job-template.json", "beam/dataflow.yaml",
            "beam/flink.yaml", "beam/spark.yaml"} <= names
    assert not any(p.suffix == ".py" for p in files)  # infra/ is declarative only
    for path in files:
        if path.suffix in (".yaml", ".yml"):
            assert list(yaml.safe_load_all(path.read_text())), path
        elif path.suffix == ".json":
            assert json.loads(path.read_text()), path
    docker = (INFRA_DIR / "Dockerfile").read_text()
    for package in ("bert_core", "beam_jobs", "flows"):
        assert f"COPY {package} {package}" in docker
    assert 'ENTRYPOINT ["/opt/apache/beam/boot"]' in docker  # usable as a Beam custom container


def test_each_pod_gets_its_node_rank_master_address_and_gpus():
    from deepspeed.launcher.runner import parse_args

    cfg = load_config("demo", sets=GPU_SETS)
    settings = InfraSettings(image="gcr.io/p/bertpipe:1", namespace="ml", instances="gs://b/inst/v1",
                             run="/mnt/bertpipe-runs/pretrain/v2")
    config_map, service, *pods = pretrain_manifests(cfg, settings)
    assert [d["kind"] for d in (config_map, service, *pods)] == ["ConfigMap", "Service", "Pod", "Pod", "Pod"]
    master = "bert-pretrain-0.bert-pretrain.ml.svc.cluster.local"
    assert master_host(settings) == master
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["ports"][0]["port"] == 29600
    for rank, pod in enumerate(pods):
        spec = pod["spec"]
        # the pod's DNS name through the headless Service; rank 0's is the master address
        assert f"{spec['hostname']}.{spec['subdomain']}.ml.svc.cluster.local" == (
            master.replace("-0.", f"-{rank}.", 1))
        (container,) = spec["containers"]
        assert container["image"] == "gcr.io/p/bertpipe:1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
        command = container["command"]
        assert command[0] == "deepspeed"
        module_at = command.index("--module")
        args = parse_args(command[1:module_at + 2])  # DeepSpeed's own launcher parser
        assert (args.no_ssh, args.node_rank, args.num_nodes, args.num_gpus) == (True, rank, 3, 4)
        assert (args.master_addr, args.master_port) == (master, 29600)
        assert args.user_script == "bert_core.pretrain"
        script = command[module_at + 2:]
        assert script[script.index("--instances") + 1] == "gs://b/inst/v1"
        assert script[script.index("--output") + 1] == "/mnt/bertpipe-runs/pretrain/v2"
        # the run folder is a path on a volume every pod mounts (DeepSpeed saves with torch.save)
        assert {"name": "runs", "mountPath": "/mnt/bertpipe-runs"} in container["volumeMounts"]
        assert {"name": "runs", "persistentVolumeClaim": {"claimName": "bertpipe-runs"}} in spec["volumes"]
    # the pods' config is the run's config, switched to one launcher per pod
    run_cfg = PipelineConfig.model_validate(json.loads(config_map["data"]["pipeline.json"]))
    assert run_cfg.pretrain.launcher == "no_ssh" and run_cfg.pretrain.master_addr == master
    assert config_map["data"]["hostfile"].splitlines() == [f"node{i} slots=4" for i in range(3)]


def test_pods_mount_the_bucket_for_the_run_folder_and_refuse_a_gs_run():
    cfg = load_config("demo", sets=["storage_root=gs://bkt/team/bp", "runs_root=/mnt/gcs/runs"])
    _, _, pod = pretrain_manifests(cfg)
    assert pod["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "runs")
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert volume["csi"]["volumeAttributes"] == {"bucketName": "bkt",
                                                 "mountOptions": "implicit-dirs,only-dir=team/bp/runs"}
    container = pod["spec"]["containers"][0]
    assert {"name": "runs", "mountPath": "/mnt/gcs/runs"} in container["volumeMounts"]
    command = container["command"]
    assert command[command.index("--output") + 1] == "/mnt/gcs/runs/pretrain/demo"
    assert command[command.index("--instances") + 1] == "gs://bkt/team/bp/instances/latest"
    with pytest.raises(ValueError, match="torch.save"):
        pretrain_manifests(cfg, InfraSettings(run="gs://bkt/team/bp/pretrain/x"))


def test_cpu_pods_ask_for_cores_not_gpus():
    cfg = load_config("demo", sets=["pretrain.threads_per_rank=3"])
    _, _, pod = pretrain_manifests(cfg)
    container = pod["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert container["resources"]["requests"]["cpu"] == "6"  # 2 ranks x 3 threads
    assert {"name": "DS_ACCELERATOR", "value": "cpu"} in container["env"]
    assert pod["spec"]["tolerations"] == [] and pod["spec"]["nodeSelector"] == {}


def test_gpu_work_pool_template_is_consistent():
    tmpl = gpu_base_job_template(load_config("demo", sets=GPU_SETS))
    props = tmpl["variables"]["properties"]
    assert props["gpus"]["default"] == 4
    used = set(re.findall(r"\{\{ *(\w+) *\}\}", json.dumps(tmpl["job_configuration"])))
    assert used <= set(props), used - set(props)  # every placeholder has a variable
    container = tmpl["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert container["command"] == ["/usr/bin/env"]  # the image's entrypoint is Beam's boot


@pytest.mark.parametrize("runner,key,expected", [
    ("DataflowRunner", "project", "p-1"),
    ("FlinkRunner", "flink_master", "flink:8081"),
    ("SparkRunner", "spark_master_url", "spark://s:7077"),
])
def test_beam_runner_settings_are_real_pipeline_options(runner, key, expected):
    from apache_beam.options.pipeline_options import PipelineOptions

    cfg = load_config("demo", sets=["storage_root=gs://bucket/bp"])
    settings = InfraSettings(image="img:1", gcp_project="p-1", flink_master="flink:8081",
                             spark_master="spark://s:7077")
    options = PipelineOptions([f"--runner={runner}", *beam_args(cfg, runner, settings)])
    values = options.get_all_options()
    assert values["runner"] == runner and values[key] == expected
    if runner != "SparkRunner":
        assert values["temp_location"] == "gs://bucket/bp/tmp/beam"
    overlay = load_config("demo", sets=[f"beam_runner={runner}",
                                        f"beam_args={json.dumps(beam_args(cfg, runner, settings))}"])
    assert overlay.beam_args == beam_args(cfg, runner, settings)


def test_prefect_yaml_is_the_rendered_demo_and_names_real_flows():
    from prefect.flows import load_flow_from_entrypoint

    spec = load_prefect_yaml()
    # The file is exactly what render.py makes of the config it embeds (the demo preset when it
    # was rendered; later preset edits do not make it wrong, only older).
    embedded = PipelineConfig.model_validate(spec["definitions"]["parameters"]["config"])
    assert (INFRA_DIR / "prefect.yaml").read_text() == prefect_yaml(embedded), (
        "infra/prefect.yaml is not the rendering of its own config: re-render it with "
        "`bertpipe infra render --preset demo --out build/infra && cp build/infra/prefect.yaml infra/`")
    names = set()
    for d in spec["deployments"]:
        flow = load_flow_from_entrypoint(d["entrypoint"])
        names.add(f"{flow.name}/{d['name']}")
        assert "config" in flow.parameters.properties
        PipelineConfig.model_validate(d["parameters"]["config"])  # the UI form's defaults are valid
        assert d["work_pool"]["name"] in (PROCESS_POOL, GPU_POOL)
    assert {"bert-pipeline/local", "refresh/monthly", "corpus/local", "vocab/local",
            "instances/local", "pretrain/local", "pretrain/gpu", "finetune/local",
            "finetune/gpu"} == names
    (monthly,) = [d for d in spec["deployments"] if d["name"] == "monthly"]
    assert monthly["schedules"][0]["cron"] == REFRESH_CRON
    # fine-tuning reads the registry's current model unless a run names another checkpoint
    finetunes = [d for d in spec["deployments"] if d["entrypoint"] == "flows/finetune.py:finetune"]
    assert [d["parameters"]["checkpoint"] for d in finetunes] == ["models:current"] * 2


def test_compose_runs_prefect_on_postgres_on_localhost_only():
    compose = yaml.safe_load((INFRA_DIR / "compose.yaml").read_text())
    pg = compose["services"]["postgres"]["environment"]
    server = compose["services"]["prefect-server"]
    url = server["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert url == (f"postgresql+asyncpg://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}"
                   f"@postgres:5432/{pg['POSTGRES_DB']}")
    assert all(p.startswith("127.0.0.1:") for p in server["ports"])
    assert server["image"].startswith("prefecthq/prefect:3.8.8")


def test_cli_renders_everything(tmp_path: Path):
    from flows.cli.main import app

    out = tmp_path / "infra"
    result = CliRunner().invoke(app, [
        "infra", "render", "--out", str(out), "--set", "pretrain.nodes=2", "--set", "pretrain.procs_per_node=1",
        "--set", "pretrain.launcher=no_ssh", "--image", "img:2"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all((out / "k8s" / "pretrain.yaml").read_text()))
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Pod"] == ["bert-pretrain-0", "bert-pretrain-1"]
    assert yaml.safe_load((out / "beam" / "dataflow.config.yaml").read_text())["beam_runner"] == "DataflowRunner"
    assert yaml.safe_load((out / "prefect.yaml").read_text())["deployments"]
