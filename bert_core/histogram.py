"""Histograms as data: bin edges and counts, stored in every manifest as
``{"edges": [...], "counts": [...]}`` and turned into bin labels in one place (:meth:`Histogram.labels`).

    h = Histogram.of([3, 7, 12, 250], edges=(1, 2, 5, 10, 100, None))   # None: an open last bin
    h.to_json()        # {"edges": [1, 2, 5, 10, 100, null], "counts": [0, 1, 1, 1, 1]}
    h.items()          # [("1", 0), ("2-4", 1), ("5-9", 1), ("10-99", 1), ("100+", 1)]
    Histogram.from_json(manifest["stats"]["sentences_per_doc"])          # either stored form
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_LABEL = re.compile(r"^(?:<(\d+)|(\d+)\+|(\d+)(?:-(\d+))?)$")


@dataclass(frozen=True)
class Histogram:
    """Integer values (lengths, counts) in bins: bin ``i`` holds ``edges[i] <= v < edges[i + 1]``,
    so ``edges`` has one entry more than ``counts``; a last edge of ``None`` leaves the last bin
    open. A manifest that holds a dict of bin labels instead (``{"2-4": 5, "100+": 1}``,
    ``{"17": 3}``) reads back as the same bins, in numeric order.
    """
    edges: tuple[int | None, ...]
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.edges) != len(self.counts) + 1:
            raise ValueError(f"a histogram needs one edge more than counts: {len(self.edges)} edges, "
                             f"{len(self.counts)} counts")
        if None in self.edges[:-1]:
            raise ValueError("only the last edge may be None (an open last bin)")
        closed = [e for e in self.edges if e is not None]
        if any(b <= a for a, b in zip(closed, closed[1:], strict=False)):
            raise ValueError(f"histogram edges must increase: {list(self.edges)}")

    @classmethod
    def empty(cls, edges: Sequence[int | None]) -> Histogram:
        return cls(tuple(edges), (0,) * (len(edges) - 1))

    @classmethod
    def of(cls, values: Iterable[int], edges: Sequence[int | None]) -> Histogram:
        counts = [0] * (len(edges) - 1)
        for value in values:
            counts[bin_index(value, edges)] += 1
        return cls(tuple(edges), tuple(counts))

    @classmethod
    def from_bins(cls, edges: Sequence[int | None], counts: Mapping[int, int]) -> Histogram:
        """From counts by bin index (what a job accumulates), every bin of ``edges`` present."""
        return cls(tuple(edges), tuple(int(counts.get(i, 0)) for i in range(len(edges) - 1)))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Histogram:
        """The stored form, or a dict of bin labels (gaps between labelled bins become empty bins)."""
        if set(data) == {"edges", "counts"}:
            return cls(tuple(data["edges"]), tuple(int(c) for c in data["counts"]))
        bins = sorted(((_parse_label(str(label)), int(count)) for label, count in data.items()),
                      key=lambda b: b[0][0])
        edges: list[int | None] = []
        counts: list[int] = []
        for (low, high), count in bins:
            if edges and (edges[-1] is None or edges[-1] > low):
                raise ValueError(f"overlapping histogram bins: {sorted(data)}")
            if edges and edges[-1] < low:  # a gap between two labelled bins
                counts.append(0)
            if not edges or edges[-1] != low:
                edges.append(low)
            counts.append(count)
            edges.append(high)
        return cls(tuple(edges), tuple(counts))

    def to_json(self) -> dict[str, list]:
        return {"edges": list(self.edges), "counts": list(self.counts)}

    def merge(self, other: Histogram) -> Histogram:
        if other.edges != self.edges:
            raise ValueError(f"cannot merge histograms with other edges: {list(other.edges)} into {list(self.edges)}")
        return Histogram(self.edges, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)))

    def total(self) -> int:
        return sum(self.counts)

    def trimmed(self) -> Histogram:
        """Without the empty bins at either end (for showing); an empty histogram stays as it is."""
        filled = [i for i, c in enumerate(self.counts) if c]
        if not filled:
            return self
        first, last = filled[0], filled[-1]
        return Histogram(self.edges[first:last + 2], self.counts[first:last + 1])

    def labels(self) -> list[str]:
        """``"5"`` for a bin of one value, ``"10-99"`` for a range, ``"100+"`` for the open last bin."""
        out = []
        for low, high in zip(self.edges, self.edges[1:], strict=False):
            if high is None:
                out.append(f"{low}+")
            elif high - low == 1:
                out.append(f"{low}")
            else:
                out.append(f"{low}-{high - 1}")
        return out

    def items(self) -> list[tuple[str, int]]:
        """``(label, count)`` of every bin, in numeric order."""
        return list(zip(self.labels(), self.counts, strict=True))

    def format(self) -> str:
        """One line: ``"1: 0, 2-4: 5, 100+: 1"``."""
        return ", ".join(f"{label}: {count}" for label, count in self.items())


def bin_index(value: int, edges: Sequence[int | None]) -> int:
    """The bin of ``edges`` that holds ``value``; a value outside every bin is a ValueError."""
    last = len(edges) - 1
    closed = edges[:-1] if edges[-1] is None else edges
    i = bisect.bisect_right(closed, value) - 1
    if i < 0 or i >= last:
        raise ValueError(f"{value} is outside the histogram's bins {list(edges)}")
    return i


def is_histogram(value: Any) -> bool:
    """True for a stored histogram, in either form (for readers that show any manifest field)."""
    if not isinstance(value, Mapping) or not value:
        return False
    if set(value) == {"edges", "counts"}:
        return True
    return all(_LABEL.match(str(k)) for k in value) and all(isinstance(v, int) for v in value.values())


def _parse_label(label: str) -> tuple[int, int | None]:
    """A stored bin label -> its ``[low, high)`` bounds (``high`` None: open)."""
    match = _LABEL.match(label.strip())
    if not match:
        raise ValueError(f"not a histogram bin label: {label!r}")
    below, open_low, low, high = match.groups()
    if below is not None:
        return 0, int(below)
    if open_low is not None:
        return int(open_low), None
    return int(low), int(high if high is not None else low) + 1
