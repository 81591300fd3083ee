"""Sorted runs: records written to storage sorted by a key, and merged back in key order with
a bounded number of open files, so that a Beam shuffle carries file names, never the records.

    write_run(uri, records, key)                 # sorted by key, one pickle per record
    for record in merge_runs(uris, key): ...      # all runs in key order, one record per open run

A merge holds one record per open run and reads at most ``MERGE_FAN_IN`` runs at once
(:func:`fewer_runs`). The runs are a job's temporary files under ``_spill/`` in the folder the
attempt writes (``<output>/_attempt-<id>``: ``lease.staging``), removed before its manifest is
written.
"""

from __future__ import annotations

import heapq
import pickle
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from bert_core import storage

SPILL_DIR = "_spill"  # under a job's output; removed before its manifest is written
MERGE_FAN_IN = 64  # runs a merge reads at once (plus the intermediate run it writes)


def spill_folder(output: str, kind: str) -> str:
    """The folder of one kind of spill file under a job's output."""
    return storage.join(output, SPILL_DIR, kind)


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


def merge_runs(uris: Iterable[str], key: Callable[[Any], Any], *, fan_in: int = MERGE_FAN_IN) -> Iterator[Any]:
    """The records of every run (each sorted by ``key``) in ``key`` order; ties keep the order
    of ``uris``. At most ``fan_in`` runs are read at once (:func:`fewer_runs`)."""
    check_fan_in(fan_in)
    return _merge(list(uris), key, fan_in)


def _merge(uris: list[str], key: Callable[[Any], Any], fan_in: int) -> Iterator[Any]:
    def merge_into(group: list[str], out: str) -> None:
        write_run(out, _merge_group(group, key))  # already in key order

    with fewer_runs(uris, fan_in, merge_into, "pkl") as few:
        yield from _merge_group(few, key)


def check_fan_in(fan_in: int) -> None:
    if fan_in < 2:
        raise ValueError(f"fan_in must be at least 2 (runs merged at once), got {fan_in}")


@contextmanager
def fewer_runs(uris: list[str], fan_in: int, merge_into: Callable[[list[str], str], Any],
               ext: str) -> Iterator[list[str]]:
    """At most ``fan_in`` sorted runs holding the records of ``uris``, in the same order of ties.

    While there are more, consecutive groups of ``fan_in`` runs are merged by
    ``merge_into(group, out)`` into intermediate runs (``merged-<uuid>.<ext>`` in the folder of
    the first run), which are removed once merged in turn and when the block ends, however it
    ends. The input runs are never removed."""
    first = storage.to_uri(uris[0]) if uris else ""
    folder = first[:first.rfind("/") + 1]  # the first run's folder, ending in "/" (or "proto://")
    intermediate: set[str] = set()  # the runs written here and not removed yet
    try:
        while len(uris) > fan_in:
            merged = []
            for start in range(0, len(uris), fan_in):
                group = uris[start:start + fan_in]
                if len(group) == 1:
                    merged.append(group[0])
                    continue
                out = folder + storage.unique_name("merged", ext)
                intermediate.add(out)
                merge_into(group, out)
                merged.append(out)
                for uri in intermediate.intersection(group):
                    storage.remove(uri, recursive=False)
                    intermediate.discard(uri)
            uris = merged
        yield uris
    finally:
        for uri in intermediate:
            storage.remove(uri, recursive=False)


def _merge_group(uris: list[str], key: Callable[[Any], Any]) -> Iterator[Any]:
    """One ``heapq.merge`` of runs (stable: ties keep the order of ``uris``); each run's file is
    closed when the merge ends or is closed."""
    runs = [read_run(uri) for uri in uris]
    try:
        yield from heapq.merge(*runs, key=key)
    finally:
        for run in runs:
            run.close()


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
