"""Progress of a long stage: counts that workers on other machines write, a driver that sums
them, and the rate and ETA a display shows.

    tally = Tally(folder, "read", key=repr(item))      # on a worker, one per work item
    tally.add(records=1); tally.close(done=item_bytes)  # cumulative counts, flushed now and then
    watch = Watch(folder, "corpus", {"read": Phase("reading inputs", total_bytes, "bytes")}, on_progress)
    watch.poll()                                        # on the driver: one Update per phase that moved

A stage reports :class:`Update` values to a plain function (``on_progress``); the command line
draws them as bars and the flows as progress artifacts, both with :class:`Meter`'s rate and ETA.

Workers may be other processes or machines, and a runner may report its counters only when the
job ends, so counts travel as files: under ``folder/<phase>/`` one small JSON file per work
item, named by the item, holding that item's cumulative counts. A retried item overwrites its
own file rather than adding to the sum, and the driver never shows less than it showed before.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from bert_core import storage

FLUSH_S = 2.0  # how often a worker rewrites its item's counts while the item runs
RATE_WINDOW_S = 30.0  # the rate is measured over this much recent time


@dataclass(frozen=True)
class Update:
    """Where a stage stands: ``done`` of ``total`` ``unit`` (``total`` None: not known ahead) in
    ``phase``; ``extra`` holds other counts of the phase (records read while bytes are the unit)."""

    stage: str
    phase: str
    done: int
    total: int | None
    unit: str
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return min(1.0, self.done / self.total)


OnProgress = Callable[[Update], None]
T = TypeVar("T")
TELL_S = 0.5  # how often a stage's own loop tells on_progress (a display redraws no faster)


def counted(items: Iterable[T], on_progress: OnProgress | None, stage: str, phase: str, total: int | None,
            unit: str, start: int = 0) -> Iterator[T]:
    """``items`` passed through, with ``on_progress`` told every :data:`TELL_S` seconds how many
    have gone by (counting on from ``start``), and once at the end."""
    if on_progress is None:
        yield from items
        return
    done, told = start, time.monotonic()
    on_progress(Update(stage, phase, done, total, unit))
    for item in items:
        yield item
        done += 1
        if time.monotonic() - told > TELL_S:
            told = time.monotonic()
            on_progress(Update(stage, phase, done, total, unit))
    on_progress(Update(stage, phase, done, total, unit))


@dataclass(frozen=True)
class Phase:
    """What a phase counts, for the driver: its name as shown, its total (None: unknown) and unit."""

    name: str
    total: int | None
    unit: str


def amount(n: float, unit: str) -> str:
    """``12.3 MB`` for bytes, ``1,234 documents`` otherwise."""
    if unit == "bytes":
        for scale, name in ((1 << 30, "GB"), (1 << 20, "MB"), (1 << 10, "kB")):
            if n >= scale:
                return f"{n / scale:.1f} {name}"
        return f"{int(n)} B"
    return f"{int(n):,} {unit}"


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Meter:
    """Rate and ETA of one phase from the updates it is given (the display's own clock)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self.samples: list[tuple[float, int]] = []

    def rate(self, done: int, now: float | None = None) -> float | None:
        """Units per second over the recent window; None until two samples span some time."""
        now = time.monotonic() if now is None else now
        if not self.samples or self.samples[-1][1] != done:
            self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[1][0] > self.window_s:
            self.samples.pop(0)
        (t0, d0), d1 = self.samples[0], self.samples[-1][1]
        if len(self.samples) < 2 or now - t0 <= 0:
            return None
        return (d1 - d0) / (now - t0)

    def describe(self, update: Update, now: float | None = None) -> str:
        """``corpus, reading inputs: 12.3 MB of 45.6 MB (27%), 2.1 MB/s, ETA 0:00:15``."""
        return f"{update.stage}, {update.phase}: {self.counts(update, now)}"

    def counts(self, update: Update, now: float | None = None) -> str:
        """``12.3 MB of 45.6 MB (27%), 2,102 records, 2.1 MB/s, ETA 0:00:15``."""
        rate = self.rate(update.done, now)
        if update.total is None:
            text = amount(update.done, update.unit)
        else:
            done = amount(update.done, update.unit) if update.unit == "bytes" else f"{update.done:,}"
            text = f"{done} of {amount(update.total, update.unit)} ({100 * (update.fraction or 0):.0f}%)"
        text += "".join(f", {amount(n, unit)}" for unit, n in update.extra.items())
        if rate:
            text += f", {amount(rate, update.unit)}/s"
            if update.total is not None and update.done < update.total:
                text += f", ETA {clock((update.total - update.done) / rate)}"
        return text


# --------------------------------------------------------------------------- workers


def _file_name(key: str) -> str:
    return hashlib.sha1(key.encode("utf-8")).hexdigest()[:20] + ".json"


class Tally:
    """One work item's counts on a worker, written to ``folder/<phase>/<item>.json`` at most every
    :data:`FLUSH_S` seconds while it runs and once at :meth:`close`. ``folder`` None: counts nothing."""

    def __init__(self, folder: str | None, phase: str, key: str):
        self.uri = storage.join(folder, phase, _file_name(key)) if folder else None
        self.counts: dict[str, int] = {"done": 0}
        self.flushed_at = time.monotonic()

    def add(self, done: int = 0, **extra: int) -> None:
        self.counts["done"] += done
        for name, n in extra.items():
            self.counts[name] = self.counts.get(name, 0) + n
        if self.uri and time.monotonic() - self.flushed_at > FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.uri:
            storage.write_text(self.uri, json.dumps(self.counts))
            self.flushed_at = time.monotonic()

    def close(self, done: int = 0, **extra: int) -> None:
        self.counts["done"] += done
        for name, n in extra.items():
            self.counts[name] = self.counts.get(name, 0) + n
        self.flush()


def report(folder: str | None, phase: str, key: str, done: int, **extra: int) -> None:
    """A work item's counts written once, when it is done."""
    Tally(folder, phase, key).close(done, **extra)


# --------------------------------------------------------------------------- the driver


class Watch:
    """Sums the workers' files of each phase of ``phases`` and tells ``on_progress`` each phase
    whose sum grew, never a smaller count than before. Phases are polled in order; a phase
    with nothing counted yet says nothing."""

    def __init__(self, folder: str, stage: str, phases: dict[str, Phase], on_progress: OnProgress | None):
        self.folder, self.stage, self.phases, self.on_progress = folder, stage, phases, on_progress
        self.shown: dict[str, dict[str, int]] = {}
        self.cache: dict[str, tuple[object, dict[str, int]]] = {}

    def _sums(self, phase: str) -> dict[str, int] | None:
        fs = storage.filesystem(self.folder)
        path = storage.split_protocol(storage.join(self.folder, phase))[1]
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            return None
        sums: dict[str, int] = {}
        for entry in entries:
            name = entry["name"]
            stamp = (entry.get("size"), entry.get("mtime") or entry.get("updated") or entry.get("generation"))
            cached = self.cache.get(name)
            if cached is None or cached[0] != stamp:
                try:
                    with fs.open(name, "rb") as f:
                        cached = (stamp, json.loads(f.read()))
                except (OSError, ValueError):  # being rewritten: the next poll reads it
                    continue
                self.cache[name] = cached
            for key, n in cached[1].items():
                sums[key] = sums.get(key, 0) + int(n)
        return sums or None

    def poll(self) -> None:
        for phase, spec in self.phases.items():
            sums = self._sums(phase)
            if sums is None:
                continue
            before = self.shown.get(phase, {})
            now = {k: max(n, before.get(k, 0)) for k, n in sums.items()}
            if now == before:
                continue
            self.shown[phase] = now
            if self.on_progress is not None:
                extra = {k: n for k, n in now.items() if k != "done"}
                self.on_progress(Update(self.stage, spec.name, now.get("done", 0), spec.total, spec.unit, extra))

    def clear(self) -> None:
        storage.remove(self.folder)
