"""Statistics of a set of MLM/NSP instances, for manifests and for comparing with the reference.

    bertpipe stats OUT_URI/seq128      (prints what the instance stage stored in the manifest)

The benchmark computes the same summary from google-research/bert's TFRecords, so both sides
are measured by one piece of code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bert_core.histogram import Histogram


@dataclass
class InstanceStats:
    """Accumulates rows in any order and merges, so each Beam shard writer keeps one and the
    manifest step adds them up; :meth:`summary` gives the numbers a manifest records: instances,
    tokens, mean length, masked fraction and its 80/10/10 split, random-next fraction, and a
    length histogram.

    How a masked position was corrupted is read back from the row: ``[MASK]`` at the position;
    else the stored input id equals the label (kept); else a random id. A random draw that hits
    the original id counts as kept, in the reference's output as in ours.
    """
    max_seq_length: int
    instances: int = 0
    tokens: int = 0
    tokens_squared: int = 0  # sum of squared lengths, for the length's standard deviation
    maskable_tokens: int = 0  # tokens other than [CLS]/[SEP]
    masked: int = 0
    masked_as_mask: int = 0
    masked_kept: int = 0
    masked_random: int = 0
    random_next: int = 0
    with_nsp: int = 0  # instances that have a next-sentence label (B segment)
    length_histogram: dict[int, int] = field(default_factory=dict)  # bin start -> count

    @property
    def bin_width(self) -> int:
        return max(1, self.max_seq_length // 8)

    def length_edges(self) -> list[int]:
        """Edges of the length histogram: bins of ``bin_width`` tokens from 1 up to the length."""
        w = self.bin_width
        return [*range(1, self.max_seq_length + 1, w), (self.max_seq_length - 1) // w * w + w + 1]

    def length_histogram_data(self) -> Histogram:
        return Histogram.from_bins(self.length_edges(),
                                   {start // self.bin_width: c for start, c in self.length_histogram.items()})

    def add(
        self,
        input_ids: Sequence[int],
        masked_lm_positions: Sequence[int],
        masked_lm_ids: Sequence[int],
        next_sentence_label: int,
        mask_id: int,
        n_special: int | None = None,
    ) -> None:
        """Count one instance. ``n_special`` = its [CLS]/[SEP] count (2 without B, 3 with)."""
        n = len(input_ids)
        self.instances += 1
        self.tokens += n
        self.tokens_squared += n * n
        if n_special is None:
            n_special = 2 if next_sentence_label < 0 else 3
        self.maskable_tokens += n - n_special
        self.masked += len(masked_lm_positions)
        for pos, label in zip(masked_lm_positions, masked_lm_ids, strict=True):
            seen = input_ids[pos]
            if seen == mask_id:
                self.masked_as_mask += 1
            elif seen == label:
                self.masked_kept += 1
            else:
                self.masked_random += 1
        if next_sentence_label >= 0:
            self.with_nsp += 1
            self.random_next += int(next_sentence_label == 1)
        start = (n - 1) // self.bin_width * self.bin_width
        self.length_histogram[start] = self.length_histogram.get(start, 0) + 1

    def add_columns(self, input_ids: Any, offsets: Any, len_a: Any, masked_lm_positions: Any,
                    masked_lm_ids: Any, mask_offsets: Any, next_sentence_label: Any, mask_id: int) -> None:
        """Count a batch of rows given as numpy columns (``bert_core.instances.batch.InstanceBatch``'s
        layout): the same counts as :meth:`add` per row (``n_special`` = 2 when ``len_a`` is the
        whole row), without a Python loop."""
        import numpy as np

        offsets = np.asarray(offsets, dtype=np.int64)
        lengths = np.diff(offsets)
        if len(lengths) == 0:
            return
        n_masked = np.diff(np.asarray(mask_offsets, dtype=np.int64))
        nsp = np.asarray(next_sentence_label)
        n_special = np.where(np.asarray(len_a) == lengths, 2, 3)
        self.instances += int(len(lengths))
        self.tokens += int(lengths.sum())
        self.tokens_squared += int((lengths * lengths).sum())
        self.maskable_tokens += int((lengths - n_special).sum())
        self.masked += int(n_masked.sum())
        seen = np.asarray(input_ids)[np.repeat(offsets[:-1], n_masked) + np.asarray(masked_lm_positions)]
        as_mask = seen == mask_id
        kept = ~as_mask & (seen == np.asarray(masked_lm_ids))
        self.masked_as_mask += int(as_mask.sum())
        self.masked_kept += int(kept.sum())
        self.masked_random += int(len(seen) - as_mask.sum() - kept.sum())
        self.with_nsp += int((nsp >= 0).sum())
        self.random_next += int((nsp == 1).sum())
        w = self.bin_width
        starts, counts = np.unique((lengths - 1) // w * w, return_counts=True)
        for start, count in zip(starts.tolist(), counts.tolist(), strict=True):
            self.length_histogram[start] = self.length_histogram.get(start, 0) + count

    def merge(self, other: InstanceStats) -> InstanceStats:
        if other.max_seq_length != self.max_seq_length:
            raise ValueError(f"cannot merge stats of seq{other.max_seq_length} into seq{self.max_seq_length}")
        for name in ("instances", "tokens", "tokens_squared", "maskable_tokens", "masked", "masked_as_mask",
                     "masked_kept", "masked_random", "random_next", "with_nsp"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for start, count in other.length_histogram.items():
            self.length_histogram[start] = self.length_histogram.get(start, 0) + count
        return self

    def to_dict(self) -> dict[str, Any]:
        """Raw counts (JSON-safe), the inverse of :meth:`from_dict`."""
        out = {k: v for k, v in self.__dict__.items() if k != "length_histogram"}
        out["length_histogram"] = self.length_histogram_data().to_json()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceStats:
        data = dict(data)
        stored = data.pop("length_histogram", {})
        if set(stored) == {"edges", "counts"}:  # bins of bin_width tokens, edges at start + 1
            hist = {int(e) - 1: int(c) for e, c in zip(stored["edges"], stored["counts"], strict=False) if c}
        else:  # bin start -> count, as manifests stored it before histograms were data
            hist = {int(k): int(v) for k, v in stored.items()}
        return cls(**data, length_histogram=hist)

    def summary(self) -> dict[str, Any]:
        """The manifest's stats for one length: counts, fractions and the histogram."""

        def frac(a: int, b: int) -> float:
            return round(a / b, 6) if b else 0.0

        return {
            "max_seq_length": self.max_seq_length,
            "instances": self.instances,
            "tokens": self.tokens,
            "mean_length": frac(self.tokens, self.instances),
            "length_sd": round(math.sqrt(max(0.0, self.tokens_squared / self.instances
                                             - (self.tokens / self.instances) ** 2)), 6)
            if self.instances else 0.0,
            "masked_per_instance": frac(self.masked, self.instances),
            "masked_fraction": frac(self.masked, self.tokens),
            "masked_fraction_of_maskable": frac(self.masked, self.maskable_tokens),
            "mask_token_fraction": frac(self.masked_as_mask, self.masked),
            "kept_fraction": frac(self.masked_kept, self.masked),
            "random_token_fraction": frac(self.masked_random, self.masked),
            "random_next_fraction": frac(self.random_next, self.with_nsp),
            "length_histogram": self.length_histogram_data().to_json(),
            "counts": self.to_dict(),
        }
