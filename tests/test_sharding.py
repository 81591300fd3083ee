"""bert_core/instances/sharding.py: random-next pools, balanced shard ranges, pieces and layout."""

from __future__ import annotations

import numpy as np

from bert_core.config import InstanceConfig, SequenceSpec
from bert_core.instances.batch import InstanceBatch
from bert_core.instances.sharding import (
    EVAL,
    EVAL_SHARDS,
    TRAIN,
    assign_shards,
    eval_threshold,
    every_shard,
    is_eval_document,
    make_layout,
    num_random_doc_buckets,
    num_shards,
    pieces_by_group,
    pool_of,
    set_folder,
    shard_of_rank,
    shard_start,
    split_pools,
)


def test_shard_of_rank_splits_contiguously_within_one() -> None:
    for total, shards in [(0, 4), (3, 4), (10, 3), (1000, 7), (8, 8)]:
        sizes = [0] * shards
        last = 0
        for rank in range(total):
            f = shard_of_rank(rank, total, shards)
            assert f >= last  # contiguous ranges in rank order
            last = f
            sizes[f] += 1
        assert max(sizes) - min(sizes) <= 1


def test_shard_start_is_the_first_rank_of_each_shard() -> None:
    for total, shards in [(3, 4), (10, 3), (1000, 7), (8, 8)]:
        for shard in range(shards):
            start, end = shard_start(shard, total, shards), shard_start(shard + 1, total, shards)
            assert all(shard_of_rank(r, total, shards) == shard for r in range(start, end))
        assert shard_start(shards, total, shards) == total


def test_random_doc_buckets_bound_memory_and_keep_pools_large() -> None:
    cfg = InstanceConfig(random_doc_buckets=64)
    assert num_random_doc_buckets(0, cfg) == 1
    assert num_random_doc_buckets(300, cfg) == 1  # tiny corpus: one pool, the whole corpus
    assert num_random_doc_buckets(5_000, cfg) == 5  # never under 1000 documents a pool
    assert num_random_doc_buckets(500_000, cfg) == 64  # the setting
    assert num_random_doc_buckets(6_000_000, cfg) == 300  # never over 20000 a pool
    assert num_random_doc_buckets(40, cfg, min_docs=10) == 4


def test_num_shards_rounds_up_to_the_multiple() -> None:
    assert num_shards(10, InstanceConfig(num_shards=3, shard_multiple_of=2)) == 4
    assert num_shards(250_000, InstanceConfig(num_shards=0)) == 3  # one per 100k instances
    assert num_shards(0, InstanceConfig(num_shards=0, shard_multiple_of=4)) == 4


def batch_with_keys(keys: list[int]) -> InstanceBatch:
    """A batch of one-token instances whose token is the row's position (to follow rows)."""
    n = len(keys)
    empty = np.zeros(n + 1, dtype=np.int64)
    return InstanceBatch(
        input_ids=np.arange(n, dtype=np.int32), offsets=np.arange(n + 1, dtype=np.int64),
        len_a=np.ones(n, dtype=np.int32), masked_lm_positions=np.zeros(0, dtype=np.int32),
        masked_lm_ids=np.zeros(0, dtype=np.int32), mask_offsets=empty,
        next_sentence_label=np.zeros(n, dtype=np.int8), keys=np.array(keys, dtype=np.uint64))


def test_pieces_group_by_key_modulo_and_sort_by_key() -> None:
    keys = [7, 2, 9, 4, 3, 12, 5]
    pieces = dict(pieces_by_group(batch_with_keys(keys), 3))
    assert sorted(pieces) == [0, 1, 2]
    for g, piece in pieces.items():
        assert piece.keys.tolist() == sorted(k for k in keys if k % 3 == g)
        assert [keys[i] for i in piece.input_ids.tolist()] == piece.keys.tolist()  # rows travel with keys
    assert dict(pieces_by_group(batch_with_keys([3, 6]), 3)).keys() == {0}  # empty groups are skipped


def test_layout_and_assign_shards_place_every_row_once_in_balanced_shards() -> None:
    config = InstanceConfig(lengths=[SequenceSpec(max_seq_length=64, max_predictions_per_seq=10)],
                            num_shards=3)
    sizes = {(0, 0): 4, (0, 1): 3, (1, 0): 5, (1, 1): 2}
    train = (64, TRAIN)
    layout = make_layout([((train, piece), n) for piece, n in sizes.items()], config)
    assert layout[train]["total"] == 14 and layout[train]["shards"] == 3
    assert layout[train]["offsets"] == {(0, 0): 0, (0, 1): 4, (1, 0): 7, (1, 1): 12}
    assert every_shard(layout) == [(train, 0), (train, 1), (train, 2)]
    per_shard: dict[int, list[int]] = {}
    for piece, n in sizes.items():
        for (set_, shard), (first, rows) in assign_shards(((train, piece), batch_with_keys([0] * n)), layout):
            assert set_ == train
            per_shard.setdefault(shard, []).extend(range(first, first + len(rows)))
    assert {s: len(r) for s, r in per_shard.items()} == {0: 5, 1: 5, 2: 4}
    assert sorted(r for rs in per_shard.values() for r in rs) == list(range(14))


def test_eval_sets_get_a_fixed_shard_count_and_are_listed_even_when_empty() -> None:
    config = InstanceConfig(lengths=[SequenceSpec(max_seq_length=64, max_predictions_per_seq=10)],
                            num_shards=3)
    layout = make_layout([(((64, EVAL), (0, 0)), 500), (((64, TRAIN), (0, 0)), 9)], config, (TRAIN, EVAL))
    assert layout[(64, EVAL)] == {"total": 500, "shards": EVAL_SHARDS, "offsets": {(0, 0): 0}}
    assert layout[(64, TRAIN)]["shards"] == 3
    empty = make_layout([], config, (TRAIN, EVAL))
    assert empty[(64, EVAL)]["total"] == 0 and ((64, EVAL), 0) in every_shard(empty)
    assert set_folder("gs://b/out", (64, EVAL)) == "gs://b/out/seq64/eval"
    assert set_folder("gs://b/out", (64, TRAIN)) == "gs://b/out/seq64"


def test_eval_threshold_takes_the_larger_share_capped_at_half() -> None:
    assert eval_threshold(100_000, InstanceConfig()) == 0.01  # eval_fraction
    assert eval_threshold(500, InstanceConfig()) == 10 / 500  # at least min_eval_documents
    assert eval_threshold(20, InstanceConfig()) == 0.5  # never more than half
    assert eval_threshold(19, InstanceConfig()) == 0.0  # too small to give any up
    assert eval_threshold(12, InstanceConfig(min_eval_documents=3)) == 0.25
    assert eval_threshold(500, InstanceConfig(eval_fraction=0)) == 0.0  # off
    assert eval_threshold(0, InstanceConfig()) == 0.0


def test_eval_documents_are_a_stable_share_and_pools_follow_the_split() -> None:
    ids = [f"wiki:{i}" for i in range(20_000)]
    held = [d for d in ids if is_eval_document(d, 12345, 0.05)]
    assert abs(len(held) - 1000) < 4 * (20_000 * 0.05 * 0.95) ** 0.5
    assert set(held) <= {d for d in ids if is_eval_document(d, 12345, 0.1)}  # a larger share keeps them
    assert held != [d for d in ids if is_eval_document(d, 1, 0.05)]  # the seed picks other documents
    pools = split_pools(20_000, 0.05, InstanceConfig(), min_docs=100)
    assert pools == {TRAIN: 64, EVAL: 10}
    assert split_pools(20_000, 0.0, InstanceConfig()) == {TRAIN: 20}
    for d in ids[:500]:
        split, pool = pool_of(d, 12345, 0.05, pools)
        assert split == (EVAL if d in held else TRAIN) and 0 <= pool < pools[split]
