"""Sorted runs: records spilled to temporary files in key order, read back and merged as streams.

    from bert_core.corpus.spill import write_run, merge_runs
    write_run(uri, records, key)                 # sorted by key, one pickle per record
    for record in merge_runs(uris, key): ...      # all runs in key order, one record per run held

The corpus job (``beam_jobs/clean_corpus.py``) moves documents, fingerprints, duplicate verdicts
and rejects between its steps this way and shuffles only the file names: Beam's local runner
keeps every shuffled element in its own process, so shuffling the records themselves would make
its memory grow with the corpus. Reading a run back holds one record at a time, so a step that
merges runs (e.g. writes one output shard) holds one record per run, never the shard. The files
are the job's own temporary files under its output URL (fsspec), never user input.
"""

from __future__ import annotations

import heapq
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from bert_core import storage


def write_run(uri: str, records: Iterable[Any], key: Callable[[Any], Any] | None = None) -> None:
    """``records`` sorted by ``key`` (as given if None) to ``uri``, one pickle per record."""
    ordered = sorted(records, key=key) if key is not None else records
    with storage.open_file(uri, "wb") as f:
        pickler = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
        for record in ordered:
            pickler.dump(record)
            pickler.clear_memo()  # the memo would keep every record alive


def read_run(uri: str) -> Iterator[Any]:
    """The records of one run, in file order, one at a time."""
    with storage.open_file(uri, "rb") as f:
        unpickler = pickle.Unpickler(f)  # our own temporary files, written by write_run
        while True:
            try:
                yield unpickler.load()
            except EOFError:
                return


def merge_runs(uris: Iterable[str], key: Callable[[Any], Any]) -> Iterator[Any]:
    """The records of every run (each sorted by ``key``) in ``key`` order; ties keep the order
    of ``uris``."""
    return heapq.merge(*(read_run(uri) for uri in uris), key=key)


def group_sorted(records: Iterable[Any], key: Callable[[Any], Any]) -> Iterator[tuple[Any, list[Any]]]:
    """``(key, records with that key)`` for records sorted by a key that starts with ``key``."""
    current, group = None, []
    for record in records:
        k = key(record)
        if group and k != current:
            yield current, group
            group = []
        current = k
        group.append(record)
    if group:
        yield current, group
