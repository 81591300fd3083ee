"""Leases on output folders: one attempt at a time writes a stage's folder, on a local disk or
on ``gs://``.

    with lease.hold(output, "instances") as held:
        if held.finished:            # another attempt finished this folder while we waited
            return storage.read_manifest(output)
        ...                          # clear, write shards, then held.check() and the manifest

``<folder>/_LEASE.json`` names the attempt that holds the folder: a random attempt id, where it
runs (host, and the kernel and process namespace that make its pid meaningful), its pid, and
when the lease expires. The holder renews the expiry from a thread while it writes and removes
the file when it is done, however it ends. A second writer waits while the lease is live and,
when it is gone, does nothing if the folder now has its manifest; if the holder died (its pid is
gone on this machine, or its lease expired elsewhere) the second writer takes over and starts
the folder afresh. ``BERTPIPE_LEASE_WAIT`` (seconds) bounds the wait: past it a writer is
refused in one line (:class:`LeaseHeldError`, exit 3: retry later).

A lease is taken by creating the file exclusively where the backend can (``O_EXCL`` on a local
disk, an ``ifGenerationMatch=0`` precondition on GCS) and is then read back after a pause: a
backend that ignores the precondition (an emulator, some object stores) lets two writers create
it, and the read-back leaves only the last one holding it. Before its manifest, a holder checks
that the lease is still its own (:meth:`Held.check`), so an attempt that lost its lease never
commits.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bert_core import storage
from bert_core.failures import InfrastructureError

LEASE = "_LEASE.json"
# A live holder renews its lease a few times per TTL; a holder on another machine that stops
# renewing (killed, cut off) is presumed dead once its lease expires.
TTL_SECONDS = 60.0
POLL_SECONDS = 1.0
# The pause between creating a lease and reading it back: longer than a competitor's gap between
# finding no lease and writing its own. A local disk's O_EXCL needs none for a fresh lease.
SETTLE_SECONDS = {"file": 0.0, "default": 1.0}
TAKEOVER_SETTLE_SECONDS = 0.5  # a dead holder's lease is replaced, not created: never exclusive

_LOG = logging.getLogger(__name__)


class LeaseHeldError(RuntimeError, InfrastructureError):
    """Another live attempt holds the folder longer than this one may wait."""


class LeaseLostError(RuntimeError, InfrastructureError):
    """The attempt's lease expired and another attempt took the folder: it must not commit."""


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
    """The start time of process ``pid`` (None when there is none), so a reused pid is not taken
    for the holder."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0.0
    except Exception:  # psutil.NoSuchProcess, AccessDenied: no such process we can vouch for
        return None


@dataclass
class Record:
    attempt: str
    stage: str
    machine: str
    pid: int
    started: float | None
    expires: float
    since: float

    @classmethod
    def mine(cls, attempt: str, stage: str, ttl: float, since: float) -> Record:
        return cls(attempt, stage, _machine(), os.getpid(), _started(os.getpid()), time.time() + ttl, since)

    def dumps(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode("utf-8")

    def dead(self) -> bool:
        """Expired, or a process of this machine that is gone."""
        if time.time() > self.expires:
            return True
        if self.machine == _machine():
            now = _started(self.pid)
            return now is None or (bool(self.started) and bool(now) and abs(now - self.started) > 1.0)
        return False

    def describe(self) -> str:
        host = self.machine.split("/", 1)[0]
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"attempt {self.attempt} ({self.stage}, pid {self.pid} on {host}, since {since})"


def read(folder: str) -> Record | None:
    """The lease of ``folder``, or None when there is none. A lease that cannot be read whole (cut
    short by a kill mid-write) counts as expired."""
    uri = storage.join(folder, LEASE)
    try:
        with storage.open_file(uri, "rb") as f:
            raw = json.loads(f.read().decode("utf-8"))
        return Record(**raw)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):
        return Record("unreadable", "?", "", 0, None, 0.0, 0.0)


def _create(folder: str, record: Record, exclusive: bool) -> bool:
    """Write the lease; False when an exclusive create finds one there. A reader sees the old
    lease or the new one whole, never a file cut short (which counts as a dead holder's): on a
    local disk the record is written beside it, then linked (exclusive) or renamed into place;
    an object store's object appears whole when written."""
    uri = storage.join(folder, LEASE)
    if storage.is_local(uri):
        path = storage.split_protocol(uri)[1]
        part = f"{path}.{uuid.uuid4().hex[:8]}.part"
        with open(part, "wb") as f:
            f.write(record.dumps())
        try:
            if not exclusive:
                os.replace(part, path)
                return True
            os.link(part, path)
        except FileExistsError:
            return False
        finally:
            if os.path.exists(part):
                os.remove(part)
        return True
    try:
        with storage.open_file(uri, "xb" if exclusive else "wb") as f:
            f.write(record.dumps())
    except FileExistsError:
        return False
    except OSError as err:  # a precondition failure surfaces as an HTTP error on GCS
        if exclusive and ("412" in str(err) or "recondition" in str(err)):
            return False
        raise
    return True


@dataclass
class Held:
    """A lease this attempt holds. ``finished``: another attempt finished the folder while this
    one waited, so there is nothing to write."""

    folder: str
    record: Record
    ttl: float
    finished: bool = False
    lost: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def attempt(self) -> str:
        return self.record.attempt

    def renew(self) -> None:
        current = read(self.folder)
        if current is None or current.attempt != self.attempt:
            self.lost = True
            return
        self.record.expires = time.time() + self.ttl
        _create(self.folder, self.record, exclusive=False)

    def check(self) -> None:
        """:func:`check` for this attempt, which also fails once a renewal found the lease gone."""
        check(self.folder, self.attempt, lost=self.lost)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self.renew()
            except Exception as err:  # a missed renewal is retried; the lease lasts a TTL
                _LOG.warning("%s: could not renew its lease: %s", self.folder, err)


def check(folder: str, attempt: str, lost: bool = False) -> None:
    """Raise :class:`LeaseLostError` unless ``folder``'s lease is still ``attempt``'s: called right
    before a manifest (also from a Beam worker, given the attempt id), so only the holder commits."""
    current = read(folder)
    if lost or current is None or current.attempt != attempt:
        who = f"; {current.describe()} holds it now" if current else ""
        raise LeaseLostError(f"{storage.to_uri(folder)}: this run's lease expired while it wrote{who}; "
                             "its files are not committed. Run it again, or raise BERTPIPE_LEASE_SECONDS "
                             "on a slow or paused machine")


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def seen(folder: str) -> str | None:
    """The folder's manifest as this attempt first finds it (its sha256, None when there is
    none): a manifest that differs once the lease is held was written by another attempt."""
    return storage.manifest_sha256(folder) if storage.has_manifest(folder) else None


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
    attempt, start = uuid.uuid4().hex[:16], time.time()
    storage.makedirs(folder)
    waited, told = False, ""
    while True:
        current = read(folder)
        if current is not None and not current.dead():
            if time.time() - start >= wait:
                raise LeaseHeldError(
                    f"{folder} is being written by {current.describe()}; this run waited "
                    f"{time.time() - start:.0f} s (BERTPIPE_LEASE_WAIT): run it again when that one ends")
            if current.attempt != told:
                _LOG.warning("%s: %s writes it; waiting for it to finish", folder, current.describe())
                told = current.attempt
            waited = True
            time.sleep(POLL_SECONDS)
            continue
        record = Record.mine(attempt, stage, ttl, start)
        if current is None:
            if not _create(folder, record, exclusive=True):
                continue
            pause = settle
        else:
            _LOG.warning("%s: %s stopped without finishing; this run takes the folder over",
                         folder, current.describe())
            storage.remove(storage.join(folder, LEASE), recursive=False)
            _create(folder, record, exclusive=False)
            pause = max(settle, TAKEOVER_SETTLE_SECONDS)
            waited = True
        if pause:
            time.sleep(pause)
        now = read(folder)
        if now is not None and now.attempt == attempt:
            finished = storage.has_manifest(folder) and (waited or seen(folder) != first_seen)
            held = Held(folder, record, ttl, finished=finished)
            threading.Thread(target=held._heartbeat, daemon=True, name=f"lease-{attempt}").start()
            return held
        waited = True  # another attempt won the race: wait on it like on any holder


def release(held: Held) -> None:
    """Stop renewing and remove the lease, if it is still this attempt's."""
    held._stop.set()
    current = read(held.folder)
    if current is not None and current.attempt == held.attempt:
        storage.remove(storage.join(held.folder, LEASE), recursive=False)


@contextmanager
def hold(folder: str, stage: str, first_seen: str | None = _UNSEEN) -> Iterator[Held]:
    """The lease of ``folder`` for the block (:func:`acquire`), released however the block ends."""
    held = acquire(folder, stage, first_seen)
    try:
        yield held
    finally:
        release(held)


def in_progress(folder: str) -> dict[str, Any] | None:
    """The live lease of ``folder`` as a dict (what ``bertpipe verify`` reports), or None."""
    current = read(folder)
    return None if current is None or current.dead() else current.__dict__
