"""A real Dask distributed cluster on 127.0.0.1 whose workers share no disk, for the cluster tests.

    with namespaced_cluster(shared, n_workers=2) as scheduler_file: ...

One ``dask scheduler`` and ``n_workers`` ``dask worker`` processes (one thread each). Each worker
runs in its own mount namespace (``unshare -m``) with a private tmpfs over ``/tmp`` (its
scratch, and every local path of the driver under it), and ``shared`` mounted back into it at
the same path, as network storage would be: what one worker writes under ``/tmp`` no other
worker and not the driver sees; what it writes under ``shared`` they all do. Workers start in
``/``, so a relative path that reached one would name another folder than on the driver.

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

# In the worker's new mount namespace: keep `shared` aside, cover /tmp with a tmpfs, put
# `shared` back at its path. The namespace and its mounts end with the worker.
WORKER_SCRIPT = """set -e
mount --make-rprivate /
aside=$(mktemp -d /run/bertpipe-shared.XXXXXX)
mount --bind "$SHARED" "$aside"
mount -t tmpfs -o size=2g bertpipe-private /tmp
mkdir -p "$SHARED"
mount --move "$aside" "$SHARED"
rmdir "$aside" 2>/dev/null || true
cd /
exec "$@"
"""


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


def _dask() -> str:
    return str(Path(sys.executable).with_name("dask"))


@contextlib.contextmanager
def namespaced_cluster(shared: Path, n_workers: int = 2, timeout: float = 90) -> Iterator[str]:
    """Start the scheduler and the workers, wait for every worker, yield the scheduler file (in
    ``shared``), then stop each process it started, by its PID."""
    from dask.distributed import Client

    shared.mkdir(parents=True, exist_ok=True)
    logs = shared.parent / "dask-logs"
    logs.mkdir(exist_ok=True)
    scheduler_file = shared / "scheduler.json"
    scheduler_file.unlink(missing_ok=True)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "SHARED": str(shared),
           "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str]) -> None:
        with open(logs / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd="/"))

    try:
        start("scheduler", [_dask(), "scheduler", "--host", "127.0.0.1", "--port", "0",
                            "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file)])
        deadline = time.monotonic() + timeout
        while not scheduler_file.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dask scheduler did not start: " + (logs / "scheduler.log").read_text()[-2000:])
            time.sleep(0.2)
        for i in range(n_workers):
            start(f"worker-{i}", ["unshare", "-m", "--propagation", "private", "sh", "-c", WORKER_SCRIPT, "worker",
                                  _dask(), "worker", "--scheduler-file", str(scheduler_file), "--nworkers", "1",
                                  "--nthreads", "1", "--host", "127.0.0.1", "--local-directory", "/tmp/dask",
                                  "--name", f"worker-{i}", "--no-dashboard"])
        with Client(scheduler_file=str(scheduler_file), timeout=timeout) as client:
            client.wait_for_workers(n_workers, timeout=timeout)
        yield str(scheduler_file)
    finally:
        for proc in reversed(procs):
            stop_process_group(proc, timeout=20)
