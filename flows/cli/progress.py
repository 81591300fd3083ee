"""Progress bars of the long stages in the terminal: one line per phase with its count, rate,
ETA and elapsed time, drawn from a stage's ``on_progress`` updates (``bert_core/progress.py``).

    with progress_bars() as on_progress:
        manifest = clean_corpus.run(cfg, output, on_progress=on_progress)

Where stderr is not a terminal (a log file, a pipe, CI) there are no bars: ``on_progress`` is
None, so the stage writes no progress files either.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from bert_core.progress import Meter, OnProgress, Update


class Bars:
    """``on_progress`` drawing rich bars: a bar per (stage, phase), the one before it closed when
    a new phase starts. Safe to call from any thread."""

    def __init__(self, bar) -> None:
        self.bar = bar
        self.tasks: dict[tuple[str, str], tuple[int, Meter, Update]] = {}
        self.lock = threading.Lock()

    def __call__(self, update: Update) -> None:
        key = (update.stage, update.phase)
        with self.lock:
            if key not in self.tasks:
                for task, _, last in self.tasks.values():  # a phase of unknown total is over
                    if last.total is None:
                        self.bar.update(task, total=max(last.done, 1), completed=max(last.done, 1))
                name = f"[bold]{update.stage}[/] {update.phase}"
                self.tasks[key] = (self.bar.add_task(name, total=update.total, line=""), Meter(), update)
            task, meter, _ = self.tasks[key]
            self.tasks[key] = (task, meter, update)
            self.bar.update(task, completed=update.done, total=update.total, line=meter.counts(update))


@contextmanager
def progress_bars() -> Iterator[OnProgress | None]:
    """Bars on stderr while the body runs, or None where stderr is not a terminal. The bars end
    (their last state stays on screen) before an error leaves the body, so the error is the
    last line."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[line]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        yield Bars(bar)
