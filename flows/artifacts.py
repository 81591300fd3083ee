"""Prefect UI artifacts for every stage: tables, markdown reports with pictures, live progress.

    from flows.artifacts import publish_table, publish_markdown, progress, line_plot, png_data_url
    publish_table("corpus-counts", [{"reason": "too_short", "docs": 3}], "Rejected documents")
    fig = line_plot({"loss": (steps, losses)}, title="Pre-training loss", xlabel="step")
    publish_markdown("pretrain-report", f"![loss]({png_data_url(fig)})", "Loss curve")

Keys are stable per stage (lowercase letters, digits and dashes, as Prefect requires) so the
Artifacts page shows one history per key across runs. Pictures are PNGs embedded as
``data:image/png;base64,...`` URLs: the Prefect UI renders them inside markdown artifacts without
a file server or a bucket. Figures are drawn with matplotlib's Agg canvas directly (no pyplot,
no global figure state), so this works in worker processes and threads.

Called outside a flow or task run, the artifacts are still stored (just not linked to a run).
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from uuid import UUID

if TYPE_CHECKING:  # matplotlib is imported where a picture is drawn
    from matplotlib.figure import Figure

_KEY = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

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
    """A table artifact, one dict per row (columns = the union of keys, in first-seen order)."""
    from prefect.artifacts import create_table_artifact

    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    # Every row gets every column so the UI table lines up; a missing cell is shown empty.
    table = [{c: _cell(row.get(c)) for c in columns} for row in rows]
    return create_table_artifact(table=table, key=check_key(key), description=description)


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


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
    values: Iterable[float] | Mapping[Any, int],
    title: str,
    xlabel: str,
    bins: int = 30,
) -> Figure:
    """A histogram of raw values, or bars of precomputed ``{bin: count}`` (e.g. manifest stats)."""
    fig, ax = _figure()
    if isinstance(values, Mapping):
        items = sorted(values.items(), key=lambda kv: float(kv[0]))
        xs = [float(k) for k, _ in items]
        width = min((b - a for a, b in zip(xs, xs[1:], strict=False)), default=1.0) * 0.9
        ax.bar(xs, [c for _, c in items], width=width)
    else:
        ax.hist(list(values), bins=bins)
    ax.set(title=title, xlabel=xlabel, ylabel="count")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def metrics_curves(rows: Iterable[Mapping[str, Any]]) -> dict[str, Figure]:
    """Loss and MLM/NSP accuracy curves from ``metrics.jsonl`` rows (per phase if present)."""
    loss: dict[str, tuple[list[float], list[float]]] = {}
    acc: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        if "step" not in row:
            continue
        phase = f"phase {row['phase']}" if "phase" in row else ""
        for name, target, field in (("loss", loss, "loss"), ("mlm_acc", acc, "mlm_acc"),
                                    ("nsp_acc", acc, "nsp_acc")):
            value = row.get(field)
            if isinstance(value, (int, float)):
                label = f"{name} {phase}".strip()
                xs, ys = target.setdefault(label, ([], []))
                xs.append(float(row["step"]))
                ys.append(float(value))
    figs = {}
    if loss:
        figs["loss"] = line_plot(loss, "Pre-training loss (MLM + NSP)", ylabel="loss")
    if acc:
        figs["accuracy"] = line_plot(acc, "Masked LM and next-sentence accuracy", ylabel="accuracy")
    return figs
