"""BERT: the whole forward pass in one file (embeddings, encoder, pooler, pre-training heads).

    python -c "from bert_core.model.bert import BertForPreTraining; from bert_core.config import ModelConfig; \
print(BertForPreTraining(ModelConfig(size='tiny', vocab_size=8000)))"

Parameter names equal transformers' ``BertForPreTraining``, so a state dict maps 1:1 both ways
(``bert_core/model/checkpoint.py``). Shapes are commented inline: B = batch, T = sequence length,
N = real (non-padding) tokens, H = hidden size, nh = heads, hs = H / nh, P = masked positions per
sequence, M = real masked positions of the batch, V = vocab size.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from bert_core.config import ModelConfig
from bert_core.model.checkpoint import load_into, load_pretrained

# What makes the step cheaper than the reference implementation:
# - the encoder works on the real tokens only: padding is dropped before the first layer;
#   attention runs on the packed tokens (varlen FlashAttention on CUDA) or scatters into the
#   [B, T] grid, with no mask when nothing is padded so SDPA may pick its flash kernel;
# - the MLM head runs only at the masked positions, and the last layer, after its attention,
#   goes on with the masked positions and [CLS] only (as MosaicBERT does);
# - query/key/value are one stored matrix and one matmul (the state dict keeps transformers' names);
# - the unpadding indices come precomputed from the loader's workers (pretraining_plan), so the
#   forward pass never waits for the host.

varlen_attn = None  # packed FlashAttention over variable-length sequences: CUDA only, so only
if torch.cuda.is_available():  # imported there (it loads torch._dynamo, seconds a process)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        pass

if TYPE_CHECKING:  # pragma: no cover
    from typing import Self

PAD_ID = 0  # [PAD] is token 0 in every vocab of the pipeline (and in transformers' BertConfig)
IGNORE = -100  # a masked-LM label with no prediction behind it (transformers' ignore_index)


def _activation(name: str):
    if name == "gelu":  # the paper's GELU: exact, erf-based
        return F.gelu
    if name == "gelu_new":  # tanh approximation (GPT-2 / google-research/bert's TF code)
        return functools.partial(F.gelu, approximate="tanh")  # a partial pickles, a lambda not
    if name == "relu":
        return F.relu
    raise ValueError(f"hidden_act={name!r} is not supported; use gelu, gelu_new or relu")


def _check_vocab(cfg: ModelConfig) -> int:
    if cfg.vocab_size is None:
        raise ValueError(
            "ModelConfig.vocab_size is None: set it from the vocab (e.g. "
            "cfg.model_copy(update={'vocab_size': tokenizer.vocab_size})) before building the model"
        )
    return cfg.vocab_size


class BertOutput(NamedTuple):
    last_hidden_state: Tensor  # [B, T, H]; zeros at padding positions (they are never computed)
    pooler_output: Tensor  # [B, H], tanh(dense([CLS]))
    hidden_states: tuple[Tensor, ...] | None  # embeddings + one per layer, each [B, T, H]


# --------------------------------------------------------------------------- embeddings


class BertEmbeddings(nn.Module):
    """token + segment + position embeddings, then LayerNorm and dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.word_embeddings = nn.Embedding(_check_vocab(cfg), H, padding_idx=PAD_ID)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, H)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, H)
        self.LayerNorm = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.max_positions = cfg.max_position_embeddings

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        T = input_ids.shape[1]
        if T > self.max_positions:
            raise ValueError(
                f"sequence length {T} exceeds max_position_embeddings={self.max_positions}; "
                "truncate the inputs or use a model with more positions"
            )
        pos = torch.arange(T, device=input_ids.device)  # [T]
        x = (
            self.word_embeddings(input_ids)  # [B, T, H]
            + self.token_type_embeddings(token_type_ids)  # [B, T, H]
            + self.position_embeddings(pos)  # [T, H], broadcast over B
        )
        return self.dropout(self.LayerNorm(x))


# --------------------------------------------------------------------------- encoder


class _Linear(nn.Module):
    """A bare weight and bias holder, so parameter names read like transformers' (``...qkv``
    excepted, which its state dict splits)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_out))


QKV = ("query", "key", "value")


def _split_qkv(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict hook: the stored [3H, H] ``qkv`` as transformers' ``query``/``key``/``value``."""
    for kind in ("weight", "bias"):
        fused = state.pop(f"{prefix}qkv.{kind}")
        for name, part in zip(QKV, fused.detach().chunk(3), strict=True):
            state[f"{prefix}{name}.{kind}"] = part.clone()  # own storage: safetensors refuses views


def _join_qkv(module: nn.Module, state: dict, prefix: str, *args: object) -> None:
    """load_state_dict pre-hook: transformers' ``query``/``key``/``value`` into the stored ``qkv``."""
    for kind in ("weight", "bias"):
        names = [f"{prefix}{name}.{kind}" for name in QKV]
        if all(name in state for name in names):
            state[f"{prefix}qkv.{kind}"] = torch.cat([state.pop(name) for name in names])


class BertSelfAttention(nn.Module):
    """Query, key and value are one stored [3H, H] matrix: one matmul, and nothing concatenated
    or split per step. Its state dict reads transformers' separate ``query``/``key``/``value``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.qkv = _Linear(H, 3 * H)  # rows: query, key, value
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.register_state_dict_post_hook(_split_qkv)
        self.register_load_state_dict_pre_hook(_join_qkv)

    def forward(self, x: Tensor, tokens: Tokens) -> Tensor:
        N, H = x.shape  # N = the real tokens of the batch (B * T when there is no padding)
        B, T, nh = tokens.batch, tokens.length, self.num_heads
        dropout_p = self.dropout_p if self.training else 0.0
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)  # [N, H] @ [H, 3H] -> [N, 3H]
        if tokens.varlen(qkv, dropout_p):
            # FlashAttention over the packed real tokens: no [B, T] grid, no mask
            q, k, v = qkv.view(N, 3, nh, H // nh).unbind(1)  # each [N, nh, hs]
            y = varlen_attn(q, k, v, tokens.cu_seqlens, tokens.cu_seqlens, T, T)  # [N, nh, hs]
            return y.reshape(N, H)
        # [B, T, 3H] (zeros at padding) -> [B, T, 3, nh, hs] -> [3, B, nh, T, hs]
        q, k, v = tokens.pad(qkv).view(B, T, 3, nh, H // nh).permute(2, 0, 3, 1, 4)
        # No mask when nothing is padded, so SDPA may pick its flash kernel
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=tokens.attn_mask, dropout_p=dropout_p)
        return tokens.unpad(y.transpose(1, 2).reshape(B, T, H))  # heads side by side -> [N, H]


class BertProjection(nn.Module):
    """A projection back to the hidden size with its dropout and LayerNorm: the attention output
    (``attention.output``) and the FFN down projection (``output``). ``LayerNorm`` is post-LN's
    norm after the residual; pre-LN uses it on the sublayer's input instead."""

    def __init__(self, cfg: ModelConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertProjection(cfg, cfg.hidden_size)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)


class BertLayer(nn.Module):
    """Self-attention + GELU feed-forward, each with a residual and a LayerNorm.

    post-LN (paper):  x = LN(x + attn(x));     x = LN(x + ffn(x))
    pre-LN (option):  x = x + attn(LN(x));     x = x + ffn(LN(x))   (+ one final LN in the encoder)
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertProjection(cfg, cfg.intermediate_size)
        self.act = _activation(cfg.hidden_act)
        self.pre_layer_norm = cfg.pre_layer_norm

    def _attn(self, x: Tensor, tokens: Tokens, rows: Tensor | None) -> Tensor:
        y = self.attention.self(x, tokens)  # [N, H]: every token attends (and is attended to)
        if rows is not None:
            y = y.index_select(0, rows)  # [S, H]: only the rows the caller will read
        out = self.attention.output
        return out.dropout(out.dense(y))

    def _ffn(self, x: Tensor) -> Tensor:
        h = self.act(self.intermediate.dense(x))  # [N, 4H]
        return self.output.dropout(self.output.dense(h))  # [N, H]

    def forward(self, x: Tensor, tokens: Tokens, rows: Tensor | None = None) -> Tensor:
        """[N, H] -> [N, H]; with ``rows`` ([S] indices into N) -> [S, H], those tokens only."""
        ln_attn, ln_ffn = self.attention.output.LayerNorm, self.output.LayerNorm
        residual = x if rows is None else x.index_select(0, rows)
        if self.pre_layer_norm:
            x = residual + self._attn(ln_attn(x), tokens, rows)
            return x + self._ffn(ln_ffn(x))
        x = ln_attn(residual + self._attn(x, tokens, rows))
        return ln_ffn(x + self._ffn(x))


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        # Pre-LN leaves the residual stream un-normalised; one LayerNorm closes it (as Megatron).
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if cfg.pre_layer_norm else None


class BertPooler(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))  # [B, H] from [CLS]


# --------------------------------------------------------------------------- the model


def init_weights(module: nn.Module, initializer_range: float = 0.02) -> None:
    """BERT's init: weights ~ N(0, 0.02) (truncation is immaterial at 0.02), biases 0, LN = 1/0."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, _Linear)):
            nn.init.normal_(m.weight, mean=0.0, std=initializer_range)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=initializer_range)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class Tokens:
    """Where the real tokens of a padded [B, T] batch are, to run the encoder on them alone.

    Everything but attention is per token, so the layers work on the N real tokens ([N, H]) and
    padding costs no matmuls. Attention either runs on the packed tokens (``varlen``, CUDA) or
    needs the [B, T] grid: ``pad`` scatters into it, ``unpad`` gathers back. The index tensors
    come from :func:`unpadding_plan`, which the pre-training loader computes on its workers so
    the device never waits for the host.
    """

    def __init__(self, B: int, T: int, padded: bool, token_index: Tensor, cu_seqlens: Tensor,
                 attention_mask: Tensor | None, dtype: torch.dtype) -> None:
        self.batch, self.length = B, T
        self.keep = token_index if padded else None  # [N] flat indices of the real tokens
        self.cu_seqlens = cu_seqlens  # [B + 1] int32 offsets of each sequence in [N]
        self.attn_mask = padding_mask(attention_mask, dtype) if padded else None  # [B, 1, 1, T]

    def varlen(self, qkv: Tensor, dropout_p: float) -> bool:
        """Packed FlashAttention applies: CUDA, padding, no attention dropout (``varlen_attn`` has
        none), and q/k/v in half precision (under autocast the layer's input is fp32, its
        projection ``qkv`` is not)."""
        return (self.keep is not None and varlen_attn is not None and qkv.is_cuda
                and qkv.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0)

    def unpad(self, x: Tensor) -> Tensor:
        """[B, T, D] -> [N, D]."""
        x = x.reshape(self.batch * self.length, x.shape[-1])
        return x if self.keep is None else x.index_select(0, self.keep)

    def pad(self, x: Tensor) -> Tensor:
        """[N, D] -> [B, T, D], zeros at the padding."""
        if self.keep is not None:
            x = x.new_zeros(self.batch * self.length, x.shape[-1]).index_copy(0, self.keep, x)
        return x.view(self.batch, self.length, x.shape[-1])


def unpadding_plan(attention_mask: Tensor, output_positions: Tensor | None = None,
                   token_buckets: int = 0) -> dict:
    """The index tensors the encoder runs on, from a [B, T] attention mask (on the host).

    ``padded`` (a bool), ``token_index`` ([N] flat positions of the real tokens), ``cu_seqlens``
    ([B + 1] int32) and, with ``output_positions`` ([S] flat positions ``b * T + t``),
    ``output_rows``: the rows in [N] of every [CLS] and then of those positions. Reading a
    mask's values waits for the device, so the pre-training loader calls this on its workers.

    With ``token_buckets`` > 0 the shapes do not depend on the batch's lengths: N is rounded up
    to a multiple of B*T / token_buckets with padding positions, which no real token attends to
    and nothing reads, and ``cu_seqlens`` gets a fixed number of extra entries that cut them into
    sequences of at most T.
    """
    B, T = attention_mask.shape
    real = attention_mask.reshape(-1) != 0  # [B*T]
    token_index = real.nonzero().squeeze(1)  # [N]
    n_real = token_index.numel()
    lengths = real.view(B, T).sum(1, dtype=torch.int32)  # [B]
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))  # [B + 1]
    if token_buckets:
        size = -(-B * T // token_buckets)
        extra = min(B * T, -(-n_real // size) * size) - n_real
        token_index = torch.cat([token_index, (~real).nonzero().squeeze(1)[:extra]])  # [N_bucket]
        cuts = torch.arange(1, -(-size // T) + 1, dtype=torch.int32, device=real.device) * T  # [K]
        cu_seqlens = torch.cat([cu_seqlens, (n_real + cuts).clamp(max=n_real + extra)])  # [B + 1 + K]
    plan = {"padded": n_real != B * T, "token_index": token_index, "cu_seqlens": cu_seqlens}
    if output_positions is not None:
        row_of = torch.full((B * T,), -1, dtype=torch.long, device=token_index.device)
        row_of[token_index] = torch.arange(token_index.numel(), device=token_index.device)
        flat = torch.cat([torch.arange(B, device=token_index.device) * T, output_positions.long()])
        rows = row_of[flat]  # [B + S]
        if bool((rows < 0).any()) or bool((rows[B:] >= n_real).any()):
            bad = flat[(rows < 0) | (rows >= n_real)][:3].tolist()
            raise ValueError(
                f"positions {[(p // T, p % T) for p in bad]} (batch row, token) are padding "
                "(attention_mask 0); masked_lm_positions must point at real tokens"
            )
        plan["output_rows"] = rows
    return plan


def pretraining_plan(attention_mask: Tensor, masked_lm_positions: Tensor, masked_lm_ids: Tensor,
                     masked_lm_weights: Tensor, token_buckets: int = 0) -> dict:
    """:func:`unpadding_plan` for a pre-training batch: the encoder's indices, the rows of the
    masked positions and their labels ``mlm_labels``: the M real ones (``masked_lm_weights`` > 0),
    or with ``token_buckets`` all B*P of them, ``IGNORE`` where there is no prediction."""
    B, T = attention_mask.shape
    real = masked_lm_weights.reshape(-1) > 0  # [B*P]
    flat = (masked_lm_positions + T * torch.arange(B, device=masked_lm_positions.device)[:, None]).reshape(-1)
    labels = masked_lm_ids.reshape(-1).long()
    if token_buckets:  # padding predictions point at position 0 ([CLS], a real token)
        plan = unpadding_plan(attention_mask, torch.where(real, flat, flat - flat % T), token_buckets)
        plan["mlm_labels"] = labels.masked_fill(~real, IGNORE)  # [B*P]
    else:
        plan = unpadding_plan(attention_mask, flat[real])
        plan["mlm_labels"] = labels[real]  # [M]
    return plan


def padding_mask(attention_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """[B, T] of 1 (token) / 0 (padding) -> additive [B, 1, 1, T] mask for SDPA (None if no mask).

    Additive (0 / dtype min) rather than boolean: the same numbers as transformers, and a row
    never becomes all -inf (every sequence has at least [CLS]), so no NaNs.
    """
    if attention_mask is None:
        return None
    keep = attention_mask[:, None, None, :].to(torch.bool)  # [B, 1, 1, T]
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(
        ~keep, torch.finfo(dtype).min
    )


class FromPretrained:
    """``from_pretrained(path)`` for the models: build from the folder's ``config.json``, then load
    its weights (``bert.`` prefix or not). Weights the folder lacks (e.g. the pre-training heads
    when it holds a bare ``BertModel``) keep their fresh init."""

    @classmethod
    def from_pretrained(cls, path: str) -> Self:
        """Load a transformers-layout folder (``config.json`` + weights)."""
        cfg, state = load_pretrained(path)
        model = cls(cfg)
        load_into(model, state, source=path)
        return model


class BertModel(FromPretrained, nn.Module):
    """The encoder: ``forward(input_ids, token_type_ids, attention_mask) -> BertOutput``.

    ``checkpoint_fn`` (``fn(layer, *args)``, e.g. ``deepspeed.checkpointing.checkpoint``), when set,
    runs each encoder layer in training without keeping its activations: they are recomputed in
    the backward pass (activation checkpointing).
    """

    checkpoint_fn: Any = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg)
        init_weights(self, cfg.initializer_range)

    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        token_type_ids: Tensor | None = None,  # [B, T], 0 = segment A, 1 = segment B
        attention_mask: Tensor | None = None,  # [B, T], 1 = token, 0 = padding
        output_hidden_states: bool = False,
        output_positions: Tensor | None = None,  # [S] flat indices b * T + t of real tokens
        plan: dict | None = None,  # unpadding_plan(attention_mask, output_positions), precomputed
    ) -> BertOutput:
        """With ``output_positions`` the last layer computes only those tokens (and [CLS] for the
        pooler) after its attention, and ``last_hidden_state`` is their [S, H] rows, in order:
        pre-training reads the final states at the masked positions alone (~15%)."""
        B, T = input_ids.shape
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if plan is None:
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            plan = unpadding_plan(mask, output_positions)
        x = self.embeddings(input_ids, token_type_ids)  # [B, T, H]
        tokens = Tokens(B, T, plan["padded"], plan["token_index"], plan["cu_seqlens"], attention_mask, x.dtype)
        hidden = [x] if output_hidden_states else None
        x = tokens.unpad(x)  # [N, H]: the real tokens only
        rows = plan.get("output_rows")  # [B + S] indices into N, or None
        last = len(self.encoder.layer) - 1
        for i, layer in enumerate(self.encoder.layer):
            if self.checkpoint_fn is not None and self.training:  # recompute in backward, keep no activations
                x = self.checkpoint_fn(layer, x, tokens, rows if i == last else None)
            else:
                x = layer(x, tokens, rows if i == last else None)  # [N, H] ([B + S, H] after the last)
            if hidden is not None and (rows is None or i < last):
                hidden.append(tokens.pad(x))
        if self.encoder.ln is not None:
            x = self.encoder.ln(x)
            if hidden is not None and rows is None:
                hidden[-1] = tokens.pad(x)
        if rows is not None:  # [B + S, H]: [CLS] rows, then the requested ones
            pooled = self.pooler(x[:B, None])  # [B, 1, H] holds only [CLS]
            return BertOutput(x[B:], pooled, tuple(hidden) if hidden is not None else None)
        x = tokens.pad(x)  # [B, T, H], zeros at the padding
        return BertOutput(x, self.pooler(x), tuple(hidden) if hidden is not None else None)


# --------------------------------------------------------------------------- pre-training heads


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """transform, then the word-embedding matrix (tied) as the output projection, + a bias."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg)
        self.bias = nn.Parameter(torch.zeros(_check_vocab(cfg)))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2)


class BertForPreTraining(FromPretrained, nn.Module):
    """Masked LM + next sentence prediction: ``forward(...) -> {loss, mlm_loss, nsp_loss, mlm_acc, nsp_acc}``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg)
        self.cls = BertPreTrainingHeads(cfg)
        init_weights(self.cls, cfg.initializer_range)
        # Rows per chunk of the masked-LM loss, 0 = all at once: a training-time setting
        # (pretrain.mlm_loss_chunk), so not part of the config a checkpoint exports.
        self.mlm_loss_chunk = 0

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """[M, H] hidden states at masked positions -> [M, V] logits (decoder tied to embeddings)."""
        return self._decode(self.cls.predictions.transform(hidden))

    def _decode(self, x: Tensor) -> Tensor:
        """[m, H] transformed states -> [m, V] logits."""
        return F.linear(x, self.bert.embeddings.word_embeddings.weight, self.cls.predictions.bias)

    def _mlm_sums(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """[m, H] transformed states, [m] labels -> (summed cross-entropy, correct predictions)."""
        logits = self._decode(x)  # [m, V]
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")
        return loss, ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum()

    def chunked_mlm_sums(self, x: Tensor, labels: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
        """What ``_mlm_sums`` gives, ``chunk`` rows at a time: each chunk's [chunk, V] logits are
        recomputed in the backward pass instead of kept, so at most one chunk's logits (and their
        fp32 copy and gradients) are alive, never all [M, V]."""
        # The head draws no random numbers, so there is no RNG state to save for the recompute.
        sums = [checkpoint(self._mlm_sums, x_, y, use_reentrant=False, preserve_rng_state=False)
                for x_, y in zip(x.split(chunk), labels.split(chunk), strict=True)]
        loss, correct = zip(*sums, strict=True)
        return torch.stack(loss).sum(), torch.stack(correct).sum()

    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        token_type_ids: Tensor | None,  # [B, T]
        attention_mask: Tensor | None,  # [B, T]
        masked_lm_positions: Tensor,  # [B, P], 0-padded
        masked_lm_ids: Tensor,  # [B, P]
        masked_lm_weights: Tensor,  # [B, P], 1 = real prediction, 0 = padding
        next_sentence_label: Tensor | None = None,  # [B], 0 = IsNext, 1 = random; -1 = no NSP
        *,
        padded: bool | None = None,  # the rest: pretraining_plan(...) computed by the loader
        token_index: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        output_rows: Tensor | None = None,
        mlm_labels: Tensor | None = None,
    ) -> dict[str, Tensor]:
        if output_rows is None:
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            plan = pretraining_plan(mask, masked_lm_positions, masked_lm_ids, masked_lm_weights)
        else:
            plan = {"padded": padded, "token_index": token_index, "cu_seqlens": cu_seqlens,
                    "output_rows": output_rows, "mlm_labels": mlm_labels}
        # The MLM head sees only the real masked positions, never all B x T, and the encoder's
        # last layer computes only those rows (and [CLS]) after its attention.
        out = self.bert(input_ids, token_type_ids, attention_mask, plan=plan)
        picked = out.last_hidden_state  # [M, H]
        labels = plan["mlm_labels"]  # [M]
        # Sums over the real predictions divided by their count: no branch on the labels, a
        # batch without predictions still touches the graph, and IGNORE rows count for nothing.
        count = (labels != IGNORE).sum().clamp(min=1)
        # The transform runs once over all rows ([M, H]: small beside [M, V]), outside the chunks
        # (torch.compile with dynamic shapes fails on LayerNorm's eps read in sibling checkpoints).
        x = self.cls.predictions.transform(picked)  # [M, H]
        if self.mlm_loss_chunk:
            mlm_sum, correct = self.chunked_mlm_sums(x, labels, self.mlm_loss_chunk)
        else:
            mlm_sum, correct = self._mlm_sums(x, labels)
        mlm_loss = mlm_sum / count
        mlm_acc = correct / count

        nsp_loss = nsp_acc = mlm_loss.new_zeros(())
        if next_sentence_label is not None:
            # Sums over the rows with a label (-1 = none), divided by their count: no branch on
            # the labels' values, and a batch without NSP rows still touches the head (ZeRO
            # expects every parameter to get a gradient).
            nsp_logits = self.cls.seq_relationship(out.pooler_output)  # [B, 2]
            nsp_label = next_sentence_label.view(-1).long()  # [B]
            has_nsp = nsp_label >= 0
            count = has_nsp.sum().clamp(min=1)
            nsp_loss = F.cross_entropy(nsp_logits.float(), nsp_label, ignore_index=-1, reduction="sum") / count
            nsp_acc = ((nsp_logits.argmax(-1) == nsp_label) & has_nsp).sum() / count
        return {
            "loss": mlm_loss + nsp_loss,
            "mlm_loss": mlm_loss.detach(),
            "nsp_loss": nsp_loss.detach(),
            "mlm_acc": mlm_acc.detach(),
            "nsp_acc": nsp_acc.detach(),
        }


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig, seq_len: int, masked_fraction: float = 0.15) -> float:
    """Training FLOPs per token (forward + backward = 3x forward) of BertForPreTraining, for MFU.

    Matmuls only: per layer 4H^2 (q,k,v,o) + 2*H*I (FFN) + 2*T*H (scores and weighted sum),
    x2 FLOPs per multiply-add; the MLM head (H^2 + H*V) at the masked fraction of tokens.
    """
    H, ffn, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    V = cfg.vocab_size or 0
    per_layer = 4 * H * H + 2 * H * ffn + 2 * seq_len * H
    head = masked_fraction * (H * H + H * V)
    return 3 * 2 * (L * per_layer + head)


__all__ = [
    "BertForPreTraining",
    "BertModel",
    "BertOutput",
    "flops_per_token",
    "init_weights",
    "num_parameters",
    "padding_mask",
    "pretraining_plan",
    "unpadding_plan",
]
