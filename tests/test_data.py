"""The pre-training loader on real instances: sharding, padding, exact resume, dynamic masking.

    .venv/bin/python -m pytest -q tests/test_data.py

The instances are made here in the instances contract (Parquet shards + manifests) from the
real Botchan text, tokenized with the real bert-base-uncased vocab of the MiniLM sample, by
the instance stage's own functions (``bert_core.instances.batch``).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from bert_core import storage
from bert_core.config import InstanceConfig, SequenceSpec
from bert_core.instances.batch import create_instance_batch, write_instance_shards
from bert_core.instances.pairs import DocumentPool
from bert_core.pretrain.data import InstanceDataError, PretrainingLoader, vocab_file_of, vocab_ids


def book_documents(samples_dir: Path, vocab_file: str, max_docs: int) -> list[list[list[int]]]:
    """Botchan as documents of ~12 tokenized sentences (the Gutenberg header skipped)."""
    from tokenizers import BertWordPieceTokenizer

    tok = BertWordPieceTokenizer(vocab_file, lowercase=True)
    text = (samples_dir / "books" / "botchan.txt").read_text(encoding="utf-8-sig")
    body = text.split("*** START OF", 1)[1].split("\n", 1)[1]
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(body.split())) if len(s.strip()) > 2]
    encoded = [e.ids[1:-1] for e in tok.encode_batch(sentences[: max_docs * 12])]
    encoded = [ids for ids in encoded if ids]
    return [encoded[i:i + 12] for i in range(0, len(encoded), 12)][:max_docs]


def make_instances(
    root: Path,
    samples_dir: Path,
    num_shards: int = 4,
    masking: str = "static",
    max_seq_length: int = 64,
    max_docs: int = 40,
) -> str:
    """Write ``<root>/instances`` (and the vocab folder it names) in the instances contract."""
    vocab_dir = root / "vocab"
    vocab_dir.mkdir(parents=True, exist_ok=True)
    vocab_text = (samples_dir / "models" / "minilm" / "vocab.txt").read_text()
    (vocab_dir / "vocab.txt").write_text(vocab_text)
    vocab_manifest = storage.write_manifest(str(vocab_dir), stage="vocab",
                                            config={"lowercase": True, "strip_accents": None})
    vocab = vocab_ids(vocab_text.splitlines())
    cfg = InstanceConfig(
        lengths=[SequenceSpec(max_seq_length=max_seq_length, max_predictions_per_seq=10)],
        masking=masking, dupe_factor=1, num_shards=num_shards,
    )
    docs = book_documents(samples_dir, str(vocab_dir / "vocab.txt"), max_docs)
    batch = create_instance_batch(
        DocumentPool.from_documents(docs), [f"book:{i}" for i in range(len(docs))], seed=cfg.seed,
        dupe_factor=1, max_seq_length=max_seq_length, max_predictions_per_seq=10,
        masked_lm_prob=cfg.masked_lm_prob, short_seq_prob=cfg.short_seq_prob, vocab=vocab,
        mask=masking == "static",
    )
    instances = len(batch)
    out = root / "instances"
    folder = out / f"seq{max_seq_length}"
    shards = write_instance_shards(batch, str(folder), num_shards)
    storage.write_manifest(str(folder), stage="instances", config=cfg, shards=shards,
                           counts={"instances": instances})
    storage.write_manifest(str(out), stage="instances", config=cfg, inputs=[vocab_manifest],
                           counts={"instances": instances})
    return str(out)


def sample_keys(batch: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """A batch's samples, each as its real tokens: identity for order/equality checks."""
    return [tuple(ids[m.bool()].tolist()) for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


@pytest.fixture(scope="module")
def static_instances(tmp_path_factory, samples_dir) -> str:
    return make_instances(tmp_path_factory.mktemp("static"), samples_dir, num_shards=4)


def test_ranks_read_disjoint_shards_and_take_equal_steps(static_instances):
    total = storage.read_manifest(static_instances)["counts"]["instances"]
    seen: list[tuple[int, ...]] = []
    per_rank = []
    for rank in range(2):
        loader = PretrainingLoader(static_instances, 64, micro_batch_size=4, rank=rank, world_size=2, seed=1)
        per_rank.append(loader.batches_per_epoch)
        for batch in itertools.islice(loader, loader.batches_per_epoch):
            seen += sample_keys(batch)
    assert per_rank[0] == per_rank[1] > 0
    # disjoint (apart from genuinely repeated text) and nearly all of the data in one epoch
    assert len(set(seen)) >= len(seen) - 2
    assert len(seen) > total - 2 * 2 * 4


def test_batches_padded_to_longest_rounded_up_to_8(static_instances):
    loader = PretrainingLoader(static_instances, 64, micro_batch_size=8, seed=3)
    for batch in itertools.islice(loader, 6):
        lengths = batch["attention_mask"].sum(1)
        T = batch["input_ids"].shape[1]
        assert T % 8 == 0 and T - 8 < int(lengths.max()) <= T
        # padding is [PAD] = 0 and beyond each sequence's length only
        assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()
        # segment B starts after [CLS] A [SEP] and never covers padding
        assert (batch["token_type_ids"] <= batch["attention_mask"]).all()
        w = batch["masked_lm_weights"]
        assert w.shape == batch["masked_lm_positions"].shape and w.shape[1] % 8 == 0
        assert ((w == 0) | (w == 1)).all() and (batch["masked_lm_positions"][w == 0] == 0).all()
        real = batch["masked_lm_positions"][w == 1]
        assert (real > 0).all()
        # static masking: the stored inputs carry [MASK] (103) at most predicted positions
        rows = torch.arange(w.shape[0])[:, None].expand_as(w)[w == 1]
        masked_tokens = batch["input_ids"][rows, real]
        assert (masked_tokens == 103).float().mean() > 0.6


def test_shuffle_depends_on_seed_and_epoch(static_instances):
    def first_epochs(seed: int) -> list[list[tuple[int, ...]]]:
        loader = PretrainingLoader(static_instances, 64, micro_batch_size=4, seed=seed)
        n = loader.batches_per_epoch
        keys = [k for b in itertools.islice(loader, 2 * n) for k in sample_keys(b)]
        return [keys[: n * 4], keys[n * 4:]]

    a, b, a_again = first_epochs(1), first_epochs(2), first_epochs(1)
    assert a == a_again
    assert a[0] != a[1]  # a new order each epoch
    assert a[0] != b[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_sees_exactly_the_same_batches(static_instances, workers):
    def run(n: int, state: dict | None = None) -> tuple[list, dict]:
        loader = PretrainingLoader(static_instances, 64, micro_batch_size=3, seed=7, workers=workers)
        if state:
            loader.load_state_dict(state)
        batches = list(itertools.islice(loader, n))
        return batches, loader.state_dict()

    probe = PretrainingLoader(static_instances, 64, micro_batch_size=3, seed=7, workers=workers)
    n = probe.batches_per_epoch + 5  # crosses an epoch boundary
    whole, _ = run(n)
    head, state = run(7)
    tail, _ = run(n - 7, state)
    assert state["position"] == 7 and state["epoch"] == 0
    for a, b in zip(whole, head + tail, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key], key


def test_worker_order_equals_in_process_order(static_instances):
    # Worker w owns reader w's shards; the rank's batch order is the same as one process reading
    # those readers round-robin.
    def keys(workers: int) -> list:
        loader = PretrainingLoader(static_instances, 64, micro_batch_size=3, seed=7, workers=workers)
        return [sample_keys(b) for b in itertools.islice(loader, loader.batches_per_epoch)]

    two = keys(2)
    loader = PretrainingLoader(static_instances, 64, micro_batch_size=3, seed=7, workers=2)
    in_process = [sample_keys({k: torch.from_numpy(v) for k, v in loader.batch(0, j).items()})
                  for j in range(loader.batches_per_epoch)]
    assert two == in_process


def test_dynamic_masking_new_masks_each_epoch_same_after_resume(tmp_path, samples_dir):
    instances = make_instances(tmp_path, samples_dir, num_shards=2, masking="dynamic", max_docs=20)
    loader = PretrainingLoader(instances, 64, micro_batch_size=4, seed=5)
    n = loader.batches_per_epoch
    batches = list(itertools.islice(loader, 2 * n))
    w = torch.cat([b["masked_lm_weights"].sum(1) for b in batches])
    assert (w >= 1).all()  # every sample got predictions
    first = batches[0]
    rows = torch.arange(first["masked_lm_weights"].shape[0])[:, None].expand_as(first["masked_lm_weights"])
    real = first["masked_lm_weights"] == 1
    labels = first["masked_lm_ids"][real]
    inputs_at = first["input_ids"][rows[real], first["masked_lm_positions"][real]]
    assert (inputs_at == 103).float().mean() > 0.5  # [MASK] applied by the loader
    assert (labels != 103).all()
    # the instance stage's rules: round(15%) of each sequence (1..10) predicted, 80/10/10
    lengths = torch.cat([b["attention_mask"].sum(1) for b in batches])
    assert torch.equal(w.long(), torch.clamp(torch.round(lengths * 0.15).long(), 1, 10))
    kinds = {"mask": 0, "kept": 0, "random": 0}
    for b in batches:
        real = b["masked_lm_weights"] == 1
        rows = torch.arange(real.shape[0])[:, None].expand_as(real)[real]
        seen = b["input_ids"][rows, b["masked_lm_positions"][real]]
        label = b["masked_lm_ids"][real]
        kinds["mask"] += int((seen == 103).sum())
        kinds["kept"] += int(((seen != 103) & (seen == label)).sum())
        kinds["random"] += int(((seen != 103) & (seen != label)).sum())
    predicted = sum(kinds.values())
    for kind, p in (("mask", 0.8), ("kept", 0.1), ("random", 0.1)):
        assert abs(kinds[kind] - predicted * p) < 4 * (predicted * p * (1 - p)) ** 0.5, (kind, kinds)
    # the same samples in epoch 1 get other masks: compare sets of (masked positions) per sample
    def masks(bs):
        return {tuple(ids.tolist()): tuple(p[wt == 1].tolist()) for b in bs
                for ids, p, wt in zip(b["masked_lm_ids"], b["masked_lm_positions"], b["masked_lm_weights"],
                                      strict=True)}
    assert masks(batches[:n]) != masks(batches[n:])
    # resume mid-epoch 1: the same masks as the uninterrupted stream
    resumed = PretrainingLoader(instances, 64, micro_batch_size=4, seed=5)
    resumed.load_state_dict({"epoch": 1, "position": 2})
    again = list(itertools.islice(resumed, n - 2))
    for a, b in zip(batches[n + 2:], again, strict=True):
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def test_clear_errors(static_instances, tmp_path):
    with pytest.raises(InstanceDataError, match="every reader needs a shard"):
        PretrainingLoader(static_instances, 64, micro_batch_size=2, rank=0, world_size=8)
    with pytest.raises(storage.UnfinishedWriteError):
        PretrainingLoader(static_instances, 128, micro_batch_size=2)
    loader = PretrainingLoader(static_instances, 64, micro_batch_size=2, world_size=2)
    with pytest.raises(ValueError, match="world_size=1"):
        loader.load_state_dict({"epoch": 0, "position": 3, "world_size": 1})
    assert np.all(loader.batch(0, 0)["attention_mask"].sum(1) > 0)
    # instances made from a bare vocab.txt: the config's vocab.vocab_file names it
    bare = tmp_path / "bare"
    storage.write_manifest(str(bare), stage="instances", config={"masking": "static"})
    with pytest.raises(InstanceDataError, match="vocab.vocab_file"):
        vocab_file_of(str(bare))
    assert vocab_file_of(str(bare), fallback="/v/vocab.txt") == "/v/vocab.txt"
    assert vocab_file_of(static_instances).endswith("/vocab/vocab.txt")


def test_loader_computes_the_unpadding_plan_the_model_would(static_instances):
    """The loader hands the model its unpadding indices and masked-LM labels (so the forward pass
    never reads a device value); they equal what the model computes itself, and so do the losses."""
    from bert_core.config import ModelConfig
    from bert_core.model.bert import BertForPreTraining

    loader = PretrainingLoader(static_instances, 64, micro_batch_size=4, seed=3)
    batches = list(itertools.islice(loader, 4))
    assert any(b["padded"] for b in batches)
    vocab = 1 + max(int(b["input_ids"].max()) for b in batches)
    torch.manual_seed(0)
    model = BertForPreTraining(ModelConfig(size="tiny", vocab_size=vocab, max_position_embeddings=64)).eval()
    raw_keys = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions", "masked_lm_ids",
                "masked_lm_weights", "next_sentence_label")
    for batch in batches:
        assert batch["token_index"].numel() == int(batch["attention_mask"].sum())
        assert batch["cu_seqlens"].tolist()[-1] == batch["token_index"].numel()
        assert batch["mlm_labels"].numel() == int(batch["masked_lm_weights"].sum())
        with torch.no_grad():
            given = model(**batch)
            computed = model(**{k: batch[k] for k in raw_keys})
        for key in ("loss", "mlm_acc", "nsp_acc"):
            assert torch.equal(given[key], computed[key]), key


def test_token_buckets_give_fixed_shapes_and_the_same_losses(static_instances):
    """Static shapes: every batch is [B, max_seq_length] with [B, max_predictions_per_seq] slots,
    the encoder's rows one of a few bucket sizes, and the losses those of the exact batch."""
    from bert_core.config import ModelConfig
    from bert_core.model.bert import BertForPreTraining

    exact = list(itertools.islice(PretrainingLoader(static_instances, 64, micro_batch_size=4, seed=3), 6))
    static = list(itertools.islice(PretrainingLoader(static_instances, 64, micro_batch_size=4, seed=3,
                                                     token_buckets=4), 6))
    assert {tuple(b["input_ids"].shape) for b in static} == {(4, 64)}
    assert {tuple(b["masked_lm_positions"].shape) for b in static} == {(4, 16)}  # 10 rounded up to 8s
    assert {b["token_index"].numel() for b in static} <= {64, 128, 192, 256}
    assert {b["output_rows"].numel() for b in static} == {4 + 4 * 16}
    vocab = 1 + max(int(b["input_ids"].max()) for b in exact)
    torch.manual_seed(0)
    model = BertForPreTraining(ModelConfig(size="tiny", vocab_size=vocab, max_position_embeddings=64)).eval()
    with torch.no_grad():
        for a, b in zip(exact, static, strict=True):
            out_a, out_b = model(**a), model(**b)
            for key in ("loss", "mlm_acc", "nsp_acc"):
                assert float(out_a[key]) == pytest.approx(float(out_b[key]), abs=1e-6), key
