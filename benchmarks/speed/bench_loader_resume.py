"""Loader resume: ours (skip to the saved position by index) vs replaying the stream, side by side.

    python -m benchmarks.speed.bench_loader_resume            (BERTPIPE_SAMPLES = the sample folder)

Ours turns the saved (epoch, position) into shard and row offsets
(``PretrainingLoader.load_state_dict``); the reference is what a loader without that does, e.g.
transformers' ``skip_first_batches``: iterate the epoch's first ``position`` batches and throw
them away. Both must yield the same next batch. Rows: ``bench-results/loader_resume.json``.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

from benchmarks.common import row, samples, timed, write_rows

MICRO_BATCH = 8


def same_batch(mine: dict, theirs: dict) -> bool:
    """Whether two loader batches are equal: the tensors element by element, the host-side flags
    of the unpadding plan (``bert_core.model.bert.pretraining_plan``) by value."""
    import torch

    return mine.keys() == theirs.keys() and all(
        torch.equal(a, theirs[k]) if isinstance(a, torch.Tensor) else a == theirs[k] for k, a in mine.items())


def best_of(fn, repeats: int = 3) -> tuple[float, dict]:
    """Fastest of a few runs (after a warm-up run: imports, page cache) and its result."""
    fn()
    result, seconds = min((timed(fn, time.perf_counter) for _ in range(repeats)), key=lambda run: run[1])
    return seconds, result


def main() -> None:
    import torch

    from benchmarks.speed.bench_train_step import MAX_SEQ_LENGTH, build_instances
    from bert_core.pretrain.data import PretrainingLoader

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        instances = build_instances(samples(), Path(tmp), num_shards=4)
        probe = PretrainingLoader(instances, MAX_SEQ_LENGTH, MICRO_BATCH, seed=1)
        rows = []
        for fraction in (0.5, 0.95):
            position = int(probe.batches_per_epoch * fraction)

            def resume(position: int = position) -> dict:
                loader = PretrainingLoader(instances, MAX_SEQ_LENGTH, MICRO_BATCH, seed=1)
                loader.load_state_dict({"epoch": 0, "position": position})
                return next(iter(loader))

            def replay(position: int = position) -> dict:
                loader = PretrainingLoader(instances, MAX_SEQ_LENGTH, MICRO_BATCH, seed=1)
                return next(itertools.islice(iter(loader), position, None))

            (t_ours, mine), (t_ref, theirs) = best_of(resume), best_of(replay)

            assert same_batch(mine, theirs), "resume and replay disagree"
            rows.append(row(f"resume at {fraction:.0%} of an epoch ({position} batches of {MICRO_BATCH})", t_ours * 1e3,
                            t_ref * 1e3, "ms to the first batch (replay / ours)", t_ref / t_ours, 2))
    write_rows("loader_resume", rows, instances_per_epoch=probe.batches_per_epoch * MICRO_BATCH)


if __name__ == "__main__":
    main()
