"""Prefect UI artifacts for every stage: tables, markdown reports with pictures, live progress.

    publish_table("corpus-counts", [{"reason": "too_short", "docs": 3}], "Rejected documents")
    publish_markdown("pretrain-report", f"![loss]({png_data_url(line_plot(series, 'Loss'))})")

Keys are stable per stage, so the UI keeps one history per key; pictures are PNGs embedded as
``data:`` URLs, drawn without pyplot so that worker processes and threads can draw them.
"""

from __future__ import annotations

import base64
import io
import math
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from uuid import UUID

from bert_core.histogram import Histogram
from bert_core.progress import Meter, OnProgress, Update

if TYPE_CHECKING:  # matplotlib is imported where a picture is drawn
    from matplotlib.figure import Figure

_KEY = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
MAX_COLUMNS = 9  # what the UI shows without scrolling next to its side panels
SIGNIFICANT = 4  # digits a table keeps: losses and accuracies differ in the third or fourth

# (run id, key) -> progress artifact id: the first call creates, later calls update in place.
_PROGRESS_IDS: dict[tuple[str, str], UUID] = {}


def check_key(key: str) -> str:
    """Refuse a key Prefect would reject, before any work is lost to a late failure."""
    if not _KEY.match(key):
        raise ValueError(
            f"artifact key {key!r} is invalid: use lowercase letters, digits and single dashes, "
            "e.g. 'pretrain-progress'"
        )
    return key


def publish_table(key: str, rows: Sequence[Mapping[str, Any]], description: str | None = None) -> UUID:
    """A table artifact, one dict per row, shaped to fit the UI (see :func:`table_parts`).

    A table too wide for one screen is published in parts under ``key``, ``key-2``, ...; the
    id of the first is returned.
    """
    from prefect.artifacts import create_table_artifact

    parts = table_parts(rows)
    ids = []
    for i, part in enumerate(parts):
        part_key = key if i == 0 else f"{key}-{i + 1}"
        text = description if len(parts) == 1 else f"{description or key} (part {i + 1} of {len(parts)})"
        ids.append(create_table_artifact(table=part, key=check_key(part_key), description=text))
    return ids[0]


def table_parts(rows: Sequence[Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rows shaped for the UI, which shows about :data:`MAX_COLUMNS` columns without scrolling.

    Columns are the union of keys in first-seen order; a column empty in every row (MFU on a
    CPU run) is left out; every row gets every other column (a missing cell shows empty) and
    numbers keep :data:`SIGNIFICANT` digits. A wider table with few rows is transposed (one
    column per row, named by its first cell); one with many rows is split into parts of at
    most ``MAX_COLUMNS`` columns, each repeating the leading label columns (e.g. kind, phase,
    step), so every part reads on its own.
    """
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    columns = [c for c in columns if any(row.get(c) is not None for row in rows)]
    table = [{c: _cell(row.get(c)) for c in columns} for row in rows]
    if len(columns) <= MAX_COLUMNS:
        return [table]
    names = [str(row[columns[0]]) for row in table]
    if len(table) < MAX_COLUMNS and len(set(names)) == len(names) and columns[0] not in names:
        return [[{columns[0]: c, **{n: row[c] for n, row in zip(names, table, strict=True)}}
                 for c in columns[1:]]]
    index = _label_columns(table, columns)
    values = columns[len(index):]
    n_parts = -(-len(values) // (MAX_COLUMNS - len(index)))
    size = -(-len(values) // n_parts)
    return [[{c: row[c] for c in index + values[i:i + size]} for row in table]
            for i in range(0, len(values), size)]


def _label_columns(table: list[dict[str, Any]], columns: list[str], most: int = 3) -> list[str]:
    """The leading columns that name a row rather than measure it: no fractional numbers."""
    index = []
    for c in columns[:most]:
        if any(isinstance(row[c], float) for row in table):
            break
        index.append(c)
    return index or columns[:1]


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return round_number(value)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def round_number(value: float, significant: int | None = None) -> float | int | str:
    """``value`` to ``significant`` digits, whole numbers from there on: 0.84442 -> 0.8444,
    9.87654 -> 9.877, 1234.567 -> 1235, 2.5e-05 stays; NaN and infinities as text."""
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return 0.0
    digits = (significant or SIGNIFICANT) - 1 - math.floor(math.log10(abs(value)))
    return round(value, digits) if digits > 0 else round(value)


def publish_markdown(key: str, md: str, description: str | None = None) -> UUID:
    """A markdown artifact (may contain ``data:`` PNG images from :func:`png_data_url`)."""
    from prefect.artifacts import create_markdown_artifact

    return create_markdown_artifact(markdown=md, key=check_key(key), description=description)


def progress(key: str, fraction: float, description: str | None = None) -> UUID:
    """Live progress (0..1) under a stable key: created on the first call in a run, then updated."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    percent = 100.0 * min(max(float(fraction), 0.0), 1.0)
    slot = (_run_id(), check_key(key))
    artifact_id = _PROGRESS_IDS.get(slot)
    if artifact_id is None:
        artifact_id = create_progress_artifact(percent, key=key, description=description)
        _PROGRESS_IDS[slot] = artifact_id
    else:
        update_progress_artifact(artifact_id, percent, description=description)
    return artifact_id


PUBLISH_S = 5.0  # how often a stage's progress artifact is updated: each update is an API call


class StageProgress:
    """A stage's ``on_progress`` for a flow: its progress artifact under ``key``, updated at most
    every :data:`PUBLISH_S` seconds (and whenever a phase starts or ends), the description saying
    the phase, counts, rate and ETA (:class:`bert_core.progress.Meter`). A phase of unknown total
    keeps the last known fraction."""

    def __init__(self, key: str):
        self.key = check_key(key)
        self.meters: dict[str, Meter] = {}
        self.fraction, self.phase, self.published_at = 0.0, None, 0.0
        self.lock = threading.Lock()

    def __call__(self, update: Update) -> None:
        with self.lock:
            meter = self.meters.setdefault(update.phase, Meter())
            text = meter.describe(update)  # every update feeds the rate, published or not
            if update.fraction is not None:
                self.fraction = update.fraction
            boundary = update.phase != self.phase or update.fraction == 1.0
            if boundary or time.monotonic() - self.published_at >= PUBLISH_S:
                self.phase, self.published_at = update.phase, time.monotonic()
                progress(self.key, self.fraction, text)

    def finished(self, text: str) -> None:
        with self.lock:
            progress(self.key, 1.0, text)


@contextmanager
def stage_progress(stage: str) -> Iterator[OnProgress]:
    """``on_progress`` for a stage run in a flow (artifact ``<stage>-progress``), at 100% once the
    body ends well (a stage found finished and skipped ends there too)."""
    reporter = StageProgress(f"{stage}-progress")
    start = time.monotonic()
    yield reporter
    from bert_core.progress import clock

    reporter.finished(f"{stage}: done in {clock(time.monotonic() - start)}")


def _run_id() -> str:
    """The current flow run (a new run of the same flow gets a fresh progress artifact)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else "no-run"


# --------------------------------------------------------------------------- pictures


def png_data_url(fig: Figure, dpi: int = 80) -> str:
    """The figure as a ``data:image/png;base64,...`` URL (small dpi keeps artifacts light)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # attach an Agg canvas: no display, no pyplot state
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def markdown_image(fig: Figure, alt: str) -> str:
    """A markdown image line that embeds the figure."""
    return f"![{alt}]({png_data_url(fig)})"


def _figure() -> tuple[Figure, Any]:
    """A figure and its axes; every picture has the same size, so artifact pages line up."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2))
    return fig, fig.add_subplot()


def line_plot(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    xlabel: str = "step",
    ylabel: str = "",
) -> Figure:
    """One line per named (x, y) series, e.g. loss curves of both pre-training phases."""
    fig, ax = _figure()
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), label=name, marker="." if len(xs) < 30 else None)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    return fig


def histogram(
    values: Iterable[float] | Histogram | Mapping[str, Any],
    title: str,
    xlabel: str,
    bins: int = 30,
) -> Figure:
    """A histogram of raw values, or bars of a stored one (a manifest's ``{"edges", "counts"}``,
    or its bin labels): one bar per bin, in numeric order, under the bin's label
    (:meth:`bert_core.histogram.Histogram.labels`), empty bins at either end left out."""
    fig, ax = _figure()
    if isinstance(values, Histogram | Mapping):
        stored = values if isinstance(values, Histogram) else Histogram.from_json(values)
        items = stored.trimmed().items()
        ax.bar(range(len(items)), [c for _, c in items], width=0.9)
        ax.set_xticks(range(len(items)), [label for label, _ in items],
                      rotation=45 if len(items) > 6 else 0, ha="right" if len(items) > 6 else "center")
    else:
        ax.hist(list(values), bins=bins)
    ax.set(title=title, xlabel=xlabel, ylabel="count")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
