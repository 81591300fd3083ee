"""The metrics log: rank 0 appends one JSON line per logged step to ``RUN/metrics.jsonl``.

    python -c "from bert_core.pretrain.metrics import read_metrics; print(read_metrics('runs/demo')[-1])"

:class:`MetricsLog` writes it (``bert_core.pretrain.loop``) and says what a row holds,
:class:`MetricsTail` follows it while a run is going (CLI progress bar, Prefect flow),
:func:`read_metrics` reads it once (reports).
"""

from __future__ import annotations

import json
import os
from typing import Any

from bert_core import storage

METRICS_FILE = "metrics.jsonl"


def kind(row: dict[str, Any]) -> str:
    return row.get("kind", "train")


def train_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if kind(r) == "train"]


def eval_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if kind(r) == "eval"]


def order(row: dict[str, Any]) -> tuple[int, int, int]:
    """A row's place in the log: by phase and step, an eval row after the train row of its step."""
    return row["phase"], row["step"], int(kind(row) == "eval")


def read_metrics(run: str) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` (a torn last line while it is being written is skipped)."""
    uri = storage.join(run, METRICS_FILE)
    if not storage.exists(uri):
        return []
    rows = []
    for line in storage.read_text(uri).splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsLog:
    """Rank 0's ``metrics.jsonl``. Appended line by line on a local disk; object stores cannot
    append, so there the file is rewritten whole. On resume, rows past the checkpoint go.

    A row has a ``kind``. A ``"train"`` row (rows without a kind are train rows) holds ``phase``,
    ``step``, ``max_steps``, ``loss``, ``mlm_acc``, ``nsp_acc`` (means over all ranks), ``lr``,
    ``seq_per_s``, ``tokens_per_s`` (non-padding tokens), ``mfu``, ``epoch``, ``cpu_seconds``
    (process CPU time of all ranks since they started: what a budget in CPU-minutes counts) and
    ``time``. An ``"eval"`` row (``bert_core.pretrain.evaluate``, the whole eval split) holds
    ``phase``, ``step``, ``max_steps``, ``loss`` (= ``mlm_loss`` + ``nsp_loss``), ``mlm_loss``,
    ``mlm_acc``, ``nsp_loss``, ``nsp_acc``, ``instances``, ``predictions``, ``seconds`` and
    ``time``, and follows the train row of the same step.
    """

    def __init__(self, run: str) -> None:
        self.uri = storage.join(run, METRICS_FILE)
        self.rows = read_metrics(run)
        self.append_in_place = storage.is_local(run)

    def truncate(self, phase: int, step: int) -> None:
        self.rows = [r for r in self.rows if (r["phase"], r["step"]) <= (phase, step)]
        self._rewrite()

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.append_in_place:
            with storage.open_file(self.uri, "a") as f:
                f.write(json.dumps(row) + "\n")
        else:
            self._rewrite()

    def _rewrite(self) -> None:
        # tmp + move: a reader never sees half a file
        tmp = self.uri + ".tmp"
        storage.write_text(tmp, "".join(json.dumps(r) + "\n" for r in self.rows))
        fs = storage.filesystem(tmp)
        fs.mv(storage.split_protocol(tmp)[1], storage.split_protocol(self.uri)[1])


class MetricsTail:
    """Follows a run's ``metrics.jsonl`` while it is written (CLI progress bar, Prefect flow):
    reads only the new bytes of a local file, and all of it again after a rewrite."""

    def __init__(self, run: str) -> None:
        self.uri = storage.join(run, METRICS_FILE)
        self.rows: list[dict[str, Any]] = []
        self.offset = 0
        self.identity: object = None

    def _identity(self) -> object:
        # A rewrite is tmp + move: a new inode locally; object stores rewrite on every append.
        if storage.is_local(self.uri):
            return os.stat(self.uri).st_ino
        return object()

    def poll(self) -> list[dict[str, Any]]:
        """All complete rows so far."""
        if not storage.exists(self.uri):
            return self.rows
        identity = self._identity()
        if identity != self.identity:  # rewritten (a resume, or an object store): read it all
            self.rows, self.offset, self.identity = [], 0, identity
        with storage.open_file(self.uri, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a torn last line waits for the next poll
        self.offset += len(complete)
        for line in complete.decode("utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            # A row at or before the last one means the file was rewritten (resume): replace.
            while self.rows and order(self.rows[-1]) >= order(row):
                self.rows.pop()
            self.rows.append(row)
        return self.rows
