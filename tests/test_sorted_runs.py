"""bert_core/sorted_runs.py: merging many sorted runs with a bounded number of open files."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from bert_core import storage
from bert_core.instances.pool_files import merge_rejects, spill_rejects
from bert_core.sorted_runs import MERGE_FAN_IN, merge_runs, write_run


def _key(record: tuple[int, int, int]) -> int:
    return record[0]


def _write_runs(folder: Path, runs: int, seed: int = 0) -> tuple[list[str], list[tuple[int, int, int]]]:
    """``runs`` run files of ``(key, run, position)`` records with few distinct keys (many ties);
    returns their uris and every record in uri order, then file order."""
    rng = random.Random(seed)
    uris, records = [], []
    for run in range(runs):
        keys = sorted(rng.randrange(5) for _ in range(rng.randrange(0, 12)))
        run_records = [(k, run, i) for i, k in enumerate(keys)]
        uri = str(folder / f"run-{run:04d}.pkl")
        write_run(uri, run_records, _key)
        uris.append(uri)
        records += run_records
    return uris, records


class OpenFiles:
    """A key function that also notes, each time it is called, the files under ``folder`` this
    process has open for reading and for writing (Linux: /proc/self/fd)."""

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)
        self.max_read = self.max_write = 0
        self.names: set[str] = set()

    def __call__(self, record: tuple[int, int, int]) -> int:
        read = write = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                if not target.startswith(self.folder):
                    continue
                with open(f"/proc/self/fdinfo/{fd}") as info:
                    flags = next(int(line.split()[1], 8) for line in info if line.startswith("flags:"))
            except (FileNotFoundError, StopIteration):  # closed meanwhile (or the listing's own fd)
                continue
            self.names.add(os.path.basename(target))
            if flags & (os.O_WRONLY | os.O_RDWR):
                write += 1
            else:
                read += 1
        self.max_read, self.max_write = max(self.max_read, read), max(self.max_write, write)
        return _key(record)


def test_many_runs_merge_in_key_order_with_ties_in_uri_order(tmp_path) -> None:
    uris, records = _write_runs(tmp_path, 300)
    expected = sorted(records, key=_key)  # stable: ties in uri order, then file order
    assert len(expected) > 1000 and len({k for k, _, _ in expected}) == 5
    assert list(merge_runs(uris, _key, fan_in=8)) == expected  # 300 -> 38 -> 5 runs, then merged
    assert MERGE_FAN_IN < 300 and list(merge_runs(uris, _key)) == expected
    # a group of one run left over at the end of a pass is carried on as it is
    first_seven = [r for r in records if r[1] < 7]
    assert list(merge_runs(uris[:7], _key, fan_in=2)) == sorted(first_seven, key=_key)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fdinfo"), reason="counts open files through /proc")
def test_never_more_than_fan_in_runs_are_open(tmp_path) -> None:
    uris, records = _write_runs(tmp_path, 300, seed=1)
    key = OpenFiles(tmp_path)
    assert list(merge_runs(uris, key, fan_in=8)) == sorted(records, key=_key)
    # fan_in runs read at once, and the intermediate run being written
    assert key.max_read == 8 and key.max_write == 1
    assert any(name.startswith("merged-") for name in key.names)


def test_intermediate_runs_are_removed(tmp_path) -> None:
    uris, records = _write_runs(tmp_path, 300, seed=2)
    names = sorted(os.listdir(tmp_path))
    merged = merge_runs(uris, _key, fan_in=8)
    assert sorted(os.listdir(tmp_path)) == names  # nothing is done before the first record
    assert sum(1 for _ in merged) == len(records)
    assert sorted(os.listdir(tmp_path)) == names  # the inputs stay, the intermediate runs are gone
    # a merge closed halfway removes its intermediate runs as well
    merged = merge_runs(uris, _key, fan_in=8)
    next(merged)
    assert any(name.startswith("merged-") for name in os.listdir(tmp_path))
    merged.close()
    assert sorted(os.listdir(tmp_path)) == names


def test_few_or_no_runs_merge_in_one_pass(tmp_path) -> None:
    uris, records = _write_runs(tmp_path, 8, seed=3)
    key = OpenFiles(tmp_path) if os.path.isdir("/proc/self/fdinfo") else _key
    assert list(merge_runs(uris, key, fan_in=8)) == sorted(records, key=_key)
    assert not any(name.startswith("merged-") for name in getattr(key, "names", ()))
    assert list(merge_runs([], _key, fan_in=2)) == []


@pytest.mark.parametrize("fan_in", [1, 0, -3])
def test_a_fan_in_below_two_is_refused(tmp_path, fan_in) -> None:
    with pytest.raises(ValueError, match="fan_in must be at least 2"):
        merge_runs([str(tmp_path / "run.pkl")], _key, fan_in=fan_in)  # at once, before any read


def test_many_reject_files_merge_a_few_at_a_time(tmp_path) -> None:
    """bert_core/instances/pool_files.py: the same merge, of JSON-lines reject files sorted by id."""
    rng = random.Random(4)
    folder = tmp_path / "rejects"
    uris = []
    for n in range(150):
        uris.append(str(folder / f"rejects-{n:04d}.jsonl"))
        spill_rejects(uris[-1], [{"id": f"doc:{rng.randrange(20)}", "file": n, "row": i}
                                 for i in range(rng.randrange(6))])
    whole, grouped = str(tmp_path / "whole.jsonl"), str(tmp_path / "grouped.jsonl")
    count = merge_rejects(uris[::-1], whole, fan_in=len(uris))  # one pass, as it always was
    assert merge_rejects(uris[::-1], grouped, fan_in=4) == count > 300
    assert storage.read_text(grouped) == storage.read_text(whole)  # ties in file-name order too
    assert sorted(os.listdir(folder)) == sorted(os.path.basename(u) for u in uris)
    with pytest.raises(ValueError, match="fan_in must be at least 2"):
        merge_rejects(uris, grouped, fan_in=1)
