"""Deploy from infra/prefect.yaml to a local process work pool with a real worker, and send the
fine-tune fan-out there with run_deployment: one child flow run per task, each on the worker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bert_core.config import load_config

REPO = Path(__file__).resolve().parent.parent
TASKS = ["sst2", "ner"]
FIXTURES = REPO / "tests" / "fixtures" / "tasks"  # a few dozen examples a task


def _prefect(*args: str, env: dict[str, str]) -> str:
    prefect = str(Path(sys.executable).with_name("prefect"))
    done = subprocess.run([prefect, "--no-prompt", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_finetune_fan_out_runs_on_a_process_pool_worker(prefect_api, samples_dir, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterDeploymentId,
    )
    from prefect_server import server_env, stop_process_group

    from bert_core import storage
    from flows.pipeline import fan_out_finetune
    from flows.tools.render import PROCESS_POOL

    cfg = load_config("demo", sets=[
        f"storage_root={tmp_path / 'data'}", f"finetune.tasks={TASKS}", "finetune.seeds=[1]",
        f"finetune.data_dir={FIXTURES}", "finetune.max_train_examples=16",
        "finetune.learning_rates=[1e-4]", "finetune.epochs=[1]", "finetune.by_checkpoint={}",
        "finetune.deployment=finetune/local", "finetune.threads=1"])
    minilm = str(samples_dir / "models" / "minilm")

    env = {**server_env(prefect_api.home, prefect_api.api), "BERTPIPE_HOME": str(REPO), "OMP_NUM_THREADS": "1"}
    _prefect("work-pool", "create", PROCESS_POOL, "--type", "process", env=env)
    out = _prefect("deploy", "--prefect-file", "infra/prefect.yaml", "--name", "finetune/local", env=env)
    assert "finetune/local" in out
    worker = subprocess.Popen(
        [str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool", PROCESS_POOL,
         "--type", "process"], cwd=tmp_path, env=env, start_new_session=True,
        stdout=open(tmp_path / "worker.log", "wb"), stderr=subprocess.STDOUT)
    try:
        @flow(name="finetune-fan-out")
        def fan_out() -> list[dict]:
            return fan_out_finetune(cfg, {"minilm": minilm})

        results = fan_out()
    finally:
        stop_process_group(worker)
    log = (tmp_path / "worker.log").read_text()
    assert [(r["task"], r["status"]) for r in results] == [(t, "completed") for t in TASKS], log[-3000:]

    with get_client(sync_client=True) as client:
        (deployment,) = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["local"])))
        assert deployment.entrypoint == "flows/finetune.py:finetune"
        assert deployment.work_pool_name == PROCESS_POOL
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id])))
        # one child run per task, started by the worker, linked to the task that launched it
        assert sorted(r.name for r in children) == sorted(f"finetune-{t}-minilm" for t in TASKS)
        assert all(r.state.is_completed() and r.work_pool_name == PROCESS_POOL for r in children)
        assert all(r.parent_task_run_id is not None and r.idempotency_key for r in children)
        assert sorted(r.parameters["config"]["finetune"]["tasks"][0] for r in children) == sorted(TASKS)
        assert all(str(r.id) in log for r in children)  # the worker, not this process, ran them
    for r in results:
        summary = storage.read_manifest(r["output"])["stats"]["summary"]
        assert list(summary) == [r["task"]] and summary[r["task"]]["metrics"]
