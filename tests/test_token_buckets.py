"""Token buckets (static shapes) on CPU: the real tokens a bucketed batch counts, and the packed
attention path traced and compiled on bucketed batches against the exact batch.

Packed attention (``varlen_attn``) runs only on CUDA, so here a CPU operator with its signature
stands in: a custom op as torch's is (opaque to the compiler, a fake kernel for shapes, its own
backward), computing attention within each ``cu_seqlens`` sequence and refusing offsets that
FlashAttention would read out of bounds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.gpu.gpu_check import BUCKETS, RAW_KEYS, fill_bucket
from bert_core.config import ModelConfig
from bert_core.model import bert
from bert_core.model.bert import BertForPreTraining, pretraining_plan
from bert_core.pretrain.data import PretrainingLoader, read_vocab, vocab_file_of
from bert_core.pretrain.loop import real_tokens
from tests.test_data import make_instances

SEQ = 64
PACKED_CALLS: list[int] = []  # the cu_seqlens length of each run of the CPU operator


def _within_sequences(q, k, v, cu_seqlens):
    """Attention of each token over the tokens of its own sequence: [N, nh, hs] each."""
    N = q.shape[0]
    seq = torch.searchsorted(cu_seqlens, torch.arange(N, dtype=cu_seqlens.dtype), right=True)  # [N]
    mask = seq[:, None] == seq[None, :]  # [N, N]
    y = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask)
    return y[0].transpose(0, 1)


@torch.library.custom_op("bertpipe_test::varlen_attn", mutates_args=())
def _cpu_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_q: torch.Tensor,
                cu_seq_k: torch.Tensor, max_q: int, max_k: int) -> torch.Tensor:
    PACKED_CALLS.append(cu_seq_q.numel())
    lengths = cu_seq_q.diff()
    # what FlashAttention takes on trust: offsets that start at 0, never decrease, end at N,
    # and no sequence longer than max_q
    assert cu_seq_q[0] == 0 and bool((lengths >= 0).all()), cu_seq_q
    assert int(cu_seq_q[-1]) == q.shape[0], (cu_seq_q, q.shape)
    assert int(lengths.max()) <= max_q and torch.equal(cu_seq_q, cu_seq_k)
    return _within_sequences(q, k, v, cu_seq_q).contiguous()


@_cpu_varlen.register_fake
def _(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k):
    return torch.empty_like(q)


@torch.library.custom_op("bertpipe_test::varlen_attn_backward", mutates_args=())
def _cpu_varlen_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, vjp = torch.func.vjp(lambda q, k, v: _within_sequences(q, k, v, cu_seqlens), q, k, v)
    return tuple(g.contiguous() for g in vjp(grad))


@_cpu_varlen_backward.register_fake
def _(grad, q, k, v, cu_seqlens):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_seq_q, *_ = inputs
    ctx.save_for_backward(q, k, v, cu_seq_q)


def _backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    return (*torch.ops.bertpipe_test.varlen_attn_backward(grad, q, k, v, cu), None, None, None, None)


_cpu_varlen.register_autograd(_backward, setup_context=_setup)


def cpu_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    """``torch.nn.attention.varlen.varlen_attn``'s positional signature, on CPU."""
    return torch.ops.bertpipe_test.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)


@pytest.fixture(scope="module")
def batches(tmp_path_factory, samples_dir) -> tuple[dict, int]:
    """The loader's batch (raw arrays) and the vocab size."""
    instances = make_instances(tmp_path_factory.mktemp("buckets"), samples_dir, num_shards=1, max_docs=12)
    batch = next(iter(PretrainingLoader(instances, SEQ, micro_batch_size=32, seed=1)))
    return {k: batch[k] for k in RAW_KEYS}, len(read_vocab(vocab_file_of(instances)))


def with_plan(raw: dict, token_buckets: int = 0) -> dict:
    return raw | pretraining_plan(raw["attention_mask"], raw["masked_lm_positions"], raw["masked_lm_ids"],
                                  raw["masked_lm_weights"], token_buckets)


def test_a_bucketed_batch_counts_its_real_tokens_not_its_bucket(tmp_path, samples_dir):
    instances = make_instances(tmp_path, samples_dir, num_shards=1, max_docs=12)
    batch = next(iter(PretrainingLoader(instances, SEQ, micro_batch_size=32, seed=1, token_buckets=BUCKETS)))
    assert real_tokens(batch) == int(batch["attention_mask"].sum()) < batch["token_index"].numel()


def test_fill_bucket_leaves_only_empty_extra_entries(batches):
    raw, _ = batches
    filled, buckets = fill_bucket(raw, BUCKETS)
    plain, full = with_plan(raw, BUCKETS), with_plan(filled, buckets)
    B = raw["input_ids"].shape[0]
    extra = plain["cu_seqlens"][B:]
    assert extra.diff().gt(0).any() and extra.diff().eq(0).any()  # padding sequences, then empty ones
    assert full["padded"] and full["cu_seqlens"][B:].diff().eq(0).all()  # padded, and only empty ones
    assert real_tokens(full) == full["token_index"].numel()
    assert torch.equal(full["mlm_labels"], plain["mlm_labels"])  # the same predictions


def loss_and_grads(model, batch, forward=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = (model if forward is None else forward)(**batch)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_the_compiled_step_with_packed_attention_matches_the_exact_batch(batches, monkeypatch, dynamic):
    """Both bucketed batches (trailing empty sequences after padding ones, and empty ones only)
    through the packed path, compiled (aot_eager: the graph and its backward, without code
    generation), against the exact batch eagerly through the padded path; and no graph break."""
    raw, vocab_size = batches
    torch.manual_seed(0)
    cfg = ModelConfig(size="tiny", vocab_size=vocab_size, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0).for_vocab(vocab_size)
    model = BertForPreTraining(cfg).train()
    monkeypatch.setattr(bert, "varlen_attn", cpu_varlen_attn)
    monkeypatch.setattr(bert.Tokens, "varlen", lambda self, qkv, dropout_p: self.keep is not None)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", dynamic=dynamic)
    for inputs, buckets in ((raw, BUCKETS), fill_bucket(raw, BUCKETS)):
        with monkeypatch.context() as eager:  # the reference: the padded path, no buckets
            eager.setattr(bert.Tokens, "varlen", lambda self, qkv, dropout_p: False)
            want_loss, want_grads = loss_and_grads(model, with_plan(inputs))
        PACKED_CALLS.clear()
        bucketed = with_plan(inputs, buckets)
        got_loss, got_grads = loss_and_grads(model, bucketed, compiled)
        assert PACKED_CALLS == [bucketed["cu_seqlens"].numel()] * cfg.num_hidden_layers  # every layer packed
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in got_grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    explained = torch._dynamo.explain(model)(**with_plan(raw, BUCKETS))
    assert explained.graph_break_count == 0, explained.break_reasons
