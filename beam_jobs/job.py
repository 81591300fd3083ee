"""The skeleton every Beam job here stands on: pipeline options, run, counters, progress, and
reading the documents shards of a corpus.

Each job is a function ``run(cfg, <inputs>, output, ...)`` that takes its stage's config and
Beam's own options (``workers``, ``runner``, ``beam_args``); ``bertpipe <stage>`` is its command
line, and ``python -m beam_jobs.<job>`` forwards there (:func:`forward_to_cli`).
"""

from __future__ import annotations

import contextvars
import gc
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.runner import PipelineResult

from beam_jobs.beam_import import connectors_restored
from bert_core import stopping, storage
from bert_core.corpus.documents import read_sentences
from bert_core.failures import Refusal
from bert_core.progress import Watch

# The runner is named through Beam's ``PipelineOptions`` (``--runner``). The local default,
# :data:`LOCAL_RUNNER`, is Beam's in-process FnApiRunner (the engine the DirectRunner runs batch
# pipelines on), with ``direct_num_workers`` worker processes when ``workers > 1``. It is named
# directly because the DirectRunner tries the Prism runner first, which fetches a binary and so
# needs the network. Dataflow, Flink or Spark are settings: ``beam_runner`` and ``beam_args`` in
# the config (see ``infra/beam/``); ``dask`` names :class:`beam_jobs.dask_runner.DaskRunner` (a Dask
# distributed cluster). A ``--runner=...`` among the Beam arguments wins (:func:`resolve_runner`).
#
# A worker is another machine. Every path a job is given is resolved on the driver before it
# reaches a DoFn; on a runner whose workers are not this machine's processes, a local path is
# refused before any work unless the config declares the storage shared
# (:func:`check_shared_storage`); a run that reads a non-empty input and produces nothing fails
# (:func:`check_produced`); and counters never fail a job on a runner that reports none
# (:func:`counters`).
#
# Progress travels as files (``bert_core/progress.py``): each work item writes its counts under
# the output's ``_progress/`` folder, which every worker reaches (the rule above), and the driver
# polls them while the job runs (:func:`watching`). Beam's counters are no substitute: the local
# runner and the Dask runner report them only once the job has ended.
#
# While a job runs, Beam's own INFO messages and the harness start-up and shut-down lines of the
# local worker processes stay out of the terminal (:func:`harness_chatter_dropped`); warnings and
# errors of our code, and tracebacks, still show.

LOCAL_RUNNER = "FnApiRunner"
# Short names a user may give for a runner, and the runner each means.
RUNNERS = {"local": LOCAL_RUNNER, "dask": "beam_jobs.dask_runner.DaskRunner"}
# Runners whose workers are processes of this machine: they all see its disk.
ONE_MACHINE_RUNNERS = {LOCAL_RUNNER, "DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner",
                       "PrismRunner"}
NOT_REPORTED = "not reported by this runner"

_LOG = logging.getLogger(__name__)

# What Beam's harness says at the start and end of every worker process (channels opened,
# "harness starting", an optional GCP client missing, nothing staged): no news for a user.
# Warnings and errors of our own code, and tracebacks, do not match and stay visible.
HARNESS_CHATTER = re.compile(
    r"^(INFO|DEBUG):(__main__|apache_beam[.\w]*):"
    r"|apitools not found"
    r"|No semi_persistent_directory"
)


# --------------------------------------------------------------------------- command line


def forward_to_cli(command: str) -> NoReturn:
    """Run ``bertpipe <command>`` with this process's arguments: the one command line."""
    os.execv(sys.executable, [sys.executable, "-m", "flows.cli", command, *sys.argv[1:]])


# --------------------------------------------------------------------------- running


def is_local(runner: str) -> bool:
    return runner == LOCAL_RUNNER


def resolve_runner(runner: str, beam_args: Iterable[str] = ()) -> tuple[str, list[str]]:
    """The runner a job runs on and the Beam arguments without it: the last ``--runner`` among
    ``beam_args`` wins over ``runner``, and a short name (:data:`RUNNERS`, e.g. ``dask``) becomes
    the runner it names."""
    rest: list[str] = []
    args = list(beam_args)
    i = 0
    while i < len(args):
        if args[i].startswith("--runner="):
            runner = args[i].split("=", 1)[1]
        elif args[i] == "--runner" and i + 1 < len(args):
            runner = args[i + 1]
            i += 1
        else:
            rest.append(args[i])
        i += 1
    return RUNNERS.get(runner.lower(), runner), rest


class NotSharedError(storage.OutputError):
    """A local path given to a runner whose workers are other machines."""


def check_shared_storage(stage: str, runner: str, shared_storage: bool,
                         paths: Iterable[tuple[str, str | None]]) -> None:
    """Refuse (one line, before any work) a local path among ``paths`` (option, URI) when
    ``runner``'s workers are other machines: they would write to, or look for, a folder on their
    own disks. ``shared_storage`` (the config's, for NFS, gcsfuse or one machine) lets it be."""
    name = runner.rsplit(".", 1)[-1]
    if shared_storage or name in ONE_MACHINE_RUNNERS:
        return
    for option, uri in paths:
        if uri is not None and storage.is_local(uri):
            raise NotSharedError(
                f"{stage}: --{option} {storage.to_uri(uri)} is a local path, which the workers of "
                f"{name} do not share; give a URI every worker reaches (--{option} gs://BUCKET/PREFIX), "
                "or set shared_storage: true (--set shared_storage=true) where it is NFS, gcsfuse "
                "or one machine")


class EmptyResultError(RuntimeError, Refusal):
    """A job read a non-empty input and produced nothing."""


def check_produced(stage: str, produced: int, what: str, read: int, read_what: str) -> None:
    """Raise :class:`EmptyResultError` (one line naming the stage and the counts) when ``read``
    items of input gave 0 ``what``: a runner that drops a step's outputs finishes that way."""
    if read > 0 and produced == 0:
        raise EmptyResultError(
            f"{stage}: 0 {what} from {read:,} {read_what}; the runner finished without the output "
            "of a step (outputs emitted in finish_bundle or to a tagged output, or a sink that "
            "never ran): run it on a supported runner (local, dask)")


# On the local runner, one worker process per this many bytes of (uncompressed) input, up to
# ``workers``: a worker process costs Beam's start-up (about a CPU-second and a hundred MB), more
# than a second core saves on a tiny input. Any real corpus starts every worker, so the number of
# processes, and with it the memory, does not change as the corpus grows.
LOCAL_BYTES_PER_WORKER = 4 << 20
COMPRESSED = (".bz2", ".gz", ".zst")  # counted four times their size (about what text shrinks to)


def local_workers(workers: int, files: list[str], bytes_per_worker: int = LOCAL_BYTES_PER_WORKER) -> int:
    """Worker processes for the local runner: one per ``bytes_per_worker`` of input (compressed
    files count four times their size), at least one, at most ``workers``; every one of
    ``workers`` if ``bytes_per_worker`` is 0."""
    if bytes_per_worker <= 0:
        return max(1, workers)
    text_bytes = sum(storage.size(f) * (4 if f.endswith(COMPRESSED) else 1) for f in files)
    return max(1, min(workers, -(-text_bytes // bytes_per_worker)))


def pipeline_options(workers: int, runner: str = LOCAL_RUNNER, beam_args: Iterable[str] = ()) -> PipelineOptions:
    """Beam options for ``runner`` (:func:`resolve_runner`): ``beam_args`` (a ``--`` separator
    among them is dropped), then the runner and, on the local runner, its worker processes
    (these win over the same options in ``beam_args``)."""
    runner, beam_args = resolve_runner(runner, beam_args)
    ours = [f"--runner={runner}"]
    if is_local(runner):
        mode = "multi_processing" if workers > 1 else "in_memory"
        ours += [f"--direct_num_workers={max(1, workers)}", f"--direct_running_mode={mode}"]
    return PipelineOptions([*(a for a in beam_args if a != "--"), *ours])


@contextmanager
def fewer_gc_passes(threshold: int = 100_000) -> Iterator[None]:
    """Collect garbage less often while a job runs in this process, then restore.

    The jobs allocate millions of short-lived objects (token lists, tuples, small arrays) and
    make no cycles worth chasing, yet CPython's default gen-0 threshold (700) starts a
    collection every few hundred allocations. ``gc.freeze`` also keeps the objects loaded
    before the run (Beam, pyarrow, the vocab) out of every pass. Restored afterwards, since a
    Prefect flow process lives on."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold, 50, 1000)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


# What the local runner's worker processes start with: pyarrow's default pool (mimalloc) keeps
# the pages of freed buffers (Parquet pages, compression scratch) for reuse, which holds a worker's
# resident memory at the largest it has been; the system allocator gives them back. glibc's own
# retention is left alone: lowering MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ returns
# more memory but spends much more CPU on page faults (see docs/benchmarks.md, bench_scale).
WORKER_MEMORY_ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system"}  # read when pyarrow is first imported


@contextmanager
def memory_returned(local: bool) -> Iterator[None]:
    """On the local runner, the worker processes a job starts get :data:`WORKER_MEMORY_ENV`, and
    this process takes Arrow buffers from the system allocator while the job runs. Restored
    afterwards, since a Prefect flow process lives on."""
    if not local:
        yield
        return
    import pyarrow as pa

    old_pool, old_env = pa.default_memory_pool(), {k: os.environ.get(k) for k in WORKER_MEMORY_ENV}
    os.environ.update(WORKER_MEMORY_ENV)
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(old_pool)
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _DropChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not HARNESS_CHATTER.search(f"{record.levelname}:{record.name}:{record.getMessage()}")


def quiet_beam_logging() -> None:
    """Beam's own loggers in this process at WARNING, and its harmless start-up warnings dropped
    (the runner re-logs the workers' warnings here too)."""
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    for name in ("", "apache_beam.runners.portability.local_job_service"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropChatter) for f in logger.filters):
            logger.addFilter(_DropChatter())


@contextmanager
def harness_chatter_dropped(enabled: bool = True) -> Iterator[None]:
    """Drop :data:`HARNESS_CHATTER` lines from this process's stderr while a job runs.

    The local runner's worker processes inherit file descriptor 2 and configure their own
    logging at INFO, so no logger setting here reaches them: their lines pass through a pipe
    that forwards every other line unchanged."""
    quiet_beam_logging()
    if not enabled:
        yield
        return
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                if not HARNESS_CHATTER.search(line.decode("utf-8", "replace")):
                    os.write(terminal, line)

    pump = threading.Thread(target=forward, name="beam-stderr", daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # the pipe ends once the workers, which hold it too, have exited
        pump.join(timeout=30)
        if not pump.is_alive():
            os.close(terminal)


PROGRESS_DIR = "_progress"
POLL_S = 1.0


def progress_folder(output: str) -> str:
    """Where a job's workers write their progress counts: ``<output>/_progress``."""
    return storage.join(output, PROGRESS_DIR)


@contextmanager
def watching(watch: Watch | None, every_s: float = POLL_S) -> Iterator[None]:
    """Poll ``watch`` from a thread while the body runs, and once more when it ends well; after
    a failure nothing more is reported, so no progress follows the error.

    The thread runs in a copy of the caller's context: a Prefect run's progress artifact is
    then the run's own. A display that fails is logged once and never fails the job."""
    if watch is None:
        yield
        return
    stop = threading.Event()
    broken: list[BaseException] = []

    def poll() -> None:
        if broken:
            return
        try:
            watch.poll()
        except Exception as err:  # a display, not the job
            broken.append(err)
            _LOG.warning("progress display stopped: %s: %s", type(err).__name__, err)

    def loop() -> None:
        while not stop.wait(every_s):
            poll()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(loop,), name="beam-progress",
                              daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    poll()


@contextmanager
def workers_ended_on_stop() -> Iterator[None]:
    """The processes a job starts on this machine (the local runner's workers, a local Dask
    cluster) end when the job is stopped (a ``KeyboardInterrupt``, or the command's stop
    signal, bert_core.stopping), before the job unwinds further: nothing works on after it."""
    before = {p.pid for p in stopping.descendants()}

    def end() -> None:
        stopping.end_processes([p for p in stopping.descendants() if p.pid not in before], grace=3.0)

    with stopping.on_stop(end):
        try:
            yield
        except KeyboardInterrupt:
            end()
            raise


def run_pipeline(build: Callable[[beam.Pipeline], Any], workers: int, runner: str = LOCAL_RUNNER,
                 beam_args: Iterable[str] = (), watch: Watch | None = None) -> PipelineResult:
    """Build the graph with ``build(pipeline)``, run it to the end, return the result; ``watch``
    is polled while it runs (:func:`watching`); a stop ends its workers
    (:func:`workers_ended_on_stop`)."""
    runner, beam_args = resolve_runner(runner, beam_args)
    if runner not in ONE_MACHINE_RUNNERS:
        connectors_restored()
    with fewer_gc_passes(), memory_returned(is_local(runner)), \
            harness_chatter_dropped(is_local(runner) and workers > 1), watching(watch), \
            workers_ended_on_stop():
        p = beam.Pipeline(options=pipeline_options(workers, runner, beam_args))
        build(p)
        result = p.run()
        result.wait_until_finish()
    return result


def item_key(item: Any) -> str:
    """A work item's name in progress files: the same on every worker and on a retry."""
    return repr(item)


def shares_of_files(items: Iterable[Any], uri_of: Callable[[Any], str]) -> dict[str, int]:
    """Each work item's share of its file's bytes (:func:`item_key` -> bytes): a file's items
    share its size evenly, so the shares of all items sum to the size of the input."""
    by_file: dict[str, list[Any]] = {}
    for item in items:
        by_file.setdefault(uri_of(item), []).append(item)
    shares = {}
    for uri, its in by_file.items():
        size, n = storage.size(uri), len(its)
        for k, item in enumerate(its):
            shares[item_key(item)] = size * (k + 1) // n - size * k // n
    return shares


def counters(result: PipelineResult, namespace: str) -> dict[str, int] | None:
    """The job's Beam counters in ``namespace``, by name (summed over the steps that count), or
    None (with a warning) on a runner that reports no metrics: counters never fail a job."""
    from apache_beam.metrics.metric import MetricsFilter

    try:
        found = result.metrics().query(MetricsFilter().with_namespace(namespace))["counters"]
    except NotImplementedError:
        _LOG.warning("%s: Beam counters %s (%s)", namespace, NOT_REPORTED, type(result).__name__)
        return None
    totals: dict[str, int] = {}
    for c in found:
        totals[c.key.metric.name] = totals.get(c.key.metric.name, 0) + int(c.committed)
    return totals


# --------------------------------------------------------------------------- documents shards


class ReadSentences(beam.PTransform):
    """Documents shards (URIs) -> ``(doc_id, sentences)``, one row batch at a time."""

    def __init__(self, shards: list[str]):
        super().__init__()
        self.shards = shards

    def expand(self, pbegin):
        return (
            pbegin
            | "ListShards" >> beam.Create(self.shards)
            | "ReadShards" >> beam.FlatMap(read_sentences)
        )
