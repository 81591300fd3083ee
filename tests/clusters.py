"""Clusters on 127.0.0.1 whose workers share no disk, for the cluster tests.

    with namespaced_cluster(shared, n_workers=2) as scheduler_file: ...   # Dask distributed
    with portable_cluster(shared, n_pools=2) as (job_endpoint, pool): ...  # Beam's Fn API
    with two_hosts() as hosts: ... on_host(hosts[i], shared, argv) ...      # two network namespaces

Dask: one ``dask scheduler`` and ``n_workers`` ``dask worker`` processes (one thread each).
Beam's portable worker protocol: Beam's Python job service (``local_job_service_main``, the
runner) and ``n_pools`` SDK worker pools (``worker_pool_main``, what runs beside a Flink or
Spark task manager), behind one address that hands each ``StartWorker`` to the next pool in turn
(as a Kubernetes Service in front of worker pods would). Each worker or pool runs in its own
mount namespace (``unshare -m``) with a private tmpfs over ``/tmp`` (its scratch, and every local
path of the driver under it), and ``shared`` mounted back into it at the same path, as network
storage would be; this checkout and its Python environment come back too where they lie under
``/tmp``, as a worker's image holds the code. What one worker writes under ``/tmp`` no other
worker and not the driver sees; what it writes under ``shared`` they all do. Workers start in
``/``, so a relative path that reached one would name another folder than on the driver.

Two hosts: two network namespaces joined by a veth pair, each with its own address (in a
private range, only inside the namespaces), for the multi-node pre-training test; a command runs
"on a host" in its namespace with its own mount namespace: private ``/tmp`` and ``/dev/shm``.

Not a test module: the cluster tests import it. :func:`namespaces_refused` says why a machine
cannot run it (no ``unshare``, or not permitted).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.prefect_server import stop_process_group

# In the worker's new mount namespace: keep each path of KEEP (one per line, outer first) aside,
# cover /tmp (and /dev/shm) with a tmpfs, put each kept path back. The namespace and its mounts end
# with the worker.
WORKER_SCRIPT = """set -e
mount --make-rprivate /
aside=$(mktemp -d /run/bertpipe-keep.XXXXXX)
IFS='
'
i=0
for path in $KEEP; do i=$((i + 1)); mkdir "$aside/$i"; mount --bind "$path" "$aside/$i"; done
mount -t tmpfs -o size=2g bertpipe-private /tmp
[ -z "$PRIVATE_SHM" ] || mount -t tmpfs -o size=1g bertpipe-shm /dev/shm
i=0
for path in $KEEP; do i=$((i + 1)); mkdir -p "$path"; mount --move "$aside/$i" "$path"; rmdir "$aside/$i"; done
rmdir "$aside" 2>/dev/null || true
unset IFS
cd /
exec "$@"
"""
MASKED = (Path("/tmp"), Path("/dev/shm"))


def kept_paths(shared: Path) -> str:
    """What a worker sees of this machine's disk, for KEEP: ``shared``, and the code its image
    would hold (this checkout, this Python's environment) where a masked folder would hide it."""
    code = [Path(__file__).resolve().parent.parent, Path(sys.prefix).resolve()]
    paths = [Path(shared).resolve()] + [p for p in code if any(p.is_relative_to(m) for m in MASKED)]
    outer = [p for p in paths if not any(p != q and p.is_relative_to(q) for q in paths)]
    return "\n".join(str(p) for p in sorted(set(outer), key=lambda p: len(p.parts)))


def namespaces_refused() -> str | None:
    """Why workers cannot get their own mount namespace here, or None when they can."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs bertpipe-probe /mnt && umount /mnt"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"mount namespaces are not permitted here: {probe.stderr.strip() or probe.returncode}"
    return None


IN_OWN_NAMESPACE = ["unshare", "-m", "--propagation", "private", "sh", "-c", WORKER_SCRIPT, "worker"]


def _dask() -> str:
    return str(Path(sys.executable).with_name("dask"))


def _starter(shared: Path, name: str, procs: list[subprocess.Popen]):
    """``start(name, argv)``: a process in its own session, started in ``/`` with this checkout
    on its path, logging to ``<shared>/../<name>-logs/``, appended to ``procs``."""
    shared.mkdir(parents=True, exist_ok=True)
    logs = shared.parent / f"{name}-logs"
    logs.mkdir(exist_ok=True)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "KEEP": kept_paths(shared),
           "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        with open(logs / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd="/"))
        return procs[-1]

    return start


@contextlib.contextmanager
def namespaced_cluster(shared: Path, n_workers: int = 2, timeout: float = 90) -> Iterator[str]:
    """Start the scheduler and the workers, wait for every worker, yield the scheduler file (in
    ``shared``), then stop each process it started, by its PID."""
    from dask.distributed import Client

    scheduler_file = shared / "scheduler.json"
    scheduler_file.unlink(missing_ok=True)
    procs: list[subprocess.Popen] = []
    start = _starter(shared, "dask", procs)
    try:
        start("scheduler", [_dask(), "scheduler", "--host", "127.0.0.1", "--port", "0",
                            "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file)])
        deadline = time.monotonic() + timeout
        while not scheduler_file.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dask scheduler did not start (exit {procs[0].poll()}); see {shared.parent}/dask-logs")
            time.sleep(0.2)
        for i in range(n_workers):
            start(f"worker-{i}", [*IN_OWN_NAMESPACE, _dask(), "worker", "--scheduler-file", str(scheduler_file), "--nworkers", "1",
                                  "--nthreads", "1", "--host", "127.0.0.1", "--local-directory", "/tmp/dask",
                                  "--name", f"worker-{i}", "--no-dashboard"])
        with Client(scheduler_file=str(scheduler_file), timeout=timeout) as client:
            client.wait_for_workers(n_workers, timeout=timeout)
        yield str(scheduler_file)
    finally:
        stop_process_group(*procs, timeout=20)


class RoundRobinPool:
    """A worker pool service that hands each ``StartWorker`` to the next of ``addresses``."""

    def __init__(self, addresses: list[str]):
        import itertools

        import grpc
        from apache_beam.portability.api import beam_fn_api_pb2_grpc

        self.pools = [beam_fn_api_pb2_grpc.BeamFnExternalWorkerPoolStub(grpc.insecure_channel(a))
                      for a in addresses]
        self.turn = itertools.cycle(self.pools)

    def StartWorker(self, request, context):  # noqa: N802 (the gRPC method's name)
        return next(self.turn).StartWorker(request)

    def StopWorker(self, request, context):  # noqa: N802
        for pool in self.pools:
            response = pool.StopWorker(request)
        return response


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float, what: str) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit {proc.poll()})")
        time.sleep(0.2)


@contextlib.contextmanager
def portable_cluster(shared: Path, n_pools: int = 2, timeout: float = 90) -> Iterator[tuple[str, str]]:
    """Start the job service and the worker pools (each in its own mount namespace) and the
    round-robin address in front of the pools; yield (job endpoint, pool address); stop each
    process it started, by its PID."""
    from concurrent import futures

    import grpc
    from apache_beam.portability.api import beam_fn_api_pb2_grpc

    from tests.prefect_server import free_port

    procs: list[subprocess.Popen] = []
    start = _starter(shared, "portable", procs)
    server = None
    try:
        job_port = free_port()
        job = start("job-service", [sys.executable, "-m", "apache_beam.runners.portability.local_job_service_main",
                                    "--port", str(job_port)])
        pools = []
        for i in range(n_pools):
            port = free_port()
            pools.append((port, start(f"pool-{i}", [*IN_OWN_NAMESPACE, sys.executable, "-m",
                                                    "apache_beam.runners.worker.worker_pool_main",
                                                    "--service_port", str(port)])))
        _wait_for_port(job_port, job, timeout, "the Beam job service")
        for port, proc in pools:
            _wait_for_port(port, proc, timeout, "a Beam worker pool")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(
            RoundRobinPool([f"localhost:{port}" for port, _ in pools]), server)
        front = server.add_insecure_port("localhost:0")
        server.start()
        yield f"localhost:{job_port}", f"localhost:{front}"
    finally:
        if server is not None:
            server.stop(0)
        stop_process_group(*procs, timeout=20)


def netns_refused() -> str | None:
    """Why two network namespaces cannot be made here, or None when they can."""
    refused = namespaces_refused()
    if refused or shutil.which("ip") is None:
        return refused or "no ip(8) on this machine"
    name = f"bertpipe-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode:
        return f"network namespaces are not permitted here: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@contextlib.contextmanager
def two_hosts(subnet: str = "10.213.7") -> Iterator[list[dict[str, str]]]:
    """Two network namespaces joined by a veth pair, ``<subnet>.1`` and ``<subnet>.2``; yields
    each host's namespace, interface and address; deletes both namespaces (and the pair)."""
    tag = f"bp{os.getpid() % 100000}"
    hosts = [{"netns": f"{tag}-h{i}", "ifname": f"{tag}h{i}", "addr": f"{subnet}.{i + 1}"} for i in range(2)]
    made: list[str] = []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for host in hosts:
            ip("netns", "add", host["netns"])
            made.append(host["netns"])
        ip("link", "add", hosts[0]["ifname"], "type", "veth", "peer", "name", hosts[1]["ifname"])
        for host in hosts:
            ip("link", "set", host["ifname"], "netns", host["netns"])
            ip("-n", host["netns"], "addr", "add", f"{host['addr']}/24", "dev", host["ifname"])
            ip("-n", host["netns"], "link", "set", host["ifname"], "up")
            ip("-n", host["netns"], "link", "set", "lo", "up")
        yield hosts
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def on_host(host: dict[str, str], shared: Path, argv: list[str]) -> list[str]:
    """``argv`` run on ``host``: in its network namespace, in a mount namespace of its own with
    private /tmp and /dev/shm, ``shared`` mounted back at its path."""
    return ["ip", "netns", "exec", host["netns"], "env", f"KEEP={kept_paths(shared)}", "PRIVATE_SHM=1",
            *IN_OWN_NAMESPACE, *argv]
