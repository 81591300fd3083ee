"""``WriteSortedRuns``: records -> ``(bucket, run file)``, so that a shuffle carries file names.

Each bundle's records are written by bucket to sorted runs (:mod:`bert_core.sorted_runs`) under
the job's output, and only the file names go through the shuffle: Beam's local runner keeps every
shuffled element in memory, so shuffling the records themselves would make its memory grow with
the input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import apache_beam as beam

from bert_core import storage
from bert_core.sorted_runs import SPILL_DIR, write_run

RUN_CHARS = 4 << 20  # characters of records a worker holds (per kind) before it writes them


def identity(record: Any) -> Any:
    return record


def small(_: Any) -> int:
    return 100  # about the characters of a fingerprint, a verdict or a reject


class WriteSortedRuns(beam.DoFn):
    """Records -> ``(bucket, run file)``: ``bucket_of(record, num_buckets)`` picks the bucket,
    ``key`` orders a run, ``weight`` (characters) decides when the held records are written."""

    def __init__(self, output: str, kind: str, num_buckets: int, bucket_of: Callable[[Any, int], int],
                 key: Callable[[Any], Any] = identity, weight: Callable[[Any], int] = small):
        self.output, self.kind, self.num_buckets = output, kind, num_buckets
        self.bucket_of, self.key, self.weight = bucket_of, key, weight

    def start_bundle(self) -> None:
        self.buffers: dict[int, list[Any]] = {}
        self.size = 0

    def process(self, record: Any) -> Iterator[tuple[int, str]]:
        self.buffers.setdefault(self.bucket_of(record, self.num_buckets), []).append(record)
        self.size += self.weight(record)
        if self.size >= RUN_CHARS:
            yield from self._flush()

    def finish_bundle(self) -> Iterator[Any]:
        from apache_beam.transforms.window import GlobalWindows

        for bucket, uri in self._flush():
            yield GlobalWindows.windowed_value((bucket, uri))

    def _flush(self) -> Iterator[tuple[int, str]]:
        for bucket, records in sorted(self.buffers.items()):
            # a unique name: a retried bundle's files are simply never referenced
            uri = storage.join(self.output, SPILL_DIR, storage.unique_name(f"{self.kind}-{bucket:05d}", "pkl"))
            write_run(uri, records, self.key)
            yield bucket, uri
        self.buffers, self.size = {}, 0
