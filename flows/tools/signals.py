"""Stop signals: SIGTERM and SIGINT end a command in order, with one last line of our own.

    signals.install()                      (once, at a command's entry)
    with signals.stopped_in_order(): ...   (where the command runs)

The first signal becomes :class:`bert_core.stopping.StopSignal` (a ``KeyboardInterrupt``)
raised in the main thread, so the command unwinds as after Ctrl-C: Prefect records the runs as
crashed, leases are released, no manifest is written, and each block ends the processes it
started. Then :func:`finish` ends what is left (bert_core.stopping), releases the leases of
jobs in other threads that have not unwound (``lease.release_all``), prints the last line

    stopped by SIGTERM during instances; run the same command again to resume (finished stages are kept)

and exits with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT). When the unwinding
takes longer than :data:`UNWIND_S` (a job in a thread that does not stop), or a second signal
comes, the same clean-up and line follow at once. Inside a flow run Prefect would turn SIGTERM
into its own exception and resend the signal only once every run had unwound; its engine is
given this module's handler instead (:class:`_PrefectTakesOurs`).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any, NoReturn

from bert_core import lease
from bert_core.stopping import StopSignal, descendants, end_descendants, run_last, stop_work

SIGNALS = (signal.SIGTERM, signal.SIGINT)
PREFECT_ENGINE = "prefect.utilities.engine"  # where Prefect keeps its SIGTERM handler
UNWIND_S = 15.0  # the unwinding's share of the 30 s a stop may take
CLEAN_UP_S = 5.0  # SIGTERM to SIGKILL for what the unwinding left
# The stage a stop interrupted, by the module that was running: the innermost match wins.
STAGE_MODULES = {
    "corpus": ("flows.corpus", "beam_jobs.clean_corpus", "bert_core.corpus"),
    "vocab": ("flows.vocab", "beam_jobs.build_vocab", "bert_core.vocab"),
    "instances": ("flows.instances", "beam_jobs.create_instances", "bert_core.instances"),
    "pretrain": ("flows.pretrain", "bert_core.pretrain"),
    "finetune": ("flows.finetune", "bert_core.finetune"),
}

_stop: StopSignal | None = None
_seen: list[Any] = []  # the processes started before the stop (one may lose its parent since)
_finishing = threading.Lock()
_said = threading.Lock()


def _stage_of_module(module: str) -> str | None:
    for stage, prefixes in STAGE_MODULES.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return stage
    return None


def _frames(frame: FrameType | None, exc: BaseException | None) -> Iterator[FrameType]:
    # innermost first: the interrupted frame and its callers, then the frames an exception
    # being handled passed through (Prefect's own SIGTERM exception unwinds before ours comes)
    while frame is not None:
        yield frame
        frame = frame.f_back
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb: TracebackType | None = exc.__traceback__
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        yield from reversed(frames)
        exc = exc.__context__


def stage_at(frame: FrameType | None, exc: BaseException | None = None) -> str | None:
    """The stage whose code ``frame`` (or an exception being handled) was running, if any."""
    for f in _frames(frame, exc):
        stage = _stage_of_module(f.f_globals.get("__name__", ""))
        if stage is not None:
            return stage
    return None


def command_name(argv: list[str] | None = None) -> str:
    """The command as typed, without its options: ``bertpipe tasks fetch``."""
    argv = sys.argv if argv is None else argv
    words = [os.path.basename(argv[0]) if argv else "bertpipe"]
    for word in argv[1:3]:
        if word.startswith("-"):
            break
        words.append(word)
    if words[0] in ("__main__.py", "python", "python3"):
        words[0] = "bertpipe"
    return " ".join(words)


def last_line(stop: StopSignal) -> str:
    """What a stopped command says last: what stopped it, where, and what to run."""
    if stop.stage is None:
        return f"stopped by {stop.name} ({command_name()}); run the same command again to go on"
    return (f"stopped by {stop.name} during {stop.stage}; run the same command again to resume "
            "(finished stages are kept)")


def received() -> StopSignal | None:
    """The stop this command received, if any."""
    return _stop


def _handle(signum: int, frame: FrameType | None) -> None:
    global _stop
    if _stop is not None:  # a second signal: no more waiting
        _force()
    _seen.extend(descendants())
    _stop = StopSignal(signum, stage_at(frame, sys.exception()))
    threading.excepthook = _quiet_after_stop
    threading.Thread(target=stop_work, name="stop-work", daemon=True).start()
    timer = threading.Timer(UNWIND_S, _force)
    timer.daemon = True
    timer.start()
    raise _stop


def _quiet_after_stop(args: threading.ExceptHookArgs) -> None:
    # A thread that fails because its processes were ended (a Beam worker's) says nothing:
    # the stop's own line says what happened.
    pass


class _PrefectTakesOurs(importlib.abc.MetaPathFinder):
    """Prefect's flow engine, when it is imported, installs this module's handler where it
    would install its own SIGTERM handler: a stop then starts :data:`UNWIND_S` at once and names
    the stage, instead of after Prefect has unwound every flow run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != PREFECT_ENGINE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                module._prefect_sigterm_handler = _handle

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Handle SIGTERM and SIGINT in this process (the main thread) as described above."""
    for signum in SIGNALS:
        signal.signal(signum, _handle)
    if PREFECT_ENGINE in sys.modules:
        sys.modules[PREFECT_ENGINE]._prefect_sigterm_handler = _handle
    else:
        sys.meta_path.insert(0, _PrefectTakesOurs())


def _say_and_exit(stop: StopSignal) -> NoReturn:
    if _said.acquire(blocking=False):
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        import typer

        typer.secho(last_line(stop), fg="yellow", err=True)
        with contextlib.suppress(Exception):
            sys.stderr.flush()
    os._exit(stop.exit_code)


def _end_the_rest(grace: float) -> None:
    stop_work()
    run_last()
    end_descendants(_seen, grace=grace)
    lease.release_all()  # those of jobs in threads that have not unwound


def finish() -> NoReturn:
    """End what the stop left running, print the last line and exit with 128 + the signal."""
    assert _stop is not None
    with _finishing:
        _end_the_rest(CLEAN_UP_S)
        _say_and_exit(_stop)


def _force() -> None:
    # From the timer or a second signal: clean up here unless the main thread is doing it, and
    # exit either way.
    assert _stop is not None
    if _finishing.acquire(blocking=False):
        _end_the_rest(1.0)
    else:
        end_descendants(_seen, grace=1.0)
        lease.release_all()
    _say_and_exit(_stop)


@contextlib.contextmanager
def stopped_in_order() -> Iterator[None]:
    """Run a command's body; once a stop signal has come, however the body ends (the stop
    itself, an error it became on its way up, or no error at all), :func:`finish` it."""
    try:
        yield
    except BaseException:
        if _stop is not None:
            finish()
        raise
    if _stop is not None:
        finish()
