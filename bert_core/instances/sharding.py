"""Balanced instance shards and random-next pools: the arithmetic behind the instances job.

    (beam_jobs/create_instances.py places every piece of instances with these functions)

Random-next B segments come from the document's *pool* (``stable_hash(doc_id) % pools``), not
from the whole corpus, so a worker holds one pool, never the corpus. :func:`num_random_doc_buckets`
takes ``instances.random_doc_buckets``, raised so that no pool averages more than
MAX_DOCS_PER_BUCKET documents (bounded memory whatever the corpus size) and lowered so that none
averages fewer than MIN_DOCS_PER_BUCKET (a tiny corpus gets one pool, so its B segments are not
drawn from a handful of documents).

A pool's instances (per length) are sorted by their 64-bit key and cut into *pieces* by
``key % pools`` (:func:`pieces_by_group`). Pieces are ordered by ``(key % pools, pool)``; a
piece's rows get consecutive global ranks in that order (:func:`make_layout`), and shard ``f``
takes a contiguous rank range (:func:`shard_of_rank`, :func:`shard_start`), so shard sizes
differ by at most one and every shard holds a random share of every pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from bert_core.config import InstanceConfig
from bert_core.instances.batch import InstanceBatch

MIN_DOCS_PER_BUCKET = 1000  # random-next pools smaller than this make B too predictable
MAX_DOCS_PER_BUCKET = 20_000  # ~0.5 GB of tokenized Wikipedia articles held by one worker
INSTANCES_PER_SHARD = 100_000  # when num_shards = 0 (automatic)


def num_random_doc_buckets(n_docs: int, config: InstanceConfig,
                           min_docs: int = MIN_DOCS_PER_BUCKET, max_docs: int = MAX_DOCS_PER_BUCKET) -> int:
    """How many random-next pools ``n_docs`` documents are hashed into."""
    wanted = max(config.random_doc_buckets, math.ceil(n_docs / max_docs))
    return max(1, min(wanted, n_docs // min_docs))


def num_shards(total: int, config: InstanceConfig) -> int:
    """Shards for one length: the configured count (or one per INSTANCES_PER_SHARD), rounded up
    to a multiple of ``shard_multiple_of`` so world size x loader workers divides it."""
    wanted = config.num_shards or max(1, math.ceil(total / INSTANCES_PER_SHARD))
    m = config.shard_multiple_of
    return math.ceil(wanted / m) * m


def shard_of_rank(rank: int, total: int, shards: int) -> int:
    """The shard holding global rank ``rank`` when ``total`` rows are split into contiguous
    ranges whose sizes differ by at most one (the first ``total % shards`` get one more)."""
    q, rem = divmod(total, shards)
    boundary = rem * (q + 1)
    if rank < boundary:
        return rank // (q + 1)
    return rem + (rank - boundary) // q


def shard_start(shard: int, total: int, shards: int) -> int:
    """The first global rank of ``shard`` (inverse of :func:`shard_of_rank`)."""
    q, rem = divmod(total, shards)
    return shard * q + min(shard, rem)


def pieces_by_group(batch: InstanceBatch, groups: int) -> Iterator[tuple[int, InstanceBatch]]:
    """``(g, piece)`` for every non-empty group ``g``: the instances whose key is ``g`` modulo
    ``groups``, sorted by key."""
    group_of = batch.keys % np.uint64(groups)
    batch = batch.take(np.lexsort((batch.keys, group_of)))  # by group, then key
    bounds = np.searchsorted((batch.keys % np.uint64(groups)).astype(np.int64), np.arange(groups + 1))
    for g in range(groups):
        if bounds[g + 1] > bounds[g]:
            yield g, batch.slice(int(bounds[g]), int(bounds[g + 1]))


def make_layout(counts: Iterable[tuple[tuple[int, Any], int]], config: InstanceConfig) -> dict:
    """Per length: total, shard count, and the first global rank of every piece (pieces in the
    order of their keys, ``(group, pool)``)."""
    per_length: dict[int, dict[Any, int]] = {s.max_seq_length: {} for s in config.lengths}
    for (length, bucket), n in counts:
        per_length[length][bucket] = n
    layout = {}
    for length, buckets in per_length.items():
        offsets, running = {}, 0
        for bucket in sorted(buckets):
            offsets[bucket] = running
            running += buckets[bucket]
        layout[length] = {"total": running, "shards": num_shards(running, config), "offsets": offsets}
    return layout


def every_shard(layout: dict) -> list[tuple[int, int]]:
    """``(length, shard)`` of every shard the layout has, so empty ones are written too."""
    return [(length, i) for length, v in layout.items() for i in range(v["shards"])]


def assign_shards(piece: tuple[tuple[int, Any], InstanceBatch],
                  layout: dict) -> Iterator[tuple[tuple[int, int], tuple[int, InstanceBatch]]]:
    """A piece's rows have global ranks ``offset(piece) ..``: cut it at shard boundaries ->
    ``((length, shard), (first rank, rows))``."""
    (length, group), batch = piece
    lay = layout[length]
    total, shards = lay["total"], lay["shards"]
    first = lay["offsets"][group]
    last = first + len(batch) - 1
    for shard in range(shard_of_rank(first, total, shards), shard_of_rank(last, total, shards) + 1):
        lo = max(first, shard_start(shard, total, shards))
        hi = min(last + 1, shard_start(shard + 1, total, shards))
        yield (length, shard), (lo, batch.slice(lo - first, hi - first))
