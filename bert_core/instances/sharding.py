"""Balanced instance shards and random-next pools: the arithmetic behind the instances job.

    (beam_jobs/create_instances.py places every piece of instances with these functions)

The eval split is by document (``instances.eval_fraction``, at least
``instances.min_eval_documents``: :func:`eval_threshold`): an eval document's instances go to
``seq{L}/eval/`` only, and the split is part of the random-next pool key, so no B segment crosses
it. Eval instances are made by the same algorithm and masking in one pass into
:data:`EVAL_SHARDS` shards; with ``eval_fraction: 0`` no eval folder is written.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from bert_core import storage
from bert_core.config import InstanceConfig
from bert_core.instances.batch import InstanceBatch
from bert_core.instances.pairs import stable_hash

# Random-next B segments come from the document's *pool* (``stable_hash(doc_id) % pools``), not
# from the whole corpus, so a worker holds one pool, never the corpus. :func:`num_random_doc_buckets`
# takes ``instances.random_doc_buckets``, raised so that no pool averages more than
# MAX_DOCS_PER_BUCKET documents and lowered so that none averages fewer than MIN_DOCS_PER_BUCKET (a
# tiny corpus gets one pool, so its B segments are not drawn from a handful of documents); then
# raised again, over that floor, so that no pool averages more than ``instances.max_pool_tokens``
# tokens: what a worker holds is tokens, and a corpus of long documents (books, manuals) would
# otherwise put millions of tokens in a pool of a thousand documents. The tokens are estimated
# before the pipeline from the Parquet footers (:func:`estimated_tokens`), so no step waits for a
# count.
#
# A pool's instances (per length) are sorted by their 64-bit key and cut into *pieces* by
# ``key % pools`` (:func:`pieces_by_group`). Pieces are ordered by ``(key % pools, pool)``; a
# piece's rows get consecutive global ranks in that order (:func:`make_layout`), and shard ``f``
# takes a contiguous rank range (:func:`shard_of_rank`, :func:`shard_start`), so shard sizes
# differ by at most one and every shard holds a random share of every pool.
#
# The eval split is by document: a document is held out when ``stable_hash("eval", seed, doc_id)``,
# mapped to [0, 1), is below :func:`eval_threshold`. The split is part of a pool's key
# (:func:`pool_of`), so an eval document's B segments come only from eval documents and a
# training document's only from training documents. Shards are laid out per *set*,
# ``(max_seq_length, split)``: ``seq{L}/`` for training, ``seq{L}/eval/`` (EVAL_SHARDS shards,
# whatever the workers) for eval.

MIN_DOCS_PER_BUCKET = 1000  # random-next pools smaller than this make B too predictable
MAX_DOCS_PER_BUCKET = 20_000  # documents a pool averages at most (and max_pool_tokens tokens)
BYTES_PER_TOKEN = 3  # text bytes per WordPiece token, on the low side (English: ~4) so pools err small
INSTANCES_PER_SHARD = 100_000  # when num_shards = 0 (automatic)
MAX_EVAL_FRACTION = 0.5  # min_eval_documents never takes more than half of a small corpus
EVAL_SHARDS = 1  # shards of an eval set: fixed, so the eval rows never depend on the workers
TRAIN, EVAL = "train", "eval"

Set = tuple[int, str]  # (max_seq_length, split): one folder of shards, seq{L}/ or seq{L}/eval/


def eval_threshold(documents_read: int, config: InstanceConfig) -> float:
    """The share of documents held out: ``eval_fraction``, raised so that about
    ``min_eval_documents`` are held out, capped at MAX_EVAL_FRACTION; 0 when the split is off,
    and for a corpus of fewer than twice ``min_eval_documents`` documents, which is too small to
    give up any of them."""
    if config.eval_fraction == 0 or documents_read < 2 * max(1, config.min_eval_documents):
        return 0.0
    return min(MAX_EVAL_FRACTION, max(config.eval_fraction, config.min_eval_documents / documents_read))


def is_eval_document(doc_id: str, seed: int, threshold: float) -> bool:
    """Whether ``doc_id`` belongs to the eval split (the same answer in every process)."""
    return stable_hash("eval", seed, doc_id) / 2**64 < threshold


def split_pools(documents_read: int, threshold: float, config: InstanceConfig,
                min_docs: int = MIN_DOCS_PER_BUCKET, tokens_read: int = 0) -> dict[str, int]:
    """How many random-next pools each split's (expected) documents and tokens are hashed into."""
    n_eval = math.ceil(threshold * documents_read)
    eval_tokens = math.ceil(threshold * tokens_read)
    pools = {TRAIN: num_random_doc_buckets(documents_read - n_eval, config, min_docs,
                                           n_tokens=tokens_read - eval_tokens)}
    if threshold > 0:
        pools[EVAL] = num_random_doc_buckets(n_eval, config, min_docs, n_tokens=eval_tokens)
    return pools


def estimated_tokens(shards: Iterable[str]) -> int:
    """Tokens of the documents shards, estimated from their Parquet footers (no data read): the
    uncompressed bytes of the ``sentences`` column over BYTES_PER_TOKEN."""
    import pyarrow.parquet as pq

    text = 0
    for uri in shards:
        with storage.open_file(uri, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            text += sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                        if group.column(c).path_in_schema.split(".")[0] == "sentences")
    return text // BYTES_PER_TOKEN


def pool_of(doc_id: str, seed: int, threshold: float, pools: dict[str, int]) -> tuple[str, int]:
    """``(split, pool)`` of a document: a B segment is drawn from the documents of its key."""
    split = EVAL if threshold > 0 and is_eval_document(doc_id, seed, threshold) else TRAIN
    return split, stable_hash("bucket", doc_id) % pools[split]


def set_folder(output: str, length_split: Set) -> str:
    """``output/seq{L}`` for a training set, ``output/seq{L}/eval`` for an eval set."""
    length, split = length_split
    folder = storage.join(output, f"seq{length}")
    return storage.join(folder, EVAL) if split == EVAL else folder


def num_random_doc_buckets(n_docs: int, config: InstanceConfig,
                           min_docs: int = MIN_DOCS_PER_BUCKET, max_docs: int = MAX_DOCS_PER_BUCKET,
                           n_tokens: int = 0) -> int:
    """How many random-next pools ``n_docs`` documents of ``n_tokens`` tokens are hashed into:
    the memory bound (``config.max_pool_tokens`` tokens a pool) wins over the floor of
    ``min_docs`` documents a pool, and no pool is meant to be empty."""
    wanted = max(config.random_doc_buckets, math.ceil(n_docs / max_docs))
    by_documents = max(1, min(wanted, n_docs // min_docs))
    by_tokens = min(math.ceil(n_tokens / config.max_pool_tokens), n_docs)
    return max(by_documents, by_tokens)


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


def piece_bounds(keys: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """The order that puts instances by group ``key % groups``, then by key, and where each
    group starts in it: group ``g`` is ``order[bounds[g]:bounds[g + 1]]``."""
    keys = np.asarray(keys, dtype=np.uint64)
    group_of = keys % np.uint64(groups)
    order = np.lexsort((keys, group_of))  # by group, then key
    bounds = np.searchsorted(group_of[order].astype(np.int64), np.arange(groups + 1))
    return order, bounds


def pieces_by_group(batch: InstanceBatch, groups: int) -> Iterator[tuple[int, InstanceBatch]]:
    """``(g, piece)`` for every non-empty group ``g``: the instances whose key is ``g`` modulo
    ``groups``, sorted by key."""
    order, bounds = piece_bounds(batch.keys, groups)
    batch = batch.take(order)
    for g in range(groups):
        if bounds[g + 1] > bounds[g]:
            yield g, batch.slice(int(bounds[g]), int(bounds[g + 1]))


def make_layout(counts: Iterable[tuple[tuple[Set, Any], int]], config: InstanceConfig,
                splits: Iterable[str] = (TRAIN,)) -> dict[Set, dict]:
    """Per set ``(length, split)``: total, shard count (``num_shards`` for training, EVAL_SHARDS
    for eval), and the first global rank of every piece (pieces in the order of their keys,
    ``(group, pool)``)."""
    per_set: dict[Set, dict[Any, int]] = {(s.max_seq_length, split): {}
                                          for split in splits for s in config.lengths}
    for (length_split, piece), n in counts:
        per_set[length_split][piece] = n
    layout = {}
    for length_split, pieces in per_set.items():
        offsets, running = {}, 0
        for piece in sorted(pieces):
            offsets[piece] = running
            running += pieces[piece]
        shards = num_shards(running, config) if length_split[1] == TRAIN else EVAL_SHARDS
        layout[length_split] = {"total": running, "shards": shards, "offsets": offsets}
    return layout


def every_shard(layout: dict[Set, dict]) -> list[tuple[Set, int]]:
    """``(set, shard)`` of every shard the layout has, so empty ones are written too."""
    return [(length_split, i) for length_split, v in layout.items() for i in range(v["shards"])]


def assign_shards(piece: tuple[tuple[Set, Any], Any],
                  layout: dict[Set, dict]) -> Iterator[tuple[tuple[Set, int], tuple[int, Any]]]:
    """A piece's rows have global ranks ``offset(piece) ..``: cut it at shard boundaries ->
    ``((set, shard), (first rank, rows))``. The rows are an :class:`InstanceBatch` or anything
    else with ``len`` and ``slice(start, stop)`` (the job's row ranges of a spill file)."""
    (length_split, group), batch = piece
    lay = layout[length_split]
    total, shards = lay["total"], lay["shards"]
    first = lay["offsets"][group]
    last = first + len(batch) - 1
    for shard in range(shard_of_rank(first, total, shards), shard_of_rank(last, total, shards) + 1):
        lo = max(first, shard_start(shard, total, shards))
        hi = min(last + 1, shard_start(shard + 1, total, shards))
        yield (length_split, shard), (lo, batch.slice(lo - first, hi - first))
