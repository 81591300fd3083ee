"""Leases on output folders: one attempt at a time writes a stage's folder, on a local disk or
on ``gs://``, and only the attempt that holds the lease commits or deletes anything.

    with lease.hold(output, "instances") as held:
        if held.finished:            # another attempt finished this folder while we waited
            return storage.read_manifest(output)
        ...                          # clear, write shards, then write_manifest(..., attempt=held.attempt)

``<folder>/_LEASE.json`` names the attempt that holds the folder: a random attempt id, where it
runs (host, and the kernel and process namespace that make its pid meaningful), its pid and a
renewal counter. The holder renews it from a thread while it writes and removes it when it is
done, however it ends. A second writer waits while the lease is live and, when it is gone, does
nothing if the folder now has its manifest; if the holder died the second writer takes over and
starts the folder afresh. ``BERTPIPE_LEASE_WAIT`` (seconds) bounds the wait: past it a writer is
refused in one line (:class:`LeaseHeldError`, exit 3: retry later).

Every change of the lease is conditional on the lease being the one just read (:func:`_swap`):
on a local disk under an exclusive ``flock`` of ``<folder>/_LEASE.lock`` held for the read, the
compare and a rename (no hard links), on GCS by a generation precondition (``ifGenerationMatch``).
So a renewal that comes late never overwrites a new holder's lease, two takeovers never both win,
and a release never removes another attempt's lease.

The holder is dead when its pid is gone on this machine (a pid that cannot be looked up counts as
alive), or when the lease's content has not changed for a TTL as this waiter's own monotonic
clock sees it: no two hosts' wall clocks are ever compared.

The commit rule (:func:`commit`): a manifest is first written under a name of the attempt's own
(``_MANIFEST.json.<random>.tmp``, its shards already hashed) and then moved into place in one
step that fails unless the lease is still the attempt's: on a local disk the rename happens under
the lease's lock, on GCS right after a conditional update of the lease. A lost attempt's deletes
go through the same check (:func:`remove_if_held`). A renewal that finds the lease gone cancels
the attempt: the processes it started are ended and its main thread is interrupted, and
:func:`hold` turns what follows into :class:`LeaseLostError`.

The rerun rule (:func:`refuse_finished`): a stage's folder that is finished when an attempt
begins is never written again, so no reader of its shards sees them change; the same command run
again finds it finished and has nothing to do.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bert_core import storage
from bert_core.config import ConfigError
from bert_core.failures import InfrastructureError, Refusal

LEASE = "_LEASE.json"
ATTEMPT_ENV = "BERTPIPE_LEASE_ATTEMPT"  # the attempt id, for the processes a holder starts
LOCK = "_LEASE.lock"  # on a local disk: flocked for each read-compare-write of the lease
STAGING = "_attempt-"  # <folder>/_attempt-<id>: where an attempt writes until it publishes
# A live holder renews its lease a few times per TTL; a holder that stops renewing (killed, cut
# off, paused) is presumed dead once its lease has not changed for a TTL.
TTL_SECONDS = 60.0
POLL_SECONDS = 1.0
# The pause between creating a lease and reading it back: a backend that ignores the precondition
# (an emulator, some object stores) lets two writers create it; the read-back leaves one holding it.
SETTLE_SECONDS = {"file": 0.0, "default": 1.0}

_LOG = logging.getLogger(__name__)
_holding: dict[str, Held] = {}  # the leases this process holds, by attempt (release_all)
_holding_lock = threading.Lock()
_clock: Callable[[], float] = time.monotonic  # what expiry is judged on: this process's own clock


def _now() -> float:
    """Wall time, shown to people only (``since``); ``BERTPIPE_CLOCK_OFFSET`` shifts it."""
    return time.time() + float(os.environ.get("BERTPIPE_CLOCK_OFFSET") or 0)


class LeaseHeldError(RuntimeError, InfrastructureError):
    """Another live attempt holds the folder longer than this one may wait."""


class LeaseLostError(RuntimeError, InfrastructureError):
    """The attempt's lease went to another attempt: it must not commit or delete anything."""


class LeaseCancelled(KeyboardInterrupt):
    """Raised in the main thread of an attempt whose lease a renewal found another's (not a stop
    signal: no signal handler runs); :func:`hold` turns it into :class:`LeaseLostError`."""


class FinishedFolderError(ConfigError):
    """A stage's output folder that is finished already (:func:`refuse_finished`)."""


class LeaseUnsupportedError(OSError, Refusal):
    """A filesystem that cannot hold a lease (no exclusive lock)."""


def _machine() -> str:
    """Where a pid means one process: the host, its kernel's boot and the pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, pidns = "", 0
    return f"{socket.gethostname()}/{boot}/{pidns}"


def _started(pid: int) -> float | None:
    """The start time of process ``pid``: None when there is none, 0.0 when it cannot be told
    (then it counts as alive), so a reused pid is not taken for the holder."""
    try:
        import psutil
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0.0
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None
    except Exception:  # AccessDenied (hidepid), a zombie: cannot tell, so alive
        return 0.0


@dataclass
class Record:
    attempt: str
    stage: str
    machine: str
    pid: int
    started: float | None
    since: float
    renewals: int = 0
    expires: float = 0.0  # the holder's wall clock; shown, never compared

    @classmethod
    def mine(cls, attempt: str, stage: str, ttl: float, since: float) -> Record:
        return cls(attempt, stage, _machine(), os.getpid(), _started(os.getpid()), since, 0, _now() + ttl)

    def dumps(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode("utf-8")

    def gone(self) -> bool:
        """A process of this machine that is gone (another machine's holder is never gone here)."""
        if self.machine != _machine():
            return False
        now = _started(self.pid)
        return now is None or (bool(self.started) and bool(now) and abs(now - self.started) > 1.0)

    def describe(self) -> str:
        host = self.machine.split("/", 1)[0]
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"attempt {self.attempt} ({self.stage}, pid {self.pid} on {host}, since {since})"


def _parse(raw: bytes | None) -> Record | None:
    if raw is None:
        return None
    try:
        fields = json.loads(raw.decode("utf-8"))
        return Record(**{k: v for k, v in fields.items() if k in Record.__dataclass_fields__})
    except (ValueError, TypeError):
        return Record("unreadable", "?", "", 0, None, 0.0)


# --------------------------------------------------------------------------- the lease's stores


def _lease_path(folder: str) -> str:
    return storage.split_protocol(storage.join(folder, LEASE))[1]


def _kind(folder: str) -> str:
    from fsspec.implementations.local import LocalFileSystem

    fs = storage.filesystem(folder)
    if isinstance(fs, LocalFileSystem):
        return "local"
    return "gcs" if storage.split_protocol(folder)[0] in ("gs", "gcs") else "other"


@contextmanager
def _locked(folder: str) -> Iterator[None]:
    """The folder's lease lock (local disk): an exclusive ``flock`` that the kernel drops when
    its process dies; a process paused while it holds it keeps everyone else out. The lock file
    is removed with the lease (while locked), so a finished folder holds neither; a waiter that
    locked a file removed meanwhile locks the new one."""
    import fcntl

    path = storage.split_protocol(storage.join(folder, LOCK))[1]
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF):
                raise LeaseUnsupportedError(
                    err.errno, f"{storage.to_uri(folder)}: this filesystem cannot hold a lease (no exclusive "
                    f"lock: {os.strerror(err.errno)}); write the stage to a local disk or gs://") from None
            raise
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        try:
            if not os.path.exists(_lease_path(folder)):
                os.remove(path)
        finally:
            os.close(fd)


_PROCESS_LOCK = threading.Lock()  # stores without a lock of their own: this process at least


def _read_raw(folder: str) -> tuple[bytes | None, Any]:
    """The lease's bytes and the token a conditional write compares (GCS: its generation)."""
    uri = storage.join(folder, LEASE)
    if _kind(folder) == "gcs":
        fs = storage.filesystem(uri)
        path = _lease_path(folder)
        for _ in range(5):
            try:
                before = fs.info(path, refresh=True).get("generation")
                data = fs.cat_file(path)
                after = fs.info(path, refresh=True).get("generation")
            except FileNotFoundError:
                return None, 0
            if before == after:
                return data, before
        return data, after
    try:
        with storage.open_file(uri, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, 0
    return data, data


def _gcs_write(folder: str, data: bytes | None, generation: Any) -> bool:
    """Write (or, ``data`` None, delete) the lease object if its generation is still
    ``generation`` (0: there is none); False when the precondition fails."""
    return _gcs_put(storage.join(folder, LEASE), data, generation)


def _gcs_put(uri: str, data: bytes | None, generation: Any) -> bool:
    """Write (or, ``data`` None, delete) the object ``uri`` if its generation is still
    ``generation`` (0: there is none); False when the precondition fails."""
    from urllib.parse import quote

    fs = storage.filesystem(uri)
    path = storage.split_protocol(uri)[1]
    bucket, key = path.split("/", 1)
    try:
        if data is None:
            fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=str(generation or 0))
        else:
            fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o", uploadType="media",
                    name=key, ifGenerationMatch=str(generation or 0), data=data,
                    headers={"Content-Type": "application/octet-stream"}, json_out=True)
    except (FileExistsError, FileNotFoundError):  # 412: another write came first; 404: gone
        return False
    finally:
        fs.invalidate_cache(path)
    return True


def create_exclusive(uri: str, text: str) -> bool:
    """Create the file ``uri`` holding ``text`` unless it exists, in one conditional step: an
    ``O_EXCL`` create on a local disk, a generation precondition (``ifGenerationMatch=0``) on GCS;
    on other object stores a write and a read back (the last writer wins, the loser sees it).
    False when it exists."""
    uri = storage.to_uri(uri)
    kind = _kind(uri)
    if kind == "local":
        path = storage.split_protocol(uri)[1]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return True
    if kind == "gcs":
        return _gcs_put(uri, text.encode("utf-8"), 0) and storage.read_text(uri) == text
    if storage.exists(uri):
        return False
    storage.write_text(uri, text)
    return storage.read_text(uri) == text


def _swap(folder: str, new: Record | None, match: Callable[[Record | None], bool]) -> bool:
    """Replace the lease with ``new`` (None: remove it) if ``match`` holds for the lease as it is,
    in one conditional step; False (nothing written) otherwise."""
    kind = _kind(folder)
    if kind == "gcs":
        raw, generation = _read_raw(folder)
        if not match(_parse(raw)):
            return False
        return _gcs_write(folder, None if new is None else new.dumps(), generation)
    fs = storage.filesystem(folder)
    path = _lease_path(folder)
    part = None
    if new is not None:  # written beside the lease first, outside the lock: a slow write holds no one up
        part = f"{path}.{uuid.uuid4().hex[:8]}.part"
        fs.pipe_file(part, new.dumps())
    try:
        with _locked(folder) if kind == "local" else _PROCESS_LOCK:
            if not match(_parse(_read_raw(folder)[0])):
                return False
            if part is None:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(path)
            elif kind == "local":
                os.replace(part, path)
            else:
                fs.mv(part, path)
            part = None
            return True
    finally:
        if part is not None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(part)


def read(folder: str) -> Record | None:
    """The lease of ``folder``, or None when there is none. A lease that cannot be read whole
    (never one being renewed: that is a rename) counts as a dead holder's."""
    return _parse(_read_raw(storage.to_uri(folder))[0])


def _is(attempt: str) -> Callable[[Record | None], bool]:
    return lambda current: current is not None and current.attempt == attempt


# --------------------------------------------------------------------------- the commit rule


def _lost_message(folder: str, current: Record | None) -> str:
    who = f"; {current.describe()} holds it now" if current else ""
    return (f"{storage.to_uri(folder)}: this run's lease went to another run while it wrote{who}; its "
            "files are not committed. Run it again, or raise BERTPIPE_LEASE_SECONDS on a slow or paused machine")


def check(folder: str, attempt: str, lost: bool = False) -> None:
    """Raise :class:`LeaseLostError` unless ``folder``'s lease is still ``attempt``'s. An early
    way out only: the commit itself is the check (:func:`commit`)."""
    current = read(folder)
    if lost or current is None or current.attempt != attempt:
        raise LeaseLostError(_lost_message(folder, current))


def _fenced(folder: str, attempt: str, action: Callable[[], None]) -> bool:
    """Run ``action`` only while ``folder``'s lease is ``attempt``'s: on a local disk under the
    lease's lock, on GCS right after a conditional update of the lease (a generation
    precondition). False, nothing done, once the lease is another's."""
    if _kind(folder) == "local":
        with _locked(folder):
            if not _is(attempt)(read(folder)):
                return False
            action()
            return True
    current = read(folder)
    if current is None or current.attempt != attempt:
        return False
    touched = Record(**{**current.__dict__, "renewals": current.renewals + 1})
    if not _swap(folder, touched, _is(attempt)):
        return False
    action()
    return True


def commit(folder: str, attempt: str, tmp: str, final: str) -> None:
    """Move ``tmp`` (a name of ``attempt``'s own) to ``final`` if and only if ``folder``'s lease
    is still ``attempt``'s, in one step (:func:`_fenced`); otherwise remove ``tmp`` and raise
    :class:`LeaseLostError`. Callable from any process that knows the attempt id."""
    folder = storage.to_uri(folder)
    fs = storage.filesystem(folder)
    src, dst = storage.split_protocol(tmp)[1], storage.split_protocol(final)[1]
    move = functools.partial(os.replace, src, dst) if _kind(folder) == "local" else functools.partial(fs.mv, src, dst)
    try:
        if _fenced(folder, attempt, move):
            return
    except BaseException:
        with contextlib.suppress(OSError):
            storage.remove(tmp, recursive=False)
        raise
    storage.remove(tmp, recursive=False)
    raise LeaseLostError(_lost_message(folder, read(folder)))


def fence(folder: str, attempt: str | None) -> Callable[[str, str], None] | None:
    """The commit step for ``storage.write_manifest(..., fence=...)``: :func:`commit` for
    ``attempt`` (None: a folder written without a lease, moved plainly)."""
    return None if attempt is None else functools.partial(commit, storage.to_uri(folder), attempt)


def staging(folder: str, attempt: str | None) -> str:
    """Where ``attempt`` writes ``folder``'s files, under names of its own, until :func:`publish`
    moves them into place: ``<folder>/_attempt-<id>``. A late write of a lost attempt lands
    there, never on a committed name. Without a lease (None) the folder itself."""
    return storage.to_uri(folder) if attempt is None else storage.join(folder, f"{STAGING}{attempt}")


def publish(folder: str, attempt: str | None, part: str = "") -> None:
    """Move every file ``attempt`` wrote under :func:`staging` (``part``: one subfolder of it) to
    the same name in ``folder``, only while ``folder``'s lease is ``attempt``'s; otherwise
    :class:`LeaseLostError`, nothing moved (:func:`_fenced`). The manifest is committed
    afterwards, by :func:`commit`."""
    if attempt is None:
        return
    folder = storage.to_uri(folder)
    fs = storage.filesystem(folder)
    source = storage.split_protocol(storage.join(staging(folder, attempt), part) if part else staging(folder, attempt))[1]
    target = storage.split_protocol(storage.join(folder, part) if part else folder)[1]
    fs.invalidate_cache(target)  # other processes (Beam workers, ranks) wrote; a listing is read fresh
    files = fs.find(source) if fs.exists(source) else []

    def move_all() -> None:
        for path in files:
            dst = target + "/" + path[len(source):].lstrip("/")
            if kind == "local":
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.replace(path, dst)
            else:
                fs.mv(path, dst)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(source, recursive=True)
        fs.invalidate_cache(target)  # no listing of before the moves stays behind

    kind = _kind(folder)
    if not _fenced(folder, attempt, move_all):
        raise LeaseLostError(_lost_message(folder, read(folder)))


def clear_other_attempts(folder: str, attempt: str) -> None:
    """Remove what other attempts staged in ``folder`` (:func:`staging`), only while its lease is
    ``attempt``'s: no manifest lists those names."""
    folder = storage.to_uri(folder)
    fs, path = storage.filesystem(folder), storage.split_protocol(folder)[1]
    if not fs.exists(path):
        return
    entries = fs.ls(path, detail=False, refresh=True)
    fs.invalidate_cache(path)  # a cached listing would hide what other processes write there next
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(STAGING) and name != f"{STAGING}{attempt}":
            remove_held(folder, attempt, storage.join(folder, name))


def remove_if_held(folder: str, attempt: str | None, uri: str) -> bool:
    """Remove ``uri`` (recursively) only while ``folder``'s lease is ``attempt``'s (None: no lease
    is used); False, nothing removed, once it went to another attempt."""
    if attempt is None:
        storage.remove(uri)
        return True
    folder = storage.to_uri(folder)
    if _kind(folder) == "local":
        with _locked(folder):
            if not _is(attempt)(read(folder)):
                return False
            storage.remove(uri)
            return True
    if not _is(attempt)(read(folder)):
        return False
    storage.remove(uri)
    return True


def remove_held(folder: str, attempt: str | None, uri: str) -> None:
    """:func:`remove_if_held`, failing with :class:`LeaseLostError` (nothing removed) once the
    lease is another attempt's: what a holder clears before it writes."""
    if not remove_if_held(folder, attempt, uri):
        check(folder, attempt or "", lost=True)


def clear_if_held(folder: str, attempt: str) -> bool:
    """Empty ``folder`` (its manifest first, so nothing vouches for the rest) but for the lease's
    own files, only while its lease is ``attempt``'s; False, nothing removed, once it is not."""
    folder = storage.to_uri(folder)
    fs, path = storage.filesystem(folder), storage.split_protocol(folder)[1]
    if not remove_if_held(folder, attempt, storage.join(folder, storage.MANIFEST)):
        return False
    protocol = storage.split_protocol(folder)[0]
    entries = fs.ls(path, detail=False, refresh=True)
    fs.invalidate_cache(path)  # a cached listing would hide what other processes write there next
    for entry in entries:
        if entry.rstrip("/").rsplit("/", 1)[-1] in (LEASE, LOCK, f"{STAGING}{attempt}"):
            continue
        uri = entry if protocol == "file" else fs.unstrip_protocol(entry)
        if not remove_if_held(folder, attempt, uri):
            return False
    return True


# --------------------------------------------------------------------------- holding a lease


def _cancel_children() -> None:
    """End the processes this one started (Beam workers, ranks): a lost attempt does no more work."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # no psutil, or nothing to list: the driver still stops at its commit
        return
    for child in children:
        with contextlib.suppress(Exception):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        with contextlib.suppress(Exception):
            child.kill()


@dataclass
class Held:
    """A lease this attempt holds. ``finished``: another attempt finished the folder while this
    one waited, so there is nothing to write. ``lost``: a renewal found the lease another's."""

    folder: str
    record: Record
    ttl: float
    finished: bool = False
    lost: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _main: bool = False  # taken on the main thread, which a loss interrupts

    @property
    def attempt(self) -> str:
        return self.record.attempt

    def renew(self) -> None:
        """Bump the renewal counter, if the lease is still this attempt's; else mark it lost."""
        if self.lost:
            return
        self.record.renewals += 1
        self.record.expires = _now() + self.ttl
        if not _swap(self.folder, self.record, _is(self.attempt)):
            self.lost = True

    def check(self) -> None:
        """:func:`check` for this attempt, which also fails once a renewal found the lease gone."""
        check(self.folder, self.attempt, lost=self.lost)

    def _on_lost(self) -> None:
        _LOG.error("%s", _lost_message(self.folder, read(self.folder)))
        _cancel_children()
        if self._main and not self._stop.is_set():  # raised at the main thread's next Python step
            import ctypes

            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.main_thread().ident),
                                                       ctypes.py_object(LeaseCancelled))

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self.renew()
            except Exception as err:  # a missed renewal is retried; the lease lasts a TTL
                _LOG.warning("%s: could not renew its lease: %s", self.folder, err)
            if self.lost:
                self._on_lost()
                return


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def seen(folder: str) -> str | None:
    """The folder's manifest as this attempt first finds it (its sha256, None when there is
    none): a manifest that differs once the lease is held was written by another attempt."""
    return storage.manifest_sha256(folder) if storage.has_manifest(folder) else None


def refuse_finished(folder: str, stage: str, config: Any, inputs: Iterable[str] = (),
                    recorded: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The rerun rule: a stage's folder that already holds its manifest is never written again,
    so no reader of it (a pre-training reading its shards) sees them change. The same command
    run again finds nothing to do: a folder this ``stage`` finished with these settings (each
    key of ``config`` as its manifest records it, and each of ``recorded`` among its manifest's
    own keys) from these ``inputs`` (finished folders), none of them changed since, is returned
    as it is. Any other finished folder raises :class:`FinishedFolderError`, saying how it
    differs; None when ``folder`` is not finished. One that another attempt finishes while this
    one waits on the lease is returned by :func:`hold` (``Held.finished``)."""
    if not storage.has_manifest(folder):
        return None
    try:
        manifest = storage.read_manifest(folder)
    except (OSError, ValueError):  # a damaged manifest still vouches for what a reader may hold
        manifest = {}
    differs = _how_it_differs(manifest, stage, config, inputs, recorded or {})
    if differs is None:
        _LOG.warning("%s is finished already with these settings (written %s): nothing to do",
                     storage.to_uri(folder), manifest.get("created"))
        return manifest
    written = manifest.get("created") or "at an unknown time"
    raise FinishedFolderError(
        f"{storage.to_uri(folder)} is finished (its {storage.MANIFEST}, stage "
        f"\"{manifest.get('stage') or stage}\", written {written}{differs}); bertpipe never rewrites a "
        f"finished folder a reader may hold: give a new --output, or remove {storage.to_uri(folder)} first")


def _how_it_differs(manifest: dict[str, Any], stage: str, config: Any, inputs: Iterable[str],
                    recorded: dict[str, Any]) -> str | None:
    """None when ``manifest`` is what this run would write; else what differs, as a clause of
    the refusal ("" where the stage itself differs: the stage's name says it)."""
    if manifest.get("stage") != stage:
        return ""
    wanted = json.loads(json.dumps(config.model_dump(mode="json") if hasattr(config, "model_dump") else config))
    settings = manifest.get("config") or {}
    pairs = [*((f"{stage}.{k}", settings.get(k), v) for k, v in wanted.items()),
             *((k, manifest.get(k), v) for k, v in recorded.items())]
    for name, was, now in pairs:
        if was != now and name.endswith("_sha256"):
            return f", made from another {name[:-len('_sha256')]} (sha256 {str(was)[:12]}, this run's {str(now)[:12]})"
        if was != now:
            return f", with {name}={json.dumps(was)} where this run has {json.dumps(now)}"
    made_from = sorted(storage.to_uri(storage.relocated(manifest, e["uri"]))
                       for e in manifest.get("inputs", []) if e.get("uri"))
    if made_from != sorted(storage.to_uri(i) for i in inputs):
        return f", made from {', '.join(made_from) or 'no finished folder'}"
    for uri, what in storage.input_problems(manifest):
        return f", whose input {uri} {what} since"
    return None


_UNSEEN = "unseen"


def acquire(folder: str, stage: str, first_seen: str | None = _UNSEEN) -> Held:
    """Take the lease of ``folder`` for a new attempt, waiting while another live attempt holds
    it; see the module docstring. ``first_seen`` (:func:`seen`, taken when the attempt began)
    also counts a manifest written before the wait as another attempt's finished work. The
    caller releases the lease (:func:`hold` does)."""
    folder = storage.to_uri(folder)
    if first_seen == _UNSEEN:
        first_seen = seen(folder)
    ttl = _env_seconds("BERTPIPE_LEASE_SECONDS", TTL_SECONDS)
    wait = _env_seconds("BERTPIPE_LEASE_WAIT", float("inf"))
    protocol = storage.split_protocol(folder)[0]
    settle = SETTLE_SECONDS.get(protocol, SETTLE_SECONDS["default"])
    attempt, start, began = uuid.uuid4().hex[:16], _now(), _clock()
    storage.makedirs(folder)
    waited, told = False, ""
    watched: tuple[bytes | None, float] = (None, began)  # the lease as last seen, since when (own clock)
    while True:
        raw = _read_raw(folder)[0]
        current = _parse(raw)
        if raw != watched[0]:
            watched = (raw, _clock())
        stale = current is not None and (current.attempt == "unreadable" or current.gone()
                                         or _clock() - watched[1] >= ttl)
        if current is not None and not stale:
            if _clock() - began >= wait:
                raise LeaseHeldError(
                    f"{folder} is being written by {current.describe()}; this run waited "
                    f"{_clock() - began:.0f} s (BERTPIPE_LEASE_WAIT): run it again when that one ends")
            if current.attempt != told:
                _LOG.warning("%s: %s writes it; waiting for it to finish", folder, current.describe())
                told = current.attempt
            waited = True
            time.sleep(POLL_SECONDS)
            continue
        record = Record.mine(attempt, stage, ttl, start)
        if current is None:
            if not _swap(folder, record, lambda now: now is None):
                continue
        else:
            if not _swap(folder, record, lambda now, seen_raw=raw: now is not None and now.dumps() == _parse(seen_raw).dumps()):
                continue  # the lease changed under us: judge it afresh
            _LOG.warning("%s: %s stopped without finishing; this run takes the folder over",
                         folder, current.describe())
            waited = True
        if settle:
            time.sleep(settle)
        now = read(folder)
        if now is not None and now.attempt == attempt:
            finished = storage.has_manifest(folder) and (waited or seen(folder) != first_seen)
            held = Held(folder, record, ttl, finished=finished,
                        _main=threading.current_thread() is threading.main_thread())
            threading.Thread(target=held._heartbeat, daemon=True, name=f"lease-{attempt}").start()
            with _holding_lock:
                _holding[attempt] = held
            return held
        waited = True  # another attempt won the race: wait on it like on any holder


def release(held: Held) -> None:
    """Stop renewing and remove the lease, if it is still this attempt's."""
    held._stop.set()
    with _holding_lock:
        _holding.pop(held.attempt, None)
    _swap(held.folder, None, _is(held.attempt))


def release_all() -> None:
    """Release every lease this process still holds: the last step of a stopped command, whose
    jobs in other threads may not have unwound (each release is conditional, and what such a
    job commits later is refused)."""
    with _holding_lock:
        held = list(_holding.values())
    for h in held:
        try:
            release(h)
        except Exception as err:  # the lease expires after its TTL instead
            _LOG.warning("%s: could not release its lease: %s", h.folder, err)


@contextmanager
def hold(folder: str, stage: str, first_seen: str | None = _UNSEEN) -> Iterator[Held]:
    """The lease of ``folder`` for the block (:func:`acquire`), released however the block ends;
    a block that fails after its lease was lost fails with :class:`LeaseLostError`."""
    held = acquire(folder, stage, first_seen)
    try:
        if not held.finished:
            clear_other_attempts(folder, held.attempt)
        yield held
    except BaseException as err:
        if held.lost and not isinstance(err, LeaseLostError):
            raise LeaseLostError(_lost_message(held.folder, read(held.folder))) from err
        raise
    finally:
        with contextlib.suppress(OSError):  # what it staged and did not publish: its own names
            storage.remove(staging(folder, held.attempt))
        release(held)


def in_progress(folder: str) -> dict[str, Any] | None:
    """The lease of ``folder`` as a dict when its holder may be alive (what ``bertpipe verify``
    reports), or None."""
    current = read(folder)
    return None if current is None or current.gone() else current.__dict__
