"""The instances stage's eval split, held out by document (beam_jobs/create_instances.py with
bert_core/instances/sharding.py): real Beam, real Parquet, the real bert-base-uncased vocab.

Every document is written in its own words (disjoint vocabulary slices), so a token id names
the document it came from, and a training instance that held any eval text, as A or as a
random-next B segment, would show it.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_create_instances import write_corpus

from beam_jobs import create_instances
from bert_core import storage
from bert_core.config import InstanceConfig, SequenceSpec
from bert_core.instances.batch import InstanceBatch, create_instance_batch
from bert_core.instances.pairs import DocumentPool, VocabIds
from bert_core.instances.sharding import (
    EVAL,
    EVAL_SHARDS,
    eval_threshold,
    is_eval_document,
    pool_of,
    split_pools,
)
from bert_core.instances.stats import InstanceStats
from bert_core.vocab.tokenization import load_tokenizer

N_DOCS, WORDS_PER_DOC, SENTENCES, WORDS_PER_SENTENCE = 40, 24, 12, 8
MIN_DOCS_PER_BUCKET = 4  # several random-next pools per split, even in this tiny corpus
CONFIG = InstanceConfig(
    lengths=[SequenceSpec(max_seq_length=32, max_predictions_per_seq=5)],
    dupe_factor=3, num_shards=2, seed=11,
)


@pytest.fixture(scope="module")
def vocab_file(samples_dir) -> str:
    return str(samples_dir / "models" / "minilm" / "vocab.txt")


@pytest.fixture(scope="module")
def own_words(vocab_file) -> dict[str, list[str]]:
    """doc_id -> the words only that document uses: whole lowercase vocab words, one token each."""
    tokenizer = load_tokenizer(vocab_file)
    words = [t for t in storage.read_text(vocab_file).splitlines()[2000:]
             if t.isascii() and t.isalpha() and t.islower() and len(t) >= 4]
    words = [w for w in words if len(tokenizer.encode(w)) == 1][:N_DOCS * WORDS_PER_DOC]
    assert len(words) == N_DOCS * WORDS_PER_DOC
    return {f"doc:{d:02d}": words[d * WORDS_PER_DOC:(d + 1) * WORDS_PER_DOC] for d in range(N_DOCS)}


@pytest.fixture(scope="module")
def corpus(own_words, tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    docs = {doc_id: [" ".join(rng.choice(words, WORDS_PER_SENTENCE)) for _ in range(SENTENCES)]
            for doc_id, words in own_words.items()}
    return write_corpus(str(tmp_path_factory.mktemp("tagged-corpus")), list(docs.items()), "tagged")


@pytest.fixture(scope="module")
def doc_of_token(own_words, vocab_file) -> dict[int, str]:
    tokenizer = load_tokenizer(vocab_file)
    return {tokenizer.encode(w)[0]: doc_id for doc_id, words in own_words.items() for w in words}


@pytest.fixture(scope="module")
def split_run(corpus, vocab_file, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("split"))
    create_instances.run(CONFIG, corpus, vocab_file, out, workers=1, min_docs_per_bucket=MIN_DOCS_PER_BUCKET)
    return out


def read_rows(folder: str) -> list[dict]:
    return [r for uri in storage.shard_uris(folder) for r in pq.read_table(uri).to_pylist()]


def source_docs(row: dict, doc_of_token: dict[int, str]) -> tuple[set[str], set[str]]:
    """The documents of a row's A and B segments, read from its original (unmasked) tokens."""
    ids = list(row["input_ids"])
    for position, original in zip(row["masked_lm_positions"], row["masked_lm_ids"], strict=True):
        ids[position] = original  # a random replacement may be any word: judge the original
    a, b = ids[1:row["len_a"] - 1], ids[row["len_a"]:-1]
    return {doc_of_token[t] for t in a}, {doc_of_token[t] for t in b}


def test_no_eval_document_reaches_a_training_instance(split_run, doc_of_token) -> None:
    train = read_rows(storage.join(split_run, "seq32"))
    held_out = read_rows(storage.join(split_run, "seq32", "eval"))
    assert train and held_out
    eval_docs = {d for r in held_out for side in source_docs(r, doc_of_token) for d in side}
    random_next = 0
    for r in train:
        a, b = source_docs(r, doc_of_token)
        assert len(a) == 1 and len(b) == 1  # segments of one document each
        assert not (a | b) & eval_docs, (a, b)
        random_next += a != b
    assert random_next > 0.3 * len(train)  # B segments did come from other (training) documents
    for r in held_out:  # and eval B segments come from eval documents only
        a, b = source_docs(r, doc_of_token)
        assert a | b <= eval_docs


def test_eval_and_training_documents_partition_the_documents_read(split_run, doc_of_token) -> None:
    manifest = storage.read_manifest(split_run)
    counts = manifest["counts"]
    threshold = eval_threshold(N_DOCS, CONFIG)
    assert threshold == 10 / N_DOCS  # min_eval_documents lifts the default 1%
    expected = {f"doc:{d:02d}" for d in range(N_DOCS) if is_eval_document(f"doc:{d:02d}", CONFIG.seed, threshold)}

    def docs_in(folder: str) -> set[str]:
        return {d for r in read_rows(folder) for side in source_docs(r, doc_of_token) for d in side}

    train, held_out = docs_in(storage.join(split_run, "seq32")), docs_in(storage.join(split_run, "seq32", "eval"))
    assert held_out == expected and not train & held_out
    assert train | held_out == {f"doc:{d:02d}" for d in range(N_DOCS)}
    assert counts["documents_read"] == counts["documents_used"] == N_DOCS
    assert counts["eval_documents"] == len(held_out)
    assert split_pools(N_DOCS, threshold, CONFIG, MIN_DOCS_PER_BUCKET)[EVAL] > 1  # pools were split too


def test_eval_instances_are_one_pass_of_the_same_algorithm(split_run, corpus, vocab_file) -> None:
    """Rebuilt from the library's own pools and ``create_instance_batch`` with dupe_factor 1,
    the eval instances are exactly the eval shard's rows."""
    threshold = eval_threshold(N_DOCS, CONFIG)
    pools = split_pools(N_DOCS, threshold, CONFIG, MIN_DOCS_PER_BUCKET)
    tokenizer = load_tokenizer(vocab_file)
    vocab_ids = VocabIds.from_tokenizer(tokenizer)
    table = pq.read_table(storage.shard_uris(corpus)[0]).to_pylist()
    by_pool: dict[tuple[str, int], list[tuple[str, bytes]]] = {}
    for doc in table:
        key = pool_of(doc["doc_id"], CONFIG.seed, threshold, pools)
        if key[0] == EVAL:
            by_pool.setdefault(key, []).append((doc["doc_id"], tokenizer.encode_document_bytes(doc["sentences"])))
    spec = CONFIG.lengths[0]
    batches = []
    for docs in by_pool.values():
        docs.sort()
        batches.append(create_instance_batch(
            DocumentPool.from_marked([m for _, m in docs]), [d for d, _ in docs], seed=CONFIG.seed,
            dupe_factor=1, max_seq_length=spec.max_seq_length, max_predictions_per_seq=spec.max_predictions_per_seq,
            masked_lm_prob=CONFIG.masked_lm_prob, short_seq_prob=CONFIG.short_seq_prob, vocab=vocab_ids))
    expected = sorted(InstanceBatch.concat(batches).rows())
    written = sorted((r["input_ids"], r["len_a"], r["masked_lm_positions"], r["masked_lm_ids"],
                      r["next_sentence_label"]) for r in read_rows(storage.join(split_run, "seq32", "eval")))
    assert written == expected


def test_eval_manifests_and_statistics(split_run, vocab_file) -> None:
    top = storage.read_manifest(split_run)
    train = storage.read_manifest(storage.join(split_run, "seq32"))
    held_out = storage.read_manifest(storage.join(split_run, "seq32", "eval"))
    assert held_out["split"] == "eval" and held_out["stage"] == "instances"
    assert held_out["config"]["dupe_factor"] == 1 and held_out["config"]["max_seq_length"] == 32
    assert len(held_out["shards"]) == EVAL_SHARDS and [s["path"] for s in held_out["shards"]] == [
        "part-00000-of-00001.parquet"]
    n_eval = held_out["counts"]["instances"]
    assert n_eval == train["counts"]["eval_instances"] == top["counts"]["eval_instances_seq32"] > 20
    assert train["counts"]["instances"] == top["counts"]["instances_seq32"]
    assert sum(s["count"] for s in train["shards"]) == train["counts"]["instances"]
    # training: 3 passes over ~3x as many documents; eval: one pass
    assert 4 * n_eval < train["counts"]["instances"] < 20 * n_eval

    rows = read_rows(storage.join(split_run, "seq32", "eval"))
    mask_id = VocabIds.from_tokenizer(load_tokenizer(vocab_file)).mask_id
    stats = InstanceStats(max_seq_length=32)
    for r in rows:
        stats.add(r["input_ids"], r["masked_lm_positions"], r["masked_lm_ids"], r["next_sentence_label"], mask_id)
        assert len(r["input_ids"]) <= 32 and r["next_sentence_label"] in (0, 1)
        assert len(r["masked_lm_positions"]) == min(5, max(1, round(len(r["input_ids"]) * 0.15)))
    summary = stats.summary()
    assert summary == held_out["stats"]
    n = stats.masked
    assert abs(summary["mask_token_fraction"] - 0.8) < 4 * math.sqrt(0.16 / n)
    assert abs(summary["kept_fraction"] - 0.1) < 4 * math.sqrt(0.09 / n)
    assert 0.25 < summary["random_next_fraction"] < 0.85
    assert summary["mean_length"] > 0.6 * 32


def test_eval_fraction_zero_writes_no_eval_folder(corpus, vocab_file, doc_of_token, tmp_path) -> None:
    out = str(tmp_path / "no-eval")
    config = CONFIG.model_copy(update={"eval_fraction": 0.0})
    manifest = create_instances.run(config, corpus, vocab_file, out, workers=1, min_docs_per_bucket=MIN_DOCS_PER_BUCKET)
    assert not (tmp_path / "no-eval" / "seq32" / "eval").exists()
    assert manifest["counts"]["eval_documents"] == 0 and manifest["counts"]["eval_instances_seq32"] == 0
    assert storage.read_manifest(storage.join(out, "seq32"))["counts"]["eval_instances"] == 0
    seen = {d for r in read_rows(storage.join(out, "seq32")) for side in source_docs(r, doc_of_token) for d in side}
    assert len(seen) == N_DOCS
