"""``bertpipe run``: the whole pipeline once, as the Prefect flow ``bert_pipeline``.

    bertpipe run --preset demo
    bertpipe run --preset demo --dry-run      (the plan of ``bertpipe plan``; nothing runs)

What every stage reads is checked before Prefect starts (``bert_core.preflight``). A flow that
fails ends the command with the failure's one line, as any command does (flows/cli/main.py).
The terminal shows our lines and the flow and task runs' log lines; Prefect's own warnings and
its temporary server's output go to a log file (``flows.tools.prefect_output``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Annotated, Any, TypeVar

import typer

from flows.cli.options import ConfigOpt, PresetOpt, SetOpt, resolve
from flows.tools.prefect_output import prefect_messages_to_log

T = TypeVar("T")


class _WithoutTraceback(logging.Formatter):
    """Another formatter's lines, less the traceback a record carries."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        kept = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = kept


@contextlib.contextmanager
def _console_without_tracebacks() -> Iterator[None]:
    # The run's log (the API handler, which formats a record before the console sees it) keeps
    # the traceback for the UI; the terminal's last line is the failure's own.
    from prefect.logging.handlers import PrefectConsoleHandler

    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    formatters = [h.formatter for h in consoles]
    for handler, formatter in zip(consoles, formatters, strict=True):
        handler.setFormatter(_WithoutTraceback(formatter))
    try:
        yield
    finally:
        for handler, formatter in zip(consoles, formatters, strict=True):
            handler.setFormatter(formatter)


def _stop_temporary_server() -> None:
    # Prefect stops its temporary server at exit and logs that it does, after the command's last
    # line; stopped here, once the run's logs and events are sent, the command's line comes last.
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if not server.running:
        return
    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
    server.stop()


def run_flow(flow: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``flow`` from the terminal: its failure reaches the command line as the error it
    raised, with no traceback printed before it and nothing after it."""
    with prefect_messages_to_log(), _console_without_tracebacks():
        try:
            return flow(*args, **kwargs)
        except Exception:
            _stop_temporary_server()
            raise


def run(preset: PresetOpt = "demo", config: ConfigOpt = None, set_: SetOpt = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the inputs and print the plan "
                                              "(as `bertpipe plan`); run nothing.")] = False) -> None:
    """Run the whole pipeline once (stages already finished for this config are skipped)."""
    cfg = resolve(preset, config, set_)
    from bert_core.preflight import check_run

    check_run(cfg)
    if dry_run:
        from flows.cli.plan import make_plan, print_plan

        print_plan(make_plan(cfg))
        return
    from flows.pipeline import bert_pipeline

    summary = run_flow(bert_pipeline, cfg)
    for stage, info in summary["stages"].items():
        typer.echo(f"{stage:10s} {info['status']:16s} {info['output']}")
