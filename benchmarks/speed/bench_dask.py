"""Throughput on a Dask cluster: each Beam stage on the local runner and on a two-worker Dask
cluster on this machine, on the sample corpus; wall time and CPU-seconds of every process.

    python -m benchmarks.speed.bench_dask

The inputs are bench_scale's at x1. Both runners must write the same shards (sha256 compared).
CPU-seconds on the cluster add what the scheduler's and the workers' process trees spent during
the stage; the cluster's start-up is reported on its own. Results: ``bench-results/dask.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, machine, measure, row, tree_cpu, write_rows
from benchmarks.common import samples as samples_dir
from benchmarks.speed.bench_scale import raw_inputs, stage_argv

STAGES = ("clean", "vocab", "instances")
WORKERS = 2


class Cluster:
    """``dask scheduler`` and ``dask worker --nworkers N --nthreads 1`` on 127.0.0.1."""

    def __init__(self, work: Path, env: dict[str, str], workers: int = WORKERS):
        dask = str(Path(sys.executable).with_name("dask"))
        self.scheduler_file = work / "scheduler.json"
        started = time.perf_counter()
        self.procs = [subprocess.Popen(
            [dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
             "--scheduler-file", str(self.scheduler_file)],
            env=env, stdout=open(work / "scheduler.log", "wb"), stderr=subprocess.STDOUT)]
        while not self.scheduler_file.exists():
            time.sleep(0.1)
        self.procs.append(subprocess.Popen(
            [dask, "worker", "--scheduler-file", str(self.scheduler_file), "--nworkers", str(workers),
             "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
            env=env, stdout=open(work / "workers.log", "wb"), stderr=subprocess.STDOUT))
        from dask.distributed import Client

        with Client(scheduler_file=str(self.scheduler_file)) as client:
            client.wait_for_workers(workers, timeout=120)
        self.start_s = round(time.perf_counter() - started, 2)

    def cpu(self) -> float:
        return tree_cpu([p.pid for p in self.procs])

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def shard_digests(work: Path, stage: str) -> dict[str, str]:
    folder = work / {"clean": "corpus", "vocab": "vocab", "instances": "instances"}[stage]
    found = {}
    for manifest in sorted(folder.rglob("_MANIFEST.json")):
        for shard in json.loads(manifest.read_text())["shards"]:
            found[f"{manifest.parent.relative_to(folder)}/{shard['path']}"] = shard["sha256"]
    return found


def main() -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    info, load = machine(), os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-dask-") as tmp:
        tmp = Path(tmp)
        inputs = raw_inputs(1, samples_dir(), [], tmp)
        local, cluster_work = tmp / "local", tmp / "dask"
        for stage in STAGES:
            local.mkdir(exist_ok=True)
            rows.append({"stage": stage, "runner": "local", "input_mb": inputs["input_mb"],
                         **measure(stage_argv(stage, local, inputs), local / f"{stage}.log", env)})
        cluster_work.mkdir()
        cluster = Cluster(cluster_work, env)
        try:
            for stage in STAGES:
                before = cluster.cpu()
                extra = ["--runner", "dask", "--set", "shared_storage=true", "--",
                         f"--dask_scheduler_file={cluster.scheduler_file}"]
                result = measure(stage_argv(stage, cluster_work, inputs, *extra), cluster_work / f"{stage}.log", env)
                result["cpu_s"] = round(result["cpu_s"] + cluster.cpu() - before, 2)
                rows.append({"stage": stage, "runner": "dask", "input_mb": inputs["input_mb"], **result})
                if shard_digests(local, stage) != shard_digests(cluster_work, stage):
                    raise SystemExit(f"{stage}: the Dask cluster's shards differ from the local runner's")
        finally:
            cluster.stop()
    ratios, summary = {}, []
    print(f"\nMachine: {info['cpu']}, {info['cores']} cores; load average {load[0]:.1f} at start; "
          f"{inputs['input_mb']} MB of distinct input; cluster start-up {cluster.start_s} s")
    print(f"{'stage':<10} {'local wall':>10} {'dask wall':>10} {'ratio':>6} {'local CPU':>10} {'dask CPU':>10} {'ratio':>6}")
    for stage in STAGES:
        a, b = (next(r for r in rows if r["stage"] == stage and r["runner"] == k) for k in ("local", "dask"))
        ratios[stage] = {"wall": round(b["wall_s"] / a["wall_s"], 2), "cpu": round(b["cpu_s"] / a["cpu_s"], 2)}
        print(f"{stage:<10} {a['wall_s']:>10.1f} {b['wall_s']:>10.1f} {ratios[stage]['wall']:>6.2f} "
              f"{a['cpu_s']:>10.1f} {b['cpu_s']:>10.1f} {ratios[stage]['cpu']:>6.2f}")
        summary.append(row(f"{stage}: CPU-seconds on a two-worker Dask cluster on this machine", b["cpu_s"],
                           a["cpu_s"], "CPU-s (reference: the local runner, 2 workers)", ratios[stage]["cpu"], 2))
    write_rows("dask", summary, machine=info, load_average={"start": load, "end": os.getloadavg()},
               workers=WORKERS, cluster_start_s=cluster.start_s, runs=rows, dask_over_local=ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
