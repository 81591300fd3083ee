"""What a stop signal ends: every process a command started, in order, however the command stops.

    with stopping.on_stop(functools.partial(stop_group, proc)):
        proc.wait()

A command's entry (``flows/tools/signals.py``) turns SIGTERM and SIGINT into :class:`StopSignal`,
raised in the main thread, so a stop unwinds the same ``with`` and ``finally`` blocks an error
does: leases are released, no manifest is written, each block ends the processes it started.
A block whose unwinding would wait on its processes (the local Beam runner joins its workers)
ends them at once through :func:`on_stop`; what the unwinding leaves, or cannot reach in time,
ends afterwards: the clean-ups of :func:`at_last`, then every process this one started
(:func:`end_descendants`). A child that runs on its own (the DeepSpeed launcher, Prefect's
temporary server) starts detached from the terminal (setsid), so a terminal's Ctrl-C reaches this process
first and the child is stopped in order, and ends with this process if it is killed
(:func:`end_with_parent`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

_LOG = logging.getLogger(__name__)
_lock = threading.Lock()
_keys = iter(range(1, 1 << 62))
_work: dict[int, Callable[[], None]] = {}  # run as soon as a stop comes (stop_work)
_last: dict[int, Callable[[], None]] = {}  # run once the command has unwound (run_last)


class StopSignal(KeyboardInterrupt):
    """A stop signal (SIGTERM or SIGINT) received by the command, raised in its main thread: the
    same path as Ctrl-C's ``KeyboardInterrupt``. ``stage`` is the stage it stopped, if known."""

    def __init__(self, signum: int, stage: str | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.stage = stage

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process its signal ended."""
        return 128 + self.signum


@contextmanager
def on_stop(clean_up: Callable[[], None]) -> Iterator[None]:
    """While the block runs, a stop runs ``clean_up`` at once (:func:`stop_work`, from another
    thread while the main thread unwinds): it ends the work the block started, whose own
    unwinding may wait on it. It may run again where the block unwinds."""
    key = _add(_work, clean_up)
    try:
        yield
    finally:
        with _lock:
            _work.pop(key, None)


def at_last(clean_up: Callable[[], None]) -> None:
    """Run ``clean_up`` once a stopped command has unwound (:func:`run_last`), e.g. stop a
    server the unwinding still reports to."""
    _add(_last, clean_up)


def _add(table: dict[int, Callable[[], None]], clean_up: Callable[[], None]) -> int:
    with _lock:
        key = next(_keys)
        table[key] = clean_up
    return key


def _run(table: dict[int, Callable[[], None]]) -> None:
    # newest first, each once; one that fails is logged and the others still run
    while True:
        with _lock:
            if not table:
                return
            clean_up = table.pop(max(table))
        try:
            clean_up()
        except Exception as err:
            _LOG.warning("clean-up %r failed: %s: %s", clean_up, type(err).__name__, err)


def stop_work() -> None:
    """Run the clean-ups of :func:`on_stop` blocks, newest first."""
    _run(_work)


def run_last() -> None:
    """Run the clean-ups of :func:`at_last`, newest first."""
    _run(_last)


def descendants() -> list[Any]:
    """This process's children, theirs, and so on (psutil processes)."""
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def end_descendants(also: Iterable[Any] = (), grace: float = 5.0) -> None:
    """End every process this one started, and ``also`` (processes seen earlier, which may have
    lost their parent since): :func:`end_processes`."""
    end_processes([*also, *descendants()], grace)


def end_processes(procs: Iterable[Any], grace: float = 5.0) -> None:
    """SIGTERM each of ``procs`` (psutil processes), SIGKILL what is left after ``grace``
    seconds."""
    import psutil

    found = {p.pid: p for p in procs}
    found.pop(os.getpid(), None)
    for p in found.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(found.values()), timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End what is left of a child's process group (e.g. the launcher and its local ranks):
    SIGTERM while the child runs, so that it stops its own children, then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty: every process is gone
        pass


def end_with_parent(parent: int) -> None:
    """In a child, before it starts (Linux; a ``preexec_fn``): SIGTERM when the process that
    started it dies, by SIGKILL too. Elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the line above took effect
        os.kill(os.getpid(), signal.SIGTERM)
